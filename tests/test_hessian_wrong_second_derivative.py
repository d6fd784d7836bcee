"""Hessians through a custom autograd.Function whose backward autograd cannot differentiate
right: "auto" neither returns reverse over reverse's zeros over a right forward-over-reverse
Hessian (NOTE [reverse over reverse, outvoted] in torch_vjp/_engine/symmetry.py), nor
returns an asymmetric Hessian without a word (NOTE [an asymmetric Hessian, said]).
Checked against torch.func.hessian of the same function written with plain operations."""

import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64


class _Once(torch.autograd.Function):
    """``a * b**2`` with a right first derivative, marked once_differentiable."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b):
        return a * b * b

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b * b, g * 2 * a * b

    @staticmethod
    def jvp(ctx, ta, tb):
        a, b = ctx.saved_tensors
        return ta * b * b + tb * 2 * a * b


class _Detached(_Once):
    """The same, whose backward for ``a`` detaches ``b``: its Hessian lacks d2/da db there."""

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b.detach() * b.detach(), g * 2 * a * b


class _DetachedNoJvp(_Detached):
    @staticmethod
    def jvp(ctx, ta, tb):
        raise NotImplementedError("no forward-mode formula")


def _true(x):
    return (x[:2] * x[2:] ** 2).sum()


def _x():
    return torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(3))


def test_auto_keeps_forward_over_reverse_where_reverse_over_reverse_gives_zeros():
    def f(x):
        return _Once.apply(x[:2], x[2:]).sum()

    x = _x()
    expected = torch.func.hessian(_true)(x)
    rev = tv.hessian(f, x, strategy="rev")
    assert rev.abs().max() == 0  # (torch: once_differentiable's second derivative)
    with pytest.warns(tv.JacobianWarning, match=(
            r"^torch_vjp\.hessian: forward-over-reverse \(strategy='auto'\) and "
            r"reverse-over-reverse give different Hessians of \S*\.f \(by up to .*\), and a "
            r"difference quotient of f's gradient agrees with forward over reverse: "
            r"autograd cannot differentiate f's backward a second time in reverse mode, "
            r"(?s:.*)once_differentiable(?s:.*)returned the forward-over-reverse Hessian."
            r"\n  Pass strategy='fwd'")):
        H = tv.hessian(f, x)
    torch.testing.assert_close(H, expected)
    torch.testing.assert_close(tv.hessian(f, x, strategy="fwd"), expected)


def test_the_quotient_still_lets_reverse_over_reverse_win_where_forward_mode_is_wrong():
    # torch.scatter_reduce(..., reduce='prod')'s forward-mode formula is wrong (torch 2.13)
    idx = torch.tensor([0, 0, 1, 1, 1])

    def f(x):
        y = torch.zeros(2, dtype=x.dtype).scatter_reduce(0, idx, x, "prod",
                                                          include_self=False)
        return (y * y).sum()

    x = torch.rand(5, dtype=D, generator=torch.Generator().manual_seed(0)) + 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        H = tv.hessian(f, x)
    torch.testing.assert_close(H, tv.hessian(f, x, strategy="rev"))


def test_an_asymmetric_hessian_of_both_routes_is_said():
    def g(x):
        return _Detached.apply(x[:2], x[2:]).sum()

    x = _x()
    with pytest.warns(tv.JacobianWarning, match=(
            r"^torch_vjp\.hessian: the Hessian of \S*\.g is not symmetric \(entries that must be "
            r"equal differ by up to .*, at a scale of .*\), computed by forward over "
            r"reverse and reverse over reverse alike: either f is not twice differentiable "
            r"at this point, or autograd differentiates f's gradient wrongly(?s:.*)"
            r"returned the Hessian as computed.\n  Fix: (?s:.*)gradgradcheck")):
        H = tv.hessian(g, x)
    torch.testing.assert_close(H, tv.hessian(g, x, strategy="rev"))


def test_an_asymmetric_hessian_of_reverse_over_reverse_alone_is_said():
    def h(x):
        return _DetachedNoJvp.apply(x[:2], x[2:]).sum()

    x = _x()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tv.hessian(h, x)
    said = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    assert any(m.startswith("torch_vjp.hessian: the Hessian of ") and ".h is not symmetric" in m
               and "computed by reverse over reverse (forward mode could not run f)" in m
               for m in said), said


def test_a_symmetric_hessian_through_a_right_function_says_nothing():
    def k(x):
        return (x[:2] * x[2:] ** 2).sum() + x.relu().sum()

    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        H = tv.hessian(k, x)
    torch.testing.assert_close(H, torch.func.hessian(k)(x))
