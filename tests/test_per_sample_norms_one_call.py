"""The squared row norms of the factors inside narrow_norms (NOTE [one check on the CPU]):
the same numbers as the general path, bit for bit, asked for in one call (they are taken
for every factor of every call of the norms and the clipped step)."""

from __future__ import annotations

import sys

import torch

from torch_vjp._per_sample import norms_wide
from torch_vjp._per_sample.norms_wide import narrow_norms, row_norms, wide_sq_norms, wide_sq_rows


def _python_calls(fn):
    """The names of the functions of norms_wide that ``fn()`` enters (besides the one
    called)."""
    seen: list[str] = []

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == norms_wide.__file__:
            seen.append(frame.f_code.co_name)

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_narrow_rows_are_the_plain_norms_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for shape in [(8, 16), (5, 3, 7), (4, 2, 3, 5), (1, 1)]:
        v = torch.randn(shape, generator=g) * 1e3
        rows = v.reshape(shape[0], -1)
        with narrow_norms():
            got_rows = wide_sq_rows(v)
            got_norms = wide_sq_norms(v)
            general = row_norms(v).square()  # (the path they took before, in narrow mode)
        assert got_rows.dtype == torch.float32 and got_norms.dtype == torch.float32
        assert torch.equal(got_rows, torch.linalg.vector_norm(rows, dim=1).square())
        assert torch.equal(got_norms, general)
        assert torch.equal(got_rows, got_norms)
        # outside narrow_norms: float64, as right (NOTE [norms past the square])
        wide = wide_sq_rows(v)
        assert wide.dtype == torch.float64
        ref = rows.double().square().sum(1)
        assert torch.allclose(wide, ref, rtol=1e-12)


def test_narrow_rows_overflow_shows_as_inf():
    # (the one check reads an inf where the squares pass float32's range; the caller then
    # takes the norms again in float64)
    v = torch.full((2, 4), 3e19)
    v[1] = 1.0
    with narrow_norms():
        sq = wide_sq_rows(v)
    assert torch.isinf(sq[0]) and sq[1] == 4.0
    assert torch.isfinite(wide_sq_rows(v)).all()


def test_narrow_rows_asked_in_one_call():
    v = torch.randn(8, 16)
    with narrow_norms():
        calls = _python_calls(lambda: wide_sq_rows(v))
        calls_norms = _python_calls(lambda: wide_sq_norms(v.view(8, 4, 4)))
    assert calls == ["wide_sq_rows"], calls
    assert calls_norms == ["wide_sq_norms"], calls_norms
