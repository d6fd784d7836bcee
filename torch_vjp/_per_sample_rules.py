"""Per-layer rules for per-sample gradients, from one ordinary forward and backward pass.

A layer such as ``nn.Linear`` computes ``y = x W^T + b`` row by row, so the gradient that
example ``i`` alone gives ``W`` is ``sum_t g[i, t] x[i, t]^T``, where ``x[i, t]`` are the rows of
the layer's input that belong to example ``i`` and ``g = dL/dy`` is the output gradient of the
per-example losses. Forward hooks record each layer call's input and output edge
(:class:`Recorder`), one ``torch.autograd.grad`` call on those edges gives the output
gradients, and the rules below turn each recorded call into factors (NOTE [Factors]).
"""

# NOTE [Factors]
# A factor describes the per-sample gradient of one region of one parameter (the whole
# parameter, or a block of rows of it, such as the query rows of a packed attention
# in-projection) without necessarily materialising it:
#
# - ``SmallFactor``: the per-sample gradient itself, ``(B, *region_shape)``; used where it is
#   small (biases, normalisation weights, attention's bias_k / bias_v).
# - ``OuterFactor``: ``G_i = sum_t g[i, t] a[i, t]^T`` for ``a: (B, T, p)``, ``g: (B, T, q)``
#   (Linear over any leading dimensions, attention projections). Squared norms use the
#   ghost-norm identity ``<a_i a_i^T, g_i g_i^T>`` when ``T (p + q) <= p q``, else the direct
#   ``||G_i||^2`` in chunks of examples; ``T == 1`` gives ``||a_i||^2 ||g_i||^2``. The clipped
#   sum ``sum_i c_i G_i`` is one matrix product over the B * T rows.
# - ``ConvFactor``: the same for Conv1d/Conv2d weights, through unfold (ghost, or per-sample
#   gradients by one batched product) or one grouped convolution with a group per example.
# - ``EmbeddingFactor``: ``G_i = sum_t onehot(idx[i, t]) g[i, t]^T``; norms and sums by
#   index_add over the distinct (example, index) pairs, never a ``(B, V, D)`` tensor.
#
# Every factor can write its per-sample gradients into a caller's buffer, give the (B,)
# squared norms of its region, and give the clipped weighted sum ``sum_i c_i G_i``. Factors
# of one region are merged before norms are taken (two calls of one Linear concatenate along
# T), because norms are not additive; factors of different kinds on one region (tied weights)
# are materialised for that parameter alone.

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = [
    "Call",
    "Factor",
    "SmallFactor",
    "OuterFactor",
    "ConvFactor",
    "EmbeddingFactor",
    "Recorder",
    "rule_for",
    "merge_factors",
    "chunks",
    "sq_norms_rows",
]

# Elements a temporary may hold before the work is split into chunks of examples.
CHUNK_ELEMENTS = 1 << 23


def sq_norms_rows(v: Tensor) -> Tensor:
    """Squared L2 norm of each row of ``v`` viewed as ``(B, -1)``."""
    return torch.linalg.vector_norm(v.reshape(v.shape[0], -1), dim=1).square_()


# Elements the temporaries of a norms-only or clipped-sum computation may hold for one layer
# (1 MB in float32): these calls promise no buffer of the order of B x P, and on a small
# model a layer's temporaries (an unfolded input, say) can be as large as B x P itself.
NORM_CHUNK_ELEMENTS = 1 << 18


def chunks(
    batch: int, per_example: int, chunk_size: int | None = None, budget: int | None = None
) -> Iterator[tuple[int, int]]:
    """Yields ``(start, stop)`` ranges of examples whose temporaries stay under the budget
    (``CHUNK_ELEMENTS`` unless given)."""
    limit = CHUNK_ELEMENTS if budget is None else budget
    step = max(1, limit // max(1, per_example))
    if chunk_size is not None:
        step = min(step, chunk_size)
    for start in range(0, batch, step):
        yield start, min(batch, start + step)


# --------------------------------------------------------------------------------------------
# Factors
# --------------------------------------------------------------------------------------------


class Factor:
    """The per-sample gradient of one region of a parameter (see NOTE [Factors])."""

    rows: slice | None = None
    region_shape: tuple[int, ...] = ()

    @property
    def batch(self) -> int:
        raise NotImplementedError

    def write(self, out: Tensor, accumulate: bool, chunk_size: int | None) -> None:
        """Writes (or adds) the per-sample gradients into ``out`` of shape ``(B, *region_shape)``."""
        raise NotImplementedError

    def sq_norms(self, chunk_size: int | None) -> Tensor:
        """The ``(B,)`` squared L2 norms of the per-sample gradients of this region."""
        raise NotImplementedError

    def weighted_sum(self, c: Tensor) -> Tensor:
        """``sum_i c[i] G_i``, of shape ``region_shape``."""
        raise NotImplementedError

    def merge_key(self) -> Any:
        """Factors with equal keys describe one region the same way and can be merged."""
        return None


class SmallFactor(Factor):
    """Per-sample gradients held as they are, ``value: (B, *region_shape)``."""

    def __init__(self, value: Tensor, rows: slice | None = None):
        self.value = value
        self.rows = rows
        self.region_shape = tuple(value.shape[1:])

    @property
    def batch(self) -> int:
        return self.value.shape[0]

    def write(self, out: Tensor, accumulate: bool, chunk_size: int | None) -> None:
        if accumulate:
            out.add_(self.value)
        else:
            out.copy_(self.value)

    def sq_norms(self, chunk_size: int | None) -> Tensor:
        return sq_norms_rows(self.value)

    def weighted_sum(self, c: Tensor) -> Tensor:
        return torch.tensordot(c, self.value, dims=1)

    def merge_key(self) -> Any:
        return ("small", self.rows, self.region_shape)

    @staticmethod
    def merge(factors: list[Factor]) -> Factor:
        total = factors[0].value.clone()  # type: ignore[attr-defined]
        for f in factors[1:]:
            total.add_(f.value)  # type: ignore[attr-defined]
        return SmallFactor(total, factors[0].rows)


class OuterFactor(Factor):
    """``G_i = sum_t g[i, t] a[i, t]^T`` with ``a: (B, T, p)``, ``g: (B, T, q)``.

    ``region_shape`` is the region's own shape, ``(q, p)``: a Linear weight, or a block of
    rows of one (an attention projection).
    """

    def __init__(self, a: Tensor, g: Tensor, region_shape: tuple[int, ...], rows: slice | None = None):
        self.a = a
        self.g = g
        self.rows = rows
        self.region_shape = tuple(region_shape)

    @property
    def batch(self) -> int:
        return self.a.shape[0]

    def write(self, out: Tensor, accumulate: bool, chunk_size: int | None) -> None:
        a, g = self.a, self.g
        B, T, p = a.shape
        q = g.shape[2]
        try:
            out3 = out.view(B, q, p)
        except RuntimeError:
            tmp = torch.empty((B, q, p), dtype=out.dtype, device=out.device)
            self.write(tmp, False, chunk_size)
            tmp = tmp.view(out.shape)
            out.add_(tmp) if accumulate else out.copy_(tmp)
            return
        for s, e in chunks(B, 1, chunk_size):
            o = out3[s:e]
            if T == 1:
                gs, as_ = g[s:e, 0, :, None], a[s:e, 0, None, :]
                if accumulate:
                    o.addcmul_(gs, as_)
                else:
                    torch.mul(gs, as_, out=o)
            elif accumulate:
                o.baddbmm_(g[s:e].mT, a[s:e])
            else:
                torch.bmm(g[s:e].mT, a[s:e], out=o)

    def use_ghost(self) -> bool:
        """Whether the ghost-norm identity is cheaper than forming each ``G_i``."""
        _, T, p = self.a.shape
        q = self.g.shape[2]
        return T * (p + q) <= p * q

    def sq_norms(self, chunk_size: int | None) -> Tensor:
        a, g = self.a, self.g
        B, T, p = a.shape
        q = g.shape[2]
        if T == 1:
            return sq_norms_rows(a).mul_(sq_norms_rows(g))
        out = a.new_empty(B)
        if self.use_ghost():
            for s, e in chunks(B, 2 * T * T, chunk_size, NORM_CHUNK_ELEMENTS):
                aa = torch.bmm(a[s:e], a[s:e].mT)
                gg = torch.bmm(g[s:e], g[s:e].mT)
                out[s:e] = aa.mul_(gg).view(e - s, -1).sum(1)
        else:
            buf = None
            for s, e in chunks(B, p * q, chunk_size, NORM_CHUNK_ELEMENTS):
                if buf is None or buf.shape[0] != e - s:
                    buf = a.new_empty((e - s, q, p))
                torch.bmm(g[s:e].mT, a[s:e], out=buf)
                out[s:e] = sq_norms_rows(buf)
        return out

    def weighted_sum(self, c: Tensor) -> Tensor:
        B, T, p = self.a.shape
        q = self.g.shape[2]
        gc = self.g * c.view(B, 1, 1)
        res = torch.mm(gc.reshape(B * T, q).T, self.a.reshape(B * T, p))
        return res.view(self.region_shape)

    def merge_key(self) -> Any:
        return ("outer", self.rows, self.region_shape, self.a.shape[2], self.g.shape[2])

    @staticmethod
    def merge(factors: list[Factor]) -> Factor:
        a = torch.cat([f.a for f in factors], dim=1)  # type: ignore[attr-defined]
        g = torch.cat([f.g for f in factors], dim=1)  # type: ignore[attr-defined]
        return OuterFactor(a, g, factors[0].region_shape, factors[0].rows)


class EmbeddingFactor(Factor):
    """``G_i = sum_t onehot(idx[i, t]) g[i, t]^T``: ``idx: (B, T)`` integers, ``g: (B, T, D)``."""

    def __init__(self, idx: Tensor, g: Tensor, num_embeddings: int, padding_idx: int | None):
        if padding_idx is not None:
            keep = idx != padding_idx
            g = g * keep.unsqueeze(-1).to(g.dtype)
        self.idx = idx
        self.g = g
        self.num = num_embeddings
        self.padding_idx = padding_idx
        self.region_shape = (num_embeddings, g.shape[2])

    @property
    def batch(self) -> int:
        return self.idx.shape[0]

    def _keys(self) -> Tensor:
        B = self.idx.shape[0]
        base = torch.arange(B, device=self.idx.device).unsqueeze(1) * self.num
        return (base + self.idx).reshape(-1)

    def write(self, out: Tensor, accumulate: bool, chunk_size: int | None) -> None:
        B, T, D = self.g.shape
        if not accumulate:
            out.zero_()
        keys = self._keys()
        if out.is_contiguous():
            out.view(B * self.num, D).index_add_(0, keys, self.g.reshape(B * T, D))
        else:
            tmp = torch.zeros((B * self.num, D), dtype=out.dtype, device=out.device)
            tmp.index_add_(0, keys, self.g.reshape(B * T, D))
            out.add_(tmp.view(out.shape))

    def sq_norms(self, chunk_size: int | None) -> Tensor:
        B, T, D = self.g.shape
        uniq, inv = torch.unique(self._keys(), return_inverse=True)
        acc = self.g.new_zeros((uniq.numel(), D)).index_add_(0, inv, self.g.reshape(B * T, D))
        rows = sq_norms_rows(acc)
        return self.g.new_zeros(B).index_add_(0, torch.div(uniq, self.num, rounding_mode="floor"), rows)

    def weighted_sum(self, c: Tensor) -> Tensor:
        B, T, D = self.g.shape
        gc = (self.g * c.view(B, 1, 1)).reshape(B * T, D)
        return self.g.new_zeros((self.num, D)).index_add_(0, self.idx.reshape(-1), gc)

    def merge_key(self) -> Any:
        return ("embedding", self.num, self.g.shape[2])

    @staticmethod
    def merge(factors: list[Factor]) -> Factor:
        idx = torch.cat([f.idx for f in factors], dim=1)  # type: ignore[attr-defined]
        g = torch.cat([f.g for f in factors], dim=1)  # type: ignore[attr-defined]
        return EmbeddingFactor(idx, g, factors[0].num, None)  # type: ignore[attr-defined]


def merge_factors(factors: list[Factor]) -> Factor | None:
    """Merges factors of one region into one, or returns None if they are of different kinds."""
    if len(factors) == 1:
        return factors[0]
    key = factors[0].merge_key()
    if key is None or any(f.merge_key() != key for f in factors[1:]):
        return None
    return type(factors[0]).merge(factors)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# Recorded calls and the rules that turn them into factors
# --------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One use of parameters by a layer that has a rule, recorded during the forward pass.

    ``params`` maps a role (``"weight"``, ``"bias"``) to the parameter tensor and the block of
    its rows that the call used (None: all of it). ``x`` is the layer's input (integer indices
    for Embedding). ``allowed`` are the dimensions of ``x`` that may hold the examples;
    ``fixed`` says the dimension is known from the layer's contract (attention's batch
    dimension), so no probing is needed.
    """

    rule: Rule
    module: nn.Module | None
    path: str
    params: dict[str, tuple[Tensor, slice | None]]
    x: Tensor
    out_edge: GradientEdge | None
    in_edges: list[GradientEdge]
    allowed: tuple[int, ...]
    fixed: bool = False
    x_version: int = 0
    x_shape: tuple[int, ...] = ()
    out_shape: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    bdim: int | None = None
    valid: bool = True
    reason: str = ""
    # No weight or bias of the layer is computed from other tensors (a parametrization), so
    # the graph walk may skip the layer's internals (see per_sample._walk).
    complete: bool = True


def _edge(t: Tensor) -> GradientEdge | None:
    fn = t.grad_fn
    if fn is not None:
        return GradientEdge(fn, t.output_nr)
    return get_gradient_edge(t) if t.requires_grad else None


def _out_edge(y: Tensor) -> GradientEdge | None:
    """The edge that receives ``dL/dy``, robust to later in-place changes of ``y``.

    ``F.linear`` on 3-D inputs returns a view of its 2-D result; an in-place op on that view
    (``relu_``) rebases the graph so that the view's own node drops out of it. The base's
    node stays, so for a view that is a plain reshape of its whole base the base's edge is
    used (its gradient is reshaped back to ``y.shape``).
    """
    if not y.requires_grad:
        return None
    base = y._base
    if (
        base is not None
        and base.requires_grad
        and base.numel() == y.numel()
        and y.is_contiguous()
        and base.is_contiguous()
        and y.storage_offset() == base.storage_offset()
    ):
        return _edge(base)
    return _edge(y)


def _to_batch_first(t: Tensor, bdim: int | None, batch: int) -> Tensor:
    """Moves the examples' dimension to the front; ``bdim=None`` means one example (B == 1)."""
    if bdim is None:
        return t.unsqueeze(0)
    return t.movedim(bdim, 0) if bdim != 0 else t


class Rule:
    """Turns a recorded call and its output gradient into factors, one per selected role."""

    name = "rule"

    def factors(self, call: Call, g: Tensor, roles: set[str], batch: int) -> list[tuple[str, Factor]]:
        raise NotImplementedError


class LinearRule(Rule):
    name = "Linear"

    def factors(self, call, g, roles, batch):
        x = _to_batch_first(call.x, call.bdim, batch)
        gb = _to_batch_first(g, call.bdim, batch)
        p, q = x.shape[-1], gb.shape[-1]
        a = x.reshape(batch, -1, p)
        gg = gb.reshape(batch, -1, q)
        out: list[tuple[str, Factor]] = []
        if "weight" in roles:
            w, rows = call.params["weight"]
            out.append(("weight", OuterFactor(a, gg, (q, p), rows)))
        if "bias" in roles:
            _, rows = call.params["bias"]
            val = gg[:, 0] if gg.shape[1] == 1 else gg.sum(1)
            out.append(("bias", SmallFactor(val, rows)))
        return out


def unfold2d(
    x: Tensor,
    kernel: tuple[int, int],
    dilation: tuple[int, int],
    padding: tuple[int, int],
    stride: tuple[int, int],
) -> Tensor:
    """``F.unfold`` as one strided copy: ``(B, C, H, W) -> (B, C * kh * kw, L)``.

    Same layout as ``F.unfold`` (channel-major patch rows), built from an ``as_strided`` view
    of the padded input; torch's CPU im2col loops over examples and is far slower.
    """
    if padding[0] or padding[1]:
        x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    x = x.contiguous()
    B, C, H, W = x.shape
    kh, kw = kernel
    dh, dw = dilation
    sh, sw = stride
    oh = (H - dh * (kh - 1) - 1) // sh + 1
    ow = (W - dw * (kw - 1) - 1) // sw + 1
    sB, sC, sH, sW = x.stride()
    patches = x.as_strided(
        (B, C, kh, kw, oh, ow), (sB, sC, dh * sH, dw * sW, sh * sH, sw * sW), x.storage_offset()
    )
    return patches.reshape(B, C * kh * kw, oh * ow)


class ConvFactor(Factor):
    """Per-sample gradients of a Conv weight from its input ``x: (B, C, H, W)`` and output
    gradient ``g: (B, O, H', W')`` (Conv1d is handled as a 2-D conv of height 1).

    Per-sample gradients come from ``unfold`` and one batched matrix product when a patch is
    short (few input channels: many small products would be slow in a grouped convolution),
    else from one grouped convolution whose groups are the examples (``groups = B * groups``).
    Squared norms use the ghost identity over the output positions when that is cheaper;
    otherwise the per-sample gradients are formed in chunks of examples. Either way the
    temporaries (unfolded inputs, per-sample gradients) stay under ``NORM_CHUNK_ELEMENTS``
    per chunk, so no buffer of the order of B x P exists. The clipped sum is one ordinary
    convolution weight gradient with ``g`` scaled per example.
    """

    def __init__(self, x, g, weight_shape, region_shape, stride, padding, dilation, groups):
        self.x = x
        self.g = g
        self.weight_shape = tuple(weight_shape)  # 2-D: (O, C / groups, kh, kw)
        self.region_shape = tuple(region_shape)  # the parameter's own shape
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.rows = None

    @property
    def batch(self) -> int:
        return self.x.shape[0]

    def _dims(self):
        O, cg, kh, kw = self.weight_shape
        L = self.g.shape[2] * self.g.shape[3]
        return O, cg, kh * kw, L

    def _per_sample(self, s: int, e: int) -> Tensor:
        """Per-sample gradients of examples ``s:e``, shape ``(e - s, *weight_shape)``."""
        O, cg, k, L = self._dims()
        G = self.groups
        x, g = self.x[s:e], self.g[s:e]
        n = e - s
        if cg * k < 64:
            U = unfold2d(x, self.weight_shape[2:], self.dilation, self.padding, self.stride)
            g3 = g.reshape(n, O, L)
            if G == 1:
                # U g^T, read transposed: U (n, C k, L) is contiguous along L, the summed
                # dimension, so no operand is transposed in memory, and the result needs no
                # copy (a view of shape (n, O, C, kh, kw)). The CNN rows of
                # benchmarks/bench_per_sample.py time this path.
                return torch.bmm(U, g3.mT).mT.unflatten(2, self.weight_shape[1:])
            out = x.new_empty((n, *self.weight_shape))
            og = O // G
            U4 = U.view(n, G, cg * k, L)
            for j in range(G):
                out[:, j * og : (j + 1) * og] = torch.bmm(
                    g3[:, j * og : (j + 1) * og], U4[:, j].mT
                ).view(n, og, cg, *self.weight_shape[2:])
            return out
        C = x.shape[1]
        gw = torch.nn.grad.conv2d_weight(
            x.reshape(1, n * C, *x.shape[2:]),
            (n * O, cg, *self.weight_shape[2:]),
            g.reshape(1, n * O, *g.shape[2:]),
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            groups=n * G,
        )
        return gw.view(n, *self.weight_shape)

    def write(self, out: Tensor, accumulate: bool, chunk_size: int | None) -> None:
        B = self.batch
        out4 = out.view(B, *self.weight_shape)
        for s, e in chunks(B, math.prod(self.weight_shape), chunk_size):
            G = self._per_sample(s, e)
            out4[s:e].add_(G) if accumulate else out4[s:e].copy_(G)

    def _ghost_cheaper(self) -> bool:
        O, cg, k, L = self._dims()
        p, q = cg * k, O // self.groups
        return L * (p + q) < p * q

    def sq_norms(self, chunk_size: int | None) -> Tensor:
        B = self.batch
        O, cg, k, L = self._dims()
        G = self.groups
        out = self.x.new_zeros(B)
        if self._ghost_cheaper():
            og = O // G
            per_example = cg * k * L * G + 2 * L * L
            for s, e in chunks(B, per_example, chunk_size, NORM_CHUNK_ELEMENTS):
                n = e - s
                U = unfold2d(self.x[s:e], self.weight_shape[2:], self.dilation, self.padding, self.stride)
                U4 = U.view(n, G, cg * k, L)
                g4 = self.g[s:e].reshape(n, G, og, L)
                for j in range(G):
                    aa = torch.bmm(U4[:, j].mT, U4[:, j])
                    gg = torch.bmm(g4[:, j].mT, g4[:, j])
                    out[s:e] += aa.mul_(gg).view(n, -1).sum(1)
            return out
        # Direct: the per-sample gradients (and, for short patches, the unfolded input).
        per_example = math.prod(self.weight_shape) + (cg * k * L * G if cg * k < 64 else 0)
        for s, e in chunks(B, per_example, chunk_size, NORM_CHUNK_ELEMENTS):
            out[s:e] = sq_norms_rows(self._per_sample(s, e))
        return out

    def weighted_sum(self, c: Tensor) -> Tensor:
        B = self.batch
        O, cg, k, L = self._dims()
        # The temporary is g scaled (the size of g, as in an ordinary backward), so the usual
        # budget applies: one ordinary weight gradient in the common case.
        total = None
        for s, e in chunks(B, O * L, None):
            gc = self.g[s:e] * c[s:e].view(e - s, *([1] * (self.g.dim() - 1)))
            gw = torch.nn.grad.conv2d_weight(
                self.x[s:e], self.weight_shape, gc, stride=self.stride, padding=self.padding,
                dilation=self.dilation, groups=self.groups,
            )
            total = gw if total is None else total.add_(gw)
        return total.view(self.region_shape)


class ConvRule(Rule):
    """Conv1d / Conv2d (see :class:`ConvFactor`); Conv1d runs as a 2-D conv of height 1."""

    name = "Conv"

    def __init__(self, dims: int):
        self.dims = dims

    def factors(self, call, g, roles, batch):
        m = call.module
        x = _to_batch_first(call.x, call.bdim, batch)
        gb = _to_batch_first(g, call.bdim, batch)
        out: list[tuple[str, Factor]] = []
        O = gb.shape[1]
        if "weight" in roles:
            w, _ = call.params["weight"]
            padding = m.padding
            if isinstance(padding, str) or m.padding_mode != "zeros":
                mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
                x = F.pad(x, m._reversed_padding_repeated_twice, mode=mode)
                padding = (0,) * self.dims
            if self.dims == 1:
                x, gw = x.unsqueeze(-2), gb.unsqueeze(-2)
                wshape = (w.shape[0], w.shape[1], 1, w.shape[2])
                stride, padding, dilation = (1, m.stride[0]), (0, padding[0]), (1, m.dilation[0])
            else:
                gw, wshape = gb, tuple(w.shape)
                stride, padding, dilation = tuple(m.stride), tuple(padding), tuple(m.dilation)
            out.append(("weight", ConvFactor(x, gw, wshape, tuple(w.shape), stride, padding, dilation, m.groups)))
        if "bias" in roles:
            out.append(("bias", SmallFactor(gb.reshape(batch, O, -1).sum(2))))
        return out


class EmbeddingRule(Rule):
    name = "Embedding"

    def factors(self, call, g, roles, batch):
        m = call.module
        idx = _to_batch_first(call.x, call.bdim, batch).reshape(batch, -1)
        gb = _to_batch_first(g, call.bdim, batch).reshape(batch, idx.shape[1], -1)
        if "weight" not in roles:
            return []
        return [("weight", EmbeddingFactor(idx, gb, m.num_embeddings, m.padding_idx))]


def _affine_factors(xhat: Tensor, g: Tensor, sum_dims: tuple[int, ...], roles: set[str], call: Call):
    out: list[tuple[str, Factor]] = []
    if "weight" in roles:
        prod = xhat * g
        out.append(("weight", SmallFactor(prod.sum(sum_dims) if sum_dims else prod)))
    if "bias" in roles:
        out.append(("bias", SmallFactor(g.sum(sum_dims) if sum_dims else g)))
    return out


def _normalized_input(call: Call, g: Tensor, batch: int) -> tuple[Tensor, Tensor, tuple[int, ...]]:
    """Input and output gradient of a LayerNorm/RMSNorm call as ``(B, rows, *normalized_shape)``,
    and the normalized dimensions."""
    k = len(call.module.normalized_shape)
    x = _to_batch_first(call.x, call.bdim, batch)
    gb = _to_batch_first(g, call.bdim, batch)
    x = x.reshape(batch, -1, *x.shape[x.dim() - k :])
    return x, gb.reshape(x.shape), tuple(range(2, 2 + k))


class LayerNormRule(Rule):
    name = "LayerNorm"

    def factors(self, call, g, roles, batch):
        x, gb, dims = _normalized_input(call, g, batch)
        var, mean = torch.var_mean(x, dim=dims, keepdim=True, unbiased=False)
        xhat = (x - mean) * torch.rsqrt(var + call.module.eps)
        return _affine_factors(xhat, gb, (1,), roles, call)


class RMSNormRule(Rule):
    name = "RMSNorm"

    def factors(self, call, g, roles, batch):
        m = call.module
        x, gb, dims = _normalized_input(call, g, batch)
        eps = m.eps if m.eps is not None else torch.finfo(x.dtype).eps
        xhat = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
        return _affine_factors(xhat, gb, (1,), roles, call)


class GroupNormRule(Rule):
    name = "GroupNorm"

    def factors(self, call, g, roles, batch):
        m = call.module
        x = _to_batch_first(call.x, call.bdim, batch)
        gb = _to_batch_first(g, call.bdim, batch)
        C = x.shape[1]
        xg = x.reshape(batch, m.num_groups, -1)
        var, mean = torch.var_mean(xg, dim=2, keepdim=True, unbiased=False)
        xhat = ((xg - mean) * torch.rsqrt(var + m.eps)).reshape(batch, C, -1)
        return _affine_factors(xhat, gb.reshape(batch, C, -1), (2,), roles, call)


class BatchNormEvalRule(Rule):
    """BatchNorm with running statistics in eval mode: a per-channel affine map of each example."""

    name = "BatchNorm (eval)"

    def factors(self, call, g, roles, batch):
        m = call.module
        x = _to_batch_first(call.x, call.bdim, batch)
        gb = _to_batch_first(g, call.bdim, batch)
        C = x.shape[1]
        x3 = x.reshape(batch, C, -1)
        rm = m.running_mean.to(x.dtype).view(1, C, 1)
        rv = m.running_var.to(x.dtype).view(1, C, 1)
        xhat = (x3 - rm) * torch.rsqrt(rv + m.eps)
        return _affine_factors(xhat, gb.reshape(batch, C, -1), (2,), roles, call)


class ExpandRule(Rule):
    """A parameter repeated along the batch dimension (attention's ``bias_k`` / ``bias_v``)."""

    name = "broadcast parameter"

    def factors(self, call, g, roles, batch):
        p, rows = call.params["weight"]
        gb = _to_batch_first(g, call.bdim, batch)
        return [("weight", SmallFactor(gb.reshape(batch, *p.shape), rows))]


_LINEAR = LinearRule()
_CONV1 = ConvRule(1)
_CONV2 = ConvRule(2)
_EMBEDDING = EmbeddingRule()
_LAYERNORM = LayerNormRule()
_RMSNORM = RMSNormRule()
_GROUPNORM = GroupNormRule()
_BATCHNORM = BatchNormEvalRule()
_EXPAND = ExpandRule()


def _stock(module: nn.Module, base: type, *methods: str) -> bool:
    """True if ``module`` is a ``base`` whose forward (and named helpers) are base's own."""
    if not isinstance(module, base):
        return False
    cls = type(module)
    return all(getattr(cls, name) is getattr(base, name) for name in ("forward", *methods))


def rule_for(module: nn.Module) -> tuple[Rule, Callable[[Tensor], tuple[int, ...]]] | None:
    """The rule for a module and the dims its input may hold the batch in, or None."""
    if _stock(module, nn.Linear):
        return _LINEAR, lambda x: tuple(range(max(0, x.dim() - 1)))
    if _stock(module, nn.Conv1d, "_conv_forward"):
        return _CONV1, lambda x: (0,) if x.dim() == 3 else ()
    if _stock(module, nn.Conv2d, "_conv_forward"):
        return _CONV2, lambda x: (0,) if x.dim() == 4 else ()
    if _stock(module, nn.Embedding):
        if module.scale_grad_by_freq or module.max_norm is not None:
            return None
        return _EMBEDDING, lambda x: tuple(range(x.dim()))
    if _stock(module, nn.LayerNorm):
        k = len(module.normalized_shape)
        return _LAYERNORM, lambda x: tuple(range(max(0, x.dim() - k)))
    rms = getattr(nn, "RMSNorm", None)
    if rms is not None and _stock(module, rms):
        k = len(module.normalized_shape)
        return _RMSNORM, lambda x: tuple(range(max(0, x.dim() - k)))
    if _stock(module, nn.GroupNorm):
        return _GROUPNORM, lambda x: (0,) if x.dim() >= 2 else ()
    if (
        _stock(module, nn.modules.batchnorm._BatchNorm)
        and not module.training
        and module.running_mean is not None
        and module.running_var is not None
    ):
        return _BATCHNORM, lambda x: (0,) if x.dim() >= 2 else ()
    return None


def is_attention(module: nn.Module) -> bool:
    """A stock ``nn.MultiheadAttention``, whose projections are handled inside its forward."""
    return _stock(module, nn.MultiheadAttention)


# --------------------------------------------------------------------------------------------
# The recorder: forward hooks and the attention interceptor
# --------------------------------------------------------------------------------------------


class _AttentionMode(torch.overrides.TorchFunctionMode):
    """Routes ``F.multi_head_attention_forward`` through :func:`_mha_forward` while active."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward and self.recorder.capturing:
            handled = self.recorder.attention(args, kwargs)
            if handled is not None:
                return handled
        return func(*args, **kwargs)


class Recorder:
    """Records the calls of layers that have rules during one forward pass.

    ``tracked`` maps ``id(tensor)`` of every selected parameter (as the modules see it during
    the forward) to its name. In probe mode only the input shapes of module calls are kept.
    """

    def __init__(self, model: nn.Module, tracked: dict[int, str], batch: int, owners: set[str]):
        self.model = model
        self.owners = owners
        self.tracked = tracked
        self.batch = batch
        self.calls: list[Call] = []
        self.shapes: list[tuple[int, tuple[int, ...]]] = []
        self.handles: list[Any] = []
        self.capturing = False
        self.probing = False
        self.mode = _AttentionMode(self)
        self.mode_depth = 0
        self.attention_modules: set[int] = set()
        self.attention_path = ""

    # -- installation --------------------------------------------------------------------

    def install(self) -> None:
        for path, m in self.model.named_modules():
            prefix = path + "." if path else ""
            if is_attention(m) and any(o == path or o.startswith(prefix) for o in self.owners):
                self.attention_modules.add(id(m))
                self.handles.append(m.register_forward_pre_hook(self._enter_attention(path)))
                self.handles.append(
                    m.register_forward_hook(self._exit_attention, always_call=True)
                )
                continue
            if path not in self.owners:
                continue
            found = rule_for(m)
            if found is None:
                continue
            rule, allowed = found
            self.handles.append(
                m.register_forward_hook(self._hook(path, m, rule, allowed), prepend=True)
            )

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        while self.mode_depth > 0:
            self.mode_depth -= 1
            self.mode.__exit__(None, None, None)

    def _enter_attention(self, path: str):
        def pre_hook(module, args):
            if self.capturing and not self.probing:
                self.attention_path = path
                self.mode.__enter__()
                self.mode_depth += 1

        return pre_hook

    def _exit_attention(self, module, args, output):
        if self.mode_depth > 0:
            self.mode_depth -= 1
            self.mode.__exit__(None, None, None)

    # -- module calls --------------------------------------------------------------------

    def _hook(self, path: str, module: nn.Module, rule: Rule, allowed: Callable):
        def hook(mod, args, output):
            if not self.capturing or not args or not isinstance(args[0], Tensor):
                return None
            x = args[0]
            if self.probing:
                self.shapes.append((id(mod), tuple(x.shape)))
                return None
            params: dict[str, tuple[Tensor, slice | None]] = {}
            own = mod._parameters
            complete = True
            for role in ("weight", "bias"):
                t = own.get(role)
                if t is None:
                    t = getattr(mod, role, None)
                if isinstance(t, Tensor):
                    if id(t) in self.tracked:
                        params[role] = (t, None)
                    elif t.grad_fn is not None:
                        complete = False
            if not isinstance(output, Tensor):
                return None
            call = Call(
                rule=rule,
                module=mod,
                path=path,
                params=params,
                x=x,
                out_edge=_out_edge(output),
                out_shape=tuple(output.shape),
                in_edges=[e for e in (_edge(x),) if e is not None],
                allowed=allowed(x),
                x_version=x._version,
                x_shape=tuple(x.shape),
                complete=complete,
            )
            self.calls.append(call)
            return None

        return hook

    # -- attention -----------------------------------------------------------------------

    def linear(
        self,
        x: Tensor,
        weight: Tensor,
        weight_rows: slice | None,
        bias: Tensor | None,
        bias_rows: slice | None,
        path: str,
    ) -> Tensor:
        """``F.linear`` on a batch-first ``(N, L, E)`` input, recorded as a Linear call."""
        w = weight if weight_rows is None else weight[weight_rows]
        b = None if bias is None else (bias if bias_rows is None else bias[bias_rows])
        y = F.linear(x, w, b)
        params: dict[str, tuple[Tensor, slice | None]] = {}
        complete = True
        for role, t, rows in (("weight", weight, weight_rows), ("bias", bias, bias_rows)):
            if t is None:
                continue
            if id(t) in self.tracked:
                params[role] = (t, rows)
            elif t.grad_fn is not None:
                complete = False
        self.calls.append(
            Call(
                rule=_LINEAR,
                module=None,
                path=path,
                params=params,
                x=x,
                out_edge=_out_edge(y),
                out_shape=tuple(y.shape),
                in_edges=[e for e in (_edge(x),) if e is not None],
                allowed=(0,),
                fixed=True,
                x_version=x._version,
                x_shape=tuple(x.shape),
                complete=complete,
            )
        )
        return y

    def expand(self, param: Tensor, repeated: Tensor, path: str) -> Tensor:
        if id(param) in self.tracked:
            self.calls.append(
                Call(
                    rule=_EXPAND,
                    module=None,
                    path=path,
                    params={"weight": (param, None)},
                    x=repeated,
                    out_edge=_edge(repeated),
                    out_shape=tuple(repeated.shape),
                    in_edges=[],
                    allowed=(1,),
                    fixed=True,
                    x_version=repeated._version,
                    x_shape=tuple(repeated.shape),
                )
            )
        return repeated

    def attention(self, args: tuple, kwargs: dict) -> Any:
        """Runs ``F.multi_head_attention_forward`` with recorded projections, or returns None."""
        if self.probing:
            return None
        try:
            return _mha_forward(self, *args, **kwargs)
        except _NotHandled:
            return None


class _NotHandled(Exception):
    """This attention call is left to torch (no parameter tracked, or an unusual layout)."""


def _mha_forward(
    rec: Recorder,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    bias_k: Tensor | None,
    bias_v: Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    training: bool = True,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: Tensor | None = None,
    k_proj_weight: Tensor | None = None,
    v_proj_weight: Tensor | None = None,
    static_k: Tensor | None = None,
    static_v: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """torch's ``multi_head_attention_forward`` (torch 2.13) with recorded projections.

    The attention arithmetic is torch's own, step for step; only the in- and out-projections
    go through :meth:`Recorder.linear`, and ``bias_k``/``bias_v`` through
    :meth:`Recorder.expand`, so that the per-sample rules see their inputs and output edges.
    Raises ``_NotHandled`` for calls it leaves to torch.
    """
    weights = (
        in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
        q_proj_weight, k_proj_weight, v_proj_weight, bias_k, bias_v,
    )
    if not any(isinstance(w, Tensor) and id(w) in rec.tracked for w in weights):
        raise _NotHandled
    helpers = ("_mha_shape_check", "_canonical_mask", "_none_or_dtype")
    if not all(hasattr(F, h) for h in helpers) or isinstance(embed_dim_to_check, Tensor):
        raise _NotHandled
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3 or query.shape[1] != rec.batch:
        raise _NotHandled
    path = rec.attention_path
    is_batched = F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, num_heads)
    if not is_batched:
        raise _NotHandled
    tgt_len, bsz, embed_dim = query.shape
    src_len, _, _ = key.shape
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. "
            "You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask,
            mask_name="attn_mask",
            other_type=None,
            other_name="",
            target_type=query.dtype,
            check_other=False,
        )
        if key_padding_mask is not None:
            is_causal = False
    if embed_dim != embed_dim_to_check:
        raise AssertionError(
            f"was expecting embedding dimension of {embed_dim_to_check}, but got {embed_dim}"
        )
    head_dim = embed_dim // num_heads
    if head_dim * num_heads != embed_dim:
        raise AssertionError(f"embed_dim {embed_dim} not divisible by num_heads {num_heads}")
    E = embed_dim
    # The projections run on batch-first views (N, L, E): the layout the per-sample rules
    # want, and for batch_first modules the layout of the caller's tensors.
    qb, kb, vb = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)

    def seq_first(t: Tensor) -> Tensor:
        return t.transpose(0, 1)

    if not use_separate_proj_weight:
        if key.shape != value.shape:
            raise AssertionError(f"key shape {key.shape} does not match value shape {value.shape}")
        if in_proj_weight is None:
            raise AssertionError("use_separate_proj_weight is False but in_proj_weight is None")
        if key is value:
            if query is key:
                proj = seq_first(rec.linear(qb, in_proj_weight, None, in_proj_bias, None, path))
                proj = proj.unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
                q, k, v = proj[0], proj[1], proj[2]
            else:
                q = seq_first(rec.linear(qb, in_proj_weight, slice(0, E), in_proj_bias, slice(0, E), path))
                kv = seq_first(
                    rec.linear(kb, in_proj_weight, slice(E, 3 * E), in_proj_bias, slice(E, 3 * E), path)
                )
                kv = kv.unflatten(-1, (2, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
                k, v = kv[0], kv[1]
        else:
            q = seq_first(rec.linear(qb, in_proj_weight, slice(0, E), in_proj_bias, slice(0, E), path))
            k = seq_first(rec.linear(kb, in_proj_weight, slice(E, 2 * E), in_proj_bias, slice(E, 2 * E), path))
            v = seq_first(
                rec.linear(vb, in_proj_weight, slice(2 * E, 3 * E), in_proj_bias, slice(2 * E, 3 * E), path)
            )
    else:
        if key.shape[:2] != value.shape[:2]:
            raise AssertionError(
                f"key's sequence and batch dims {key.shape[:2]} do not match value's {value.shape[:2]}"
            )
        if q_proj_weight is None or k_proj_weight is None or v_proj_weight is None:
            raise AssertionError("use_separate_proj_weight is True but a projection weight is None")
        q = seq_first(rec.linear(qb, q_proj_weight, None, in_proj_bias, slice(0, E), path))
        k = seq_first(rec.linear(kb, k_proj_weight, None, in_proj_bias, slice(E, 2 * E), path))
        v = seq_first(rec.linear(vb, v_proj_weight, None, in_proj_bias, slice(2 * E, 3 * E), path))

    if attn_mask is not None:
        if attn_mask.dim() == 2:
            correct_2d_size = (tgt_len, src_len)
            if attn_mask.shape != correct_2d_size:
                raise RuntimeError(
                    f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be {correct_2d_size}."
                )
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() == 3:
            correct_3d_size = (bsz * num_heads, tgt_len, src_len)
            if attn_mask.shape != correct_3d_size:
                raise RuntimeError(
                    f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be {correct_3d_size}."
                )
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")

    if bias_k is not None and bias_v is not None:
        if static_k is not None or static_v is not None:
            raise AssertionError("bias cannot be added to static key or value.")
        k = torch.cat([k, rec.expand(bias_k, bias_k.repeat(1, bsz, 1), path)])
        v = torch.cat([v, rec.expand(bias_v, bias_v.repeat(1, bsz, 1), path)])
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))
    elif bias_k is not None or bias_v is not None:
        raise AssertionError("bias_k and bias_v must both be set or both be None")

    q = q.reshape(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    if static_k is None:
        k = k.reshape(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    else:
        k = static_k
    if static_v is None:
        v = v.reshape(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    else:
        v = static_v

    if add_zero_attn:
        zero_attn_shape = (bsz * num_heads, 1, head_dim)
        k = torch.cat([k, torch.zeros(zero_attn_shape, dtype=k.dtype, device=k.device)], dim=1)
        v = torch.cat([v, torch.zeros(zero_attn_shape, dtype=v.dtype, device=v.device)], dim=1)
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))

    src_len = k.size(1)
    if key_padding_mask is not None:
        if hasattr(F, "_check_key_padding_mask"):
            F._check_key_padding_mask(key_padding_mask, src_len, bsz)
        key_padding_mask = (
            key_padding_mask.view(bsz, 1, 1, src_len)
            .expand(-1, num_heads, -1, -1)
            .reshape(bsz * num_heads, 1, src_len)
        )
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask

    if not training:
        dropout_p = 0.0

    if need_weights:
        _B, _Nt, Eh = q.shape
        q_scaled = q * math.sqrt(1.0 / float(Eh))
        if is_causal and attn_mask is None:
            raise AssertionError("FIXME: is_causal not implemented for need_weights")
        if attn_mask is not None:
            attn_output_weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            attn_output_weights = torch.bmm(q_scaled, k.transpose(-2, -1))
        attn_output_weights = F.softmax(attn_output_weights, dim=-1)
        if dropout_p > 0.0:
            attn_output_weights = F.dropout(attn_output_weights, p=dropout_p)
        attn_output = torch.bmm(attn_output_weights, v)
        attn_output = (
            attn_output.view(bsz, num_heads, tgt_len, head_dim)
            .permute(0, 2, 1, 3)
            .reshape(bsz, tgt_len, embed_dim)
        )
        attn_output = seq_first(rec.linear(attn_output, out_proj_weight, None, out_proj_bias, None, path))
        attn_output_weights = attn_output_weights.view(bsz, num_heads, tgt_len, src_len)
        if average_attn_weights:
            attn_output_weights = attn_output_weights.mean(dim=1)
        return attn_output, attn_output_weights
    if attn_mask is not None:
        if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
    q = q.view(bsz, num_heads, tgt_len, head_dim)
    k = k.view(bsz, num_heads, src_len, head_dim)
    v = v.view(bsz, num_heads, src_len, head_dim)
    attn_output = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
    attn_output = attn_output.permute(0, 2, 1, 3).reshape(bsz, tgt_len, embed_dim)
    attn_output = seq_first(rec.linear(attn_output, out_proj_weight, None, out_proj_bias, None, path))
    return attn_output, None
