"""Factors: the per-sample gradients of one region of a parameter, formed only where needed.

A rule (``torch_vjp._per_sample.rules``) turns one recorded layer call and its output
gradient into factors; the public functions write them out (per-sample gradients), take
their squared norms, or their clipped weighted sums.

NOTE [Factors]
A factor describes the per-sample gradient of one region of one parameter (the whole
parameter, or a block of rows of it, such as the query rows of a packed attention
in-projection) without necessarily materialising it:

- :class:`SmallFactor`: the per-sample gradient itself, ``(B, *region_shape)``; used where it
  is small (biases, normalisation weights, a broadcast parameter) or where a rule can only
  form it (a user's rule, a recurrent layer).
- :class:`OuterFactor`: ``G_i = sum_t g[i, t] a[i, t]^T`` for ``a: (B, T, p)``,
  ``g: (B, T, q)`` (Linear over any leading dimensions, attention projections, GPT-2's
  ``Conv1D``). Squared norms use the ghost-norm identity ``<a_i a_i^T, g_i g_i^T>`` when
  ``T (p + q) <= p q``, else the direct ``||G_i||^2`` in chunks of examples; ``T == 1`` gives
  ``||a_i||^2 ||g_i||^2``. (NOTE [ghost norms, checked]: the identity sums ``T^2`` products
  whose rounding, in float32, can be the whole of a small gradient's norm; examples where it
  may be get the direct norm, see :func:`ghost_unsure`.) The clipped sum ``sum_i c_i G_i``
  is one matrix product over the ``B * T`` rows.
- :class:`EmbeddingFactor`: ``G_i = sum_t onehot(idx[i, t]) g[i, t]^T``; norms and sums by
  index_add over the distinct (example, index) pairs, never a ``(B, V, D)`` tensor.
- ``ConvFactor`` (in ``rules.conv``): the same for convolution weights.

Every factor can write its per-sample gradients (of all examples, or of a range of them)
into a caller's buffer, give the ``(B,)`` squared norms of its region, and give the clipped
weighted sum ``sum_i c_i G_i``. Factors of one region are merged before norms are taken (two
calls of one Linear concatenate along T), because norms are not additive; factors of
different kinds on one region (tied weights: an embedding table that is also the output
layer's weight) are written out a chunk of examples at a time, so that no buffer of the
order of ``B x P`` exists.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from torch_vjp._per_sample.keep import Kept, KeepBudget, kept_weighted_sum
from torch_vjp._per_sample.norms_wide import wide_dtype, wide_sq_rows

__all__ = ["CHUNK_ELEMENTS", "NORM_CHUNK_ELEMENTS", "Factor", "SmallFactor", "OuterFactor",
           "EmbeddingFactor", "merge_factors", "chunks", "sq_norms_rows", "ghost_sq_norms",
           "ghost_unsure", "widened", "full_precision", "region_sq_norms", "region_weighted_sum",
           "write_region"]

#: Elements a temporary may hold before the work is split into chunks of examples.
CHUNK_ELEMENTS = 1 << 23
#: Elements the temporaries of a norms-only or clipped-sum computation may hold for one layer
#: (1 MB in float32): these calls promise no buffer of the order of B x P, and on a small
#: model a layer's temporaries (an unfolded input, say) can be as large as B x P itself.
NORM_CHUNK_ELEMENTS = 1 << 18


_F32_EPS = torch.finfo(torch.float32).eps


def widened(t: Any) -> Any:
    """``t`` in float32 where it is a floating tensor of lower precision (bfloat16, float16),
    else ``t``. NOTE [norms at float32's precision]: under autocast the recorded inputs and
    output gradients are bfloat16 or float16, whose rounding of a norm (0.4% in bfloat16)
    lets a clipped contribution pass ``max_norm``, and blinds the ghost-norm check; the
    norms and the clipped sums are taken from them widened, with autocast off
    (:func:`full_precision`)."""
    if isinstance(t, Tensor) and t.is_floating_point() and torch.finfo(t.dtype).eps > _F32_EPS:
        return t.float()
    return t


def full_precision(device: torch.device) -> Any:
    """Autocast off on ``device`` (NOTE [norms at float32's precision]); nothing to do, and
    no context to enter, where it is off already (the common case: per-call cost)."""
    try:
        on = torch.is_autocast_enabled(device.type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return contextlib.nullcontext()
    if not on:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def sq_norms_rows(v: Tensor) -> Tensor:
    """Squared L2 norm of each row of ``v`` viewed as ``(B, -1)``, in ``v``'s dtype (inf
    past its range: the factors take :func:`wide_sq_rows`, NOTE [norms past the square])."""
    rows = v if v.dim() == 2 else v.reshape(v.shape[0], -1)
    # (one reduction: linalg.vecdot would first form the B x P product of the rows)
    return torch.linalg.vector_norm(rows, dim=1).square_()


def ghost_unsure(sq: Tensor, products: Tensor, width: int) -> Tensor:
    """The examples (indices into ``sq``) whose ghost norm ``sq`` may have cancelled away.

    ``products`` is ``(n, T, T)``, ``<a_t, a_t'><g_t, g_t'>``, whose sum is ``sq``; each
    inner product over ``width = p + q`` elements rounds by about ``eps * sqrt(width)``
    of its size, so the sum carries about ``eps * sqrt(width + 1)`` times ``sum_t |a_t|^2
    |g_t|^2`` (its diagonal, the size of its terms taken as random). An example whose
    gradient is far smaller than that (tokens whose products nearly cancel) can lose its
    whole norm: a float32 norm came out 0, a clip factor of 1, past ``max_norm``. These
    get the direct ``||G_i||^2``, whose error is of the order of ``eps`` itself (NOTE
    [ghost norms, checked])."""
    unit = max(torch.finfo(sq.dtype).eps, torch.finfo(products.dtype).eps)
    tol = 1e3 * unit * math.sqrt(width + 1)  # (a 1e-3 relative error, at the estimate)
    diag = products.diagonal(dim1=1, dim2=2).sum(1)
    # (an example with no gradient at all, diag 0, has nothing to cancel; one whose products
    # overflowed, diag inf or NaN (inf times a zero gradient), a sum inf or NaN, gets the
    # direct norm: NOTE [norms past the square])
    return (~(sq > tol * diag) & (diag != 0)).nonzero().view(-1)


def ghost_sq_norms(a: Tensor, g: Tensor) -> Tensor:
    """``||g_i^T a_i||^2`` of ``a: (n, T, p)`` and ``g: (n, T, q)`` by the ghost-norm identity,
    ``sum_{t,t'} <a_t, a_t'><g_t, g_t'>``, with the examples whose sum may have cancelled
    (:func:`ghost_unsure`) computed from their own gradients, a few at a time within the
    norms' budget (NOTE [ghost norms, checked])."""
    n, _, p = a.shape
    q = g.shape[2]
    products = torch.bmm(a, a.mT).mul_(torch.bmm(g, g.mT))
    out = products.view(n, -1).sum(1)
    out = out.to(wide_dtype(out.dtype, out.device))
    unsure = ghost_unsure(out, products, p + q)
    for first, last in chunks(unsure.numel(), p * q, None, NORM_CHUNK_ELEMENTS):
        idx = unsure[first:last]
        out[idx] = wide_sq_rows(torch.bmm(g[idx].mT, a[idx]))
    return out


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


class Factor:
    """The per-sample gradient of one region of a parameter (see NOTE [Factors])."""

    rows: slice | None = None
    region_shape: tuple[int, ...] = ()
    #: The per-sample gradients ``(B, ...)`` that :meth:`sq_norms` formed and kept (with a
    #: ``keep`` budget), for :func:`region_weighted_sum`; None where they were not formed.
    kept: Kept | None = None

    @property
    def batch(self) -> int:
        raise NotImplementedError

    def write_range(self, out: Tensor, start: int, stop: int, accumulate: bool) -> None:
        """Writes (or adds) the per-sample gradients of examples ``start:stop`` into ``out``
        of shape ``(stop - start, *region_shape)``."""
        raise NotImplementedError

    def write(self, out: Tensor, accumulate: bool, chunk_size: int | None) -> None:
        """Writes (or adds) every example's per-sample gradient into ``out``,
        ``(B, *region_shape)``, a chunk of examples at a time."""
        for s, e in chunks(self.batch, math.prod(self.region_shape), chunk_size):
            self.write_range(out[s:e], s, e, accumulate)

    def sq_norms(self, chunk_size: int | None, keep: KeepBudget | None = None) -> Tensor:
        """The ``(B,)`` squared L2 norms of the per-sample gradients of this region. With
        ``keep``, per-sample gradients formed for them are kept in :attr:`kept` where the
        budget allows."""
        dtype, device = self._dtype(), self._device()
        out = torch.empty(self.batch, dtype=wide_dtype(dtype, device), device=device)
        numel = math.prod(self.region_shape)
        kept = (keep.buffer(self.batch, self.region_shape, out.new_empty(0, dtype=dtype))
                if keep is not None else None)
        for s, e in chunks(self.batch, numel, chunk_size, NORM_CHUNK_ELEMENTS):
            if kept is not None:
                buf = kept[s:e]
            else:
                buf = torch.empty((e - s, *self.region_shape), dtype=dtype, device=device)
            self.write_range(buf, s, e, False)
            out[s:e] = wide_sq_rows(buf)
        self.kept = kept
        return out

    def weighted_sum(self, c: Tensor) -> Tensor:
        """``sum_i c[i] G_i``, of shape ``region_shape``."""
        raise NotImplementedError

    def kept_sum(self, c: Tensor) -> Tensor:
        """``sum_i c[i] G_i`` from :attr:`kept` (not None)."""
        return kept_weighted_sum(self.kept, c)  # type: ignore[arg-type]

    def merge_key(self) -> Any:
        """Factors with equal keys describe one region the same way and can be merged."""
        return None

    def _dtype(self) -> torch.dtype:
        raise NotImplementedError

    def _device(self) -> torch.device:
        raise NotImplementedError


class SmallFactor(Factor):
    """Per-sample gradients held as they are, ``value: (B, *region_shape)``."""

    def __init__(self, value: Tensor, rows: slice | None = None, sq: Any = None):
        self.value = value
        self.rows = rows
        self.region_shape = tuple(value.shape[1:])
        self._sq = sq  # a function giving the squared norms already known (a Linear's bias)

    @property
    def batch(self) -> int:
        return self.value.shape[0]

    def _dtype(self) -> torch.dtype:
        return self.value.dtype

    def _device(self) -> torch.device:
        return self.value.device

    def write_range(self, out: Tensor, start: int, stop: int, accumulate: bool) -> None:
        if accumulate:
            out.add_(self.value[start:stop])
        else:
            out.copy_(self.value[start:stop])

    def write(self, out: Tensor, accumulate: bool, chunk_size: int | None) -> None:
        self.write_range(out, 0, self.batch, accumulate)

    def sq_norms(self, chunk_size: int | None, keep: KeepBudget | None = None) -> Tensor:
        return self._sq() if self._sq is not None else wide_sq_rows(self.value)

    def weighted_sum(self, c: Tensor) -> Tensor:
        v = self.value
        if c.dtype != v.dtype:
            c = c.to(v.dtype)
        if v.dim() == 2:
            return torch.mv(v.T, c)
        return torch.mv(v.reshape(v.shape[0], -1).T, c).view(v.shape[1:])

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
    rows of one (an attention projection). With ``transposed``, the region is ``(p, q)``
    (GPT-2's ``Conv1D`` stores its weight as ``(in, out)``) and ``G_i^T`` is written.
    ``a: (B, p)`` and ``g: (B, q)`` stand for ``T == 1`` (a Linear on a batch of vectors,
    the common case, kept two-dimensional so that no call reshapes them).
    """

    def __init__(
        self,
        a: Tensor,
        g: Tensor,
        region_shape: tuple[int, ...],
        rows: slice | None = None,
        transposed: bool = False,
    ):
        if a.dim() == 2:
            self.a2: Tensor | None = a
            self.g2: Tensor | None = g
            self._a3: Tensor | None = None
            self._g3: Tensor | None = None
        else:
            self.a2 = self.g2 = None
            self._a3, self._g3 = a, g
        self.rows = rows
        self.region_shape = tuple(region_shape)
        self.transposed = transposed
        self._g_sq: Tensor | None = None

    @property
    def a(self) -> Tensor:
        """``(B, T, p)``."""
        if self._a3 is None:
            self._a3 = self.a2.unsqueeze(1)  # type: ignore[union-attr]
        return self._a3

    @property
    def g(self) -> Tensor:
        """``(B, T, q)``."""
        if self._g3 is None:
            self._g3 = self.g2.unsqueeze(1)  # type: ignore[union-attr]
        return self._g3

    def g_sq_norms(self) -> Tensor:
        """``||g_i||^2`` for ``T == 1`` (made once for each dtype of the squared norms: NOTE
        [one check on the CPU]; a bias's squared norms, too)."""
        g = self.g2 if self.g2 is not None else self.g
        if self._g_sq is None or self._g_sq.dtype != wide_dtype(g.dtype, g.device):
            self._g_sq = wide_sq_rows(self.g2 if self.g2 is not None else self.g[:, 0])
        return self._g_sq

    @property
    def batch(self) -> int:
        return (self.a2 if self.a2 is not None else self._a3).shape[0]  # type: ignore[union-attr]

    def _dtype(self) -> torch.dtype:
        return (self.a2 if self.a2 is not None else self._a3).dtype  # type: ignore[union-attr]

    def _device(self) -> torch.device:
        return (self.a2 if self.a2 is not None else self._a3).device  # type: ignore[union-attr]

    def write_range(self, out: Tensor, start: int, stop: int, accumulate: bool) -> None:
        a, g = self.a[start:stop], self.g[start:stop]
        n, T, p = a.shape
        q = g.shape[2]
        if self.transposed:  # G_i^T = sum_t a[i, t] g[i, t]^T, (p, q)
            a, g, p, q = g, a, q, p
        try:
            out3 = out.view(n, q, p)
        except RuntimeError:
            tmp = torch.empty((n, q, p), dtype=out.dtype, device=out.device)
            self._product(tmp, a, g, False)
            tmp = tmp.view(out.shape)
            out.add_(tmp) if accumulate else out.copy_(tmp)
            return
        self._product(out3, a, g, accumulate)

    @staticmethod
    def _product(o: Tensor, a: Tensor, g: Tensor, accumulate: bool) -> None:
        if a.dtype != o.dtype or g.dtype != o.dtype:  # (autocast's bfloat16 into a float32 buffer)
            a, g = a.to(o.dtype), g.to(o.dtype)
        if a.shape[1] == 1:
            gs, as_ = g[:, 0, :, None], a[:, 0, None, :]
            if accumulate:
                o.addcmul_(gs, as_)
            else:
                torch.mul(gs, as_, out=o)
        elif accumulate:
            o.baddbmm_(g.mT, a)
        else:
            torch.bmm(g.mT, a, out=o)

    def write(self, out: Tensor, accumulate: bool, chunk_size: int | None) -> None:
        for s, e in chunks(self.batch, 1, chunk_size):
            self.write_range(out[s:e], s, e, accumulate)

    def use_ghost(self) -> bool:
        """Whether the ghost-norm identity is cheaper than forming each ``G_i``."""
        _, T, p = self.a.shape
        q = self.g.shape[2]
        return T * (p + q) <= p * q

    def sq_norms(self, chunk_size: int | None, keep: KeepBudget | None = None) -> Tensor:
        if self.a2 is not None:
            return wide_sq_rows(self.a2).mul_(self.g_sq_norms())
        a, g = self.a, self.g
        B, T, p = a.shape
        q = g.shape[2]
        if T == 1:
            return wide_sq_rows(a).mul_(self.g_sq_norms())
        out = a.new_empty(B, dtype=wide_dtype(a.dtype, a.device))
        if self.use_ghost():
            for s, e in chunks(B, 2 * T * T, chunk_size, NORM_CHUNK_ELEMENTS):
                out[s:e] = ghost_sq_norms(a[s:e], g[s:e])
        else:
            kept = keep.buffer(B, (q, p), a) if keep is not None else None
            buf = None
            for s, e in chunks(B, p * q, chunk_size, NORM_CHUNK_ELEMENTS):
                if kept is not None:
                    buf = kept[s:e]
                elif buf is None or buf.shape[0] != e - s:
                    buf = a.new_empty((e - s, q, p))
                torch.bmm(g[s:e].mT, a[s:e], out=buf)
                out[s:e] = wide_sq_rows(buf)
            self.kept = kept if kept is None or not self.transposed else kept.mT
        return out

    def weighted_sum(self, c: Tensor) -> Tensor:
        # sum_i c_i g_i^T a_i over all B * T rows, in any order: the narrower of a and g is
        # scaled (a copy, written contiguous), the one product reads the other in place; its
        # rows go in the order that one is stored in (time-major for the batch-first view of
        # a sequence-first input, an attention's output projection: batch-major rows copied
        # it)
        if self.a2 is not None:
            # (T == 1: one broadcast product, one matrix product; no buffer, no reshapes)
            a, g = self.a2, self.g2
            cc = c if c.dtype == g.dtype else c.to(g.dtype)  # type: ignore[union-attr]
            if a.shape[1] < g.shape[1]:  # type: ignore[union-attr]
                a = a * cc[:, None]  # type: ignore[operator]
            else:
                g = g * cc[:, None]  # type: ignore[operator]
            res = torch.mm(a.T, g) if self.transposed else torch.mm(g.T, a)  # type: ignore[union-attr]
            return res if res.shape == self.region_shape else res.view(self.region_shape)
        a, g, cv = self._a3, self._g3, c.view(-1, 1, 1)
        other = g if a.shape[2] < g.shape[2] else a  # type: ignore[union-attr]
        if not other.is_contiguous() and other.transpose(0, 1).is_contiguous():
            a, g, cv = a.transpose(0, 1), g.transpose(0, 1), c.view(1, -1, 1)  # type: ignore[union-attr]
        cv = cv if cv.dtype == g.dtype else cv.to(g.dtype)  # type: ignore[union-attr]
        if a.shape[-1] < g.shape[-1]:  # type: ignore[union-attr]
            a = _scaled(a, cv)  # type: ignore[arg-type]
        else:
            g = _scaled(g, cv)  # type: ignore[arg-type]
        a, g = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])  # type: ignore[union-attr]
        res = torch.mm(a.T, g) if self.transposed else torch.mm(g.T, a)
        return res if res.shape == self.region_shape else res.view(self.region_shape)

    def merge_key(self) -> Any:
        return ("outer", self.rows, self.region_shape, self.a.shape[2], self.g.shape[2],
                self.transposed)

    @staticmethod
    def merge(factors: list[Factor]) -> Factor:
        a = torch.cat([f.a for f in factors], dim=1)  # type: ignore[attr-defined]
        g = torch.cat([f.g for f in factors], dim=1)  # type: ignore[attr-defined]
        first = factors[0]
        return OuterFactor(a, g, first.region_shape, first.rows,
                           first.transposed)  # type: ignore[attr-defined]


def _scaled(x: Tensor, c: Tensor) -> Tensor:
    """``x * c`` written contiguous in ``x``'s logical order (a product follows the memory
    order of its operand, which a transposed view does not have)."""
    if torch.is_grad_enabled() and (x.requires_grad or c.requires_grad):
        return (x * c).contiguous()  # (out= takes no part in autograd)
    out = torch.empty(x.shape, dtype=torch.result_type(x, c), device=x.device)
    return torch.mul(x, c, out=out)


class EmbeddingFactor(Factor):
    """``G_i = sum_t onehot(idx[i, t]) g[i, t]^T``: ``idx: (B, T)`` integers, ``g: (B, T, D)``.

    With ``weights`` (EmbeddingBag's ``per_sample_weights``, ``(B, T)``), each row is scaled
    first.
    """

    def __init__(self, idx: Tensor, g: Tensor, num_embeddings: int, padding_idx: int | None):
        if padding_idx is not None:
            keep = idx != padding_idx
            g = g * keep.unsqueeze(-1).to(g.dtype)
        self.idx = idx
        self.g = g
        self.num = num_embeddings
        self.region_shape = (num_embeddings, g.shape[2])

    @property
    def batch(self) -> int:
        return self.idx.shape[0]

    def _dtype(self) -> torch.dtype:
        return self.g.dtype

    def _device(self) -> torch.device:
        return self.g.device

    def _keys(self, start: int = 0, stop: int | None = None) -> Tensor:
        idx = self.idx[start:stop]
        base = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1) * self.num
        return (base + idx).reshape(-1)

    def write_range(self, out: Tensor, start: int, stop: int, accumulate: bool) -> None:
        g = self.g[start:stop]
        n, T, D = g.shape
        if not accumulate:
            out.zero_()
        keys = self._keys(start, stop)
        src = g.reshape(n * T, D).to(out.dtype)
        if out.is_contiguous():
            out.view(n * self.num, D).index_add_(0, keys, src)
        else:
            tmp = torch.zeros((n * self.num, D), dtype=out.dtype, device=out.device)
            tmp.index_add_(0, keys, src)
            out.add_(tmp.view(out.shape))

    def sq_norms(self, chunk_size: int | None, keep: KeepBudget | None = None) -> Tensor:
        B, T, D = self.g.shape
        uniq, inv = torch.unique(self._keys(), return_inverse=True)
        acc = self.g.new_zeros((uniq.numel(), D)).index_add_(0, inv, self.g.reshape(B * T, D))
        rows = wide_sq_rows(acc)
        return rows.new_zeros(B).index_add_(
            0, torch.div(uniq, self.num, rounding_mode="floor"), rows
        )

    def weighted_sum(self, c: Tensor) -> Tensor:
        B, T, D = self.g.shape
        gc = (self.g * c.to(self.g.dtype).view(B, 1, 1)).reshape(B * T, D)
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
# All the factors of one parameter
# --------------------------------------------------------------------------------------------


def _rows_key(rows: slice | None) -> tuple[int, int] | None:
    return None if rows is None else (rows.start, rows.stop)


def write_region(factors: list[Factor], out: Tensor, chunk_size: int | None) -> None:
    """Writes the per-sample gradients of one parameter into ``out``, ``(B, *shape)``."""
    whole_first = factors[0].rows is None
    if not whole_first:
        out.zero_()
    for k, f in enumerate(factors):
        region = out if f.rows is None else out[:, f.rows]
        f.write(region, accumulate=k > 0 or not whole_first, chunk_size=chunk_size)


def _write_range(factors: list[Factor], out: Tensor, start: int, stop: int) -> None:
    """Writes examples ``start:stop`` of one parameter's per-sample gradients into ``out``."""
    whole_first = factors[0].rows is None
    if not whole_first:
        out.zero_()
    for k, f in enumerate(factors):
        region = out if f.rows is None else out[:, f.rows]
        f.write_range(region, start, stop, accumulate=k > 0 or not whole_first)


def region_sq_norms(factors: list[Factor], shape: tuple[int, ...], batch: int, like: Tensor) -> Tensor:
    """Squared per-sample norms of one parameter, without materialising where factors allow.

    Factors of disjoint regions (the blocks of a packed projection) add their norms; several
    factors of one region merge first; factors of different kinds on one region (tied
    weights) are written out a chunk of examples at a time (NOTE [Factors]).
    """
    groups: dict[Any, list[Factor]] = {}
    for f in factors:
        groups.setdefault(_rows_key(f.rows), []).append(f)
    keys = list(groups)
    disjoint = len(keys) == 1 or (
        None not in keys
        and all(a[1] <= b[0] for a, b in zip(sorted(keys), sorted(keys)[1:]))  # type: ignore[index]
    )
    if disjoint:
        merged = [merge_factors(g) for g in groups.values()]
        if all(m is not None for m in merged):
            total = None
            for m in merged:
                sq = m.sq_norms(None)  # type: ignore[union-attr]
                total = sq if total is None else total + sq
            return total  # type: ignore[return-value]
    out = like.new_empty(batch, dtype=wide_dtype(like.dtype, like.device))
    for s, e in chunks(batch, math.prod(shape), None, NORM_CHUNK_ELEMENTS):
        buf = like.new_empty((e - s, *shape))
        _write_range(factors, buf, s, e)
        out[s:e] = wide_sq_rows(buf)
    return out


def region_weighted_sum(factors: list[Factor], c: Tensor, param: Tensor) -> Tensor:
    """``sum_i c[i] G_i`` of one parameter (weighted sums add across factors and regions);
    from the factor's kept per-sample gradients where it has them."""
    if len(factors) == 1 and factors[0].rows is None:
        if factors[0].kept is not None:
            res = factors[0].kept_sum(c)
            return res if res.shape == param.shape else res.reshape(param.shape)
        res = factors[0].weighted_sum(c)
        return res if res.shape == param.shape else res.reshape(param.shape)
    total = torch.zeros(param.shape, dtype=c.dtype, device=c.device)
    for f in factors:
        region = total if f.rows is None else total[f.rows]
        region.add_(f.weighted_sum(c).reshape(region.shape))
    return total
