"""Checked mode, a custom backward with two mistakes: the explanation that follows torch's
sentence is about the mistake that sentence names, and the other mistake is told with it.

torch checks what a backward returned in its own order and names the first mistake it meets;
the explanation had been the check's first objection whatever torch named: torch's "returned
a gradient different than None at position 2, but the corresponding forward input was not a
Variable" came with a note about the shape of the gradient at index 0 (and a gloss of torch's
"shape compatible with" that the sentence shown did not hold), and the non-tensor input was
not explained at all.
"""

from __future__ import annotations

import pytest
import torch

import torch_vjp as tv
from torch_vjp import FunctionCheckError

F64 = torch.float64


class _ShapeAndNonTensor(torch.autograd.Function):
    """A gradient of the wrong shape for ``a``, and a tensor for the non-tensor ``flag``."""

    @staticmethod
    def forward(ctx, a, flag):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        return (g * 2).sum(0), torch.ones(3)


class _OnlyNonTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, flag):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2, torch.ones(3)


def _raised(fn, *args):
    x = torch.randn(3, 4, dtype=F64, requires_grad=True)
    with tv.checked():
        with pytest.raises(FunctionCheckError) as info:
            torch.autograd.grad(fn.apply(x, *args).sum(), x)
    return info.value


def test_the_explanation_is_about_what_torchs_sentence_names():
    err = _raised(_ShapeAndNonTensor, None)
    # torch's own sentence first, unchanged
    assert str(err).startswith(
        "function _ShapeAndNonTensorBackward returned a gradient different than None at "
        "position 2, but the corresponding forward input was not a Variable"), str(err)
    note = err.explanation
    first = note.splitlines()[0]
    assert first == ("torch_vjp.checked: _ShapeAndNonTensor.backward returned a tensor at "
                     "index 1, but forward input 1 is not a tensor."), note
    assert "Fix: return None at index 1" in note, note
    # (torch's "shape compatible with" is not in the sentence shown: no gloss of it)
    assert "shape compatible with" not in note, note


def test_the_other_mistake_is_told_with_it():
    note = _raised(_ShapeAndNonTensor, None).explanation
    assert ("_ShapeAndNonTensor.backward has more to fix: it returned a gradient of shape "
            "(4,) at index 0, but forward input 0 has shape (3, 4).") in note, note


def test_a_single_mistake_has_nothing_more_to_fix():
    err = _raised(_OnlyNonTensor, None)
    assert err.explanation.startswith("torch_vjp.checked: _OnlyNonTensor.backward returned a "
                                      "tensor at index 1"), err.explanation
    assert "more to fix" not in err.explanation, err.explanation


def test_outside_checked_mode_torch_raises_its_own_error_unchanged():
    x = torch.randn(3, 4, dtype=F64, requires_grad=True)
    with pytest.raises(RuntimeError, match="not a Variable") as info:
        torch.autograd.grad(_ShapeAndNonTensor.apply(x, None).sum(), x)
    assert not isinstance(info.value, FunctionCheckError)
