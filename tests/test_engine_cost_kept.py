"""same_bits reads a real floating dtype's bits through one table (NOTE [unchanged, bit for
bit]), with the answers of the general reading: every floating dtype of torch's has its
integer dtype of the same size, and signed zeros, NaN payloads, shapes and dtypes compare as
they did; Watched puts back what changed and leaves the grad mode as it was."""

from __future__ import annotations

import pytest
import torch

from torch_vjp._engine import kept


def _reference(a, b):
    # (the general reading, as same_bits reads every dtype but the real floating ones)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    if a.is_complex():
        a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(bits), b.view(bits))


def test_every_floating_dtype_has_its_bits():
    floats = [d for d in vars(torch).values()
              if isinstance(d, torch.dtype) and d.is_floating_point and d.itemsize <= 8]
    assert floats
    for d in floats:
        bits = kept._FLOAT_BITS[d]
        assert bits.itemsize == d.itemsize and not bits.is_floating_point


def _pairs():
    nan2 = torch.tensor([1], dtype=torch.int32).view(torch.float32) * 0 + float("nan")
    payload = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        a = torch.tensor([1.0, -0.0, 2.5], dtype=dtype)
        yield a, a.clone()
        yield a, torch.tensor([1.0, 0.0, 2.5], dtype=dtype)  # a signed zero
        yield a, a[:2].clone()  # another shape
        yield a, a.double() if dtype != torch.float64 else a.float()  # another dtype
        yield a.reshape(3, 1).t(), a.reshape(1, 3).clone()  # a view, other strides
    yield nan2, nan2.clone()
    yield payload, torch.tensor([float("nan")])  # another NaN payload
    yield torch.tensor([1, 2]), torch.tensor([1, 2])
    yield torch.tensor([True]), torch.tensor([False])
    yield torch.tensor([1 + 2j]), torch.tensor([1 + 2j])
    yield torch.tensor([1.0, 2.0]), torch.tensor([1, 2])
    yield torch.tensor([1.0]).to(torch.float8_e4m3fn), torch.tensor([1.0]).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("pair", list(_pairs()))
def test_the_answers_are_those_of_the_general_reading(pair):
    a, b = pair
    assert kept.same_bits(a, b) == _reference(a, b)


@pytest.mark.parametrize("grad", [True, False])
def test_watched_puts_back_and_keeps_the_grad_mode(grad):
    t = torch.tensor([1.0, -0.0, 3.0])
    w = kept.Watched([("t", t)])
    t[1] = 0.0  # (equal as numbers, other bits)
    with torch.set_grad_enabled(grad):
        assert w.restore() == {"t": True}
        assert torch.is_grad_enabled() is grad
    assert torch.equal(t.view(torch.int32), torch.tensor([1.0, -0.0, 3.0]).view(torch.int32))
    assert w.restore() == {}
