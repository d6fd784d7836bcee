"""Sparsity rules of ops that read a neighbourhood of their inputs, where a dense rule
would hold every output dependent on every input: ``prelu``, ``polar``, ``linalg.cross``,
``renorm``, the FFTs, ``F.fold``, ``F.affine_grid``, ``F.bilinear``, ``cdist`` and the
resizes of ``F.interpolate`` that weigh a window (linear, bilinear, trilinear, bicubic,
antialiased) (registered with the rules of :mod:`~torch_vjp._sparse.rules`); and ops that
work on blocks of their inputs: ``F.grid_sample`` (each output point reads the taps around
its grid point in its example and channel's input plane, the whole plane where the grid
comes from x, and its own grid point), fractional max pooling (each output
element reads a window that every draw of its random samples stays inside), and the
batched linear algebra of ``torch.linalg`` (each matrix of a batch depends on the matrices
of its batch index only: a block-diagonal pattern). Each is a superset of the true pattern
(at every input and every draw).

NOTE [a resize's reach]
The resizes are separable: output pixel ``(o_1, ..., o_k)`` of a channel weighs input pixel
``(i_1, ..., i_k)`` of the same channel by a product of one weight per dimension, so it
depends on it where each ``i_d`` is in the reach of ``o_d`` along dimension ``d``. A
dimension's reach is read off the kernels themselves, run in float64 on an identity (row
``i`` as channel ``i``), not from a formula of ours: the forward kernel (what forward mode
and the values compute) and the backward kernel (what reverse mode computes; torch 2.13's
antialiased backward reads a window where its forward copies, for a dimension of equal
sizes and a scale given), each with the other dimensions of size 1 and of size 2 (the
antialiased forward on a last dimension of size 1 reads only the first row). The source
index of an output row is computed in float (float32 for float32, bfloat16 and float16),
so at another dtype it can fall one row over, and a tap whose weight is exactly zero in
float64 (bicubic's outer taps at an integer source index, ``(1 - t) t^2`` with ``t = 0``)
is non-zero there: each source is widened by one neighbour on each side (linear, bilinear,
trilinear, antialiased bilinear), by two for the bicubic ones, whose taps shifted by a row
reach two past the float64 ones.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torch_vjp._sparse.contract import _ints, windowed
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

__all__ = ["affine_grid", "batched_linalg", "cdist", "col2im", "cross", "fft",
           "fractional_max_pool", "grid_sampler", "renorm", "trilinear", "upsample"]


# ``prelu`` is pointwise though torch does not tag it so: each output element depends on the
# input element at its position and the weight of its channel (broadcast)
register("_prelu_kernel", "prelu")(pointwise)
# ``polar`` and ``complex`` are pointwise too, untagged: each complex output element is
# made of the two real input elements at its (broadcast) position
register("polar", "complex")(pointwise)


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


@register("_fft_r2c", "_fft_c2c", "_fft_c2r")
def fft(tr: Tracer, call: Call) -> list[Tensor | None]:
    """A discrete Fourier transform over ``dim``: each output element depends on every
    input element of its line (plane, ...) along the transformed dimensions, at the same
    index of the others (their sizes are the input's; the last transformed one may differ:
    a one-sided or a real result)."""
    x = _self(call)
    ids = tr.ids(x)
    out = call.outs[0]
    if ids is None or x.dim() != out.dim():
        return for_outputs(call, ids) if ids is None else conservative(tr, call)
    dims = [d % x.dim() for d in call.bound["dim"]]
    return for_outputs(call, group(tr, ids, dims).expand(out.shape))


@register("col2im")
def col2im(tr: Tracer, call: Call) -> list[Tensor | None]:
    """``F.fold`` adds each column element into the output pixel its window puts it at (the
    adjoint of ``im2col``): each output pixel depends on the column elements that land on
    it, which ``im2col`` of the output's positions says (0 where a window reads padding)."""
    x = _self(call)
    ids = tr.ids(x)
    out = call.outs[0]
    if ids is None or out.numel() == 0:
        return [None] if ids is None else conservative(tr, call)
    pos = torch.arange(1, out.numel() + 1, dtype=torch.float64).view(out.shape)
    lands = aten.im2col.default(pos, call.bound["kernel_size"], call.bound["dilation"],
                                call.bound["padding"], call.bound["stride"])
    lands = lands.to(_LONG).reshape(-1)
    kept = lands > 0
    res = tr.table.union(lands[kept] - 1, ids.reshape(-1)[kept], out.numel())
    return [res.view(out.shape)]


@register("affine_grid_generator")
def affine_grid(tr: Tracer, call: Call) -> list[Tensor | None]:
    """``F.affine_grid``: coordinate ``k`` of each grid point of example ``n`` is row ``k``
    of ``theta[n]`` applied to the point's base coordinates: it depends on that row."""
    theta = call.bound["theta"]
    ids = tr.ids(theta)
    out = call.outs[0]
    if ids is None or theta.dim() != 3 or out.dim() < 3 or out.shape[-1] != theta.shape[1]:
        return [None] if ids is None else conservative(tr, call)
    rows = group(tr, ids, [-1])  # (N, k, 1)
    view = (rows.shape[0],) + (1,) * (out.dim() - 2) + (rows.shape[1],)
    return [rows.reshape(view).expand(out.shape)]


@register("_trilinear")
def trilinear(tr: Tracer, call: Call) -> list[Tensor | None]:
    """``F.bilinear``'s product: the three operands, each unsqueezed at its ``expand``
    dimensions, multiplied (broadcast) and summed over ``sumdim``: each output element
    depends on the union over ``sumdim`` of the three at its position."""
    bd = call.bound
    out = call.outs[0]
    operands = [(bd["i1"], bd["expand1"]), (bd["i2"], bd["expand2"]), (bd["i3"], bd["expand3"])]
    shaped = []
    for t, expand in operands:
        view = list(t.shape)
        for d in sorted(expand):
            view.insert(d, 1)
        shaped.append((tr.ids(t), view))
    full = torch.broadcast_shapes(*(torch.Size(v) for _, v in shaped))
    sumdim = sorted({d % len(full) for d in bd["sumdim"]})
    kept = [s for d, s in enumerate(full) if d not in sumdim]
    if list(out.shape) != kept:
        return conservative(tr, call)
    parts = [None if ids is None else group(tr, ids.reshape(view).expand(full), sumdim)
             for ids, view in shaped]
    both = combine(tr, [1 if d in sumdim else s for d, s in enumerate(full)], parts)
    return for_outputs(call, None if both is None else both.reshape(out.shape))


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


#: The resizes that weigh, separably, a window of input pixels of their channel per output
#: pixel: by op, the number of resized dimensions, the names of their scales, and how many
#: neighbours on each side a dimension's reach is widened by (:func:`_reach`).
_RESIZES = {
    "upsample_linear1d": (1, ("scales",), 1),
    "upsample_bilinear2d": (2, ("scales_h", "scales_w"), 1),
    "upsample_trilinear3d": (3, ("scales_d", "scales_h", "scales_w"), 1),
    "upsample_bicubic2d": (2, ("scales_h", "scales_w"), 2),
    "_upsample_bilinear2d_aa": (2, ("scales_h", "scales_w"), 1),
    "_upsample_bicubic2d_aa": (2, ("scales_h", "scales_w"), 2),
}


@register(*_RESIZES)
def upsample(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Each output pixel depends on the input pixels of its channel that its index along
    each resized dimension reads (:func:`_reach`, per dimension: the op is separable, its
    weights a product of one weight per dimension): linear, bilinear and trilinear read two
    of each, bicubic four, antialiased ones a window as wide as the scale asks."""
    k, names, widen = _RESIZES[call.name]
    x = _self(call)
    ids = tr.ids(x)
    out = call.outs[0]
    if ids is None or x.dim() != k + 2 or x.numel() == 0 or out.numel() == 0:
        return conservative(tr, call) if ids is not None else [None]
    sizes_in, sizes_out = tuple(x.shape[2:]), tuple(out.shape[2:])
    factors = call.bound.get("scale_factors")
    scales = (list(factors) if factors is not None
              else [call.bound.get(name) for name in names])
    align = bool(call.bound.get("align_corners"))
    to = src = torch.zeros(1, dtype=_LONG)
    for d in range(k):
        o, i = _reach(call.name, k, d, sizes_in[d], sizes_out[d], align, scales[d],
                      widen).nonzero().unbind(1)
        to = (to[:, None] * sizes_out[d] + o[None, :]).reshape(-1)
        src = (src[:, None] * sizes_in[d] + i[None, :]).reshape(-1)
    n_out = math.prod(sizes_out)
    planes = ids.reshape(-1, math.prod(sizes_in))
    n = planes.shape[0]
    rows = (torch.arange(n, dtype=_LONG)[:, None] * n_out + to[None, :]).reshape(-1)
    return [tr.table.union(rows, planes[:, src].reshape(-1), n * n_out).view(out.shape)]


def _reach(name: str, k: int, d: int, n_in: int, n_out: int, align: bool,
           scale: float | None, widen: int) -> Tensor:
    """``(n_out, n_in)``: which input rows each output row of resize ``name`` reads along
    its resized dimension ``d`` (of ``k``), by its forward and its backward kernels, each
    source widened by ``widen`` neighbours on each side. See NOTE [a resize's reach]."""
    scales: list[float | None] = [None] * k
    scales[d] = scale
    forward = getattr(aten, name).default
    backward = getattr(aten, name + "_backward").default
    reach = torch.zeros(n_out, n_in, dtype=torch.bool)
    for other in (1, 2):
        size_in, size_out = [other] * k, [other] * k
        size_in[d], size_out[d] = n_in, n_out
        # (row i of the identity as channel i, constant along the other dimensions)
        got = forward(_identity(n_in, k, d, size_in), size_out, align, *scales)
        reach |= _plane_line(got, n_in, k, d).t() != 0
        got = backward(_identity(n_out, k, d, size_out), size_out, [1, n_out, *size_in],
                       align, *scales)
        reach |= _plane_line(got, n_out, k, d) != 0
    wide = reach.clone()
    for step in range(1, widen + 1):
        wide[:, step:] |= reach[:, :-step]
        wide[:, :-step] |= reach[:, step:]
    return wide


def _identity(n: int, k: int, d: int, size: list[int]) -> Tensor:
    """``(1, n, *size)`` float64 (``size[d] == n``): channel ``i`` one at index ``i`` of
    dimension ``d``, zero elsewhere, the same along the other dimensions."""
    view = [n] + [1] * k
    view[1 + d] = n
    eye = torch.eye(n, dtype=torch.float64).reshape(view)
    return eye.expand(n, *size).unsqueeze(0).contiguous()


def _plane_line(t: Tensor, channels: int, k: int, d: int) -> Tensor:
    """``(channels, t.shape[2 + d])``: each channel of ``t`` along dimension ``d``, at index
    0 of the others."""
    return t[0].movedim(1 + d, -1).reshape(channels, -1, t.shape[2 + d])[:, 0]


# ---- ops on blocks: grid_sample, fractional max pooling, batched linear algebra -----------


@register("grid_sampler_2d", "grid_sampler_3d", "grid_sampler", "_grid_sampler_2d_cpu_fallback",
          "cudnn_grid_sampler")
def grid_sampler(tr: Tracer, call: Call) -> list[Tensor | None]:
    """``F.grid_sample``: output point ``(n, c, *p)`` interpolates the input plane (volume)
    ``(n, c)`` at grid point ``(n, *p)``, and depends on that grid point's coordinates (its
    last dimension). Where it lands is read off the grid's values: for a constant grid
    (:func:`_grid_taps`: zeros or border padding), the taps around it, one pixel wider on
    each side (the grid guards the pattern); for a grid computed from x or drawn, or
    reflection padding, the whole plane."""
    x, grid = _self(call), call.bound["grid"]
    out = call.outs[0]
    d = grid.dim() - 2
    if x.dim() != d + 2 or out.dim() != d + 2 or grid.shape[-1] != d:
        return conservative(tr, call)
    parts = []
    ids = tr.ids(x)
    taps = None
    if ids is not None and not tr.tracked(grid) and not tr.value_dependent(grid):
        taps = _grid_taps(tr, call, ids, grid, out)
    if taps is not None:
        tr.guarded_by(grid)
        parts.append(taps)
    elif ids is not None:
        parts.append(group(tr, ids, list(range(2, 2 + d))))  # (N, C, 1, ...)
    ids = tr.ids(grid)
    if ids is not None:
        point = group(tr, ids, [-1])  # (N, *p, 1)
        parts.append(point.reshape(point.shape[0], 1, *point.shape[1:-1]))  # (N, 1, *p)
    return [combine(tr, out.shape, parts)] + [None] * (len(call.outs) - 1)


def _grid_taps(tr: Tracer, call: Call, ids: Tensor, grid: Tensor, out: Tensor
               ) -> Tensor | None:
    """The ids of a grid sample's output from a constant grid: each point reads the
    pixels around its source coordinate (torch's unnormalisation; border padding clips it,
    zeros padding drops taps outside), ``[floor(s) - 1, floor(s) + 2]`` along each dimension
    (bilinear and nearest read ``floor(s)`` and ``floor(s) + 1`` at most; bicubic one more
    on each side), widened by one for the rounding of the grid's dtype. None (the whole
    plane) for reflection padding, a non-finite grid, or an op without its modes."""
    mode, padding = call.bound.get("interpolation_mode"), call.bound.get("padding_mode")
    align = call.bound.get("align_corners")
    if mode not in (0, 1, 2) or padding not in (0, 1) or align is None:
        return None
    g = grid.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(g).all()):
        return None
    d = g.shape[-1]
    sizes = list(ids.shape[2:])
    n, c = ids.shape[0], ids.shape[1]
    points = math.prod(g.shape[1:-1])
    extra = 2 if mode == 2 else 1
    lows, highs = [], []
    for k in range(d):  # (grid coordinate k runs along the input's dimension d - 1 - k)
        size = sizes[d - 1 - k]
        u = g[..., k].reshape(n, points)
        src = (u + 1) / 2 * (size - 1) if align else ((u + 1) * size - 1) / 2
        if padding == 1 and mode != 2:
            src = src.clamp(0, size - 1)
        lo, hi = torch.floor(src) - extra, torch.floor(src) + 1 + extra
        if padding == 1:
            lo, hi = lo.clamp(0, size - 1), hi.clamp(0, size - 1)
        lows.append(lo.to(_LONG))
        highs.append(hi.to(_LONG))
    width = 2 + 2 * extra
    pos = torch.zeros(n, points, 1, dtype=_LONG)
    ok = torch.ones(n, points, 1, dtype=torch.bool)
    stride = 1
    for k in range(d):
        size = sizes[d - 1 - k]
        at = lows[k].unsqueeze(-1) + torch.arange(width, dtype=_LONG)  # (N, P, width)
        keep = (at <= highs[k].unsqueeze(-1)) & (at >= 0) & (at < size)
        pos = (pos.unsqueeze(-1) + at.clamp(0, size - 1).unsqueeze(-2) * stride).flatten(2)
        ok = (ok.unsqueeze(-1) & keep.unsqueeze(-2)).flatten(2)
        stride *= size
    flat = ids.reshape(n, c, -1)
    taps = pos.shape[-1]
    read = flat.gather(2, pos.reshape(n, 1, -1).expand(n, c, -1)).view(n, c, points, taps)
    rows = torch.arange(n * c * points, dtype=_LONG).view(n, c, points, 1).expand_as(read)
    keep = ok.view(n, 1, points, taps).expand_as(read)
    res = tr.table.union(rows[keep], read[keep], n * c * points)
    return res.view(out.shape)


def _fractional_reach(n_in: int, n_out: int, pool: int) -> Tensor:
    """``(n_out, n_in)``: the input positions output position ``o`` may read along one
    dimension, for any sample ``u`` in ``[0, 1)``: torch starts window ``o`` at
    ``floor((o + u) a) - floor(u a)``, ``a = (n_in - pool) / (n_out - 1)``, which is
    ``floor(o a)`` or one more, and the last at ``n_in - pool``; taken one position wider
    on each side (torch computes the start in the input's dtype, which rounds)."""
    o = torch.arange(n_out, dtype=torch.float64).unsqueeze(1)
    a = (n_in - pool) / (n_out - 1) if n_out > 1 else 0.0
    lo = torch.floor(o * a) - 1
    hi = lo + pool + 2
    lo[-1], hi[-1] = n_in - pool - 1, n_in
    at = torch.arange(n_in, dtype=torch.float64).unsqueeze(0)
    return (at >= lo) & (at <= hi)


@register("fractional_max_pool2d", "fractional_max_pool3d")
def fractional_max_pool(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Fractional max pooling: each output element is the max of its window, which the
    random samples place; every window a draw can give lies inside the reach of
    :func:`_fractional_reach` along each dimension, and the output depends on its
    reach (the product of the dimensions'); the index output carries no set."""
    x = call.bound["self"]
    ids = tr.ids(x)
    if ids is None:
        return [None] * len(call.outs)
    d = int(call.name[len("fractional_max_pool")])
    out = call.outs[0]
    pool = _ints(call.bound["kernel_size"], d, [1])
    sizes, lengths = list(out.shape[out.dim() - d:]), list(x.shape[x.dim() - d:])
    return windowed(tr, call, ids, [_fractional_reach(length, s, k)
                                    for s, length, k in zip(sizes, lengths, pool)])


#: Batched linear algebra: op -> the names of its matrix arguments (``(..., m, n)``); its
#: other tensor arguments (pivots, tolerances) are read as a whole.
_LINALG = {
    "_linalg_solve_ex": ("A", "B"), "linalg_solve_ex": ("A", "B"), "linalg_solve": ("A", "B"),
    "linalg_inv_ex": ("A",), "linalg_inv": ("A",), "inverse": ("self",),
    "_linalg_det": ("A",), "linalg_det": ("A",), "det": ("self",),
    "_linalg_slogdet": ("A",), "linalg_slogdet": ("A",), "slogdet": ("self",),
    "logdet": ("self",),
    "linalg_cholesky_ex": ("self",), "linalg_cholesky": ("self",), "cholesky": ("self",),
    "cholesky_solve": ("self", "input2"), "cholesky_inverse": ("self",),
    "_linalg_eigh": ("A",), "linalg_eigh": ("self",), "linalg_eigvalsh": ("self",),
    "linalg_qr": ("A",), "_linalg_svd": ("A",), "linalg_svd": ("A",), "linalg_svdvals": ("A",),
    "linalg_lu_factor_ex": ("A",), "linalg_lu": ("A",), "linalg_lu_solve": ("LU", "B"),
    "linalg_matrix_exp": ("self",), "linalg_pinv": ("self",),
    "linalg_solve_triangular": ("self", "B"), "triangular_solve": ("self", "A"),
    "linalg_lstsq": ("self", "b"), "linalg_eig": ("self",), "lu_unpack": ("LU_data",),
    "geqrf": ("self",),
}


#: Solves, by the argument that is their right-hand side: column ``j`` of the solution
#: (``left=False``: row ``j``) depends on column (row) ``j`` of it only.
_RHS = {"_linalg_solve_ex": "B", "linalg_solve_ex": "B", "linalg_solve": "B",
        "linalg_solve_triangular": "B", "triangular_solve": "self", "cholesky_solve": "self",
        "linalg_lu_solve": "B"}


@register(*_LINALG)
def batched_linalg(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Each output matrix (vector, number) of batch index ``b`` depends on the matrices of
    index ``b`` of the (broadcast) inputs, and on nothing of the other indices: the batch
    dimensions are those the matrix arguments' leading dimensions broadcast to (a vector
    right-hand side of ``linalg.solve``, ``B`` of shape ``A.shape[:-1]``, has one core
    dimension); a solve's solution (its first output) depends on its right-hand side's
    column (:data:`_RHS`) and the rest of its batch index. An output whose leading
    dimensions are not the batch (an empty residual of ``lstsq``) depends on everything
    the op reads."""
    mats = [(a, call.bound.get(a)) for a in _LINALG[call.name]]
    mats = [(a, t) for a, t in mats if isinstance(t, Tensor)]
    if any(tr.ids(t) is not None for t in call.bound.values() if isinstance(t, Tensor)
           and carries_sets(t) and all(t is not m for _, m in mats)):
        return conservative(tr, call)  # (a tolerance computed from x: read as a whole)
    cores = []
    for a, t in mats:
        core = 2
        if a == "B" and (call.name.endswith("solve_ex") or call.name == "linalg_solve"):
            A = call.bound["A"]
            core = 1 if t.dim() == 1 or (t.dim() == A.dim() - 1 and t.shape == A.shape[:-1]) else 2
        cores.append(min(core, t.dim()))
    try:
        batch = torch.broadcast_shapes(*(t.shape[: t.dim() - c] for (_, t), c in zip(mats, cores)))
    except RuntimeError:
        return conservative(tr, call)
    parts, rhs, others = [], None, None
    for (a, t), c in zip(mats, cores):
        ids = tr.ids(t)
        if ids is None:
            continue
        if a == _RHS.get(call.name) and c == 2:
            rhs = group(tr, ids, [-2 if call.bound.get("left", True) is not False else -1])
        ids = group(tr, ids, list(range(t.dim() - c, t.dim()))) if c else ids
        parts.append((a, ids.reshape(ids.shape[: ids.dim() - c])))
    block = combine(tr, batch, [p for _, p in parts])  # (every matrix argument, whole)
    if rhs is not None:  # (the solution: the others whole, the right-hand side by column)
        others = combine(tr, batch, [p for a, p in parts if a != _RHS[call.name]])
    res: list[Tensor | None] = []
    for i, o in enumerate(call.outs):
        if block is None or not carries_sets(o):
            res.append(None)
        elif tuple(o.shape[: len(batch)]) != tuple(batch):
            res.append(torch.full(o.shape, tr.table.union_all(block), dtype=torch.long))
        elif i == 0 and rhs is not None and o.dim() == len(batch) + 2:
            lead = [] if others is None else [others.reshape(*batch, 1, 1)]
            res.append(combine(tr, o.shape, lead + [rhs]))
        else:
            res.append(block.reshape(*batch, *(1,) * (o.dim() - len(batch))).expand(o.shape))
    return res
