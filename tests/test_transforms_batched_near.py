"""vjp_fn(v, batched=True) at a degenerate vjp point (NOTE [batched pullback, checked near
the point] in torch_vjp/_engine/nearcheck.py): a custom op with a wrong batching rule in f's
backward agreed with the products without vmap at zeros, or multiplied by x.sum() at a
point summing to 0; "rev" was remembered, and the batched products at later vjp points were
wrong by 3.5-7.4 without a word. float64, against one torch.autograd.grad per cotangent."""

from __future__ import annotations

import pytest
import torch

import torch_vjp as tv

from _references import WrongBatched, caught

D = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _batched_products(u):
    return WrongBatched.apply(u[1:] * u[:-1]).sin() + u[1:]


def _batched_times_sum(u):
    return WrongBatched.apply(u[1:] * u[:-1]).sin() * u.sum()


def _right(u):
    return (u[1:] * u[:-1]).sin() * u.sum()


def _zeros():
    return torch.zeros(8, dtype=D)


def _summing_to_zero():
    v = torch.randn(8, dtype=D, generator=torch.Generator().manual_seed(3))
    return v - v.mean()


_X1 = torch.randn(8, dtype=D, generator=torch.Generator().manual_seed(4))
_CASES = {"zeros": (_batched_products, _zeros),
          "sum-zero": (_batched_times_sum, _summing_to_zero)}


def _per_cotangent(f, x, V):
    xx = x.detach().clone().requires_grad_(True)
    out = f(xx)
    return torch.stack([torch.autograd.grad(out, xx, V[k], retain_graph=True)[0]
                        for k in range(V.shape[0])])


@pytest.mark.parametrize("case", sorted(_CASES))
def test_a_wrong_batching_rule_is_caught_at_a_degenerate_vjp_point(case):
    f, first = _CASES[case]
    said = []
    for seed, x in enumerate((first(), _X1, first(), _X1)):
        V = torch.randn(5, 7, dtype=D, generator=torch.Generator().manual_seed(seed))
        _, vjp_fn = tv.vjp(f, x)
        (got,), words = caught(lambda: vjp_fn(V, batched=True))
        said += words
        torch.testing.assert_close(got, _per_cotangent(f, x, V))
    assert len(said) == 1
    msg = said[0]
    assert msg.startswith("torch_vjp.vjp: vjp_fn: at a point near the vjp point, the products "
                          "of batched=True (torch.vmap over the pullback)")
    assert "at the vjp point itself they agreed" in msg
    assert "has a wrong batching rule" in msg
    assert "vjp_fn returned the products computed one cotangent at a time" in msg
    assert "pass chunk_size=1" in msg


def test_right_batching_rules_at_a_degenerate_point_stay_vectorised_and_silent():
    for x in (_zeros(), _summing_to_zero(), _X1):
        V = torch.randn(5, 7, dtype=D)
        _, vjp_fn = tv.vjp(_right, x)
        (got,), words = caught(lambda: vjp_fn(V, batched=True))
        assert words == []
        torch.testing.assert_close(got, _per_cotangent(_right, x, V))


def test_a_point_without_structure_calls_f_no_more():
    calls = []

    def f(u):
        calls.append(1)
        return _batched_products(u)

    _, vjp_fn = tv.vjp(f, _X1)
    vjp_fn(torch.randn(5, 7, dtype=D), batched=True)
    assert len(calls) == 1


def test_the_near_call_puts_the_generators_back():
    def f(u):
        return torch.nn.functional.dropout(_batched_products(u), 0.25)

    torch.manual_seed(1)
    _, vjp_fn = tv.vjp(f, _zeros())
    V = torch.randn(5, 7, dtype=D)
    state = torch.get_rng_state()
    _, words = caught(lambda: vjp_fn(V, batched=True))
    assert len(words) == 1 and "at a point near the vjp point" in words[0]  # (it ran)
    assert torch.equal(torch.get_rng_state(), state)
