"""Valid custom Functions pass checked mode and check_function without a word."""

import pytest
import torch

import torch_vjp


class _BroadcastAdd(torch.autograd.Function):
    """x + b with b broadcast; backward returns grad_output for both (torch sums it to b)."""

    @staticmethod
    def forward(ctx, x, b):
        return x + b

    @staticmethod
    def backward(ctx, g):
        return g, g


class _BroadcastAddTwice(torch.autograd.Function):
    """A wrong gradient for the broadcast input: twice the right one."""

    @staticmethod
    def forward(ctx, x, b):
        return x + b

    @staticmethod
    def backward(ctx, g):
        return g, 2 * g


def test_check_function_accepts_broadcast_gradient_summed_by_torch():
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    report = torch_vjp.check_function(_BroadcastAdd, x, b)
    assert report.inputs[1].shape_ok
    # torch's own result agrees with an independent reference
    gx, gb = torch.autograd.grad(_BroadcastAdd.apply(x, b).sum(), (x, b))
    rx, rb = torch.autograd.grad((x + b).sum(), (x, b))
    torch.testing.assert_close(gb, rb)
    torch.testing.assert_close(gx, rx)


def test_check_function_still_rejects_wrong_broadcast_gradient():
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(torch_vjp.FunctionCheckError, match=r"shape \(2, 3\) at index 1(.|\n)*sums the gradient down to \(3,\)"):
        torch_vjp.check_function(_BroadcastAddTwice, x, b)


def test_check_function_rejects_unbroadcastable_shape():
    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, b):
            return x + b

        @staticmethod
        def backward(ctx, g):
            return g, g[:, :2]

    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(torch_vjp.FunctionCheckError, match=r"shape \(2, 2\) at index 1"):
        torch_vjp.check_function(Wrong, x, b)
