"""Checked mode's note on a custom backward's gradient of the wrong dtype, for a leaf whose
``grad_dtype`` is set: it names that grad_dtype as a dtype torch takes (the dtype .grad
holds), not the leaf's dtype alone, and the gradients it says are taken are taken without
a word, into the .grad that plain autograd makes."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

pytestmark = pytest.mark.skipif(
    not hasattr(torch.Tensor, "grad_dtype"), reason="this torch has no Tensor.grad_dtype")


def _function(dtype):
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            return (g * 2.0).to(dtype)

    return Twice


def _leaf(grad_dtype):
    leaf = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    leaf.grad_dtype = grad_dtype
    return leaf


def _run_checked(fn, leaf):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tv.checked():
            fn.apply(leaf).sum().backward()
    return [str(w.message) for w in caught if issubclass(w.category, tv.FunctionCheckWarning)]


def test_the_note_names_the_leaf_s_grad_dtype():
    said = _run_checked(_function(torch.float64), _leaf(torch.float16))
    assert len(said) == 1, said
    msg = said[0]
    note = next(line for line in msg.splitlines() if "dL/d(input 0) holds" in line)
    assert "holds one float32 number per element of input 0" in note  # (the input's own)
    assert ("or the grad_dtype of a leaf that sets one (torch.float16, the dtype its .grad "
            "holds: torch takes a torch.float16 or torch.float32 gradient for it)") in note


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
def test_the_dtypes_the_note_says_are_taken_are_taken_silently(dtype):
    ref = _leaf(torch.float16)
    _function(dtype).apply(ref).sum().backward()
    leaf = _leaf(torch.float16)
    assert _run_checked(_function(dtype), leaf) == []
    assert leaf.grad.dtype == torch.float16
    torch.testing.assert_close(leaf.grad, ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(leaf.grad.double(), torch.full((3,), 2.0, dtype=torch.float64))


def test_a_leaf_without_grad_dtype_keeps_the_plain_note():
    said = _run_checked(_function(torch.float64), torch.tensor([1.0, 2.0], requires_grad=True))
    assert len(said) == 1, said
    assert ("holds one float32 number per element of input 0: a gradient has its input's "
            "dtype (and shape, and device).\n") in said[0]
    assert "grad_dtype" not in said[0]
