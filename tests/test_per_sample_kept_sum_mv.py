"""The clipped sum from per-sample gradients the norms kept in chunks (keep.kept_weighted_sum):
right in float64 against the per-example sum, one matrix-vector product per chunk."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_vjp._per_sample.keep import kept_weighted_sum


def _chunks(grads, step):
    B = grads.shape[0]
    return [(s, min(B, s + step), grads[s:min(B, s + step)]) for s in range(0, B, step)]


def test_kept_chunks_sum_float64():
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(13, 4, 3, 2, dtype=torch.float64, generator=gen)
    c = torch.rand(13, dtype=torch.float64, generator=gen)
    c[5] = 0.0
    ref = sum(c[i] * grads[i] for i in range(13))
    for step in (1, 4, 13):
        got = kept_weighted_sum(_chunks(grads, step), c)
        assert got.shape == (4, 3, 2)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kept_weighted_sum(grads, c), ref, rtol=1e-12, atol=1e-12)


def test_kept_chunks_not_contiguous_and_left_alone():
    # (a chunk kept as a transposed view, as a convolution's unfolded product gives it)
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(6, 5, 4, dtype=torch.float64, generator=gen)
    grads = base.mT  # (6, 4, 5), not contiguous
    c = torch.rand(6, dtype=torch.float64, generator=gen)
    kept = _chunks(grads, 4)
    before = [g.clone() for _, _, g in kept]
    got = kept_weighted_sum(kept, c)
    torch.testing.assert_close(got, sum(c[i] * grads[i] for i in range(6)), rtol=1e-12,
                               atol=1e-12)
    assert all(torch.equal(g, b) for (_, _, g), b in zip(kept, before))


def test_kept_chunks_sum_in_their_dtype():
    grads = torch.randn(5, 3)
    c = torch.rand(5, dtype=torch.float64)
    got = kept_weighted_sum(_chunks(grads, 2), c)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), (c[:, None] * grads.double()).sum(0),
                               rtol=1e-5, atol=1e-6)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in ("_to_copy", "clone"):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_kept_chunks_one_product_each():
    kept, c = _chunks(torch.randn(9, 16, 25), 3), torch.rand(9)
    with _Ops() as m:
        kept_weighted_sum(kept, c)
    assert sorted(m.ops) == ["addmv_", "addmv_", "mv"], m.ops
