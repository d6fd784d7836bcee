"""A real gradient returned for a complex input: checked mode's warning says what torch does
with it (a zero imaginary part) and when that is right, instead of calling it a stray float64
or integer tensor and telling the user to compute in grad_output's dtype, which the
backward already did."""

from __future__ import annotations

import warnings

import torch

import torch_vjp as tv


class RealPart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z):
        return z.real * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2  # real, in grad_output's dtype: right here (dL/dz is real)


def _run(checked):
    z = torch.tensor([1 + 2j, -3j, 0.5], dtype=torch.complex64, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if checked:
            with tv.checked():
                RealPart.apply(z).sum().backward()
        else:
            RealPart.apply(z).sum().backward()
    return z.grad, [str(w.message) for w in caught
                    if issubclass(w.category, tv.FunctionCheckWarning)]


def test_a_real_gradient_for_a_complex_input_is_explained_as_what_it_is():
    plain, none = _run(False)
    got, said = _run(True)
    assert none == []
    torch.testing.assert_close(got, plain)  # (checked mode changes nothing but a warning)
    torch.testing.assert_close(got, torch.full((3,), 2.0 + 0j))
    assert len(said) == 1, said
    msg = said[0]
    assert msg.startswith("torch_vjp.checked: RealPart.backward returned a gradient of dtype "
                          "torch.float32 at index 0, but forward input 0 has dtype "
                          "torch.complex64.")
    assert ("torch casts it to torch.complex64 with a zero imaginary part without a word: "
            "that is right only where dL/d(input 0) is real") in msg
    assert "Fix: return the complex gradient; where it is real, return " \
        "grad.to(torch.complex64) to say so." in msg
    assert "usually a float64 or integer tensor" not in msg
    assert "compute in grad_output's dtype" not in msg
