"""A module whose training-mode forward reads state it also updates (spectral_norm's
power-iteration vectors u and v, updated in place on every call) computes a different
function on each call of f. The Jacobian functions call f more than once (a loop's one call
per column, auto's checks, jvp's chunks), and the module's buffers are put back only when
the call returns: each internal call starts from the state the previous one left, so the
columns of one Jacobian come from different functions. Reverse mode and vectorised forward
mode after its first call (one call of f) give the Jacobian of the call f makes from the
caller's state; vectorised forward mode's first call (a probe of the output's size calls f
first), the loops, chunk_size=1 and "auto" do not (by 1e-4 to 3e-3 here), and only "auto"
says anything.

Known defect, outside the files this test's authors may change: the fix is to restore the
saved buffers (and captured tensors) before every call of f inside a computation, not only
at its end (torch_vjp/_engine/kept.py / context.py's buffers_kept, called from
problem.py's Problem.g beside the primals' reset, and from transforms.py's jvp chunks).
Strict xfail until then."""

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


@pytest.mark.xfail(strict=True, reason="defect: internal calls of f do not start from the "
                   "caller's module state (spectral_norm's u, v move between calls)")
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
