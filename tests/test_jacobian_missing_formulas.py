"""Operators torch has no formula for, as the Jacobian engine explains them: a backward
kernel without a derivative (a Hessian's reverse over reverse through fused attention on
the CPU, torch.cdist), and an operator without a forward-mode formula (a torch operator,
or a custom autograd.Function without jvp: only the latter's fix is a jvp staticmethod)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_vjp as tv

D = torch.float64
SDPA = "_scaled_dot_product_flash_attention_for_cpu"


def _attention(x):  # one head over 3 positions: the fused CPU kernel
    q = x.view(1, 1, 3, 2)
    return F.scaled_dot_product_attention(q, q, q).pow(2).sum()


def _attention_by_hand(x):  # the same, written out (an independent reference)
    q = x.view(3, 2)
    w = torch.softmax(q @ q.T / 2 ** 0.5, dim=-1)
    return (w @ q).pow(2).sum()


def _cdist(x):
    return torch.cdist(x.view(3, 2), torch.ones(2, 2, dtype=D)).pow(2).sum()


class _CubeNoJvp(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x ** 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        return 3 * ctx.saved_tensors[0] ** 2 * g


def _hessian(f, x, strategy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("auto": forward mode failed, reverse mode taken)
        return tv.hessian(f, x, strategy=strategy)


@pytest.mark.parametrize("strategy", ["auto", "rev", "rev-loop"])
def test_hessian_through_fused_attention_names_the_kernel_and_the_math_kernel(strategy):
    x = torch.randn(6, dtype=D)
    with pytest.raises(tv.StrategyNotImplementedError) as info:
        _hessian(_attention, x, strategy)
    assert isinstance(info.value, NotImplementedError)
    msg = str(info.value)
    assert msg.startswith(
        f"torch_vjp.hessian: f (_attention) uses torch's aten::{SDPA}, whose backward kernel "
        f"(aten::{SDPA}_backward) has no derivative formula in torch; a Hessian "
        f"differentiates f's gradient, which takes that derivative where the gradient is "
        f"differentiated with reverse mode (strategy='{strategy}' ")
    assert f"\n  torch said: RuntimeError: derivative for aten::{SDPA}_backward" in msg
    assert msg.endswith(
        "\n  Fix: compute attention with the math kernel, made of differentiable operations: "
        "call inside `with torch.nn.attention.sdpa_kernel("
        "torch.nn.attention.SDPBackend.MATH):` (a transformers model: load it with "
        "attn_implementation=\"eager\").")


@pytest.mark.parametrize("strategy", ["auto", "rev", "fwd", "rev-loop", "fwd-loop"])
def test_the_fix_it_names_gives_the_right_hessian(strategy):
    x = torch.randn(6, dtype=D)
    want = torch.autograd.functional.hessian(_attention_by_hand, x)
    with sdpa_kernel(SDPBackend.MATH):
        got = _hessian(_attention, x, strategy)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("strategy", ["auto", "rev", "rev-loop"])
def test_hessian_through_cdist_names_its_backward(strategy):
    # (torch declares the derivative of _cdist_backward not implemented: a
    # NotImplementedError in torch's other wording)
    x = torch.randn(6, dtype=D)
    with pytest.raises(tv.StrategyNotImplementedError) as info:
        _hessian(_cdist, x, strategy)
    msg = str(info.value)
    assert msg.startswith(
        "torch_vjp.hessian: f (_cdist) uses torch's aten::_cdist, whose backward kernel "
        "(aten::_cdist_backward) has no derivative formula in torch")
    assert ("\n  torch said: NotImplementedError: the derivative for '_cdist_backward' is not "
            "implemented") in msg
    assert msg.endswith(
        "\n  Fix: write that operation with differentiable torch operations (or as a custom "
        "autograd.Function whose backward is made of them).")


@pytest.mark.parametrize("strategy", ["auto", "rev", "rev-loop"])
def test_f_own_runtime_error_passes_through_a_hessian(strategy):
    def f(x):
        raise RuntimeError("my layer is not written yet")

    with pytest.raises(RuntimeError, match="^my layer is not written yet$") as info:
        _hessian(f, torch.randn(3, dtype=D), strategy)
    assert not isinstance(info.value, tv.TorchVJPError)


def test_only_a_backward_kernel_without_a_derivative_is_a_double_backward_refusal():
    from torch_vjp._engine.refusals import double_backward_refusal

    said = "derivative for aten::{} is not implemented"
    assert double_backward_refusal(RuntimeError(said.format(f"{SDPA}_backward"))) == SDPA
    assert double_backward_refusal(
        NotImplementedError("the derivative for '_cdist_backward' is not implemented.")
    ) == "_cdist"
    # (a first derivative torch lacks is no double backward)
    assert double_backward_refusal(RuntimeError(said.format("my_op"))) is None
    assert double_backward_refusal(ValueError(said.format("a_backward"))) is None
    assert double_backward_refusal(RuntimeError("my layer is not written yet")) is None


@pytest.mark.parametrize("strategy", ["fwd", "fwd-loop"])
def test_forward_mode_through_a_torch_operator_names_it_and_no_jvp_staticmethod(strategy):
    x = torch.randn(6, dtype=D)
    with pytest.raises(tv.StrategyNotImplementedError) as info:
        tv.jacobian(_cdist, x, strategy=strategy)
    msg = str(info.value)
    assert msg.startswith(
        f"torch_vjp.jacobian: strategy='{strategy}' computes with forward-mode AD, and an "
        f"operator in f has no forward-mode formula (torch's aten::_cdist_forward: torch "
        f"has none for it).\n  torch said: NotImplementedError: Trying to use forward AD "
        f"with _cdist_forward")
    rev = "rev" if strategy == "fwd" else "rev-loop"
    assert msg.endswith(
        f"\n  Fix: strategy='{rev}' or 'auto' (reverse mode needs only backward formulas).")
    assert "jvp staticmethod" not in msg


@pytest.mark.parametrize("strategy", ["fwd", "fwd-loop"])
def test_forward_mode_through_fused_attention_names_the_math_kernel(strategy):
    x = torch.randn(6, dtype=D)
    with pytest.raises(tv.StrategyNotImplementedError) as info:
        tv.jacobian(_attention, x, strategy=strategy)
    msg = str(info.value)
    assert (f"no forward-mode formula (torch's aten::{SDPA}: torch has none for it)."
            in msg)
    assert "jvp staticmethod" not in msg
    assert msg.endswith(
        "(reverse mode needs only backward formulas), or compute attention with the math "
        "kernel, made of differentiable operations: call inside `with "
        "torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):` (a "
        "transformers model: load it with attn_implementation=\"eager\").")
    with sdpa_kernel(SDPBackend.MATH):  # (the fix works: against jacrev of the hand-written)
        got = tv.jacobian(_attention, x, strategy=strategy)
    torch.testing.assert_close(got, torch.func.jacrev(_attention_by_hand)(x))


@pytest.mark.parametrize("strategy", ["fwd", "fwd-loop"])
def test_forward_mode_through_a_function_without_jvp_names_the_jvp_staticmethod(strategy):
    x = torch.randn(4, dtype=D)
    with pytest.raises(tv.StrategyNotImplementedError) as info:
        tv.jacobian(_CubeNoJvp.apply, x, strategy=strategy)
    msg = str(info.value)
    assert ("an operator in f has no forward-mode formula (a custom torch.autograd.Function "
            "without a jvp staticmethod).\n  torch said: NotImplementedError: You must "
            "implement the jvp function") in msg
    assert msg.endswith(
        "(reverse mode needs only backward formulas), or give the Function a jvp "
        "staticmethod.")
