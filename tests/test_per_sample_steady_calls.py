"""A steady call of the per-sample functions (the plan made and checked): what it still does
on every call costs as little as it can, and gives the per-example loop's results, in a
tensor of the caller's own."""

from __future__ import annotations

import sys
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torch_vjp as tv
from torch_vjp._per_sample import norms_wide, run

from _references import per_example_grads


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    return model, nn.CrossEntropyLoss(), x, y


class _Counted(weakref.WeakKeyDictionary):
    """The selection cache, counting the calls that make a weak reference to the model."""

    def __init__(self) -> None:
        super().__init__()
        self.made = 0

    def setdefault(self, key, default=None):
        self.made += 1
        return super().setdefault(key, default)


def test_steady_call_reads_the_selection_cache_without_a_new_weak_reference(monkeypatch):
    counted = _Counted()
    monkeypatch.setattr(run, "_STATIC", counted)
    model, loss_fn, x, y = _model()
    tv.per_sample_grad_norms(model, loss_fn, x, y)  # (plans, checks, fills the cache)
    first = counted.made
    for _ in range(3):
        tv.per_sample_grad_norms(model, loss_fn, x, y)
    assert counted.made == first


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_norms_alone_take_their_square_root_in_place(dtype):
    # (the total of the squared norms is the call's own: no second tensor for its root)
    model, loss_fn, x, y = _model()
    model, x = model.to(dtype), x.to(dtype)
    tv.per_sample_grad_norms(model, loss_fn, x, y)
    with _Ops() as seen:
        tv.per_sample_grad_norms(model, loss_fn, x, y)
    assert "sqrt_" in seen.ops and "sqrt" not in seen.ops


def test_steady_norms_are_the_loops_and_the_callers_own():
    model, loss_fn, x, y = _model()
    ref = per_example_grads(model, loss_fn, x, y)
    want = torch.stack([g.flatten(1).pow(2).sum(1) for g in ref.values()]).sum(0).sqrt()
    held = []
    for k in range(4):  # (the first call plans and checks; the later ones are steady)
        norms = tv.per_sample_grad_norms(model, loss_fn, x * (1 + k), y)
        held.append((norms, norms.clone()))
        if k == 0:
            torch.testing.assert_close(norms, want, rtol=1e-12, atol=1e-14)
    for norms, copy in held:  # (no later call wrote into an earlier result)
        assert norms.equal(copy)
    assert len({id(n) for n, _ in held}) == len(held)
    assert all(p.grad is None for p in model.parameters())


def test_steady_clipped_step_is_the_loops():
    model, loss_fn, x, y = _model()
    ref = per_example_grads(model, loss_fn, x, y)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in ref.values()]).sum(0).sqrt()
    c = (0.3 / norms).clamp(max=1.0)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        got = tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=0.3)
        torch.testing.assert_close(got, norms, rtol=1e-12, atol=1e-14)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, ref[n]),
                                       rtol=1e-12, atol=1e-14)


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
