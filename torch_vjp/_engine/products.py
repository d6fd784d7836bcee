"""The products of a Jacobian with torch.func: reverse mode (one ``vjp`` forward, then its
pullback per output element) and forward mode (``jvp`` per input element), each under vmap
or in a loop, assembled into :class:`~torch_vjp._engine.blocks.Blocks`. The strategy
engine that chooses among them is :mod:`torch_vjp._engine.jacobian`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor
from torch.func import vmap
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from torch_vjp._engine.blocks import Blocks, fwd_blocks, rev_blocks
from torch_vjp._engine.context import func_jvp, func_vjp, is_nested, vjp_with_argnums
from torch_vjp._engine.fwd_wrong import named_read, named_reading
from torch_vjp._engine.gradmode import in_grad_mode
from torch_vjp._engine.problem import LEAF_SPEC, Problem
from torch_vjp._engine.rows import (
    basis_rows,
    eye_basis,
    map_rows,
    loop_draws,
    passes_through,
)
from torch_vjp._engine.shapes import Opts, Shapes, chunk_for, in_rows, row_shapes
from torch_vjp._engine.wrongops import (grad_mode_backward, named_reverse, wrong_hessian,
                                        wrong_ops)

__all__: list[str] = []


def _rev(prob: Problem, opts: Opts, *, vectorized: bool) -> Blocks:
    """Reverse mode with torch.func: one ``vjp`` forward, then its pullback per output
    element, under vmap or in a loop (under ``torch.no_grad()`` for a detached result: NOTE
    [no graph outlives its chunk])."""
    if opts.detached:
        with torch.no_grad():
            return _rev_products(prob, opts, vectorized=vectorized)
    return _rev_products(prob, opts, vectorized=vectorized)


def _rev_products(prob: Problem, opts: Opts, *, vectorized: bool) -> Blocks:
    connected = [False]
    has_aux = prob.has_aux
    prob_g = prob.g_inner  # NOTE [non-differentiated primals]

    # (inside an outer transform too, a Hessian's gradient excepted, which reads it for its
    # own refusal: NOTE [named reverse strategies and wrong formulas], NOTE [a Hessian
    # through a wrong backward])
    named = None if is_nested() and opts.vmap_single else opts.named
    found: list[tuple[str | None, str | None]] = []
    # (a pullback run without grad mode: where f's graph holds a node whose backward is right
    # only in grad mode, it runs in grad mode: NOTE [a backward right only in grad mode])
    no_grad_pullback = not torch.is_grad_enabled() and not is_nested()
    grad_mode: list[str | None] = [None]

    def g(*xs: Tensor) -> Any:
        res = prob_g(*xs)
        out = res[0] if has_aux else res
        if isinstance(out, Tensor):
            connected[0] = out.requires_grad
        else:
            connected[0] = all(o.requires_grad for o in tree_leaves(out))
        outs = [out] if isinstance(out, Tensor) else [
            o for o in tree_leaves(out) if isinstance(o, Tensor)]
        if named is not None or opts.hessian is not None or opts.remembered:  # NOTE [named
            # strategies and wrong formulas], NOTE [a Hessian through a wrong backward]
            # (the same walk reads a backward right only in grad mode)
            found.append(wrong_ops(outs, grad_mode=grad_mode if no_grad_pullback else None))
        elif no_grad_pullback:
            grad_mode[0] = grad_mode_backward(outs)
        return res

    leaves = prob.leaves
    nested = is_nested()
    one_leaf = len(leaves) == 1 and vjp_with_argnums is not None
    if one_leaf:  # the pullback returns a tensor
        res = vjp_with_argnums(g, leaves[0], argnums=0, has_aux=has_aux)
    else:  # the pullback returns a tuple, one tensor per leaf
        res = func_vjp(g, *leaves, has_aux=has_aux)
    out, pullback = res[0], res[1]
    if nested:
        # Differentiated by an outer transform (a Hessian's forward-over-reverse): the
        # backward pass must itself be differentiable. torch.func's pullback decides by the
        # grad mode, which graph_mode turns off at top level; and forward mode over a
        # pullback run without create_graph is silently wrong for some operators (logdet).
        pullback = functools.partial(pullback, create_graph=True)
    elif grad_mode[0] is not None:
        pullback = functools.partial(in_grad_mode, pullback)  # (NOTE [a backward right
        # only in grad mode]: the graph of its backward pass lives for the call only)
    aux = res[2] if has_aux else None
    if isinstance(out, Tensor):
        flat_out, out_spec = [out], LEAF_SPEC
    else:
        flat_out, out_spec = tree_flatten(out)
    out_rows = row_shapes(flat_out, opts.batch, prob, out_spec)
    n = sum(math.prod(s) for s in out_rows)
    out_dtypes = [o.dtype for o in flat_out]
    chunk = chunk_for(prob, "rev", out_rows, out_dtypes, opts)
    if found and opts.hessian is not None and found[0][1] is not None:
        raise wrong_hessian(prob.call, found[0][1], *opts.hessian)
    if found and named is not None:
        vectorized = named_reverse(prob.call, found[0], vectorized, chunk, named)
    if found and opts.remembered is not None:  # NOTE [a remembered route through a known
        batching = found[0][0] if vectorized and chunk != 1 else None  # wrong operator]
        opts.remembered[1].append((batching, found[0][1]))
    if n == 0:
        stacked = [leaf.new_zeros((0, *leaf.shape)) for leaf in leaves]
    else:
        if out_spec.is_leaf():
            fn = pullback
        else:

            def fn(*cot: Tensor) -> Any:
                return pullback(tree_unflatten(list(cot), out_spec))

        if vectorized and chunk is None and (n > 1 or opts.vmap_single):
            # NOTE [per-call overhead]
            vecs = _all_rows(out_rows, out_dtypes, [o.device for o in flat_out], n, opts.batch)
            products = vmap(fn)(*vecs) if n > 1 else _single_product(fn, vecs)
            stacked = [products] if one_leaf else list(products)
        else:
            if one_leaf:
                pb = fn

                def fn(*cot: Tensor) -> Any:
                    return (pb(*cot),)

            rows = basis_rows(out_rows, out_dtypes, [o.device for o in flat_out], opts.batch)
            stacked, _ = map_rows(fn, rows, n, vectorized=vectorized, chunk_size=chunk)
    blocks, views = rev_blocks(stacked, out_rows, opts.batch)
    return Blocks(blocks, out_spec, aux, "rev", views, connected[0])


def _single_product(fn: Callable[..., Any], vecs: tuple[Tensor, ...]) -> Any:
    """One product under vmap (``vmap_single``: NOTE [the gradient inside a Hessian] in :mod:`torch_vjp._engine.hessian`), or, if
    vmap cannot batch it, the plain call: for one product that costs nothing more, so there
    is nothing to warn about, and an error of the plain call is f's own and propagates."""
    try:
        return vmap(fn)(*vecs)
    except Exception as err:  # noqa: BLE001 - classified by the plain call below
        if passes_through(err):
            raise
    res = fn(*[v[0] for v in vecs])
    if isinstance(res, Tensor):
        return res.unsqueeze(0)
    return tuple(r.unsqueeze(0) for r in res)


def _all_rows(
    shapes: Sequence[torch.Size],
    dtypes: Sequence[torch.dtype],
    devices: Sequence[torch.device],
    n: int,
    batch: int | None,
) -> tuple[Tensor, ...]:
    """The whole basis at once (NOTE [per-call overhead]): one ``torch.eye`` for one tensor,
    else :func:`basis_rows` (materialised over a batch)."""
    if len(shapes) == 1:
        return (eye_basis(shapes[0], n, dtypes[0], devices[0], batch),)
    vecs = basis_rows(shapes, dtypes, devices, batch)(0, n)
    if batch is not None:
        vecs = tuple(v.contiguous() for v in vecs)
    return vecs


def _fwd(prob: Problem, shapes: Shapes, opts: Opts, *, vectorized: bool) -> Blocks:
    """Forward mode with torch.func: ``jvp`` per input element, under vmap or in a loop.

    NOTE [forward mode of a function that draws]
    Reverse mode calls ``f`` once, so a function that draws random numbers (dropout in
    training mode) has one Jacobian: that of the draw it made. Forward mode calls ``f`` once
    per chunk of columns, and every column must see that one draw too, else the columns
    belong to different functions and the Jacobian is of none of them. So the columns'
    vmap runs with ``randomness="same"`` (what ``torch.func.jacfwd(randomness="same")``
    does: a draw shared by the batch, where vmap's default refuses the function), and
    the generators are put back before every later chunk or loop column
    (:class:`~torch_vjp._engine.rows.SameDraws`), so that chunks, columns and reverse mode
    all see the numbers one call of ``f`` draws. ``randomness="different"`` would give
    each column its own draw: no Jacobian at all.
    """
    # (a named strategy: f's calls read on the first call per signature, NOTE [forward
    # mode through a wrong formula])
    reading = named_reading(prob, opts, "fwd" if vectorized else "fwd-loop")
    leaves = tuple(prob.leaves)
    rows_in = in_rows(prob, opts.batch)
    n = sum(math.prod(s) for s in rows_in)
    chunk = chunk_for(prob, "fwd", shapes.rows, [o.dtype for o in shapes.flat], opts,
                      shapes.records)
    has_aux = prob.has_aux
    connected = [False]
    prob_g = prob.g_inner  # NOTE [non-differentiated primals]
    check = shapes.check
    unpack_dual = fwAD.unpack_dual
    # (one call of f per column, where no vmap runs: chunks of one column are plain calls;
    # one per chunk under vmap, where there are several chunks; the generators of f's own
    # too, where there are several columns: NOTE [forward mode of a function that draws])
    one_call = vectorized and (chunk is None or chunk >= n)
    same_draws = None if one_call else loop_draws(prob, n)

    def g(*xs: Tensor) -> Any:
        if same_draws is not None:
            same_draws()
        if reading is not None:
            with reading[1]:
                res = prob_g(*xs)
        else:
            res = prob_g(*xs)
        out = res[0] if has_aux else res
        if isinstance(out, Tensor):
            check((out,), LEAF_SPEC)
            connected[0] = unpack_dual(out).tangent is not None
        else:
            flat, spec = tree_flatten(out)
            check(flat, spec)
            connected[0] = all(unpack_dual(o).tangent is not None for o in flat)
        return res

    aux = None
    dtypes, devices = [x.dtype for x in leaves], [x.device for x in leaves]
    if n == 0:
        if has_aux or shapes.key is not None:
            # (no product calls f: remembered output sizes are checked by this call, the
            # only one, as the products check them; its aux keeps a graph where the
            # result is to have one, as the products' aux does)
            with torch.set_grad_enabled(torch.is_grad_enabled() and not opts.detached):
                res0 = prob.g(*leaves)
            flat0, spec0 = tree_flatten(res0[0] if has_aux else res0)
            check(flat0, spec0)
            if has_aux:
                aux = res0[1]
        stacked = [o.new_zeros((0, *o.shape), device=leaves[0].device) for o in shapes.flat]
    elif vectorized and chunk is None and n > 1 and not has_aux:  # NOTE [per-call overhead]

        def push(*tangents: Tensor) -> Any:
            tan = func_jvp(g, leaves, tangents)[1]
            return tan if isinstance(tan, Tensor) else tuple(tree_leaves(tan))

        products = vmap(push, randomness="same")(
            *_all_rows(rows_in, dtypes, devices, n, opts.batch))
        stacked = [products] if isinstance(products, Tensor) else list(products)
    else:

        def fn(*tangents: Tensor) -> Any:
            res = func_jvp(g, leaves, tangents, has_aux=has_aux)
            tan = res[1]
            tan_flat = (tan,) if isinstance(tan, Tensor) else tuple(tree_leaves(tan))
            return (tan_flat, res[2]) if has_aux else tan_flat

        rows = basis_rows(rows_in, dtypes, devices, opts.batch)
        stacked, aux = map_rows(
            fn, rows, n, vectorized=vectorized, chunk_size=chunk, extras=has_aux,
            detach=opts.detached, batched_fn=vmap(fn, randomness="same"),
        )
    if reading is not None:
        named_read(prob, opts, reading, "fwd" if vectorized else "fwd-loop")
    if opts.detached:
        stacked = [t.detach() for t in stacked]
    blocks, views = fwd_blocks(stacked, rows_in)
    return Blocks(blocks, shapes.spec, aux, "fwd", views, connected[0])
