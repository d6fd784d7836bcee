"""Many watched buffers of one dtype are copied and compared as one flat tensor per dtype
(NOTE [one copy of the watched buffers] in kept.py): a call makes two copies per dtype where
it made one per buffer, and what is put back, and reported, is what the one-at-a-time
reading puts back, in the same order: a change without a version bump, a signed zero, a NaN
payload, a buffer of other strides, one resized in place, one given data of another dtype,
BatchNorm's statistics and counters, and fewer buffers of a dtype, or one requiring grad
(read one at a time)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_vjp._engine import kept

N = kept.GROUPED_FROM


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _buffers(dtype=torch.float32, n=N):
    g = torch.Generator().manual_seed(0)
    out = [("a", torch.randn(256, generator=g, dtype=dtype)),
           ("b", torch.randn(8, 32, generator=g, dtype=dtype)),
           ("c", torch.randn(5, 3, generator=g, dtype=dtype).t())]  # (other strides)
    out += [(f"d{k}", torch.randn(8, generator=g, dtype=dtype)) for k in range(n - 3)]
    return out


def _copies(ops):
    return [op for op in ops if op in ("clone", "cat", "copy_", "_to_copy")]


def test_a_call_copies_the_buffers_once_not_once_each():
    buffers = [b for b in _buffers(n=N + 1) if b[1].is_contiguous()]
    assert len(buffers) == N
    with _Count() as count:
        w = kept.Watched(buffers)
        assert w.restore() == {}
    # (one flat copy before the call, one after; one clone per buffer before)
    assert _copies(count.ops) == ["cat", "cat"], count.ops


def test_fewer_buffers_are_read_one_at_a_time():
    buffers = [b for b in _buffers(n=N + 1) if b[1].is_contiguous()][:N - 1]
    with _Count() as count:
        w = kept.Watched(buffers)
        assert w.restore() == {}
    assert _copies(count.ops) == ["clone"] * (N - 1), count.ops


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32,
                                   torch.float64])
@pytest.mark.parametrize("which", ["a", "b", "c", "d0"])
def test_a_change_without_a_version_bump_is_put_back_and_named(dtype, which):
    buffers = _buffers(dtype)
    before = {n: t.clone() for n, t in buffers}
    w = kept.Watched(buffers)
    assert w.entries[0][3] is None  # (copied as one)
    t = dict(buffers)[which]
    with torch.no_grad():
        t[(0,) * t.dim()] = float("nan") if which == "d0" else -0.0
        if which == "c":
            t.add_(1)
    assert w.restore() == {which: True}
    for n, t in buffers:
        assert torch.equal(_bits(t), _bits(before[n])), n
    assert w.restore() == {}


def test_signed_zeros_and_nan_payloads_count_as_changes():
    zero = torch.tensor([0.0, 1.0])
    nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32).repeat(2)
    for t, new in ((zero, torch.tensor([-0.0, 1.0])),
                   (nan, torch.tensor([float("nan")] * 2))):
        others = [(f"o{k}", torch.ones(3)) for k in range(N - 1)]
        w = kept.Watched([("t", t), *others])
        assert w.entries[0][3] is None
        old = t.clone()
        t.view(torch.int32).copy_(new.view(torch.int32))
        assert w.restore() == {"t": True}
        assert torch.equal(t.view(torch.int32), old.view(torch.int32))


def _resized(one_copy):
    a = torch.arange(4.0)
    others = [(f"o{k}", torch.arange(3.0)) for k in range(N - 1)]
    w = kept.Watched([("a", a), *others]) if one_copy else kept.Watched([("a", a)])
    assert (w.entries[0][3] is None) is one_copy
    with torch.no_grad():
        a.resize_(2)
    try:
        return w.restore()
    except RuntimeError as err:
        return str(err)


def test_a_buffer_resized_in_place_is_read_one_at_a_time():
    # (put back from a copy of its old shape, as one at a time: torch's copy_ refuses it)
    assert _resized(True) == _resized(False)


def test_a_buffer_given_data_of_another_dtype_is_read_one_at_a_time():
    bufs = [(f"o{k}", torch.ones(2)) for k in range(N)]
    w = kept.Watched(bufs)
    b = bufs[1][1]
    b.data = torch.ones(2, dtype=torch.float64)  # (the same values, another dtype)
    assert w.restore() == {"o1": True}
    assert b.dtype == torch.float64 and torch.equal(b, torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("second", ["float64", "requires_grad"])
def test_a_buffer_of_another_kind_is_read_one_at_a_time(second):
    a = torch.arange(3.0)
    b = (torch.arange(3.0, dtype=torch.float64) if second == "float64"
         else torch.arange(3.0).requires_grad_())
    others = [(f"o{k}", torch.zeros(2)) for k in range(N - 1)]
    w = kept.Watched([("a", a), ("b", b), *others])
    assert w.entries[0][3] is None and w.entries[1][3] is not None
    with torch.no_grad():
        a[0] = 7.0
        b[0] = 7.0
    assert w.restore() == {"a": True, "b": True}
    assert torch.equal(a, torch.arange(3.0)) and torch.equal(b.detach(), torch.arange(3.0))


def test_parameters_after_the_buffers_are_still_read_by_their_version():
    bufs = [(f"o{k}", torch.zeros(2)) for k in range(N)]
    p = torch.zeros(2)
    w = kept.Watched(bufs, [("p", p)])
    p.add_(0)  # (the version moves, the values do not)
    bufs[2][1].add_(1)
    assert w.restore() == {"o2": True, "p": False}
    assert torch.equal(bufs[2][1], torch.zeros(2))


def test_batch_norm_buffers_are_copied_once_per_dtype_and_put_back_in_order():
    bns = [torch.nn.BatchNorm1d(3) for _ in range(N)]
    buffers = [(f"{i}.{n}", b) for i, bn in enumerate(bns) for n, b in bn.named_buffers()]
    before = {n: b.clone() for n, b in buffers}
    with _Count() as count:
        w = kept.Watched(buffers)
    assert _copies(count.ops) == ["cat", "cat"], count.ops  # (float32, int64)
    bns[0](torch.randn(4, 3))  # (the statistics and the counter of the first move)
    bns[1].num_batches_tracked += 2
    assert list(w.restore()) == ["0.running_mean", "0.running_var",
                                 "0.num_batches_tracked", "1.num_batches_tracked"]
    for n, b in buffers:
        assert torch.equal(b, before[n]), n
    assert w.restore() == {}


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.uint8])
def test_integer_and_bool_buffers_are_compared_as_they_are(dtype):
    bufs = [(f"o{k}", torch.tensor([0, 1, 1], dtype=dtype)) for k in range(N)]
    w = kept.Watched(bufs)
    assert w.entries[0][3] is None
    bufs[3][1][0] = 1
    assert w.restore() == {"o3": True}
    assert torch.equal(bufs[3][1], torch.tensor([0, 1, 1], dtype=dtype))
