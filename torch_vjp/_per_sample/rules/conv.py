"""Convolutions: ``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d``.

A convolution is a Linear layer applied to every patch of its input, so example ``i``'s
gradient of the weight is ``sum_l g[i, :, l] u[i, :, l]^T`` over the output positions ``l``,
with ``u`` the unfolded input patches (:class:`ConvFactor`).

A transposed convolution ``y = conv_transpose(x, W)`` is the adjoint of the convolution
``z -> conv(z, W)`` (same stride, padding, dilation and groups) that maps ``y``'s space back
to ``x``'s. So ``<g, y> = <conv(g, W), x>`` for any ``g``, and the weight gradient of the
transposed convolution is the weight gradient of ``conv(g, W)`` with ``x`` as its output
gradient: a :class:`ConvFactor` with the roles of input and output gradient swapped
(:class:`ConvTransposeRule`).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_vjp._engine.compile_key import tracing
from torch_vjp._per_sample.factors import (
    NORM_CHUNK_ELEMENTS,
    Factor,
    SmallFactor,
    chunks,
    ghost_sq_norms,
)
from torch_vjp._per_sample.keep import KeepBudget
from torch_vjp._per_sample.norms_wide import wide_dtype, wide_sq_norms, wide_sq_rows
from torch_vjp._per_sample.registry import Rule, register_rule, to_batch_first

__all__ = ["ConvFactor", "ConvRule", "ConvTransposeRule", "unfold_nd", "patches_last",
           "PATCHES_FASTER"]

# The ordinary weight gradient of a convolution, by number of spatial dimensions.
_CONV_WEIGHT = {
    1: torch.nn.grad.conv1d_weight,
    2: torch.nn.grad.conv2d_weight,
    3: torch.nn.grad.conv3d_weight,
}


def unfold_nd(
    x: Tensor,
    kernel: tuple[int, ...],
    dilation: tuple[int, ...],
    padding: tuple[int, ...],
    stride: tuple[int, ...],
) -> Tensor:
    """``F.unfold`` for any number of spatial dimensions, as one strided copy:
    ``(B, C, *S) -> (B, C * prod(kernel), L)``.

    Same layout as ``F.unfold`` (channel-major patch rows, kernel offsets row-major, output
    positions row-major), built from an ``as_strided`` view of the zero-padded input; torch's
    CPU im2col loops over examples and is far slower, and has no 3-D version.
    """
    if any(padding):
        x = F.pad(x, [p for q in reversed(padding) for p in (q, q)])
    x = x.contiguous()
    B, C, *sizes = x.shape
    sB, sC, *sS = x.stride()
    out = [(n - d * (k - 1) - 1) // s + 1 for n, k, d, s in zip(sizes, kernel, dilation, stride)]
    patches = x.as_strided(
        (B, C, *kernel, *out),
        (sB, sC, *[d * t for d, t in zip(dilation, sS)], *[s * t for s, t in zip(stride, sS)]),
        x.storage_offset(),
    )
    return patches.reshape(B, C * math.prod(kernel), math.prod(out))


def patches_last(
    x: Tensor,
    kernel: tuple[int, ...],
    dilation: tuple[int, ...],
    padding: tuple[int, ...],
    stride: tuple[int, ...],
) -> Tensor:
    """The patches of a 2-D convolution's input, channels last, as one strided copy:
    ``(B, C, H, W) -> (B, L, kh * kw * C)``, rows in output positions' order, columns in
    the order ``(kh, kw, C)`` (the layout of a channels-last weight). Each patch row is
    ``kw * C`` contiguous numbers of the channels-last input, where :func:`unfold_nd`
    gathers runs of one output row."""
    if any(padding):
        x = F.pad(x, [p for q in reversed(padding) for p in (q, q)])
    xl = x.permute(0, 2, 3, 1).contiguous()  # (B, H, W, C)
    B, H, W, C = xl.shape
    sB, sH, sW, sC = xl.stride()
    (kh, kw), (dh, dw), (th, tw) = kernel, dilation, stride
    oh = (H - dh * (kh - 1) - 1) // th + 1
    ow = (W - dw * (kw - 1) - 1) // tw + 1
    patches = xl.as_strided((B, oh, ow, kh, kw, C),
                            (sB, th * sH, tw * sW, dh * sH, dw * sW, sC), xl.storage_offset())
    return patches.reshape(B, oh * ow, kh * kw * C)


# NOTE [two ways to a convolution's per-sample gradients]
# For the direct norms of a 2-D convolution with long patches (``groups == 1``), the
# per-sample gradients come from one grouped convolution per chunk of examples (the
# examples as groups), or from the channels-last patches and one batched matrix product
# (``g_i (O, L) @ P_i (L, kh kw C)``). The work is the same; which is faster depends on the
# shapes and on the machine's convolution kernels: on cnn_b64 of
# benchmarks/bench_per_sample.py (16 -> 32 channels, 5 x 5, 8 x 8 outputs) the product took
# 0.54-0.65 of the grouped convolution's time, on 3 x 3 layers of 8 to 64 channels 1.2-1.7
# of it (one thread, process CPU time, medians of alternated runs; the layers of
# benchmarks/bench_per_sample_parts.py, conv_norms, which times both). So on CPU the first
# norms of each of the first three calls of each layer shape are computed both ways, each
# way whole (every chunk of the batch) and timed (process CPU time, the order of the two
# alternating from call to call; the best time of each way over the three calls:
# interference from other processes only adds time, and comes in bursts that one call's
# runs can fall into), and from then on the product is used for that shape, for the rest
# of the process, where it took at most 0.8 of the grouped convolution's time (a wrong
# choice under a noisy measurement then costs little). Both give the same numbers up to
# rounding; the measurement costs one more computation of the layer's norms on each of
# three calls, once per shape. (Timing only the first chunk, twice, misjudged the whole:
# on cnn_b64 the first chunks of the grouped convolution timed at 45 to 90 us an example,
# the whole pass at 115 to 160, against 30 to 36 for the product, so that under load the
# grouped convolution was chosen in about half of the processes, at twice the layer's
# time.) Elsewhere (GPUs, groups, 3-D) the grouped convolution is used, as before.
#: (shapes, dtype) -> whether the patches' product is the faster (NOTE above).
PATCHES_FASTER: dict[tuple, bool] = {}
#: (shapes, dtype) -> [best seconds per example grouped, by the patches, calls measured].
_PATCHES_TIMES: dict[tuple, list] = {}
#: The calls of a layer shape measured before the choice is made.
_PATCHES_CALLS = 3
#: The product must take at most this fraction of the grouped convolution's time.
_PATCHES_MARGIN = 0.8


class ConvFactor(Factor):
    """Per-sample gradients of a convolution weight from its input ``x: (B, C, *S)`` and
    output gradient ``g: (B, O, *S')``, for 2 or 3 spatial dimensions (1-D convolutions are
    handled as 2-D ones of height 1, whose paths are the fastest).

    Per-sample gradients come from ``unfold`` and one batched matrix product when a patch is
    short (few input channels: many small products would be slow in a grouped convolution),
    else from grouped convolutions whose groups are the examples of a small chunk
    (``groups = n * groups``; one example at a time for large weights).
    Squared norms use the ghost identity over the output positions when that is cheaper;
    otherwise the per-sample gradients are formed in chunks of examples. Either way the
    temporaries (unfolded inputs, per-sample gradients) stay under ``NORM_CHUNK_ELEMENTS``
    per chunk, so no buffer of the order of B x P exists. The clipped sum is one ordinary
    convolution weight gradient with ``g`` scaled per example.

    A transposed convolution's rule passes its output gradient as ``x`` and its input as
    ``g`` (see the module's docstring).
    """

    def __init__(self, x, g, weight_shape, region_shape, stride, padding, dilation, groups):
        self.x = x
        self.g = g
        self.weight_shape = tuple(weight_shape)  # (O, C / groups, *kernel)
        self.region_shape = tuple(region_shape)  # the parameter's own shape
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.rows = None
        self.keeping = False  # (whether :meth:`sq_norms` keeps the per-sample gradients)
        self.kept_last = False  # (kept chunks channels last: :meth:`_per_sample_last`)

    @property
    def batch(self) -> int:
        return self.x.shape[0]

    def _dims(self):
        O, cg, *kernel = self.weight_shape
        return O, cg, math.prod(kernel), math.prod(self.g.shape[2:])

    def _unfolds(self) -> bool:
        """Whether per-sample gradients go through ``unfold`` (short patches)."""
        _, cg, k, _ = self._dims()
        return cg * k < 64

    def _unfold(self, s: int, e: int) -> Tensor:
        return unfold_nd(self.x[s:e], self.weight_shape[2:], self.dilation, self.padding,
                         self.stride)

    def _per_sample(self, s: int, e: int) -> Tensor:
        """Per-sample gradients of examples ``s:e``, shape ``(e - s, *weight_shape)``."""
        O, cg, k, L = self._dims()
        G = self.groups
        x, g = self.x[s:e], self.g[s:e]
        n = e - s
        if self._unfolds():
            U = self._unfold(s, e)
            g3 = g.reshape(n, O, L)
            if G == 1:
                # U g^T, read transposed: U (n, C k, L) is contiguous along L, the summed
                # dimension, so no operand is transposed in memory, and the result needs no
                # copy (a view of shape (n, O, C, *kernel)). The CNN rows of
                # benchmarks/bench_per_sample.py time this path.
                return torch.bmm(U, g3.mT).mT.unflatten(2, self.weight_shape[1:])
            out = x.new_empty((n, *self.weight_shape))
            og = O // G
            U4 = U.view(n, G, cg * k, L)
            for j in range(G):
                out[:, j * og : (j + 1) * og] = torch.bmm(
                    g3[:, j * og : (j + 1) * og], U4[:, j].mT
                ).view(n, og, *self.weight_shape[1:])
            return out
        C = x.shape[1]
        gw = _CONV_WEIGHT[len(self.weight_shape) - 2](
            x.reshape(1, n * C, *x.shape[2:]),
            (n * O, cg, *self.weight_shape[2:]),
            g.reshape(1, n * O, *g.shape[2:]),
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            groups=n * G,
        )
        return gw.view(n, *self.weight_shape)

    def _dtype(self) -> torch.dtype:
        return self.x.dtype

    def _device(self) -> torch.device:
        return self.x.device

    def write_range(self, out: Tensor, start: int, stop: int, accumulate: bool) -> None:
        G = self._per_sample(start, stop).reshape(out.shape)
        out.add_(G) if accumulate else out.copy_(G)

    def _per_example(self) -> int:
        """Elements of the temporaries of :meth:`_per_sample` per example."""
        O, cg, k, L = self._dims()
        return math.prod(self.weight_shape) + (cg * k * L * self.groups if self._unfolds() else 0)

    def write(self, out: Tensor, accumulate: bool, chunk_size: int | None) -> None:
        # The unfolded input can be larger than the per-sample gradients (many output
        # positions), so it counts towards the chunk budget too. The grouped convolution
        # slows down with its number of groups far more than the work grows: its chunks get
        # the norms' small budget (one example at a time for a 3x3 convolution of 128
        # channels or more). With B = 16 it takes 0.64, 0.43 and 0.73 of the time that
        # chunks of the default budget took, for 128, 256 and 512 channels
        # (benchmarks/results/per_sample_parts.md, conv_chunks).
        per_example = max(self._per_example(), math.prod(self.region_shape))
        budget = None if self._unfolds() else NORM_CHUNK_ELEMENTS
        for s, e in chunks(self.batch, per_example, chunk_size, budget):
            self.write_range(out[s:e], s, e, accumulate)

    def _ghost_cheaper(self) -> bool:
        O, cg, k, L = self._dims()
        p, q = cg * k, O // self.groups
        return L * (p + q) < p * q

    def sq_norms(self, chunk_size: int | None, keep: KeepBudget | None = None) -> Tensor:
        B = self.batch
        O, cg, k, L = self._dims()
        G = self.groups
        if self._ghost_cheaper():
            out = self.x.new_zeros(B, dtype=wide_dtype(self.x.dtype, self.x.device))
            og = O // G
            per_example = cg * k * L * G + 2 * L * L
            for s, e in chunks(B, per_example, chunk_size, NORM_CHUNK_ELEMENTS):
                n = e - s
                U4 = self._unfold(s, e).view(n, G, cg * k, L)
                g4 = self.g[s:e].reshape(n, G, og, L)
                for j in range(G):  # (patches and output gradients, position-major)
                    out[s:e] += ghost_sq_norms(U4[:, j].mT, g4[:, j].mT)
            return out
        # Direct: the per-sample gradients (and, for short patches, the unfolded input),
        # their chunks kept as they are for the clipped sum where the budget allows (not
        # copied into one new buffer: the clipped step on the CNN of bench_per_sample.py
        # takes 0.97 of the time it took so, benchmarks/results/per_sample_parts.md,
        # kept_chunks).
        self.keeping = keep is not None and keep.take(B * math.prod(self.weight_shape))
        by_patches = self._patches_choice(chunk_size)
        if by_patches is None:
            return self._measure(chunk_size)
        kept: list[tuple[int, int, Tensor]] | None = [] if self.keeping else None
        out = self._direct_norms(by_patches, chunk_size, kept)
        self.kept = kept
        self.kept_last = by_patches
        return out

    def _direct_norms(self, by_patches: bool, chunk_size: int | None,
                      kept: list[tuple[int, int, Tensor]] | None) -> Tensor:
        """The squared norms from the per-sample gradients, formed one way (NOTE [two ways
        to a convolution's per-sample gradients]) a chunk of examples at a time; each chunk
        appended to ``kept`` where it is a list."""
        B = self.batch
        out = self.x.new_empty(B, dtype=wide_dtype(self.x.dtype, self.x.device))
        per_example = self._patches_per_example() if by_patches else self._per_example()
        for s, e in chunks(B, per_example, chunk_size, NORM_CHUNK_ELEMENTS):
            if by_patches:
                per_sample = self._per_sample_last(s, e)
                # (one reduction over each example's (O, kh kw C) block, read in place)
                out[s:e] = wide_sq_norms(per_sample)
            else:
                per_sample = self._per_sample(s, e)
                out[s:e] = wide_sq_rows(per_sample)
            if kept is not None:
                kept.append((s, e, per_sample))
        return out

    # -- NOTE [two ways to a convolution's per-sample gradients] -------------------------

    def _patches_key(self, chunk_size: int | None) -> tuple | None:
        """The key of :data:`PATCHES_FASTER` for this factor, or None where the patches'
        product is not a choice (the grouped convolution is used)."""
        x = self.x
        if (self.groups != 1 or len(self.weight_shape) != 4 or x.device.type != "cpu"
                or self._unfolds() or x.dtype not in (torch.float32, torch.float64)
                or tracing()):  # (no timing inside the user's torch.compile)
            return None
        return (tuple(x.shape), tuple(self.g.shape[1:]), self.weight_shape, self.stride,
                self.padding, self.dilation, x.dtype, chunk_size, NORM_CHUNK_ELEMENTS)

    def _patches_choice(self, chunk_size: int | None) -> bool | None:
        """Whether the direct norms go by the patches' product; None: not measured yet."""
        key = self._patches_key(chunk_size)
        if key is None:
            return False
        return PATCHES_FASTER.get(key)

    def _measure(self, chunk_size: int | None) -> Tensor:
        """The squared norms, computed both ways and each timed whole (NOTE [two ways to a
        convolution's per-sample gradients]); the choice recorded for this factor's shapes
        once measured on :data:`_PATCHES_CALLS` calls. What the second way formed is kept
        where :attr:`keeping`; what the first formed is let go before the second runs."""
        key = self._patches_key(chunk_size)
        if len(_PATCHES_TIMES) >= 256:
            _PATCHES_TIMES.clear()
        best = _PATCHES_TIMES.setdefault(key, [math.inf, math.inf, 0])  # type: ignore[arg-type]
        # (the order alternates from call to call: what runs second finds the caches warm)
        order = (False, True) if best[2] % 2 == 0 else (True, False)
        out = kept = None
        for way in order:
            out = kept = None  # (the first way's gradients go before the second's are made)
            kept = [] if self.keeping else None
            start = time.process_time()
            out = self._direct_norms(way, chunk_size, kept)
            best[int(way)] = min(best[int(way)], time.process_time() - start)
        best[2] += 1
        if best[2] >= _PATCHES_CALLS:
            if len(PATCHES_FASTER) >= 256:
                PATCHES_FASTER.clear()
            PATCHES_FASTER[key] = best[1] <= _PATCHES_MARGIN * best[0]  # type: ignore[index]
            del _PATCHES_TIMES[key]
        self.kept = kept
        self.kept_last = order[1]
        return out  # type: ignore[return-value]

    def _patches_per_example(self) -> int:
        """Elements of the temporaries of :meth:`_per_sample_last` per example (the
        channels-last copy of the padded input, the patches, the per-sample gradients)."""
        O, cg, k, L = self._dims()
        padded = math.prod(n + 2 * p for n, p in zip(self.x.shape[2:], self.padding))
        return self.x.shape[1] * padded + L * cg * k + O * cg * k

    def _per_sample_last(self, s: int, e: int) -> Tensor:
        """Per-sample gradients of examples ``s:e`` (``groups == 1``, 2-D), channels last:
        ``(e - s, O, kh * kw * C)``."""
        O, _, _, L = self._dims()
        P = patches_last(self.x[s:e], self.weight_shape[2:], self.dilation, self.padding,
                         self.stride)
        return torch.bmm(self.g[s:e].reshape(e - s, O, L), P)

    def kept_sum(self, c: Tensor) -> Tensor:
        if not self.kept_last:
            return super().kept_sum(c)
        # (each chunk by one matrix product into a buffer made once, then added: tensordot's
        # numbers bit for bit, without its Python layer and a new tensor per chunk; addmm_
        # or addmv_ would add inside the product, which rounds otherwise)
        total: Tensor | None = None
        buf: Tensor | None = None
        for s, e, G in self.kept:  # type: ignore[union-attr]
            w, rows = c[s:e].to(G.dtype).view(1, e - s), G.reshape(e - s, -1)
            if total is None:
                total = torch.mm(w, rows)
            else:
                buf = torch.empty_like(total) if buf is None else buf
                total.add_(torch.mm(w, rows, out=buf))
        O, C, kh, kw = self.weight_shape
        assert total is not None
        return total.view(O, kh, kw, C).permute(0, 3, 1, 2).contiguous().view(
            self.region_shape)

    def weighted_sum(self, c: Tensor) -> Tensor:
        B = self.batch
        O, cg, k, L = self._dims()
        # The temporary is g scaled (the size of g, as in an ordinary backward), so the usual
        # budget applies: one ordinary weight gradient in the common case.
        total = None
        for s, e in chunks(B, O * L, None):
            gc = self.g[s:e] * c[s:e].view(e - s, *([1] * (self.g.dim() - 1)))
            gw = _CONV_WEIGHT[len(self.weight_shape) - 2](
                self.x[s:e], self.weight_shape, gc, stride=self.stride, padding=self.padding,
                dilation=self.dilation, groups=self.groups,
            )
            total = gw if total is None else total.add_(gw)
        return total.view(self.region_shape)


def _conv_factor(x, g, weight_shape, stride, padding, dilation, groups) -> ConvFactor:
    """A :class:`ConvFactor` for the convolution ``conv(x, W) -> g``'s shape, ``W`` of
    ``weight_shape``; a 1-D convolution becomes a 2-D one of height 1 (the 2-D paths are the
    fastest, and ``as_strided`` and grouped convolutions handle the extra dimension free)."""
    if len(weight_shape) == 3:
        return ConvFactor(
            x.unsqueeze(-2), g.unsqueeze(-2), (*weight_shape[:2], 1, weight_shape[2]),
            weight_shape, (1, stride[0]), (0, padding[0]), (1, dilation[0]), groups,
        )
    return ConvFactor(x, g, weight_shape, weight_shape, tuple(stride), tuple(padding),
                      tuple(dilation), groups)


def _examples_first(t: Tensor, bdim: int | None, rank: int) -> Tensor:
    """``t`` (a layer's input or output gradient) as ``(N, C, *S)`` with the examples first.

    With ``bdim=None`` the whole call belongs to the batch's one example: an unbatched call
    ``(C, *S)`` gains a dimension of size one, and a batched one keeps its own ``N`` rows
    (all of them the one example's, see :meth:`_ConvRuleBase._factors`).
    """
    if bdim is None:
        return t.unsqueeze(0) if t.dim() == rank - 1 else t
    return to_batch_first(t, bdim)


class _ConvRuleBase(Rule):
    """What the convolution rules share: the batch dimension, the bias, and calls whose
    rows all belong to one example."""

    def batch_dims(self, module, x):
        # A batched input has the weight's rank (B, C, *S); an unbatched one (C, *S) holds
        # no dimension of examples.
        return (0,) if isinstance(x, Tensor) and x.dim() == module.weight.dim() else ()

    def _factors(self, call, grads, roles, batch, weight_factor):
        """The factors of ``call``; ``weight_factor(x, g, w)`` makes the weight's, from the
        input and output gradient with the examples first."""
        if grads[0] is None:
            return []
        rank = call.module.weight.dim()
        gb = _examples_first(grads[0], call.bdim, rank)
        # A batch of one whose layer call has rows of its own (a model that folds its one
        # example into several rows of the convolution's batch): every row is that example's.
        one = gb.shape[0] != batch
        out = []
        if "weight" in roles:
            w, _ = call.params["weight"]
            f = weight_factor(_examples_first(call.x, call.bdim, rank), gb, w)
            if one:
                f = SmallFactor(f.weighted_sum(gb.new_ones(gb.shape[0])).unsqueeze(0))
            out.append(("weight", f))
        if "bias" in roles:
            # each example's output gradient summed over positions (and rows, for ``one``)
            b = gb.transpose(0, 1).reshape(gb.shape[1], -1).sum(1).unsqueeze(0) if one else (
                gb.reshape(batch, gb.shape[1], -1).sum(2))
            out.append(("bias", SmallFactor(b)))
        return out


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvRule(_ConvRuleBase):
    """Conv1d / Conv2d / Conv3d (see :class:`ConvFactor`)."""

    name = "Conv"

    def factors(self, call, grads, roles, batch):
        m = call.module

        def weight(x, g, w):
            padding = m.padding
            if isinstance(padding, str) or m.padding_mode != "zeros":
                # 'same' may pad unevenly, and other modes are not zeros: pad explicitly as
                # the layer's forward does, then convolve without padding ('valid', or no
                # padding at all, needs no copy).
                pads = m._reversed_padding_repeated_twice
                if any(pads):
                    mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
                    x = F.pad(x, pads, mode=mode)
                padding = (0,) * (w.dim() - 2)
            return _conv_factor(x, g, tuple(w.shape), m.stride, padding, m.dilation, m.groups)

        return self._factors(call, grads, roles, batch, weight)


@register_rule(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
class ConvTransposeRule(_ConvRuleBase):
    """ConvTranspose1d / 2d / 3d: the weight gradient of ``conv(g, W)`` with the layer's input
    as the output gradient (see the module's docstring).

    The layer's weight ``(C_in, C_out / groups, *kernel)`` is that convolution's weight, and
    its stride, padding, dilation and groups are the layer's. ``output_padding`` (or an
    ``output_size`` given to ``forward``) only lengthens ``y`` at the end; the convolution of
    ``g`` then reads those positions or, when ``output_padding >= stride`` (allowed where the
    dilation is larger), would produce more positions than ``x`` has: ``g`` is then padded
    explicitly, unevenly, so that it produces exactly ``x``'s. The lengths are read from the
    shapes of ``x`` and ``g``, so an ``output_size`` passed by keyword is handled too.
    """

    name = "ConvTranspose"

    def factors(self, call, grads, roles, batch):
        m = call.module

        def weight(x, g, w):
            kernel = w.shape[2:]
            padding = tuple(m.padding)
            # The padded length of g whose convolution has exactly x's positions, and so the
            # padding after g's end that gives it (negative: cut).
            right = tuple(
                (X - 1) * s + d * (k - 1) + 1 - Y - p
                for X, Y, k, s, p, d in zip(x.shape[2:], g.shape[2:], kernel, m.stride,
                                            padding, m.dilation)
            )
            if right != padding:
                g = F.pad(g, [v for p, r in zip(reversed(padding), reversed(right))
                              for v in (p, r)])
                padding = (0,) * len(kernel)
            # input and output gradient swapped (see the module's docstring)
            return _conv_factor(g, x, tuple(w.shape), m.stride, padding, m.dilation, m.groups)

        return self._factors(call, grads, roles, batch, weight)
