"""Checked mode beside another library that patches the same entry points of torch (NOTE
[patches of other libraries] in ``torch_vjp._checked_mode``): a patch made over a checking
wrapper is kept, a patch that calls the wrapper back never recurses, and checks go on."""

from __future__ import annotations

import pytest
import torch

import torch_vjp as tv
from torch_vjp import _checked_mode, _checked_scope

_ENTRY_POINTS = ((torch.autograd, "grad"), (torch.autograd, "backward"),
                 (torch.Tensor, "backward"), (torch.func, "vjp"))


@pytest.fixture(autouse=True)
def _restored():
    """Puts torch's entry points and checked mode's record of them back as they were."""
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in _ENTRY_POINTS]
    records = [getattr(_checked_mode, name) for name in ("_PREVIOUS", "_REPLACED", "_INSTALLED")
               if hasattr(_checked_mode, name)]
    state = [dict(d) for d in records]
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
        for d, old in zip(records, state):
            d.clear()
            d.update(old)


def _leaf():
    return torch.randn(3, requires_grad=True)


def test_a_tensor_backward_patch_made_after_a_block_survives_the_next_block():
    x = _leaf()
    with tv.checked():
        (x * 2).sum().backward()
    calls = []
    found = torch.Tensor.backward  # checked mode's wrapper: it stays after the block

    def logged(self, *args, **kwargs):
        calls.append(1)
        return found(self, *args, **kwargs)

    torch.Tensor.backward = logged
    with tv.checked():
        assert torch.Tensor.backward is logged
        with pytest.raises(tv.GradOutputsError, match=r"gradient has shape \(4,\)"):
            (x * 2).backward(torch.ones(4))  # still checked, through the library's patch
    assert torch.Tensor.backward is logged
    x.grad = None
    (x * 2).sum().backward()  # was RecursionError on every call from here on
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    assert len(calls) == 2


def test_a_grad_patch_made_inside_a_block_survives_the_next_block():
    x = _leaf()
    calls = []
    with tv.checked():
        found = torch.autograd.grad  # the checking wrapper

        def logged(*args, **kwargs):
            calls.append(1)
            return found(*args, **kwargs)

        torch.autograd.grad = logged
        torch.autograd.grad((x * 2).sum(), x)
    assert torch.autograd.grad is logged  # kept on the last exit
    torch.autograd.grad((x * 2).sum(), x)
    with tv.checked():
        assert torch.autograd.grad is logged  # and on the next entry
        (g,) = torch.autograd.grad((x * 2).sum(), x)  # was RecursionError
        assert torch.equal(g, torch.full((3,), 2.0))
        with pytest.raises(tv.GradOutputsError, match=r"grad_outputs\[0\] has shape \(4,\)"):
            torch.autograd.grad(x * 2, x, torch.ones(4))
    assert torch.autograd.grad is logged
    assert len(calls) == 4


def test_a_patch_that_calls_the_wrapper_back_does_not_recurse():
    # the library took the checking wrapper in one block and installed its own after the
    # block had put torch's function back: the next block's wrapper calls the library's,
    # which calls the wrapper again
    x = _leaf()
    calls = []
    with tv.checked():
        found = torch.autograd.grad
    genuine = torch.autograd.grad
    assert genuine is not found

    def logged(*args, **kwargs):
        calls.append(1)
        return found(*args, **kwargs)

    torch.autograd.grad = logged
    with tv.checked():
        assert torch.autograd.grad is found
        (g,) = torch.autograd.grad((x * 3).sum(), x)
        torch.testing.assert_close(g, torch.full((3,), 3.0))
        with pytest.raises(tv.GradOutputsError, match=r"grad_outputs\[0\] has shape \(4,\)"):
            torch.autograd.grad(x * 2, x, torch.ones(4))
    assert torch.autograd.grad is logged  # what the wrapper replaced, put back
    assert len(calls) == 2


def test_a_guarded_patch_still_sees_calls_made_from_within_a_backward_pass():
    class Inner(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            (t,) = ctx.saved_tensors
            with torch.enable_grad():
                u = t.detach().requires_grad_()
                (h,) = torch.autograd.grad((u * u).sum(), u)  # a new call, not a cycle
            return g * h

    x = _leaf()
    calls = []
    with tv.checked():
        found = torch.autograd.grad

    def logged(*args, **kwargs):
        calls.append(1)
        return found(*args, **kwargs)

    torch.autograd.grad = logged
    with tv.checked():
        (g,) = torch.autograd.grad(Inner.apply(x).sum(), x)
    torch.testing.assert_close(g, 2 * x.detach())
    assert len(calls) == 2


def test_a_patch_made_before_the_first_block_is_wrapped_and_put_back():
    x = _leaf()
    genuine = torch.autograd.grad
    calls = []

    def logged(*args, **kwargs):
        calls.append(1)
        return genuine(*args, **kwargs)

    torch.autograd.grad = logged
    with tv.checked():
        assert torch.autograd.grad is not logged
        with pytest.raises(tv.GradOutputsError, match=r"grad_outputs\[0\] has shape \(4,\)"):
            torch.autograd.grad(x * 2, x, torch.ones(4))
        torch.autograd.grad((x * 2).sum(), x)
    assert torch.autograd.grad is logged
    assert len(calls) == 2  # the rejected call ran torch's function to judge it


def test_a_patch_removed_again_leaves_the_wrapper_to_be_put_back():
    x = _leaf()
    with tv.checked():
        found = torch.autograd.grad
        torch.autograd.grad = lambda *a, **k: found(*a, **k)  # noqa: E731
    torch.autograd.grad = found  # the library takes its patch away, after the block
    torch.autograd.grad((x * 2).sum(), x)  # the wrapper, outside any block: unchecked
    with tv.checked():
        assert torch.autograd.grad is found
        with pytest.raises(tv.GradOutputsError):
            torch.autograd.grad(x * 2, x, torch.ones(4))
    assert torch.autograd.grad is _checked_scope._GENUINE_GRAD


def test_an_error_a_patch_raises_itself_passes_through_a_rejected_call():
    x = _leaf()

    def refusing(*args, **kwargs):
        raise RuntimeError("the library's own refusal")

    torch.autograd.grad = refusing
    with tv.checked(), pytest.raises(RuntimeError, match="^the library's own refusal$") as info:
        torch.autograd.grad(x * 2, x, torch.ones(4))  # rejected: torch (here, the patch) judges
    assert type(info.value) is RuntimeError
