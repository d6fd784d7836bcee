"""The first-use check of reverse mode's products (NOTE [reverse products, checked on first
use] in torch_vjp._sparse.guard) at a point where a wrong backward agrees with the right
one: a custom autograd.Function whose backward is wrong (or whose backward's batching rule
is wrong), at zeros, or multiplied by ``x.sum()`` at a point summing to 0, passed the check,
the route was kept, and every later call was wrong by 1.7-4 at a scale of one, without a
word. The check is run at a point
near x too (NOTE [checked near the point]). float64, against torch.func.jvp columns."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

from _references import WrongBackward, WrongBatched, jvp_columns

D = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _products(u):
    return WrongBackward.apply(u[1:] * u[:-1]).sin()


def _times_sum(u):
    return WrongBackward.apply(u[1:] * u[:-1]).sin() * u.sum()


def _zeros():
    return torch.zeros(8, dtype=D)


def _summing_to_zero():
    v = torch.randn(8, dtype=D, generator=torch.Generator().manual_seed(3))
    return v - v.mean()


_CASES = {"zeros": (_products, _zeros), "sum-zero": (_times_sum, _summing_to_zero)}


def _flat(f, x):
    return jvp_columns(f, x).reshape(-1, x.numel())


@pytest.mark.parametrize("given", [False, True], ids=["detected", "users_pattern"])
@pytest.mark.parametrize("mode", ["rev", "auto"])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_a_wrong_backward_is_caught_at_a_degenerate_first_point(case, mode, given):
    f, first = _CASES[case]
    x1 = torch.randn(8, dtype=D, generator=torch.Generator().manual_seed(4))
    kw = {"pattern": _flat(f, x1) != 0} if given else {}
    tv.sparse.clear_cache(f)
    said = []
    for x in (first(), x1, first(), x1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = tv.sparse_jacobian(f, x, mode=mode, layout=torch.strided, **kw)
        said += [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
        torch.testing.assert_close(got, _flat(f, x))
    told = [s for s in said if "computed in forward mode" in s]
    assert len(told) == 1 and "custom autograd.Function WrongBackward" in told[0]


def test_a_right_function_at_zeros_is_left_as_it_is():
    def f(u):
        return (u[1:] * u[:-1]).sin() * u.sum() + u[1:].log1p()

    x1 = torch.rand(8, dtype=D, generator=torch.Generator().manual_seed(5))
    tv.sparse.clear_cache(f)
    for x in (_zeros(), x1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = tv.sparse_jacobian(f, x, mode="rev", layout=torch.strided)
        assert not [w for w in caught if issubclass(w.category, tv.JacobianWarning)]
        torch.testing.assert_close(got, _flat(f, x))


def _batched_products(u):
    return WrongBatched.apply(u[1:] * u[:-1]).sin() + u[1:]


def _batched_times_sum(u):
    return WrongBatched.apply(u[1:] * u[:-1]).sin() * u.sum()


def _per_row(f, x):
    """The Jacobian, one torch.autograd.grad per output element (no vmap anywhere)."""
    xx = x.detach().clone().requires_grad_(True)
    out = f(xx).reshape(-1)
    return torch.stack([torch.autograd.grad(out[i], xx, retain_graph=True)[0]
                        for i in range(out.numel())])


_BATCHED = {"zeros": (_batched_products, _zeros),
            "sum-zero": (_batched_times_sum, _summing_to_zero)}


@pytest.mark.parametrize("given", [False, True], ids=["detected", "users_pattern"])
@pytest.mark.parametrize("mode", ["rev", "auto"])
@pytest.mark.parametrize("case", sorted(_BATCHED))
def test_a_wrong_batching_rule_is_caught_at_a_degenerate_first_point(case, mode, given):
    # (the probe of later calls computes its row in the same vectorised call: a rule wrong
    # by a factor agrees with itself there)
    f, first = _BATCHED[case]
    x1 = torch.randn(8, dtype=D, generator=torch.Generator().manual_seed(4))
    kw = {"pattern": _per_row(f, x1) != 0} if given else {}
    tv.sparse.clear_cache(f)
    for x in (first(), x1, x1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tv.JacobianWarning)
            got = tv.sparse_jacobian(f, x, mode=mode, layout=torch.strided, **kw)
        torch.testing.assert_close(got, _per_row(f, x))


@pytest.mark.parametrize("outside", ["raises", "integer"])
def test_a_function_defined_near_x_only_is_computed_at_x(outside):
    # (the point near x is not one the caller passed: what f does there is not an error of
    # the call; x's check stands)
    def f(u):
        if bool((u.abs() > 1.5).any()):
            if outside == "raises":
                raise ValueError("outside the domain")
            return u.round().long()
        return (u[1:] * u[:-1]).sin()

    x = torch.full((8,), 1.4, dtype=D)
    tv.sparse.clear_cache(f)
    for mode in ("rev", "auto"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = tv.sparse_jacobian(f, x, mode=mode, layout=torch.strided)
        # (the one warning: a pattern shaped by a branch on x's values)
        said = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
        assert all("depends on the values of x" in s for s in said)
        torch.testing.assert_close(got, _flat(f, x))
