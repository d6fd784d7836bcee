"""The loop strategies with plain autograd, for functions torch.func cannot run at all.

A custom ``autograd.Function`` without ``setup_context``, or NumPy calls inside ``f``, make
torch.func's ``vjp``/``jvp`` fail even without vmap. Plain autograd still works there: one
``torch.autograd.grad`` per output element (reverse mode), or one forward pass with
``torch.autograd.forward_ad`` dual tensors per input element (forward mode). These do not
compose with outer torch.func transforms, so the engine uses them at top level only (see
NOTE [auto fallback] in :mod:`torch_vjp._engine.jacobian`).

NOTE [plain autograd in inference mode]
Under ``torch.inference_mode()`` no operator records a graph or carries a tangent, whatever
``torch.enable_grad()`` says: f's outputs came out without either, and every product was
taken as zeros, silently. torch.func's transforms run there as outside it, so the plain
loops leave the mode for their calls of f, their basis vectors (an inference tensor saved
for backward, or given as a tangent, is refused) and their products, as they enter grad
mode.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from torch_vjp._engine.blocks import Blocks, fwd_blocks, rev_blocks
from torch_vjp._engine.context import FORWARD_AD
from torch_vjp._engine.copies import normal_tensors
from torch_vjp._engine.fwd_wrong import named_read, named_reading
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.refusals import reentrant_checkpoint, reentrant_checkpoint_message
from torch_vjp._engine.rows import basis_rows, loop_draws, map_rows
from torch_vjp._engine.shapes import Opts, Shapes, chunk_for, in_rows, row_shapes
from torch_vjp._engine.wrongops import grad_mode_backward, named_reverse, wrong_ops
from torch_vjp._errors import JacobianCallError

__all__ = ["rev_plain", "fwd_plain", "plain_pullback"]


def _detach_tree(tree: Any) -> Any:
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, tree)


def rev_plain(prob: Problem, opts: Opts,
              instead: Callable[[str], Blocks] | None = None) -> Blocks:
    """Reverse mode with plain autograd, one ``torch.autograd.grad`` per output element
    (under ``torch.no_grad()`` for a detached result: NOTE [no graph outlives its chunk]).
    ``instead(op)``: what is returned where f's graph holds ``op``, an operator whose
    backward formula is wrong alone (NOTE [a plain loop through a wrong backward] in
    :mod:`torch_vjp._engine.wrongops`), in place of the products."""
    with normal_tensors():  # NOTE [plain autograd in inference mode]
        if opts.detached:
            with torch.no_grad():
                return _rev_plain_products(prob, opts, instead)
        return _rev_plain_products(prob, opts, instead)


def _rev_plain_products(prob: Problem, opts: Opts,
                        instead: Callable[[str], Blocks] | None) -> Blocks:
    """Reverse mode with plain autograd, one ``torch.autograd.grad`` per output element.

    No torch.func transform is involved, so functions that torch.func cannot run (a custom
    ``autograd.Function`` without ``setup_context``, NumPy calls) work here. The result is
    differentiable (``create_graph``) when grad mode is on and a primal requires grad.
    """
    need_graph = torch.is_grad_enabled() and any(x.requires_grad for x in prob.leaves)
    fn, flat_out, out_spec, aux, connected = plain_pullback(prob, need_graph)
    out_rows = row_shapes(flat_out, opts.batch, prob, out_spec)
    n = sum(math.prod(s) for s in out_rows)
    chunk = chunk_for(prob, "rev", out_rows, [o.dtype for o in flat_out], opts)
    if opts.named is not None:  # NOTE [named reverse strategies and wrong formulas]
        named_reverse(prob.call, wrong_ops(flat_out), False, chunk, opts.named)
    elif instead is not None:  # NOTE [a plain loop through a wrong backward]
        alone = wrong_ops(flat_out)[1]
        if alone is not None:
            return instead(alone)
    if n == 0:
        stacked = [x.new_zeros((0, *x.shape)) for x in prob.leaves]
    else:
        rows = basis_rows(
            out_rows, [o.dtype for o in flat_out], [o.device for o in flat_out], opts.batch
        )
        stacked, _ = map_rows(fn, rows, n, vectorized=False, chunk_size=chunk)
    blocks, views = rev_blocks(stacked, out_rows, opts.batch)
    return Blocks(blocks, out_spec, aux, "rev", views, connected)


def plain_pullback(
    prob: Problem, need_graph: bool = False
) -> tuple[Callable[..., tuple[Tensor, ...]], list[Tensor], Any, Any, bool]:
    """f called once with plain autograd: ``(fn, flat outputs, their structure, aux,
    connected)``, ``fn(*cotangents)`` one ``torch.autograd.grad`` (the graph kept), a gradient
    per leaf, zeros where unused; ``connected``: every output depends on the leaves. With
    ``need_graph``, the leaves keep the primals' history and the gradients are
    differentiable (``create_graph``); otherwise aux is detached. The one sharded Jacobians
    use too, each rank for its own rows."""
    with torch.enable_grad(), normal_tensors():  # NOTE [plain autograd in inference mode]
        # (a leaf with no history of its own, one that does not require grad beside one that
        # does, becomes a leaf that requires grad: autograd.grad refuses any other)
        xs = [x.view_as(x) if need_graph and x.requires_grad else x.detach().requires_grad_()
              for x in prob.leaves]
        res = prob.g(*xs)
    out = res[0] if prob.has_aux else res
    aux = None
    if prob.has_aux:
        aux = res[1] if need_graph else _detach_tree(res[1])
    flat_out, out_spec = tree_flatten(out)
    diff = [j for j, o in enumerate(flat_out) if o.requires_grad]
    d_outs = [flat_out[j] for j in diff]
    # (a backward right only in grad mode runs in it, detached after: NOTE [a backward right
    # only in grad mode] in torch_vjp._engine.wrongops)
    in_grad_mode = not need_graph and grad_mode_backward(d_outs) is not None

    def fn(*cot: Tensor) -> tuple[Tensor, ...]:
        if not d_outs:
            return tuple(torch.zeros_like(x) for x in xs)
        with normal_tensors(), torch.enable_grad() if in_grad_mode else nullcontext():
            try:
                grads = torch.autograd.grad(
                    d_outs, xs, [cot[j] for j in diff], retain_graph=True,
                    create_graph=need_graph or in_grad_mode, allow_unused=True,
                )
            except RuntimeError as err:
                if reentrant_checkpoint(err):  # (torch's words blame .grad(), not f)
                    raise JacobianCallError(reentrant_checkpoint_message(prob.call)) from None
                raise
        if in_grad_mode:
            grads = tuple(None if gx is None else gx.detach() for gx in grads)
        return tuple(torch.zeros_like(x) if gx is None else gx for gx, x in zip(grads, xs))

    return fn, flat_out, out_spec, aux, len(diff) == len(flat_out)


def plain_push(prob: Problem, check: Callable[[list[Tensor], Any], None], n: int
               ) -> tuple[Callable[..., Any], list[bool]]:
    """``(fn, connected)``: ``fn(*tangents)`` one forward pass of f with dual tensors (plain
    forward-mode AD, ``torch.autograd.forward_ad``), the tangents of its flat outputs (and
    aux, with ``has_aux``); ``connected[0]`` turns False where an output has no tangent.
    ``check(flat, spec)`` sees each call's outputs (a structure that changed between calls
    raises); ``n``: the calls the loop makes, which draw what one call of f draws. The one sharded
    Jacobians use too, each rank for its own columns."""
    leaves = prob.leaves
    has_aux = prob.has_aux

    def primal(t: Any) -> Any:
        return fwAD.unpack_dual(t).primal if isinstance(t, Tensor) else t

    connected = [True]
    # (one call of f per column: one set of random draws, of f's own generators too)
    same_draws = loop_draws(prob, n)

    def fn(*tangents: Tensor) -> Any:
        same_draws()
        # (NOTE [plain autograd in inference mode]; NOTE [forward mode, one thread at a time])
        with FORWARD_AD, normal_tensors(), fwAD.dual_level():
            duals = [fwAD.make_dual(x, t) for x, t in zip(leaves, tangents)]
            res = prob.g(*duals)
            out = res[0] if has_aux else res
            flat, spec = tree_flatten(out)
            check(flat, spec)
            tans = []
            for o in flat:
                p, t = fwAD.unpack_dual(o)
                if t is None:
                    connected[0] = False
                    t = torch.zeros_like(p)
                tans.append(t)
            aux = tree_map(primal, res[1]) if has_aux else None
        return (tuple(tans), aux) if has_aux else tuple(tans)

    return fn, connected


def fwd_plain(prob: Problem, shapes: Shapes, opts: Opts) -> Blocks:
    """Forward mode with plain forward-mode AD (``torch.autograd.forward_ad``), one
    forward pass with dual tensors per input element."""
    # (a named strategy: f's calls read on the first call per signature, NOTE [forward mode
    # through a wrong formula])
    reading = named_reading(prob, opts, "fwd-loop")
    if reading is None:
        with normal_tensors():  # NOTE [plain autograd in inference mode]
            return _fwd_plain_products(prob, shapes, opts)
    with normal_tensors(), reading[1]:
        res = _fwd_plain_products(prob, shapes, opts)
    named_read(prob, opts, reading, "fwd-loop")
    return res


def _fwd_plain_products(prob: Problem, shapes: Shapes, opts: Opts) -> Blocks:
    leaves = prob.leaves
    rows_in = in_rows(prob, opts.batch)
    n = sum(math.prod(s) for s in rows_in)
    chunk = chunk_for(prob, "fwd", shapes.rows, [o.dtype for o in shapes.flat], opts,
                      shapes.records)
    has_aux = prob.has_aux
    fn, connected = plain_push(prob, shapes.check, n)
    aux = None
    if n == 0:
        stacked = [o.new_zeros((0, *o.shape), device=leaves[0].device) for o in shapes.flat]
        if has_aux:
            with torch.no_grad():
                aux = prob.g(*leaves)[1]
    else:
        rows = basis_rows(
            rows_in, [x.dtype for x in leaves], [x.device for x in leaves], opts.batch
        )
        stacked, aux = map_rows(fn, rows, n, vectorized=False, chunk_size=chunk, extras=has_aux,
                                detach=opts.detached)
    blocks, views = fwd_blocks(stacked, rows_in)
    return Blocks(blocks, shapes.spec, aux, "fwd", views, connected[0] and n > 0)
