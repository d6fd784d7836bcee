"""A function that updates a tensor it captures, and reads it (a step counter, a running
statistic), computes another function on each call. Every call of f inside one Jacobian
call starts from the tensor as the caller holds it (NOTE [every call from the caller's
state] in torch_vjp/_engine/kept.py): each strategy gives the Jacobian of the one call f
makes from the caller's state, the warning says so, and the tensor is the caller's after."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils.parametrizations import spectral_norm

import torch_vjp as tv

D = torch.float64


def _counter_f():
    g = torch.zeros(1, dtype=D)

    def f(x):
        g.add_(1.0)  # (a step counter: the call from the caller's state sees 1)
        return x * g

    return g, f


# (torch.func refuses f's write into a captured tensor: the strategies that compute such
# a function are auto's plain autograd and the loops)
@pytest.mark.parametrize("strategy", ["auto", "fwd-loop", "rev-loop"])
def test_each_column_is_of_the_call_from_the_callers_state(strategy, monkeypatch):
    from torch_vjp import _errors

    monkeypatch.setattr(_errors, "_WARNED", set())
    g, f = _counter_f()
    x = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        J = tv.jacobian(f, x, strategy=strategy)
    torch.testing.assert_close(J, torch.eye(3, dtype=D))  # (g is 1 in the one call)
    assert g.item() == 0.0
    said = [str(w.message) for w in caught
            if "changes a tensor it captures in place" in str(w.message)]
    for text in said:  # (where f was called more than once)
        assert "every call starts from the tensor as the caller holds it" in text
        assert "the Jacobian of the one call f makes from the caller's state" in text
        assert "Fix: keep f free of side effects" in text


@pytest.mark.parametrize("chunk_size", [1, 2, 3])
def test_batched_jvp_chunks_each_start_from_the_callers_state(chunk_size):
    torch.manual_seed(0)
    m = spectral_norm(torch.nn.Linear(4, 4)).double().train()
    u = m.parametrizations.weight[0]._u.clone()
    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))
    want = torch.func.jacrev(lambda t: copy.deepcopy(m)(t))(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, tan = tv.jvp(m, (x,), (torch.eye(4, dtype=D),), batched=True,
                        chunk_size=chunk_size)
    torch.testing.assert_close(tan.T, want)
    assert torch.equal(m.parametrizations.weight[0]._u, u)


def test_running_statistics_updated_by_a_kernel_are_put_back_before_each_call():
    # F.batch_norm updates its statistics in a kernel (no version bump); f reads them
    # after, so each call from a moved state would compute another function
    rm = torch.zeros(3, dtype=D)
    rv = torch.ones(3, dtype=D)

    def f(x):
        F.batch_norm(x.detach()[None].repeat(2, 1), rm, rv, training=True, momentum=0.5)
        return x * (1.0 + rm)

    x = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(2))
    want = torch.diag(1.0 + 0.5 * x)  # (rm after one call: 0.5 * x)
    for strategy in ("fwd-loop", "rev-loop", "auto"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            J = tv.jacobian(f, x, strategy=strategy)
        torch.testing.assert_close(J, want, msg=strategy)
        assert torch.equal(rm, torch.zeros(3, dtype=D))
        assert torch.equal(rv, torch.ones(3, dtype=D))


def test_a_state_moved_only_after_a_first_call_that_moved_none_is_put_back():
    # (after a first call that moves nothing, later calls are read by their versions:
    # a write that bumps one is still put back before the next call)
    from torch_vjp._engine.kept import Walked, Watched, fresh_state

    t = torch.zeros(3, dtype=D)

    def f():
        return None

    w = Walked(f, {}, None, Watched([("<captured>", t)]))
    seen = []
    with w:
        for k in range(4):
            fresh_state(f)
            seen.append(t.clone())
            if k >= 1:
                t.add_(1.0)
    assert all(torch.equal(s, torch.zeros(3, dtype=D)) for s in seen), seen
    assert torch.equal(t, torch.zeros(3, dtype=D))


def test_a_counter_moved_only_with_grad_enabled_is_put_back_before_each_call(monkeypatch):
    # auto's first call (a probe without grad) moves nothing; its later calls move the
    # counter: each still starts from the caller's value
    g = torch.zeros(1, dtype=D)

    def f(x):
        if torch.is_grad_enabled():
            g.add_(1.0)
        return x * g

    x = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(3))
    for strategy in ("auto", "fwd-loop"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            J = tv.jacobian(f, x, strategy=strategy)
        torch.testing.assert_close(J, torch.eye(3, dtype=D), msg=strategy)
        assert g.item() == 0.0
