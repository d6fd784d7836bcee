""""auto" where torch.func cannot run f (the plain-autograd loop) through
torch.as_strided_scatter's wrong backward (torch 2.13): plain forward mode instead, with a
one-time warning, or a refusal where forward mode cannot run f either (NOTE [a plain loop
through a wrong backward] in torch_vjp/_engine/wrongops.py). Checked against finite
differences."""

import warnings

import pytest
import torch

import torch_vjp as tv
from torch_vjp import JacobianCallError, JacobianWarning

from _references import OldStyleSquare


class _Square(torch.autograd.Function):  # (old style: torch.func refuses it)
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 2 * x * t


def _fd(f, x, h=1e-6):
    cols = [(f(x + h * e) - f(x - h * e)) / (2 * h) for e in torch.eye(x.numel(), dtype=x.dtype)]
    return torch.stack(cols, -1)


def _x():
    return torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def test_auto_takes_plain_forward_mode():
    def scatter_plain(x):
        base = _Square.apply(x).sin()
        return torch.as_strided_scatter(base, x[:2] * 3, (2,), (1,), 1)

    x = _x()
    ref = _fd(scatter_plain, x)
    for call in range(2):  # (the second from the route remembered)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            j = tv.jacobian(scatter_plain, x)
        torch.testing.assert_close(j, ref, atol=1e-7, rtol=1e-7)
        ours = [w for w in caught if issubclass(w.category, JacobianWarning)
                and "plain forward-mode AD" in str(w.message)]
        assert len(ours) == (1 if call == 0 else 0)
        assert not any("no other route agrees" in str(w.message) for w in caught)


def test_auto_warning_words():
    def scatter_words(x):
        base = _Square.apply(x).cos()
        return torch.as_strided_scatter(base, x[:2] * 2, (2,), (1,), 1)

    with pytest.warns(JacobianWarning) as caught:
        tv.jacobian(scatter_words, _x())
    text = next(str(w.message) for w in caught if "plain forward-mode" in str(w.message))
    assert "torch.func cannot run f (" in text and "scatter_words" in text
    assert "backward formula of torch.as_strided_scatter is wrong" in text
    assert "strategy='fwd-loop'" in text and "shown once per function" in text


def test_auto_refuses_where_forward_mode_cannot_run_f():
    def scatter_no_jvp(x):
        base = OldStyleSquare.apply(x).sin()
        return torch.as_strided_scatter(base, x[:2] * 3, (2,), (1,), 1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(JacobianCallError) as info:
            tv.jacobian(scatter_no_jvp, _x())
    msg = str(info.value)
    assert "torch.func cannot run f (" in msg and "scatter_no_jvp" in msg
    assert "backward formula of torch.as_strided_scatter is wrong" in msg
    assert "forward mode, whose formula is right, cannot run f either" in msg
    assert "Forward mode said: NotImplementedError" in msg
    assert "Fix: let forward mode run f" in msg and "jvp staticmethod" in msg


def test_scatter_into_a_constant_stays_reverse():
    def scatter_const(x):
        base = torch.zeros(5, dtype=x.dtype)
        return torch.as_strided_scatter(base, OldStyleSquare.apply(x[:2]), (2,), (1,), 1) + x

    x = _x()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        j = tv.jacobian(scatter_const, x)
    torch.testing.assert_close(j, _fd(scatter_const, x), atol=1e-7, rtol=1e-7)
    assert not any("plain forward-mode" in str(w.message) for w in caught)
