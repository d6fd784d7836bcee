"""The fix named when a custom Function's backward returns too few values: its example
return names a gradient (``grad_j``) for each missing input that needs one, ``None`` only
for those that need none (a None for an input that needs a gradient gives it zero, which
torch accepts without a word)."""

from __future__ import annotations

import re

import pytest
import torch

import torch_vjp as tv


class TooFew(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, k):
        return x * y * k

    @staticmethod
    def backward(ctx, g):
        return g * 2  # (y and k's values are missing)


def _fix_line(message):
    return next(line for line in message.splitlines() if line.strip().startswith("Fix:"))


@pytest.mark.parametrize("y_needs_grad, example, what", [
    (True, "return grad_0, grad_1, None.", "its gradient (or None where no gradient is needed)"),
    (False, "return grad_0, None, None.", "None"),
], ids=["missing-input-needs-grad", "missing-inputs-need-none"])
def test_checked_mode_names_a_gradient_for_a_missing_input_that_needs_one(
        y_needs_grad, example, what):
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=y_needs_grad)
    with tv.checked():
        with pytest.raises(tv.FunctionCheckError,
                           match=re.escape("returned an incorrect number of gradients")) as info:
            TooFew.apply(x, y, 2.0).sum().backward()
    fix = _fix_line(info.value.explanation)
    assert fix.endswith(f"as well: {what}, e.g. {example}"), fix
    assert x.grad is None and y.grad is None


def test_check_function_names_a_gradient_for_a_missing_input_that_needs_one():
    with pytest.raises(tv.FunctionCheckError) as info:
        tv.check_function(TooFew, torch.randn(3, dtype=torch.float64),
                          torch.randn(3, dtype=torch.float64), 2.0)
    assert _fix_line(str(info.value)).endswith("e.g. return grad_0, grad_1, None."), str(info.value)
