"""The two Hessian helpers of the engine: the reverse-mode gradient a Hessian differentiates
(vectorised, see NOTE [the gradient inside a Hessian]), and the plain-autograd Hessian for
functions torch.func refuses to transform."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from torch_vjp._engine.blocks import assemble
from torch_vjp._engine.jacobian import function_key, jacobian_blocks
from torch_vjp._engine.refusals import mutates_captured
from torch_vjp._engine.problem import Problem
from torch_vjp._errors import JacobianCallError, JacobianWarning, quote_error, warn_once

__all__ = ["hessian_gradient", "autograd_hessian"]


def hessian_gradient(
    f: Callable[..., Any],
    args: tuple[Any, ...],
    argnums: int | tuple[int, ...],
    vectorized: bool,
    fallback: bool,
    call: str,
) -> Any:
    """The reverse-mode Jacobian of ``f`` at ``args`` (the inner half of :func:`torch_vjp.hessian`).

    NOTE [the gradient inside a Hessian]
    torch.func.hessian is jacfwd(jacrev(f)), and jacrev runs its pullback under vmap even for
    a single output element. Under vmap torch decomposes backward kernels that have no
    batching rule into differentiable operations (huber_loss_backward, layer_norm's backward
    without a weight), and the outer Jacobian then differentiates those; called without vmap,
    the kernel itself is differentiated, and some have no forward-mode formula (or a double
    backward that fails). So the gradient here is vectorised for one element too
    (``vmap_single``); where vmap cannot batch f, "auto" still falls back to the plain call.
    """
    prob = Problem(f, args, argnums, has_aux=False, call=call, aux=False)
    res = jacobian_blocks(
        prob, "rev", vectorized=vectorized, fallback=fallback, chunk_size=None, max_memory=None,
        vmap_single=True,
    )
    return assemble(prob, res)


def autograd_hessian(
    f: Callable[..., Any], primals: tuple[Any, ...], argnums: int | tuple[int, ...],
    create_graph: bool, call: str, refusal: BaseException,
) -> Any:
    """The Hessian with plain autograd (``torch.autograd.functional.jacobian`` of the
    gradient, one backward pass per row), with a one-time warning: for functions torch.func
    cannot transform (``refusal`` is what it raised: a captured tensor changed in place, a
    custom Function without setup_context, NumPy calls). ``f`` must return one tensor and
    the differentiated primals must be tensors; the result has :func:`torch_vjp.hessian`'s
    structure (one tensor for an int ``argnums``, a tuple of tuples for a tuple)."""
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
    if not all(isinstance(primals[n], Tensor) for n in nums):
        raise JacobianCallError(
            f"{call}: {why}, and the plain autograd fallback takes tensor primals only. "
            f"Fix: pass the differentiated primals as tensors. {keep}"
        )

    def f_sel(*xs: Tensor) -> Tensor:
        args = list(primals)
        for n, x in zip(nums, xs):
            args[n] = x.clone()  # (f may write into its input: NOTE [f writes into its input])
        out = f(*args)
        if not isinstance(out, Tensor):
            raise JacobianCallError(
                f"{call}: {why}, and the plain autograd fallback takes an f that returns one "
                f"tensor, not a {type(out).__name__}. Fix: return one tensor. {keep}"
            )
        return out

    xs = tuple(primals[n].detach() for n in nums)

    def gradient(*ys: Tensor) -> Any:
        jac = torch.autograd.functional.jacobian(f_sel, ys, create_graph=True)
        return jac if len(ys) > 1 else jac[0]

    with torch.enable_grad():
        h = torch.autograd.functional.jacobian(gradient, xs, create_graph=create_graph)
    # (warned once it worked: an error of f's own comes out of the call above alone)
    warn_once(
        ("hessian-autograd", call, function_key(f)),
        f"{call}: {why}, so the Hessian was computed with plain autograd, one backward pass "
        f"per row: usually many times slower (buffers a forward changes are put back "
        f"afterwards). {keep} This warning is shown once per function.",
        JacobianWarning,
    )
    if isinstance(argnums, int):
        return h[0]
    return tuple(tuple(row) for row in h)
