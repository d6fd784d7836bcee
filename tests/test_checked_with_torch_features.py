"""Checked mode combined with other torch features, and its messages for the commonest
confusions."""

from __future__ import annotations

import pytest
import torch

import torch_vjp as tv

D = torch.float64


def _note(call, *args, **kwargs) -> str:
    """The message and notes of what ``call(*args, **kwargs)`` raises in a checked block
    (``call`` a name of torch.autograd, or a callable)."""
    with pytest.raises(RuntimeError) as info:
        with tv.checked():
            fn = getattr(torch.autograd, call) if isinstance(call, str) else call
            fn(*args, **kwargs)
    return str(info.value) + "\n" + "\n".join(getattr(info.value, "__notes__", ()))


# --------------------------------------------------------------------------------------
# A vector of an input's shape is named as such, also where its shape reads otherwise too
# --------------------------------------------------------------------------------------


def test_input_shaped_vector_for_a_scalar_output_is_named():
    # torch.ones_like(w) for a scalar loss: was told only "a single number, not 12"
    w = torch.randn(4, 3, dtype=D, requires_grad=True)
    msg = _note("grad", (w * 2).sum(), w, torch.ones_like(w))
    assert "(4, 3) is the shape of inputs[0]; gradients with respect to the inputs are " \
           "what the call returns, not what it takes" in msg
    assert "pass torch.ones_like(outputs[0]) (or leave it None: torch uses 1)" in msg
    assert "Or: outputs[0] is a 0-d scalar (shape ()), so dL/d outputs[0] is a single " \
           "number, not 12" in msg
    (g,) = torch.autograd.grad((w * 2).sum(), w)
    torch.testing.assert_close(g, torch.func.jacrev(lambda t: (t * 2).sum())(w.detach()))


def test_input_shaped_vector_with_an_extra_leading_dimension_is_named():
    # (4, 3) is both w's shape and y's (3,) with a leading 4: only the second was told
    w = torch.randn(4, 3, dtype=D, requires_grad=True)
    y = (w * 2).sum(0)
    msg = _note("grad", y, w, torch.ones_like(w), retain_graph=True)
    assert "(4, 3) is the shape of inputs[0]" in msg
    assert "To sum the elements of outputs[0], pass torch.ones_like(outputs[0])." in msg
    assert "Or: grad_outputs[0] has an extra leading dimension of size 4" in msg
    msg = _note(lambda: y.backward(torch.ones_like(w), retain_graph=True))
    assert "(4, 3) is the shape of a leaf tensor that y was computed from" in msg
    assert "Or: gradient has an extra leading dimension of size 4" in msg
    (g,) = torch.autograd.grad(y, w, torch.ones_like(y))
    torch.testing.assert_close(g, torch.func.jacrev(lambda t: (t * 2).sum(0))(
        w.detach()).sum(0))


def test_input_shaped_cotangent_for_a_scalar_pullback_is_named():
    x = torch.randn(3, dtype=D)
    with tv.checked():
        _, vjp_fn = torch.func.vjp(lambda a: (a * a).sum(), x)
    msg = _note(vjp_fn, torch.ones_like(x))
    assert "(3,) is the shape of primals[0]" in msg
    assert "Or: out is a 0-d scalar" in msg


def test_a_shape_that_is_no_inputs_keeps_its_own_reading_alone():
    w = torch.randn(4, 3, dtype=D, requires_grad=True)
    msg = _note("grad", (w * 2).sum(0), w, torch.ones(5, 3, dtype=D))
    assert "grad_outputs[0] has an extra leading dimension of size 5" in msg
    assert "is the shape of inputs" not in msg and "Or:" not in msg


# --------------------------------------------------------------------------------------
# A custom backward's gradients returned in another order are told as such
# --------------------------------------------------------------------------------------


class _Swapped(torch.autograd.Function):
    """x @ w, whose backward returns the two gradients in the wrong order."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return x.mT @ g, g @ w.mT


class _Ordered(_Swapped):
    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.mT, x.mT @ g


def test_gradients_in_the_wrong_order_are_told_in_checked_mode():
    # (3, 4) at index 0 was read as "one example's Jacobian (transposed)" only
    x = torch.randn(2, 3, dtype=D, requires_grad=True)
    w = torch.randn(3, 4, dtype=D, requires_grad=True)
    msg = _note(lambda: _Swapped.apply(x, w).sum().backward())
    assert msg.startswith("Function _SwappedBackward returned an invalid gradient at index 0")
    assert ("(3, 4) is the shape of forward input 1: gradients out of order? backward "
            "returns them in forward's order: input 0's, of shape (2, 3), at index 0.") in msg
    gx, gw = torch.autograd.grad(_Ordered.apply(x, w).sum(), (x, w))
    jx, jw = torch.func.jacrev(lambda a, b: (a @ b).sum(), argnums=(0, 1))(x.detach(),
                                                                          w.detach())
    torch.testing.assert_close((gx, gw), (jx, jw))


def test_gradients_in_the_wrong_order_are_told_by_check_function():
    with pytest.raises(tv.FunctionCheckError,
                       match=r"\(3, 4\) is the shape of forward input 1: gradients out of "
                             r"order\?"):
        tv.check_function(_Swapped, torch.randn(2, 3, dtype=D), torch.randn(3, 4, dtype=D))
    report = tv.check_function(_Ordered, torch.randn(2, 3, dtype=D), torch.randn(3, 4, dtype=D))
    assert all(i.shape_ok for i in report.inputs)


def test_a_summed_gradient_of_another_input_s_shape_is_not_told_as_out_of_order():
    class SumRows(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(x, y)
            return (x * y).sum(0)

        @staticmethod
        def backward(ctx, g):
            x, y = ctx.saved_tensors
            return g * y.expand_as(x), g * x  # index 1: (5, 4), which torch sums to (4,)

    x = torch.randn(5, 4, dtype=D, requires_grad=True)
    y = torch.randn(4, dtype=D, requires_grad=True)
    with pytest.warns(tv.FunctionCheckWarning) as caught:
        with tv.checked():
            SumRows.apply(x, y).sum().backward()
    text = "\n".join(str(w.message) for w in caught)
    assert "extra leading dimension of size 5" in text and "out of order" not in text
    torch.testing.assert_close(y.grad, x.detach().sum(0))
