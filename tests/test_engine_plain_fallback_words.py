""""auto"'s warning that it could not vectorise names the route it took: where torch.func
cannot run f and the plain reverse loop meets torch.as_strided_scatter's wrong backward,
the Jacobian comes from plain forward mode, and the warning said 'rev-loop' (whose advice,
strategy='rev-loop', is refused there). float64, against central differences."""

import warnings

import torch

import torch_vjp as tv
from torch_vjp import JacobianWarning


class _Cube(torch.autograd.Function):  # (old style: torch.func refuses it)
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 3 * x * x * t


def _fd(f, x, h=1e-6):
    cols = [(f(x + h * e) - f(x - h * e)) / (2 * h) for e in torch.eye(x.numel(), dtype=x.dtype)]
    return torch.stack(cols, -1)


def _x():
    return torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def _fallback_warning(f, x):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        J = tv.jacobian(f, x)
    texts = [str(w.message) for w in caught if issubclass(w.category, JacobianWarning)
             and "could not vectorise" in str(w.message)]
    assert len(texts) == 1, [str(w.message) for w in caught]
    return J, texts[0]


def test_the_warning_names_plain_forward_mode_where_it_was_taken():
    def scatter_cubed(x):
        base = _Cube.apply(x).tanh()
        return torch.as_strided_scatter(base, x[:2] * 5, (2,), (1,), 1)

    x = _x()
    J, text = _fallback_warning(scatter_cubed, x)
    ref = _fd(scatter_cubed, x)
    torch.testing.assert_close(J, ref, atol=1e-7, rtol=1e-7)
    assert "so it used strategy='fwd-loop'" in text
    assert "one JVP per input element at a time" in text
    assert "backward formula torch computes wrongly" in text
    assert "Pass strategy='fwd-loop' to skip the vectorised attempt" in text
    assert "rev-loop" not in text
    # (the advice, followed)
    torch.testing.assert_close(tv.jacobian(scatter_cubed, x, strategy="fwd-loop"), ref,
                               atol=1e-7, rtol=1e-7)


def test_the_warning_names_the_reverse_loop_where_it_was_taken():
    def cubed_sin(x):
        return _Cube.apply(x).sin()[:3]

    x = _x()
    J, text = _fallback_warning(cubed_sin, x)
    torch.testing.assert_close(J, _fd(cubed_sin, x), atol=1e-7, rtol=1e-7)
    assert "so it used strategy='rev-loop': one VJP per output element at a time" in text
    assert "Pass strategy='rev-loop' to skip the vectorised attempt" in text
