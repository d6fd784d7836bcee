"""A module whose training-mode forward reads state it also updates (spectral_norm's
power-iteration vectors u and v, updated in place on every call) computes a different
function on each call of f. The Jacobian functions call f more than once (a loop's one call
per column, auto's checks, jvp's chunks, a probe of the output's size, the Hessian's
forward paths): every one of those calls starts from the caller's state (NOTE [every call
from the caller's state] in torch_vjp/_engine/kept.py), so every strategy gives the
Jacobian of the one call f makes from it, and the state is the caller's after the call.
Each internal call used to start from the state the one before left (off by 1e-4 to 3e-3,
and only "auto" said anything)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.nn.utils.parametrizations import spectral_norm

import torch_vjp as tv

D = torch.float64


def _model():
    torch.manual_seed(0)
    return spectral_norm(torch.nn.Linear(4, 4)).double().train()


def _one_call_jacobian(m, x):
    # the Jacobian of the one call f makes from the caller's state (a copy of it)
    return torch.func.jacrev(lambda t: copy.deepcopy(m)(t))(x)


@pytest.mark.parametrize("strategy", ["rev", "rev-loop"])
def test_one_call_strategies_give_the_jacobian_of_the_call_from_the_callers_state(strategy):
    m, x = _model(), torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))
    want = _one_call_jacobian(m, x)
    for _ in range(2):
        torch.testing.assert_close(tv.jacobian(m, x, strategy=strategy), want)


@pytest.mark.parametrize("call", ["jacobian-fwd-first-call", "jacobian-fwd-loop", "jacobian-auto",
                                  "batch-jacobian-fwd-loop", "jvp-batched-chunk-1"])
def test_every_internal_call_of_f_starts_from_the_callers_module_state(call):
    m, x = _model(), torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))
    want = _one_call_jacobian(m, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if call == "jacobian-fwd-first-call":  # (its output-size probe calls f first)
            got = tv.jacobian(m, x, strategy="fwd")
        elif call == "jacobian-fwd-loop":
            got = tv.jacobian(m, x, strategy="fwd-loop")
        elif call == "jacobian-auto":
            got = tv.jacobian(m, x)
        elif call == "batch-jacobian-fwd-loop":
            got = tv.batch_jacobian(m, x[None], strategy="fwd-loop")[0]
        else:
            got = tv.jvp(m, (x,), (torch.eye(4, dtype=D),), batched=True, chunk_size=1)[1].T
    torch.testing.assert_close(got, want)
    _assert_state_is_the_callers(m)


def _assert_state_is_the_callers(m):
    # (the buffers after the call are the caller's, bit for bit)
    ref = _model()
    for (n, b), (_, r) in zip(m.named_buffers(), ref.named_buffers()):
        assert torch.equal(b, r), n


@pytest.mark.parametrize("strategy", ["auto", "fwd", "fwd-loop", "rev", "rev-loop"])
def test_hessian_of_a_module_that_updates_its_state_is_that_of_one_call(strategy):
    m, x = _model(), torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))

    def f(t):
        return torch.tanh(m(t)).pow(2).sum()

    def one_call(t):
        return torch.tanh(copy.deepcopy(m)(t)).pow(2).sum()

    want = torch.func.jacfwd(torch.func.jacrev(one_call))(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.hessian(f, x, strategy=strategy)
    torch.testing.assert_close(got, want)
    _assert_state_is_the_callers(m)
