"""A torch op whose backward is wrong even without vmap, and which the hand-made lists do
not hold yet (NOTE [reverse products, checked on first use] in torch_vjp._sparse.guard):
the guard took forward mode only for custom Functions, and reverse mode and "auto" returned
the wrong Jacobian without a word. ``torch.as_strided_scatter``'s backward (torch 2.13) is
such an op once taken out of the lists; a write at a repeated index, whose modes differ by
convention, keeps each mode's answer (torch.func.jacrev's, torch.func.jacfwd's)."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv
import torch_vjp._engine.wrongops as engine_wrongops
from torch_vjp._sparse import rules

_F64 = torch.float64


@pytest.fixture
def unlisted(monkeypatch, fresh_route_checks):
    """torch.as_strided_scatter's wrong backward left out of every list of known ops."""
    monkeypatch.setattr(rules, "WRONG_REVERSE", {})
    monkeypatch.setattr(engine_wrongops, "_WRONG_ALONE", {})


def _by_differences(f, x, h=1e-6):
    """The Jacobian by central differences, column by column (float64)."""
    cols = []
    for j in range(x.numel()):
        e = torch.zeros(x.numel(), dtype=x.dtype)
        e[j] = h
        cols.append(((f(x + e.view_as(x)) - f(x - e.view_as(x))) / (2 * h)).reshape(-1))
    return torch.stack(cols, 1)


def _square(u):  # as many outputs as inputs: "auto" takes reverse mode on the tie
    return torch.as_strided_scatter(u * 2, u[:3] ** 2, (3,), (2,), 1)


def _tall(u):  # more outputs than inputs: "auto" takes forward mode (fewer colours)
    scattered = torch.as_strided_scatter(u[:4] * 2, u[:2] ** 2, (2,), (1,), 1)
    return torch.cat([scattered, u.sin(), u.cos() * u.roll(1)])


def _wide(u):  # fewer outputs than inputs
    return torch.as_strided_scatter(u * 2, u[:3] ** 2, (3,), (2,), 1)[:3] * u[3:6].sum()


_FUNCTIONS = {"square": _square, "tall": _tall, "wide": _wide}


def _calls(f, x, **kw):
    got, said = [], []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got.append(tv.sparse_jacobian(f, x, layout=torch.strided, **kw))
        said += [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    return got, said


@pytest.mark.parametrize("given", [False, True], ids=["detected", "users_pattern"])
@pytest.mark.parametrize("mode", ["auto", "rev", "fwd"])
@pytest.mark.parametrize("name", sorted(_FUNCTIONS))
def test_an_unlisted_wrong_torch_backward_is_computed_in_forward_mode(name, mode, given,
                                                                       unlisted):
    f = _FUNCTIONS[name]
    x = torch.randn(8, dtype=_F64, generator=torch.Generator().manual_seed(4))
    want = _by_differences(f, x)
    assert (torch.func.jacrev(f)(x) - want).abs().max() > 1.0  # (torch's backward is wrong)
    kw = {"pattern": torch.ones(want.shape, dtype=torch.bool)} if given else {}
    tv.sparse.clear_cache(f)
    got, said = _calls(f, x, mode=mode, **kw)
    for j in got:
        torch.testing.assert_close(j, want, atol=1e-7, rtol=1e-7)
    told = [s for s in said if "computed in forward mode" in s]
    assert len(told) <= 1
    if told:
        msg = told[0]
        assert "disagree with a forward-mode product and a central difference" in msg
        assert "one of torch's operators" in msg and "AsStridedScatterBackward0" in msg
        assert "Fix: write f without that op" in msg and "report it to PyTorch" in msg
        assert "mode='fwd'" in msg
        assert "correct that op's backward" not in msg  # (torch's: not the user's to fix)
    elif mode != "fwd":
        pytest.fail(f"no warning that reverse mode was replaced: {said}")


def _write_twice(u):  # out[1] is written twice (u[0]**2, then u[1]**2): no accumulation
    return (u * 1.5).index_put((torch.tensor([1, 1, 3]),), u[:3] ** 2)


def _write_twice_tall(u):
    return torch.cat([_write_twice(u), u.sin(), u.cos()])


@pytest.mark.parametrize("given", [False, True], ids=["detected", "users_pattern"])
def test_auto_keeps_the_mode_it_picked_at_a_repeated_index(given, fresh_route_checks):
    # a write at a repeated index: forward mode (and differences) give the last writer's
    # derivative, torch's backward every writer's. "auto" picked forward mode for a tall
    # Jacobian, found it disagreeing with a reverse product, and returned reverse mode's
    # answer with a warning that blamed a wrong forward-mode derivative: it keeps forward
    # mode's, as it keeps reverse mode's where it picks reverse mode (the docs page
    # "Strategies"), without a warning
    x = torch.randn(8, dtype=_F64, generator=torch.Generator().manual_seed(5))
    for f, ref in ((_write_twice_tall, torch.func.jacfwd), (_write_twice, torch.func.jacrev)):
        want = ref(f)(x)
        kw = {"pattern": torch.ones(want.shape, dtype=torch.bool)} if given else {}
        tv.sparse.clear_cache(f)
        got, said = _calls(f, x, **kw)
        for j in got:
            torch.testing.assert_close(j, want)
        assert said == []


@pytest.mark.parametrize("mode, ref", [("rev", torch.func.jacrev), ("fwd", torch.func.jacfwd)])
def test_a_repeated_index_keeps_each_explicit_modes_convention(mode, ref, fresh_route_checks):
    x = torch.randn(8, dtype=_F64, generator=torch.Generator().manual_seed(6))
    for f in (_write_twice, _write_twice_tall):
        tv.sparse.clear_cache(f)
        got, said = _calls(f, x, mode=mode)
        for j in got:
            torch.testing.assert_close(j, ref(f)(x))
        assert said == []


def _resize(v):  # torch 2.13's backward of an antialiased resize with a scale_factor is wrong
    return torch.nn.functional.interpolate(v.reshape(1, 1, 6, 1), scale_factor=(1.95, 1.27),
                                           mode="bilinear", antialias=True).flatten()


def test_an_antialiased_resize_is_computed_in_forward_mode(fresh_route_checks):
    # (known to the list of ops torch differentiates wrongly, which reverse mode's products
    # read their graph for: NOTE [reverse products read the graph] in
    # torch_vjp._sparse.guard; "auto" takes forward mode, mode="rev" is refused)
    x = torch.randn(6, dtype=_F64, generator=torch.Generator().manual_seed(7))
    want = _by_differences(_resize, x)
    torch.testing.assert_close(torch.func.jacfwd(_resize)(x), want)
    assert (torch.func.jacrev(_resize)(x) - want).abs().max() > 0.5
    tv.sparse.clear_cache(_resize)
    got, said = _calls(_resize, x, mode="auto")
    for j in got:
        torch.testing.assert_close(j, want, atol=1e-7, rtol=1e-7)
    told = [s for s in said if "computed in forward mode" in s]
    assert len(told) == 1
    assert ("reverse mode's products of _resize disagree with a forward-mode product and a "
            "central difference, which agree: torch.nn.functional.interpolate(mode='bilinear', "
            "antialias=True) has a backward that computes a wrong gradient") in told[0]
    assert "Fix: resize with antialias=False, whose backward is right (or pass mode='fwd'" \
        in told[0]
    tv.sparse.clear_cache(_resize)
    with pytest.raises(tv.StrategyError, match=r"mode='rev' computes the products with "
                                               r"reverse-mode AD, and _resize calls "
                                               r"torch\.nn\.functional\.interpolate"):
        tv.sparse_jacobian(_resize, x, mode="rev")
