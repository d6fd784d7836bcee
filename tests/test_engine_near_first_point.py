"""strategy="auto"'s route check at a degenerate first point (NOTE [auto, checked near the
point] in torch_vjp._engine.nearcheck): a custom autograd.Function whose backward is wrong
(or calls an op whose batching rule is wrong by a factor) agrees with the right one at
zeros, or multiplied by ``x.sum()`` at a point summing to 0; the check passed, the route was
remembered, and every later call was wrong by 1.8-3.5 (batch_jacobian by 2.6), without a
word. float64, against torch.func.jvp columns and a per-row autograd loop."""

from __future__ import annotations

import pytest
import torch

import torch_vjp as tv
from torch_vjp._engine import fwdcheck

from _references import WrongBackward, WrongBatched, caught, jvp_columns

D = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _products(u):
    return WrongBackward.apply(u[1:] * u[:-1]).sin()


def _times_sum(u):
    return WrongBackward.apply(u[1:] * u[:-1]).sin() * u.sum()


def _batched_products(u):
    return WrongBatched.apply(u[1:] * u[:-1]).sin() + u[1:]


def _batched_times_sum(u):
    return WrongBatched.apply(u[1:] * u[:-1]).sin() * u.sum()


def _zeros():
    return torch.zeros(8, dtype=D)


def _summing_to_zero():
    v = torch.randn(8, dtype=D, generator=torch.Generator().manual_seed(3))
    return v - v.mean()


def _per_row(f, x):
    """The Jacobian, one torch.autograd.grad per output element (no vmap anywhere)."""
    xx = x.detach().clone().requires_grad_(True)
    out = f(xx).reshape(-1)
    rows = [torch.autograd.grad(out[i], xx, retain_graph=True)[0] for i in range(out.numel())]
    return torch.stack(rows).reshape(*out.shape, *x.shape)


_X1 = torch.randn(8, dtype=D, generator=torch.Generator().manual_seed(4))

_ALONE = {"zeros": (_products, _zeros), "sum-zero": (_times_sum, _summing_to_zero)}
_BATCHED = {"zeros": (_batched_products, _zeros),
            "sum-zero": (_batched_times_sum, _summing_to_zero)}


@pytest.mark.parametrize("case", sorted(_ALONE))
def test_a_wrong_backward_is_caught_at_a_degenerate_first_point(case):
    f, first = _ALONE[case]
    said = []
    for x in (first(), _X1, first(), _X1):
        got, words = caught(lambda: tv.jacobian(f, x, strategy="auto"))
        said += words
        torch.testing.assert_close(got, jvp_columns(f, x))
    assert len(said) == 1
    assert "disagrees with a forward product and a central difference" in said[0]
    assert "at a point near x" in said[0] and "strategy='fwd'" in said[0]


@pytest.mark.parametrize("case", sorted(_BATCHED))
def test_a_wrong_batching_rule_is_caught_at_a_degenerate_first_point(case):
    f, first = _BATCHED[case]
    said = []
    for x in (first(), _X1, _X1):
        got, words = caught(lambda: tv.jacobian(f, x, strategy="auto"))
        said += words
        torch.testing.assert_close(got, _per_row(f, x))
    assert len(said) == 1
    assert "rev-loop" in fwdcheck.CHECKED.values()


def test_the_batching_warning_says_what_why_and_the_fix():
    f, first = _BATCHED["zeros"]
    _, said = caught(lambda: tv.jacobian(f, first(), strategy="auto"))
    assert len(said) == 1
    words = said[0]
    assert words.startswith("torch_vjp.jacobian: at a point near x, a reverse product of "
                            "_batched_products computed under torch.vmap disagrees with the "
                            "same product without vmap")
    assert "at x itself they agreed" in words and "wrong batching rule" in words
    assert "one reverse product at a time, without vmap" in words
    assert "Fix the batching rule" in words and "strategy='rev-loop'" in words


def test_batch_jacobian_through_a_wrong_backward_at_zeros():
    def f(xb):
        return WrongBackward.apply(xb[:, 1:] * xb[:, :-1]).sin()

    x1 = torch.randn(3, 8, dtype=D, generator=torch.Generator().manual_seed(6))
    for x in (torch.zeros(3, 8, dtype=D), x1):
        got, _ = caught(lambda: tv.batch_jacobian(f, x, strategy="auto"))
        want = torch.stack([jvp_columns(lambda r: f(r[None])[0], r) for r in x])
        torch.testing.assert_close(got, want)


def test_batch_jacobian_through_a_wrong_batching_rule_at_zeros():
    def f(xb):
        return WrongBatched.apply(xb[:, 1:] * xb[:, :-1]).sin() + xb[:, 1:]

    x1 = torch.randn(3, 8, dtype=D, generator=torch.Generator().manual_seed(6))
    for x in (torch.zeros(3, 8, dtype=D), x1):
        got, _ = caught(lambda: tv.batch_jacobian(f, x, strategy="auto"))
        want = torch.stack([_per_row(lambda r: f(r[None])[0], r) for r in x])
        torch.testing.assert_close(got, want)


def test_a_right_function_at_zeros_is_left_as_it_is():
    def f(u):
        return (u[1:] * u[:-1]).sin() * u.sum() + u[1:].log1p() + torch.relu(u[1:])

    x1 = torch.rand(8, dtype=D, generator=torch.Generator().manual_seed(5))
    for x in (_zeros(), x1):
        got, said = caught(lambda: tv.jacobian(f, x, strategy="auto"))
        assert not said
        torch.testing.assert_close(got, jvp_columns(f, x))
    assert set(fwdcheck.CHECKED.values()) == {"rev"}


@pytest.mark.parametrize("outside", ["raises", "integer", "nan"])
def test_a_function_defined_near_x_only_is_computed_at_x(outside):
    # (the point near x is not one the caller passed: what f does there is no error of the
    # call; x's check stands)
    def f(u):
        if bool((u.abs() > 1.5).any()):
            if outside == "raises":
                raise ValueError("outside the domain")
            if outside == "integer":
                return u.round().long()[1:]
            return (u[1:] * u[:-1]).sin() * float("nan")
        return (u[1:] * u[:-1]).sin()

    x = torch.full((8,), 1.4, dtype=D)
    got, said = caught(lambda: tv.jacobian(f, x, strategy="auto"))
    assert not said
    torch.testing.assert_close(got, jvp_columns(f, x))
    assert set(fwdcheck.CHECKED.values()) == {"rev"}


def test_only_the_first_call_per_key_checks_near_x(monkeypatch):
    from torch_vjp._engine import nearcheck

    calls = []
    near = nearcheck.near_sides

    def counted(*args, **kwargs):
        calls.append(1)
        return near(*args, **kwargs)

    monkeypatch.setattr("torch_vjp._engine.revcheck.near_sides", counted)

    def f(u):
        return (u[1:] * u[:-1]).sin()

    for x in (_zeros(), _X1, _zeros(), _X1):
        torch.testing.assert_close(tv.jacobian(f, x, strategy="auto"), jvp_columns(f, x))
    assert len(calls) == 1


def test_the_users_input_is_left_as_it_was():
    f, first = _ALONE["zeros"]
    x = first()
    kept = x.clone()
    caught(lambda: tv.jacobian(f, x, strategy="auto"))
    assert torch.equal(x, kept)


def test_a_point_drawn_at_random_is_not_checked_again(monkeypatch):
    # (no coincidence to hide a wrong formula: the first call costs what it did)
    calls = []
    monkeypatch.setattr("torch_vjp._engine.revcheck.near_sides",
                        lambda *args, **kwargs: calls.append(1))

    def f(u):
        return (u[1:] * u[:-1]).sin()

    torch.testing.assert_close(tv.jacobian(f, _X1, strategy="auto"), jvp_columns(f, _X1))
    assert not calls


@pytest.mark.parametrize("name", ["zeros", "ones", "one zero", "integers", "centred",
                                  "centred rows", "random"])
def test_the_points_that_are_checked_again(name):
    from torch_vjp._engine.nearcheck import structured

    r = torch.randn(4, 6, dtype=D, generator=torch.Generator().manual_seed(8))
    points = {"zeros": torch.zeros(4, 6, dtype=D), "ones": torch.ones(4, 6, dtype=D),
              "one zero": torch.cat([r.reshape(-1)[1:], torch.zeros(1, dtype=D)]),
              "integers": torch.arange(24, dtype=D).reshape(4, 6) % 5,
              "centred": r - r.mean(), "centred rows": r - r.mean(0), "random": r}
    assert structured([points[name]]) == (name != "random")
