"""Sparsity rules of ops that read a neighbourhood of their inputs, where a dense rule
would hold every output dependent on every input: ``prelu``, ``linalg.cross``, ``renorm``,
``cdist`` and the bilinear resize (registered with the rules of
:mod:`~torch_vjp._sparse.rules`). Each is a superset of the true pattern."""

from __future__ import annotations

import torch
from torch import Tensor

from torch_vjp._sparse.rules import (
    _LONG,
    _float_inputs,
    _self,
    aten,
    combine,
    conservative,
    for_outputs,
    group,
    pointwise,
    register,
)
from torch_vjp._sparse.tracer import Call, Tracer, carries_sets

__all__ = ["cdist", "cross", "renorm", "upsample_bilinear"]


# ``prelu`` is pointwise though torch does not tag it so: each output element depends on the
# input element at its position and the weight of its channel (broadcast)
register("_prelu_kernel", "prelu")(pointwise)


@register("linalg_cross")
def cross(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Each output element depends on the line of 3 along ``dim`` of both (broadcast)
    inputs at its position."""
    shape = call.outs[0].shape
    dim = call.bound.get("dim")
    dim = (-1 if dim is None else dim) % max(1, len(shape))
    parts = []
    for t in _float_inputs(call):
        ids = tr.ids(t)
        if ids is not None:
            ids = ids.reshape((1,) * (len(shape) - ids.dim()) + tuple(ids.shape))
            parts.append(group(tr, ids, [dim]).expand(ids.shape))
    return for_outputs(call, combine(tr, shape, parts))


@register("renorm")
def renorm(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Each sub-tensor at one index of ``dim`` is scaled by its own norm: each output
    element depends on every element of its sub-tensor."""
    x = _self(call)
    ids = tr.ids(x)
    if ids is None or x.dim() == 0:
        return for_outputs(call, ids)
    dim = call.bound["dim"] % x.dim()
    return for_outputs(call, group(tr, ids, [d for d in range(x.dim()) if d != dim])
                       .expand(x.shape))


@register("_cdist_forward", "cdist", "_euclidean_dist")
def cdist(tr: Tracer, call: Call) -> list[Tensor | None]:
    """``out[..., i, j]`` depends on the rows ``x1[..., i, :]`` and ``x2[..., j, :]`` (batch
    dimensions broadcast)."""
    shape = call.outs[0].shape
    parts = []
    for name, rows_last in (("x1", False), ("x2", True)):
        t = call.bound.get(name)
        ids = tr.ids(t) if carries_sets(t) else None
        if ids is not None and ids.dim() >= 2:
            line = group(tr, ids, [-1])
            parts.append(line.transpose(-1, -2) if rows_last else line)
        elif ids is not None:
            return conservative(tr, call)
    return for_outputs(call, combine(tr, shape, parts))


@register("upsample_bilinear2d")
def upsample_bilinear(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Each output pixel depends on the input pixels of its channel that its rows and
    columns read (:func:`_bilinear_reach`: two of each, with a neighbour on each side)."""
    x = _self(call)
    ids = tr.ids(x)
    out = call.outs[0]
    if ids is None or x.dim() != 4 or x.numel() == 0 or out.numel() == 0:
        return conservative(tr, call) if ids is not None else [None]
    (hin, win), (hout, wout) = x.shape[-2:], out.shape[-2:]
    factors = call.bound.get("scale_factors")
    scales = (list(factors) if factors is not None
              else [call.bound.get("scales_h"), call.bound.get("scales_w")])
    align = bool(call.bound.get("align_corners"))
    oh, ih = _bilinear_reach(hin, hout, align, scales[0]).nonzero().unbind(1)
    ow, iw = _bilinear_reach(win, wout, align, scales[1]).nonzero().unbind(1)
    to = (oh[:, None] * wout + ow[None, :]).reshape(-1)
    src = (ih[:, None] * win + iw[None, :]).reshape(-1)
    planes = ids.reshape(-1, hin * win)
    n = planes.shape[0]
    rows = (torch.arange(n, dtype=_LONG)[:, None] * (hout * wout) + to[None, :]).reshape(-1)
    return [tr.table.union(rows, planes[:, src].reshape(-1), n * hout * wout).view(out.shape)]


def _bilinear_reach(n_in: int, n_out: int, align: bool, scale: float | None) -> Tensor:
    """``(n_out, n_in)``: which input rows each output row of a bilinear resize reads, along
    one dimension: the resize itself run on the rows of an identity (float64; each output
    row weighs its two source rows, the weights sum to 1), each source widened by its
    neighbours, as the source index that another dtype rounds may fall one row over."""
    eye = torch.eye(n_in, dtype=torch.float64).reshape(1, n_in, n_in, 1)
    reach = aten.upsample_bilinear2d.default(eye, [n_out, 1], align, scale, None)
    reach = reach.reshape(n_in, n_out).t() != 0
    wide = reach.clone()
    wide[:, 1:] |= reach[:, :-1]
    wide[:, :-1] |= reach[:, 1:]
    return wide
