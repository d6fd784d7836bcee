"""A Jacobian block for an input the output does not depend on is an ordinary, writable
tensor of zeros (as torch.autograd.functional.jacobian's are), not an expanded view."""
import pytest
import torch

import torch_vjp as tv


def _f(a, b):
    return a * 2.0


def _check(blocks, refs):
    for got, ref in zip(blocks, refs):
        torch.testing.assert_close(got, ref)
        got.add_(1.0)  # an expanded view raises here
        torch.testing.assert_close(got, ref + 1.0)


@pytest.mark.parametrize("strategy", ["auto", "rev", "rev-loop", "fwd", "fwd-loop"])
def test_jacobian_zero_block_is_writable(strategy):
    x = torch.randn(3, dtype=torch.float64)
    y = torch.randn(2, dtype=torch.float64)
    ref = torch.autograd.functional.jacobian(_f, (x, y))
    got = tv.jacobian(_f, x, y, argnums=(0, 1), strategy=strategy)
    _check(got, ref)


def test_jacobian_of_zero_block_is_writable():
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, dtype=torch.float64, requires_grad=True)
    got = tv.jacobian_of(x * 2.0, [x, y])
    ref = torch.autograd.functional.jacobian(_f, (x.detach(), y.detach()))
    _check(got, ref)


def test_hessian_zero_block_is_writable():
    def g(a, b):
        return (a ** 3).sum()

    x = torch.randn(3, dtype=torch.float64)
    y = torch.randn(2, dtype=torch.float64)
    got = tv.hessian(g, x, y, argnums=(0, 1))
    ref = torch.autograd.functional.hessian(g, (x, y))
    for row, ref_row in zip(got, ref):
        _check(row, ref_row)


def test_batch_jacobian_zero_columns_are_writable():
    xb = torch.randn(4, 3, dtype=torch.float64)
    got = tv.batch_jacobian(lambda a: a[:, :1] * 0.0 + 1.0, xb)
    ref = torch.zeros(4, 1, 3, dtype=torch.float64)
    _check([got], [ref])
