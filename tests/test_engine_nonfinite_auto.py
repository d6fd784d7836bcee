"""strategy='auto' at a point holding a NaN or an infinity (NOTE [auto at a point it cannot
check] in torch_vjp/_engine/autoknown.py): the values check compares nothing there, but the
read of f's graph for the operators torch differentiates wrongly still decides the route,
none is remembered, and where nothing is known the one-time warning says the result went
unchecked. float64, against a loop of plain reverse products (torch.func.jacrev runs vmap,
through torch.cdist's wrong batching rule) or of forward products, on the finite entries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv
from torch_vjp._engine import fwdcheck

from _references import caught, reverse_rows

D = torch.float64
INF = float("inf")

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _forward_cols(f, x):
    """The Jacobian by one forward product per input element, without vmap."""
    cols = [torch.func.jvp(f, (x,), (e.reshape(x.shape),))[1]
            for e in torch.eye(x.numel(), dtype=D)]
    return torch.stack(cols, -1).reshape(*f(x).shape, *x.shape)


def _same(got, want):
    """Equal where ``want`` is finite, and finite in the same entries."""
    assert torch.equal(got.isfinite(), want.isfinite())
    keep = want.isfinite()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-10, atol=1e-10)


def _x(n, bad=INF, at=-1, seed=0):
    x = torch.randn(n, dtype=D, generator=torch.Generator().manual_seed(seed))
    x[at] = bad
    return x


_Y = torch.randn(3, 2, dtype=D, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("bad", [INF, float("nan")], ids=["inf", "nan"])
def test_cdist_with_an_entry_f_never_reads_not_finite(bad):
    def f(x):
        return torch.cdist(x[:4].reshape(2, 2), _Y)

    x = _x(5, bad)
    J, words = caught(lambda: tv.jacobian(f, x))
    _same(J, reverse_rows(f, x))
    assert any("batching rule for the backward of torch.cdist" in w for w in words)
    assert not fwdcheck.CHECKED  # (no route remembered from a point not checked)


def test_cdist_times_a_captured_weight_with_an_infinity():
    w = torch.ones(2, 3, dtype=D)
    w[0, 0] = INF

    def f(x):
        return torch.cdist(x.reshape(2, 2), _Y) * w

    x = _x(4, 0.3)
    J, words = caught(lambda: tv.jacobian(f, x))
    _same(J, reverse_rows(f, x))
    assert any("torch.cdist" in m for m in words)
    assert not fwdcheck.CHECKED


def test_a_later_finite_call_is_checked_and_right():
    def f(x):
        return torch.cdist(x[:4].reshape(2, 2), _Y)

    tv.jacobian(f, _x(5))
    x = _x(5, 0.4)
    _same(tv.jacobian(f, x), reverse_rows(f, x))
    assert list(fwdcheck.CHECKED.values()) == ["rev-loop"]


_S = torch.tensor(0.7, dtype=D)
_IDX = torch.tensor([[[[0, 0], [5, 5]]]])
_WRONG_ALONE = {
    "as_strided_scatter": (
        lambda x: torch.as_strided_scatter(x[:4] * x[:4], _S * x[:2], (2,), (1,), 0).sin(),
        5, "torch.as_strided_scatter"),
    "antialias": (
        lambda x: F.interpolate(x[:16].reshape(1, 1, 4, 4), size=(3, 1), mode="bilinear",
                                antialias=True),
        17, "antialias=True"),
    "max_unpool": (
        lambda x: F.max_unpool2d(x[:4].reshape(1, 1, 2, 2), _IDX, 2, output_size=(4, 4)),
        5, "max_unpool2d"),
}


@pytest.mark.parametrize("case", sorted(_WRONG_ALONE))
def test_a_wrong_backward_formula_at_a_point_not_finite(case):
    f, n, op = _WRONG_ALONE[case]
    x = _x(n)
    J, words = caught(lambda: tv.jacobian(f, x))
    _same(J, _forward_cols(f, x))
    assert any(op in w and "backward formula of it is wrong" in w for w in words)
    assert not fwdcheck.CHECKED


def test_batch_jacobian_cdist_with_an_entry_not_finite():
    def f(x):
        return torch.cdist(x[:, :4].reshape(-1, 2, 2), _Y).reshape(x.shape[0], -1)

    x = torch.randn(3, 5, dtype=D, generator=torch.Generator().manual_seed(2))
    x[1, 4] = float("nan")
    J, words = caught(lambda: tv.batch_jacobian(f, x))
    want = torch.stack([reverse_rows(lambda r: f(r[None])[0], x[i]) for i in range(3)])
    _same(J, want)
    assert any("torch.cdist" in w for w in words)


def test_the_warning_at_a_point_not_finite_says_the_values_went_unchecked_and_why():
    w = torch.ones(2, 3, dtype=D)
    w[1, 2] = INF

    def f(x):
        return torch.cdist(x[:4].reshape(2, 2), _Y)

    def g(x):
        return torch.cdist(x.reshape(2, 2), _Y) * w

    for fn, x, why in ((f, _x(5, float("nan")), "Here the point x holds a NaN or an infinity"),
                       (g, _x(4, 0.2), "Here a reverse product holds a NaN or an infinity "
                                       "(from a tensor f reads but does not differentiate")):
        _, words = caught(lambda: tv.jacobian(fn, x))
        said, = words
        assert "batching rule for the backward of torch.cdist" in said  # (what, and why)
        assert why in said  # (why nothing was compared)
        assert "the values were not compared with a reverse product (unchecked" in said
        assert "taken from f's graph alone, and is not remembered" in said
        assert "Pass strategy='rev-loop'" in said  # (the fix)


def test_no_warning_at_a_point_not_finite_where_nothing_is_known():
    def f(x):
        return x.roll(1) * x

    x = _x(3, float("nan"), at=0)
    J, words = caught(lambda: tv.jacobian(f, x))
    _same(J, reverse_rows(f, x))
    assert words == [] and not fwdcheck.CHECKED


_SCATTER_IDX = torch.tensor([0, 1, 1, 2, 2, 0, 3, 3])


def test_a_wrong_forward_formula_at_a_point_not_finite():
    def f(x):  # (5 inputs, 804 outputs: "auto" starts from forward mode)
        a = x[:4]
        y = torch.ones(4, dtype=D).scatter_reduce(0, _SCATTER_IDX, a.repeat(2), "prod",
                                                  include_self=False)
        return torch.cat([y * a.sum(), a.sin().repeat(200)])

    x = torch.rand(5, dtype=D, generator=torch.Generator().manual_seed(4)) + 0.5
    x[4] = INF
    J, words = caught(lambda: tv.jacobian(f, x))
    _same(J, reverse_rows(f, x))
    assert any("scatter_reduce" in w for w in words)
    assert not fwdcheck.CHECKED
