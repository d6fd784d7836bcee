"""More edge cases of the Jacobian API on hostile but valid input."""

from __future__ import annotations

import pytest
import torch
import torch.func

import torch_vjp as tv

D = torch.float64


@pytest.mark.parametrize("chunk_size", [None, 1, 2, 1000], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("which", ["output", "input", "both", "twice"])
def test_jacobian_of_retain_grad_tensors_kept(which, chunk_size):
    """Outputs and inputs of jacobian_of that retain their grad come out as they went in:
    backward passes run by torch.autograd.grad write their .grad (a batched tensor under
    vmap, which escaped it)."""
    x = torch.randn(4, dtype=D, requires_grad=True)
    h = x.sin()
    y = h * h.flip(0)
    if which in ("output", "both", "twice"):
        y.retain_grad()
    if which in ("input", "both", "twice"):
        h.retain_grad()
    before = None
    if which == "twice":  # a .grad left by an earlier backward pass stays as it was
        y.backward(torch.ones_like(y), retain_graph=True)
        before = (y.grad, y.grad.clone(), h.grad, h.grad.clone())
    got = tv.jacobian_of(y, (x, h), retain_graph=True, chunk_size=chunk_size)
    ref_x = torch.func.jacrev(lambda t: t.sin() * t.sin().flip(0))(x.detach())
    ref_h = torch.func.jacrev(lambda t: t * t.flip(0))(h.detach())
    torch.testing.assert_close(got[0], ref_x)
    torch.testing.assert_close(got[1], ref_h)
    if before is None:
        assert x.grad is None
        assert all(t.grad is None for t in (y, h) if t.retains_grad)
    else:
        assert y.grad is before[0] and h.grad is before[2]
        torch.testing.assert_close(y.grad, before[1])
        torch.testing.assert_close(h.grad, before[3])


@pytest.mark.parametrize("strategy", ["rev", "fwd", "rev-loop", "fwd-loop"])
def test_memory_error_counts_in_the_dtype_it_names(strategy):
    """The size is counted at the widest dtype of inputs and outputs (never less), and the
    message names that dtype, so the bytes and the element count agree."""
    x = torch.randn(200, dtype=torch.float16)

    def f(v):
        return v.double().outer(v.double()).reshape(-1)[:300]

    with pytest.raises(tv.JacobianMemoryError,
                       match=r"needs 480 kB: 60,000 float64 elements, 300 output elements"):
        tv.jacobian(f, x, strategy=strategy, max_memory="100KB")
