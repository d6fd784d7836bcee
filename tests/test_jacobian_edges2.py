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
    """The result is counted in the dtype its block has (the input's in reverse mode, the
    output's in forward mode, as torch.func gives it), and the message names that dtype, so
    the bytes and the element count agree."""
    x = torch.randn(200, dtype=torch.float16)

    def f(v):
        return v.double().outer(v.double()).reshape(-1)[:300]

    size, dtype = ("120 kB", "float16") if strategy.startswith("rev") else ("480 kB", "float64")
    assert tv.jacobian(f, x, strategy=strategy).dtype == getattr(torch, dtype)
    with pytest.raises(tv.JacobianMemoryError,
                       match=rf"needs {size}: 60,000 {dtype} elements, 300 output elements"):
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


@pytest.mark.parametrize("strategy", ["rev", "rev-loop", "fwd", "fwd-loop"])
def test_memory_plan_counts_each_block_in_its_own_dtype(strategy):
    # reverse mode: blocks in the input's dtype (float16, 80 kB); forward mode: in the
    # output's (float64, 320 kB), as torch.func.jacrev / jacfwd give them
    x = torch.randn(200, dtype=D).half()
    w = torch.randn(200, dtype=D)

    def f(x):
        return x.double() * w

    rev = strategy.startswith("rev")
    want = (torch.func.jacrev if rev else torch.func.jacfwd)(f)(x)
    budget = 200_000  # the result and one product fit in reverse mode only
    if rev:
        J = tv.jacobian(f, x, strategy=strategy, max_memory=budget)
        assert J.dtype == torch.float16
        torch.testing.assert_close(J, want)
        small = 60_000
    else:
        small = budget
    with pytest.raises(tv.JacobianMemoryError) as info:
        tv.jacobian(f, x, strategy=strategy, max_memory=small)
    kind = "float16" if rev else "float64"
    size = "80 kB" if rev else "320 kB"
    assert f"the result needs {size}" in str(info.value)
    assert f"40,000 {kind} elements" in str(info.value)


def test_memory_plan_names_no_dtype_for_blocks_of_several():
    a = torch.randn(100, dtype=D).float()
    b = torch.randn(100, dtype=D)
    with pytest.raises(tv.JacobianMemoryError) as info:
        tv.jacobian(lambda a, b: a.double() * b, a, b, argnums=(0, 1), strategy="rev",
                    max_memory=50_000)
    # 100 x 100 float32 and 100 x 100 float64
    assert "the result needs 120 kB: 20,000 elements, 100 output elements times 200" in str(
        info.value)
