"""The plain forms of torch_vjp's calls: the torch.func composition of each call's strategy
(``jacrev``/``jacfwd`` and ``vmap``), which dynamo traces into one graph. ``compile=True``
compiles them, and inside the user's own ``torch.compile`` the public functions return them
directly (see NOTE [compiled Jacobians] in :mod:`torch_vjp._engine.compiled`).

They call torch.func's transforms as this module bound them at import, so that code which
replaces ``torch.func.jacrev`` and the like by wrappers of torch_vjp's (a test harness
swapping them) does not send torch_vjp back into itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.func import jacfwd, jacrev, jvp, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_map

from torch_vjp._strategies import choose_mode

__all__ = [
    "auto_mode", "batch_mode", "plain_jacobian", "plain_batch_jacobian", "plain_hessian",
    "plain_jvp", "plain_vjp",
]


def _numel(tree: Any) -> int:
    return sum(t.numel() for t in tree_flatten(tree)[0] if isinstance(t, Tensor))


def _output(f: Callable[..., Any], args: tuple[Any, ...], has_aux: bool) -> Any:
    with torch.no_grad():
        res = f(*args)
    return res[0] if has_aux else res


def auto_mode(
    f: Callable[..., Any], primals: tuple[Any, ...], argnums: int | tuple[int, ...],
    has_aux: bool,
) -> str:
    """``"rev"`` or ``"fwd"`` for a Jacobian, by the numbers of output and input elements
    (one call of ``f`` for the output sizes)."""
    nums = (argnums,) if isinstance(argnums, int) else argnums
    n_in = sum(_numel(primals[i]) for i in nums)
    return choose_mode(n_in, _numel(_output(f, primals, has_aux)))


def plain_jacobian(
    f: Callable[..., Any], primals: tuple[Any, ...], argnums: int | tuple[int, ...],
    has_aux: bool, mode: str | None, chunk_size: int | None,
) -> Any:
    """``jacrev`` or ``jacfwd`` of ``f`` at ``primals`` (``mode=None``: by size)."""
    if mode is None:
        mode = auto_mode(f, primals, argnums, has_aux)
    if mode == "rev":
        return jacrev(f, argnums, has_aux=has_aux, chunk_size=chunk_size)(*primals)
    return jacfwd(f, argnums, has_aux=has_aux)(*primals)


def batch_mode(f: Callable[[Tensor], Any], x: Tensor) -> str:
    """``"rev"`` or ``"fwd"`` for per-example Jacobians, by the per-row sizes."""
    out = tree_flatten(_output(f, (x,), False))[0]
    n_out = sum(o[0].numel() for o in out if isinstance(o, Tensor) and o.dim()) if len(x) else 0
    return choose_mode(math.prod(x.shape[1:]), n_out)


def plain_batch_jacobian(
    f: Callable[[Tensor], Any], x: Tensor, mode: str | None, chunk_size: int | None
) -> Any:
    """Per-example Jacobians as :func:`torch_vjp.batch_jacobian` defines them: reverse mode
    differentiates the outputs summed over the batch, forward mode pushes each basis vector
    of a row through every row at once."""
    row = tuple(x.shape[1:])
    n_in = math.prod(row)
    if mode is None:
        mode = batch_mode(f, x)
    if mode == "rev":
        jac = jacrev(lambda t: tree_map(lambda o: o.sum(0), f(t)),
                                chunk_size=chunk_size)(x)
        return tree_map(lambda j: j.movedim(j.dim() - x.dim(), 0), jac)
    batch = x.shape[0]
    basis = torch.eye(n_in, dtype=x.dtype, device=x.device).reshape(n_in, 1, *row)
    basis = basis.expand(n_in, batch, *row)

    def push(t: Tensor) -> Any:
        return jvp(f, (x,), (t,))[1]

    cols = vmap(push, chunk_size=chunk_size)(basis)
    return tree_map(lambda c: c.movedim(0, -1).reshape(*c.shape[1:], *row), cols)


def plain_hessian(
    f: Callable[..., Any], primals: tuple[Any, ...], argnums: int | tuple[int, ...],
    mode: str | None,
) -> Any:
    """Forward over reverse (``mode`` ``"fwd"`` or None), or reverse over reverse."""
    outer = jacrev if mode == "rev" else jacfwd
    return outer(jacrev(f, argnums), argnums)(*primals)


def plain_jvp(
    f: Callable[..., Any], primals: tuple[Any, ...], tangents: tuple[Any, ...],
    has_aux: bool, batched: bool, chunk_size: int | None,
) -> tuple[Any, ...]:
    """``torch.func.jvp``; batched, under ``vmap`` over the tangents' leading dimension."""
    if not batched:
        return jvp(f, primals, tangents, has_aux=has_aux)

    def push(t: tuple[Any, ...]) -> tuple[Any, ...]:
        return jvp(f, primals, t, has_aux=has_aux)

    out_dims = (None, 0, None) if has_aux else (None, 0)
    return vmap(push, out_dims=out_dims, chunk_size=chunk_size)(tangents)


def plain_vjp(
    f: Callable[..., Any], primals: tuple[Any, ...], cotangents: Any, has_aux: bool,
    batched: bool, chunk_size: int | None,
) -> Any:
    """The pullback of ``f`` at ``primals`` applied to ``cotangents`` (forward included)."""
    pull = vjp(f, *primals, has_aux=has_aux)[1]
    if not batched:
        return pull(cotangents)
    return vmap(pull, chunk_size=chunk_size)(cotangents)
