"""tv.jvp's refusal where forward mode has no formula names a jvp staticmethod as a fix for
a custom Function only: a torch operator (torch.cdist) has none to give."""

import pytest
import torch

import torch_vjp as tv
from torch_vjp import JacobianNotImplementedError


def test_torch_operator_without_forward_formula():
    x = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randn(5, 3, dtype=torch.float64)
    with pytest.raises(JacobianNotImplementedError) as info:
        tv.jvp(lambda a: torch.cdist(a, y), (x,), (torch.ones_like(x),))
    msg = str(info.value)
    assert "aten::_cdist_forward" in msg
    assert "Fix: compute with reverse mode" in msg
    assert "staticmethod" not in msg
    assert msg.rstrip().endswith("times the tangents for J t.")


def test_custom_function_without_jvp():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    x = torch.randn(3, dtype=torch.float64)
    with pytest.raises(JacobianNotImplementedError) as info:
        tv.jvp(Double.apply, (x,), (torch.ones_like(x),))
    msg = str(info.value)
    assert "custom torch.autograd.Function without a jvp staticmethod" in msg
    assert "Fix: compute with reverse mode" in msg
    assert msg.rstrip().endswith("; or give the Function a jvp staticmethod.")
