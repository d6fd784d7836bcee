"""Reverse mode's products read the graph their own call of f builds for the operators
torch differentiates wrongly (torch 2.13: the antialiased resize's backward in some of its
resizes, torch.as_strided_scatter's; torch.cdist's batching rule), on every call (NOTE
[reverse products read the graph] in torch_vjp._sparse.guard). The first-use check compares
values at the first call's point only: at a point where the wrong products and the right
ones agree (zeros, a factor ``x.sum()`` that is 0 there), the route was kept, and every
later call was wrong by up to 3.5 at a scale of one, without a word; a user's pattern served
a function whose graph took the resize at a later call only, wrong by 0.77.
float64, against torch.func.jvp columns (forward mode, whose formula is right) and central
differences."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv

from _references import caught, central_difference, jvp_columns

D = torch.float64

# (each test sees its own first call: conftest's fresh_route_checks)
pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _flat(f, x):
    return jvp_columns(f, x).reshape(-1, x.numel())


def _squared_down(kind):  # one column wide, its height resampled: torch's backward is wrong
    def f(x):
        return F.interpolate((x * x).reshape(1, 1, 12, 1), size=(5, 1), mode=kind,
                             antialias=True).reshape(-1)
    return f


def _times_sum(kind):
    def f(x):
        y = F.interpolate(x.reshape(1, 1, 12, 1), size=(5, 1), mode=kind, antialias=True)
        return (y * x.sum()).reshape(-1)
    return f


def _scaled_sin(kind):  # a dimension kept at its size under a scale_factor other than 1
    def f(x):
        return F.interpolate(x.reshape(1, 1, 3, 3), scale_factor=(1.6, 1.27), mode=kind,
                             antialias=True).reshape(-1).sin()
    return f


def _zeros(n):
    return torch.zeros(n, dtype=D)


def _summing_to_zero(n):
    v = torch.randn(n, dtype=D, generator=torch.Generator().manual_seed(5))
    return v - v.mean()


# (name, f, a first point where the wrong reverse products and the right ones agree)
_DEGENERATE = {
    "squared-zeros": (_squared_down, _zeros, 12),
    "times-sum-zero": (_times_sum, _summing_to_zero, 12),
    "sin-half-pi": (_scaled_sin, lambda n: torch.full((n,), torch.pi / 2, dtype=D), 9),
}


def _random(n, seed=6):
    return torch.randn(n, dtype=D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("given", [False, True], ids=["detected", "users_pattern"])
@pytest.mark.parametrize("kind", ["bilinear", "bicubic"])
@pytest.mark.parametrize("case", sorted(_DEGENERATE))
def test_auto_is_right_at_a_later_point_after_a_degenerate_first_one(case, kind, given):
    make, first_point, n = _DEGENERATE[case]
    f = make(kind)
    x0, x1 = first_point(n), _random(n)
    want1 = _flat(f, x1)
    torch.testing.assert_close(want1, central_difference(f, x1).reshape(-1, n))
    assert (torch.func.jacrev(f)(x1).reshape(-1, n) - want1).abs().max() > 0.05  # (torch's)
    kw = {"pattern": (want1 != 0) | (_flat(f, _random(n, 7)) != 0)} if given else {}
    tv.sparse.clear_cache(f)
    for x in (x0, x1, x0, x1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tv.JacobianWarning)
            got = tv.sparse_jacobian(f, x, layout=torch.strided, **kw)
        torch.testing.assert_close(got, _flat(f, x))


@pytest.mark.parametrize("given", [False, True], ids=["detected", "users_pattern"])
@pytest.mark.parametrize("case", sorted(_DEGENERATE))
def test_mode_rev_through_a_wrong_resize_is_refused_at_a_degenerate_first_point(case, given):
    make, first_point, n = _DEGENERATE[case]
    f = make("bilinear")
    x0 = first_point(n)
    kw = {"pattern": torch.ones(len(f(x0)), n, dtype=torch.bool)} if given else {}
    tv.sparse.clear_cache(f)
    for x in (x0, _random(n)):
        with pytest.raises(tv.StrategyError) as err:
            tv.sparse_jacobian(f, x, mode="rev", **kw)
        msg = str(err.value)
        assert msg.startswith("torch_vjp.sparse_jacobian: mode='rev' computes the products "
                              "with reverse-mode AD, and ")
        assert (".f calls torch.nn.functional.interpolate(mode='bilinear', antialias=True), "
                "whose backward torch computes wrongly (torch 2.13: for the input resized, "
                "where the output is one column wide and its height is resampled, or where a "
                "dimension keeps its size under a scale_factor other than 1), so reverse "
                "mode's products would be wrong; forward mode's are right.") in msg
        assert msg.endswith("Fix: mode='fwd' or 'auto' (forward mode), or resize with "
                            "antialias=False, whose backward is right.")
    # (the fixes it names compute the right Jacobian)
    x1 = _random(n)
    torch.testing.assert_close(
        tv.sparse_jacobian(f, x1, mode="fwd", layout=torch.strided, **kw), _flat(f, x1))
    got, said = caught(lambda: tv.sparse_jacobian(f, x1, layout=torch.strided, **kw))
    torch.testing.assert_close(got, _flat(f, x1))


def test_auto_says_once_that_it_computed_in_forward_mode():
    f = _squared_down("bicubic")
    tv.sparse.clear_cache(f)
    _, said = caught(lambda: tv.sparse_jacobian(f, _zeros(12)))
    told = [s for s in said if "interpolate(mode='bicubic', antialias=True)" in s]
    assert len(told) == 1
    msg = told[0]
    assert msg.startswith("torch_vjp.sparse_jacobian: _squared_down.<locals>.f calls "
                          "torch.nn.functional.interpolate(mode='bicubic', antialias=True), "
                          "whose backward torch computes wrongly (torch 2.13: for the input "
                          "resized")
    assert "mode='auto' computed them in forward mode" in msg
    _, said = caught(lambda: tv.sparse_jacobian(f, _random(12)))
    assert said == []


@pytest.mark.parametrize("mode", ["auto", "rev"])
def test_a_users_pattern_whose_function_takes_the_resize_later(mode):
    # (the graph changes between calls that share the key: a flag in a dict; the probe of
    # later calls compares the vectorised products with one of the same call, and a formula
    # wrong alone agrees with itself)
    cfg = {"aa": False}

    def f(x):
        y = F.interpolate((x * x).reshape(1, 1, 12, 1), size=(5, 1), mode="bilinear",
                          antialias=cfg["aa"])
        return y.reshape(-1)

    pattern = torch.ones(5, 12, dtype=torch.bool)
    x = _random(12)
    for _ in range(2):
        got = tv.sparse_jacobian(f, x, pattern=pattern, mode=mode, layout=torch.strided)
        torch.testing.assert_close(got, _flat(f, x))
    cfg["aa"] = True
    for _ in range(2):
        if mode == "rev":
            with pytest.raises(tv.StrategyError, match=r"mode='rev' computes the products "
                                                       r"with reverse-mode AD, and .*f calls "
                                                       r"torch\.nn\.functional\.interpolate"):
                tv.sparse_jacobian(f, x, pattern=pattern, mode=mode)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", tv.JacobianWarning)
                got = tv.sparse_jacobian(f, x, pattern=pattern, mode=mode,
                                         layout=torch.strided)
            torch.testing.assert_close(got, _flat(f, x))


def test_a_users_pattern_whose_function_takes_cdist_later():
    # (torch.cdist's batching rule is wrong: first taken at a call whose point makes the
    # vectorised products agree with the probe's, x.sum() == 0)
    cfg = {"cdist": False}
    y = torch.randn(5, 3, dtype=D, generator=torch.Generator().manual_seed(8))

    def f(x):
        a = x.reshape(4, 3)
        d = torch.cdist(a, y) if cfg["cdist"] else a @ y.T
        return (d * x.sum()).reshape(-1)

    pattern = torch.ones(20, 12, dtype=torch.bool)

    def rows(x):  # one torch.autograd.grad per output element: no vmap anywhere
        xx = x.clone().requires_grad_(True)
        out = f(xx)
        return torch.stack([torch.autograd.grad(out[i], xx, retain_graph=True)[0]
                            for i in range(out.numel())])

    x1 = _random(12)
    for x in (x1, x1):
        torch.testing.assert_close(tv.sparse_jacobian(f, x, pattern=pattern, mode="rev",
                                                      layout=torch.strided), rows(x))
    cfg["cdist"] = True
    for x in (_summing_to_zero(12), x1, _random(12, 9)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tv.JacobianWarning)
            got = tv.sparse_jacobian(f, x, pattern=pattern, mode="rev", layout=torch.strided)
        torch.testing.assert_close(got, rows(x))
