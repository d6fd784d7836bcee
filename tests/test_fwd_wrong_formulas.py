"""Forward mode through a forward-mode formula torch (2.13) has wrong (NOTE [forward mode
through a wrong formula] in torch_vjp/_engine/fwd_wrong.py): torch.scatter_reduce's with
reduce='prod' (the source; the tensor scattered into with include_self=True) and
torch.triangular_solve's for its matrix. torch_vjp.jvp returned J t wrong by the size of
its entries, batched or not, at random points and at points holding zeros, without a word;
it now computes it by reverse over reverse there (NOTE [J t by reverse over reverse]), with
a one-time warning; a named forward strategy refuses, naming reverse mode. float64, against
a per-row torch.autograd.grad loop (no forward mode, no vmap)."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64
IDX = torch.tensor([0, 1, 1, 2, 2, 0, 3, 3] * 8)  # (64 -> 4)

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _per_row(f, *xs):
    """The Jacobian of f's flat output by each flat input, one backward per output row."""
    xx = [x.detach().clone().requires_grad_(True) for x in xs]
    out = f(*xx).reshape(-1)
    rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(out[i], xx,
                                                                  retain_graph=True)])
            for i in range(out.numel())]
    return torch.stack(rows)


def _point(kind, n=64, seed=0):
    x = torch.rand(n, dtype=D, generator=torch.Generator().manual_seed(seed)) + 0.5
    if kind == "zeros":
        x[[3, 10, 17]] = 0.0
    return x


def _scatter(include_self):
    def f(a):
        return torch.full((4,), 1.5, dtype=D).scatter_reduce(
            0, IDX, a, "prod", include_self=include_self)
    return f


@pytest.mark.parametrize("include_self", [False, True])
@pytest.mark.parametrize("kind", ["random", "zeros"])
def test_torchs_own_forward_formula_is_wrong_here(include_self, kind):
    # (the premise: if torch fixes its formula, the entry in WRONG_FORWARD is to go)
    f, x = _scatter(include_self), _point(kind)
    t = torch.randn(64, dtype=D, generator=torch.Generator().manual_seed(1))
    wrong = torch.func.jvp(f, (x,), (t,))[1]
    assert (wrong - _per_row(f, x) @ t).abs().max() > 1e-3


@pytest.mark.parametrize("include_self", [False, True])
@pytest.mark.parametrize("kind", ["random", "zeros"])
@pytest.mark.parametrize("batched", [False, True])
def test_jvp_through_scatter_prod_is_computed_by_reverse_mode(include_self, kind, batched):
    f, x = _scatter(include_self), _point(kind)
    t = torch.randn(*((5,) if batched else ()), 64, dtype=D)
    if kind == "zeros":  # (two zeros scattered to one position: no double backward)
        with pytest.raises(tv.JacobianCallError) as info:
            tv.jvp(f, (x,), (t,), batched=batched)
        msg = str(info.value)
        assert msg.startswith("torch_vjp.jvp: torch's forward-mode formula of "
                              "torch.scatter_reduce(reduce='prod') is wrong for the source")
        assert ("torch cannot differentiate a backward formula in f (_scatter.<locals>.f) "
                "at this point, so neither mode can compute J t here") in msg
        assert ("torch said: RuntimeError: scatter_reduce(): Double backward is "
                "unsupported") in msg
        assert "or take J t from finite differences at this point" in msg
        return
    with pytest.warns(tv.JacobianWarning) as rec:
        out, jt = tv.jvp(f, (x,), (t,), batched=batched)
    msg = " ".join(str(w.message) for w in rec if w.category is tv.JacobianWarning)
    assert msg.startswith("torch_vjp.jvp: torch's forward-mode formula of "
                          "torch.scatter_reduce(reduce='prod') is wrong for the source")
    assert "so J t was computed by reverse over reverse instead" in msg
    assert torch.equal(out, f(x))
    torch.testing.assert_close(jt, t @ _per_row(f, x).T if batched else _per_row(f, x) @ t)


def test_the_route_is_remembered_and_right_at_later_points():
    f = _scatter(False)
    for seed in range(3):
        x = _point("random", seed=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tv.JacobianWarning)
            _, jt = tv.jvp(f, (x,), (torch.ones(64, dtype=D),))
        torch.testing.assert_close(jt, _per_row(f, x).sum(1))


def test_a_right_formula_of_the_same_operator_is_computed():
    # (include_self=False: the tensor scattered into has a right tangent; other reductions)
    src = _point("random")

    def into(s):
        return s.scatter_reduce(0, IDX, src, "prod", include_self=False) * 2

    def summed(a):
        return torch.ones(4, dtype=D).scatter_reduce(0, IDX, a, "amax") + a[:4].exp()

    s = torch.rand(4, dtype=D) + 0.5
    t = torch.randn(4, dtype=D)
    for f, x, v in ((into, s, t), (summed, src, torch.randn(64, dtype=D))):
        out, jt = tv.jvp(f, (x,), (v,))
        torch.testing.assert_close(jt, _per_row(f, x) @ v)
        _, cols = tv.jvp(f, (x,), (torch.stack([v, 2 * v]),), batched=True)
        torch.testing.assert_close(cols, torch.stack([jt, 2 * jt]))


def test_triangular_solve_matrix_by_reverse_mode_right_hand_side_forward():
    A = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(2)).triu()
    A = A + 4 * torch.eye(4, dtype=D)
    B = torch.randn(4, 2, dtype=D)

    def of_matrix(a):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # (deprecated)
            return torch.triangular_solve(B, a).solution

    def of_rhs(b):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.triangular_solve(b, A).solution

    ta = torch.randn(4, 4, dtype=D)
    assert (torch.func.jvp(of_matrix, (A,), (ta,))[1].reshape(-1)
            - _per_row(of_matrix, A) @ ta.reshape(-1)).abs().max() > 1e-3
    with pytest.warns(tv.JacobianWarning) as rec:
        _, jt = tv.jvp(of_matrix, (A,), (ta,))
    msg = " ".join(str(w.message) for w in rec if w.category is tv.JacobianWarning)
    assert "torch.triangular_solve is wrong for the matrix A" in msg
    assert "torch.linalg.solve_triangular, whose forward-mode formula is right" in msg
    torch.testing.assert_close(jt.reshape(-1), _per_row(of_matrix, A) @ ta.reshape(-1))
    tb = torch.randn(4, 2, dtype=D)
    _, jt = tv.jvp(of_rhs, (B,), (tb,))
    torch.testing.assert_close(jt.reshape(-1), _per_row(of_rhs, B) @ tb.reshape(-1))


@pytest.mark.parametrize("batched", [False, True])
def test_jvp_still_calls_f_once_and_draws_what_a_plain_call_draws(batched):
    calls = []

    def f(a):
        calls.append(1)
        return torch.nn.functional.dropout(a, 0.5) * 2

    x = torch.randn(6, dtype=D)
    t = torch.ones(*((3,) if batched else ()), 6, dtype=D)
    for _ in range(2):  # (the first call reads f's graph, the second remembers)
        calls.clear()
        torch.manual_seed(0)
        out, jt = tv.jvp(f, (x,), (t,), batched=batched)
        assert len(calls) == 1
        torch.manual_seed(0)
        assert torch.equal(out, f(x))
        assert not out.requires_grad and not jt.requires_grad
        torch.testing.assert_close(jt, (out != 0).to(D).mul(4).expand_as(jt))


def test_jvp_reads_the_graph_under_no_grad_and_keeps_a_differentiable_output():
    f = _scatter(False)
    x = _point("random")
    with torch.no_grad(), pytest.warns(tv.JacobianWarning, match="scatter_reduce"):
        _, jt = tv.jvp(f, (x,), (torch.ones(64, dtype=D),))
    torch.testing.assert_close(jt, _per_row(f, x).sum(1))
    w = torch.randn(4, dtype=D, requires_grad=True)
    x = torch.randn(4, dtype=D)
    out, jt = tv.jvp(lambda a: (a * w).sin(), (x,), (torch.ones(4, dtype=D),))
    assert out.requires_grad and jt.requires_grad  # (through w, as torch.func.jvp's)
    torch.testing.assert_close(jt, (x * w).cos() * w)


def test_named_forward_message():
    from torch_vjp._engine import fwd_wrong

    err = fwd_wrong.named_forward("torch_vjp.jacobian", "torch.scatter_reduce(reduce='prod')",
                                  "f", "fwd")
    msg = str(err)
    assert isinstance(err, tv.StrategyError) and isinstance(err, ValueError)
    assert msg.startswith("torch_vjp.jacobian: strategy='fwd' computes with forward-mode AD, "
                          "and torch's forward-mode formula of torch.scatter_reduce")
    assert "so the Jacobian would be wrong, with or without torch.vmap" in msg
    assert "Fix: strategy='rev' (reverse mode, whose formula is right), or 'auto'" in msg


@pytest.mark.parametrize("strategy", ["fwd", "fwd-loop"])
@pytest.mark.parametrize("kind", ["random", "zeros"])
def test_named_forward_jacobian_through_scatter_prod_refuses(strategy, kind):
    f, x = _scatter(False), _point(kind)
    for seed in range(2):  # (the first call reads f's graph, later ones remember it)
        with pytest.raises(tv.StrategyError) as info:
            tv.jacobian(f, x if seed == 0 else _point(kind, seed=seed), strategy=strategy)
        msg = str(info.value)
        assert msg.startswith(f"torch_vjp.jacobian: strategy={strategy!r} computes with "
                              f"forward-mode AD, and torch's forward-mode formula of "
                              f"torch.scatter_reduce(reduce='prod') is wrong for the source")
        assert "which f (_scatter.<locals>.f) computes from its differentiated inputs" in msg
        assert "Fix: strategy='rev' (reverse mode, whose formula is right)" in msg
    torch.testing.assert_close(tv.jacobian(f, x, strategy="rev").reshape(4, 64), _per_row(f, x))


def test_named_forward_jacobian_through_triangular_solve_refuses_only_for_the_matrix():
    A = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(2)).triu()
    A = A + 4 * torch.eye(4, dtype=D)
    B = torch.randn(4, 4, dtype=D)

    def solve(b, a):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # (deprecated)
            return torch.triangular_solve(b, a).solution

    for strategy in ("fwd", "fwd-loop"):
        with pytest.raises(tv.StrategyError, match=r"triangular_solve is wrong for the matrix "
                           r"A(?s:.*)or torch.linalg.solve_triangular"):
            tv.jacobian(solve, B, A, argnums=1, strategy=strategy)
        # (the right-hand side's formula is right: same shapes, another argnums)
        J = tv.jacobian(solve, B, A, argnums=0, strategy=strategy)
        torch.testing.assert_close(J.reshape(16, 16), _per_row(lambda b: solve(b, A), B))
    with pytest.raises(tv.StrategyError, match="triangular_solve"):
        tv.batch_jacobian(lambda a: solve(B, a), A.expand(3, 4, 4).clone(), strategy="fwd")


def test_named_forward_jacobian_without_a_wrong_formula_is_computed_once_read():
    calls = []

    def f(a):
        calls.append(1)
        return torch.ones(4, dtype=D).scatter_reduce(0, IDX, a, "amax") * a[:4].sin()

    x = _point("random")
    ref = _per_row(f, x)
    for strategy in ("fwd", "fwd-loop"):
        for _ in range(2):
            calls.clear()
            torch.testing.assert_close(tv.jacobian(f, x, strategy=strategy), ref)
            assert calls  # (called, once read, not refused)


@pytest.mark.parametrize("kind", ["random", "zeros"])
def test_auto_through_scatter_prod_is_right(kind):
    f, x = _scatter(True), _point(kind)

    def tall(a):  # (more output than input elements: "auto" starts from forward mode)
        return torch.cat([f(a.repeat(16)), a.sin().repeat(8)])

    for y in (x[:4], x[4:8]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tv.JacobianWarning)
            J = tv.jacobian(tall, y)
        torch.testing.assert_close(J, _per_row(tall, y))
    torch.testing.assert_close(tv.jacobian(f, x).reshape(4, 64), _per_row(f, x))


def test_named_forward_jacobian_reads_again_where_a_flag_chooses_another_operator():
    # (a flag of f's in the key, as "auto"'s route: the branch it chooses is read there)
    def f(a, prod):
        return torch.ones(4, dtype=D).scatter_reduce(0, IDX, a, "prod" if prod else "sum")

    x = _point("random")
    torch.testing.assert_close(tv.jacobian(f, x, False, strategy="fwd"),
                               _per_row(lambda a: f(a, False), x))
    with pytest.raises(tv.StrategyError, match="scatter_reduce"):
        tv.jacobian(f, x, True, strategy="fwd")
    torch.testing.assert_close(tv.jacobian(f, x, False, strategy="fwd"),
                               _per_row(lambda a: f(a, False), x))


class _OldStyleSquare(torch.autograd.Function):
    """No setup_context: torch.func cannot run it, plain forward-mode AD can (its jvp)."""

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_forward(a)
        return a * a

    @staticmethod
    def jvp(ctx, t):
        (a,) = ctx.saved_tensors
        return 2 * a * t


def test_named_fwd_loop_with_plain_autograd_refuses_through_scatter_prod():
    def f(a):
        return torch.ones(4, dtype=D).scatter_reduce(0, IDX, _OldStyleSquare.apply(a), "prod",
                                                     include_self=False)

    def g(a):
        return torch.ones(4, dtype=D).scatter_reduce(0, IDX, _OldStyleSquare.apply(a), "amax")

    x = _point("random")
    for _ in range(2):
        with pytest.raises(tv.StrategyError, match=r"^torch_vjp\.jacobian: "
                           r"strategy='fwd-loop' computes with forward-mode AD, and torch's "
                           r"forward-mode formula of torch\.scatter_reduce"):
            tv.jacobian(f, x, strategy="fwd-loop")
    ref = torch.func.jacrev(lambda a: torch.ones(4, dtype=D).scatter_reduce(0, IDX, a * a,
                                                                             "amax"))(x)
    torch.testing.assert_close(tv.jacobian(g, x, strategy="fwd-loop"), ref)
