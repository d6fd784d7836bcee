"""torch.func's refusals that reached the user raw (a custom Function without vmap support
under strategy='fwd', NumPy inside f, jvp of an operator without a forward-mode formula)
are TorchVJPErrors that name the strategy and the alternatives; f's own errors pass through
untouched."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

import torch_vjp as tv

D = torch.float64


class _CubeNoVmap(torch.autograd.Function):
    """setup_context style, with jvp, without vmap support."""

    @staticmethod
    def forward(x):
        return x ** 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.x = inputs[0]

    @staticmethod
    def backward(ctx, g):
        return 3 * ctx.saved_tensors[0] ** 2 * g

    @staticmethod
    def jvp(ctx, t):
        return 3 * ctx.x ** 2 * t


def _numpy_f(a):
    return a * torch.from_numpy(np.cos(a.detach().numpy()))


def _cdist_f(a):
    return torch.cdist(a.view(2, 2), a.view(2, 2) + 1)


def test_fwd_on_a_function_without_vmap_support_names_the_loops():
    x = torch.randn(4, dtype=D)
    with pytest.raises(tv.StrategyError) as info:
        tv.jacobian(_CubeNoVmap.apply, x, strategy="fwd")
    msg = str(info.value)
    assert msg.startswith(
        "torch_vjp.jacobian: the vectorised strategies compute with torch.func, which cannot "
        "run f (_CubeNoVmap.apply) in fwd-mode products: f uses a custom "
        "torch.autograd.Function without vmap support")
    assert "Fix: strategy='auto', 'rev-loop' or 'fwd-loop'" in msg
    # and the loop it names computes it (against torch.func.jacrev, which runs no vmap here)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.jacobian(_CubeNoVmap.apply, x, strategy="fwd-loop")
    torch.testing.assert_close(got, torch.diag(3 * x ** 2))


@pytest.mark.parametrize("strategy", ["rev", "fwd"])
def test_numpy_inside_f_names_the_loops(strategy):
    x = torch.randn(4, dtype=D)
    with pytest.raises(tv.StrategyError) as info:
        tv.jacobian(_numpy_f, x, strategy=strategy)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert re.search(r"in (rev|fwd)-mode products: f reads a tensor's memory directly \(NumPy",
                     msg), msg
    assert "Cannot access data pointer of Tensor that doesn't have storage" in msg
    assert "Fix: strategy='auto', 'rev-loop' or 'fwd-loop'" in msg


@pytest.mark.parametrize("call", ["vjp", "jvp", "jvp-batched"])
def test_numpy_inside_f_in_vjp_and_jvp_says_why(call):
    x = torch.randn(4, dtype=D)
    with pytest.raises(tv.JacobianCallError) as info:
        if call == "vjp":
            tv.vjp(_numpy_f, x)
        elif call == "jvp":
            tv.jvp(_numpy_f, (x,), (x,))
        else:
            tv.jvp(_numpy_f, (x,), (torch.eye(4, dtype=D),), batched=True)
    msg = str(info.value)
    name = call.split("-")[0]
    assert msg.startswith(f"torch_vjp.{name}: f reads a tensor's memory directly (NumPy"), msg
    assert "Fix: differentiate with plain autograd" in msg


@pytest.mark.parametrize("batched", [False, True])
def test_jvp_without_a_forward_formula_names_reverse_mode(batched):
    x = torch.randn(4, dtype=D)
    t = torch.eye(4, dtype=D) if batched else x
    with pytest.raises(tv.JacobianCallError) as info:
        tv.jvp(_cdist_f, (x,), (t,), batched=batched)
    assert isinstance(info.value, RuntimeError)
    # (torch.func.jvp raises NotImplementedError: `except NotImplementedError:` still works)
    assert isinstance(info.value, NotImplementedError)
    assert isinstance(info.value, tv.JacobianNotImplementedError)
    msg = str(info.value)
    assert msg.startswith(
        "torch_vjp.jvp: a Jacobian-vector product computes with forward-mode AD, and an "
        "operator in f has no forward-mode formula")
    assert "torch said: NotImplementedError: Trying to use forward AD with _cdist_forward" in msg
    assert ("Fix: compute with reverse mode, which needs only backward formulas: "
            "torch_vjp.vjp(f, *primals) for v^T J, or torch_vjp.jacobian(f, *primals, "
            "strategy='rev') times the tangents for J t") in msg
    # the alternative it names is right (float64, against a loop of torch.autograd.grad:
    # torch.func.jacrev shares vmap's wrong batching rule for cdist's backward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J = tv.jacobian(_cdist_f, x, strategy="rev")
    xr = x.detach().requires_grad_()
    y = _cdist_f(xr).reshape(-1)
    rows = [torch.autograd.grad(y[i], xr, retain_graph=True)[0] for i in range(y.numel())]
    torch.testing.assert_close(J, torch.stack(rows).reshape(J.shape))


@pytest.mark.parametrize("batched", [False, True])
def test_f_raising_its_own_not_implemented_error_passes_through(batched):
    def f(a):
        raise NotImplementedError("my layer is not written yet")

    x = torch.randn(4, dtype=D)
    t = torch.eye(4, dtype=D) if batched else x
    with pytest.raises(NotImplementedError, match="^my layer is not written yet$") as info:
        tv.jvp(f, (x,), (t,), batched=batched)
    assert not isinstance(info.value, tv.TorchVJPError)


def test_batched_vjp_of_a_function_without_vmap_support_still_loops():
    # (torch.vmap's own refusal: one product at a time runs the Function, so batched=True
    # falls back to its loop, as before; the check of NOTE [batched products, checked once]
    # sees the loop agree)
    x = torch.randn(4, dtype=D)
    V = torch.randn(3, 4, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (got,) = tv.vjp(_CubeNoVmap.apply, x)[1](V, batched=True)
    torch.testing.assert_close(got, V * 3 * x ** 2)


class _CubeNoJvp(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x ** 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        return 3 * ctx.saved_tensors[0] ** 2 * g


def test_jvp_of_a_function_without_jvp_is_a_not_implemented_error_as_in_torch():
    x = torch.randn(3, dtype=D)
    with pytest.raises(NotImplementedError):
        torch.func.jvp(_CubeNoJvp.apply, (x,), (x,))
    with pytest.raises(NotImplementedError) as info:  # (a fallback to reverse mode keeps working)
        tv.jvp(_CubeNoJvp.apply, (x,), (x,))
    assert isinstance(info.value, tv.JacobianCallError)
    assert "give the Function a jvp staticmethod" in str(info.value)
