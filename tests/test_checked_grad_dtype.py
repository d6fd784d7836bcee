"""A leaf's ``grad_dtype``: torch casts the gradient that reaches the leaf to it (and casts
nothing where it is None), not to the leaf's dtype. Checked mode and the drop-ins must not
warn of a cast torch does not make, and must keep warning of the casts it does make."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.autograd.graph import get_gradient_edge

import torch_vjp as tv

pytestmark = pytest.mark.skipif(
    not hasattr(torch.Tensor, "grad_dtype"), reason="this torch has no Tensor.grad_dtype")

_VALUES = [1.0 + 2.0**-30, -2.0, 0.5]  # (the first is not a float32: a cast would show)


def _leaf(grad_dtype):
    leaf = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    leaf.grad_dtype = grad_dtype
    return leaf


def _gradient():
    return torch.tensor(_VALUES, dtype=torch.float64)


class _Twice(torch.autograd.Function):
    """Returns a float64 gradient for its float32 input."""

    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return g.double() * _gradient()


def _checked(fn):
    def run(*args, **kwargs):
        with tv.checked():
            return fn(*args, **kwargs)

    return run


def _no_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    ours = [w for w in caught if issubclass(w.category, (tv.GradOutputsWarning,
                                                          tv.FunctionCheckWarning))]
    assert not ours, [str(w.message) for w in ours]
    return out


_BACKWARDS = {
    "tv.backward": lambda t, g: tv.backward(t, g),
    "checked Tensor.backward": _checked(lambda t, g: t.backward(g)),
    "checked autograd.backward": _checked(lambda t, g: torch.autograd.backward(t, g)),
    "checked edge": _checked(lambda t, g: torch.autograd.backward(get_gradient_edge(t), g)),
    "tv.backward edge": lambda t, g: tv.backward(get_gradient_edge(t), g),
}


@pytest.mark.parametrize("grad_dtype", [torch.float64, None], ids=["float64", "None"])
@pytest.mark.parametrize("call", list(_BACKWARDS), ids=list(_BACKWARDS))
def test_a_float64_gradient_for_a_leaf_that_keeps_it_is_no_cast(call, grad_dtype):
    # grad_dtype float64 (or None) on a float32 leaf: torch keeps the float64 gradient, so
    # "torch casts the torch.float64 gradient to torch.float32 silently" was false.
    ref = _leaf(grad_dtype)
    ref.backward(_gradient())
    leaf = _leaf(grad_dtype)
    _no_warnings(lambda: _BACKWARDS[call](leaf, _gradient()))
    assert leaf.grad.dtype == torch.float64
    torch.testing.assert_close(leaf.grad, ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(leaf.grad, _gradient(), rtol=0, atol=0)


@pytest.mark.parametrize("grad", [tv.grad, _checked(torch.autograd.grad)],
                         ids=["tv.grad", "checked"])
def test_grad_of_a_leaf_with_grad_dtype_keeps_the_gradient(grad):
    leaf = _leaf(torch.float64)
    (g,) = _no_warnings(lambda: grad(leaf, leaf, _gradient()))
    torch.testing.assert_close(g, _gradient(), rtol=0, atol=0)


@pytest.mark.parametrize("grad_dtype", [torch.float64, None], ids=["float64", "None"])
def test_a_function_s_float64_gradient_for_such_a_leaf_is_no_cast(grad_dtype):
    # The custom backward's float64 gradient reaches .grad unchanged: no FunctionCheckWarning.
    ref = _leaf(grad_dtype)
    _Twice.apply(ref).sum().backward()
    leaf = _leaf(grad_dtype)
    _no_warnings(_checked(lambda: _Twice.apply(leaf).sum().backward()))
    assert leaf.grad.dtype == torch.float64
    torch.testing.assert_close(leaf.grad, ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(leaf.grad, _gradient(), rtol=0, atol=0)


def test_the_casts_torch_does_make_are_still_told():
    # without grad_dtype, and through a node in between, torch casts to float32: warned
    leaf = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with pytest.warns(tv.GradOutputsWarning, match="casts the torch.float64 grad_tensors to "
                                                   "torch.float32"):
        tv.backward(leaf, _gradient())
    assert leaf.grad.dtype == torch.float32
    leaf = _leaf(torch.float64)
    with pytest.warns(tv.GradOutputsWarning, match="to torch.float32 silently"):
        tv.backward(leaf * 1.0, _gradient())
    leaf = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with pytest.warns(tv.FunctionCheckWarning, match="dtype torch.float64"):
        _checked(lambda: _Twice.apply(leaf).sum().backward())()


@pytest.mark.parametrize("call", list(_BACKWARDS), ids=list(_BACKWARDS))
def test_a_cast_to_a_leaf_s_grad_dtype_names_that_dtype(call):
    # a float64 gradient for a float32 leaf whose grad_dtype is float16: torch casts it to
    # float16, and the warning named float32 (the leaf's dtype) as the target and the fix
    ref = _leaf(torch.float16)
    ref.backward(_gradient())
    leaf = _leaf(torch.float16)
    with pytest.warns(tv.GradOutputsWarning) as said:
        _BACKWARDS[call](leaf, _gradient())
    msg = str(said[0].message)
    assert "has dtype torch.float32 (a leaf whose grad_dtype is torch.float16); torch casts " \
           "the torch.float64" in msg, msg
    assert "to torch.float16 silently" in msg and ".to(torch.float16) to make the cast " \
           "explicit" in msg, msg
    assert leaf.grad.dtype == torch.float16
    torch.testing.assert_close(leaf.grad, ref.grad, rtol=0, atol=0)


@pytest.mark.parametrize("call", list(_BACKWARDS), ids=list(_BACKWARDS))
def test_an_exact_cast_to_a_leaf_s_grad_dtype_is_not_told(call):
    # a float16 gradient for a float32 leaf whose grad_dtype is float64: torch casts it to
    # float64 exactly, the result of the explicit cast: valid code, no warning
    ref = _leaf(torch.float64)
    ref.backward(_gradient().half().double())
    leaf = _leaf(torch.float64)
    _no_warnings(lambda: _BACKWARDS[call](leaf, _gradient().half()))
    assert leaf.grad.dtype == torch.float64
    torch.testing.assert_close(leaf.grad, ref.grad, rtol=0, atol=0)


def test_a_function_s_cast_to_a_leaf_s_grad_dtype_names_the_leaf_s_dtype():
    # a float64 gradient from a custom backward for a float32 leaf whose grad_dtype is
    # float16: torch casts it to float16. The warning said forward input 0 "has dtype
    # torch.float16" and "holds one float16 number per element": the input is float32.
    ref = _leaf(torch.float16)
    _Twice.apply(ref).sum().backward()
    leaf = _leaf(torch.float16)
    with pytest.warns(tv.FunctionCheckWarning) as said:
        _checked(lambda: _Twice.apply(leaf).sum().backward())()
    msg = str(said[0].message)
    assert ("returned a gradient of dtype torch.float64 at index 0, but forward input 0 has "
            "dtype torch.float32 (a leaf whose grad_dtype is torch.float16).") in msg, msg
    assert "holds one float32 number per element of input 0" in msg, msg
    assert "it casts the gradient to torch.float16 without a word" in msg, msg
    assert leaf.grad.dtype == torch.float16
    torch.testing.assert_close(leaf.grad, ref.grad, rtol=0, atol=0)
    # a leaf without grad_dtype set keeps the plain wording
    plain = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with pytest.warns(tv.FunctionCheckWarning) as said:
        _checked(lambda: _Twice.apply(plain).sum().backward())()
    msg = str(said[0].message)
    assert "forward input 0 has dtype torch.float32.\n" in msg and "grad_dtype" not in msg, msg

