"""jacobian_of through torch.utils.checkpoint: use_reentrant=False computes (against
torch.func.jacrev in float64), use_reentrant=True, which refuses torch.autograd.grad, is
explained with its fix."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import torch_vjp as tv


def _block(v):
    return v.sin() * v


@pytest.mark.parametrize("options", [{}, {"chunk_size": 1}, {"chunk_size": 2}],
                         ids=["one-chunk", "loop", "chunks-of-2"])
def test_jacobian_of_through_a_reentrant_checkpoint_is_explained(options):
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = checkpoint(_block, x, use_reentrant=True).exp()
    with pytest.raises(tv.JacobianCallError, match=(
            r"(?s)^torch_vjp\.jacobian_of: the graph of the outputs goes through "
            r"torch\.utils\.checkpoint\(\.\.\., use_reentrant=True\) \(a "
            r"CheckpointFunctionBackward node\), whose backward runs only under \.backward\(\) "
            r"without inputs=; it refuses torch\.autograd\.grad, and torch_vjp\.jacobian_of "
            r"computes the Jacobian with torch\.autograd\.grad, one backward pass per output "
            r"element, to the inputs only\.\n  Fix: checkpoint with "
            r"torch\.utils\.checkpoint\.checkpoint\(\.\.\., use_reentrant=False\).*"
            r"torch said: RuntimeError: When use_reentrant=True")) as info:
        tv.jacobian_of(y, x, **options)
    assert isinstance(info.value, RuntimeError)  # (code that caught torch's error still does)
    assert "use_reentrant=True" in str(info.value.__cause__)
    y.sum().backward()  # the graph is whole, for the backward pass that checkpoint supports
    torch.testing.assert_close(x.grad, torch.func.grad(lambda v: _block(v).exp().sum())(
        x.detach()))


def test_jacobian_of_through_a_checkpoint_without_reentrant():
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = checkpoint(_block, x, use_reentrant=False).exp()
    torch.testing.assert_close(tv.jacobian_of(y, x),
                               torch.func.jacrev(lambda v: _block(v).exp())(x.detach()),
                               rtol=1e-12, atol=1e-12)


def test_another_error_in_a_reentrant_checkpoint_graph_is_torchs_own():
    # an error that is not the checkpoint's refusal is not explained as one
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = checkpoint(_block, x, use_reentrant=True).exp()
    y.sum().backward()  # (frees the graph)
    with pytest.raises(RuntimeError) as info:
        tv.jacobian_of(y, x)
    assert not isinstance(info.value, tv.TorchVJPError)
