"""Where torch.func computes a derivative, torch_vjp computes it too: functions that mutate a
primal they are not differentiated against, backward formulas that read their grad_output
through ``as_strided``, backward kernels torch decomposes only under vmap, forward-mode
formulas torch has wrong, a disconnection check that never fails a call, and a pullback
``make_fx`` can trace. Every result in float64 against torch.func and finite differences."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import torch_vjp as tv
from torch_vjp._engine import rows as rows_module
from torch_vjp._engine.symmetry import asymmetry
from torch_vjp._strategies import STRATEGIES

D = torch.float64
ALL = tuple(STRATEGIES)  # auto, rev, fwd, rev-loop, fwd-loop
CHECKED_BY_ENVIRONMENT = os.environ.get("TORCH_VJP_CHECKED") == "1"


def fd_jacobian(f, x, eps=1e-6):
    """Central differences, one input element at a time: ``out.shape + x.shape``."""
    cols = []
    flat = x.reshape(-1)
    for k in range(flat.numel()):
        e = torch.zeros_like(flat)
        e[k] = eps
        cols.append((f((flat + e).view_as(x)) - f((flat - e).view_as(x))) / (2 * eps))
    return torch.stack(cols, -1).reshape(*cols[0].shape, *x.shape)


def fd_hessian(f, x):
    """The finite-difference Jacobian of torch.func's gradient."""
    return fd_jacobian(torch.func.grad(f), x)


@contextlib.contextmanager
def no_jacobian_warnings():
    """A context in which any JacobianWarning fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        yield


# --------------------------------------------------------------------------------------
# f writes into a primal it is not differentiated against (NOTE [non-differentiated primals])
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ALL)
def test_f_copying_into_a_non_differentiated_primal(strategy):
    x, y = torch.randn(3, dtype=D), torch.zeros(3, dtype=D)
    y_before = y.clone()

    def f(x, y):
        return y.copy_(x) * x

    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)  # no "could not vectorise"
        J = tv.jacobian(f, x, y, argnums=0, strategy=strategy)
    torch.testing.assert_close(J, torch.func.jacrev(f, argnums=0)(x, y.clone()))
    torch.testing.assert_close(J, fd_jacobian(lambda t: f(t, y.clone()), x))
    assert torch.equal(y, y_before)  # the caller's tensor is never written


def test_issue_example_copy_is_the_identity():
    x, y = torch.randn(3, dtype=D), torch.zeros(3, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        J = tv.jacobian(lambda x, y: y.copy_(x), x, y, argnums=0)
    torch.testing.assert_close(J, torch.eye(3, dtype=D))
    assert not y.any()


@pytest.mark.parametrize("strategy", ALL)
def test_hessian_of_f_copying_into_a_non_differentiated_primal(strategy):
    x, y = torch.randn(3, dtype=D), torch.zeros(3, dtype=D)

    def f(x, y):
        return y.copy_(x).pow(3).sum()

    H = tv.hessian(f, x, y, argnums=0, strategy=strategy)
    torch.testing.assert_close(H, torch.func.hessian(f, argnums=0)(x, y.clone()))
    torch.testing.assert_close(H, fd_hessian(lambda t: f(t, y.clone()), x))
    assert not y.any()


def test_batched_jvp_of_f_writing_into_a_pytree_primal_not_differentiated():
    x = torch.randn(3, dtype=D)
    buf = {"y": torch.zeros(3, dtype=D)}

    def f(x, buf):
        return buf["y"].copy_(x).sin()

    J = tv.jacobian(f, x, buf, argnums=0, strategy="fwd")
    torch.testing.assert_close(J, torch.diag(x.cos()))
    assert not buf["y"].any()


# --------------------------------------------------------------------------------------
# The loops pass each vector as a tensor of its own (NOTE [one vector at a time])
# --------------------------------------------------------------------------------------


def _as_strided_scatter(x):
    return torch.as_strided_scatter(torch.zeros(9, dtype=D), x, (2, 2), (1, 2), 1)


@pytest.mark.parametrize("strategy", ["auto", "rev", "rev-loop", "fwd-loop"])
def test_as_strided_scatter_backward_reads_a_fresh_row(strategy):
    """(``"fwd"`` is left out: as_strided_scatter has no batching rule, and torch.func.jacfwd
    fails on it too; ``"auto"`` falls back to its loop.)"""
    x = torch.randn(2, 2, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J = tv.jacobian(_as_strided_scatter, x, strategy=strategy)
    torch.testing.assert_close(J, torch.func.jacrev(_as_strided_scatter)(x))
    torch.testing.assert_close(J, fd_jacobian(_as_strided_scatter, x))


@pytest.mark.parametrize("batch", [None, 3])
def test_loop_rows_are_fresh_contiguous_tensors(batch):
    shapes = [torch.Size([2, 2]), torch.Size([3])]
    rows = rows_module.basis_rows(shapes, [D, D], [torch.device("cpu")] * 2, batch)
    seen = []

    def fn(a, b):
        seen.append((a, b))
        return (a.sum() + b.sum()).reshape(1),

    (stacked,), _ = rows_module.map_rows(fn, rows, 7, vectorized=False, chunk_size=None)
    assert stacked.flatten().tolist() == [float(batch or 1)] * 7
    for a, b in seen:
        for v in (a, b):
            assert v.storage_offset() == 0 and v.is_contiguous()
    assert len({a.untyped_storage().data_ptr() for a, _ in seen}) == 7


# --------------------------------------------------------------------------------------
# The gradient inside a Hessian runs under vmap (NOTE [the gradient inside a Hessian])
# --------------------------------------------------------------------------------------


def _huber(x, t):
    return (F.huber_loss(x, t, reduction="none") ** 2).sum()


def _layer_norm_bias_only(x, b):
    return F.layer_norm(x, (5,), None, b).pow(3).sum()


@pytest.mark.parametrize("strategy", ["auto", "rev", "fwd"])
@pytest.mark.parametrize("name", ["huber_loss", "layer_norm(weight=None, bias)"])
def test_hessian_of_backward_kernels_torch_decomposes_under_vmap(name, strategy):
    """The vectorised strategies, as torch.func.hessian. (The loop strategies run without
    vmap by definition, as torch.func.jacrev(chunk_size=1) does, and fail where it fails:
    huber_loss under "fwd-loop", layer_norm under "rev-loop".)"""
    if name == "huber_loss":
        f, primals = _huber, (torch.randn(5, dtype=D) * 2, torch.randn(5, dtype=D))
    else:
        f, primals = _layer_norm_bias_only, (torch.randn(2, 5, dtype=D), torch.randn(5, dtype=D))
    H = tv.hessian(f, *primals, argnums=(0, 1), strategy=strategy)
    ref = torch.func.hessian(f, argnums=(0, 1))(*primals)
    for i in range(2):
        for j in range(2):
            torch.testing.assert_close(H[i][j], ref[i][j])
    # finite differences of the gradient, block by block
    x, t = primals
    torch.testing.assert_close(H[0][0], fd_hessian(lambda u: f(u, t), x))
    torch.testing.assert_close(H[1][1], fd_hessian(lambda u: f(x, u), t))


# --------------------------------------------------------------------------------------
# Forward over reverse, checked by the Hessian's symmetry (NOTE [forward over reverse,
# checked])
# --------------------------------------------------------------------------------------


def _triangular(b, A):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.triangular_solve is deprecated
        return torch.triangular_solve(b, A)[0].pow(3).sum()


def _triangular_point():
    A = torch.randn(3, 3, dtype=D).triu() + 3 * torch.eye(3, dtype=D)
    return torch.randn(3, 2, dtype=D), A


def test_auto_hessian_prefers_reverse_over_reverse_where_forward_is_wrong():
    b, A = _triangular_point()
    rev = tv.hessian(_triangular, b, A, argnums=1, strategy="rev")
    fwd = tv.hessian(_triangular, b, A, argnums=1, strategy="fwd")
    assert (fwd - rev).norm() > 0.1 * rev.norm()  # torch's forward-mode formula is wrong
    with pytest.warns(tv.JacobianWarning, match=r"^torch_vjp\.hessian: forward-over-reverse "
                      r"\(strategy='auto'\) gave a Hessian of _triangular that is not symmetric "
                      r"\(entries that must be equal differ by up to .*, at a scale of .*\), "
                      r"and reverse-over-reverse disagrees with it \(by up to .*\): an operator "
                      r"in f has a wrong forward-mode derivative of its backward formula"
                      r"(?s:.*)returned the reverse-over-reverse Hessian.\n  Pass "
                      r"strategy='rev'"):
        H = tv.hessian(_triangular, b, A, argnums=1)
    torch.testing.assert_close(H, rev)
    torch.testing.assert_close(H, fd_hessian(lambda M: _triangular(b, M), A))
    with pytest.raises(RuntimeError):  # torch.func.hessian fails on it
        torch.func.hessian(_triangular, argnums=1)(b, A)


@pytest.mark.parametrize("scale", [1e-8, 1e-12])
def test_auto_hessian_sees_a_wrong_formula_at_a_small_scale(scale):
    # an absolute floor on the disagreement (sqrt(eps)) let forward mode's wrong Hessian
    # through wherever the Hessian's entries were smaller than it (relative error 0.85)
    b, A = _triangular_point()

    def small(b, A):
        return scale * _triangular(b, A)

    rev = tv.hessian(small, b, A, argnums=1, strategy="rev")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        torch.testing.assert_close(tv.hessian(small, b, A, argnums=1), rev, atol=0, rtol=1e-6)


def test_auto_hessian_of_a_zero_hessian_gives_no_warning():
    # the true Hessian is zero (exp(log a + log b) - a b): forward over reverse returns
    # rounding (1e-16) whose scale is its own, and "auto" warned that an operator has a
    # wrong forward-mode derivative; the gradient's scale (1) says it is rounding
    def f(x):
        return ((torch.exp(torch.log(x[0]) + torch.log(x[1])) - x[0] * x[1]) * 3.7 + x.sum()
                + torch.exp(torch.log(x[1]) + torch.log(x[2])) - x[1] * x[2])

    x = torch.tensor([1.3, 0.7, 2.1], dtype=D)
    with no_jacobian_warnings():
        H = tv.hessian(f, x)
    torch.testing.assert_close(H, torch.zeros(3, 3, dtype=D), atol=1e-12, rtol=0)


def test_auto_hessian_checks_every_block_pair():
    b, A = _triangular_point()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        H = tv.hessian(_triangular, b, A, argnums=(0, 1))
    rev = tv.hessian(_triangular, b, A, argnums=(0, 1), strategy="rev")
    for i in range(2):
        for j in range(2):
            torch.testing.assert_close(H[i][j], rev[i][j])


def test_symmetric_hessians_are_returned_as_computed(monkeypatch):
    """The common case: symmetric, so forward over reverse stands, computed once."""
    x = torch.randn(4, dtype=D)
    f = lambda x: (x.sin() * x.roll(1)).sum() ** 2  # noqa: E731
    modes = []
    from torch_vjp import jacobians

    real = jacobians.jacobian_blocks

    def recording(prob, mode, **kwargs):
        if kwargs.get("probe") is not None:  # the outer Jacobian (the inner one has no probe)
            modes.append(mode)
        return real(prob, mode, **kwargs)

    monkeypatch.setattr(jacobians, "jacobian_blocks", recording)
    with no_jacobian_warnings():
        H = tv.hessian(f, x)
    torch.testing.assert_close(H, torch.func.hessian(f)(x))
    torch.testing.assert_close(H, fd_hessian(f, x))
    assert modes == ["fwd"]


# --------------------------------------------------------------------------------------
# Forward mode under "auto", checked once against a reverse product (NOTE [auto, checked
# once])
# --------------------------------------------------------------------------------------


def _solve_wide(A):
    """Tall Jacobian (300 outputs, 9 inputs): "auto" picks forward mode, whose formula for
    torch.triangular_solve's matrix argument is wrong in torch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.triangular_solve is deprecated
        return torch.triangular_solve(_WIDE.expand(*A.shape[:-2], 3, 100), A)[0]


_WIDE = torch.linspace(-1.0, 1.0, 300, dtype=D).reshape(3, 100)


@pytest.fixture
def forward_checks_forgotten():
    from torch_vjp._engine import fwdcheck

    fwdcheck.CHECKED.clear()
    yield fwdcheck.CHECKED
    fwdcheck.CHECKED.clear()


_FWD_WRONG = (r"forward mode \(strategy='auto' chooses it for a Jacobian with more output "
              r"than input elements\) disagrees with a reverse product on the Jacobian of "
              r"_solve_wide \(by up to .*, at a scale of .*\): an operator in f has a wrong "
              r"forward-mode derivative \(torch.triangular_solve is one\). strategy='auto' "
              r"returned the reverse-mode Jacobian, and uses it for this function and input "
              r"shapes from now on.\n  Pass strategy='rev'")


def test_auto_jacobian_checks_forward_mode_against_reverse_mode(forward_checks_forgotten):
    A = _triangular_point()[1]
    ref = torch.func.jacrev(_solve_wide)(A)
    assert (torch.func.jacfwd(_solve_wide)(A) - ref).abs().max() > 0.1  # torch's is wrong
    with pytest.warns(tv.JacobianWarning, match=r"^torch_vjp\.jacobian: " + _FWD_WRONG):
        J = tv.jacobian(_solve_wide, A)
    torch.testing.assert_close(J, ref)
    torch.testing.assert_close(J, fd_jacobian(_solve_wide, A))
    assert list(forward_checks_forgotten.values()) == ["rev"]
    with no_jacobian_warnings():  # later calls go to reverse mode directly
        torch.testing.assert_close(tv.jacobian(_solve_wide, A), ref)
    # a named forward strategy reads f's graph and refuses torch's wrong formula
    with pytest.raises(tv.StrategyError, match=r"^torch_vjp\.jacobian: strategy='fwd' "
                       r"computes with forward-mode AD, and torch's forward-mode formula of "
                       r"torch\.triangular_solve is wrong for the matrix A"):
        tv.jacobian(_solve_wide, A, strategy="fwd")


def test_auto_batch_and_sparse_jacobians_check_forward_mode(forward_checks_forgotten):
    A = torch.stack([_triangular_point()[1] for _ in range(4)])
    ref = torch.vmap(torch.func.jacrev(_solve_wide))(A)

    def rows(A):  # (a function of its own: the warning is shown once per function)
        return _solve_wide(A)

    with pytest.warns(tv.JacobianWarning, match=r"^torch_vjp\.batch_jacobian: forward mode "
                      r"(?s:.*) disagrees with a reverse product on the Jacobian of .*rows"):
        torch.testing.assert_close(tv.batch_jacobian(rows, A), ref)
    with warnings.catch_warnings(record=True) as caught:  # (and the missing rule's warning)
        warnings.simplefilter("always")
        S = tv.sparse_jacobian(_solve_wide, A[0], layout=torch.strided)
    assert [w for w in caught if re.match(
        r"torch_vjp\.sparse_jacobian: forward mode \(mode='auto' chooses it where it needs "
        r"fewer products\) disagrees with a reverse product on the Jacobian of _solve_wide .*"
        r"mode='auto' returned the reverse-mode Jacobian, and uses it for this function and "
        r"input shapes from now on.\n  Pass mode='rev'", str(w.message), re.S)]
    torch.testing.assert_close(S.reshape(3, 100, 3, 3), ref[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        S = tv.sparse_jacobian(_solve_wide, A[0], layout=torch.strided)
    assert not [w for w in caught if "disagree" in str(w.message)]  # reverse mode directly
    torch.testing.assert_close(S.reshape(3, 100, 3, 3), ref[0])


def test_auto_jacobian_checks_reverse_mode_under_vmap(forward_checks_forgotten):
    """torch.cdist's backward has a wrong batching rule (torch 2.13): reverse mode under vmap
    is wrong by a relative error near 1; one reverse product at a time is right."""
    y = torch.randn(4, 2, dtype=D)

    def dist(x):
        return torch.cdist(x, y)

    x = torch.randn(3, 2, dtype=D)
    ref = torch.autograd.functional.jacobian(dist, x)
    torch.testing.assert_close(ref, fd_jacobian(dist, x))
    assert (torch.func.jacrev(dist)(x) - ref).abs().max() > 0.1  # torch.func's is wrong
    with pytest.warns(tv.JacobianWarning, match=r"^torch_vjp\.jacobian: reverse mode under "
                      r"torch\.vmap disagrees with a reverse product without it on the "
                      r"Jacobian of .*dist \(by up to .*\): an operator in f's backward has "
                      r"a wrong batching rule \(torch\.cdist's is one\)\. strategy='auto' "
                      r"returned the Jacobian computed one reverse product at a time "
                      r"\(strategy='rev-loop'\), and uses it for this function and input "
                      r"shapes from now on.\n  Pass strategy='rev-loop'"):
        J = tv.jacobian(dist, x)
    torch.testing.assert_close(J, ref)
    assert list(forward_checks_forgotten.values()) == ["rev-loop"]
    with no_jacobian_warnings():
        torch.testing.assert_close(tv.jacobian(dist, x), ref)
    xb = torch.randn(5, 3, 2, dtype=D)

    def dists(x):
        return torch.cdist(x, y.expand(x.shape[0], 4, 2))

    with pytest.warns(tv.JacobianWarning, match=r"^torch_vjp\.batch_jacobian: reverse mode"):
        torch.testing.assert_close(
            tv.batch_jacobian(dists, xb),
            torch.stack([torch.autograd.functional.jacobian(dist, r) for r in xb]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        S = tv.sparse_jacobian(dist, x, layout=torch.strided)
    torch.testing.assert_close(S, ref.reshape(12, 6))
    # (sparse_jacobian knows cdist's batching rule for wrong, and computes its colours one
    # at a time from the start)
    assert [w for w in caught if re.match(
        r"torch_vjp\.sparse_jacobian: .*dist calls torch\.cdist \(aten\._cdist_forward\), whose "
        r"backward torch computes wrongly under torch\.vmap \(a wrong batching rule\).*one "
        r"colour at a time", str(w.message), re.S)]
    with no_jacobian_warnings():  # the plan remembers the route
        torch.testing.assert_close(tv.sparse_jacobian(dist, x, layout=torch.strided),
                                   ref.reshape(12, 6))


def test_jacobian_of_checks_its_vectorised_backward_once_per_graph(forward_checks_forgotten):
    """jacobian_of takes its products under torch.vmap: where a backward formula has a wrong
    batching rule (torch.cdist's, torch 2.13) the first call for a graph of that structure
    finds it against one backward pass without vmap and returns the loop's Jacobian."""
    y = torch.randn(4, 2, dtype=D)
    ref_fn = lambda x: torch.cdist(x, y)  # noqa: E731
    x = torch.randn(3, 2, dtype=D, requires_grad=True)
    ref = torch.autograd.functional.jacobian(ref_fn, x.detach())
    torch.testing.assert_close(ref, fd_jacobian(ref_fn, x.detach()))
    with pytest.warns(tv.JacobianWarning, match=(
            r"^torch_vjp\.jacobian_of: the vectorised backward pass \(torch\.vmap over "
            r"torch\.autograd\.grad\) disagrees with one backward pass without it \(by up "
            r"to .*\): an operator in the graph has a wrong batching rule for its backward "
            r"\(torch\.cdist's is one\)\. jacobian_of returned the Jacobian computed one "
            r"backward pass per output element, and does so for graphs of this structure from "
            r"now on\.\n  Pass chunk_size=1 to compute it that way directly\.")):
        J = tv.jacobian_of(torch.cdist(x, y), x)
    torch.testing.assert_close(J, ref)
    with no_jacobian_warnings():  # a new graph of the same structure: the loop directly
        x2 = torch.randn(3, 2, dtype=D, requires_grad=True)
        out = torch.cdist(x2, y)
        torch.testing.assert_close(tv.jacobian_of(out, x2, retain_graph=True),
                                   torch.autograd.functional.jacobian(ref_fn, x2.detach()))
        out.sum().backward()  # the graph kept, as asked


def test_jacobian_of_check_keeps_the_graph_when_asked(forward_checks_forgotten):
    # the common case: the vectorised products agree, silently; retain_graph=True keeps the
    # graph through the check's extra backward pass
    W = torch.randn(5, 3, dtype=D)
    x = torch.randn(3, dtype=D, requires_grad=True)
    out = torch.tanh(W @ x)
    with no_jacobian_warnings():
        J = tv.jacobian_of(out, x, retain_graph=True)
    torch.testing.assert_close(J, torch.func.jacrev(lambda v: torch.tanh(W @ v))(x.detach()))
    out.sum().backward()
    torch.testing.assert_close(x.grad, J.sum(0))
    assert list(forward_checks_forgotten.values()) == ["rev"]


def test_auto_chooses_the_mode_on_the_output_size_f_has_now(forward_checks_forgotten):
    # The output size is remembered per function and input shapes, and reverse mode does not
    # check it: after f's output grew (a global rebound) "auto" kept reverse mode, and the
    # route remembered for the wide Jacobian served the tall one (43x slower, measured)
    W1 = torch.randn(16, 4, dtype=D)
    out = {"W": torch.randn(2, 16, dtype=D)}

    def f(x):
        return out["W"] @ torch.tanh(W1 @ x)

    x = torch.randn(4, dtype=D)
    for rows, mode in ((2, "rev"), (300, "fwd")):
        out["W"] = torch.randn(rows, 16, dtype=D)
        ref = torch.func.jacrev(f)(x)
        for _ in range(2):  # the first call after the change may still be reverse mode
            torch.testing.assert_close(tv.jacobian(f, x), ref)
        assert mode in forward_checks_forgotten.values()
    assert set(forward_checks_forgotten.values()) == {"fwd", "rev"}


def test_jacobian_of_check_rounds_at_the_graphs_least_precise_dtype(forward_checks_forgotten,
                                                                    monkeypatch):
    # a float32 step inside a float64 graph: the vectorised products and the unbatched one
    # round differently at float32's precision, which the check took for a disagreement:
    # the first call took every output element's backward pass again, one at a time
    from torch_vjp._engine import computed

    chunk_sizes = []
    real = computed.map_rows_with_fallback

    def spy(*args, **kwargs):
        chunk_sizes.append(kwargs.get("chunk_size"))
        return real(*args, **kwargs)

    monkeypatch.setattr(computed, "map_rows_with_fallback", spy)
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(2000, 300, generator=gen)
    x = torch.randn(300, dtype=D, generator=gen).requires_grad_()
    out = torch.tanh(W @ x.float()).double()
    with no_jacobian_warnings():
        J = tv.jacobian_of(out, x)
    assert J.shape == (2000, 300)
    assert chunk_sizes == [None]
    assert list(forward_checks_forgotten.values()) == ["rev"]


def test_auto_checks_again_for_another_flag_among_the_primals(forward_checks_forgotten):
    # f branches on a plain argument to the operator whose forward-mode formula is wrong:
    # the check of the first call (the right branch) covered the second, silently wrong
    def f(A, wrong):
        if wrong:
            return _solve_wide(A)
        return torch.linalg.solve_triangular(A, _WIDE, upper=True)

    A = _triangular_point()[1]
    with no_jacobian_warnings():
        torch.testing.assert_close(tv.jacobian(f, A, False),
                                   torch.func.jacrev(lambda M: f(M, False))(A))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J = tv.jacobian(f, A, True)
    torch.testing.assert_close(J, torch.func.jacrev(_solve_wide)(A))


def test_auto_routes_are_remembered_per_function_not_per_code(forward_checks_forgotten):
    # two functions made by one line (or two nn.Sequential) share a code object: the route
    # checked for the first was taken by the second, whose forward-mode formula is wrong
    def make(op):
        return lambda A: op(A)

    A = _triangular_point()[1]
    right = make(lambda M: torch.linalg.solve_triangular(M, _WIDE, upper=True))
    wrong = make(_solve_wide)
    tv.jacobian(right, A)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        torch.testing.assert_close(tv.jacobian(wrong, A), torch.func.jacrev(_solve_wide)(A))
        P = torch.ones(300, 9, dtype=torch.bool)  # a user's pattern serves both
        tv.sparse_jacobian(right, A, pattern=P, layout=torch.strided)
        S = tv.sparse_jacobian(wrong, A, pattern=P, layout=torch.strided)
    torch.testing.assert_close(S.reshape(3, 100, 3, 3), torch.func.jacrev(_solve_wide)(A))


class _Solver(torch.nn.Module):
    """A module whose forward branches on an attribute: solve_triangular (right in forward
    mode) or torch.triangular_solve (wrong in forward mode)."""

    def __init__(self, wrong):
        super().__init__()
        self.wrong = wrong

    def forward(self, A):
        if self.wrong:
            return _solve_wide(A)
        return torch.linalg.solve_triangular(A, _WIDE, upper=True)


def test_auto_route_of_a_dead_module_is_not_taken_by_a_new_one_at_its_address(
        forward_checks_forgotten):
    # A module is known by identity; CPython gives a new object the address (id) of one
    # that died. The check of the dead module covered the new one, whose forward-mode
    # formula is wrong: a silently wrong Jacobian.
    A = _triangular_point()[1]
    ref = torch.func.jacrev(_solve_wide)(A)
    for _ in range(200):
        right = _Solver(False)
        tv.jacobian(right, A)
        address = id(right)
        del right
        wrong = _Solver(True)
        if id(wrong) == address:
            break
    else:
        pytest.skip("no new module was given a dead one's address")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        torch.testing.assert_close(tv.jacobian(wrong, A), ref)
        torch.testing.assert_close(tv.jacobian(wrong.forward, A), ref)


class _SlotsHolder:
    __slots__ = ("op",)  # (no __weakref__: cannot be weakly referenced)

    def __init__(self, op):
        self.op = op


def test_a_route_key_reads_the_callables_a_list_or_dict_holds():
    # (a list cannot be weakly referenced, so its identity is its id alone, which a new list
    # takes over once the old one dies: the callables it holds tell two apart; the numbers
    # it logs do not make a new key on every call)
    from torch_vjp._engine.fwdcheck import route_key

    def make(h):
        return lambda M: h[0](M)

    def right(M):
        return torch.linalg.solve_triangular(M, _WIDE, upper=True)

    ops = [right]
    before = route_key(make(ops))
    ops[0] = _solve_wide
    assert route_key(make(ops)) != before
    table = {0: right}
    before = route_key(make(table))
    table[0] = _solve_wide
    assert route_key(make(table)) != before
    log = [right]
    before = route_key(make(log))
    log.extend([1.0, 2.0])
    assert route_key(make(log)) == before
    assert route_key(make((right,))) == route_key(make((right,)))  # a tuple: its contents
    looped = []
    looped.append(looped)  # (a list that holds itself: the key is finite)
    assert route_key(make(looped)) is not None
    # immutable values that cannot be weakly referenced are held as values, not as new
    # objects on every call (a closure over a dtype was checked again on every call)
    for value in (torch.float32, torch.device("cpu"), torch.Size([2, 3]), slice(1, 2)):
        f = make(value)
        assert route_key(f) == route_key(f) == route_key(make(value))


@pytest.mark.parametrize("holder", ["slots"])
def test_auto_route_of_a_dead_container_is_not_taken_by_a_new_one(holder,
                                                                   forward_checks_forgotten):
    # a closure over a list (keyed by id alone: lists cannot be weakly referenced) or over
    # an object of a __slots__ class: a new one at a dead one's address took its route, and
    # forward mode's wrong triangular_solve Jacobian came back silently
    A = _triangular_point()[1]
    ref = torch.func.jacrev(_solve_wide)(A)

    def right(M):
        return torch.linalg.solve_triangular(M, _WIDE, upper=True)

    def make(h):
        if holder == "list":
            return lambda M: h[0](M)
        return lambda M: h.op(M)

    # (the key holds such a holder, so that no new one takes its address while the route is
    # remembered: then no attempt below meets a reused address, and the last new holder is
    # checked all the same. CPython hands a freed block to the next object of its size, so
    # a key that let the holder die would meet its address again within a few attempts.
    # Each attempt is a first call, checked: 4 to 130 ms here)
    for _ in range(10):
        first = [right] if holder == "list" else _SlotsHolder(right)
        tv.jacobian(make(first), A)
        address = id(first)
        del first
        second = [_solve_wide] if holder == "list" else _SlotsHolder(_solve_wide)
        if id(second) == address:
            break
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        torch.testing.assert_close(tv.jacobian(make(second), A), ref)


def test_auto_forward_mode_check_runs_once_and_draws_nothing(forward_checks_forgotten):
    """The common case: forward mode agrees; the check costs one call of f on the first
    call for a signature, none later, and leaves the global random state alone."""
    W = torch.randn(200, 4, dtype=D)
    calls = []

    def f(x):
        calls.append(1)
        return torch.tanh(W @ x)

    x = torch.randn(4, dtype=D)
    state = torch.get_rng_state()
    with no_jacobian_warnings():
        J = tv.jacobian(f, x)  # (its output sizes are remembered from now on)
        torch.testing.assert_close(J, torch.func.jacrev(f)(x))
        assert list(forward_checks_forgotten.values()) == ["fwd"]
        forward_checks_forgotten.clear()
        counts = []
        for _ in range(2):
            calls.clear()
            torch.testing.assert_close(tv.jacobian(f, x), J)
            counts.append(len(calls))
    assert counts == [2, 1]  # the products and the check; then the products alone
    assert torch.equal(torch.get_rng_state(), state)


def test_auto_forward_mode_check_of_a_random_f_sees_the_products_draw(forward_checks_forgotten):
    """A random f (dropout): the check's reverse product starts from the generator state the
    products started from, so it sees their draw and agrees (NOTE [auto's extra calls draw
    what the products draw]); the result is torch.func.jacrev's at the caller's generator
    state, without a warning, and the generator ends one call of f on. (The check used to
    draw on: no route agreed, and forward mode's result stood with a warning; the products
    had differentiated the probe's next draw.)"""
    W = torch.randn(200, 4, dtype=D)
    f = lambda x: F.dropout(torch.tanh(W @ x), 0.5)  # noqa: E731
    x = torch.randn(4, dtype=D)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", tv.JacobianWarning)
        J = tv.jacobian(f, x)
    after = torch.rand(1)
    assert not [w for w in said if "disagrees" in str(w.message)], said  # (vmap's fallback:
    assert list(forward_checks_forgotten.values()) == ["fwd"]            # random draws)
    torch.manual_seed(0)
    torch.testing.assert_close(J, torch.func.jacrev(f)(x))
    assert torch.equal(after, torch.rand(1))


def test_asymmetry_pairs_blocks_across_inputs():
    """blocks[o * L + k][i] against blocks[o * L + i][k], transposed."""
    x, y = torch.zeros(2), torch.zeros(3)
    full = torch.randn(5, 5)
    full = full + full.T
    blocks = [[full[:2, :2], full[:2, 2:]], [full[2:, :2], full[2:, 2:]]]
    assert asymmetry(blocks, [x, y])[0] == 0.0
    blocks[0][1] = blocks[0][1] + torch.tensor([[0.0, 0.0, 0.25], [0.0, 0.0, 0.0]])
    assert asymmetry(blocks, [x, y]) == (0.25, full.abs().max().item())
    # two outputs (a non-scalar f): each output's Hessian on its own
    two = [[torch.stack([full[:2, :2], -full[:2, :2]])]]
    assert asymmetry(two, [x]) == (0.0, full[:2, :2].abs().max().item())


def test_asymmetry_compares_large_hessians_a_slice_at_a_time(monkeypatch):
    from torch_vjp._engine import fwdcheck, symmetry

    monkeypatch.setattr(symmetry, "PIECE", 16)
    monkeypatch.setattr(fwdcheck, "PIECE", 16)
    H = torch.randn(3, 10, 10)
    H = H + H.transpose(1, 2)
    assert asymmetry([[H]], [torch.zeros(10)])[0] == 0.0
    H[1, 7, 2] += 0.5
    assert asymmetry([[H]], [torch.zeros(10)])[0] == pytest.approx(0.5)


# --------------------------------------------------------------------------------------
# The disconnection check never fails a call, and runs f only in checked mode
# (NOTE [the disconnection check])
# --------------------------------------------------------------------------------------


def _batch_norm_counting(calls):
    def f(x, rm, rv):
        calls.append(1)
        return F.batch_norm(x, rm.clone(), rv.clone(), training=True)

    return f


@pytest.mark.parametrize("checked", [False, True], ids=["default", "checked"])
@pytest.mark.parametrize("strategy", ["fwd", "fwd-loop"])
def test_zero_blocks_of_forward_mode_never_fail_the_call(strategy, checked):
    """Running statistics: a forward-mode derivative (zero), no reverse-mode one."""
    x = torch.randn(4, 3, dtype=D)
    rm, rv = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)
    calls = []
    f = _batch_norm_counting(calls)
    with pytest.raises(RuntimeError, match="not differentiable with respect to argument"):
        torch.func.jacrev(f, argnums=(1, 2))(x, rm, rv)
    ref = torch.func.jacfwd(f, argnums=(1, 2))(x, rm, rv)
    with tv.checked() if checked else warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        J = tv.jacobian(f, x, rm, rv, argnums=(1, 2), strategy=strategy)
    for got, want in zip(J, ref):
        torch.testing.assert_close(got, want)
        assert not got.any()  # finite differences: the output does not move either
    torch.testing.assert_close(fd_jacobian(lambda m: f(x, m, rv), rm), J[0])


@pytest.mark.skipif(CHECKED_BY_ENVIRONMENT, reason="TORCH_VJP_CHECKED=1 turns the check on")
@pytest.mark.parametrize("strategy", ["fwd", "rev"])
def test_f_runs_no_more_often_for_a_zero_block(strategy):
    """Outside checked mode a zero block costs nothing: f runs as often as for a block that
    is not zero (forward mode: a probe and the products; reverse mode: the products)."""
    x = torch.randn(4, 3, dtype=D)
    rm, rv = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)
    zero_calls, nonzero_calls = [], []
    f = _batch_norm_counting(zero_calls)
    if strategy == "fwd":
        tv.jacobian(f, x, rm, rv, argnums=(1, 2), strategy=strategy)
    g = _batch_norm_counting(nonzero_calls)
    tv.jacobian(g, x, rm, rv, argnums=0, strategy=strategy)
    through_item_calls = []

    def through_item(x):
        through_item_calls.append(1)
        return torch.full((2,), x.sum().item(), dtype=D)

    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        J = tv.jacobian(through_item, torch.randn(3, dtype=D), strategy=strategy)
    assert not J.any()  # as torch.func gives it
    assert len(through_item_calls) == len(nonzero_calls)
    if strategy == "fwd":
        assert len(zero_calls) == len(nonzero_calls) == 2


def test_a_failure_inside_the_check_ends_it_silently():
    """In checked mode the check calls f again; if f fails there, the Jacobian stands."""
    calls = []

    def flaky(x):
        calls.append(1)
        if len(calls) > 1:
            raise ValueError("f fails on its second call")
        return torch.full((2,), x.sum().item(), dtype=D)

    x = torch.randn(3, dtype=D)
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        J = tv.jacobian(flaky, x, strategy="rev")
    assert J.shape == (2, 3) and not J.any() and len(calls) > 1


def test_the_check_warns_through_a_warnings_filter_turned_to_errors():
    """A warning the check emits is raised outside its guard: an "error" filter sees it."""
    def through_item(x):
        return torch.full((2,), x.sum().item(), dtype=D)

    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        with pytest.raises(tv.JacobianWarning, match="does not depend on primals"):
            tv.jacobian(through_item, torch.randn(3, dtype=D))


# --------------------------------------------------------------------------------------
# make_fx traces the pullback itself (NOTE [a traceable pullback])
# --------------------------------------------------------------------------------------


def test_make_fx_traces_vjp_fn_directly():
    x = torch.randn(3, dtype=D)
    W = torch.randn(2, 3, dtype=D)
    out, vjp_fn = tv.vjp(lambda x: torch.tanh(W @ x), x)
    c = torch.randn(2, dtype=D)
    graph = make_fx(vjp_fn)(c)
    (want,) = torch.func.vjp(lambda x: torch.tanh(W @ x), x)[1](c)
    (got,) = graph(c)
    torch.testing.assert_close(got, want)
    c2 = torch.randn(2, dtype=D)
    torch.testing.assert_close(graph(c2)[0], vjp_fn(c2)[0])
    torch.testing.assert_close(got, c @ fd_jacobian(lambda t: torch.tanh(W @ t), x))
    # torch.func's own pullback needs a lambda around it
    with pytest.raises(RuntimeError, match="Tracing expected 3 arguments"):
        make_fx(torch.func.vjp(torch.sin, x)[1])(x)


def test_vjp_fn_shows_and_checks_its_documented_signature():
    _, vjp_fn = tv.vjp(torch.sin, torch.randn(3, dtype=D))
    assert str(inspect.signature(vjp_fn)) == (
        "(cotangents, retain_graph=True, create_graph=None, *, batched=False, chunk_size=None)"
    )
    c = torch.eye(3, dtype=D)
    (rows,) = vjp_fn(c, batched=True, chunk_size=2)
    torch.testing.assert_close(rows, vjp_fn(cotangents=c, batched=True)[0])
    with pytest.raises(TypeError, match=r"^vjp_fn\(\) got an unexpected keyword argument "
                       r"'retain'$"):
        vjp_fn(c[0], retain=True)
    with pytest.raises(TypeError, match=r"takes from 1 to 3 positional arguments but 4 were"):
        vjp_fn(c[0], True, True, True)
    with pytest.raises(TypeError, match=r"multiple values for argument 'create_graph'"):
        vjp_fn(c[0], True, None, create_graph=True)


def test_vjp_fn_takes_torch_funcs_retain_graph_and_create_graph():
    """torch.func's vjp_fn(cotangents, retain_graph=True, create_graph=None), by position
    (as make_fx(vjp_fn)(v, True, True) passes them) or by name."""
    x = torch.randn(3, dtype=D, requires_grad=True)
    f = lambda t: torch.sin(t).sum()  # noqa: E731
    _, vjp_fn = tv.vjp(f, x)
    _, ref_fn = torch.func.vjp(f, x)
    c = torch.randn((), dtype=D)
    for args, kwargs in [((True, True), {}), ((True, False), {}), ((), {"create_graph": True})]:
        (got,) = vjp_fn(c, *args, **kwargs)
        (want,) = ref_fn(c, *args, **kwargs)
        torch.testing.assert_close(got, want)
        assert got.requires_grad == want.requires_grad
    (got,) = vjp_fn(c, True, False)
    assert not got.requires_grad
    graph = make_fx(vjp_fn)(c, True, True)
    c2 = torch.randn((), dtype=D)
    torch.testing.assert_close(graph(c2, True, True)[0], c2 * x.detach().cos())
    (rows,) = vjp_fn(torch.ones(2, dtype=D), True, False, batched=True)
    torch.testing.assert_close(rows, x.detach().cos().expand(2, 3))


# --------------------------------------------------------------------------------------
# vjp and jvp call f once, on the caller's tensors, as torch.func does (NOTE [f's own
# copies])
# --------------------------------------------------------------------------------------


def test_vjp_taken_under_no_grad_is_differentiable_afterwards():
    x = torch.tensor(3.14, dtype=D, requires_grad=True)
    results = []
    for vjp in (tv.vjp, torch.func.vjp):
        with torch.no_grad():
            out, vjp_fn = vjp(lambda t: t**2, x)
        (y,) = vjp_fn(torch.tensor(1.0, dtype=D))
        assert not out.requires_grad and y.requires_grad
        results.append((y, torch.autograd.grad(y, x)[0]))
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(results[0][1], torch.tensor(2.0, dtype=D))


def _copy_into_first(x, y):
    x.copy_(y)
    return x


def test_jvp_writes_into_primals_reach_the_caller_as_under_torch_func():
    y = torch.randn(3, dtype=D)
    tangents = (torch.ones(3, dtype=D), torch.full((3,), 2.0, dtype=D))
    x_tv, x_ref = torch.zeros(3, dtype=D), torch.zeros(3, dtype=D)
    got = tv.jvp(_copy_into_first, (x_tv, y), tangents)
    want = torch.func.jvp(_copy_into_first, (x_ref, y), tangents)
    torch.testing.assert_close(got, want)
    assert torch.equal(x_tv, y) and torch.equal(x_ref, y)


def test_vjp_of_f_writing_into_a_primal_fails_as_under_torch_func():
    """The primal is a leaf that requires grad inside vjp; torch refuses the write."""
    for vjp in (tv.vjp, torch.func.vjp):
        x = torch.zeros(3, dtype=D)
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            vjp(_copy_into_first, x, torch.randn(3, dtype=D))


def test_jvp_under_vmap_writes_through_a_view_as_torch_func():
    """torch.func's TestVmapJvpInplaceView, case 2: the tangent written into a view of a
    primal reaches its base; the caller's batched primal is written."""

    def f(x, y):
        view = x[:, ::2]
        view.copy_(y)
        return view, x

    B = 2
    x0, xt = torch.randn(2, 6, B, dtype=D), torch.randn(2, 6, B, dtype=D)
    y, yt = torch.randn(2, B, 3, dtype=D), torch.randn(2, B, 3, dtype=D)
    results = []
    for jvp in (tv.jvp, torch.func.jvp):
        x = x0.clone()
        out = torch.vmap(lambda a, at, b, bt: jvp(f, (a, b), (at, bt)), in_dims=(2, 2, 1, 1))(
            x, xt.clone(), y, yt)
        results.append((out, x))
    torch.testing.assert_close(results[0], results[1])
    expected = xt.movedim(-1, 0).clone()
    expected[:, :, ::2].copy_(yt.movedim(1, 0))
    torch.testing.assert_close(results[0][0][1][1], expected)


def test_batched_jvp_still_starts_every_chunk_from_the_callers_point():
    x, y = torch.zeros(3, dtype=D), torch.randn(3, dtype=D)

    def f(x, y):
        x.add_(y)
        return x * 1.0

    _, cols = tv.jvp(f, (x, y), (torch.eye(3, dtype=D), torch.zeros(3, 3, dtype=D)),
                     batched=True, chunk_size=1)
    torch.testing.assert_close(cols, torch.eye(3, dtype=D))
    assert not x.any()  # batched: f runs on copies, once per chunk


def test_jvp_strict_as_torch_func():
    y = torch.randn(2, 3, dtype=D)
    x, tx = torch.randn(2, 3, dtype=D), torch.randn(2, 3, dtype=D)
    for jvp in (tv.jvp, torch.func.jvp):
        with pytest.raises(RuntimeError, match="strict"):
            jvp(lambda t: (t, y), (x,), (tx,), strict=True)
    with pytest.raises(RuntimeError, match="strict"):
        tv.jvp(lambda t: (t, y), (x,), (tx[None],), strict=True, batched=True)
    got = tv.jvp(lambda t: t.sin(), (x,), (tx,), strict=True)
    torch.testing.assert_close(got, torch.func.jvp(lambda t: t.sin(), (x,), (tx,), strict=True))


# --------------------------------------------------------------------------------------
# A non-tensor aux: one rule for every strategy and transform
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda f, x: tv.jvp(f, (x,), (torch.eye(3, dtype=D),), batched=True, has_aux=True),
    lambda f, x: tv.jvp(f, (x,), (x,), has_aux=True),
    lambda f, x: tv.vjp(f, x, has_aux=True),
    *[lambda f, x, s=s: tv.jacobian(f, x, has_aux=True, strategy=s) for s in ALL],
], ids=["jvp-batched", "jvp", "vjp", *ALL])
def test_non_tensor_aux_is_named_everywhere(call):
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        with pytest.raises(tv.JacobianCallError, match=r": aux\[1\] is a str, but with "
                           r"has_aux=True the aux value f returns must be a tensor"):
            call(lambda t: (t.sin(), (t.cos(), "label")), torch.randn(3, dtype=D))


@pytest.mark.parametrize("aux", [None, {"a": None}], ids=["None", "dict-of-None"])
@pytest.mark.parametrize("call", [
    lambda f, x: tv.jvp(f, (x,), (torch.eye(3, dtype=D),), batched=True, has_aux=True),
    lambda f, x: tv.jvp(f, (x,), (x,), has_aux=True),
    lambda f, x: tv.vjp(f, x, has_aux=True),
    *[lambda f, x, s=s: tv.jacobian(f, x, has_aux=True, strategy=s) for s in ALL],
], ids=["jvp-batched", "jvp", "vjp", *ALL])
def test_none_aux_is_named_everywhere(call, aux):
    # torch.func refuses None in aux ("Expected tensors, got unsupported type NoneType"):
    # "rev", "fwd", vjp and jvp raised that raw error, "auto" warned and fell back to the
    # loop, and the loops returned it
    where = "aux" if aux is None else r"aux\['a'\]"
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        with pytest.raises(tv.JacobianCallError, match=where + r" is None, but with "
                           r"has_aux=True the aux value f returns must be a tensor.*Fix: "
                           r"leave it out of aux"):
            call(lambda t: (t.sin(), aux), torch.randn(3, dtype=D))
