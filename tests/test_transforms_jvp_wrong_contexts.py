"""torch_vjp.jvp through an operator whose forward-mode formula torch (2.13) has wrong
(torch.linalg.det at a singular matrix, scatter_reduce(reduce='prod')), called inside the
user's own torch.compile (NOTE [J t by reverse over reverse, traced]) and under
torch.inference_mode() / torch.no_grad() (NOTE [J t by reverse over reverse in inference
mode]). float64, against torch.func.jacrev(f)(x) @ t and central differences (not
torch.autograd.functional.jacobian, whose det backward outside grad mode is zeros at a
singular matrix)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import torch_vjp as tv

D = torch.float64
W = torch.arange(1.0, 4.0, dtype=D)
SINGULAR = torch.tensor([[1., 2, 3], [0, 0, 0], [4, 5, 7]], dtype=D)
RANK_2 = torch.tensor([[1., 2, 3], [4, 5, 6], [7, 8, 9]], dtype=D)
REGULAR = torch.randn(3, 3, dtype=D, generator=torch.Generator().manual_seed(4))
IDX = torch.tensor([0, 1, 1, 2, 2, 0, 3, 3] * 2)

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _det(A):
    return torch.linalg.det(A) * W + A.sum(0)


def _scatter(a):
    return torch.full((4,), 1.5, dtype=D).scatter_reduce(0, IDX, a, "prod", include_self=False)


def _tangents(x, k=None, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(((k,) if k else ()) + x.shape, dtype=D, generator=g)


def _reference(f, x, t):
    J = torch.func.jacrev(f)(x)
    return (J.reshape(-1, x.numel()) @ t.reshape(-1)).reshape(J.shape[:J.dim() - x.dim()])


def _references(f, x, t, batched):
    return torch.stack([_reference(f, x, s) for s in t]) if batched else _reference(f, x, t)


def _central(f, x, t, eps=1e-6):
    return (f(x + eps * t) - f(x - eps * t)) / (2 * eps)


def _quiet(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        return fn(*args)


POINTS = [("det-singular", _det, SINGULAR), ("det-rank-2", _det, RANK_2),
          ("det-regular", _det, REGULAR),
          ("scatter-prod", _scatter, torch.rand(16, dtype=D,
                                                generator=torch.Generator().manual_seed(0)) + .5)]


def test_the_references_agree_and_forward_mode_is_wrong_at_a_singular_matrix():
    t = _tangents(SINGULAR)
    torch.testing.assert_close(_reference(_det, SINGULAR, t), _central(_det, SINGULAR, t))
    assert not torch.allclose(torch.func.jvp(_det, (SINGULAR,), (t,))[1],
                              _reference(_det, SINGULAR, t))


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name,f,x,batched", [
    (*POINTS[0], False), (*POINTS[0], True), (*POINTS[1], False), (*POINTS[2], True)],
    ids=["det-singular", "det-singular-batched", "det-rank-2", "det-regular-batched"])
def test_inside_the_users_torch_compile(name, f, x, batched):
    # (the plain form, torch.func.jvp, returned J t = 0 at the singular matrix, 11.7 off.
    # fullgraph=True: one graph, so the same trace as without it, and a graph break fails;
    # scatter-prod: test_inside_the_users_torch_compile_scatter_prod_is_refused)
    t = _tangents(x, k=3 if batched else None)
    compiled = torch.compile(
        lambda x, t: tv.jvp(f, (x,), (t,), batched=batched, chunk_size=2 if batched else None),
        backend="aot_eager", fullgraph=True)
    out, jt = _quiet(compiled, x, t)
    torch.testing.assert_close(out, f(x))
    torch.testing.assert_close(jt, _references(f, x, t, batched))
    with torch.no_grad():
        out, jt = _quiet(compiled, x, t)
    torch.testing.assert_close(jt, _references(f, x, t, batched))
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("fullgraph", [False, True])
def test_inside_the_users_torch_compile_scatter_prod_is_refused(fullgraph):
    # (forward mode's J t came back wrong without a word; reverse over reverse fails in
    # torch's compiler, a raw BackendCompilerFailed)
    x = POINTS[-1][2]
    t = _tangents(x)
    compiled = torch.compile(lambda x, t: tv.jvp(_scatter, (x,), (t,)), backend="aot_eager",
                             fullgraph=fullgraph)
    # (with fullgraph=True, dynamo raises its own error where an exception is raised where
    # it traces, and quotes it)
    with pytest.raises(Exception) as info:
        _quiet(compiled, x, t)
    expected = (
        "torch_vjp.jvp: torch's forward-mode formula of torch.scatter_reduce(reduce='prod') "
        "is wrong for the source, and for the tensor scattered into with "
        "include_self=True (errors of the size of the entries), which f (_scatter) computes "
        "from the primals, so J t is computed by reverse over reverse there; but this call "
        "runs inside torch.compile, whose compiler cannot trace the double backward of "
        "torch.scatter_reduce(reduce='prod') (torch 2.13's AOT tracing fails on it), so "
        "J t cannot be computed inside the compiled function.\n"
        "  Fix: call torch_vjp.jvp outside the compiled function, or inside it through "
        "torch.compiler.disable (a graph break: not with fullgraph=True); "
        "torch_vjp.jvp(..., compile=True) at top level computes it eagerly.")
    if fullgraph:
        assert repr(tv.JacobianCallError(expected)) in str(info.value)
    else:
        assert type(info.value) is tv.JacobianCallError
        assert str(info.value) == expected
    # (the fixes it names compute it)
    if not fullgraph:
        eager_jvp = torch.compiler.disable(lambda x, t: tv.jvp(_scatter, (x,), (t,)))
        _, jt = _quiet(torch.compile(lambda x, t: eager_jvp(x, t), backend="aot_eager"), x, t)
        torch.testing.assert_close(jt, _reference(_scatter, x, t))
    _, jt = _quiet(lambda: tv.jvp(_scatter, (x,), (t,), compile=True))
    torch.testing.assert_close(jt, _reference(_scatter, x, t))


@pytest.mark.usefixtures("fresh_dynamo")
def test_inside_the_users_torch_compile_other_outputs_and_aux():
    # (a constant, an integer output, the input itself, a value computed under no_grad:
    # each with the tangent torch.func.jvp gives it; the aux as f returns it)
    def f(A):
        with torch.no_grad():
            side = A.sin()
        out = {"det": _det(A), "ones": torch.ones(3, dtype=D), "int": torch.arange(3),
               "side": side, "self": A}
        return out, {"n": A.norm()}

    t = _tangents(SINGULAR)
    compiled = torch.compile(lambda x, t: tv.jvp(f, (x,), (t,), has_aux=True),
                             backend="aot_eager", fullgraph=True)
    out, jt, aux = _quiet(compiled, SINGULAR, t)
    torch.testing.assert_close(jt["det"], _reference(_det, SINGULAR, t))
    expected = torch.func.jvp(f, (SINGULAR,), (t,), has_aux=True)
    for key in ("ones", "int", "side", "self"):
        torch.testing.assert_close(jt[key], expected[1][key])
        torch.testing.assert_close(out[key], expected[0][key])
    torch.testing.assert_close(aux["n"], SINGULAR.norm())


@pytest.mark.usefixtures("fresh_dynamo")
def test_inside_the_users_torch_compile_without_a_wrong_operator_still_forward_mode():
    f = lambda x: torch.tanh(x) * 2  # noqa: E731
    x, t = REGULAR, _tangents(REGULAR)
    compiled = torch.compile(lambda x, t: tv.jvp(f, (x,), (t,)), backend="aot_eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(x, t)[1], torch.func.jvp(f, (x,), (t,))[1])


@pytest.mark.parametrize("inputs_inside", [False, True])
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("name,f,x", POINTS, ids=[p[0] for p in POINTS])
def test_in_inference_mode_on_the_first_call(name, f, x, batched, compile, inputs_inside,
                                             request):
    # (the first call in inference mode skipped the reading of f's graph, and forward
    # mode's J t = 0 at the singular matrix came back, and was right on later calls only
    # where an earlier call outside the mode had read it)
    if compile:
        request.getfixturevalue("fresh_dynamo")
        request.getfixturevalue("aot_eager_unless_inductor")
    t = _tangents(x, k=3 if batched else None)
    for _ in range(2):
        with torch.inference_mode():
            xs, ts = (x.clone(), t.clone()) if inputs_inside else (x, t)
            out, jt = _quiet(lambda: tv.jvp(f, (xs,), (ts,), batched=batched,
                                            compile=compile))
        torch.testing.assert_close(jt, _references(f, x, t, batched))
        torch.testing.assert_close(out, f(x))
        assert not jt.requires_grad


@pytest.mark.parametrize("batched", [False, True])
def test_under_no_grad_on_the_first_call(batched):
    t = _tangents(SINGULAR, k=3 if batched else None)
    with torch.no_grad():
        _, jt = _quiet(lambda: tv.jvp(_det, (SINGULAR,), (t,), batched=batched))
    torch.testing.assert_close(jt, _references(_det, SINGULAR, t, batched))
