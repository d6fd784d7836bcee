"""The disconnection check: a Jacobian block of zeros that is not the derivative, because
the output depends on the input through something autograd cannot follow.

NOTE [the disconnection check]
An output computed from an input's values through ``.item()``, ``.tolist()``, ``.numpy()``,
``torch.tensor(...)`` or ``.detach()`` has no autograd path to it, and its Jacobian block
comes out all zeros, as in torch.func, silently. Telling such a block from a true zero (an
output that does not use the input, a constant) takes evidence the Jacobian's own run does
not give: whether the output's value moves when the input moves, which means calling f again,
at another point. A diagnostic must never fail a call that succeeded, nor call f behind the
caller's back (f may have side effects, or not be differentiable in another mode: BatchNorm's
running statistics have a forward-mode derivative but no reverse one). So the check runs only
where the caller asked for checks, in checked mode (``torch_vjp.checked()`` or
``TORCH_VJP_CHECKED=1``), and there:
* it looks at blocks that came out all zero, and only at those;
* it asks autograd whether each such output has a path to its input in the mode the
  Jacobian was computed in (reverse mode: a backward pass; forward mode: a tangent on that
  input alone), never in the other one;
* for a pair without a path, it runs f once at a slightly moved input (without a graph,
  with the same random state) and warns if the output's value changes;
* anything that fails inside the check ends the check, silently: the Jacobian stands.
Outside checked mode nothing runs and nothing is scanned.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor
from torch.utils._pytree import tree_flatten_with_path, tree_leaves, tree_unflatten

from torch_vjp._engine.blocks import Blocks
from torch_vjp._engine.compile_key import tracing
from torch_vjp._engine.context import is_nested
from torch_vjp._engine.problem import Problem, leaf_name
from torch_vjp._engine.shapes import SHAPES_MAX, shapes_key
from torch_vjp._errors import JacobianWarning, user_stacklevel
from torch_vjp.autograd import is_checked

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
    """In checked mode, warns about each all-zero block whose output does not depend on its
    input through autograd although its value does (NOTE [the disconnection check]).

    Outside checked mode it returns at once. In checked mode it is free in the usual case:
    in forward mode every output was seen to depend on the one input (a tangent reached it:
    see :class:`Blocks`); otherwise (several inputs, or reverse mode, where an output that
    requires grad may do so through a tensor f made itself with ``requires_grad=True``
    rather than through the input: ``p = x.detach().requires_grad_()``) each block's first
    element, else the block, is checked for zeros, once per function and input shapes (the
    key of NOTE [output sizes]) as long as every block is found non-zero. Skipped inside
    outer torch.func transforms. Never raises: a failure inside the check ends it without a
    warning.
    """
    if not is_checked():
        return
    if res.connected and len(prob.leaves) == 1 and res.mode == "fwd":
        return  # every output depends on the one input through autograd
    if is_nested() or tracing():
        return
    try:
        messages = _disconnected_messages(prob, res, batch)
    except Exception:  # noqa: BLE001 - a diagnostic never fails a call that succeeded
        return
    for message in messages:  # outside the guard: a warning turned into an error propagates
        warnings.warn(message, JacobianWarning, stacklevel=user_stacklevel())


def _disconnected_messages(prob: Problem, res: Blocks, batch: int | None) -> list[str]:
    key = None
    if res.connected:  # (several inputs, or reverse mode) once per function and input shapes
        key = shapes_key(prob, batch)
        if key is not None and key in _VERIFIED:
            return []
    flat = [(j, i, v) for j, row in enumerate(res.views) for i, v in enumerate(row) if v.numel()]
    if not flat:
        return []
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
        return []
    if res.mode == "fwd":
        disconnected = _without_forward_path(prob, zero_pairs)
    else:
        disconnected = _without_autograd_path(prob, zero_pairs)
    if not disconnected:
        return []
    return _messages_if_value_moves(prob, res, disconnected)


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


def _without_forward_path(
    prob: Problem, pairs: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The (output, input) pairs among ``pairs`` with no forward-mode path between them: f
    run with a tangent on that input alone, the output gets none."""
    disconnected = []
    for i in sorted({i for _, i in pairs}):
        with fwAD.dual_level():
            xs = list(prob.leaves)
            xs[i] = fwAD.make_dual(xs[i].detach(), torch.ones_like(xs[i]))
            out = prob.g(*xs)
            flat_out = tree_leaves(out[0] if prob.has_aux else out)
            tangents = [fwAD.unpack_dual(o).tangent is not None for o in flat_out]
        disconnected += [(j, k) for j, k in pairs if k == i and not tangents[j]]
    return disconnected


def _messages_if_value_moves(
    prob: Problem, res: Blocks, disconnected: Sequence[tuple[int, int]]
) -> list[str]:
    """A message for each pair whose output's value changes when its input moves a
    little."""
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
    messages = []
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
        messages.append(
            f"{prob.call}: {out_name} does not depend on {prob.leaf_name(i)} through "
            f"autograd, although its value changes when {prob.leaf_name(i)} changes: its "
            f"Jacobian block is all zeros, which is not its derivative.\n"
            f"  f turns a tensor computed from {prob.leaf_name(i)} into a Python number or "
            f"NumPy array (.item(), .tolist(), .numpy(), float(...), torch.tensor(...)), or "
            f"calls .detach() on it, and autograd cannot follow that. Keep the computation "
            f"in torch operations on the tensor itself. (This check runs in checked mode, "
            f"torch_vjp.checked().)"
        )
    return messages
