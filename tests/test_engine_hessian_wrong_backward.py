"""A Hessian through torch.as_strided_scatter's wrong backward (torch 2.13) is refused under
every strategy (NOTE [a Hessian through a wrong backward] in torch_vjp/_engine/wrongops.py):
its gradient is reverse mode whatever the strategy. Checked against finite differences."""

import warnings

import pytest
import torch

import torch_vjp as tv
from torch_vjp import JacobianCallError, StrategyError

from _references import OldStyleSquare


def _scatter_into_computed(x):
    base = x.sin()
    y = torch.as_strided_scatter(base, x[:2] * x[:2], (2,), (1,), 1)
    return (y * y.cos()).sum()


def _scatter_into_constant(x):
    y = torch.as_strided_scatter(torch.zeros(5, dtype=x.dtype), x[:2] ** 3, (2,), (1,), 1)
    return (y * y).sum() + x.sin().sum()


def _fd_hessian(f, x, h=1e-4):
    n = x.numel()
    e = torch.eye(n, dtype=x.dtype) * h
    out = torch.zeros(n, n, dtype=x.dtype)
    for i in range(n):
        for j in range(n):
            out[i, j] = (f(x + e[i] + e[j]) - f(x + e[i] - e[j]) - f(x - e[i] + e[j])
                         + f(x - e[i] - e[j])) / (4 * h * h)
    return out


def _x():
    return torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("strategy", ["auto", "rev", "rev-loop", "fwd-loop"])
def test_hessian_through_wrong_backward_refused(strategy):
    x = _x()
    with pytest.raises(JacobianCallError) as info:
        tv.hessian(_scatter_into_computed, x, strategy=strategy)
    msg = str(info.value)
    assert "backward formula of torch.as_strided_scatter is wrong" in msg
    assert f"strategy={strategy!r} names the outer Jacobian only" in msg
    assert "wrong under every strategy" in msg
    assert "_scatter_into_computed" in msg
    assert "Fix: take the Jacobian of a forward-mode gradient" in msg


def test_the_fix_named_is_right():
    x = _x()
    f = _scatter_into_computed
    h = tv.jacobian(lambda y: tv.jacobian(f, y, strategy="fwd-loop"), x, strategy="fwd-loop")
    torch.testing.assert_close(h, _fd_hessian(f, x), atol=1e-5, rtol=1e-5)


def test_fwd_hessian_names_the_strategy_passed():
    # (into a constant: the loop 'fwd-loop' computes it rightly, so it is the fix named)
    with pytest.raises(StrategyError) as info:
        tv.hessian(_scatter_into_constant, _x(), strategy="fwd")
    msg = str(info.value)
    assert "strategy='fwd' computes the Hessian's products with torch.vmap" in msg
    assert "aten::as_strided_scatter" in msg
    assert "Fix: strategy='fwd-loop'" in msg
    assert "strategy='rev'" not in msg and "rev-loop" not in msg


def test_fwd_hessian_into_a_computed_tensor_is_refused_as_the_loop_is():
    # (the loop that 'fwd''s refusal named refuses it too: its refusal is the error)
    with pytest.raises(JacobianCallError) as info:
        tv.hessian(_scatter_into_computed, _x(), strategy="fwd")
    msg = str(info.value)
    assert "as_strided_scatter is wrong for the tensor scattered into" in msg
    assert "strategy='fwd' names the outer Jacobian only" in msg


@pytest.mark.parametrize("strategy", ["auto", "rev", "rev-loop", "fwd-loop"])
def test_scatter_into_a_constant_is_right(strategy):
    # (the gradient of the scattered source is right: nothing refused)
    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = tv.hessian(_scatter_into_constant, x, strategy=strategy)
    torch.testing.assert_close(h, _fd_hessian(_scatter_into_constant, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strategy", ["auto", "rev-loop", "fwd-loop"])
def test_plain_autograd_hessian_refused(strategy):
    # (the Hessian torch.func cannot run: plain autograd's gradient is reverse mode too)
    def scatter_plain(x):
        y = torch.as_strided_scatter(OldStyleSquare.apply(x).sin(), x[:2] * x[:2], (2,), (1,), 1)
        return (y * y.cos()).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(JacobianCallError) as info:
            tv.hessian(scatter_plain, _x(), strategy=strategy)
    msg = str(info.value)
    assert "backward formula of torch.as_strided_scatter is wrong" in msg
    assert "scatter_plain" in msg
    assert f"strategy={strategy!r} names the outer Jacobian only" in msg


def test_plain_autograd_hessian_into_a_constant_is_right():
    def scatter_const_plain(x):
        y = torch.as_strided_scatter(torch.zeros(5, dtype=x.dtype), OldStyleSquare.apply(x[:2]),
                                     (2,), (1,), 1)
        return (y * y).sum() + x.sin().sum()

    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = tv.hessian(scatter_const_plain, x)
    torch.testing.assert_close(h, _fd_hessian(scatter_const_plain, x), atol=1e-5, rtol=1e-5)
