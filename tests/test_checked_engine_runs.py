"""Checked mode judges a custom backward's return value as torch's engine will treat it,
and only where the engine treats it.

* A node's ``apply`` called by hand (``y.grad_fn.apply(g)``) is no backward pass: torch
  checks nothing and hands the value back. Checked mode raised a FunctionCheckError there,
  with a sentence of torch's that torch never raises for the call.
* The backward of a Function that modified a view in place (``mark_dirty``) runs inside the
  view's CopySlices node, which copies the view's gradient into its slice (broadcasting it)
  without the shape check of a plain node: torch accepts a gradient it would reject
  elsewhere. Checked mode's replay on a plain stand-in node said "rejects" and raised, so a
  call torch runs failed; it now warns, and the result is torch's.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv
from torch_vjp import FunctionCheckError, FunctionCheckWarning

F64 = torch.float64


class _RowSum(torch.autograd.Function):
    """backward returns a (4,) gradient for a (3, 4) input: torch's engine rejects it."""

    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        return (g * 2).sum(0)


class _DirtyRowSum(torch.autograd.Function):
    """Doubles its input in place; backward's gradient lacks the input's first dimension."""

    @staticmethod
    def forward(ctx, a):
        a.mul_(2)
        ctx.mark_dirty(a)
        return a

    @staticmethod
    def backward(ctx, g):
        return (g * 2).sum(0)


def test_a_node_applied_by_hand_is_not_checked():
    x = torch.randn(3, 4, dtype=F64, requires_grad=True)
    g = torch.ones(3, 4, dtype=F64)
    plain = _RowSum.apply(x).grad_fn.apply(g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tv.checked():
            checked = _RowSum.apply(x).grad_fn.apply(g)
    assert torch.equal(plain, checked)
    assert checked.shape == (4,)


def _dirty_view_grad(x):
    base = x.clone()
    _DirtyRowSum.apply(base[:, 1:3])
    return torch.autograd.grad((base ** 2).sum(), x)[0]


def test_a_gradient_copyslices_takes_warns_and_the_result_is_torchs():
    x = torch.randn(3, 4, dtype=F64, requires_grad=True)
    plain = _dirty_view_grad(x)
    with tv.checked():
        with pytest.warns(FunctionCheckWarning,
                          match=r"_DirtyRowSum\.backward returned a gradient of shape \(2,\) at "
                                r"index 0, but forward input 0 has shape \(3, 2\)"):
            checked = _dirty_view_grad(x)
    assert torch.equal(plain, checked)


def test_the_copyslices_warning_says_why_torch_took_it():
    x = torch.randn(3, 4, dtype=F64, requires_grad=True)
    with tv.checked():
        with pytest.warns(FunctionCheckWarning) as record:
            _dirty_view_grad(x)
    text = str(record[0].message)
    assert text.startswith(
        "torch_vjp.checked: torch took what _DirtyRowSum.backward returned without its shape "
        "check: forward modified a view in place (mark_dirty), and torch copies the gradient "
        "of input 0 into that view's slice of its base (Tensor.copy_, which broadcasts it)."), \
        text
    # (torch took the shape: its "shape compatible with" sentence is not glossed)
    assert "shape compatible with" not in text, text
    assert "Fix: " in text, text


def test_a_backward_pass_still_raises_torchs_sentence_with_the_explanation():
    x = torch.randn(3, 4, dtype=F64, requires_grad=True)
    with tv.checked():
        with pytest.raises(FunctionCheckError, match=r"Function _RowSumBackward returned an "
                           r"invalid gradient at index 0 - got \[4\]") as info:
            torch.autograd.grad(_RowSum.apply(x).sum(), x)
    assert "_RowSum.backward returned a gradient of shape (4,) at index 0" in \
        info.value.explanation
