"""Reverse mode's products checked on a plan's first use (NOTE [reverse products, checked
on first use] in torch_vjp._sparse.guard): an op not in the hand-made lists whose batching
rule is wrong, or whose backward is wrong alone, is caught on the first call."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

import _references as references

_F64 = torch.float64


class WrongBatched(references.WrongBatched):
    """2 x, whose backward calls an op with a wrong batching rule; no vmap rule of its own."""

    generate_vmap_rule = False


class WrongBackward(references.WrongBackward):
    """2 x, whose backward is wrong even without vmap (3 g); its jvp is right; no vmap rule
    of its own."""

    generate_vmap_rule = False


def _per_row(f, x):
    """The Jacobian, one torch.autograd.grad per output element (no vmap anywhere)."""
    xx = x.detach().clone().requires_grad_(True)
    out = f(xx).reshape(-1)
    rows = [torch.autograd.grad(out[i], xx, retain_graph=True)[0].reshape(-1)
            for i in range(out.numel())]
    return torch.stack(rows)


def _by_differences(f, x, h=1e-6):
    """The Jacobian by central differences, column by column (float64)."""
    cols = []
    for j in range(x.numel()):
        e = torch.zeros(x.numel(), dtype=x.dtype)
        e[j] = h
        e = e.view_as(x)
        cols.append(((f(x + e) - f(x - e)) / (2 * h)).reshape(-1))
    return torch.stack(cols, 1)


def _calls(f, x, times=2, **kw):
    got, said = [], []
    for _ in range(times):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got.append(tv.sparse_jacobian(f, x, layout=torch.strided, **kw))
        said += [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    return got, said


@pytest.mark.parametrize("mode", ["rev", "auto"])
def test_an_unlisted_wrong_batching_rule_is_caught_on_the_first_call(mode, fresh_route_checks):
    def f(u):
        return WrongBatched.apply(u[1:] * u[:-1]).sin() + u[1:]

    x = torch.randn(9, dtype=_F64, generator=torch.Generator().manual_seed(0))
    want = _per_row(f, x)
    got, said = _calls(f, x, mode=mode)
    for j in got:
        torch.testing.assert_close(j, want)
    if mode == "rev":
        told = [s for s in said if "under torch.vmap" in s]
        assert len(told) == 1
        assert "WrongBatched" in told[0] and "one colour at a time" in told[0]


def test_an_unlisted_wrong_batching_rule_with_a_users_pattern(fresh_route_checks):
    def f(u):
        return WrongBatched.apply(u.roll(1) * u).cos()

    x = torch.randn(7, dtype=_F64, generator=torch.Generator().manual_seed(1))
    want = _per_row(f, x)
    pattern = want != 0
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = tv.sparse_jacobian(f, x, pattern=pattern, mode="rev", layout=torch.strided)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", ["rev", "auto"])
def test_a_backward_wrong_alone_is_computed_in_forward_mode(mode, fresh_route_checks):
    def f(u):
        return WrongBackward.apply(u[1:] * u[:-1]).sin()

    x = torch.randn(8, dtype=_F64, generator=torch.Generator().manual_seed(2))
    want = _by_differences(f, x)
    got, said = _calls(f, x, mode=mode)
    for j in got:
        torch.testing.assert_close(j, want, atol=1e-7, rtol=1e-7)
    told = [s for s in said if "computed in forward mode" in s]
    assert len(told) == 1
    msg = told[0]
    assert "disagree with a forward-mode product and a central " \
           "difference, which agree" in msg
    assert "custom autograd.Function WrongBackward" in msg
    assert "has a backward that computes a wrong gradient" in msg
    assert "Fix: correct that op's backward" in msg and "mode='fwd'" in msg
    assert not [s for s in said if "no other route agrees" in s]


def test_right_products_are_left_as_they_are(fresh_route_checks):
    def f(u):
        return (u[2:] - 2 * u[1:-1] + u[:-2]) + u[1:-1] ** 3

    x = torch.randn(12, dtype=_F64, generator=torch.Generator().manual_seed(3))
    got, said = _calls(f, x, mode="rev")
    for j in got:
        torch.testing.assert_close(j, torch.func.jacrev(f)(x))
    assert said == []
