"""The test of every row at once of the per-sample plan (NOTE [the per-sample plan] in
``plan``, step 3): the gradients of the examples' losses under two random weightings, and
whether a row of a recorded tensor keeps the ratio of its own example's weights."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from torch_vjp._function_values import real_dtype
from torch_vjp._per_sample.args import Job
from torch_vjp._per_sample.losses import loss_sum

__all__ = ["as_shape", "weighted_grads", "linear_at", "rows_moved"]


def as_shape(g: Tensor, shape: Sequence[int]) -> Tensor:
    """A recorded tensor's gradient in the tensor's shape: the gradient of a view's base
    comes in the base's shape (see recorder.out_edge)."""
    if tuple(g.shape) != tuple(shape) and g.numel() == math.prod(shape):
        return g.reshape(shape)
    return g


#: The examples' loss weights of the two passes of :func:`weighted_grads` (fixed, so that
#: plans do not depend on a random draw).
_WEIGHTS = torch.Generator().manual_seed(20261127)


def weighted_grads(
    job: Job, out: Any, out_dims: list[int] | None, edges: list[Any], batch: int
) -> tuple[Any, ...] | None:
    """The gradients at ``edges`` of ``sum_k w_k loss_k`` for two random weightings ``w``
    and ``v`` of the examples' losses, and for ``w + v``: ``(w, v, grads_w, grads_v,
    grads_sum, top)``, ``top`` the largest entry of the cotangents the sum weighting's
    backward starts from (the scale of its values: see :func:`rows_moved`). Where a row
    ``j`` of a
    tensor belongs to example ``j`` alone, its two gradients are ``w_j u`` and ``v_j u``; a
    row that follows another example's loss, or several, breaks that ratio. Two backward
    passes test every example at once, where the per-example probes test two (a model that
    sorts its batch and restores the order can leave those two in place)."""
    if not edges:
        return None
    leaves = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
    dims = out_dims if out_dims is not None else [0] * len(leaves)
    pairs = [(t, d) for t, d in zip(leaves, dims) if t.requires_grad]
    total = loss_sum(job.fn, job.loss_fn, out, job.targets, batch, out_dims)
    if not pairs or not total.requires_grad:
        return None
    per_row = torch.autograd.grad(total, [t for t, _ in pairs], retain_graph=True,
                                  allow_unused=True)
    weights = [torch.rand(batch, generator=_WEIGHTS, dtype=torch.float64) + 1.0
               for _ in range(2)]
    weights.append(weights[0] + weights[1])  # (the backward's linearity: see linear_at)
    grads = []
    top = max((float(g.detach().abs().amax()) for g in per_row
               if g is not None and g.numel()), default=0.0) * float(weights[2].max())
    for w in weights:
        cotangents = []
        for (t, d), g in zip(pairs, per_row):
            shape = [1] * t.dim()
            shape[d] = batch
            g = torch.zeros_like(t) if g is None else g
            cotangents.append(g * w.to(device=g.device, dtype=g.dtype).view(shape))
        grads.append(torch.autograd.grad([t for t, _ in pairs], edges, cotangents,
                                         retain_graph=True, allow_unused=True))
    return weights[0], weights[1], grads[0], grads[1], grads[2], top


def linear_at(weighted: tuple[Any, ...], pos: int) -> bool:
    """Whether the gradient at edge ``pos`` is linear in the examples' loss weights (the sum
    weighting's gradient the sum of the two weightings'): a backward hook that normalises a
    gradient by its norm over the batch is not, and breaks every row's ratio without any
    example's loss reaching another's rows (the per-example probes see that case right)."""
    a, b, c = weighted[2][pos], weighted[3][pos], weighted[4][pos]
    if a is None or b is None or c is None:
        return False
    a, b, c = _as_real(a), _as_real(b), _as_real(c)
    dtype = weighted[2][pos].dtype
    tol = 64 * torch.finfo(real_dtype(dtype)).eps ** 0.5 if (
        dtype.is_floating_point or dtype.is_complex) else 1e-6
    return bool(((a + b - c).abs() <= tol * (a.abs() + b.abs()).amax() + 1e-30).all())


def rows_moved(weighted: tuple[Any, ...], pos: int, shape: Sequence[int], d: int,
                batch: int) -> bool:
    """Whether some row along ``d`` of the tensor at edge ``pos`` breaks the ratio of
    :func:`weighted_grads` (a row that does not belong to the example of its index).

    A row whose gradients are rounding errors has no ratio to keep: where the gradient
    cancels exactly in the backward (the squared output of an RMSNorm whose weight is 1 does
    not depend on its input), what reaches the layers below is rounding of values of the
    size of the cotangents the backward started from, which breaks the ratio of every row.
    The backward's own rounding is measured at the edge, as the amount by which the sum
    weighting's gradient differs from the sum of the two weightings' (zero in exact
    arithmetic for a backward linear in the examples' weights); where that amount is itself
    at rounding level of the starting cotangents, deviations within a few times it are
    taken as rounding. A row that follows another example's loss deviates by its whole
    size while the backward stays linear up to rounding, so it is still found; a backward
    that is not linear (a hook that normalises the gradient over the batch) differs by
    far more than rounding and gets no floor."""
    w, v, grads_w, grads_v = weighted[:4]
    a, b = grads_w[pos], grads_v[pos]
    if a is None or b is None:
        return False
    a, b = as_shape(a, shape), as_shape(b, shape)
    if d >= a.dim() or a.shape[d] != batch or a.numel() == 0:
        return False  # (rows of no elements, a sequence of length 0: no ratio to break)
    a = _as_real(a.detach().movedim(d, 0).reshape(batch, -1)).reshape(batch, -1)
    b = _as_real(b.detach().movedim(d, 0).reshape(batch, -1)).reshape(batch, -1)
    lhs, rhs = a * v.to(a.device).unsqueeze(1), b * w.to(a.device).unsqueeze(1)
    scale = (lhs.abs() + rhs.abs()).amax(1, keepdim=True)
    floating = grads_w[pos].is_floating_point() or grads_w[pos].is_complex()
    eps = torch.finfo(real_dtype(grads_w[pos].dtype)).eps if floating else 0.0
    tol = 64 * eps ** 0.5 if floating else 1e-6
    off = (lhs - rhs).abs()
    moved = off > tol * scale
    if not bool(moved.any()):
        return False
    c = weighted[4][pos] if len(weighted) > 5 else None
    if c is None or not floating:
        return True
    c = _as_real(as_shape(c, shape).detach().movedim(d, 0).reshape(batch, -1)).reshape(
        batch, -1)
    rounding = float((a + b - c).abs().amax())
    if rounding > eps ** 0.5 * weighted[5]:
        return True  # (the backward is not linear beyond rounding: no floor)
    top = float(torch.maximum(w, v).max())
    return bool((moved & (off > 16 * top * rounding)).any())


def _as_real(t: Tensor) -> Tensor:
    """``t`` in float64, a complex tensor as its real and imaginary parts (a last dimension
    of 2): the ratio of a row's gradients holds for both parts, and ``.double()`` of a
    complex tensor would drop the imaginary one."""
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj().contiguous())
    return t.double()
