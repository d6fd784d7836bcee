"""Tests of ``check_function``: custom autograd.Function checking (SPEC §2).

Correct Functions pass with small dot-product errors; each way a backward can be wrong is
caught with a message that names it; what torch itself lets through silently (a ``(2, 4, 3)``
gradient for a ``(4, 3)`` input, a float64 gradient for a float32 input) is shown next to
the check that catches it. Errors from the user's own forward/backward pass through.
"""

from __future__ import annotations

import re
import warnings
from fractions import Fraction

import pytest
import torch

from torch_vjp._errors import FunctionCheckError, TorchVJPError
from torch_vjp.function_check import (
    FunctionCheckReport,
    FunctionCheckTypeError,
    FunctionCheckValueError,
    check_function,
)

# ---------------------------------------------------------------------------------------
# Correct Functions


class Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        (y,) = ctx.saved_tensors
        return grad_output * y


class ScaleAddSquare(torch.autograd.Function):
    """alpha * x + y**2, with a non-tensor argument in the middle."""

    @staticmethod
    def forward(ctx, x, alpha, y):
        ctx.alpha = alpha
        ctx.save_for_backward(y)
        return alpha * x + y**2

    @staticmethod
    def backward(ctx, grad_output):
        (y,) = ctx.saved_tensors
        return ctx.alpha * grad_output, None, 2 * y * grad_output


class MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, grad_output):
        a, b = ctx.saved_tensors
        return grad_output @ b.mT, a.mT @ grad_output


class MulNoGradForWeight(torch.autograd.Function):
    """x * w; returns None for w when w needs no grad."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad_output):
        x, w = ctx.saved_tensors
        grad_x = grad_output * w if ctx.needs_input_grad[0] else None
        grad_w = grad_output * x if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


class SinCos(torch.autograd.Function):
    """Two outputs: backward takes two grad_outputs and still returns one gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin(), x.cos()

    @staticmethod
    def backward(ctx, grad_sin, grad_cos):
        (x,) = ctx.saved_tensors
        return grad_sin * x.cos() - grad_cos * x.sin()


class RowSoftmax(torch.autograd.Function):
    """A batch (b, n) -> (b, n): the gradient is (b, n), no per-example Jacobians."""

    @staticmethod
    def forward(ctx, x):
        p = x.softmax(dim=-1)
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, grad_output):
        (p,) = ctx.saved_tensors
        return p * (grad_output - (grad_output * p).sum(-1, keepdim=True))


class PowerSetupContext(torch.autograd.Function):
    """New-style Function (forward without ctx, setup_context) with a default argument."""

    @staticmethod
    def forward(x, n=3):
        return x**n

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, n = inputs
        ctx.save_for_backward(x)
        ctx.n = n

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return ctx.n * x ** (ctx.n - 1) * grad_output, None


class ComplexSquare(torch.autograd.Function):
    """z**2 on complex tensors; torch's convention: grad = grad_output * conj(dz**2/dz)."""

    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)
        return z * z

    @staticmethod
    def backward(ctx, grad_output):
        (z,) = ctx.saved_tensors
        return grad_output * (2 * z).conj()


class DoubleInPlace(torch.autograd.Function):
    """Modifies its input in place (mark_dirty): the caller's tensor must stay untouched."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad_output):
        return 2 * grad_output


def _x(*shape, dtype=torch.float64, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(requires_grad)


PASS_CASES = [
    pytest.param(Exp, lambda: (_x(4, 3),), id="exp"),
    pytest.param(Exp, lambda: (_x(4, 3, dtype=torch.float32),), id="exp-float32"),
    pytest.param(Exp, lambda: (_x(()),), id="exp-0d"),
    pytest.param(ScaleAddSquare, lambda: (_x(5), 2.5, _x(5, seed=1)), id="non-tensor-arg"),
    pytest.param(MatMul, lambda: (_x(3, 4), _x(4, 2, seed=1)), id="matmul"),
    pytest.param(MatMul, lambda: (_x(2, 3, 4), _x(2, 4, 5, seed=1)), id="batched-matmul"),
    pytest.param(
        MulNoGradForWeight,
        lambda: (_x(4, requires_grad=True), _x(4, seed=1)),
        id="none-for-non-grad-input",
    ),
    pytest.param(SinCos, lambda: (_x(6),), id="two-outputs"),
    pytest.param(RowSoftmax, lambda: (_x(5, 3),), id="batch-rowwise"),
    pytest.param(PowerSetupContext, lambda: (_x(4),), id="setup-context-default-arg"),
    pytest.param(ComplexSquare, lambda: (_x(4, dtype=torch.complex128),), id="complex"),
    pytest.param(DoubleInPlace, lambda: (_x(3),), id="in-place-mark-dirty"),
    pytest.param(lambda x: Exp.apply(2 * x).sum(0), lambda: (_x(4, 3),), id="callable"),
    pytest.param(
        lambda a, b: MatMul.apply(Exp.apply(a), b),
        lambda: (_x(3, 4), _x(4, 2, seed=1)),
        id="callable-two-functions",
    ),
]


@pytest.mark.parametrize("fn, make_inputs", PASS_CASES)
def test_correct_functions_pass(fn, make_inputs):
    inputs = make_inputs()
    report = check_function(fn, *inputs)
    assert isinstance(report, FunctionCheckReport)
    assert len(report.inputs) == len(inputs)
    for row, arg in zip(report.inputs, inputs):
        if row.requires_grad:
            assert row.shape_ok and row.dtype_ok and row.device_ok
            assert row.grad_shape == tuple(arg.shape)
            assert row.max_rel_error is not None and row.max_rel_error < 1e-6
        else:
            assert row.max_error is None
    assert report.value_dtype in (torch.float64, torch.complex128)
    assert report.max_error < 1e-6
    assert "passed" in str(report)


def test_report_rows_and_table():
    x, w = _x(4, requires_grad=True), _x(4, seed=1)
    report = check_function(MulNoGradForWeight, x, w)
    assert report.functions == ("MulNoGradForWeight.backward",)
    grad_row, weight_row = report.inputs
    assert (grad_row.requires_grad, weight_row.requires_grad) == (True, False)
    assert weight_row.grad_shape is None and weight_row.shape_ok is None
    text = str(report)
    assert "torch_vjp.check_function(MulNoGradForWeight): passed" in text
    assert "Tensor(4,) float64" in text and "float64, eps=1e-06" in text

    report = check_function(ScaleAddSquare, _x(5), 2.5, _x(5, seed=1))
    assert report.inputs[1].description == "float" and not report.inputs[1].requires_grad
    assert [r.requires_grad for r in report.inputs] == [True, False, True]


def test_callable_report_names_the_functions():
    report = check_function(lambda x: Exp.apply(Exp.apply(x)), _x(3))
    assert report.functions == ("Exp.backward x 2",)


def test_result_is_reproducible_and_global_rng_untouched():
    x = _x(4, 3)
    state = torch.random.get_rng_state()
    first = check_function(Exp, x)
    second = check_function(Exp, x)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert [r.max_error for r in first.inputs] == [r.max_error for r in second.inputs]


def test_nothing_of_the_callers_is_modified():
    x = _x(3, 4, requires_grad=True)
    b = _x(4, 2, seed=1, requires_grad=True)
    x_before, b_before = x.detach().clone(), b.detach().clone()
    check_function(MatMul, x, b)
    assert x.grad is None and b.grad is None
    assert x.requires_grad and b.requires_grad and x.is_leaf and b.is_leaf
    assert torch.equal(x, x_before) and torch.equal(b, b_before)

    y = _x(3)
    y_before = y.clone()
    check_function(DoubleInPlace, y)  # forward doubles its argument in place
    assert torch.equal(y, y_before) and not y.requires_grad


def test_float32_inputs_are_value_checked_in_float64():
    # With float32 finite differences a 1e-3 error would hide in the noise; in float64 the
    # default tolerance (rtol 1e-5) catches it.
    class SlightlyOff(Exp):
        @staticmethod
        def backward(ctx, grad_output):
            (y,) = ctx.saved_tensors
            return grad_output * y * 1.001

    x = _x(4, 3, dtype=torch.float32)
    assert check_function(Exp, x).value_dtype == torch.float64
    with pytest.raises(FunctionCheckError, match=r"does not match finite differences"):
        check_function(SlightlyOff, x)
    assert x.dtype == torch.float32


def test_falls_back_to_the_inputs_dtype_when_fn_cannot_run_in_float64():
    weight = _x(4, 2, dtype=torch.float32, seed=3)  # captured float32 tensor

    def uses_float32_weight(x):
        return MatMul.apply(x, weight)  # float64 x @ float32 weight raises in torch

    report = check_function(uses_float32_weight, _x(3, 4, dtype=torch.float32))
    assert report.value_dtype == torch.float32
    assert report.eps > 1e-3
    assert any("not float64" in note for note in report.notes)
    assert "note: values checked in float32" in str(report)


def _float32_inside(backward_scale):
    class SinInFloat32(torch.autograd.Function):
        """float64 in and out, float32 inside."""

        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.float().sin().to(x.dtype)

        @staticmethod
        def backward(ctx, grad_output):
            (x,) = ctx.saved_tensors
            return grad_output * x.cos() * backward_scale

    return SinInFloat32


def test_a_forward_that_computes_in_float32_inside_is_checked_at_float32_precision():
    # Its float64 outputs carry float32's rounding: central differences with eps=1e-6 are
    # off by about 6e-8 / 1e-6, and a right backward was reported as wrong.
    x = _x(4, 3, dtype=torch.float64)
    report = check_function(_float32_inside(1.0), x)
    assert report.value_dtype == torch.float32
    assert report.eps > 1e-3
    assert any("lie on float32's grid" in note for note in report.notes)
    assert "note: values checked at float32's precision" in str(report)
    # a wrong backward is still caught
    with pytest.raises(FunctionCheckError, match=r"does not match finite differences"):
        check_function(_float32_inside(1.1), x)
    with pytest.raises(FunctionCheckError, match=r"does not match finite differences"):
        check_function(_float32_inside(-1.0), x)


def _scaling(name, factor, backward_scale):
    return _function(name, lambda ctx, g: g * factor * backward_scale,
                     forward=lambda ctx, x: x * factor)


def test_a_forward_that_moves_or_scales_grid_values_keeps_float64_precision():
    # float32 inputs (widened) and round float64 inputs lie on narrower grids themselves:
    # a forward that scales them returned values on those grids, and was taken for one that
    # computes in float32 (or bfloat16) inside, with its tolerances: a backward 0.5% (5%)
    # wrong passed
    with pytest.raises(FunctionCheckError, match=r"does not match finite differences"):
        check_function(_scaling("Twice", 2.0, 1.005), _x(50, dtype=torch.float32))
    with pytest.raises(FunctionCheckError, match=r"does not match finite differences"):
        check_function(_scaling("Half", 0.5, 1.05),
                       torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64))
    # and a right backward at a kink's doorstep is checked with float64's small step
    relu = _function("Relu", lambda ctx, g: g * (ctx.saved_tensors[0] > 0),
                     forward=lambda ctx, x: (ctx.save_for_backward(x), x.clamp_min(0))[1])
    report = check_function(relu, torch.tensor([0.001, 0.002]))
    assert report.value_dtype == torch.float64 and report.eps == 1e-6


def test_a_float64_forward_with_integer_outputs_keeps_float64_precision():
    # (integer values lie on every grid: they do not say the forward rounds to float32)
    x = _x(4, 3, dtype=torch.float64)
    report = check_function(lambda t: torch.cat([(10 * t).floor(), Exp.apply(t)]), x)
    assert report.value_dtype == torch.float64 and report.eps == 1e-6


# ---------------------------------------------------------------------------------------
# Broken Functions: one per mistake


def _function(name, backward, forward=None):
    """A Function class named ``name`` with the given backward (and forward: exp)."""

    def default_forward(ctx, *args):
        ctx.save_for_backward(*[a for a in args if isinstance(a, torch.Tensor)])
        ctx.args = args
        return args[0].exp()

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward or default_forward),
        "backward": staticmethod(backward),
    })


def _exp_grad(ctx, g):
    return g * ctx.saved_tensors[0].exp()


def _linear_forward(ctx, x):  # (b, n) -> (b, k) with a fixed (k, n) = (2, 3) matrix
    ctx.save_for_backward(x)
    return x @ _W.to(x.dtype).mT


_W = torch.arange(6.0).reshape(2, 3)

FAIL_CASES = [
    pytest.param(
        _function("MyFunc", lambda ctx, g: (_exp_grad(ctx, g), None)), (_x(4, 3),),
        r"MyFunc\.backward returned 2 values, but MyFunc\.forward takes 1 input (.|\n)*"
        r"one gradient per forward input(.|\n)*torch drops trailing None values",
        id="count-extra",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: _exp_grad(ctx, g)), (_x(4, 3), 2.0),
        r"returned 1 value, but MyFunc\.forward takes 2 inputs(.|\n)*"
        r"incorrect number of gradients \(expected 2, got 1\)(.|\n)*"
        r"Fix: .*input 1 \(a float: None\)",
        id="count-missing-none-for-float",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: _exp_grad(ctx, g).expand(2, 4, 3)), (_x(4, 3),),
        r"returned a gradient of shape \(2, 4, 3\) at index 0, but forward input 0 has shape "
        r"\(4, 3\)(.|\n)*torch does not catch this: it sums the gradient down(.|\n)*"
        r"extra leading dimension of size 2(.|\n)*grad\.sum\(0\)",
        id="extra-batch-dim-summed-by-torch",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: torch.diag_embed(ctx.saved_tensors[0].exp())),
        (_x(4),),
        r"shape \(4, 4\) at index 0(.|\n)*never the Jacobian itself(.|\n)*"
        r"the shape of the Jacobian d\(the output\)/d\(input 0\)(.|\n)*"
        r"torch\.tensordot\(grad_output, J, dims=1\)",
        id="jacobian-instead-of-vjp",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: torch.ones(3, 2), forward=_linear_forward), (_x(3),),
        r"shape \(3, 2\)(.|\n)*followed by the output's shape \(2,\): the transposed "
        r"Jacobian(.|\n)*torch\.tensordot\(J, grad_output, dims=1\)",
        id="jacobian-transposed-layout",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: torch.ones(4, 3, 2), forward=_linear_forward),
        (_x(4, 3),),
        r"shape \(4, 3, 2\)(.|\n)*one Jacobian per example(.|\n)*"
        r"torch\.tensordot\(j, g, dims=g\.dim\(\)\)",
        id="per-example-jacobians-transposed",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: torch.ones(5, 2, 3), forward=_linear_forward),
        (_x(5, 3),),
        r"Function MyFuncBackward returned an invalid gradient at index 0 - got \[5, 2, 3\] "
        r"but expected shape compatible with \[5, 3\](.|\n)*one Jacobian per example(.|\n)*"
        r"a batch input of shape \(5, 3\) gets a gradient of shape \(5, 3\)",
        id="per-example-jacobians",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: g, forward=lambda ctx, x: x.sum(1)), (_x(4, 3),),
        r"shape \(4,\) at index 0(.|\n)*got \[4\] but expected shape compatible with \[4, 3\]"
        r"(.|\n)*\(4,\) is the shape of the output \(and of grad_output\)",
        id="grad-output-returned-as-is",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: _exp_grad(ctx, g).mT), (_x(4, 3),),
        r"got \[3, 4\] but expected shape compatible with \[4, 3\](.|\n)*"
        r"shape reversed: return grad\.mT",
        id="transposed",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: _exp_grad(ctx, g).reshape(-1)), (_x(4, 3),),
        r"right number of elements \(12\) in the wrong shape(.|\n)*reshape\(input\.shape\)",
        id="flattened",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: _exp_grad(ctx, g).expand(4, 3)), (_x(1, 3),),
        r"shape \(4, 3\) at index 0, but forward input 0 has shape \(1, 3\)(.|\n)*"
        r"torch does not catch this(.|\n)*grad\.sum\(dim=0, keepdim=True\)",
        id="broadcast-dim-not-summed",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: _exp_grad(ctx, g).double()),
        (_x(4, 3, dtype=torch.float32),),
        r"dtype torch\.float64 at index 0, but forward input 0 has dtype torch\.float32(.|\n)*"
        r"casts the gradient to torch\.float32 without a word",
        id="float64-for-float32",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: _exp_grad(ctx, g).to(torch.complex64)),
        (_x(4, 3, dtype=torch.float32),),
        r"dtype torch\.complex64 at index 0(.|\n)*torch reports this as: Expected "
        r"isFloatingType",
        id="complex-for-real",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: (_exp_grad(ctx, g), None)),
        (_x(4), _x(4, seed=1)),
        r"returned None at index 1, but forward input 1 \(shape \(4,\)\) requires grad"
        r"(.|\n)*silently gets no gradient",
        id="none-for-input-needing-grad",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: (_exp_grad(ctx, g), torch.ones(()))), (_x(4), 2.0),
        r"returned a tensor at index 1, but forward input 1 is not a tensor \(float\)(.|\n)*"
        r"gradient different than None at position 2",
        id="tensor-for-non-tensor-input",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: 1.0), (_x(4),),
        r"returned a float at index 0(.|\n)*expected Variable or None \(got float\)",
        id="python-number",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: [_exp_grad(ctx, g), None]), (_x(4), 2.0),
        r"returned a list of 2 values(.|\n)*torch reports this as: function MyFuncBackward "
        r"returned an incorrect number of gradients \(expected 2, got 1\)\.(.|\n)*Fix: "
        r"return a tuple",
        id="list-instead-of-tuple",
    ),
    pytest.param(  # (one input: torch rejects the list's type, not the count)
        _function("MyFunc", lambda ctx, g: [_exp_grad(ctx, g)]), (_x(4),),
        r"returned a list of 1 value(.|\n)*torch reports this as: expected Variable or None "
        r"\(got list\)\.(.|\n)*Fix: return a tuple",
        id="list-instead-of-tuple-one-input",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: _exp_grad(ctx, g) * 0.5), (_x(4, 3),),
        r"the gradient that MyFunc\.backward returns for input 0 does not match finite "
        r"differences(.|\n)*<t, backward\(c\)> = 0\.5 \* <J t, c>(.|\n)*constant factor",
        id="values-missing-factor-2",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: -_exp_grad(ctx, g)), (_x(4, 3),),
        r"does not match finite differences(.|\n)*sign flipped",
        id="values-sign",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: torch.zeros_like(g)), (_x(4, 3),),
        r"does not match finite differences(.|\n)*backward returns zero for this input",
        id="values-zero",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: _exp_grad(ctx, g).flip(0)), (_x(4, 3),),
        r"does not match finite differences(.|\n)*Fix: re-derive MyFunc\.backward for input 0",
        id="values-permuted",
    ),
    pytest.param(
        _function("MyFunc", lambda ctx, g: _exp_grad(ctx, g).to("meta")), (_x(4, 3),),
        r"gradient on device meta at index 0, but forward input 0 is on cpu(.|\n)*"
        r"expected device cpu but got meta",
        id="wrong-device",
    ),
]


@pytest.mark.parametrize("fn, inputs, match", FAIL_CASES)
def test_broken_functions_raise(fn, inputs, match):
    with pytest.raises(FunctionCheckError, match=match) as info:
        check_function(fn, *inputs)
    message = str(info.value)
    assert message.startswith(f"torch_vjp.check_function({fn.__name__}): ")
    assert isinstance(info.value, TorchVJPError) and isinstance(info.value, RuntimeError)


def test_torch_lets_extra_batch_dim_and_float64_through():
    """What torch itself does with the two silent mistakes check_function catches."""
    summed = _function("Summed", lambda ctx, g: _exp_grad(ctx, g).expand(2, 4, 3))
    x = _x(4, 3, requires_grad=True)
    (grad,) = torch.autograd.grad(summed.apply(x).sum(), x)
    assert grad.shape == (4, 3)  # no error: torch summed (2, 4, 3) down to (4, 3)
    torch.testing.assert_close(grad, 2 * x.detach().exp())  # twice the true gradient

    cast = _function("Cast", lambda ctx, g: _exp_grad(ctx, g).double())
    x32 = _x(4, 3, dtype=torch.float32, requires_grad=True)
    (grad,) = torch.autograd.grad(cast.apply(x32).sum(), x32)
    assert grad.dtype == torch.float32  # no error: torch cast the float64 gradient

    for fn, arg in ((summed, x), (cast, x32)):
        with pytest.raises(FunctionCheckError):
            check_function(fn, arg)


def test_torch_rejects_jacobian_shape_with_the_seed_message():
    """The message of seed 002, which check_function quotes and explains."""
    jac = _function("MyFunc", lambda ctx, g: torch.ones(5, 2, 3), forward=_linear_forward)
    x = _x(5, 3, requires_grad=True)
    with pytest.raises(RuntimeError) as torch_error:
        torch.autograd.grad(jac.apply(x).sum(), x)
    with pytest.raises(FunctionCheckError) as ours:
        check_function(jac, x)
    assert str(torch_error.value) in str(ours.value)
    assert ours.value.__cause__ is not None  # torch's error is chained, not lost


def test_broken_function_inside_a_callable_is_caught():
    summed = _function("Summed", lambda ctx, g: _exp_grad(ctx, g).expand(2, 4, 3))
    with pytest.raises(FunctionCheckError, match=r"check_function\(wrapper\): Summed\.backward "
                       r"returned a gradient of shape \(2, 4, 3\)"):
        def wrapper(x, scale):
            return summed.apply(x * scale).sum(1)

        check_function(wrapper, _x(4, 3), 3.0)

    half = _function("Half", lambda ctx, g: _exp_grad(ctx, g) * 0.5)
    with pytest.raises(FunctionCheckError, match=r"the gradient autograd computes through fn "
                       r"for input 0 does not match"):
        check_function(lambda x: half.apply(x) + x, _x(4))


def test_none_for_a_needed_input_of_a_function_inside_a_callable():
    drops = _function("Drops", lambda ctx, g: (g, None), forward=lambda ctx, x, y: x + y)
    with pytest.raises(FunctionCheckError, match=r"Drops\.backward returned None at index 1, "
                       r"but forward input 1 \(shape \(3,\)\) requires grad"):
        check_function(lambda x, y: drops.apply(x, y * 2), _x(3), _x(3, seed=1))


# ---------------------------------------------------------------------------------------
# The user's own errors pass through untouched


class UserError(Exception):
    pass


def test_error_in_forward_passes_through():
    def forward(ctx, x):
        raise UserError("forward is broken")

    broken = _function("BrokenForward", _exp_grad, forward=forward)
    with pytest.raises(UserError, match="^forward is broken$") as info:
        check_function(broken, _x(3))
    assert not isinstance(info.value, TorchVJPError)


def test_error_in_backward_passes_through():
    def backward(ctx, g):
        raise UserError("backward is broken")

    broken = _function("BrokenBackward", backward)
    with pytest.raises(UserError, match="^backward is broken$") as info:
        check_function(broken, _x(3))
    assert not isinstance(info.value, TorchVJPError)
    with pytest.raises(UserError):  # also when the Function is used inside a callable
        check_function(lambda x: broken.apply(x * 2), _x(3))


# ---------------------------------------------------------------------------------------
# Misuse of check_function itself


def test_no_custom_function_in_callable():
    with pytest.raises(FunctionCheckError, match=r"check_function\(<lambda>\): found no custom "
                       r"torch\.autograd\.Function between fn's inputs and its outputs"):
        check_function(lambda x: x.exp(), _x(3))


def test_outputs_do_not_require_grad():
    detached = _function("Detached", _exp_grad)
    with pytest.raises(FunctionCheckError, match=r"no output of fn requires grad, although "
                       r"input 0 does"):
        check_function(lambda x: detached.apply(x).detach(), _x(3))


@pytest.mark.parametrize(
    "fn, inputs, kwargs, error, match",
    [
        pytest.param(42, (_x(3),), {}, FunctionCheckTypeError,
                     r"fn must be a torch\.autograd\.Function subclass or a callable",
                     id="not-callable"),
        pytest.param(Exp, (torch.arange(3), 2.0), {}, FunctionCheckValueError,
                     r"none of the 2 inputs is a floating-point or complex tensor",
                     id="no-float-input"),
        pytest.param(Exp, (_x(3),), {"eps": 0.0}, FunctionCheckValueError,
                     r"eps must be a finite number > 0, but got 0\.0", id="eps-zero"),
        pytest.param(Exp, (_x(3),), {"rtol": -1.0}, FunctionCheckValueError,
                     r"rtol must be a finite number >= 0", id="rtol-negative"),
        pytest.param(Exp, (_x(3),), {"atol": "big"}, FunctionCheckTypeError,
                     r"atol must be a number, but got str", id="atol-str"),
        # a string float() parses, and a bool (rtol=True was a tolerance of 1, under which
        # nothing failed; eps=True a step of 1)
        pytest.param(Exp, (_x(3),), {"eps": "1e-6"}, FunctionCheckTypeError,
                     r"eps must be a number, but got str \('1e-6'\)\. Fix: pass a float, "
                     r"e\.g\. eps=1e-06", id="eps-numeric-str"),
        pytest.param(Exp, (_x(3),), {"rtol": True}, FunctionCheckTypeError,
                     r"rtol must be a number, but got bool \(True\)\. Fix: pass a float, "
                     r"e\.g\. rtol=1e-05", id="rtol-bool"),
        pytest.param(Exp, (_x(3),), {"atol": False}, FunctionCheckTypeError,
                     r"atol must be a number, but got bool", id="atol-bool"),
        pytest.param(Exp, (_x(3),), {"eps": torch.tensor(True)}, FunctionCheckTypeError,
                     r"eps must be a number, but got Tensor", id="eps-bool-tensor"),
    ],
)
def test_argument_errors(fn, inputs, kwargs, error, match):
    with pytest.raises(error, match=match):
        check_function(fn, *inputs, **kwargs)


@pytest.mark.parametrize("value", [Fraction(1, 10000), torch.tensor(1e-4), 1], ids=str)
def test_real_numbers_of_every_kind_are_tolerances(value):
    report = check_function(Exp, _x(3), rtol=value)
    assert report.rtol == float(value)


def test_function_instance_instead_of_class():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch deprecates instances
        try:
            instance = Exp()
        except Exception as exc:  # a later torch may refuse to create one at all
            pytest.skip(f"this torch cannot instantiate a Function: {exc}")
    with pytest.raises(FunctionCheckTypeError, match=r"got an instance of Exp; pass the class "
                       r"itself: torch_vjp\.check_function\(Exp, \.\.\.\)"):
        check_function(instance, _x(3))


def test_tolerances_are_used():
    off = _function("Off", lambda ctx, g: _exp_grad(ctx, g) * 1.01)
    with pytest.raises(FunctionCheckError, match=r"does not match"):
        check_function(off, _x(4, 3))
    report = check_function(off, _x(4, 3), rtol=0.05)
    assert report.rtol == 0.05 and report.inputs[0].max_rel_error > 1e-3


# ---------------------------------------------------------------------------------------
# Non-finite values: refused before the dot-product test, not blamed on backward


class Log(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.log()

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output / x


def _with(x, index, value):
    x = x.clone()
    x[index] = value
    return x


_NON_FINITE = (r"so the values of its gradient cannot be checked\.\n  The values are checked "
               r"against central differences of forward, and at a NaN or inf those differences "
               r"are NaN whatever backward returns: the test would fail a correct backward\. "
               r"\(The count, shapes, dtypes and devices of what backward returns were "
               r"checked, and are right\.\)\n  Fix: check at finite inputs, e.g. ")


@pytest.mark.parametrize("x, message", [
    pytest.param(_with(_x(4, 3), (1, 2), float("nan")),
                 r"input 0 holds non-finite values \(1 of 12 elements is NaN or inf; the "
                 r"first, at index \(1, 2\), is nan\), " + _NON_FINITE
                 + r"torch\.randn\(4, 3, dtype=torch\.float64\)\.$", id="nan-float64"),
    pytest.param(_with(_with(_x(5, dtype=torch.float32), 3, float("inf")), 4, -float("inf")),
                 r"input 0 holds non-finite values \(2 of 5 elements are NaN or inf; the "
                 r"first, at index \(3,\), is inf\), " + _NON_FINITE + r"torch\.randn\(5\)\.$",
                 id="inf-float32"),
    pytest.param(torch.tensor(float("nan"), dtype=torch.float64),
                 r"input 0 holds non-finite values \(its one element is nan\), " + _NON_FINITE
                 + r"torch\.randn\(dtype=torch\.float64\)\.$", id="nan-0d"),
])
def test_non_finite_input_is_refused_not_blamed_on_backward(x, message):
    with pytest.raises(FunctionCheckValueError,
                       match=r"^torch_vjp\.check_function\(Exp\): " + message) as info:
        check_function(Exp, x)
    assert isinstance(info.value, ValueError) and isinstance(info.value, FunctionCheckError)
    # The same backward passes at finite inputs.
    check_function(Exp, x.nan_to_num(0.0, 1.0, -1.0))


def test_non_finite_input_of_a_callable_names_the_input():
    fn = lambda a, b: Exp.apply(a) * b  # noqa: E731
    with pytest.raises(FunctionCheckValueError, match=r"check_function\(<lambda>\): input 1 "
                       r"holds non-finite values \(1 of 3 elements is NaN or inf"):
        check_function(fn, _x(3), _with(_x(3, seed=1), 0, float("nan")))


def test_wrong_shape_is_still_reported_before_non_finite_values():
    bad = _function("Summed", lambda ctx, g: (g * ctx.saved_tensors[0].exp()).sum(0))
    with pytest.raises(FunctionCheckError, match=r"Summed\.backward") as info:
        check_function(bad, _with(_x(4, 3), (0, 0), float("nan")))
    assert not isinstance(info.value, FunctionCheckValueError)
    assert "non-finite" not in str(info.value)


def test_non_finite_output_is_refused_not_blamed_on_backward():
    x = _x(5)  # some entries negative: log gives NaN there
    assert (x < 0).any()
    with pytest.raises(FunctionCheckValueError, match=(
            r"^torch_vjp\.check_function\(Log\): the output of fn holds non-finite values at "
            r"these inputs \(in float64: \d of 5 elements (is|are) NaN or inf; the first, at "
            r"index \(\d,\), is nan\), so the values of the gradients cannot be checked\.\n"
            r"(.|\n)*the test would fail a correct backward\.(.|\n)*\n  Fix: check at inputs "
            r"where forward's outputs are finite")):
        check_function(Log, x)
    check_function(Log, x.abs() + 0.1)  # the same backward passes where log is finite


def test_non_finite_output_names_a_non_finite_input_that_is_not_differentiated():
    fn = lambda a, b: Exp.apply(a) * b  # noqa: E731
    with pytest.raises(FunctionCheckValueError, match=r"the output of fn holds non-finite "
                       r"values(.|\n)* Input 1, not differentiated, holds NaN or inf too\."):
        check_function(fn, _x(3, requires_grad=True), _with(_x(3, seed=1), 2, float("nan")))


def test_infinite_mask_that_is_not_differentiated_is_accepted():
    # An attention-style mask of -inf: forward's outputs stay finite, so the values are
    # checked as usual.
    mask = torch.zeros(2, 4, dtype=torch.float64)
    mask[0, 1] = mask[1, 3] = -float("inf")
    report = check_function(lambda x, m: RowSoftmax.apply(x + m), _x(2, 4, requires_grad=True),
                            mask)
    assert report.inputs[0].max_error < 1e-6 and not report.inputs[1].requires_grad


class _OuterOutputShaped(torch.autograd.Function):
    """y = outer(x, x); backward returns grad_output * x, of the output's shape."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.outer(x, x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x


class _MulSumJacobianShaped(torch.autograd.Function):
    """(x * y).sum(-1) with x (3,), y (4, 3): the broadcast copy's gradient, (4, 3)."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return (x * y).sum(-1)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g[:, None] * y, g[:, None] * x


def test_a_gradient_of_the_outputs_shape_is_named_so_not_a_per_example_jacobian():
    # the hint read (3, 3) for a (3,) input as "one Jacobian per example" of a batch of 3
    with pytest.raises(FunctionCheckError) as info:
        check_function(_OuterOutputShaped, torch.randn(3, dtype=torch.float64))
    text = str(info.value)
    assert "(3, 3) is the shape of the output (and of grad_output)" in text
    assert "per example" not in text


def test_a_jacobian_shaped_gradient_hint_also_names_the_broadcast_reading():
    # (4, 3) is both out + in and a broadcast copy of x: the Jacobian fix alone was wrong here
    with pytest.raises(FunctionCheckError) as info:
        check_function(_MulSumJacobianShaped, torch.randn(3, dtype=torch.float64),
                          torch.randn(4, 3, dtype=torch.float64))
    text = str(info.value)
    assert "the shape of the Jacobian d(the output)/d(input 0)" in text
    assert "gradient of input 0 broadcast to (4, 3) in forward" in text
    assert "return grad.sum(0)" in text


class _ScaleWithDefault(torch.autograd.Function):
    """forward has an optional second input; backward returns a trailing None for it, which
    torch accepts whether or not the call passed it."""

    @staticmethod
    def forward(ctx, x, scale=None):
        ctx.scale = 2.0 if scale is None else scale
        return x * ctx.scale

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def test_a_trailing_none_for_a_defaulted_forward_input_passes():
    # it was rejected ("returned 2 values, but forward takes 1 input ... return exactly 1"),
    # and that fix would break apply(x, 3.0)
    x = _x(3)
    assert isinstance(check_function(_ScaleWithDefault, x), FunctionCheckReport)
    assert isinstance(check_function(_ScaleWithDefault, x, 3.0), FunctionCheckReport)
    torch.testing.assert_close(
        torch.autograd.grad(_ScaleWithDefault.apply(x.requires_grad_(), 3.0).sum(), x)[0],
        torch.full((3,), 3.0, dtype=torch.float64))


class _ScalesGradOutputInPlace(torch.autograd.Function):
    """2 x, whose backward scales its grad_output in place and returns it: right."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g.mul_(2)


def test_a_backward_that_scales_grad_output_in_place_passes():
    # the checker's own cotangents were scaled by it, and the right backward was reported as
    # 'backward's result is 0.5 times the right one'
    assert isinstance(check_function(_ScalesGradOutputInPlace, _x(3)), FunctionCheckReport)


class _FreesItsState(torch.autograd.Function):
    """Releases what forward kept as backward reads it: torch runs backward once per
    forward (without retain_graph), so this is valid."""

    @staticmethod
    def forward(ctx, x):
        ctx.cache = x.detach().exp()
        return x.exp()

    @staticmethod
    def backward(ctx, g):
        cache = ctx.cache
        del ctx.cache
        return g * cache


class _ReusesItsBuffer(torch.autograd.Function):
    """Writes its gradient into the buffer forward kept (saving an allocation): valid for
    torch's one backward per forward, wrong only for a second call on the same graph."""

    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.buf = y.detach().clone()
        return y

    @staticmethod
    def backward(ctx, g):
        return ctx.buf.mul_(g)


@pytest.mark.parametrize("fn", [_FreesItsState, _ReusesItsBuffer])
def test_a_backward_that_uses_up_its_state_passes(fn):
    # every probe ran backward on one graph (retain_graph=True): the second call raised
    # AttributeError from the user's backward, or saw the buffer the first had scaled and
    # was reported as not matching finite differences
    x = _x(4)
    leaf = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(fn.apply(leaf), leaf, torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(g, torch.func.jacrev(torch.exp)(x).sum(0))  # valid
    report = check_function(fn, x)
    assert report.inputs[0].max_error < 1e-8


def _lin_jacobian_backward(ctx, g):
    (W,) = ctx.saved_tensors
    return W, None  # the Jacobian of one example, not grad_output @ W


def _lin_forward(ctx, x, W):
    ctx.save_for_backward(W)
    return x @ W.T


def test_the_jacobian_of_a_batch_of_one_is_named_so():
    # it was read as a broadcast input 'Fix: return grad.sum(dim=0, keepdim=True)', right
    # only for a grad_output of ones
    Lin = _function("Lin", _lin_jacobian_backward, _lin_forward)
    with pytest.raises(FunctionCheckError, match=(
            r"\(2, 3\) is the Jacobian of the batch's one example: the shapes of one row of "
            r"the output, \(2,\), and of input 0, \(3,\)\..*Fix: contract the Jacobian with "
            r"grad_output: torch\.tensordot\(grad_output\[0\], J, dims=1\)\.unsqueeze\(0\)")):
        check_function(Lin, _x(1, 3, requires_grad=True), _x(2, 3, seed=1))


class _SquareOneWrong(torch.autograd.Function):
    """x ** 2 whose backward is wrong (0) for one element of many."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        r = 2 * x * g
        r[0, 7] = 0
        return r


class _Sin32Wrong(torch.autograd.Function):
    """sin computed in float32 inside, whose backward is 3% too large."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sin(x.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 1.03 * g * torch.cos(x)


class _SquareToFloat32(torch.autograd.Function):
    """x ** 2 returned in float32 (a correct backward)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.float() ** 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return (2 * x * g).to(x.dtype)


def test_the_dot_product_test_sees_one_wrong_element_and_a_few_percent():
    # the tolerance was rtol times |J t| |c| (or |t| |g|), sqrt(n) times the scale of the
    # inner products: a backward wrong in one element of 250000, or 3% too large at
    # float32's tolerance, passed (NOTE [the dot-product test])
    g = torch.Generator().manual_seed(0)
    with pytest.raises(FunctionCheckError, match="does not match finite differences"):
        check_function(_SquareOneWrong, torch.randn(500, 500, dtype=torch.float64, generator=g))
    with pytest.raises(FunctionCheckError, match="does not match finite differences"):
        check_function(_Sin32Wrong, torch.randn(50, dtype=torch.float64, generator=g))


def test_an_output_of_a_narrower_dtype_is_checked_at_its_precision():
    # finite differences of a float32 output were held to float64's tolerances: a correct
    # backward failed
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32):
        report = check_function(_SquareToFloat32, torch.randn(20, dtype=dtype, generator=g))
        assert report.value_dtype == torch.float32  # (a report: it passed)


class _DefinedBelowOne(torch.autograd.Function):
    """x ** 2, defined for x <= 1 only (raises above)."""

    @staticmethod
    def forward(ctx, x):
        if bool((x > 1).any()):
            raise ValueError("defined for x <= 1 only")
        ctx.save_for_backward(x)
        return x ** 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def test_the_grid_probe_off_the_point_does_not_fail_the_check():
    # the probe for a narrower inner dtype calls fn at inputs moved by about 1e-3: a fn
    # defined only up to 1 raised its own error from a point the caller never passed
    report = check_function(_DefinedBelowOne, torch.full((3,), 0.999, dtype=torch.float64))
    assert report.value_dtype == torch.float64


class _RandomMask(torch.autograd.Function):
    """x times a random mask of 0 and 2 drawn from the global generator (dropout at p=0.5),
    with a correct backward: the mask forward drew."""

    @staticmethod
    def forward(ctx, x):
        mask = (torch.rand(x.shape, dtype=x.dtype, device=x.device) > 0.5).to(x.dtype) * 2
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * mask


class _RandomMaskUnscaled(_RandomMask):
    """The same forward; backward forgets the mask's scale of 2."""

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * (mask > 0).to(g.dtype)


def test_a_forward_that_draws_random_numbers_sees_the_same_draws_on_every_call():
    # every call of forward drew a new mask, so the finite differences mixed masks and a
    # correct backward failed by orders of magnitude (<J t, c> = 167843 against 0.80); and
    # the draws moved the caller's global generator (NOTE [check_function's draws])
    x = _x(6, 5)
    torch.manual_seed(3)
    state = torch.random.get_rng_state()
    report = check_function(_RandomMask, x)
    assert report.max_error < 1e-6
    assert torch.equal(torch.random.get_rng_state(), state)
    # a callable whose forward draws inside, too
    report = check_function(lambda t: _RandomMask.apply(t.sin()), x)
    assert report.max_error < 1e-6
    assert torch.equal(torch.random.get_rng_state(), state)
    # a backward wrong for the mask it was given is still caught, and the state put back
    with pytest.raises(FunctionCheckError, match=r"backward's result is 0\.5 times the right"):
        check_function(_RandomMaskUnscaled, x)
    assert torch.equal(torch.random.get_rng_state(), state)


class _SquareOfNormalized(torch.autograd.Function):
    """y ** 2, with a correct backward (used on the output of a BatchNorm)."""

    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        return y * y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return 2 * y * g


def test_a_module_in_training_mode_keeps_its_running_statistics():
    # check_function calls fn about ten times: a BatchNorm in training mode inside it
    # updated its running statistics on every call (running_mean 0 -> 0.17,
    # num_batches_tracked 0 -> 7), SPEC §0's "nothing is mutated"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3).double(),
                                torch.nn.BatchNorm1d(3).double())
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def fn(x):
        return _SquareOfNormalized.apply(model(x))

    check_function(fn, _x(5, 3))
    check_function(lambda x, m: _SquareOfNormalized.apply(m(x)), _x(5, 3), model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.training


class _Relu(torch.autograd.Function):
    """relu with torch's own convention at 0 (gradient 0 there): correct."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x > 0).to(g.dtype)


class _SteepExpOff(torch.autograd.Function):
    """exp(20 x), smooth and steep; backward 1% too large."""

    @staticmethod
    def forward(ctx, x):
        y = torch.exp(20 * x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return 20.2 * y * g


def test_a_kink_at_the_inputs_is_refused_not_blamed_on_backward():
    # relu at 0 (inputs of whole numbers): the central difference averages the two
    # one-sided slopes (t/2), backward returns torch's 0, and a correct backward was
    # reported as not matching forward (NOTE [kinks])
    x = torch.tensor([-2.0, 0.0, 1.0, 3.0], dtype=torch.float64)
    with pytest.raises(FunctionCheckValueError, match=(
        r"(?s)check_function\(_Relu\): forward is not differentiable at these inputs: along a "
        r"random direction t of input 0, the output of fn at index \(1,\) changes at a rate "
        r"of .* on one side and .* on the other \(one-sided differences, eps=1e-06\), so no "
        r"gradient matches its finite differences there, right or wrong\.\n"
        r"  This is a kink: relu, abs or clamp exactly at their corner.*\(input 0 holds 1 zero "
        r"and 4 whole numbers, where kinks often lie\).*torch's own relu gives 0 at 0.*"
        r"\(The count, shapes, dtypes and devices of what backward returns were checked, and "
        r"are right\.\)\n"
        r"  Fix: check at a point away from kinks, e.g\. torch\.randn\(4, dtype=torch\.float64\)"
    )):
        check_function(_Relu, x)
    one_zero = _x(3, 2)
    one_zero[2, 1] = 0.0
    with pytest.raises(FunctionCheckValueError, match=r"output 0 of fn at index \(2, 1\)"):
        check_function(lambda a: (_Relu.apply(a), a.sum()), one_zero)
    # away from the kink it passes; a wrong backward of a steep smooth forward is blamed
    assert check_function(_Relu, _x(4)).max_error < 1e-6
    with pytest.raises(FunctionCheckError, match="backward's result is 1.01 times the right"):
        check_function(_SteepExpOff, _x(5) * 0.1)


class _SqrtOff(torch.autograd.Function):
    """sqrt, with a backward 1% too large."""

    @staticmethod
    def forward(ctx, x):
        y = x.sqrt()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return 1.01 * g / (2 * y)


class _Sqrt(_SqrtOff):
    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g / (2 * y)


def test_inputs_near_a_singularity_are_checked_with_a_smaller_step():
    # log at 3e-6 (central differences with eps=1e-6 off by 2e-4 of the scale) and at 1e-7
    # (the step leaves the domain), sqrt at 1e-8: a correct backward failed (NOTE [a smaller
    # step])
    for fn, small in ((Log, 3e-6), (Log, 1e-7), (_Sqrt, 1e-8)):
        x = torch.tensor([small, 0.5, 2.0], dtype=torch.float64)
        report = check_function(fn, x)
        assert any(re.match(r"input 0: the central differences converged only at a step of "
                            r"1e-\d+ \(forward curves strongly at these inputs\)", note)
                   for note in report.notes), report.notes
        assert report.inputs[0].max_rel_error < 1e-5
    # a backward 1% off is still blamed there, at every step
    with pytest.raises(FunctionCheckError, match=r"backward's result is 1\.01 times the right"):
        check_function(_SqrtOff, torch.tensor([1e-8, 0.5, 2.0], dtype=torch.float64))


class _LinearWeightOff(torch.autograd.Function):
    """x @ w.T; backward's gradient for w is 1.5 times too large (for x it is right)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, 1.5 * (g.T @ x)


class _UsesLinearWeightOff(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = torch.nn.Linear(4, 4).double()
        self.w = torch.nn.Parameter(_x(3, 4, seed=5))

    def forward(self, x):
        return _LinearWeightOff.apply(self.pre(x), self.w)


def test_the_parameters_of_fns_modules_are_checked_too():
    # check_function(model, x) differentiated x only: a backward wrong for the module's
    # weight (here 1.5 times too large) passed (NOTE [parameters of fn's modules])
    model = _UsesLinearWeightOff()
    before = {k: (v.clone(), v._version) for k, v in model.state_dict(keep_vars=True).items()}
    for fn, args in ((model, (_x(5, 4),)), (lambda x: model(x), (_x(5, 4),)),
                     (lambda x, m: m(x), (_x(5, 4), model))):
        with pytest.raises(FunctionCheckError, match=(
            r"(?s)the gradient autograd computes through fn for parameter _UsesLinearWeightOff\.w "
            r"does not match finite differences of forward\.\n.*dL/d\(parameter "
            r"_UsesLinearWeightOff\.w\) = grad_output times the Jacobian.*backward's result is "
            r"1\.5 times the right one")):
            check_function(fn, *args)
    for k, v in model.state_dict(keep_vars=True).items():  # not written into, not even once
        assert torch.equal(v, before[k][0]) and v._version == before[k][1], k
        assert v.grad is None
    # with a right backward: one row per parameter that feeds the custom Function
    model.w.requires_grad_(False)  # (no gradient needed: not checked)
    report = check_function(model, _x(5, 4))
    assert [r.description for r in report.parameters] == [
        "_UsesLinearWeightOff.pre.weight: Tensor(4, 4) float64",
        "_UsesLinearWeightOff.pre.bias: Tensor(4,) float64",
    ]
    assert all(r.shape_ok and r.max_rel_error < 1e-6 for r in report.parameters)
    assert "param 0  _UsesLinearWeightOff.pre.weight" in str(report)


def test_a_captured_tensor_that_requires_grad_is_noted_as_unchecked():
    w = _x(3, 4, seed=5, requires_grad=True)
    report = check_function(lambda x: _LinearWeightOff.apply(x, w), _x(5, 4))
    assert report.notes == (
        "gradients not checked for 1 tensor that fn captures outside a module ((3, 4)): it "
        "requires grad and feeds a custom Function, but cannot be moved for finite "
        "differences; pass it as input of fn to check its gradient",)
    with pytest.raises(FunctionCheckError, match=r"for input 1 does not match"):
        check_function(lambda x, w: _LinearWeightOff.apply(x, w), _x(5, 4), w)


class _TimesThreeOff(torch.autograd.Function):
    """3 x; backward returns 2 g."""

    @staticmethod
    def forward(ctx, x):
        return 3 * x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def test_integer_inputs_with_module_parameters_are_checked_not_refused():
    # an embedding lookup of integer indices: no input to differentiate, but the module's
    # weight feeds the custom Function; it was refused as "nothing to check"
    torch.manual_seed(0)
    emb = torch.nn.Embedding(5, 3).double()
    idx = torch.tensor([1, 4, 1])
    with pytest.raises(FunctionCheckError, match=r"(?s)for parameter Embedding\.weight does not "
                       r"match.*0\.666667 times the right one"):
        check_function(lambda i: _TimesThreeOff.apply(emb(i)), idx)
    report = check_function(lambda i: ScaleAddSquare.apply(emb(i), 2.0, emb(i)), idx)
    assert [r.description for r in report.parameters] == ["Embedding.weight: Tensor(5, 3) float64"]
    assert report.inputs[0].requires_grad is False


def test_tensors_inside_a_list_input_are_named_when_nothing_is_differentiated():
    with pytest.raises(FunctionCheckValueError, match=(
        r"(?s)none of the 1 inputs is a floating-point or complex tensor, so there is no "
        r"gradient to check\.\n  Input 0 is a list holding tensors, but check_function "
        r"differentiates only the tensors passed directly as arguments.*\n  Fix: pass them as "
        r"separate arguments, e.g\. torch_vjp\.check_function\(lambda a, b: fn\(\[a, b\]\), a, b\)"
    )):
        check_function(lambda xs: Exp.apply(xs[0]) * xs[1], [_x(3), _x(3, seed=1)])


def test_an_input_fn_writes_into_is_not_the_callers_with_module_parameters():
    # the call that finds the parameters feeding a custom Function passed a tensor input
    # that is not differentiated as is: a forward adding into it (an output buffer) wrote
    # into the caller's tensor once
    torch.manual_seed(0)
    emb = torch.nn.Embedding(5, 3).double()
    out = torch.zeros(3, 3, dtype=torch.long)

    def fn(i, buf):
        buf.add_(1)
        return ScaleAddSquare.apply(emb(i), 2.0, emb(i)) + buf

    report = check_function(fn, torch.tensor([1, 4, 1]), out)
    assert [r.description for r in report.parameters] == ["Embedding.weight: Tensor(5, 3) float64"]
    assert torch.equal(out, torch.zeros(3, 3, dtype=torch.long))
    assert out._version == 0


class _SinInFloat32Zero(torch.autograd.Function):
    """sin computed in float32 inside; backward returns zeros."""

    @staticmethod
    def forward(ctx, x):
        return x.float().sin().to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g * 0


def test_a_smaller_step_that_jumps_to_a_plateau_passes_no_wrong_backward():
    # a forward computing in float32 inside, outputs moved off float32's grid: below
    # float32's rounding it is flat, the smaller steps' differences jumped to that plateau,
    # and a backward returning zeros for the sin passed, the report saying the differences
    # had "converged only at a step of 1e-07" (NOTE [a smaller step])
    for seed in (0, 4):
        x = torch.randn(1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        with pytest.raises(FunctionCheckError, match=(
                r"the gradient autograd computes through fn for input 0 does not match finite "
                r"differences of forward")):
            check_function(lambda x: _SinInFloat32Zero.apply(x) * 1.37 + 0.1 * x, x)


class _SinInFloat32(_SinInFloat32Zero):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.float().sin().to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()


def test_a_forward_rounding_coarser_than_its_outputs_is_no_kink():
    # float32 inside, outputs moved off float32's grid: the one-sided differences disagree
    # by rounding, which grows as the step shrinks; it was refused as "not differentiable at
    # these inputs" (a kink), a backward returning zeros included (NOTE [kinks])
    x = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for fn in (_SinInFloat32, _SinInFloat32Zero):
        with pytest.raises(FunctionCheckError, match=(
                r"(?s)for input 0 does not match finite differences of forward\..*\n  But "
                r"forward's finite differences grow noisier as the step shrinks \(their "
                r"one-sided gap grew [\d.]+ times at a step ten times smaller\): forward rounds "
                r"coarser than its float64 outputs hold \(it computes in float32 or lower "
                r"inside, say\), so this test cannot tell a right backward from a wrong one at "
                r"eps=1e-06\.\n  Fix: check with a step and tolerances for that precision, "
                r"e\.g\. check_function\(fn, \.\.\., eps=5e-3, atol=1e-5, rtol=1e-2\) for "
                r"float32 inside\.$")) as info:
            check_function(lambda x, fn=fn: fn.apply(x) * 1.37 + 0.1 * x, x)
        assert not isinstance(info.value, FunctionCheckValueError)
    # the suggested step and tolerances tell them apart
    report = check_function(lambda x: _SinInFloat32.apply(x) * 1.37 + 0.1 * x, x, eps=5e-3,
                            atol=1e-5, rtol=1e-2)
    assert report.max_error < 1e-3
    with pytest.raises(FunctionCheckError, match=r"does not match finite differences"):
        check_function(lambda x: _SinInFloat32Zero.apply(x) * 1.37 + 0.1 * x, x, eps=5e-3,
                       atol=1e-5, rtol=1e-2)


class _TakesWeight(torch.nn.Module):
    def __init__(self, w, fn):
        super().__init__()
        self.w, self.fn = w, fn

    def forward(self, x):
        return self.fn.apply(x, self.w)


def test_a_parameter_shared_by_two_modules_moves_in_both():
    # a weight shared by two modules fn reaches (neither owning the other) was swapped in
    # the first only: fn could not run in float64 (a float32 weight met a float64 one), the
    # values fell back to float32, the second use went unchecked, and the report noted the
    # weight as "a tensor fn captures outside a module"
    w = torch.nn.Parameter(_x(3, 4, seed=5).float())
    first, second = _TakesWeight(w, _LinearWeightOff), _TakesWeight(w, _LinearWeightOff)
    with pytest.raises(FunctionCheckError, match=(
            r"(?s)for parameter _TakesWeight\[0\]\.w does not match finite differences of "
            r"forward"
            r"\.\n  dot-product test in float64.*1\.5 times the right one")):
        check_function(lambda x: first(x) + second(x), _x(5, 4).float())
    first.fn = second.fn = _LinearRight
    report = check_function(lambda x: first(x) + second(x), _x(5, 4).float())
    assert report.value_dtype == torch.float64 and report.notes == ()
    assert [r.description for r in report.parameters] == [
        "_TakesWeight[0].w: Tensor(3, 4) float32"]
    assert report.parameters[0].max_rel_error < 1e-6
    assert first.w is w and second.w is w


class _LinearRight(_LinearWeightOff):
    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.T @ x


class _DropWithGenerator(torch.nn.Module):
    """Exp, then a dropout mask drawn from a generator the module holds."""

    def __init__(self, gen):
        super().__init__()
        self.gen = gen

    def forward(self, x):
        return Exp.apply(x) * (torch.rand(x.shape, generator=self.gen, dtype=x.dtype) > 0.5)


def test_a_forward_drawing_from_its_own_generator_sees_the_same_draws_on_every_call():
    # a dropout drawing from a torch.Generator of fn's closure (or of a module it uses) drew
    # another mask on every call: the point was refused as a kink (slopes of +-7e5), and
    # the generator moved (NOTE [check_function's draws])
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    x = _x(6, 5)

    def dropped(t):
        return Exp.apply(t) * (torch.rand(t.shape, generator=gen, dtype=t.dtype) > 0.5)

    for fn in (dropped, _DropWithGenerator(gen), lambda t: _DropWithGenerator(gen)(t)):
        report = check_function(fn, x)
        assert report.inputs[0].max_rel_error < 1e-6
        assert torch.equal(gen.get_state(), state)
    # a wrong backward is still caught, and the generator put back
    with pytest.raises(FunctionCheckError, match=r"backward's result is 0\.666667 times"):
        check_function(lambda t: _TimesThreeOff.apply(dropped(t)), x)
    assert torch.equal(gen.get_state(), state)


class _SpectralLinear(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.weight = torch.nn.Parameter(_x(3, 4, seed=5))

    def forward(self, x):
        return self.fn.apply(x, self.weight)


def test_a_buffer_a_call_updates_and_the_next_reads_is_put_back_before_every_call():
    # spectral norm in training mode: each call moves its power-iteration vectors, which
    # normalise the weight, so every call was another function and a correct backward was
    # blamed for input 0 (<J t, c> = -2.7 against 1.5); the buffers were put back only at
    # the end (NOTE [check_function's draws])
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = parametrizations.spectral_norm(_SpectralLinear(_LinearRight))
    before = {k: (v.clone(), v._version) for k, v in model.state_dict(keep_vars=True).items()}
    report = check_function(model, _x(2, 4))
    assert report.inputs[0].max_rel_error < 1e-6
    assert report.parameters[0].max_rel_error < 1e-6
    for k, v in model.state_dict(keep_vars=True).items():
        assert torch.equal(v, before[k][0]), k
    # torch.nn.utils.spectral_norm (one power iteration per call, from the vectors the last
    # call left): a correct backward for input 0 was blamed by 30 times
    old = torch.nn.utils.spectral_norm(_SpectralLinear(_LinearRight))
    old.weight_orig.requires_grad_(False)  # (its power iteration is not differentiated)
    before = {k: v.clone() for k, v in old.state_dict().items()}
    assert check_function(old, _x(2, 4)).inputs[0].max_rel_error < 1e-6
    for k, v in old.state_dict().items():  # (its own in-place writes move the versions)
        assert torch.equal(v, before[k]), k
    # a backward wrong for the weight is still blamed
    model = parametrizations.spectral_norm(_SpectralLinear(_LinearWeightOff))
    with pytest.raises(FunctionCheckError, match=r"(?s)for parameter Parametrized_SpectralLinear"
                       r"\.parametrizations\.weight\.original does not match.*1\.5 times"):
        check_function(model, _x(2, 4))


class _ReluOfWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.0, 1.5, -2.0], dtype=torch.float64))

    def forward(self, x):
        return Exp.apply(x * torch.relu(self.w))


def test_a_parameter_refused_for_its_values_names_a_fix_for_a_parameter():
    # a parameter holding NaN, or at a kink, was refused with the inputs' fix, "check at
    # finite inputs, e.g. torch.randn(3, 4)": no argument of fn holds it
    model = _UsesLinearWeightOff()
    with torch.no_grad():
        model.w[1, 2] = float("nan")
    with pytest.raises(FunctionCheckValueError, match=(
            r"(?s)parameter _UsesLinearWeightOff\.w holds non-finite values \(1 of 12 elements "
            r"is NaN or inf.*\n  Fix: parameter _UsesLinearWeightOff\.w is the module's own "
            r"tensor, not an argument of fn: check a copy of the module whose w is moved to "
            r"finite values \(m = copy\.deepcopy\(model\); torch\.nn\.init\.normal_\(m\.w\); "
            r"torch_vjp\.check_function\(m, \.\.\.\)\), or leave its gradient unchecked with "
            r"model\.w\.requires_grad_\(False\)\.$")):
        check_function(model, _x(5, 4))
    with pytest.raises(FunctionCheckValueError, match=(
            r"(?s)forward is not differentiable at these inputs: along a random direction t "
            r"of parameter _ReluOfWeight\.w.*\n  Fix: parameter _ReluOfWeight\.w is the "
            r"module's own tensor, not an argument of fn: check a copy of the module whose w "
            r"is moved away from the kink")):
        check_function(_ReluOfWeight(), _x(3))


def test_the_parameters_of_two_modules_of_one_class_are_told_apart():
    # two modules of one class, each with its own weight, were both "_TakesWeight.w": the
    # message did not say which one's gradient was wrong
    right = _TakesWeight(torch.nn.Parameter(_x(3, 4, seed=5)), _LinearRight)
    wrong = _TakesWeight(torch.nn.Parameter(_x(3, 4, seed=6)), _LinearWeightOff)
    with pytest.raises(FunctionCheckError, match=r"for parameter _TakesWeight\[1\]\.w does not "
                       r"match"):
        check_function(lambda x: right(x) + wrong(x).sin(), _x(5, 4))
    wrong.fn = _LinearRight
    report = check_function(lambda x: right(x) + wrong(x).sin(), _x(5, 4))
    assert [r.description.split(":")[0] for r in report.parameters] == [
        "_TakesWeight[0].w", "_TakesWeight[1].w"]


class _ReluDoubled(_Relu):
    """relu whose backward doubles every gradient."""

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * g * (x > 0).to(g.dtype)


def test_a_kink_does_not_excuse_an_error_it_cannot_explain():
    # a relu whose backward doubles every gradient, checked at whole numbers (a zero among
    # them): refused as a kink, "the check would blame a backward that may be right"; no
    # choice of one-sided slopes comes near its error (NOTE [kinks])
    x = torch.tensor([-2.0, 0.0, 1.0, 3.0, 2.0, 5.0], dtype=torch.float64)
    with pytest.raises(FunctionCheckError, match=(
            r"(?s)check_function\(_ReluDoubled\): the gradient that _ReluDoubled\.backward "
            r"returns for input 0 does not match finite differences of forward\..*\n  forward "
            r"has a kink at these inputs too \(one-sided rates of .* and .*\), but any choice "
            r"of one-sided slopes stays within [\d.e+-]+ of <J t, c>, far less than the error: "
            r"it is backward's\.\n  Fix: re-derive _ReluDoubled\.backward")) as info:
        check_function(_ReluDoubled, x)
    assert not isinstance(info.value, FunctionCheckValueError)
    with pytest.raises(FunctionCheckValueError, match=r"forward is not differentiable"):
        check_function(_Relu, x)


class _GrowingScale(torch.nn.Module):
    """Exp times a buffer that forward replaces in training mode."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones((), dtype=torch.float64))

    def forward(self, x):
        out = Exp.apply(x) * self.scale
        if self.training:
            self.scale = self.scale * 1.1
        return out


def test_a_buffer_forward_replaces_is_put_back():
    # forward replaced its buffer (self.scale = self.scale * 1.1): every call was another
    # function (refused as a kink, 6.8e6 against -1.4), and the module was left with the
    # last call's scale, 80 (NOTE [check_function's draws])
    model = _GrowingScale()
    scale = model.scale
    assert check_function(model, _x(3)).inputs[0].max_rel_error < 1e-6
    assert model.scale is scale and float(scale) == 1.0


class _ReluOff(_Relu):
    """relu, with a backward 5% too large where x > 0."""

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 1.05 * g * (x > 0).to(g.dtype)


class _ReluAndSinOff(torch.autograd.Function):
    """relu (torch's 0 at 0: right) and sin, whose gradient backward makes 3% too large."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(min=0), x.sin()

    @staticmethod
    def backward(ctx, g_relu, g_sin):
        (x,) = ctx.saved_tensors
        return g_relu * (x > 0).to(x.dtype) + 1.03 * g_sin * x.cos()


def test_a_kink_does_not_excuse_a_few_percent_wrong_on_the_other_outputs():
    # a relu right at 0 beside a sin gradient 3% off, checked at whole numbers: the kink's
    # gap (0.5 sum |c * gap|) was larger than the sin's error, and the point was refused as
    # a kink, "a backward that may be right"; with c zero where the kink lies, the error
    # stays (NOTE [kinks])
    x = torch.tensor([-2.0, 0.0, 1.0, 3.0, 2.0, 5.0, -1.0], dtype=torch.float64)
    with pytest.raises(FunctionCheckError, match=(
            r"(?s)check_function\(_ReluAndSinOff\): the gradient that _ReluAndSinOff\.backward "
            r"returns for input 0 does not match finite differences of forward\..*\n  forward "
            r"has a kink at these inputs too \(one-sided rates of .* and .*\), but .*it is "
            r"backward's\.\n  Fix: re-derive _ReluAndSinOff\.backward")) as info:
        check_function(_ReluAndSinOff, x)
    assert not isinstance(info.value, FunctionCheckValueError)
    # a relu 5% too large on its smooth elements, a zero among them
    with pytest.raises(FunctionCheckError, match=(
            r"but with c zero on the outputs where the kink lies, <J t, c'> = [\d.e+-]+ while "
            r"<t, backward\(c'\)> = [\d.e+-]+: no kink is left to excuse that error, it is "
            r"backward's\.\n  Fix: re-derive _ReluOff\.backward")) as info:
        check_function(_ReluOff, torch.arange(-2.0, 9.0, dtype=torch.float64))
    assert not isinstance(info.value, FunctionCheckValueError)
    # right everywhere: still the kink's refusal, not backward's blame
    with pytest.raises(FunctionCheckValueError, match=r"forward is not differentiable"):
        check_function(lambda a: (_Relu.apply(a), a.sin()), x)


class _Forwarding:
    """A proxy with no __dict__ whose __getattr__ (user code) forwards and records."""

    __slots__ = ("_target", "_asked")

    def __init__(self, target, asked):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_asked", asked)

    def __getattr__(self, name):
        object.__getattribute__(self, "_asked").append(name)
        return getattr(object.__getattribute__(self, "_target"), name)


def test_the_search_for_generators_runs_no_user_code():
    # the search read an object's attributes by getattr(obj, "__dict__"): an object with
    # no __dict__ (slots) ran its __getattr__, user code, with "__dict__" (NOTE
    # [check_function's draws])
    from torch_vjp._function_calls import generators

    gen, asked = torch.Generator().manual_seed(3), []

    class Holder:
        def __init__(self):
            self.gen = gen

    proxy, holder = _Forwarding(Holder(), asked), Holder()

    def fn(t):
        return t * proxy.gen.initial_seed() * holder.gen.initial_seed()

    asked.clear()
    assert generators(fn, (torch.ones(2),)) == [gen]
    assert asked == []
    asked.clear()
    assert generators(lambda t: t, (proxy,)) == []
    assert asked == []


class _BufferRewriter(torch.nn.Module):
    """Exp times a buffer that forward replaces in any mode: by a new tensor, by a
    Parameter, and a buffer it registers on every call."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.register_buffer("scale", torch.ones((), dtype=torch.float64))

    def forward(self, x):
        out = Exp.apply(x) * self.scale
        if self.how == "tensor":
            self.scale = self.scale * 1.1
        else:
            self.scale = torch.nn.Parameter(self.scale.detach() * 1.1, requires_grad=False)
        self.register_buffer(f"seen{len(self._buffers)}", x.detach().clone())
        return out


@pytest.mark.parametrize("how", ["tensor", "parameter"])
@pytest.mark.parametrize("training", [True, False])
def test_a_buffer_forward_replaces_in_eval_mode_or_by_a_parameter_is_put_back(how, training):
    # in eval mode the buffers were put back at the end only: every call was another
    # function and a correct backward was blamed ("does not match finite differences");
    # a buffer made a Parameter left the module holding both, the Parameter of the last
    # call's value; and the buffers forward registered stayed (NOTE [check_function's
    # draws])
    model = _BufferRewriter(how).train(training)
    scale = model.scale
    assert check_function(model, _x(3)).inputs[0].max_rel_error < 1e-6
    assert model.scale is scale and float(scale) == 1.0
    assert dict(model._parameters) == {} and list(model._buffers) == ["scale"]


class _ScalesOff(torch.autograd.Function):
    """(1e4 sin(a) b, 1e-3 tanh(a + b)), whose backward makes the small output's gradient
    3% too large."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return 1e4 * a.sin() * b, 1e-3 * (a + b).tanh()

    @staticmethod
    def backward(ctx, g_big, g_small):
        a, b = ctx.saved_tensors
        small = 1.03e-3 * g_small * (1 - (a + b).tanh() ** 2)
        return 1e4 * g_big * a.cos() * b + small, 1e4 * g_big * a.sin() + small


def test_a_wrong_gradient_of_a_small_output_beside_a_large_one_is_blamed():
    # one random cotangent for outputs 1e7 apart in scale: the small output's share of
    # <J t, c> was below the large one's tolerance, and a gradient 3% wrong there passed
    # (NOTE [the dot-product test])
    for dtype in (torch.float64, torch.float32):
        a, b = _x(3, dtype=dtype), _x(3, dtype=dtype, seed=1)
        with pytest.raises(FunctionCheckError, match=(
                r"check_function\(_ScalesOff\): the gradient that _ScalesOff\.backward "
                r"returns for input 0 does not match finite differences of forward")):
            check_function(_ScalesOff, a, b)


# The batch questions of a custom backward ("it does not handle batches?"): what a user
# returns who expects backward to give a Jacobian, or to average over the batch.

def _batch_linear_forward(ctx, x):  # (b, 3) -> (b, 2)
    return x @ _W.to(x.dtype).mT


def test_per_example_transposed_jacobians_are_named_in_their_order():
    # (b, n, k) was described as 'the batch of 4, then the shapes of one row of the output
    # and of input 0', the order of (b, k, n)
    F = _function("F", lambda ctx, g: _W.mT.expand(4, 3, 2).clone(), _batch_linear_forward)
    with pytest.raises(FunctionCheckError) as info:
        check_function(F, _x(4, 3))
    text = str(info.value)
    assert ("(4, 3, 2) holds one Jacobian per example: the batch of 4, then the shapes of one "
            "row of input 0 and of the output: each example's transposed Jacobian") in text
    assert "torch.tensordot(j, g, dims=g.dim())" in text


@pytest.mark.parametrize("transposed", [False, True], ids=["jacobian", "transposed"])
def test_one_examples_jacobian_for_a_batch_is_named_so_with_a_fix_that_works(transposed):
    # (k, n) for a (b, n) input, b > 1, got only 'Fix: return grad_output times the
    # Jacobian'; the batch of one had its own hint
    J = _W.mT if transposed else _W
    F = _function("F", lambda ctx, g: J.to(g.dtype).clone(), _batch_linear_forward)
    with pytest.raises(FunctionCheckError) as info:
        check_function(F, _x(4, 3))
    text = str(info.value)
    rows = ("one row of input 0, (3,), and of the output, (2,)" if transposed
            else "one row of the output, (2,), and of input 0, (3,)")
    assert f"{tuple(J.shape)} has the shapes of {rows}: one example's Jacobian" in text
    fix = re.search(r"return (torch\.tensordot\(grad_output, J, dims=.*?\)) \(shape", text).group(1)
    # the fix it names is the right backward
    Fixed = _function("Fixed", lambda ctx, grad_output: eval(
        fix, {"torch": torch, "grad_output": grad_output, "J": J.to(grad_output.dtype)}),
        _batch_linear_forward)
    assert isinstance(check_function(Fixed, _x(4, 3)), FunctionCheckReport)



def test_a_gradient_reduced_over_the_batch_is_named_so():
    # (n,) for a (b, n) input was told 'if every slice of input 0 gets this same gradient,
    # return grad.expand(...)': the wrong fix for a backward that averaged over the batch
    F = _function("F", lambda ctx, g: (g @ _W.to(g.dtype)).mean(0), _batch_linear_forward)
    with pytest.raises(FunctionCheckError) as info:
        check_function(F, _x(4, 3))
    text = str(info.value)
    assert ("(3,) lacks input 0's leading dimension of size 4, the batch that the output "
            "(4, 2) has too. backward neither sums nor averages over the batch") in text
    assert "a factor 1/4 in grad_output" in text
    assert "return them without that reduction" in text

def test_per_example_jacobians_of_a_square_map_get_the_fix_of_their_usual_order():
    # a (b, n) -> (b, n) map: (b, n, n) is both (b, *out, *in) and (b, *in, *out); it was
    # read as transposed, and its fix tensordot(j, g) gives J^T g per row where the usual
    # order (torch.func.jacrev's, (out, in)) needs g J
    A = torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0], [4.0, 1.0, 1.0]], dtype=torch.float64)

    def fwd(ctx, x):
        return x @ A.mT

    J = torch.func.vmap(torch.func.jacrev(lambda r: A @ r))(_x(4, 3))  # (4, 3, 3): (out, in)
    F = _function("F", lambda ctx, g: J.to(g.dtype).clone(), fwd)
    with pytest.raises(FunctionCheckError) as info:
        check_function(F, _x(4, 3))
    text = str(info.value)
    assert "then the shapes of one row of the output and of input 0" in text
    fix = re.search(r"torch\.vmap\((lambda g, j: torch\.tensordot\(g, j, dims=g\.dim\(\)\))\)",
                    text)
    assert fix is not None, text
    Fixed = _function("Fixed", lambda ctx, grad_output: torch.vmap(eval(fix.group(1), {
        "torch": torch}))(grad_output, J.to(grad_output.dtype)), fwd)
    assert isinstance(check_function(Fixed, _x(4, 3)), FunctionCheckReport)
    assert "(b, *in, *out)" in text  # the other order is named too


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_caller_in_no_grad_mode_gets_the_check(mode):
    # under torch.no_grad() no output required grad, and a correct Function was refused:
    # "no output of fn requires grad, although input 0 does: there is no backward to run"
    Square = _SquareOfNormalized  # (x * x with a correct backward)

    class Forgot2(Square):
        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return x * g

    x = torch.randn(3, 4, dtype=torch.float64)
    with mode():
        report = check_function(Square, x)
        assert report.max_error < 1e-6
        with pytest.raises(FunctionCheckError, match="does not match finite differences"):
            check_function(Forgot2, x)
        assert not torch.is_grad_enabled()


@pytest.mark.parametrize("cls", [torch.nn.Linear, torch.nn.Tanh, dict])
def test_a_class_that_is_not_a_function_is_refused_before_it_is_constructed(cls):
    # a class is callable: check_function called it with the inputs, and the constructor's
    # own error came out ("Linear.__init__() missing 1 required positional argument"), or,
    # for nn.Tanh, "Tanh.__init__() takes 1 positional argument but 2 were given"
    name = cls.__name__
    with pytest.raises(FunctionCheckTypeError, match=(
            rf"^torch_vjp\.check_function\({name}\): got the class {name}, which is not a "
            rf"torch\.autograd\.Function subclass: calling it would construct a {name}, not "
            rf"compute with one\. Fix: pass a torch\.autograd\.Function subclass, or a "
            rf"callable that uses one: an instance \(torch_vjp\.check_function\({name}\(\.\.\.\), "
            rf"x\)\) or a function\.$")):
        check_function(cls, _x(3))


# ---------------------------------------------------------------------------------------
# Gradients of two inputs of one shape in each other's places (NOTE [swapped gradients])


class _Weighted(torch.autograd.Function):
    """forward(ctx, x, scale, y, z) = x * exp(y) * scale + z ** 2; backward returns its
    gradients in the order ``_Weighted.order`` gives (the right one: x, scale, y, z)."""

    order = ("x", "scale", "y", "z")

    @staticmethod
    def forward(ctx, x, scale, y, z):
        ctx.save_for_backward(x, y, z)
        ctx.scale = scale
        return x * y.exp() * scale + z ** 2

    @classmethod
    def backward(cls, ctx, g):
        x, y, z = ctx.saved_tensors
        grads = {"x": g * y.exp() * ctx.scale, "y": g * x * y.exp() * ctx.scale,
                 "z": 2 * g * z, "scale": None}
        return tuple(grads[k] for k in cls.order)


def _weighted(order):
    return type("Swapped", (_Weighted,), {"order": order})


def _point(dtype=torch.float64, shape=(3, 4)):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3)]


@pytest.mark.parametrize(
    "order, pair",
    [(("y", "scale", "x", "z"), (0, 2)), (("z", "scale", "y", "x"), (0, 3)),
     (("x", "scale", "z", "y"), (2, 3))],
    ids=["x-y", "x-z", "y-z"],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_swapped_gradients_are_named_as_swapped(order, pair, dtype):
    x, y, z = _point(dtype)
    fn = _weighted(order)
    # (torch takes them: each input silently gets the other's gradient)
    xs = [t.clone().requires_grad_() for t in (x, y, z)]
    fn.apply(xs[0], 1.5, xs[1], xs[2]).sum().backward()
    with pytest.raises(FunctionCheckError) as info:
        check_function(fn, x, 1.5, y, z)
    a, b = pair
    assert str(info.value).startswith(
        f"torch_vjp.check_function(Swapped): Swapped.backward returns the gradients of input "
        f"{a} and input {b} in each other's places: the gradient at index {a} matches finite "
        f"differences of forward for input {b}, and the one at index {b} those for input "
        f"{a}.\n"), str(info.value)
    assert "as both inputs have shape (3, 4), nothing else tells them apart, so each input " \
           "silently gets the other's gradient." in str(info.value)
    assert str(info.value).endswith(
        f"Fix: return them in forward's order in Swapped.backward: the gradient for input "
        f"{a} at index {a}, the one for input {b} at index {b}.")


def test_swapped_gradients_through_a_callable_are_named():
    x, y, z = _point()
    fn = _weighted(("y", "scale", "x", "z"))
    with pytest.raises(FunctionCheckError, match=re.escape(
            "the gradients autograd computes through fn for input 0 and input 1 come back in "
            "each other's places")):
        check_function(lambda a, b: fn.apply(a, 1.5, b, z), x, y)


def test_the_right_order_passes_and_one_wrong_gradient_is_not_called_a_swap():
    x, y, z = _point()
    report = check_function(_Weighted, x, 1.5, y, z)
    assert all(c.max_error < 1e-6 for c in report.inputs if c.max_error is not None)

    class OneWrong(_Weighted):  # (x's gradient wrong, y's right: no swap)
        @classmethod
        def backward(cls, ctx, g):
            gx, gs, gy, gz = super().backward(ctx, g)
            return 2 * gx, gs, gy, gz

    with pytest.raises(FunctionCheckError) as info:
        check_function(OneWrong, x, 1.5, y, z)
    assert "does not match finite differences of forward" in str(info.value)
    assert "each other's places" not in str(info.value)
