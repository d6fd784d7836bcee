"""Sparsity rules of contractions: matrix products (``mm``, ``bmm``, ``addmm``, ``mv``,
``dot``, ...) and convolutions (any number of spatial dimensions, strided, dilated, padded,
grouped, transposed); and of max and average pooling (adaptive too), window by window.

NOTE [contraction rule]
In ``C = A @ B``, ``C[i, k]`` depends on ``A[i, j]`` for every ``j`` where ``B[j, k]`` may be
non-zero, and on ``B[j, k]`` for every ``j`` where ``A[i, j]`` may be non-zero. An element
may be non-zero unless it is a constant zero: its value is 0 and it does not depend on the
input, so the zeros of a weight matrix are structural and a banded or block-diagonal weight
gives a banded or block-diagonal pattern. Columns of ``B`` with the same non-zero pattern
give the same unions, so the columns are grouped by pattern first (hashed, then checked
exactly): a dense weight has one pattern, and the rule costs one reference per element of
``A`` instead of one per multiply-add. A convolution is the same contraction after
``unfold``: the input's ids are padded with empty sets and unfolded into windows (which is
what the convolution reads), the weight's non-zero pattern, expanded over its groups,
plays ``B``. A transposed convolution is a convolution of the input spread out by the
stride, with the kernel flipped. A weight that depends on the input is ruled per output
channel (every output element of a channel depends on all of the channel's weights).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torch_vjp._sparse.rules import combine, group, register
from torch_vjp._sparse.tracer import Call, Tracer

__all__ = ["maybe_nonzero", "stored", "unique_rows", "contract", "product_ids", "windowed"]

_LONG = torch.long


def maybe_nonzero(tr: Tracer, t: Tensor) -> Tensor:
    """Where ``t`` may be non-zero at other inputs: non-zero here, or not a constant. A
    tensor some of whose values were computed from the input's values or drawn at random
    (a 0/1 mask ``(x > 0).double()``, a weight picked by ``where`` on x, ``dropout(W)``)
    may be non-zero everywhere: its zeros move with x (or the draw), so none of them is
    structural (NOTE [a pattern shaped by values] in :mod:`~torch_vjp._sparse.tracer`)."""
    if t.layout is not torch.strided:
        return stored(tr, t)
    if tr.value_dependent(t):
        return torch.ones(t.shape, dtype=torch.bool)
    nz = t.detach().cpu() != 0
    ids = tr.ids(t)
    nz = nz if ids is None else nz | (ids != 0)
    if not bool(nz.all()):  # (NOTE [structural zeros that move] in torch_vjp._sparse.tracer)
        tr.guarded_by(t)
    return nz


def stored(tr: Tracer, t: Tensor) -> Tensor:
    """The dense boolean pattern of the entries a constant sparse tensor stores (COO, CSR,
    CSC, BSR or BSC): its may-be-non-zeros (all of them where its values or indices were
    computed from x's values: NOTE [a pattern shaped by values] in
    :mod:`~torch_vjp._sparse.tracer`). (A tracked sparse tensor is ruled conservatively
    before any rule.)"""
    if tr.value_dependent(t):
        return torch.ones(t.shape, dtype=torch.bool)
    t = t.detach()
    if t.layout is torch.sparse_coo:
        parts = (t._indices(), t._values())
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (t.crow_indices(), t.col_indices(), t.values())
    else:
        parts = (t.ccol_indices(), t.row_indices(), t.values())
    if any(tr.value_dependent(part) for part in parts):
        return torch.ones(t.shape, dtype=torch.bool)
    indices = (t if t.layout is torch.sparse_coo else t.to_sparse_coo())._indices()
    nz = torch.zeros(t.shape, dtype=torch.bool)
    # (a hybrid tensor's dense dimensions: every element of a stored block)
    nz[tuple(indices.cpu())] = True
    return nz


def _operand(tr: Tracer, t: Any) -> Any:
    """A constant sparse operand of a product as a COO tensor storing the same entries, all
    of them where the stored ones were computed from x's values (read off the operand
    itself: the rules' reshapes and indexing make new tensors, and CSR, CSC, BSR and BSC
    tensors, without strides, refuse them: the op was ruled dense); any other operand as
    it is."""
    if not isinstance(t, Tensor) or t.layout is torch.strided:
        return t
    return stored(tr, t).to(t.dtype).to_sparse()


def unique_rows(mat: Tensor) -> tuple[Tensor, Tensor]:
    """The distinct rows of a boolean matrix and, for each row, the index of its copy.

    Example:
        >>> pats, inv = unique_rows(torch.tensor([[1, 0], [0, 1], [1, 0]], dtype=torch.bool))
        >>> pats.int().tolist(), inv.tolist()
        ([[1, 0], [0, 1]], [0, 1, 0])
    """
    r, q = mat.shape
    if r <= 1:
        return mat, torch.zeros(r, dtype=_LONG)
    gen = torch.Generator().manual_seed(q)
    h = mat.double() @ torch.rand(q, dtype=torch.float64, generator=gen)
    _, inv = torch.unique(h, return_inverse=True)
    first = torch.full((int(inv.max()) + 1,), r, dtype=_LONG).scatter_reduce_(
        0, inv, torch.arange(r, dtype=_LONG), reduce="amin"
    )
    rep = first[inv]
    ok = (mat == mat[rep]).all(1)
    if not bool(ok.all()):  # a hash collision: those rows stand alone
        rep = torch.where(ok, rep, torch.arange(r, dtype=_LONG))
    reps, inverse = torch.unique(rep, return_inverse=True)
    return mat[reps], inverse


def contract(tr: Tracer, a_ids: Tensor, nz: Tensor) -> Tensor:
    """``out[b, i, k]``: the union of ``a_ids[b, i, j]`` over the ``j`` where
    ``nz[b, j, k]``. See NOTE [contraction rule].

    Args:
        a_ids: ``(B, P, Q)`` set ids.
        nz: ``(B, Q, R)`` booleans.

    Returns:
        ``(B, P, R)`` set ids.
    """
    b, p, q = a_ids.shape
    r = nz.shape[2]
    pats, inv = unique_rows(nz.transpose(1, 2).reshape(b * r, q))
    u = pats.shape[0]
    keys, pidx = torch.unique(
        torch.arange(b, dtype=_LONG).unsqueeze(1) * u + inv.view(b, r), return_inverse=True
    )
    pb = torch.div(keys, u, rounding_mode="floor")
    pc = keys - pb * u
    pc_idx, pj_idx = pats.nonzero(as_tuple=True)
    cnt = torch.bincount(pc_idx, minlength=u)
    start = torch.cumsum(cnt, 0) - cnt
    lens = cnt[pc]
    n_pairs = keys.numel()
    e_pair = torch.repeat_interleave(torch.arange(n_pairs, dtype=_LONG), lens)
    local = torch.arange(e_pair.numel(), dtype=_LONG) - torch.repeat_interleave(
        torch.cumsum(lens, 0) - lens, lens
    )
    e_j = pj_idx[start[pc][e_pair] + local]
    ids = a_ids[pb[e_pair], :, e_j]  # (E, P)
    rows = e_pair.unsqueeze(1) * p + torch.arange(p, dtype=_LONG)
    res = tr.table.union(rows.reshape(-1), ids.reshape(-1), n_pairs * p).view(n_pairs, p)
    return res[pidx].transpose(1, 2)


def product_ids(tr: Tracer, a: Tensor, b: Tensor) -> Tensor | None:
    """The ids of the batched product ``a @ b`` of ``(B, P, Q)`` and ``(B, Q, R)`` tensors
    (values), from both operands' ids. See NOTE [contraction rule]."""
    a_ids, b_ids = tr.ids(a), tr.ids(b)
    shape = (a.shape[0], a.shape[1], b.shape[2])
    terms: list[Tensor | None] = []
    if a_ids is not None:
        terms.append(contract(tr, a_ids, maybe_nonzero(tr, b)))
    if b_ids is not None:
        left = maybe_nonzero(tr, a).transpose(1, 2)
        terms.append(contract(tr, b_ids.transpose(1, 2), left).transpose(1, 2))
    return combine(tr, shape, terms)


def _with_bias(tr: Tracer, call: Call, prod: Tensor | None, shape: torch.Size) -> list:
    bias = call.bound.get("self")
    parts = [prod]
    if isinstance(bias, Tensor) and call.bound.get("beta", 1) != 0:
        parts.append(tr.ids(bias))
    return [combine(tr, shape, parts)]


@register("mm", "bmm", "addmm", "baddbmm", "_addmm_activation", "addbmm")
def matrix_product(tr: Tracer, call: Call) -> list[Tensor | None]:
    """``mm``/``bmm`` and their ``add`` forms (bias + product)."""
    if call.name in ("mm", "bmm"):
        a, b = call.bound["self"], call.bound["mat2"]
    elif call.name in ("addmm", "_addmm_activation"):
        a, b = call.bound["mat1"], call.bound["mat2"]
    else:
        a, b = call.bound["batch1"], call.bound["batch2"]
    a, b = _operand(tr, a), _operand(tr, b)
    batched = a.dim() == 3
    prod = product_ids(tr, a if batched else a[None], b if batched else b[None])
    if prod is not None and not batched:
        prod = prod[0]
    if call.name == "addbmm" and prod is not None:
        prod = group(tr, prod, [0])[0]
    shape = call.outs[0].shape
    if call.name in ("mm", "bmm"):
        return [prod]
    return _with_bias(tr, call, prod, shape)


@register("mv", "addmv", "dot", "vdot", "addr", "inner")
def vector_product(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Matrix-vector, dot and outer products, as matrix products of reshaped operands."""
    bd = {k: _operand(tr, v) for k, v in call.bound.items()}
    if call.name == "mv":
        a, b = bd["self"][None], bd["vec"].reshape(1, -1, 1)
    elif call.name == "addmv":
        a, b = bd["mat"][None], bd["vec"].reshape(1, -1, 1)
    elif call.name in ("dot", "vdot", "inner"):
        other = bd.get("tensor", bd.get("other"))
        a, b = bd["self"].reshape(1, 1, -1), other.reshape(1, -1, 1)
    else:  # addr: outer product
        a, b = bd["vec1"].reshape(1, -1, 1), bd["vec2"].reshape(1, 1, -1)
    shape = call.outs[0].shape
    prod = product_ids(tr, a, b)
    prod = None if prod is None else prod.reshape(shape)
    if call.name in ("addmv", "addr"):
        return _with_bias(tr, call, prod, shape)
    return [prod]


def _full_weight_pattern(wnz: Tensor, groups: int, co: int, ci: int, transposed: bool) -> Tensor:
    """The ``(Co, Ci, *K)`` pattern of the equivalent ungrouped, untransposed kernel."""
    k = wnz.shape[2:]
    if transposed:  # (Ci, Co/g, *K): flip the kernel, swap the channel roles
        wnz = wnz.flip(list(range(2, wnz.dim())))
    full = torch.zeros((co, ci, *k), dtype=torch.bool)
    cog, cig = co // groups, ci // groups
    for g in range(groups):
        if transposed:
            block = wnz[g * cig : (g + 1) * cig].transpose(0, 1)
        else:
            block = wnz[g * cog : (g + 1) * cog]
        full[g * cog : (g + 1) * cog, g * cig : (g + 1) * cig] = block
    return full


@register("convolution", "_convolution", "convolution_overrideable")
def convolution(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Convolutions of any dimension. See NOTE [contraction rule]."""
    bd = call.bound
    x, w, bias = bd["input"], bd["weight"], bd.get("bias")
    out = call.outs[0]
    if x.dim() != w.dim() or x.dim() < 3:
        raise ValueError("unbatched convolution")
    stride, padding, dilation = list(bd["stride"]), list(bd["padding"]), list(bd["dilation"])
    transposed, groups = bool(bd["transposed"]), int(bd["groups"])
    n, ci = x.shape[:2]
    d = x.dim() - 2
    co = out.shape[1]
    k = list(w.shape[2:])
    if len(stride) == 1:
        stride, padding, dilation = stride * d, padding * d, dilation * d
    terms: list[Tensor | None] = []
    x_ids = tr.ids(x)
    if x_ids is not None:
        if transposed:
            out_pad = list(bd["output_padding"]) or [0] * d
            out_pad = out_pad * d if len(out_pad) == 1 else out_pad
            big = [(s - 1) * st + 1 for s, st in zip(x.shape[2:], stride)]
            xi = torch.zeros((n, ci, *big), dtype=_LONG)
            xi[(slice(None), slice(None), *[slice(None, None, st) for st in stride])] = x_ids
            lo = [dl * (kk - 1) - p for dl, kk, p in zip(dilation, k, padding)]
            hi = [a + op for a, op in zip(lo, out_pad)]
            step = [1] * d
        else:
            xi, lo, hi, step = x_ids, padding, padding, stride
        pads: list[int] = []
        for i in reversed(range(d)):
            pads += [lo[i], hi[i]]
        xi = F.pad(xi, pads)
        for i in range(d):
            xi = xi.unfold(2 + i, dilation[i] * (k[i] - 1) + 1, step[i])
        xi = xi[(slice(None),) * (2 + d) + tuple(slice(None, None, dl) for dl in dilation)]
        if tuple(xi.shape[2 : 2 + d]) != tuple(out.shape[2:]):
            raise ValueError("convolution output size not reproduced")
        n_pos, n_k = math.prod(out.shape[2:]), math.prod(k)
        a = xi.permute(0, *range(2, 2 + d), 1, *range(2 + d, 2 + 2 * d)).reshape(
            1, n * n_pos, ci * n_k
        )
        full = _full_weight_pattern(maybe_nonzero(tr, w), groups, co, ci, transposed)
        nz = full.permute(1, *range(2, 2 + d), 0).reshape(1, ci * n_k, co)
        res = contract(tr, a, nz).view(n, *out.shape[2:], co)
        terms.append(res.permute(0, d + 1, *range(1, d + 1)))
    w_ids = tr.ids(w)
    if w_ids is not None:
        if transposed and groups > 1:
            per_co = torch.full((1, co) + (1,) * d, tr.table.union_all(w_ids), dtype=_LONG)
        elif transposed:
            per_co = group(tr, w_ids, [0] + list(range(2, w.dim()))).reshape(1, co, *[1] * d)
        else:
            per_co = group(tr, w_ids, list(range(1, w.dim()))).reshape(1, co, *[1] * d)
        terms.append(per_co)
    if isinstance(bias, Tensor):
        b_ids = tr.ids(bias)
        if b_ids is not None:
            terms.append(b_ids.reshape(1, co, *[1] * d))
    return [combine(tr, out.shape, terms)]


def _ints(value: object, d: int, default: list[int]) -> list[int]:
    got = [int(v) for v in value] if isinstance(value, (list, tuple)) else (
        [] if value is None else [int(value)])
    if not got:
        got = default
    return got * d if len(got) == 1 else got


@register("max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices",
          "max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool1d", "avg_pool2d",
          "avg_pool3d")
def pooling(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Max and average pooling (any padding, stride, dilation, ``ceil_mode``): each output
    element depends on its window of the input (padded with empty sets), as a convolution
    of one channel with a dense kernel; a max's index output carries no set."""
    x = call.bound["self"]
    ids = tr.ids(x)
    if ids is None:
        return [None] * len(call.outs)
    d = int(call.name.split("pool")[1][0])
    out = call.outs[0]
    kernel = _ints(call.bound["kernel_size"], d, [1])
    stride = _ints(call.bound.get("stride"), d, kernel)
    padding = _ints(call.bound.get("padding"), d, [0])
    dilation = _ints(call.bound.get("dilation"), d, [1])
    lead = ids.shape[: ids.dim() - d]
    xi = ids.reshape(-1, *ids.shape[ids.dim() - d:])
    pads: list[int] = []
    for i in reversed(range(d)):  # (the far side padded a stride more: ceil_mode's window)
        pads += [padding[i], padding[i] + stride[i]]
    xi = F.pad(xi, pads)
    for i in range(d):
        xi = xi.unfold(1 + i, dilation[i] * (kernel[i] - 1) + 1, stride[i])
    xi = xi[(slice(None),) * (1 + d) + tuple(slice(None, None, dl) for dl in dilation)]
    size = list(out.shape[out.dim() - d:])
    if any(have < want for have, want in zip(xi.shape[1 : 1 + d], size)):
        raise ValueError("pooling output size not reproduced")
    xi = xi[(slice(None),) + tuple(slice(0, s) for s in size)]
    res = group(tr, xi, list(range(1 + d, 1 + 2 * d))).reshape(*lead, *size)
    return [res] + [None] * (len(call.outs) - 1)


@register("_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_avg_pool1d",
          "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d")
def adaptive_pooling(tr: Tracer, call: Call) -> list[Tensor | None]:
    """Adaptive pooling: output position ``o`` of a dimension of input size ``L`` and output
    size ``S`` reads the window ``[floor(o L / S), ceil((o + 1) L / S))``; each output
    element depends on its window (the product of the dimensions' windows)."""
    x = call.bound["self"]
    ids = tr.ids(x)
    if ids is None:
        return [None] * len(call.outs)
    out = call.outs[0]
    d = int(call.name.split("pool")[1][0])
    sizes, lengths = list(out.shape[out.dim() - d:]), list(x.shape[x.dim() - d:])
    insides = []
    for s, length in zip(sizes, lengths):
        o = torch.arange(s).unsqueeze(1)
        at = torch.arange(length).unsqueeze(0)
        insides.append((at >= (o * length) // s) & (at < -((-(o + 1) * length) // s)))
    return windowed(tr, call, ids, insides)


def windowed(tr: Tracer, call: Call, ids: Tensor, insides: list[Tensor]) -> list[Tensor | None]:
    """The sets of a pooling's output, whose last ``len(insides)`` dimensions each read a
    window of the input's: ``insides[k][o, i]`` is whether output position ``o`` of the k-th
    of them reads input position ``i``; an output element depends on the product of its
    dimensions' windows (the other outputs, indices, carry no set)."""
    d = len(insides)
    sizes = [inside.shape[0] for inside in insides]
    lengths = [inside.shape[1] for inside in insides]
    member = torch.ones(1, 1, dtype=torch.bool)
    for inside, s, length in zip(insides, sizes, lengths):
        member = (member.unsqueeze(1).unsqueeze(3) & inside.unsqueeze(0).unsqueeze(2)).reshape(
            member.shape[0] * s, member.shape[1] * length)
    lead = ids.shape[: ids.dim() - d]
    flat = ids.reshape(1, -1, math.prod(lengths))
    res = contract(tr, flat, member.t().unsqueeze(0)).reshape(*lead, *sizes)
    return [res] + [None] * (len(call.outs) - 1)


@register("_sparse_addmm")
def sparse_matrix_product(tr: Tracer, call: Call) -> list[Tensor | None]:
    """``torch.sparse.mm(A, B)`` and ``torch.sparse.addmm``: a constant sparse ``A`` (a
    tracked one is ruled conservatively before any rule) times a dense ``B``; ``A``'s
    stored entries are its may-be-non-zeros (all of them where its values or indices were
    computed from x's values: NOTE [a pattern shaped by values] in
    :mod:`~torch_vjp._sparse.tracer`)."""
    a, b = call.bound["mat1"], call.bound["mat2"]
    shape = call.outs[0].shape
    b_ids = tr.ids(b)
    prod = None
    if b_ids is not None:
        nz = stored(tr, a)
        prod = contract(tr, b_ids.transpose(0, 1)[None], nz.transpose(0, 1)[None])[0]
        prod = prod.transpose(0, 1)
    return _with_bias(tr, call, prod, shape)
