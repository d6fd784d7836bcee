"""A module with a full backward hook (or pre-hook), called as f, is refused by the
vectorised reverse strategy: torch wraps its inputs and outputs in BackwardHookFunction,
which torch.func cannot run. The refusal names the hook and the module, not a custom
autograd.Function of the user's, and gives fixes that work (strategy='rev-loop' or
'fwd-loop', or removing the hook), not eval mode. float64, against torch.func.jacrev of the
same module without the hook."""

import pytest
import torch

import torch_vjp as tv
from torch_vjp import StrategyError

D = torch.float64


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 2)).to(D)


def _x():
    return torch.randn(5, 3, dtype=D, generator=torch.Generator().manual_seed(2))


def _hook(calls):
    return lambda mod, grad_in, grad_out: calls.append(type(mod).__name__)


def _pre_hook(calls):
    return lambda mod, grad_out: calls.append(type(mod).__name__)


def _refusal(f, x):
    with pytest.raises(StrategyError) as info:
        tv.jacobian(f, x, strategy="rev")
    return str(info.value)


def _check_words(msg, module):
    assert f"f calls a module ({module}) with a full backward hook" in msg
    assert "BackwardHookFunction" in msg and "torch.func's transforms cannot run" in msg
    assert "register_full_backward_hook" in msg
    assert "whose forward takes ctx (no setup_context staticmethod)" not in msg
    assert "put the module in eval mode" not in msg
    assert "Fix: strategy='auto', 'rev-loop' or 'fwd-loop'" in msg
    assert "remove the hook for this call (handle.remove()" in msg
    assert "Eval mode does not remove it." in msg


@pytest.mark.parametrize("as_f", ["module", "lambda"])
@pytest.mark.parametrize("register", ["hook", "pre_hook"])
def test_the_refusal_names_the_hook_and_its_fixes_work(as_f, register):
    plain, hooked, x = _net(), _net(), _x()
    want = torch.func.jacrev(plain)(x)
    calls = []
    if register == "hook":
        handle = hooked[2].register_full_backward_hook(_hook(calls))
    else:
        handle = hooked[2].register_full_backward_pre_hook(_pre_hook(calls))
    f = hooked if as_f == "module" else (lambda v: hooked(v))
    _check_words(_refusal(f, x), "Linear")
    # the fixes the message gives: one product at a time, with the hook...
    J = tv.jacobian(f, x, strategy="rev-loop")
    torch.testing.assert_close(J, want)
    assert calls and set(calls) == {"Linear"}  # (the hook ran, once per product)
    calls.clear()
    torch.testing.assert_close(tv.jacobian(f, x, strategy="fwd-loop"), want)
    assert not calls
    # ...or without it
    handle.remove()
    torch.testing.assert_close(tv.jacobian(f, x, strategy="rev"), want)


def test_a_global_full_backward_hook_is_named_too():
    plain, x = _net(), _x()
    want = torch.func.jacrev(plain)(x)
    calls = []
    handle = torch.nn.modules.module.register_module_full_backward_hook(_hook(calls))
    try:
        msg = _refusal(plain, x)
        torch.testing.assert_close(tv.jacobian(plain, x, strategy="rev-loop"), want)
    finally:
        handle.remove()
    _check_words(msg, "Sequential")
    torch.testing.assert_close(tv.jacobian(plain, x, strategy="rev"), want)


def test_a_custom_function_of_the_users_keeps_its_words():
    class Old(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v):
            return v * 2.0

        @staticmethod
        def backward(ctx, g):
            return g * 2.0

    msg = _refusal(lambda v: Old.apply(v), _x())
    assert "custom torch.autograd.Function whose forward takes ctx" in msg
    assert "backward hook" not in msg
