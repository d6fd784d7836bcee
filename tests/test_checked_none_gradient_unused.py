"""torch's "The differentiated Tensor at index j appears to not have been used in the graph"
where outputs do depend on the input, but a custom Function's backward on the way returned
None for it: the explanation names that Function, not a cut graph.

The explanation had said "no path of the autograd graph leads from outputs back to it" and
listed .detach(), torch.no_grad() and .item() as the usual causes: wrong for a graph with the
path, and no help for the backward that returned None.
"""

from __future__ import annotations

import pytest
import torch

import torch_vjp as tv
from torch_vjp import GradOutputsError

F64 = torch.float64


class _NoneBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        return None


def _graph(detached: bool = False):
    x = torch.randn(3, 4, dtype=F64, requires_grad=True)
    y = _NoneBack.apply(x.detach() if detached else x).sin().sum()
    return x, y


@pytest.mark.parametrize("call", ["tv.grad", "checked"])
def test_a_none_gradient_of_a_custom_backward_is_named(call):
    x, y = _graph()
    with pytest.raises(GradOutputsError, match="appears to not have been used in the graph") \
            as info:
        if call == "tv.grad":
            tv.grad(y, x)
        else:
            with tv.checked():
                torch.autograd.grad(y, x)
    note = info.value.explanation
    assert "outputs do depend on it: the autograd graph leads from outputs back to it" in note
    assert "_NoneBack.backward returned None" in note, note
    assert "no gradient reached it" in note, note
    assert "Fix: return dL/d(input) from _NoneBack.backward" in note, note
    assert "materialize_grads=True" in note, note
    assert ".detach()" not in note, note  # (the graph is not cut)


def test_a_cut_graph_keeps_its_explanation():
    x = torch.randn(3, 4, dtype=F64, requires_grad=True)
    w = torch.randn(3, 4, dtype=F64, requires_grad=True)
    y = (w * _NoneBack.apply(x.detach())).sum()  # (x reaches y only through .detach())
    with pytest.raises(GradOutputsError) as info:
        tv.grad(y, [w, x])
    note = info.value.explanation
    assert "inputs[1] (shape (3, 4)) requires grad, but outputs do not depend on it: no path " \
        "of the autograd graph leads from outputs back to it" in note, note
    assert "NoneBack" not in note, note


def test_torch_accepts_the_call_with_allow_unused_and_the_result_is_unchanged():
    x, y = _graph()
    with tv.checked():
        assert torch.autograd.grad(y, x, allow_unused=True) == (None,)
    x, y = _graph()
    with tv.checked():
        (g,) = torch.autograd.grad(y, x, materialize_grads=True)
    assert torch.equal(g, torch.zeros(3, 4, dtype=F64))


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_several_custom_functions_on_the_way_are_named_the_nearest_first():
    x = torch.randn(3, dtype=F64, requires_grad=True)
    y = _Doubled.apply(_NoneBack.apply(x)).sum()
    with pytest.raises(GradOutputsError) as info:
        tv.grad(y, x)
    assert "one of _NoneBack.backward and _Doubled.backward returned None" in \
        info.value.explanation, info.value.explanation


def test_a_deep_graph_is_walked_without_recursion():
    x = torch.randn(3, dtype=F64, requires_grad=True)
    y = _NoneBack.apply(x)
    for _ in range(5000):
        y = y * 1.0
    with pytest.raises(GradOutputsError) as info:
        tv.grad(y.sum(), x)
    assert "_NoneBack.backward returned None" in info.value.explanation
