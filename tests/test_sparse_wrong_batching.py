"""Sparse Jacobians of functions that call an op whose backward torch batches wrongly
(torch.cdist's, as_strided_scatter's; torch 2.13), with a detected pattern: reverse mode's
products are computed one colour at a time, without vmap, with a one-time warning (NOTE
[wrong batching rules] in torch_vjp._sparse.probe)."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv
import torch_vjp._engine.wrongops as engine_wrongops
from torch_vjp._sparse import rules

_F64 = torch.float64


def _per_row(f, x):
    """The Jacobian, one autograd.grad per output element (no vmap anywhere)."""
    xx = x.detach().clone().requires_grad_(True)
    out = f(xx).reshape(-1)
    rows = [torch.autograd.grad(out[i], xx, retain_graph=True, allow_unused=True)[0]
            for i in range(out.numel())]
    return torch.stack([torch.zeros_like(xx) if r is None else r for r in rows]).reshape(
        out.numel(), x.numel())


def _calls(f, x, times=2, **kw):
    got, said = [], []
    for _ in range(times):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got.append(tv.sparse_jacobian(f, x, layout=torch.strided, **kw))
        said += [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    return got, said


_CDIST = [
    # (p, compute_mode, rows of x, rows of y, batch)
    (2.0, "use_mm_for_euclid_dist_if_necessary", 5, 4, ()),
    (1.0, "use_mm_for_euclid_dist_if_necessary", 3, 5, ()),
    (float("inf"), "donot_use_mm_for_euclid_dist", 3, 4, (2,)),
    (0.5, "donot_use_mm_for_euclid_dist", 4, 2, ()),
    (2.0, "use_mm_for_euclid_dist", 5, 2, ()),  # (matrix products: batched rightly)
]


@pytest.mark.parametrize("mode", ["rev", "auto"])
@pytest.mark.parametrize("p, compute_mode, rows, other, batch", _CDIST,
                         ids=[f"p={c[0]}-{c[1]}-{c[2]}x{c[3]}-batch{c[4]}" for c in _CDIST])
def test_cdist_with_a_detected_pattern_is_right_in_reverse_mode(
        p, compute_mode, rows, other, batch, mode, fresh_route_checks):
    # mode="rev" gathered the products of vmapped VJPs, which cdist's backward batches
    # wrongly: off by about 1, with no warning, on every call
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(*batch, other, 3, generator=gen, dtype=_F64)

    def f(x):
        return torch.cdist(x, y, p=p, compute_mode=compute_mode)

    x = torch.randn(*batch, rows, 3, generator=gen, dtype=_F64)
    want = _per_row(f, x)
    got, _ = _calls(f, x, mode=mode)
    for j in got:
        torch.testing.assert_close(j, want)


def test_cdist_in_both_arguments_and_a_sum_after_it(fresh_route_checks):
    def f(u):
        a, b = u[:4], u[4:]
        return torch.cdist(a, b, p=1.5).sum(0) + torch.cdist(b, a, p=3.0).sum(1)

    x = torch.randn(7, 2, dtype=_F64, generator=torch.Generator().manual_seed(1))
    want = _per_row(f, x)
    for j in _calls(f, x, mode="rev")[0]:
        torch.testing.assert_close(j, want)


def _per_column(f, x):
    """The Jacobian, one forward-mode product per input element (no vmap anywhere)."""
    eye = torch.eye(x.numel(), dtype=x.dtype)
    cols = [torch.func.jvp(f, (x,), (eye[j].view_as(x),))[1].reshape(-1)
            for j in range(x.numel())]
    return torch.stack(cols, 1)


_SCATTERS = [((2, 2), (1, 2), 1), ((2, 2), (4, 1), 5), ((3,), (5,), 0)]


@pytest.mark.parametrize("size, stride, offset", _SCATTERS)
def test_as_strided_scatter_into_a_tensor_from_x_is_computed_in_forward_mode(
        size, stride, offset, fresh_route_checks):
    # torch 2.13's backward of as_strided_scatter passes self's gradient inside the
    # scattered region, not outside it: reverse mode, and "auto" after its check against
    # a reverse product, returned that wrong Jacobian
    gen = torch.Generator().manual_seed(2)
    src = torch.randn(size, dtype=_F64, generator=gen)

    def f(t):
        return torch.as_strided_scatter(t.sin(), src, size, stride, offset) * 2

    x = torch.randn(4, 4, dtype=_F64, generator=gen)
    want = _per_column(f, x)
    for mode in ("auto", "fwd"):
        for j in _calls(f, x, mode=mode)[0]:
            torch.testing.assert_close(j, want)
    with pytest.raises(tv.StrategyError) as caught:
        tv.sparse_jacobian(f, x, mode="rev")
    said = str(caught.value)
    assert "mode='rev' computes the products with reverse-mode AD, and " in said
    assert (".f calls torch.as_strided_scatter on a tensor computed from x, whose backward torch "
            "computes wrongly") in said
    assert "reverse mode's products would be wrong; forward mode's are right" in said
    assert "Fix: mode='fwd' or 'auto'" in said and ".copy_(src)" in said


def test_auto_says_once_that_it_took_forward_mode(fresh_route_checks):
    src = torch.ones(2, dtype=_F64)

    def f(t):
        return torch.as_strided_scatter(t.exp(), src, (2,), (1,), 1)

    x = torch.randn(5, dtype=_F64)
    _, said = _calls(f, x, mode="auto")
    said = [w for w in said if "computed them in forward mode" in w]
    assert len(said) == 1
    assert ("calls torch.as_strided_scatter on a tensor computed from x, whose backward "
            "torch computes wrongly") in said[0]
    assert "mode='auto' computed them in forward mode" in said[0]


def test_as_strided_scatter_of_x_into_a_constant_is_right_in_reverse_mode(
        fresh_route_checks):
    # (src's gradient is right: reverse mode stays available)
    base = torch.randn(4, 4, dtype=_F64)

    def f(u):
        return torch.as_strided_scatter(base, u.exp(), (2, 2), (4, 1), 5)

    x = torch.randn(2, 2, dtype=_F64)
    want = _per_row(f, x)
    for j in _calls(f, x, mode="rev")[0]:
        torch.testing.assert_close(j, want)
    torch.testing.assert_close(want, _per_column(f, x))


def test_the_warning_says_what_was_wrong_why_and_the_fix(fresh_route_checks):
    y = torch.randn(4, 3, dtype=_F64)

    def dist(x):
        return torch.cdist(x, y, p=1.0)

    x = torch.randn(3, 3, dtype=_F64)
    _, said = _calls(dist, x, mode="rev")
    assert len(said) == 1 and "batching rule" in said[0]  # (once per function)
    assert ("dist calls torch.cdist (aten._cdist_forward), whose backward torch computes "
            "wrongly under torch.vmap (a wrong batching rule)") in said[0]
    assert "computed one colour at a time (4 products), without vmap" in said[0]
    assert "Pass chunk_size=1 to compute them that way directly" in said[0]


def test_chunk_size_one_asks_for_the_loop_and_is_not_warned(fresh_route_checks):
    y = torch.randn(4, 3, dtype=_F64)

    def f(x):
        return torch.cdist(x, y, p=1.0)

    x = torch.randn(3, 3, dtype=_F64)
    got, said = _calls(f, x, mode="rev", chunk_size=1)
    assert not said
    torch.testing.assert_close(got[0], _per_row(f, x))


def test_no_warning_where_the_op_is_on_constants_only_or_absent(fresh_route_checks):
    y = torch.randn(4, 3, dtype=_F64)
    d = torch.cdist(y, y)  # (computed outside f: a constant)

    def f(x):
        return (d @ x).sin() + torch.cdist(x, y, compute_mode="use_mm_for_euclid_dist").sum(1, True)

    x = torch.randn(4, 3, dtype=_F64)
    got, said = _calls(f, x, mode="rev")
    assert not said
    torch.testing.assert_close(got[0], _per_row(f, x))


def test_an_op_not_in_the_list_is_caught_on_the_first_call(
        monkeypatch, fresh_route_checks):
    # (the list left empty: cdist stands for an op whose batching rule is not known to be
    # wrong; the check of the first use finds it (NOTE [reverse products, checked on first
    # use] in torch_vjp._sparse.guard), and the plan's later calls loop)
    monkeypatch.setattr(rules, "WRONG_BATCHING", {})
    # (nor in the list the products' graph is read for: NOTE [reverse products read the
    # graph] in torch_vjp._sparse.guard)
    monkeypatch.setattr(engine_wrongops, "_BATCHED_WRONGLY", {})
    y = torch.randn(4, 3, dtype=_F64)

    def f(x):
        return torch.cdist(x, y, p=1.0)

    x = torch.randn(5, 3, dtype=_F64)
    want = _per_row(f, x)
    got, said = _calls(f, x, times=3, mode="rev")
    for j in got:
        torch.testing.assert_close(j, want)
    said = [w for w in said if "batching rule" in w]
    assert len(said) == 1 and "computed one colour at a time" in said[0]
    assert "calls an operator (not in the lists of ops known to be so), whose backward " \
           "torch computes wrongly under torch.vmap" in said[0]


class _NoForward(torch.autograd.Function):
    @staticmethod
    def forward(u):
        return u * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_as_strided_scatter_and_an_op_without_a_forward_formula_is_refused(
        fresh_route_checks):
    # (forward mode is the only right one, and it fails: no mode can compute it)
    src = torch.ones(2, dtype=_F64)

    def f(t):
        return torch.as_strided_scatter(_NoForward.apply(t), src, (2,), (1,), 1)

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with pytest.raises(tv.StrategyError) as caught:
            tv.sparse_jacobian(f, torch.randn(5, dtype=_F64))
    assert not [w for w in warned if "computed them in forward mode" in str(w.message)]
    said = str(caught.value)
    assert ("calls torch.as_strided_scatter on a tensor computed from x, whose backward "
            "torch computes wrongly, so its Jacobian is computed in forward mode only, and "
            "forward mode fails on it") in said
    assert "Fix: write the scatter as out = t.clone(); out.as_strided(size, stride, " in said


def test_a_users_pattern_through_as_strided_scatter_is_computed_in_forward_mode(
        fresh_route_checks):
    # (no detection run: the ops are read off f's graph; "auto" took reverse mode one
    # product at a time, which agreed with its check's reverse product, both wrong)
    src = torch.randn(2, 2, dtype=_F64, generator=_gen_for_users())

    def f(t):
        return torch.as_strided_scatter(t.sin(), src, (2, 2), (1, 2), 1)

    x = torch.randn(4, 4, dtype=_F64, generator=_gen_for_users())
    pattern = tv.jacobian_sparsity(f, x)
    want = _per_column(f, x)
    for mode in ("auto", "fwd"):
        for j in _calls(f, x, mode=mode, pattern=pattern)[0]:
            torch.testing.assert_close(j, want)
    with pytest.raises(tv.StrategyError, match="reverse mode's products would be wrong"):
        tv.sparse_jacobian(f, x, mode="rev", pattern=pattern)


def test_a_users_pattern_through_cdist_says_why_it_loops(fresh_route_checks):
    y = torch.randn(4, 3, dtype=_F64, generator=_gen_for_users())

    def f(x):
        return torch.cdist(x, y, p=1.0)

    x = torch.randn(5, 3, dtype=_F64, generator=_gen_for_users())
    got, said = _calls(f, x, mode="rev", pattern=tv.jacobian_sparsity(f, x))
    for j in got:
        torch.testing.assert_close(j, _per_row(f, x))
    said = [w for w in said if "batching rule" in w]
    assert len(said) == 1 and "calls torch.cdist (aten._cdist_forward)" in said[0]


def _gen_for_users():
    return torch.Generator().manual_seed(7)


def test_a_users_pattern_and_an_f_that_writes_into_its_input(fresh_route_checks):
    # (the graph is read through a copy of x: f's write into it must not hide cdist)
    y = torch.randn(4, 3, dtype=_F64, generator=_gen_for_users())

    def f(u):
        u.mul_(2)
        return torch.cdist(u, y, p=1.0)

    x = torch.randn(5, 3, dtype=_F64, generator=_gen_for_users())
    before = x.clone()
    pattern = tv.jacobian_sparsity(f, x.clone())
    got, said = _calls(f, x, mode="rev", pattern=pattern)
    for j in got:
        torch.testing.assert_close(j, _per_row(lambda u: f(u.clone()), x))
    assert torch.equal(x, before)
    assert [w for w in said if "calls torch.cdist (aten._cdist_forward)" in w]


def test_a_users_pattern_first_used_in_inference_mode_is_read_later(fresh_route_checks):
    # (inference mode records no graph: the ops are read on the first call outside it)
    src = torch.randn(2, dtype=_F64, generator=_gen_for_users())

    def f(t):
        return torch.as_strided_scatter(t.sin(), src, (2,), (1,), 1)

    x = torch.randn(5, dtype=_F64, generator=_gen_for_users())
    pattern = tv.jacobian_sparsity(f, x)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.sparse_jacobian(f, x, mode="fwd", pattern=pattern, layout=torch.strided)
    torch.testing.assert_close(got, _per_column(f, x))
    with pytest.raises(tv.StrategyError, match="reverse mode's products would be wrong"):
        tv.sparse_jacobian(f, x, mode="rev", pattern=pattern)
