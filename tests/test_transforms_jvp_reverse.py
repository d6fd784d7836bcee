"""torch_vjp.jvp through an operator whose forward-mode formula torch (2.13) has wrong
(WRONG_FORWARD: torch.scatter_reduce(reduce='prod'), torch.triangular_solve's matrix,
torch.linalg.det at singular matrices) computes J t by reverse over reverse (NOTE [J t by
reverse over reverse] in torch_vjp/_engine/revjvp.py), where it refused; it refuses only
where that is wrong too. float64, against torch.func.jacrev(f)(x) @ t and central
differences."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv
from _references import caught, twice_with

D = torch.float64
W = torch.arange(1.0, 4.0, dtype=D)
IDX = torch.tensor([0, 1, 1, 2, 2, 0, 3, 3] * 2)  # (16 -> 4)
SINGULAR = torch.tensor([[1., 2, 3], [0, 0, 0], [4, 5, 7]], dtype=D)
RANK_2 = torch.tensor([[1., 2, 3], [4, 5, 6], [7, 8, 9]], dtype=D)  # (a pivot of rounding size)
REGULAR = torch.randn(3, 3, dtype=D, generator=torch.Generator().manual_seed(4))
TRI = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(2)).triu() \
    + 4 * torch.eye(4, dtype=D)
B = torch.randn(4, 2, dtype=D, generator=torch.Generator().manual_seed(3))

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _det_of(det):
    def f(A):
        return det(A) * W + A.sum(0)
    return f


def _scatter_prod(a, include_self):
    return torch.full((4,), 1.5, dtype=D).scatter_reduce(0, IDX, a, "prod",
                                                         include_self=include_self)


def _triangular(a):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (deprecated)
        return torch.triangular_solve(B, a).solution


def _positive(seed, zeros=False):
    x = torch.rand(16, dtype=D, generator=torch.Generator().manual_seed(seed)) + 0.5
    if zeros:
        x[[3, 10]] = 0.0
    return x


# (name, f, x): every entry of WRONG_FORWARD that can be built, at the points its formula
# is wrong
CASES = [
    ("det-singular", _det_of(torch.linalg.det), SINGULAR),
    ("det-rank-2", _det_of(torch.linalg.det), RANK_2),
    ("det-regular", _det_of(torch.linalg.det), REGULAR),
    ("torch.det", _det_of(torch.det), SINGULAR),
    ("Tensor.det", _det_of(torch.Tensor.det), SINGULAR),
    ("scatter-prod", functools.partial(_scatter_prod, include_self=False), _positive(0)),
    ("scatter-prod-self", functools.partial(_scatter_prod, include_self=True), _positive(1)),
    ("scatter-prod-zeros", functools.partial(_scatter_prod, include_self=True),
     _positive(2, zeros=True)),
    ("triangular-solve", _triangular, TRI),
]


def _central(f, x, t, eps=1e-6):
    return (f(x + eps * t) - f(x - eps * t)) / (2 * eps)


def _reference(f, x, t):
    J = torch.func.jacrev(f)(x)
    return (J.reshape(-1, x.numel()) @ t.reshape(-1)).reshape(J.shape[:J.dim() - x.dim()])


def _tangents(x, k=None, seed=7):
    shape = x.shape if k is None else (k, *x.shape)
    return torch.randn(shape, dtype=D, generator=torch.Generator().manual_seed(seed))


def _jvp(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        return tv.jvp(*args, **kwargs)


@pytest.mark.parametrize("has_aux", [False, True], ids=["plain", "has_aux"])
@pytest.mark.parametrize("name,f,x", CASES, ids=[c[0] for c in CASES])
def test_jvp_is_right_where_forward_mode_is_wrong(name, f, x, has_aux):
    t = _tangents(x)
    g = (lambda a: (f(a), a.sum())) if has_aux else f
    for _ in range(2):  # (the first call reads f's graph, the second remembers)
        res = _jvp(g, (x,), (t,), has_aux=has_aux)
        out, jt = res[0], res[1]
        assert torch.equal(out, f(x))
        torch.testing.assert_close(jt, _reference(f, x, t))
        torch.testing.assert_close(jt, _central(f, x, t), rtol=1e-6, atol=1e-6)
        if has_aux:
            assert torch.equal(res[2], x.sum())


@pytest.mark.parametrize("chunk_size", [None, 1, 2, 1000])
@pytest.mark.parametrize("has_aux", [False, True], ids=["plain", "has_aux"])
@pytest.mark.parametrize("name,f,x", CASES, ids=[c[0] for c in CASES])
def test_batched_jvp_is_right_where_forward_mode_is_wrong(name, f, x, has_aux, chunk_size):
    T = _tangents(x, k=3)
    g = (lambda a: (f(a), a.sum())) if has_aux else f
    for _ in range(2):
        res = _jvp(g, (x,), (T,), batched=True, chunk_size=chunk_size, has_aux=has_aux)
        assert torch.equal(res[0], f(x))
        ref = torch.stack([_reference(f, x, t) for t in T])
        torch.testing.assert_close(res[1], ref)
        torch.testing.assert_close(res[1], torch.stack([_central(f, x, t) for t in T]),
                                   rtol=1e-6, atol=1e-6)


def test_torchs_own_forward_formulas_are_wrong_in_these_cases():
    # (the premise: if torch fixes a formula, its entry in WRONG_FORWARD is to go)
    for name, f, x in CASES:
        if name == "det-regular":
            continue
        t = _tangents(x)
        assert (torch.func.jvp(f, (x,), (t,))[1] - _reference(f, x, t)).abs().max() > 1e-3, name


def test_the_warning_says_why_once_per_function():
    f = _det_of(torch.linalg.det)
    _, said = caught(lambda: tv.jvp(f, (SINGULAR,), (_tangents(SINGULAR),)))
    assert len(said) == 1 and said[0].startswith(
        "torch_vjp.jvp: torch's forward-mode formula of torch.linalg.det is wrong at singular")
    for words in ("so J t was computed by reverse over reverse instead",
                  "about twice a vjp's cost, where forward mode costs about one",
                  "J t is computed this way at every point",
                  "This warning is shown once per function."):
        assert words in said[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        tv.jvp(f, (REGULAR,), (_tangents(REGULAR),))
        tv.jvp(f, (SINGULAR,), (_tangents(SINGULAR, k=2),), batched=True)


def test_f_is_called_once_more_on_the_first_call_only_from_the_same_draws():
    calls = []

    def f(A):
        calls.append(1)
        return torch.linalg.det(F.dropout(A, 0.5)) * W

    t = _tangents(SINGULAR)
    for n in (2, 1, 1):
        calls.clear()
        torch.manual_seed(0)
        out, jt = _jvp(f, (SINGULAR,), (t,))
        after = torch.rand(1)
        assert len(calls) == n
        torch.manual_seed(0)
        assert torch.equal(out, f(SINGULAR))
        assert torch.equal(after, torch.rand(1))  # (the generators end as one call leaves them)
        torch.manual_seed(0)
        torch.testing.assert_close(jt, _reference(f, SINGULAR, t))


def test_a_write_f_makes_into_its_primal_is_made_once():
    def f(A):
        A.mul_(2)
        return torch.linalg.det(A) * W

    x = SINGULAR.clone()
    out, jt = _jvp(f, (x,), (_tangents(x),))
    torch.testing.assert_close(x, 2 * SINGULAR)
    torch.testing.assert_close(out, torch.linalg.det(2 * SINGULAR) * W)


def test_the_callers_tangents_are_never_handed_back():
    def f(A):
        return torch.linalg.det(A) * W, A

    t = _tangents(SINGULAR)
    keep = t.clone()
    for batched, v in ((False, t), (True, t.expand(2, 3, 3))):
        out, (jt, same) = _jvp(f, (SINGULAR,), (v,), batched=batched)
        torch.testing.assert_close(same, v)
        same.add_(1)
        assert torch.equal(t, keep)


def test_dtypes_and_a_differentiable_result_as_torch_func_jvps():
    w = torch.tensor(2.0, dtype=D, requires_grad=True)
    x32 = SINGULAR.float()
    out, jt = _jvp(lambda A: torch.linalg.det(A) * W.float(), (x32,), (_tangents(x32).float(),))
    assert out.dtype == jt.dtype == torch.float32
    out, jt = _jvp(lambda A: torch.linalg.det(A * w), (SINGULAR,), (_tangents(SINGULAR),))
    assert out.requires_grad and jt.requires_grad  # (through w, as torch.func.jvp's)
    (gw,) = torch.autograd.grad(jt, w)
    ref = torch.func.grad(lambda s: _reference(lambda A: torch.linalg.det(A * s), SINGULAR,
                                               _tangents(SINGULAR)))(w.detach())
    torch.testing.assert_close(gw, ref)
    with torch.no_grad():
        out, jt = _jvp(_det_of(torch.linalg.det), (SINGULAR,), (_tangents(SINGULAR),))
    torch.testing.assert_close(jt, _reference(_det_of(torch.linalg.det), SINGULAR,
                                              _tangents(SINGULAR)))


def test_the_first_call_s_check_warns_nothing_of_torch_s():
    # (the dot-product test of the first call read a number off a tensor requiring grad,
    # and torch's "Converting a tensor with requires_grad=True to a scalar" reached the user)
    w = torch.tensor(2.0, dtype=D, requires_grad=True)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        tv.jvp(lambda A: torch.linalg.det(A * w), (SINGULAR,), (_tangents(SINGULAR),))
    assert [str(g.message)[:60] for g in got if g.category is not tv.JacobianWarning] == []


def _unpool(repeat):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 1, 4, 4, dtype=D, generator=g)
    v, idx = F.max_pool2d(x, 2, return_indices=True)
    if repeat:
        idx = idx.clone()
        idx.view(-1)[1] = idx.view(-1)[0]
    return (lambda a: F.max_unpool2d(a, idx, 2, output_size=x.shape[-2:])), v


def test_max_unpool_keeps_forward_mode_whose_formula_is_right():
    # (its backward is the wrong one where indices repeat: forward mode, no warning)
    f, v = _unpool(True)
    t = _tangents(v)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        out, jt = tv.jvp(f, (v,), (t,))
    torch.testing.assert_close(jt, _central(f, v, t))
    torch.testing.assert_close(jt, torch.func.jvp(f, (v,), (t,))[1])


@pytest.mark.parametrize("repeat", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_det_and_max_unpool_refused_only_where_both_formulas_are_wrong(repeat, batched):
    unpool, v = _unpool(repeat)

    def f(a):
        return torch.linalg.det(unpool(a)[0, 0, :3, :3] + torch.eye(3, dtype=D)) * W

    t = _tangents(v, k=2 if batched else None)
    for _ in range(2):
        if not repeat:
            out, jt = _jvp(f, (v,), (t,), batched=batched)
            ref = torch.stack([_reference(f, v, s) for s in t]) if batched else \
                _reference(f, v, t)
            torch.testing.assert_close(jt, ref)
            continue
        with pytest.raises(tv.JacobianCallError) as info:
            _jvp(f, (v,), (t,), batched=batched)
        msg = str(info.value)
        assert msg.startswith("torch_vjp.jvp: torch's forward-mode formula of "
                              "torch.linalg.det is wrong at singular")
        assert ("but f (test_det_and_max_unpool_refused_only_where_both_formulas_are_wrong."
                "<locals>.f) also runs torch.nn.functional.max_unpool2d") in msg
        assert "so J t would be wrong either way" in msg
        assert "Fix: compute one of the two operators another way in f" in msg


def _no_grad_side(A):
    with torch.no_grad():
        side = A.sin()
    return torch.linalg.det(A) * W, side


# (a backward that records no graph under torch.func, without an error; forward mode right)
_ONCE = twice_with(torch.autograd.function.once_differentiable(lambda ctx, g: g * 2))

# (id, f, what the message says): where reverse over reverse is wrong too
REFUSALS = [
    ("output-without-grad", _no_grad_side,
     ["so J t is computed by reverse over reverse, but f's (_no_grad_side) output 1 (flat) "
      "(shape (3, 3)) does not require grad",
      "under torch.no_grad() or .detach() inside f",
      "Fix: return that tensor as aux (has_aux=True)"]),
    ("once-differentiable", lambda A: torch.linalg.det(_ONCE.apply(A)) * W,
     ["which differentiates f's backward pass, and it disagrees with that backward pass",
      "the dot-product test <u, J t> = <u^T J, t> at random u and t is off by",
      "a backward in f (<lambda>) records no graph (a custom autograd.Function with "
      "@once_differentiable", "so J t would be wrong there",
      "Fix: make that backward differentiable"]),
]


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("name,f,said", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refused_where_reverse_over_reverse_is_wrong_too(name, f, said, batched):
    t = _tangents(REGULAR, k=2 if batched else None)
    with pytest.raises(tv.JacobianCallError) as info:
        _jvp(f, (REGULAR,), (t,), batched=batched)
    msg = str(info.value)
    assert msg.startswith("torch_vjp.jvp: torch's forward-mode formula of torch.linalg.det "
                          "is wrong at singular")
    for words in said:
        assert words in msg


def test_an_error_of_fs_own_in_the_call_by_reverse_passes_through():
    calls = []

    def f(A):
        calls.append(1)
        if len(calls) == 2:  # (the call of reverse over reverse)
            raise KeyError("f's own")
        return torch.linalg.det(A) * W

    with pytest.raises(KeyError, match="f's own"):
        _jvp(f, (SINGULAR,), (_tangents(SINGULAR),))


@pytest.mark.usefixtures("fresh_dynamo", "aot_eager_unless_inductor")
@pytest.mark.parametrize("batched", [False, True])
def test_compile_keeps_a_signature_eager_where_j_t_is_computed_by_reverse(batched):
    # (a program compiled at a regular matrix, with forward mode, was wrong at a later
    # singular one by 8.6)
    f = _det_of(torch.linalg.det)
    t = _tangents(REGULAR, k=2 if batched else None)
    _, said = caught(lambda: tv.jvp(f, (REGULAR,), (t,), batched=batched, compile=True))
    assert any("compile=True could not compile the computation for" in m
               and "so J t is computed by reverse over reverse, eagerly; the compiled "
                   "program computes with forward mode" in m for m in said), said
    for A in (REGULAR, SINGULAR, RANK_2):
        _, jt = _jvp(f, (A,), (t,), batched=batched, compile=True)
        ref = torch.stack([_reference(f, A, s) for s in t]) if batched else \
            _reference(f, A, t)
        torch.testing.assert_close(jt, ref)


def test_inside_an_outer_vmap_and_grad():
    f = _det_of(torch.linalg.det)
    t = _tangents(SINGULAR)
    As = torch.stack([SINGULAR, RANK_2, REGULAR])
    got = torch.func.vmap(lambda A: _jvp(f, (A,), (t,))[1])(As)
    torch.testing.assert_close(got, torch.stack([_reference(f, A, t) for A in As]))
    g = torch.func.grad(lambda A: _jvp(f, (A,), (t,))[1].sum())(SINGULAR)
    torch.testing.assert_close(g, torch.func.grad(lambda A: _reference(f, A, t).sum())(SINGULAR))
