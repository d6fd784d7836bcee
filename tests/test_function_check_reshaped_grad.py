"""A custom backward that returns its gradient in the shape of forward's output where forward
only rearranged its input (reshape, flatten, squeeze, transpose): the message names that
rearrangement and the one fix that undoes it, in check_function and in checked mode alike.

The hint had said only "multiply grad_output by the Jacobian", the general rule, where the
mistake is recognisable from the shapes alone; and for a transposing forward a reshape, the
obvious repair, would give wrong values without an error, so the message must say which.
"""

from __future__ import annotations

import pytest
import torch

import torch_vjp as tv
from torch_vjp import FunctionCheckError, check_function

F64 = torch.float64


def _rearranging(name: str, forward_op, backward_op=None):
    """A custom Function doubling a rearranged copy of its input, whose backward returns
    ``2 * grad_output`` (put through ``backward_op``, where given)."""

    def forward(ctx, a):
        return forward_op(a) * 2

    def backward(ctx, g):
        g = g * 2
        return g if backward_op is None else backward_op(g)

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward)})


CASES = [
    # (id, input shape, forward's rearrangement, words the message must hold)
    ("flatten", (3, 4), lambda a: a.reshape(-1),
     ["(12,) is the shape of the output (and of grad_output)",
      "forward reshaped input 0", "return grad.reshape((3, 4))"]),
    ("squeeze", (1, 4), lambda a: a.squeeze(0),
     ["(4,) is the shape of the output (and of grad_output)",
      "dimensions of size 1", "return grad.reshape((1, 4))"]),
    ("unsqueeze", (4,), lambda a: a[None, :, None],
     ["(1, 4, 1) is the shape of the output", "dimensions of size 1",
      "return grad.reshape((4,))"]),
    ("transpose", (3, 4), lambda a: a.t(),
     ["(4, 3) is the shape of the output", "transposed or permuted input 0",
      "grad.mT", "grad.reshape((3, 4)) would", "wrong values"]),
    ("permute3", (2, 3, 4), lambda a: a.permute(2, 0, 1),
     ["(4, 2, 3) is the shape of the output", "transposed or permuted input 0",
      "inverse permutation", "grad.reshape((2, 3, 4)) would"]),
    ("view_other_dims", (2, 6), lambda a: a.view(3, 4),
     ["(3, 4) is the shape of the output", "forward reshaped input 0",
      "return grad.reshape((2, 6))"]),
]


@pytest.mark.parametrize("shape, op, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_check_function_names_the_rearrangement_and_its_undoing(shape, op, words):
    fn = _rearranging("Rearranged", op)
    with pytest.raises(FunctionCheckError, match=r"Rearranged\.backward returned a gradient of "
                       r"shape") as info:
        check_function(fn, torch.randn(shape, dtype=F64))
    text = str(info.value)
    for w in words:
        assert w in text, (w, text)


@pytest.mark.parametrize("shape, op, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_checked_mode_names_the_rearrangement_and_its_undoing(shape, op, words):
    fn = _rearranging("Rearranged", op)
    x = torch.randn(shape, dtype=F64, requires_grad=True)
    with tv.checked():
        with pytest.raises(FunctionCheckError, match="returned an invalid gradient at index 0") \
                as info:
            torch.autograd.grad(fn.apply(x).sum(), x)
    text = info.value.explanation
    for w in words:
        assert w in text, (w, text)


# the fix each message gives, as code: the undoing of each case's rearrangement
UNDO = {
    "flatten": lambda g: g.reshape(3, 4),
    "squeeze": lambda g: g.reshape(1, 4),
    "unsqueeze": lambda g: g.reshape(4),
    "transpose": lambda g: g.mT,
    "permute3": lambda g: g.permute(1, 2, 0),  # (the inverse of (2, 0, 1))
    "view_other_dims": lambda g: g.reshape(2, 6),
}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_fix_the_message_gives_is_right(case):
    # applied, it passes check_function against finite differences in float64
    name, shape, op, _ = case
    check_function(_rearranging("Fixed", op, UNDO[name]), torch.randn(shape, dtype=F64))


def test_a_reshape_of_a_transposed_gradient_is_wrong_values_as_the_message_says():
    # the warning's ground: reshape instead of mT passes the shape checks and fails values
    fn = _rearranging("Reshaped", lambda a: a.t(), lambda g: g.reshape(3, 4))
    with pytest.raises(FunctionCheckError, match="does not match finite differences"):
        check_function(fn, torch.randn(3, 4, dtype=F64))


def test_an_output_shaped_gradient_of_another_size_keeps_the_general_fix():
    # (3,) output of a (3, 4) input: nothing was only rearranged; the general rule stays
    fn = _rearranging("Summed", lambda a: a.sum(-1))
    with pytest.raises(FunctionCheckError) as info:
        check_function(fn, torch.randn(3, 4, dtype=F64))
    text = str(info.value)
    assert "multiply grad_output by the Jacobian d(the output)/d(input 0)" in text, text
    assert "reshape" not in text, text
