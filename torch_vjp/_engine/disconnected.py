"""The disconnection check: a Jacobian block of zeros that is not the derivative, because
the output depends on the input through something autograd cannot follow."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten_with_path, tree_leaves, tree_unflatten

from torch_vjp._engine.blocks import Blocks
from torch_vjp._engine.context import is_nested
from torch_vjp._engine.problem import Problem, leaf_name
from torch_vjp._engine.shapes import SHAPES_MAX, shapes_key
from torch_vjp._errors import JacobianWarning, user_stacklevel

__all__ = ["warn_disconnected"]


def _perturbation_scale(dtype: torch.dtype) -> float:
    eps = torch.finfo(dtype).eps
    return 1e-3 if eps < 1e-4 else 16 * eps


def _differs(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape:
        return True
    differ = a != b
    if a.is_floating_point():
        differ &= ~(a.isnan() & b.isnan())
    return bool(differ.any())


_VERIFIED: dict[Any, None] = {}


def warn_disconnected(prob: Problem, res: Blocks, batch: int | None = None) -> None:
    """Warns about each all-zero block whose output does not depend on its input through
    autograd although its value does.

    Free in the usual case: every output was seen to depend on the one input (see
    :class:`Blocks`); with several inputs, each block's first element, else the block, is
    checked for zeros, once per function and input shapes (the key of NOTE [output
    sizes]) as long as every block is found non-zero.
    Only for an all-zero block does it re-run ``f`` with fresh leaves to ask autograd
    whether the output is connected to the input (a connected zero block is a true zero
    derivative), and, if it is not, run ``f`` at a slightly moved input (with the same
    random state) to see whether the value changes: an output that changes but has no
    autograd path went through ``.item()``, ``.numpy()``, ``torch.tensor(...)`` or
    ``.detach()``, and its block of zeros is not its derivative. Skipped inside outer
    torch.func transforms.
    """
    if res.connected and len(prob.leaves) == 1:
        return  # every output depends on the one input through autograd
    if is_nested() or torch.compiler.is_compiling():
        return
    key = None
    if res.connected:  # several inputs: scanned once per function and input shapes
        key = shapes_key(prob, batch)
        if key is not None and key in _VERIFIED:
            return
    flat = [(j, i, v) for j, row in enumerate(res.views) for i, v in enumerate(row) if v.numel()]
    if not flat:
        return
    # Each block's first element settles most blocks; only blocks whose first element is
    # zero are scanned in full.
    nonzero = [v[(0,) * v.dim()].item() != 0 for _, _, v in flat]
    for k, (nz, (_, _, v)) in enumerate(zip(nonzero, flat)):
        if not nz and v.numel() > 1:
            nonzero[k] = bool(v.any())
    zero_pairs = [(j, i) for (j, i, _), nz in zip(flat, nonzero) if not nz]
    if not zero_pairs:
        if key is not None:
            if len(_VERIFIED) >= SHAPES_MAX:
                _VERIFIED.pop(next(iter(_VERIFIED)))
            _VERIFIED[key] = None
        return
    disconnected = _without_autograd_path(prob, zero_pairs)
    if disconnected:
        _warn_if_value_moves(prob, res, disconnected)


def _without_autograd_path(
    prob: Problem, pairs: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The (output, input) pairs among ``pairs`` with no autograd path between them."""
    leaves = [x.detach().requires_grad_() for x in prob.leaves]
    with torch.enable_grad():
        out = prob.g(*leaves)
    flat_out = tree_leaves(out[0] if prob.has_aux else out)
    disconnected = []
    for j, i in pairs:
        o = flat_out[j]
        if o.requires_grad:
            (gi,) = torch.autograd.grad(
                o, leaves[i], torch.ones_like(o), allow_unused=True, retain_graph=True
            )
            if gi is not None:
                continue
        disconnected.append((j, i))
    return disconnected


def _warn_if_value_moves(
    prob: Problem, res: Blocks, disconnected: Sequence[tuple[int, int]]
) -> None:
    """Warns for each pair whose output's value changes when its input moves a little."""
    devices = sorted(
        {x.device.index or 0 for x in prob.leaves if x.device.type == "cuda"}
    )
    gen = torch.Generator().manual_seed(0)

    def evaluate(xs: Sequence[Tensor]) -> list[Tensor]:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            r = prob.g(*xs)
        return tree_leaves(r[0] if prob.has_aux else r)

    base = evaluate(prob.leaves)
    moved_by_input: dict[int, list[Tensor]] = {}
    out_paths = tree_flatten_with_path(tree_unflatten(list(range(len(base))), res.out_spec))[0]
    for j, i in disconnected:
        if i not in moved_by_input:
            x = prob.leaves[i]
            noise = torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device)
            step = _perturbation_scale(x.dtype) * (1 + x.detach().abs()) * noise
            xs = list(prob.leaves)
            xs[i] = x.detach() + step
            moved_by_input[i] = evaluate(xs)
        if not _differs(base[j], moved_by_input[i][j]):
            continue
        path = out_paths[j][0]
        out_name = "the output of f" if res.out_spec.is_leaf() else leaf_name(path, "output")
        warnings.warn(
            f"{prob.call}: {out_name} does not depend on {prob.leaf_name(i)} through "
            f"autograd, although its value changes when {prob.leaf_name(i)} changes: its "
            f"Jacobian block is all zeros, which is not its derivative.\n"
            f"  f turns a tensor computed from {prob.leaf_name(i)} into a Python number or "
            f"NumPy array (.item(), .tolist(), .numpy(), float(...), torch.tensor(...)), or "
            f"calls .detach() on it, and autograd cannot follow that. Keep the computation "
            f"in torch operations on the tensor itself.",
            JacobianWarning,
            stacklevel=user_stacklevel(),
        )
