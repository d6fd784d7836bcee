"""The two Hessian helpers of the engine: the reverse-mode gradient a Hessian differentiates
(vectorised, see NOTE [the gradient inside a Hessian]), and the plain-autograd Hessian for
functions torch.func refuses to transform."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from torch_vjp._engine.blocks import assemble
from torch_vjp._engine.copies import normal_tensors
from torch_vjp._engine.graph import graph_nodes
from torch_vjp._engine.jacobian import function_key, function_name, jacobian_blocks
from torch_vjp._engine.refusals import (double_backward_refusal, mutates_captured,
                                        no_double_backward_fix, unbatched_op)
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.rows import passes_through
from torch_vjp._engine.wrongops import wrong_alone, wrong_hessian, wrong_ops
from torch_vjp._errors import (JacobianCallError, JacobianWarning, StrategyError,
                               StrategyNotImplementedError, quote_error, warn_once)

__all__ = ["hessian_gradient", "autograd_hessian", "no_double_backward", "raise_no_double_backward",
           "refused_by_loop", "single_batched_wrongly"]


def refused_by_loop(err: BaseException, loop: Callable[[], Any]) -> Exception | None:
    """Where ``err`` is a vectorised Hessian's refusal for want of a batching rule of an
    operator whose backward torch computes wrongly (``torch.as_strided_scatter``), whose fix
    names the loop strategy: the loop's own refusal (NOTE [a Hessian through a wrong
    backward]), which ``loop()`` raises where f differentiates through that backward (the
    loop's Hessian would be wrong, and a fix that names it would not work); None otherwise.
    """
    inner = err.__context__  # (the refusal was raised from torch's error, "from None")
    if not isinstance(err, StrategyError) or inner is None or passes_through(inner):
        return None
    op = unbatched_op(inner)
    if op is None or not wrong_alone(op):
        return None
    try:
        loop()
    except JacobianCallError as refused:
        return refused
    except Exception:  # noqa: BLE001 - the loop fails otherwise: the vectorised refusal stands
        return None
    return None


def raise_no_double_backward(
    f: Callable[..., Any], strategy: str, err: BaseException, call: str,
) -> None:
    """Raises :func:`no_double_backward`'s refusal of ``err`` (from None: it says what
    failed and the fix) where there is one; returns otherwise (an error no fallback may
    hide, or one of f's own, is the caller's to raise)."""
    refused = None if passes_through(err) else no_double_backward(f, strategy, err, call)
    if refused is not None:
        raise refused from None


def no_double_backward(
    f: Callable[..., Any], strategy: str, err: BaseException, call: str,
) -> StrategyNotImplementedError | None:
    """The error of a Hessian whose reverse over reverse needs a derivative of a backward
    kernel that torch has none for (``err``: autograd's "derivative for aten::X_backward is
    not implemented", the fused attention kernels on the CPU; "the derivative for
    'X_backward' is not implemented", torch.cdist's, torch.nn.functional.embedding_bag's), or
    None for any other error (f's own passes through untouched)."""
    op = double_backward_refusal(err)
    if op is None:
        return None
    fix = no_double_backward_fix(op)
    if fix is None:
        fix = ("write that operation with differentiable torch operations (or as a custom "
               "autograd.Function whose backward is made of them)")
    how = (f"strategy='{strategy}' computes reverse over reverse" if strategy.startswith("rev")
           else f"strategy='{strategy}' turns to reverse over reverse where forward over "
           f"reverse cannot run f")
    return StrategyNotImplementedError(
        f"{call}: f ({function_name(f)}) uses torch's aten::{op}, whose backward kernel "
        f"(aten::{op}_backward) has no derivative formula in torch; a Hessian differentiates "
        f"f's gradient, which takes that derivative where the gradient is differentiated "
        f"with reverse mode "
        f"({how}).\n  torch said: {quote_error(err)}\n  Fix: {fix}."
    )


def hessian_gradient(
    f: Callable[..., Any],
    args: tuple[Any, ...],
    argnums: int | tuple[int, ...],
    vectorized: bool,
    fallback: bool,
    call: str,
    strategy: str = "auto",
) -> Any:
    """The reverse-mode Jacobian of ``f`` at ``args`` (the inner half of :func:`torch_vjp.hessian`,
    asked for with ``strategy``).

    NOTE [the gradient inside a Hessian]
    torch.func.hessian is jacfwd(jacrev(f)), and jacrev runs its pullback under vmap even for
    a single output element. Under vmap torch decomposes backward kernels that have no
    batching rule into differentiable operations (huber_loss_backward, layer_norm's backward
    without a weight), and the outer Jacobian then differentiates those; called without vmap,
    the kernel itself is differentiated, and some have no forward-mode formula (or a double
    backward that fails). So the gradient here is vectorised for one element too
    (``vmap_single``); where vmap cannot batch f, "auto" still falls back to the plain call.

    NOTE [a single product batched wrongly]
    That one product under vmap is itself wrong, differentiated, where f's graph holds
    layer_norm's or batch_norm's backward with a weight that requires grad
    (:data:`_SINGLE_BATCHED_WRONGLY`): torch.func.hessian (jacfwd(jacrev(f))) and
    jacrev(jacrev(f)) of ``(layer_norm(x * p[:4], (4,), p[4:]) ** 3).sum()`` were off by 13.6
    at a scale of 50.3 (float64, torch 2.13), and every vectorised strategy with them, while
    jacfwd(grad(f)) and jacrev(grad(f)), whose gradient runs without vmap, were right (as
    are the loops), and so were group_norm, rms_norm, and layer_norm and batch_norm with a
    fixed weight or none. The outer Jacobian's vmap is right: only the gradient's single
    product leaves vmap there, and the strategy keeps its mode and its vectorised outer
    products, so nothing is slower to warn about. The products' own call of f reads its
    graph (a walk of its nodes); where it holds such a node, the gradient is computed
    again, its one product without vmap (one call of f more, there only).
    """
    prob = Problem(f, args, argnums, has_aux=False, call=call, aux=False)
    found: list[str | None] = []
    call_f = prob.g_inner

    def read(*xs: Tensor) -> Any:  # (NOTE [a single product batched wrongly])
        res = call_f(*xs)
        if not found:
            found.append(single_batched_wrongly(
                [o for o in tree_leaves(res) if isinstance(o, Tensor)]))
        return res

    prob.g_inner = read  # type: ignore[method-assign]
    res = jacobian_blocks(
        prob, "rev", vectorized=vectorized, fallback=fallback, chunk_size=None, max_memory=None,
        vmap_single=True, hessian=strategy,
    )
    if vectorized and found and found[0] is not None:
        prob.g_inner = call_f  # type: ignore[method-assign]
        res = jacobian_blocks(
            prob, "rev", vectorized=vectorized, fallback=fallback, chunk_size=None,
            max_memory=None, vmap_single=False, hessian=strategy,
        )
    return assemble(prob, res)


#: Backward nodes whose single product under vmap is differentiated wrongly where their
#: weight (second input) requires grad (NOTE [a single product batched wrongly]).
_SINGLE_BATCHED_WRONGLY = {"NativeLayerNormBackward0": "torch.nn.functional.layer_norm",
                           "NativeBatchNormBackward0": "torch.nn.functional.batch_norm"}


def single_batched_wrongly(outs: list[Tensor]) -> str | None:
    """The op of :data:`_SINGLE_BATCHED_WRONGLY` whose node in the graph of ``outs`` has a
    weight that requires grad (NOTE [a single product batched wrongly]); None where none."""
    for node in graph_nodes(outs):
        op = _SINGLE_BATCHED_WRONGLY.get(type(node).__name__)
        if op is not None and len(node.next_functions) > 1 \
                and node.next_functions[1][0] is not None:
            return op
    return None


def autograd_hessian(
    f: Callable[..., Any], primals: tuple[Any, ...], argnums: int | tuple[int, ...],
    create_graph: bool, call: str, refusal: BaseException, strategy: str = "auto",
) -> Any:
    """The Hessian with plain autograd (``torch.autograd.functional.jacobian`` of the
    gradient, one backward pass per row), with a one-time warning: for functions torch.func
    cannot transform (``refusal`` is what it raised: a captured tensor changed in place, a
    custom Function without setup_context, NumPy calls). The differentiated primals and
    ``f``'s output may be pytrees of tensors; the result has :func:`torch_vjp.hessian`'s
    structure, ``torch.func.hessian``'s: the output's structure, each leaf holding the
    structure of the differentiated primals (a tuple of them for a tuple ``argnums``) twice
    nested, of blocks ``out.shape + x_i.shape + x_j.shape``. ``strategy``: the one the
    Hessian was asked for, named where f's graph holds a wrong backward formula (NOTE [a
    Hessian through a wrong backward] in :mod:`torch_vjp._engine.wrongops`)."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    nums = tuple(n % len(primals) for n in nums)
    if mutates_captured(refusal):
        why = ("f changes a tensor it captured in place (a module in training mode updating "
               "its buffers)")
        keep = "Put the module in eval mode to keep the vectorised path."
    else:
        why = f"torch.func cannot run f ({quote_error(refusal)})"
        keep = ("A custom autograd.Function with setup_context (and vmap support), and torch "
                "operations in place of NumPy, keep the vectorised path.")
    flat = [tree_flatten(primals[n]) for n in nums]
    if not all(isinstance(t, Tensor) for leaves, _ in flat for t in leaves):
        raise JacobianCallError(
            f"{call}: {why}, and the plain autograd fallback takes primals whose leaves are "
            f"all tensors. Fix: pass the differentiated primals as tensors (or tuples, "
            f"lists and dicts of them). {keep}"
        )
    sizes = [len(leaves) for leaves, _ in flat]
    n_leaves = sum(sizes)
    out_spec: list[Any] = []

    def f_sel(*xs: Tensor) -> tuple[Tensor, ...]:
        args = list(primals)
        start = 0
        for n, (_, spec), size in zip(nums, flat, sizes):
            # (f may write into its input: NOTE [f writes into its input])
            args[n] = tree_unflatten([x.clone() for x in xs[start:start + size]], spec)
            start += size
        outs, spec = tree_flatten(f(*args))
        bad = next((o for o in outs if not (isinstance(o, Tensor)
                                            and o.dtype.is_floating_point)), None)
        if not outs or bad is not None:
            got = ("no tensor" if not outs else f"a tensor of dtype {bad.dtype}"
                   if isinstance(bad, Tensor) else f"a value of type {type(bad).__name__}")
            raise JacobianCallError(
                f"{call}: {why}, and the plain autograd fallback takes an f that returns "
                f"floating-point tensors (one, or a tuple, list or dict of them), but f "
                f"returned {got}. Fix: return only the differentiable results, as floating-"
                f"point tensors. {keep}"
            )
        alone = wrong_ops(outs)[1]  # NOTE [a Hessian through a wrong backward]
        if alone is not None:
            raise wrong_hessian(call, alone, function_name(f), strategy)
        out_spec[:] = [spec]
        return tuple(outs)

    # (with create_graph, the primals themselves: autograd.functional.jacobian keeps the
    # history of one that requires grad, so that the Hessian is differentiable with respect
    # to it, as the other routes' is)
    # (and outside torch.inference_mode, where no graph is recorded: NOTE [plain autograd in
    # inference mode] in plain.py; an inference tensor is copied out of it to be a primal)
    with normal_tensors():
        xs = tuple(t.clone() if t.is_inference() else t if create_graph else t.detach()
                   for leaves, _ in flat for t in leaves)

    def gradient(*ys: Tensor) -> tuple[Tensor, ...]:
        jac = torch.autograd.functional.jacobian(f_sel, ys, create_graph=True)
        return tuple(block for row in jac for block in row)  # (output i, leaf j) at i*L + j

    with torch.enable_grad(), normal_tensors():
        h = torch.autograd.functional.jacobian(gradient, xs, create_graph=create_graph)
    # (warned once it worked: an error of f's own comes out of the call above alone)
    warn_once(
        ("hessian-autograd", call, function_key(f)),
        f"{call}: {why}, so the Hessian was computed with plain autograd, one backward pass "
        f"per row: usually many times slower (buffers a forward changes are put back "
        f"afterwards). {keep} This warning is shown once per function.",
        JacobianWarning,
    )

    def by_primal(block: Callable[[int], Any]) -> Any:
        """The structure of the differentiated primals, leaf ``l`` (counted over all of
        them) holding ``block(l)``."""
        parts, start = [], 0
        for (_, spec), size in zip(flat, sizes):
            parts.append(tree_unflatten([block(start + k) for k in range(size)], spec))
            start += size
        return parts[0] if isinstance(argnums, int) else tuple(parts)

    n_out = out_spec[0].num_leaves
    return tree_unflatten(
        [by_primal(lambda j, i=i: by_primal(lambda k, j=j: h[i * n_leaves + j][k]))
         for i in range(n_out)],
        out_spec[0],
    )
