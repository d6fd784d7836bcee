"""A steady call of the per-sample functions (the plan made and checked): what it still does
on every call costs as little as it can, and gives the per-example loop's results, in a
tensor of the caller's own."""

from __future__ import annotations

import sys

import pytest

from torch_vjp._per_sample import norms_wide


def test_narrow_norms_enters_no_generator():
    # (entered on every call of the norms and the clipped step: no contextlib frame)
    entered: list[str] = []

    def prof(frame, event, arg):
        if event == "call":
            entered.append(frame.f_code.co_filename)

    sys.setprofile(prof)
    try:
        with norms_wide.narrow_norms():
            pass
    finally:
        sys.setprofile(None)
    assert not [f for f in entered if f.endswith("contextlib.py")]


def test_narrow_norms_restores_the_flag_on_error_and_when_nested():
    assert not getattr(norms_wide._STATE, "narrow", False)
    with pytest.raises(KeyError):
        with norms_wide.narrow_norms():
            assert norms_wide._STATE.narrow
            raise KeyError("inside")
    assert not norms_wide._STATE.narrow
    with norms_wide.narrow_norms():
        with norms_wide.narrow_norms():
            pass
        assert norms_wide._STATE.narrow  # (the outer one still holds)
    assert not norms_wide._STATE.narrow
