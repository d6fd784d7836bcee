"""The reference Jacobian of :func:`torch_vjp.compare_strategies`: a Python loop of
``torch.autograd.grad`` over the output elements on float64 copies of the primals
(independent of torch_vjp and of vmap's batching rules), or ``torch.func.jacrev``, or the
same at the primals' own dtype. ``f`` is always given copies: it may write into its
arguments, and none of the caller's tensors may change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from torch_vjp._measure import reason

__all__ = ["NoReference", "reference_jacobian"]


def _to_double(tree: Any) -> Any:
    """Copies of the tensors in ``tree``, floating-point ones in float64: never the
    caller's own tensors (``x.to(torch.float64)`` of a float64 tensor is ``x`` itself, which
    an ``f`` that writes into an argument would change)."""
    def cast(x: Any) -> Any:
        if isinstance(x, Tensor):
            if x.is_floating_point():
                return x.detach().to(torch.float64, copy=True)
            if x.is_complex():
                return x.detach().to(torch.complex128, copy=True)
            return x.detach().clone()
        return x

    return tree_map(cast, tree)


def _copies(tree: Any) -> Any:
    """Copies of the tensors in ``tree``, in their own dtypes."""
    return tree_map(lambda x: x.detach().clone() if isinstance(x, Tensor) else x, tree)


def _loop_jacobian(f: Callable, primals: tuple, argnums: int | tuple[int, ...]) -> Any:
    """The Jacobian by a Python loop of ``torch.autograd.grad``, one output element at a
    time: no vmap, so it also serves functions that vmap cannot batch."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    args = list(primals)
    diff_leaves: list[list[Tensor]] = []
    diff_specs = []
    for i in nums:
        leaves, spec = tree_flatten(args[i])
        leaves = [t.detach().requires_grad_(True) for t in leaves]
        diff_leaves.append(leaves)
        diff_specs.append(spec)
        # (f gets copies it may write into: autograd refuses writes into the leaves)
        args[i] = _unflatten([t.clone() for t in leaves], spec)
    out = f(*args)
    out_leaves, out_spec = tree_flatten(out)
    flat_inputs = [t for leaves in diff_leaves for t in leaves]
    blocks: list[Any] = []
    for y in out_leaves:
        rows = []
        flat = y.reshape(-1)
        for k in range(flat.numel()):
            if flat.requires_grad:
                grads = torch.autograd.grad(flat[k], flat_inputs, retain_graph=True,
                                            allow_unused=True)
            else:
                grads = (None,) * len(flat_inputs)
            rows.append([torch.zeros_like(x) if g is None else g
                         for g, x in zip(grads, flat_inputs)])
        per_input = []
        pos = 0
        for leaves, spec in zip(diff_leaves, diff_specs):
            jac_leaves = []
            for x in leaves:
                if rows:
                    col = torch.stack([r[pos] for r in rows]).reshape(y.shape + x.shape)
                else:
                    col = y.new_zeros(y.shape + x.shape)
                jac_leaves.append(col)
                pos += 1
            per_input.append(_unflatten(jac_leaves, spec))
        blocks.append(per_input[0] if isinstance(argnums, int) else tuple(per_input))
    return _unflatten(blocks, out_spec)


def _unflatten(leaves: list[Any], spec: Any) -> Any:
    from torch.utils._pytree import tree_unflatten

    return tree_unflatten(leaves, spec)


def reference_jacobian(f: Callable, primals: tuple, argnums: int | tuple[int, ...],
               before: Callable[[], None] = lambda: None) -> tuple[Any, str]:
    """The reference Jacobian and a description of how it was computed.

    Tries, in order: a loop of ``torch.autograd.grad`` on float64 copies of the primals (no
    vmap: a wrong batching rule, which every vectorised strategy and ``torch.func.jacrev``
    share, cannot reach it); ``torch.func.jacrev`` on them; the same two at the primals' own
    dtype (for a function that holds float32 weights, which float64 inputs cannot multiply).
    """
    # (grad mode on and inference mode off, whatever the caller's: under torch.no_grad() the
    # loop's rows were read off an output that records no graph, and the reference was all
    # zeros, so every strategy was 'wrong'; the strategies themselves switch grad mode on)
    with torch.inference_mode(False), torch.enable_grad():
        return _reference(f, primals, argnums, before)


def _reference(f: Callable, primals: tuple, argnums: int | tuple[int, ...],
               before: Callable[[], None]) -> tuple[Any, str]:
    attempts = []
    # (each attempt on fresh copies: f may write into its arguments, and none of the
    # caller's tensors may change; nor may an attempt that failed halfway leave its writes
    # to the next)
    for copy, dtype_note in ((_to_double, "float64"), (_copies, "the inputs' own dtype")):
        try:
            before()  # (each attempt with the caller's draws)
            jac = _loop_jacobian(f, copy(primals), argnums)
            return jac, f"a loop of torch.autograd.grad in {dtype_note}"
        except Exception as exc:  # noqa: BLE001 - the next attempt, or the row says why
            attempts.append(f"autograd.grad loop in {dtype_note}: {reason(exc, 120)}")
        try:
            before()
            jac = torch.func.jacrev(f, argnums=argnums)(*copy(primals))
            return jac, f"torch.func.jacrev in {dtype_note} (the autograd.grad loop failed)"
        except Exception as exc:  # noqa: BLE001
            attempts.append(f"jacrev in {dtype_note}: {reason(exc, 120)}")
    raise NoReference("; ".join(attempts))


class NoReference(Exception):
    """No reference Jacobian could be computed (the reasons are the message)."""
