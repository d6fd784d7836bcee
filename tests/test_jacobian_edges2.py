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


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_jacobian_of_leaves_retained_grads_of_its_tensors_alone(chunk_size):
    x = torch.randn(3, dtype=D, requires_grad=True)
    h = x * 2
    h.retain_grad()
    y = torch.outer(h.sin(), h)
    y.retain_grad()
    before = torch.full((3,), 7.0, dtype=D)
    h.grad = before
    want_h = torch.func.jacrev(lambda h: torch.outer(h.sin(), h))(h.detach())
    J = tv.jacobian_of(y, h, retain_graph=True, chunk_size=chunk_size)
    torch.testing.assert_close(J, want_h)
    assert h.grad is before and torch.equal(before, torch.full((3,), 7.0, dtype=D))
    assert y.grad is None
    Jy, Jh = tv.jacobian_of((y, h), x, chunk_size=chunk_size)
    torch.testing.assert_close(Jy, torch.func.jacrev(
        lambda x: torch.outer((2 * x).sin(), 2 * x))(x.detach()))
    torch.testing.assert_close(Jh, 2 * torch.eye(3, dtype=D))
    assert h.grad is before and y.grad is None and x.grad is None


class _OldStyleSquare(torch.autograd.Function):
    """x ** 2 through NumPy, with ctx in forward (no setup_context): torch.func cannot run
    it, so the Jacobian functions take plain autograd."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.x = x
        return torch.from_numpy(x.detach().numpy() ** 2)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g

    @staticmethod
    def jvp(ctx, t):
        return 2 * ctx.x * t


def _old_style(a):
    return _OldStyleSquare.apply(a) * a.exp()


def _old_style_ref(a):
    return a**2 * a.exp()


@pytest.mark.filterwarnings("ignore::torch_vjp.JacobianWarning")
@pytest.mark.parametrize("strategy", ["auto", "rev-loop", "fwd-loop"])
@pytest.mark.parametrize("inference_primal", [False, True])
def test_plain_autograd_loops_under_inference_mode(strategy, inference_primal):
    x = torch.randn(4, dtype=D)
    want = torch.func.jacrev(_old_style_ref)(x)
    with torch.inference_mode():
        xx = x.clone() if inference_primal else x
        J = tv.jacobian(_old_style, xx, strategy=strategy)
    torch.testing.assert_close(J, want)
    torch.testing.assert_close(tv.jacobian(_old_style, xx, strategy=strategy), want)


@pytest.mark.filterwarnings("ignore::torch_vjp.JacobianWarning")
def test_plain_autograd_hessian_under_inference_mode():
    x = torch.randn(4, dtype=D)
    want = torch.func.hessian(lambda a: _old_style_ref(a).sum())(x)
    with torch.inference_mode():
        H = tv.hessian(lambda a: _old_style(a).sum(), x)
        Hi = tv.hessian(lambda a: _old_style(a).sum(), x.clone())
    torch.testing.assert_close(H, want)
    torch.testing.assert_close(Hi, want)
