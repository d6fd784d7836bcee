"""Convolutions: ``nn.Conv1d`` and ``nn.Conv2d``.

A convolution is a Linear layer applied to every patch of its input, so example ``i``'s
gradient of the weight is ``sum_l g[i, :, l] u[i, :, l]^T`` over the output positions ``l``,
with ``u`` the unfolded input patches (:class:`ConvFactor`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_vjp._per_sample.factors import (
    NORM_CHUNK_ELEMENTS,
    Factor,
    SmallFactor,
    chunks,
    sq_norms_rows,
)
from torch_vjp._per_sample.registry import Rule, register_rule, to_batch_first

__all__ = ["ConvFactor", "ConvRule", "unfold2d"]


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

    def _dtype(self) -> torch.dtype:
        return self.x.dtype

    def _device(self) -> torch.device:
        return self.x.device

    def write_range(self, out: Tensor, start: int, stop: int, accumulate: bool) -> None:
        G = self._per_sample(start, stop).reshape(out.shape)
        out.add_(G) if accumulate else out.copy_(G)

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


@register_rule(nn.Conv1d, nn.Conv2d)
class ConvRule(Rule):
    """Conv1d / Conv2d (see :class:`ConvFactor`); Conv1d runs as a 2-D conv of height 1."""

    name = "Conv"

    def batch_dims(self, module, x):
        return (0,) if isinstance(x, Tensor) and x.dim() == module.weight.dim() else ()

    def factors(self, call, grads, roles, batch):
        if grads[0] is None:
            return []
        m = call.module
        dims = m.weight.dim() - 2
        x = to_batch_first(call.x, call.bdim)
        gb = to_batch_first(grads[0], call.bdim)
        out = []
        O = gb.shape[1]
        if "weight" in roles:
            w, _ = call.params["weight"]
            padding = m.padding
            if isinstance(padding, str) or m.padding_mode != "zeros":
                mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
                x = F.pad(x, m._reversed_padding_repeated_twice, mode=mode)
                padding = (0,) * dims
            if dims == 1:
                x, gw = x.unsqueeze(-2), gb.unsqueeze(-2)
                wshape = (w.shape[0], w.shape[1], 1, w.shape[2])
                stride, padding, dilation = (1, m.stride[0]), (0, padding[0]), (1, m.dilation[0])
            else:
                gw, wshape = gb, tuple(w.shape)
                stride, padding, dilation = tuple(m.stride), tuple(padding), tuple(m.dilation)
            out.append(("weight", ConvFactor(x, gw, wshape, tuple(w.shape), stride, padding,
                                             dilation, m.groups)))
        if "bias" in roles:
            out.append(("bias", SmallFactor(gb.reshape(batch, O, -1).sum(2))))
        return out
