"""vjp_fn(v, batched=True) checked once against one product without vmap (NOTE [batched
products, checked once]): torch.cdist's backward has a wrong batching rule."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv
from torch_vjp._engine import fwdcheck

D = torch.float64



def _reference(f, x, V):
    xr = x.clone().requires_grad_()
    out = f(xr)
    return torch.stack([torch.autograd.grad(out, xr, V[k], retain_graph=True)[0]
                        for k in range(V.shape[0])])


def test_batched_vjp_of_cdist_is_right_and_says_why(fresh_route_checks):
    x = torch.randn(4, 3, dtype=D)
    y = torch.randn(5, 3, dtype=D)

    def f(x):
        return torch.cdist(x, y)

    V = torch.randn(6, 4, 5, dtype=D)
    want = _reference(f, x, V)
    _, vjp_fn = tv.vjp(f, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (got,) = vjp_fn(V, batched=True)
    torch.testing.assert_close(got, want)
    said = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    assert len(said) == 1, said
    assert said[0].startswith(
        "torch_vjp.vjp: vjp_fn: the K products of batched=True (torch.vmap over the pullback) "
        "disagree with one product without vmap on ")
    assert "wrong batching rule (torch.cdist's is one)" in said[0]
    assert "Pass chunk_size=1 to compute them that way directly" in said[0]
    # later calls, from a new vjp of the same function and shapes, take the loop directly
    _, vjp_fn = tv.vjp(f, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (got,) = vjp_fn(V, batched=True)
    torch.testing.assert_close(got, want)
    assert not [w for w in caught if issubclass(w.category, tv.JacobianWarning)]
    assert list(fwdcheck.CHECKED.values()) == ["rev-loop"]


def test_batched_vjp_with_right_batching_rules_stays_vectorised(fresh_route_checks):
    W = torch.randn(5, 4, dtype=D)

    def f(x):
        return torch.tanh(W @ x)

    x = torch.randn(4, 3, dtype=D)
    V = torch.randn(7, 5, 3, dtype=D)
    _, vjp_fn = tv.vjp(f, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (got,) = vjp_fn(V, batched=True)
    torch.testing.assert_close(got, _reference(f, x, V))
    assert list(fwdcheck.CHECKED.values()) == ["rev"]


@pytest.mark.parametrize("first", ["zeros", "equal rows"])
def test_a_first_batch_that_cannot_tell_does_not_decide_the_route(fresh_route_checks, first):
    # (all-zero cotangents, a masked step, or K equal rows pass a check made of the user's
    # cotangents alone with a wrong batching rule: the check draws cotangents of its own)
    x = torch.randn(4, 3, dtype=D)
    y = torch.randn(5, 3, dtype=D)

    def f(x):
        return torch.cdist(x, y)

    V0 = (torch.zeros(6, 4, 5, dtype=D) if first == "zeros"
          else torch.randn(1, 4, 5, dtype=D).expand(6, 4, 5).clone())
    _, vjp_fn = tv.vjp(f, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        (got0,) = vjp_fn(V0, batched=True)
        torch.testing.assert_close(got0, _reference(f, x, V0))
        V = torch.randn(6, 4, 5, dtype=D)
        (got,) = vjp_fn(V, batched=True)
    torch.testing.assert_close(got, _reference(f, x, V))
    assert list(fwdcheck.CHECKED.values()) == ["rev-loop"]


def test_a_zero_jacobian_remembers_nothing(fresh_route_checks):
    # (at a point where every product is zero, no route can be told wrong: the next call,
    # at another point, checks again)
    y = torch.randn(5, 3, dtype=D)

    def f(x):
        return torch.cdist(x, y) * 0

    _, vjp_fn = tv.vjp(f, torch.randn(4, 3, dtype=D))
    (got,) = vjp_fn(torch.randn(6, 4, 5, dtype=D), batched=True)
    assert not got.any()
    assert not fwdcheck.CHECKED
