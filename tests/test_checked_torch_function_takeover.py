"""A call that torch hands to a ``__torch_function__`` override (a tensor type's, or an
active ``TorchFunctionMode``'s) may be answered by the override itself, which torch then
never judged. Checked mode checks such a call first, as any other, and where the checker
objects and the override returns, warns with the checker's word; that warning said "torch
accepted this call ... (torch ignores the vector given for an output that does not depend
on what is differentiated)", which is false for an override that never handed the call to
torch. It now names the override that answered."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv


class _TakesOver(torch.Tensor):
    """Answers torch.autograd.grad / backward itself (the names it is given), as a tensor
    type with an autograd of its own does."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.autograd.grad, torch.autograd.backward):
            return "answered by the override"
        return super().__torch_function__(func, types, args, kwargs or {})


class _HandsOn(torch.Tensor):
    """Hands torch.autograd.grad / backward on to torch, as a tensor wrapper does."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _our_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, tv.GradOutputsWarning)]


_TAKEN_OVER = {
    # a vector of the wrong shape for an output of the override's type
    "backward, wrong shape": lambda s, x: torch.autograd.backward(s, torch.ones(4)),
    "grad, wrong shape": lambda s, x: torch.autograd.grad(s, x, torch.ones(4)),
    # an output that does not require grad, with a vector
    "grad, output without graph": lambda s, x: torch.autograd.grad(s, x, torch.ones(3)),
    # the override's tensor among the inputs only
    "grad, override as input": lambda s, x: torch.autograd.grad(x * 2, s, torch.ones(4)),
    "backward, override as input": lambda s, x: torch.autograd.backward(
        (x * 2).sum(), torch.ones(2), inputs=[s]),
}


_ANSWERED = ("torch handed this call to _TakesOver.__torch_function__, which answered it "
             "without an error, but torch_vjp's check rejects its ")


@pytest.mark.parametrize("call", list(_TAKEN_OVER))
def test_a_call_an_override_answers_is_said_to_be_the_overrides(call):
    def run():
        s = torch.randn(3).as_subclass(_TakesOver)
        x = torch.randn(3, requires_grad=True)
        return _TAKEN_OVER[call](s, x)

    plain, plain_warned = _our_warnings(run)
    with tv.checked():
        checked, warned = _our_warnings(run)
    assert plain == checked == "answered by the override"
    assert not plain_warned
    assert len(warned) == 1, [str(w.message) for w in warned]
    message = str(warned[0].message)
    label = "torch.autograd.backward" if call.startswith("backward") else "torch.autograd.grad"
    assert message.startswith(f"{label}: {_ANSWERED}"), message
    assert "torch accepted" not in message
    assert "; the result is the override's, unchanged.\n  Expected: each " in message, message
    assert "The override never handed the call on to torch, so torch never judged the " \
           "vectors" in message, message
    assert "\n  Fix: pass the vectors the check asks for" in message, message
    assert "\n  The check said:\n" in message


def test_a_torch_function_mode_that_answers_is_named():
    from torch.overrides import TorchFunctionMode

    class Answers(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.autograd.grad:
                return "answered by the mode"
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, requires_grad=True)
    y = x * 2
    with tv.checked(), Answers():
        out, warned = _our_warnings(lambda: torch.autograd.grad(y, x, torch.ones(4)))
    assert out == "answered by the mode"
    assert len(warned) == 1
    assert str(warned[0].message).startswith(
        "torch.autograd.grad: torch handed this call to the active TorchFunctionMode's "
        "__torch_function__, which answered it without an error"), str(warned[0].message)


def test_tensor_backward_hands_such_a_call_on_unchecked():
    # Tensor.backward hands a call on an overriding tensor to the override first, as torch
    # does: nothing to say
    class _TakesOverBackward(_TakesOver):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.backward:
                return "answered by the override"
            return super().__torch_function__(func, types, args, kwargs)

    t = torch.randn(3).as_subclass(_TakesOverBackward)
    with tv.checked():
        out, warned = _our_warnings(lambda: t.backward(torch.ones(4)))
    assert out == "answered by the override" and not warned


def test_wrong_shape_handed_to_torch_still_raises():
    # an override that hands the call on to torch: torch's verdict, the check's explanation
    x = torch.randn(3, requires_grad=True)
    y = (x * 2).as_subclass(_HandsOn)
    with tv.checked():
        with pytest.raises(RuntimeError, match=r"^Mismatch in shape: grad_output\[0\]") as info:
            torch.autograd.grad(y, x, torch.ones(4))
    assert isinstance(info.value, tv.GradOutputsError)
