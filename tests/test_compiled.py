"""compile=True, and torch_vjp's calls inside the user's torch.compile
(torch_vjp/_engine/compiled.py; NOTE [compiled Jacobians]).

Every result is checked in float64 against torch.func (an independent reference) and
against the eager call; dynamo's counters show what was compiled, and how often."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import torch_vjp as tv

D = torch.float64


pytestmark = pytest.mark.usefixtures("fresh_dynamo", "aot_eager_unless_inductor")  # conftest


#: The backend of the tests' own ``torch.compile`` of a function that calls torch_vjp,
#: whose point is what dynamo traces of it (no graph break, no recompile, the eager errors):
#: aot_eager, which compiles no C++ (the per-sample tests inside the user's compile keep
#: inductor, for the numerics through it).
_USERS_BACKEND = "aot_eager"


def _mlp(n_in, n_out, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(16, n_in, dtype=D, generator=g)
    w2 = torch.randn(n_out, 16, dtype=D, generator=g)
    return lambda x: torch.tanh(w2 @ torch.tanh(w1 @ x))


class _Box:  # (a plain object of the user's: counted in a key by identity, and held
    __slots__ = ("batch",)  # strongly, as it has no weak references: its id stays its own)

    def __init__(self, batch):
        self.batch = batch


def _frames():
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("strategy,n_in,n_out", [
    ("auto", 3, 40), ("auto", 40, 3), ("rev", 6, 5), ("fwd", 6, 5),
])
@pytest.mark.usefixtures("inductor")
def test_jacobian_compiled_once_and_reused(strategy, n_in, n_out):
    f = _mlp(n_in, n_out)
    for k in range(4):
        x = torch.randn(n_in, dtype=D)
        got = tv.jacobian(f, x, strategy=strategy, compile=True)
        torch.testing.assert_close(got, torch.func.jacrev(f)(x))
        assert not got.requires_grad
    assert _frames() == 1  # one program, compiled once, reused by calls 2 to 4


def test_a_lambda_written_in_a_loop_finds_its_entry():
    w = torch.randn(4, 3, dtype=D)
    for _ in range(3):
        x = torch.randn(3, dtype=D)
        got = tv.jacobian(lambda x: torch.sin(w @ x), x, compile=True)
        torch.testing.assert_close(got, torch.cos(w @ x)[:, None] * w)
    assert _frames() == 1


def test_inputs_of_two_memory_layouts_each_keep_their_program():
    # (the key left strides out while dynamo's guards hold them: every call that switched
    # between a tensor and a transpose of the same shape recompiled, eager call and check
    # included, and the eighth went eager for good, blaming "a global")
    from torch_vjp._engine.compiled import builds

    w = torch.randn(4, 3, dtype=D)
    f = lambda x: torch.sin(x) * w  # noqa: E731
    before = builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for k in range(4):
            x = torch.randn(4, 3, dtype=D) if k % 2 else torch.randn(3, 4, dtype=D).t()
            got = tv.jacobian(f, x, compile=True)
            torch.testing.assert_close(got, torch.func.jacrev(f)(x))
    assert builds() - before == 2  # one program per layout, each reused


@pytest.mark.parametrize("kind", ["inference", "conj"])
def test_inference_tensors_and_conjugate_views_each_keep_their_program(kind):
    # (the key left out the dispatch bits dynamo's guards hold: every call that switched
    # between a tensor made under inference_mode (or a conjugate view) and a plain one
    # recompiled the entry, eager call and check included, and the eighth went eager for
    # good, blaming "a global")
    from torch_vjp._engine.compiled import builds

    dtype = D if kind == "inference" else torch.complex128
    w = torch.randn(3, 3, dtype=dtype)
    f = lambda x: (w @ x) * x  # noqa: E731
    before = builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for k in range(4):
            x, t = torch.randn(3, dtype=dtype), torch.randn(3, dtype=dtype)
            if k % 2 and kind == "conj":
                x = x.conj()
            elif k % 2:
                with torch.inference_mode():
                    x = torch.randn(3, dtype=dtype)
            out, got = tv.jvp(f, (x,), (t,), compile=True)
            want = torch.func.jvp(f, (x.resolve_conj().clone(),), (t,))
            torch.testing.assert_close((out, got), want)
    assert builds() - before == 2  # one program per kind of tensor, each reused


def test_a_training_mode_call_leaves_the_eval_mode_program_compiled():
    # (the key left the training flag to dynamo's guard: one call in training mode
    # recompiled the eval-mode entry, dropout's draws failed its check, and every later
    # eval-mode call of that key ran eagerly)
    from torch_vjp._engine import compiled

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.5),
                                torch.nn.Tanh()).double()
    x = torch.randn(4, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)  # (training mode's, stays eager)
        for mode in ("eval", "train", "eval"):
            getattr(model, mode)()
            got = tv.jacobian(model, x, compile=True)
        # (the training-mode entry eager, the eval-mode one compiled, and used)
        assert [e.run is not None for e in compiled._CACHE.values()] == [False, True]
        before = compiled.builds()
        torch.testing.assert_close(tv.jacobian(model, x, compile=True), got)
        assert compiled.builds() == before
    torch.testing.assert_close(got, torch.func.jacrev(model)(x))


def test_a_submodule_switched_to_training_alone_leaves_the_eval_mode_program_compiled():
    # (the key held the training flags of the modules f reaches, not of their submodules:
    # ``model[1].train()`` alone recompiled the eval-mode entry under dynamo's guard, the
    # dropout draws failed its check, and the eval-mode calls after ``model[1].eval()``
    # ran eagerly for good)
    from torch_vjp._engine import compiled

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Dropout(0.5),
                                torch.nn.Linear(6, 3)).double().eval()
    f = lambda x: model(x)  # noqa: E731
    x = torch.randn(4, dtype=D)
    want = torch.func.jacrev(f)(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)  # (training mode's, stays eager)
        torch.testing.assert_close(tv.jacobian(f, x, compile=True), want)
        model[1].train()
        assert not torch.allclose(tv.jacobian(f, x, compile=True), want)  # (dropout draws)
        model[1].eval()
        torch.testing.assert_close(tv.jacobian(f, x, compile=True), want)
    assert [e.run is not None for e in compiled._CACHE.values()] == [False, True]
    before = compiled.builds()
    torch.testing.assert_close(tv.jacobian(f, x, compile=True), want)
    assert compiled.builds() == before


def test_a_training_mode_call_leaves_the_eval_mode_program_of_a_model_argument_compiled():
    # (the key held the training flags of the modules f reaches, not of a model passed as
    # an argument that is not differentiated: one training-mode call recompiled the
    # eval-mode entry, dropout's draws failed its check, and eval mode ran eagerly after)
    from torch_vjp._engine import compiled

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.5),
                                torch.nn.Tanh()).double()
    x = torch.randn(4, dtype=D)
    f = lambda x, m: m(x)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)  # (training mode's, stays eager)
        for mode in ("eval", "train", "eval"):
            getattr(model, mode)()
            got = tv.jacobian(f, x, model, argnums=0, compile=True)
        assert [e.run is not None for e in compiled._CACHE.values()] == [False, True]
        before = compiled.builds()
        torch.testing.assert_close(tv.jacobian(f, x, model, argnums=0, compile=True), got)
        assert compiled.builds() == before
    torch.testing.assert_close(got, torch.func.jacrev(model)(x))


def test_new_signature_compiles_a_new_entry_and_inplace_closure_changes_are_seen():
    w = torch.randn(4, 3, dtype=D)
    f = lambda x: w @ x  # noqa: E731
    tv.jacobian(f, torch.randn(3, dtype=D), compile=True)
    tv.jacobian(f, torch.randn(3, dtype=D), compile=True)
    w.mul_(2)  # the compiled program reads w's current values
    torch.testing.assert_close(tv.jacobian(f, torch.randn(3, dtype=D), compile=True), w)
    g = lambda x: torch.sin(x) * 2  # noqa: E731
    tv.jacobian(g, torch.randn(3, dtype=D), compile=True)
    tv.jacobian(g, torch.randn(5, dtype=D), compile=True)  # another shape: its own entry
    torch.testing.assert_close(tv.jacobian(g, torch.zeros(5, dtype=D), compile=True),
                               2 * torch.eye(5, dtype=D))


def test_containers_of_primals_are_keyed_by_structure_and_signature():
    # a dict of parameters (keyed without pytree), a list, and an OrderedDict (pytree's key)
    from collections import OrderedDict

    x = torch.randn(5, 3, dtype=D)

    def f(p):
        return torch.tanh(x @ p["w"].T + p["b"])

    def params(n):
        return {"w": torch.randn(n, 3, dtype=D), "b": torch.randn(n, dtype=D)}

    for p in (params(4), params(4), params(2), {"b": torch.randn(4, dtype=D),
                                                "w": torch.randn(4, 3, dtype=D)},
              OrderedDict(params(4))):
        got = tv.jacobian(f, p, compile=True)
        ref = torch.func.jacrev(f)(p)
        assert type(got) is type(p) and list(got) == list(p)
        for k in p:
            torch.testing.assert_close(got[k], ref[k])
    assert _frames() == 4  # 4 rows, 4 columns / 2 rows / keys in another order / OrderedDict
    g = lambda ws: ws[0] * ws[1].sum()  # noqa: E731
    for ws in ([torch.randn(3, dtype=D), torch.randn(2, dtype=D)],
               (torch.randn(3, dtype=D), torch.randn(2, dtype=D))):
        torch.testing.assert_close(tv.jacobian(g, ws, compile=True), torch.func.jacrev(g)(ws))


@torch._dynamo.config.patch(recompile_limit=3)  # (from 8: met with fewer compilations)
def test_more_functions_than_dynamos_recompile_limit_all_compile():
    limit = torch._dynamo.config.recompile_limit
    fs = [(lambda k: (lambda x: torch.sin(x) * k))(float(k)) for k in range(limit + 3)]
    x = torch.randn(4, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for k, f in enumerate(fs):
            torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                       torch.diag(torch.cos(x) * k))
            torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                       torch.diag(torch.cos(x) * k))
    assert _frames() == len(fs)


@pytest.mark.parametrize("name", ["jacobian", "batch_jacobian", "hessian"])
def test_a_closure_over_a_new_batch_each_call_reuses_one_program(name):
    x = torch.randn(2, 3, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for k in range(4):
            batch = torch.randn(3, dtype=D)
            scale = 2.0  # a number: by value
            if name == "hessian":
                f = lambda x: (torch.sin(x * batch) * scale).sum()  # noqa: E731
                ref = torch.func.hessian(f)(x)
            else:
                f = lambda x: (torch.sin(x * batch) * scale).sum(-1)  # noqa: E731 - new
                ref = (torch.func.jacrev(f) if name == "jacobian"
                       else torch.func.vmap(torch.func.jacrev(f)))(x)
            got = getattr(tv, name)(f, x, compile=True)
            torch.testing.assert_close(got, ref)  # this step's batch, not the first one's
    assert _frames() == 1


def test_a_closure_over_a_function_made_for_each_batch_reuses_one_program():
    def make_loss(batch):
        return lambda w: torch.sin(w @ batch)

    w = torch.randn(4, 3, dtype=D)
    for k in range(4):
        batch = torch.randn(3, dtype=D)
        loss = make_loss(batch)
        got = tv.jacobian(lambda w: loss(w), w, compile=True)
        torch.testing.assert_close(got, torch.func.jacrev(loss)(w))
    assert _frames() == 1


def test_a_function_whose_closure_holds_itself_is_keyed_without_end():
    def outer():
        def f(x, n=2):
            return torch.sin(x) if n == 0 else f(x, n - 1) * 1.0
        return f

    f = outer()
    x = torch.randn(3, dtype=D)
    torch.testing.assert_close(tv.jacobian(f, x, compile=True), torch.diag(torch.cos(x)))
    torch.testing.assert_close(tv.jacobian(f, x, compile=True), torch.diag(torch.cos(x)))


def test_vjp_and_jvp_read_the_closure_of_each_call():
    x = torch.randn(3, dtype=D)
    for k in range(3):
        w = torch.randn(4, 3, dtype=D)
        out, vjp_fn = tv.vjp(lambda x: w @ x, x, compile=True)
        v = torch.randn(4, dtype=D)
        torch.testing.assert_close(vjp_fn(v), (w.T @ v,))
        t = torch.randn(3, dtype=D)
        _, jt = tv.jvp(lambda x: w @ x, (x,), (t,), compile=True)
        torch.testing.assert_close(jt, w @ t)


@pytest.mark.parametrize("name", ["jacobian", "batch_jacobian"])
def test_a_closure_over_new_objects_each_call_is_warned_once_with_the_fix(name):
    from torch_vjp._engine.compiled import REBUILD_WARN_AT

    x = torch.randn(2, 3, dtype=D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(REBUILD_WARN_AT + 1):
            data = _Box(batch=torch.randn(3, dtype=D))  # a new object: known by identity
            f = lambda x: torch.sin(x * data.batch)  # noqa: E731
            got = getattr(tv, name)(f, x, compile=True)
            ref = torch.func.jacrev(f)(x)
            if name == "batch_jacobian":
                ref = torch.stack([ref[i, :, i] for i in range(2)])
            torch.testing.assert_close(got, ref)
    msgs = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    assert len(msgs) == 1, msgs
    assert f"torch_vjp.{name}: compile=True has compiled" in msgs[0]
    assert f"{REBUILD_WARN_AT} times for the same argument signature" in msgs[0]
    assert "closure" in msgs[0] and "compile=False" in msgs[0]
    if name == "jacobian":
        assert "jacobian(lambda w, batch: loss(w, batch), w, batch, argnums=0)" in msgs[0]
    else:
        assert "define the function once, outside the loop" in msgs[0]


def test_after_the_warning_new_closures_run_eagerly_and_one_met_again_compiles():
    # (every call over new objects compiled a program that was never used again, a
    # fraction of a second to seconds each, after the warning too; now the later ones
    # run eagerly, and one whose objects a later call passes again is compiled then)
    from torch_vjp._engine.compiled import REBUILD_WARN_AT, builds

    x = torch.randn(3, dtype=D)

    def make(box):
        return lambda x: torch.sin(x * box.batch)

    before = builds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(REBUILD_WARN_AT + 4):
            f = make(_Box(batch=torch.randn(3, dtype=D)))  # a new object: by identity
            torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                       torch.func.jacrev(f)(x))
        assert builds() - before == REBUILD_WARN_AT  # (none after the warning)
        msgs = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
        assert len(msgs) == 1, msgs
        assert ("From now on a new such function runs eagerly, at compile=False's speed, "
                "and is compiled only if a later call passes it again") in msgs[0]
        kept = _Box(batch=torch.randn(3, dtype=D))  # settled: one object from now on
        for k in range(3):
            f = make(kept)
            torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                       torch.func.jacrev(f)(x))
            assert builds() - before == REBUILD_WARN_AT + (k >= 1)  # (compiled when met again)
        f = make(_Box(batch=torch.randn(3, dtype=D)))  # one of them reused: compiled again
        tv.jacobian(f, x, compile=True)
        assert builds() - before == REBUILD_WARN_AT + 2


_SCALE = [2.0]


def test_a_reused_entry_that_dynamo_recompiles_is_compiled_again_not_deferred():
    # (the entry a recompile makes anew was not counted as found again: among closures
    # over new objects, past the warning, it was deferred, ran eagerly, and compiled only
    # on the call after)
    from torch_vjp._engine import compiled

    x = torch.randn(3, dtype=D)

    def make(box):
        return lambda x: torch.sin(x * box.batch) * _SCALE[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        for _ in range(compiled.REBUILD_WARN_AT):
            tv.jacobian(make(_Box(batch=torch.randn(3, dtype=D))), x, compile=True)
        f = make(_Box(batch=torch.randn(3, dtype=D)))
        for _ in range(2):  # (deferred, then compiled when found again)
            tv.jacobian(f, x, compile=True)
        before = compiled.builds()
        _SCALE[0] = 3.0  # (a global f reads: dynamo recompiles the entry)
        try:
            torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                       torch.func.jacrev(f)(x))
            assert compiled.builds() - before == 1
        finally:
            _SCALE[0] = 2.0


def test_new_closures_after_the_warning_leave_other_programs_in_the_cache():
    # (each new closure made an entry of its own: a stream of them pushed every other
    # function's program out of the cache, least recently used first, and each compiled
    # again, for seconds, when next called)
    from torch_vjp._engine import compiled

    x = torch.randn(3, dtype=D)
    g = lambda x: torch.cos(x) * 2  # noqa: E731  (another function, compiled first)
    tv.jacobian(g, x, compile=True)
    before = compiled.builds()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        for _ in range(compiled.CACHE_MAX + 8):
            box = _Box(batch=torch.randn(3, dtype=D))  # a new object: by identity
            f = lambda x: torch.sin(x * box.batch)  # noqa: E731, B023
            torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                       torch.func.jacrev(f)(x))
    assert compiled.builds() - before == compiled.REBUILD_WARN_AT
    torch.testing.assert_close(tv.jacobian(g, x, compile=True), torch.func.jacrev(g)(x))
    assert compiled.builds() - before == compiled.REBUILD_WARN_AT  # (g's program kept)
    assert len(compiled._CACHE) <= 1 + compiled.REBUILD_WARN_AT + compiled.DEFERRED_KEPT


@pytest.mark.parametrize("holder", [dict, list, tuple])
def test_a_closure_over_a_new_batch_container_each_call_reuses_one_program(holder):
    # (a dict, list or tuple a closure holds was counted by its identity, and held
    # strongly: lambda w: loss(w, {"x": x, "y": y}) made for each step compiled a new
    # program on every call, and the cache kept every batch alive, up to CACHE_MAX)
    import gc
    import weakref

    from torch_vjp._engine.compiled import builds

    def loss(w, batch):
        x, y = (batch["x"], batch["y"]) if holder is dict else batch
        return (x @ w - y).pow(2)

    def step():
        x, y = torch.randn(5, 3, dtype=D), torch.randn(5, dtype=D)
        batch = {"x": x, "y": y} if holder is dict else holder((x, y))
        w = torch.randn(3, dtype=D)
        f = lambda w: loss(w, batch)  # noqa: E731
        torch.testing.assert_close(tv.jacobian(f, w, compile=True), torch.func.jacrev(f)(w))
        return weakref.ref(x)

    before = builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        alive = [step() for _ in range(3)]
    gc.collect()
    assert builds() - before == 1
    assert [r() is None for r in alive] == [True] * 3


def test_the_fix_one_program_for_data_passed_as_an_argument_and_reused_closures_unwarned():
    from torch_vjp._engine.compiled import REBUILD_WARN_AT

    w = torch.randn(4, 3, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for _ in range(REBUILD_WARN_AT + 1):
            data = {"batch": torch.randn(3, dtype=D)}
            got = tv.jacobian(lambda w, b: torch.sin(w @ b), w, data["batch"], argnums=0,
                              compile=True)
            torch.testing.assert_close(
                got, torch.func.jacrev(lambda w: torch.sin(w @ data["batch"]))(w))
        assert _frames() == 1
        # closures over fixed objects (one per layer, say), each used again: no warning
        layers = [{"k": torch.tensor(float(k), dtype=D)} for k in range(REBUILD_WARN_AT)]
        fs = [(lambda d: (lambda x: torch.sin(x) * d["k"]))(d) for d in layers]
        x = torch.randn(3, dtype=D)
        for f in [fs[0], fs[0], *fs[1:], *fs]:
            tv.jacobian(f, x, compile=True)


def test_has_aux_tuple_argnums_and_pytree_output():
    def f(x, y):
        return {"a": x * y.sum(), "b": (x ** 2).sum()}, x.detach() + 1

    x, y = torch.randn(3, dtype=D), torch.randn(2, dtype=D)
    for _ in range(2):
        (jac, aux) = tv.jacobian(f, x, y, argnums=(0, 1), has_aux=True, compile=True)
        ref, ref_aux = torch.func.jacrev(f, (0, 1), has_aux=True)(x, y)
        torch.testing.assert_close(jac, ref)
        torch.testing.assert_close(aux, ref_aux)


@pytest.mark.usefixtures("inductor")
def test_create_graph_result_is_differentiable():
    w = torch.randn(3, 3, dtype=D, requires_grad=True)
    f = lambda x: torch.tanh(w @ x)  # noqa: E731
    x = torch.randn(3, dtype=D)
    with warnings.catch_warnings():  # (a filter of this test's own, not left behind)
        warnings.simplefilter("error", tv.JacobianWarning)
        for _ in range(2):
            jac = tv.jacobian(f, x, create_graph=True, compile=True)
            (g,) = torch.autograd.grad(jac.sum(), w)
            ref = torch.func.grad(lambda w_: torch.func.jacrev(
                lambda x_: torch.tanh(w_ @ x_))(x).sum())(w.detach())
            torch.testing.assert_close(g, ref)


@pytest.mark.usefixtures("inductor")
def test_batch_jacobian_hessian_jvp_vjp_compiled():
    f = _mlp(5, 4)
    fb = lambda x: torch.tanh(x @ torch.ones(5, 4, dtype=D) * 0.3)  # noqa: E731
    h = lambda x: f(x).pow(2).sum()  # noqa: E731
    for _ in range(2):
        x, xb = torch.randn(5, dtype=D), torch.randn(7, 5, dtype=D)
        t, tk = torch.randn(5, dtype=D), torch.randn(3, 5, dtype=D)
        c, ck = torch.randn(4, dtype=D), torch.randn(6, 4, dtype=D)
        ref_b = torch.vmap(torch.func.jacrev(lambda r: fb(r[None])[0]))(xb)
        for strategy in ("rev", "fwd"):
            torch.testing.assert_close(
                tv.batch_jacobian(fb, xb, strategy=strategy, compile=True), ref_b)
        torch.testing.assert_close(tv.hessian(h, x, compile=True), torch.func.hessian(h)(x))
        torch.testing.assert_close(tv.hessian(h, x, strategy="rev", compile=True),
                                   torch.func.hessian(h)(x))
        torch.testing.assert_close(tv.jvp(f, (x,), (t,), compile=True),
                                   torch.func.jvp(f, (x,), (t,)))
        out, cols = tv.jvp(f, (x,), (tk,), batched=True, compile=True)
        torch.testing.assert_close(cols, tk @ torch.func.jacfwd(f)(x).T)
        torch.testing.assert_close(out, f(x))
        out, vjp_fn = tv.vjp(f, x, compile=True)
        torch.testing.assert_close(vjp_fn(c), torch.func.vjp(f, x)[1](c))
        torch.testing.assert_close(vjp_fn(ck, batched=True)[0],
                                   ck @ torch.func.jacrev(f)(x))
    assert _frames() == 8


def test_the_fallback_warning_names_what_dynamo_stopped_at_and_where(capsys):
    # (it quoted dynamo's title alone: "Why: Unsupported: Failed to trace builtin operator",
    # neither the operator nor the line of f)
    def f(x):
        print("step")
        return torch.sin(x) * 2

    x = torch.randn(4, dtype=D)
    with pytest.warns(tv.JacobianWarning) as caught:
        torch.testing.assert_close(tv.jacobian(f, x, compile=True), torch.diag(2 * x.cos()))
    msg = next(str(w.message) for w in caught if "could not compile" in str(w.message))
    assert "builtin operator `print`" in msg
    assert f'line {f.__code__.co_firstlineno + 1}, in f: print("step")' in msg
    capsys.readouterr()


def test_the_fallback_reason_says_an_empty_compiler_error_is_torchs():
    # (inductor's failed assertions, here a Hessian of x[idx] ** 3 with compile=True, gave
    # "Why: InductorError: AssertionError: " and nothing more)
    from torch._inductor.exc import InductorError

    from torch_vjp._engine.compile_checks import compile_failure

    err = InductorError(AssertionError(""), None)  # (str: "AssertionError: ", then a hint)
    err.args = ("AssertionError: \n\nSet TORCHDYNAMO_VERBOSE=1 for the internal stack trace",)
    why = compile_failure(err)
    assert why.startswith("InductorError: AssertionError: (an internal error of "
                          "torch.compile with no message of its own, not an error of the "
                          "function")
    assert compile_failure(ValueError("bad value")) == "ValueError: bad value"


def test_uncompilable_function_falls_back_with_a_warning_that_says_why():
    def f(x):
        torch._dynamo.graph_break()  # what a call dynamo cannot trace does; eagerly nothing
        return torch.sin(x) * 2

    x = torch.randn(4, dtype=D)
    ref = torch.func.jacfwd(f)(x)
    with pytest.warns(tv.JacobianWarning, match=r"(?s)compile=True could not compile the "
                      r"computation for .*f, so it runs eagerly for this input signature\."
                      r".*Why: .*compile=False"):
        torch.testing.assert_close(tv.jacobian(f, x, compile=True), ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only; later calls run eagerly, silently
        torch.testing.assert_close(tv.jacobian(f, x, compile=True), ref)


def test_users_error_passes_through_untouched():
    class Mine(Exception):
        pass

    def f(x):
        raise Mine("from f")

    with pytest.raises(Mine, match="^from f$"):
        tv.jacobian(f, torch.randn(3, dtype=D), compile=True)


def test_option_errors():
    x = torch.randn(3, dtype=D, requires_grad=True)
    with pytest.raises(tv.JacobianOptionError,
                       match=r"compile='yes', but it must be True or False"):
        tv.jacobian(torch.sin, x, compile="yes")
    with pytest.raises(tv.JacobianOptionError, match=r"compile=True with strategy='rev-loop'"
                       r", but compile=True compiles the vectorised strategies only"):
        tv.jacobian(torch.sin, x, strategy="rev-loop", compile=True)
    with pytest.raises(tv.JacobianOptionError, match=r"compile=True, but jacobian_of reads "
                       r"the Jacobian from an autograd graph that was built before the call"):
        tv.jacobian_of(torch.sin(x), x, compile=True)


def test_max_memory_runs_eagerly_with_a_warning():
    x = torch.randn(3, dtype=D)
    with pytest.warns(tv.JacobianWarning, match="compile=True with max_memory runs eagerly"):
        got = tv.jacobian(torch.sin, x, max_memory="1MB", compile=True)
    torch.testing.assert_close(got, torch.diag(torch.cos(x)))
    assert _frames() == 0


def _inside_user_compile(fn, make_args, ref):
    compiled_fn = torch.compile(fn, backend=_USERS_BACKEND)
    for k in range(4):
        args = make_args(k)
        torch.testing.assert_close(compiled_fn(*args), ref(*args))
    return counters


@pytest.mark.parametrize("name", ["jacobian", "jacobian_auto_fwd", "batch_jacobian",
                                  "hessian", "jvp", "jvp_batched", "vjp", "vjp_batched"])
def test_inside_users_torch_compile_no_graph_break_no_recompile(name):
    f = _mlp(4, 6)
    fb = lambda x: torch.tanh(x * 2)  # noqa: E731
    t = torch.randn(4, dtype=D)
    tk = torch.randn(3, 4, dtype=D)
    c, ck = torch.randn(6, dtype=D), torch.randn(2, 6, dtype=D)
    cases = {
        "jacobian": (lambda x: tv.jacobian(f, x, strategy="rev"),
                     lambda x: torch.func.jacrev(f)(x)),
        "jacobian_auto_fwd": (lambda x: tv.jacobian(lambda v: f(v).repeat(30), x),
                              lambda x: torch.func.jacrev(lambda v: f(v).repeat(30))(x)),
        "batch_jacobian": (lambda x: tv.batch_jacobian(fb, x.reshape(2, 2)),
                           lambda x: torch.diag_embed(2 / torch.cosh(2 * x.reshape(2, 2)) ** 2)),
        "hessian": (lambda x: tv.hessian(lambda v: f(v).sum(), x),
                    lambda x: torch.func.hessian(lambda v: f(v).sum())(x)),
        "jvp": (lambda x: tv.jvp(f, (x,), (t,))[1], lambda x: torch.func.jvp(f, (x,), (t,))[1]),
        "jvp_batched": (lambda x: tv.jvp(f, (x,), (tk,), batched=True)[1],
                        lambda x: tk @ torch.func.jacfwd(f)(x).T),
        "vjp": (lambda x: tv.vjp(f, x)[1](c)[0], lambda x: torch.func.vjp(f, x)[1](c)[0]),
        "vjp_batched": (lambda x: tv.vjp(f, x)[1](ck, batched=True)[0],
                        lambda x: ck @ torch.func.jacrev(f)(x)),
    }
    fn, ref = cases[name]
    _inside_user_compile(fn, lambda k: (torch.randn(4, dtype=D) + k,), ref)
    assert counters["stats"]["unique_graphs"] == 1  # compiled once: no recompile
    assert sum(counters["graph_break"].values()) == 0  # and in one graph


def test_a_training_modules_buffers_are_left_as_they_were():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double().train()
    x = torch.randn(5, 3, dtype=D)
    before = {n: b.clone() for n, b in model.named_buffers()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tv.JacobianWarning)
        for _ in range(3):
            got = tv.jacobian(model, x, compile=True)
            torch.testing.assert_close(got, tv.jacobian(model, x, strategy="rev-loop"))
            for n, b in model.named_buffers():
                assert torch.equal(b, before[n]), n  # not even by the output-size probe
    # torch.func refuses the running statistics' in-place update inside a transform, so
    # the signature runs eagerly, as the warning says (the eager path loops, unchanged)
    assert sum("compile=True could not compile" in str(w.message) for w in caught) == 1


@pytest.mark.parametrize("call", ["jacobian", "jacobian-through-an-object", "per_sample_grads"])
def test_hooks_registered_or_removed_after_a_compiled_call_are_followed(call):
    # dynamo skips guards on empty module hook dicts by default; a compiled program
    # reused after a hook is added would leave the hook out of the result
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                torch.nn.Linear(4, 2)).double()
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)
    if call.startswith("jacobian"):
        class Trainer:  # the model reached through an object's attribute
            def __init__(self):
                self.net = model

            def step(self, t):
                return self.net(t)

        f = Trainer().step if call == "jacobian-through-an-object" else (lambda t: model(t))

        def compute(eager=False):
            kw = {"strategy": "rev-loop"} if eager else {"compile": True}
            return {"J": tv.jacobian(f, x, **kw)}
    else:
        def compute(eager=False):
            kw = {"strategy": "loop"} if eager else {"compile": True}
            return tv.per_sample_grads(model, torch.nn.MSELoss(), x, y, **kw)

    def check():
        got, ref = compute(), compute(eager=True)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k])
        return got

    plain = check()
    check()  # the compiled program, reused
    handle = model[1].register_forward_hook(lambda m, i, o: o * 2.0)
    hooked = check()
    assert not torch.allclose(hooked[next(iter(hooked))], plain[next(iter(plain))])
    handle.remove()
    check()
    handle = model[2].register_forward_pre_hook(lambda m, i: (i[0] * 3.0,))
    check()
    handle.remove()
    check()


def test_a_closure_tensor_that_is_the_primal_on_one_call_is_still_a_constant():
    # the same object as closure value and primal on one call, distinct objects on the
    # others: each call's Jacobian is that of its own closure
    make = lambda T: (lambda x: torch.sin(x) * T)  # noqa: E731
    for k in range(4):
        x = torch.randn(3, dtype=D)
        T = x if k in (0, 2) else torch.randn(3, dtype=D)
        got = tv.jacobian(make(T), x, compile=True)
        torch.testing.assert_close(got, torch.func.jacrev(make(T))(x))
        torch.testing.assert_close(got, torch.diag(torch.cos(x) * T))


@pytest.mark.parametrize("call", ["jacobian", "hessian"])
@pytest.mark.parametrize("where", ["inside", "compile=True"])
def test_a_negative_argnums_is_the_argument_it_counts_back_to(call, where):
    # torch.func.jacfwd took argnums=-1 for a differentiated argument but pushed its basis
    # through none: inside the user's torch.compile the forward-mode Jacobian was all zeros
    def f(x, y):
        return (x * y.sum()).pow(2)

    def run(x, y):
        if call == "jacobian":
            return tv.jacobian(f, x, y, argnums=-1, strategy="fwd")
        return tv.hessian(lambda x, y: f(x, y).sum(), x, y, argnums=-1)

    def ref(x, y):
        if call == "jacobian":
            return torch.func.jacrev(f, 1)(x, y)
        return torch.func.hessian(lambda x, y: f(x, y).sum(), 1)(x, y)

    compiled = torch.compile(run, fullgraph=True, backend=_USERS_BACKEND)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)  # compile=True: no eager fallback
        for _ in range(3):
            x, y = torch.randn(3, dtype=D), torch.randn(2, dtype=D)
            if where == "inside":
                got = compiled(x, y)
            elif call == "jacobian":
                got = tv.jacobian(f, x, y, argnums=-1, strategy="fwd", compile=True)
            else:
                got = tv.hessian(lambda x, y: f(x, y).sum(), x, y, argnums=-1, compile=True)
            assert got.abs().sum() > 0
            torch.testing.assert_close(got, ref(x, y))


@pytest.mark.usefixtures("inductor")
def test_a_large_jacobian_is_written_into_a_new_buffer_each_call(monkeypatch):
    # NOTE [the result buffer of a compiled Jacobian]; the threshold lowered to take small ones
    from torch_vjp._engine import compiled_jacobian as compiled

    made = []

    def counting_buffer(like, shape):
        made.append(shape)
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    monkeypatch.setattr(compiled, "HUGE_PAGE_MIN_BYTES", 1)
    monkeypatch.setattr(compiled, "new_buffer", counting_buffer)
    f = _mlp(5, 4)
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for strategy in ("rev", "fwd"):
            for _ in range(3):
                x = torch.randn(5, dtype=D)
                got = tv.jacobian(f, x, strategy=strategy, compile=True)
                torch.testing.assert_close(got, torch.func.jacrev(f)(x))
                results.append((got, got.clone()))
    assert made == [(4, 5)] * 6  # each compiled call (the first of each is eager) made one
    for got, kept in results:  # no later call wrote into an earlier call's result
        assert torch.equal(got, kept)
    assert len({got.data_ptr() for got, _ in results}) == len(results)


ROWS = 6


def test_a_result_buffer_of_a_shape_the_program_no_longer_gives_is_left_unused(monkeypatch):
    # f reads a global: dynamo recompiles when it changes, and the Jacobian's shape with it;
    # the buffer sized at build must not take (broadcast) the new shape's result
    import sys

    from torch_vjp._engine import compiled_jacobian

    monkeypatch.setattr(compiled_jacobian, "HUGE_PAGE_MIN_BYTES", 1)
    w = torch.randn(6, 6, dtype=D)
    f = lambda x: torch.tanh(w @ x)[:ROWS]  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for rows in (6, 6, 6, 1, 1):
            monkeypatch.setattr(sys.modules[__name__], "ROWS", rows)
            x = torch.randn(6, dtype=D)
            got = tv.jacobian(f, x, compile=True)
            assert got.shape == (rows, 6)
            torch.testing.assert_close(got, torch.func.jacrev(f)(x))


@pytest.mark.parametrize("call", ["jacobian_fwd", "jacobian_rev", "jacobian_auto",
                                  "batch_jacobian_fwd", "hessian"])
def test_a_function_that_changes_its_arguments_in_place_leaves_the_callers_as_they_were(call):
    # the compiled program ran on the caller's tensors, and the build's probes of the
    # output size called f on them too: x doubled on every call, y grew by one or two, and
    # each result was taken at other values, silently. (Forward mode takes an f that changes
    # its differentiated argument; reverse mode refuses that eagerly, as torch.func does.)
    def f(x):
        x.mul_(2)
        return x.sin()

    def g(x, y):
        y.add_(1.0)
        return x.sin() * y

    runs = {
        "jacobian_fwd": lambda x, y, c: tv.jacobian(f, x, strategy="fwd", compile=c),
        "jacobian_rev": lambda x, y, c: tv.jacobian(g, x, y, strategy="rev", compile=c),
        "jacobian_auto": lambda x, y, c: tv.jacobian(g, x, y, compile=c),
        "batch_jacobian_fwd": lambda x, y, c: tv.batch_jacobian(f, x.reshape(2, 2),
                                                                strategy="fwd", compile=c),
        "hessian": lambda x, y, c: tv.hessian(lambda x, y: g(x, y).sum(), x, y, compile=c),
    }
    x, y = torch.randn(4, dtype=D), torch.zeros(4, dtype=D)
    x0 = x.clone()
    want = runs[call](x, y, False)
    assert torch.equal(x, x0) and torch.equal(y, torch.zeros(4, dtype=D))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)  # (a fallback to eager is fine)
        for _ in range(3):
            got = runs[call](x, y, True)
            assert torch.equal(x, x0) and torch.equal(y, torch.zeros(4, dtype=D))
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("written", ["captured", "primal"])
def test_a_compiled_vjp_fn_keeps_the_point_of_its_vjp_when_a_tensor_is_written(written):
    # the compiled program reran f with the values written in place since the vjp call
    # (S.add_(5): 12 where the vjp point's answer is 2), silently; now the compiled vjp_fn
    # refuses as the eager one does (NOTE [the vjp point, kept])
    S = torch.tensor([1.0, 1.0], dtype=D)
    x, v = torch.tensor([0.0, 1.0, 2.0], dtype=D), torch.ones(3, dtype=D)
    f = (lambda t: t * S.sum()) if written == "captured" else torch.exp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        for _ in range(2):  # (the second vjp finds the compiled entry the first made)
            _, compiled = tv.vjp(f, x, compile=True)
            compiled(v)
        _, eager = tv.vjp(f, x)
        eager(v)
        if written == "captured":
            S.add_(5.0)
        else:
            x.add_(1.0)
        for fn in (compiled, eager):
            with pytest.raises(tv.JacobianCallError, match="was written in place after "
                               "torch_vjp.vjp computed the output"):
                fn(v)


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.alpha = 1.0  # a plain attribute: neither a parameter nor a buffer

    def forward(self, t):
        return t * self.alpha * 2


@pytest.mark.parametrize("change", ["default", "data", "attribute", "eval"])
def test_a_compiled_vjp_fn_keeps_the_point_when_what_f_reads_changes_unseen(change):
    # a default argument, a write through .data, a module's plain attribute or its training
    # flag: none is a closure cell, a global, a parameter or a buffer, and the compiled
    # program read them as changed (12 or 7 where the eager vjp_fn gives 2), silently
    S = torch.tensor([1.0, 1.0], dtype=D)
    m = _Scaled()

    class Branchy(torch.nn.Module):
        def forward(self, t):
            return t * 2 if self.training else t * 7

    b = Branchy()
    f = {"default": lambda t, S=S: t * S.sum(), "data": lambda t: t * S.sum(),
         "attribute": m, "eval": b}[change]
    x, v = torch.tensor([0.0, 1.0, 2.0], dtype=D), torch.ones(3, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        for _ in range(2):
            _, compiled = tv.vjp(f, x, compile=True)
            compiled(v)
        want = tv.vjp(f, x)[1](v)[0].clone()
        if change in ("default", "data"):
            S.data.add_(5.0)
        elif change == "attribute":
            m.alpha = 6.0
        else:
            b.eval()
        torch.testing.assert_close(compiled(v)[0].detach(), want)


W_GLOBAL = torch.randn(2, 3, dtype=D)


@pytest.mark.parametrize("rebind", ["closure", "global", "parameter"])
def test_a_compiled_vjp_fn_keeps_the_point_of_its_vjp_when_f_is_rebound(rebind):
    # NOTE [a compiled vjp_fn's point]: the compiled program reran f with what f read when
    # vjp_fn was called: after W = W_next, vjp_fn gave W_next.T @ v, silently
    import sys

    x, v = torch.randn(3, dtype=D), torch.randn(2, dtype=D)
    w0, w1 = torch.randn(2, 3, dtype=D), torch.randn(2, 3, dtype=D)
    lin = torch.nn.Linear(3, 2).to(D)
    with torch.no_grad():
        lin.weight.copy_(w0)
    w = w0
    fs = {"closure": lambda x: w @ x, "global": lambda x: W_GLOBAL @ x, "parameter": lin}
    f = fs[rebind]
    if rebind == "global":
        sys.modules[__name__].W_GLOBAL = w0
    for _ in range(2):  # the second vjp finds the compiled entry the first made
        _, vjp_fn = tv.vjp(f, x, compile=True)
        torch.testing.assert_close(vjp_fn(v)[0].detach(), w0.T @ v)
    if rebind == "closure":
        w = w1
    elif rebind == "global":
        sys.modules[__name__].W_GLOBAL = w1
    else:
        lin.weight = torch.nn.Parameter(w1.clone())
    torch.testing.assert_close(vjp_fn(v)[0].detach(), w0.T @ v)  # the vjp point's
    _, later = tv.vjp(f, x, compile=True)  # a new vjp: the new point
    torch.testing.assert_close(later(v)[0].detach(), w1.T @ v)


@pytest.mark.parametrize("argnums", [2, (0, 0), (0, 5)])
def test_inside_users_torch_compile_a_bad_argnums_is_the_eager_error(argnums):
    # the plain form took argnums modulo the number of primals: argnums=2 of two primals
    # differentiated the first, silently
    def run(x, y):
        return tv.jacobian(lambda x, y: x * y, x, y, argnums=argnums)

    x, y = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    with pytest.raises(tv.JacobianCallError, match=r"argnums="):
        run(x, y)  # eager
    with pytest.raises(tv.JacobianCallError, match=r"argnums="):
        torch.compile(run, backend=_USERS_BACKEND)(x, y)


def test_auto_compiles_reverse_mode_where_forward_mode_has_no_formula():
    # compiled 'auto' prefers forward mode for square and tall Jacobians: grid_sample has no
    # forward-mode formula, and the program failed to compile (eager, with a warning) where
    # reverse mode compiles
    image = torch.randn(1, 4, 3, 3, dtype=D)

    def f(u):  # 12 inputs, 24 outputs
        return F.grid_sample(image, u.view(1, 3, 2, 2) * 0.8, align_corners=False).flatten()

    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for _ in range(3):
            u = torch.randn(12, dtype=D)
            torch.testing.assert_close(tv.jacobian(f, u, compile=True),
                                       torch.autograd.functional.jacobian(f, u))
    assert _frames() == 1


def test_compiled_auto_stays_right_where_vmap_is_wrong():
    # torch.cdist's backward has a wrong batching rule (and no forward-mode formula): the
    # eager first call takes the reverse loop (NOTE [auto, checked once]), and a compiled
    # program that disagrees with it is not used
    def f(u):
        return torch.cdist(u.view(3, 2), u.view(3, 2) + 1).flatten()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        for _ in range(3):
            u = torch.randn(6, dtype=D)
            torch.testing.assert_close(tv.jacobian(f, u, compile=True),
                                       torch.autograd.functional.jacobian(f, u))


def test_auto_compiles_reverse_mode_where_forward_mode_is_wrong():
    # torch.triangular_solve's forward-mode formula for the matrix is wrong: the compiled
    # 'auto' (forward mode for this tall Jacobian) checks one forward product against one
    # reverse product before it compiles (NOTE [auto, checked once])
    B = torch.linspace(-1.0, 1.0, 160, dtype=D).reshape(2, 80)

    def f(A):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # triangular_solve is deprecated
            return torch.triangular_solve(B.expand(*A.shape[:-2], 2, 80), A)[0]

    def point(*batch):
        return torch.randn(*batch, 2, 2, dtype=D).triu() + 3 * torch.eye(2, dtype=D)

    A = point()
    assert (torch.func.jacfwd(f)(A) - torch.func.jacrev(f)(A)).abs().max() > 0.05
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)  # (the eager first call's)
        for _ in range(3):
            A = point()
            torch.testing.assert_close(tv.jacobian(f, A, compile=True, strategy="auto"),
                                       torch.func.jacrev(f)(A))
            Ab = point(3)
            torch.testing.assert_close(tv.batch_jacobian(f, Ab, compile=True),
                                       torch.vmap(torch.func.jacrev(f))(Ab))


@pytest.mark.parametrize("kind", ["module", "method"])
def test_the_cache_does_not_keep_a_model_alive(kind):
    import gc
    import weakref

    model = torch.nn.Linear(4, 3).double()
    alive = weakref.ref(model)
    f = model if kind == "module" else model.forward
    x = torch.randn(4, dtype=D)
    for _ in range(2):
        torch.testing.assert_close(tv.jacobian(f, x, compile=True), model.weight)
    del model, f
    gc.collect()
    assert alive() is None
    # a new model (its id may be the old one's) gets an entry of its own
    other = torch.nn.Linear(4, 3).double()
    torch.testing.assert_close(tv.jacobian(other, x, compile=True), other.weight)


def test_the_cache_does_not_keep_what_a_lambda_closes_over_alive():
    # (the entry held the lambda itself, so its model and its batch stayed in the cache
    # after the caller dropped them)
    import gc
    import weakref

    def step():
        model = torch.nn.Linear(4, 3).double()
        batch = torch.randn(4, dtype=D)
        for _ in range(2):
            got = tv.jacobian(lambda w: model(w * batch), torch.randn(4, dtype=D),
                              compile=True)
            torch.testing.assert_close(got, model.weight * batch)
        return weakref.ref(model), weakref.ref(batch)

    refs = step()
    gc.collect()
    assert [r() for r in refs] == [None, None]
    # a model made next (its id may be the dropped one's) gets an entry of its own
    model = torch.nn.Linear(4, 3).double()
    x = torch.randn(4, dtype=D)
    torch.testing.assert_close(tv.jacobian(lambda w: model(w), x, compile=True), model.weight)


@pytest.mark.parametrize("name", ["jacobian", "jacobian_rev", "jacobian_fwd", "batch_jacobian",
                                  "hessian", "jvp", "vjp"])
def test_inside_users_torch_compile_a_graph_break_in_f_is_traced_around(name):
    # (a print or a log call in f breaks the user's graph: the calls must resume after it,
    # as torch.func's transforms do, not fail in dynamo's resume of the public function)
    def f(a):
        torch._dynamo.graph_break()
        return torch.sin(a) * a.sum()

    x, t = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    calls = {
        "jacobian": (lambda x: tv.jacobian(f, x), lambda x: torch.func.jacrev(f)(x)),
        "jacobian_rev": (lambda x: tv.jacobian(f, x, strategy="rev"),
                         lambda x: torch.func.jacrev(f)(x)),
        "jacobian_fwd": (lambda x: tv.jacobian(f, x, strategy="fwd"),
                         lambda x: torch.func.jacrev(f)(x)),
        "batch_jacobian": (lambda x: tv.batch_jacobian(lambda b: f(b[0])[None], x[None]),
                           lambda x: torch.func.jacrev(f)(x)[None]),
        "hessian": (lambda x: tv.hessian(lambda a: f(a).sum(), x),
                    lambda x: torch.func.hessian(lambda a: f(a).sum())(x)),
        "jvp": (lambda x: tv.jvp(f, (x,), (t,))[1],
                lambda x: torch.func.jvp(f, (x,), (t,))[1]),
        "vjp": (lambda x: tv.vjp(f, x)[1](t)[0], lambda x: torch.func.vjp(f, x)[1](t)[0]),
    }
    ours, ref = calls[name]
    torch.testing.assert_close(torch.compile(ours, backend=_USERS_BACKEND)(x), ref(x))


@pytest.mark.parametrize("argnums,has_aux", [([0, 1], False), (0, [])])
def test_an_unhashable_option_with_compile_is_the_eager_calls(argnums, has_aux):
    f = lambda x, y: (x.sin() * y).sum()  # noqa: E731
    x, y = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    if has_aux == []:  # (falsy, as the eager call takes it: the eager result, uncached)
        got = tv.jvp(lambda a: a.sin(), (x,), (y,), has_aux=has_aux, compile=True)
        torch.testing.assert_close(got, torch.func.jvp(torch.sin, (x,), (y,)))
        return
    for name in ("hessian", "jacobian"):
        with pytest.raises(tv.JacobianCallError, match=(
                rf"torch_vjp.{name}: argnums=\[0, 1\], but it must be an int or a non-empty "
                rf"tuple of ints")):
            getattr(tv, name)(f, x, y, argnums=argnums, compile=True)


_LEGACY = False  # (read by _solve, as a config switch in a model's code)


def _solve(a):
    b = torch.ones(3, 4, dtype=a.dtype)
    if _LEGACY:  # (triangular_solve's forward-mode formula is wrong in torch)
        return torch.triangular_solve(b, a)[0]
    return torch.linalg.solve_triangular(a, b, upper=True)


def test_a_global_that_changes_the_function_after_the_first_call_is_checked_again():
    # (dynamo recompiles the entry for the new global: the new program is built again,
    # here in reverse mode, and compared with the eager call, NOTE [a recompiled entry])
    global _LEGACY
    a = torch.triu(torch.rand(3, 3, dtype=D)) + 2 * torch.eye(3, dtype=D)
    try:
        for legacy in (False, False, True, True, False):
            _LEGACY = legacy
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # (triangular_solve's)
                got = tv.jacobian(_solve, a, compile=True)
                torch.testing.assert_close(got, torch.func.jacrev(_solve)(a))
    finally:
        _LEGACY = False


#: The compiled and the eager program round autocast's bfloat16 steps apart (inductor fuses
#: them): their results agree at bfloat16's rounding, as the first call checks.
BF16 = {"rtol": 1.6e-2, "atol": 2e-2}


def test_autocast_is_part_of_the_signature():
    w = torch.randn(8, 8)
    f = lambda x: torch.tanh(w @ x)  # noqa: E731
    x = torch.randn(8)
    for _ in range(2):
        torch.testing.assert_close(tv.jacobian(f, x, compile=True), torch.func.jacrev(f)(x))
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, ref = tv.jacobian(f, x, compile=True), torch.func.jacrev(f)(x)
        assert got.dtype == ref.dtype == torch.float32
        torch.testing.assert_close(got, ref, **BF16)  # (bfloat16 steps, rounded apart)
    g = lambda x: torch.sin(w @ x)  # noqa: E731  (compiled first under autocast)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert tv.jacobian(g, x, compile=True).dtype == torch.float32
    torch.testing.assert_close(tv.jacobian(g, x, compile=True), torch.func.jacrev(g)(x))


@pytest.mark.usefixtures("inductor")
def test_under_autocast_the_compiled_call_takes_eager_autos_mode_and_compiles():
    # (8 -> 8 under bfloat16 autocast: the compiled "auto" took forward mode, whose
    # Jacobian has the output's dtype, bfloat16; the eager "auto" takes reverse mode,
    # float32: "the results have different shapes or dtypes", and the call stayed eager)
    from torch_vjp._engine import compiled

    w = torch.randn(8, 8)
    f = lambda x: torch.tanh(w @ x)  # noqa: E731
    x = torch.randn(8)
    before = compiled.builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got, ref = tv.jacobian(f, x, compile=True), tv.jacobian(f, x)
            assert got.dtype == ref.dtype == torch.float32
            torch.testing.assert_close(got, ref, **BF16)
            torch.testing.assert_close(got, torch.func.jacrev(f)(x).float(), **BF16)
    assert compiled.builds() - before == 1
    assert [e.run is not None for e in compiled._CACHE.values()] == [True]


@pytest.mark.parametrize("call", ["jacobian", "per_sample_grad_norms"])
def test_a_global_module_hook_registered_after_the_first_call_is_followed(call):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(),
                            torch.nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4, dtype=D), torch.randint(0, 3, (6,))
    ce = torch.nn.CrossEntropyLoss()

    def compute(compile):
        if call == "jacobian":
            return tv.jacobian(lambda x: m(x), x, compile=compile)
        return tv.per_sample_grad_norms(m, ce, x, y, compile=compile)

    for _ in range(2):
        compute(True)
    h = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, inp, out: out * 2 if isinstance(mod, torch.nn.Tanh) else None)
    try:
        ref = (torch.func.jacrev(m)(x) if call == "jacobian" else
               torch.stack([torch.cat([g.flatten() for g in torch.autograd.grad(
                   ce(m(x[i:i + 1]), y[i:i + 1]), list(m.parameters()))]).norm()
                   for i in range(len(x))]))
        for _ in range(2):
            torch.testing.assert_close(compute(True), ref)
    finally:
        h.remove()
    torch.testing.assert_close(compute(True), compute(False))


_STEP = 0


def test_a_global_that_changes_on_every_call_runs_eagerly_with_a_warning():
    from torch_vjp._engine.compiled import REBUILD_WARN_AT

    global _STEP

    def f(x):
        return torch.sin(x) * _STEP  # (a global that changes on every call)

    x = torch.randn(3, dtype=D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _STEP in range(1, 12):
            got = tv.jacobian(f, x, compile=True)
            torch.testing.assert_close(got, torch.func.jacrev(f)(x))
    _STEP = 0
    msgs = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    assert len(msgs) == 1, msgs
    # (the global's value is in the key, NOTE [the globals a program reads]: each value
    # compiled its own program, and once REBUILD_WARN_AT of them were never used again, a
    # new value runs eagerly, NOTE [closures over new objects])
    assert f".<locals>.f {REBUILD_WARN_AT} times for the same argument" in msgs[0]
    assert "a global the function reads held a new value" in msgs[0]
    assert "runs eagerly, at compile=False's speed" in msgs[0]
    assert "Fix: pass what changes from call to call as an argument" in msgs[0]


class _Temperature(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3, bias=False).double()
        self.scale = 2.0  # (a plain float attribute, as LoRA's alpha / r)

    def forward(self, x):
        return self.scale * self.lin(x)


class _Config:
    def __init__(self):
        self.k = 2.0

    def f(self, x):
        return self.k * torch.sin(x)


_CFG = _Config()


@pytest.mark.parametrize("holder", ["module", "global_object", "closure_dict", "method",
                                    "default"])
def test_a_compiled_vjp_fn_keeps_the_point_when_a_number_f_reads_changes(holder):
    # (at x = 0 the forward output is the same before and after the change, so only the
    # state snapshot can tell: the compiled program differentiated the new function)
    torch.manual_seed(0)
    m, cfg, obj = _Temperature(), {"k": 2.0}, _Config()

    def with_default(x, k=2.0):
        return k * torch.sin(x)

    fs = {"module": m, "global_object": lambda x: _CFG.k * torch.sin(x),
          "closure_dict": lambda x: cfg["k"] * torch.sin(x), "method": obj.f,
          "default": with_default}
    f = fs[holder]
    v = torch.randn(3, dtype=D)
    try:
        for _ in range(2):  # the entry, compiled and found again
            _, fn = tv.vjp(f, torch.randn(3, dtype=D), compile=True)
            fn(v)
        x0 = torch.zeros(3, dtype=D)
        _, compiled = tv.vjp(f, x0, compile=True)
        want = torch.func.vjp(f, x0)[1](v)[0]
        if holder == "module":
            m.scale = 5.0
        elif holder == "global_object":
            _CFG.k = 5.0
        elif holder == "closure_dict":
            cfg["k"] = 5.0
        elif holder == "method":
            obj.k = 5.0
        else:
            with_default.__defaults__ = (5.0,)
        torch.testing.assert_close(compiled(v)[0].detach(), want)
    finally:
        _CFG.k = 2.0


def _batch_loss(w, batch):
    return torch.tanh(batch @ w).pow(2).sum()


def test_a_partial_over_a_new_batch_each_call_reuses_one_program():
    import functools

    w = torch.randn(4, dtype=D)
    for _ in range(4):
        batch = torch.randn(5, 4, dtype=D)
        f = functools.partial(_batch_loss, batch=batch)
        torch.testing.assert_close(tv.jacobian(f, w, compile=True),
                                   torch.func.jacrev(f)(w))
    assert _frames() == 1


def test_a_partial_over_new_objects_each_call_is_warned_once():
    import functools

    from torch_vjp._engine.compiled import REBUILD_WARN_AT

    w = torch.randn(4, dtype=D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(REBUILD_WARN_AT + 1):
            data = _Box(batch=torch.randn(5, 4, dtype=D))  # a new object: by identity
            f = functools.partial(lambda w, data: _batch_loss(w, data.batch), data=data)
            torch.testing.assert_close(tv.jacobian(f, w, compile=True),
                                       torch.func.jacrev(f)(w))
    msgs = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    assert len(msgs) == 1, msgs
    assert "torch_vjp.jacobian: compile=True has compiled" in msgs[0]
    assert f"{REBUILD_WARN_AT} times for the same argument signature" in msgs[0]
    assert "or a partial's arguments) holds new objects" in msgs[0]
    assert "Fix: pass what changes from call to call as an argument" in msgs[0]


def _compile_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)
            and "compile=True" in str(w.message)]


@pytest.mark.usefixtures("inductor")
@pytest.mark.parametrize("cause", ["randn", "dropout", "in_place"])
def test_a_fallback_warning_names_the_likely_cause(cause):
    x, t = torch.randn(3, dtype=D), torch.ones(3, dtype=D)
    if cause == "randn":
        msgs = _compile_warnings(lambda: tv.jvp(lambda a: a * torch.randn(3, dtype=D), (x,),
                                                (t,), compile=True))
    elif cause == "dropout":
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Dropout(0.5),
                                torch.nn.Linear(5, 3)).double().train()
        msgs = _compile_warnings(lambda: tv.per_sample_grads(
            m, torch.nn.CrossEntropyLoss(), torch.randn(6, 4, dtype=D),
            torch.randint(0, 3, (6,)), compile=True))
    else:
        xx = x.clone()
        msgs = _compile_warnings(lambda: tv.jvp(lambda a: a.mul_(2).sin(), (xx,), (t,),
                                                compile=True))
    assert len(msgs) == 1, msgs
    assert "compile=True could not compile the computation" in msgs[0]
    assert "Why: the compiled result differs from the eager one" in msgs[0]
    if cause == "in_place":
        assert "The function wrote into its input in place" in msgs[0]
        assert "Fix: write into a copy inside the function (x = x.clone()" in msgs[0]
    else:
        assert "The function draws random numbers" in msgs[0]
        assert "Fix: draw the random numbers outside and pass them in as an argument" in msgs[0]



def test_the_first_compiled_call_leaves_the_generator_where_the_eager_call_did():
    # NOTE [auto's extra calls draw what the products draw]: the first compile=True call
    # returns the eager result; the compiled run's draws (discarded with its result) moved
    # the global generator on too, so it ended where no number of plain calls of f leaves it
    W, x = torch.randn(6, 3, dtype=D), torch.randn(3, dtype=D)

    def f(x):
        return F.dropout(W @ x, 0.5, training=True)

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J = tv.jacobian(f, x, compile=True)
    after = torch.rand(3)
    torch.manual_seed(0)
    torch.testing.assert_close(J, torch.func.jacrev(f)(x))
    torch.testing.assert_close(after, torch.rand(3))


def test_a_captured_tensor_f_changes_is_put_back_on_the_first_compiled_call_too():
    # F.batch_norm's running statistics move without a version bump; the eager call puts
    # them back (NOTE [what a call puts back]), and the first compile=True call, which
    # runs f in build() and in the compiled program, must too.
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)

    def g(x):
        return torch.nn.functional.batch_norm(x, rm, rv, training=True)

    x = torch.randn(4, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        J = tv.jacobian(g, x, compile=True)
    assert torch.equal(rm, torch.zeros(3, dtype=torch.float64))
    assert torch.equal(rv, torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(J, torch.func.jacrev(g)(x))


class _Inner:
    k = 2.0


class _Outer:
    def __init__(self):
        self.inner = _Inner()


def test_a_compiled_vjp_fn_keeps_its_point_after_another_point_built_a_program():
    # NOTE [a compiled vjp_fn's point]: k two objects deep, and at x = c the output is c
    # whatever k is; the program rebuilt for k = 3 (the second point's) gave the first
    # point's vjp_fn (1 + 3) v where its answer is (1 + 2) v, silently (error 2.2)
    cfg, c = _Outer(), torch.randn(5, dtype=D)

    def f(x):
        return x + cfg.inner.k * (x - c)

    v = torch.randn(5, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        for _ in range(2):
            _, first = tv.vjp(f, c.clone(), compile=True)
            torch.testing.assert_close(first(v)[0], 3.0 * v)
        cfg.inner.k = 3.0
        for _ in range(3):  # the program rebuilt for k = 3, and found again
            _, second = tv.vjp(f, c.clone(), compile=True)
            torch.testing.assert_close(second(v)[0], 4.0 * v)
        torch.testing.assert_close(first(v)[0], 3.0 * v)
        torch.testing.assert_close(second(v)[0], 4.0 * v)


def test_a_compiled_vjp_fn_runs_its_program_on_every_call_where_nothing_is_built(
        monkeypatch):
    from torch_vjp._engine import compiled

    runs = []
    call = compiled._Entry.__call__
    monkeypatch.setattr(compiled._Entry, "__call__",
                        lambda self, *a: runs.append(1) or call(self, *a))
    w, v = torch.randn(4, 3, dtype=D), torch.randn(4, dtype=D)
    f = lambda x: torch.tanh(w @ x)  # noqa: E731
    x = torch.randn(3, dtype=D)
    _, built_here = tv.vjp(f, x, compile=True)
    want = torch.func.vjp(f, x)[1](v)[0]
    torch.testing.assert_close(built_here(v)[0], want)  # builds: the eager products
    assert runs == [1]  # (and the program once, at random cotangents: its check)
    for _ in range(2):  # its program was checked against its own products: it runs it
        torch.testing.assert_close(built_here(v)[0], want)
    _, later = tv.vjp(f, x, compile=True)
    for _ in range(2):
        torch.testing.assert_close(later(v)[0], want)
    assert len(runs) == 5


class _EqualModule(torch.nn.Module):
    # (__eq__ without __hash__: such a module cannot be put in a set, as Module.parameters()
    # puts each module it walks)
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2).to(D)

    def forward(self, x):
        return torch.tanh(self.lin(x))

    def __eq__(self, other):
        return isinstance(other, _EqualModule)


def test_compile_true_takes_a_module_that_cannot_be_hashed():
    # compile=True raised TypeError: unhashable type, where the eager call computes
    m, x = _EqualModule(), torch.randn(3, dtype=D)
    for f in (m, lambda x: m(x)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tv.JacobianWarning)  # (dynamo may decline it)
            for _ in range(2):
                torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                           torch.func.jacrev(f)(x))


def test_a_compiled_vjp_fn_whose_own_build_agreed_by_coincidence_keeps_its_point():
    # k changed after the vjp call; the vjp_fn's first call rebuilt the program for k = 3
    # and compared it with the vjp point's products at cotangents with w[0] = 0, which k
    # does not move: they agreed, and the next call ran the k = 3 program, 4 v[0] where
    # the vjp point's answer is 3 v[0], silently
    cfg, c = _Outer(), torch.randn(5, dtype=D)
    e0 = torch.zeros(5, dtype=D)
    e0[0] = 1.0

    def f(x):
        return x + cfg.inner.k * e0 * (x - c)

    v = torch.randn(5, dtype=D)
    w = v.clone()
    w[0] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        for _ in range(2):
            _, warm = tv.vjp(f, c.clone(), compile=True)
            torch.testing.assert_close(warm(v)[0], v + 2.0 * e0 * v)
        _, point = tv.vjp(f, c.clone(), compile=True)
        cfg.inner.k = 3.0
        torch.testing.assert_close(point(w)[0], w)
        for _ in range(2):
            torch.testing.assert_close(point(v)[0], v + 2.0 * e0 * v)


def test_a_compiled_vjp_fn_does_not_take_another_threads_build_for_its_own(monkeypatch):
    # after the vjp_fn's call had found no build since its vjp call, and before it looked
    # its program up, another thread moved k and built the program for its own point: the
    # call ran that program, (1 + 3) v where its answer is (1 + 2) v, and counted the build
    # as its own
    import threading

    from torch_vjp._engine import compiled

    cfg, c, v = _Outer(), torch.randn(5, dtype=D), torch.randn(5, dtype=D)

    def f(x):
        return x + cfg.inner.k * (x - c)

    def other_point():
        cfg.inner.k = 3.0
        _, other = tv.vjp(f, c.clone(), compile=True)
        torch.testing.assert_close(other(v)[0], 4.0 * v)

    pending = []
    signature = compiled.call_signature

    def call_signature(args):  # (the lookup of the program: the other thread runs first)
        if pending:
            thread = threading.Thread(target=pending.pop())
            thread.start()
            thread.join()
        return signature(args)

    monkeypatch.setattr(compiled, "call_signature", call_signature)  # (noted or not)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        for _ in range(2):
            _, warm = tv.vjp(f, c.clone(), compile=True)
            torch.testing.assert_close(warm(v)[0], 3.0 * v)
        _, point = tv.vjp(f, c.clone(), compile=True)
        pending.append(other_point)
        torch.testing.assert_close(point(v)[0], 3.0 * v)
        assert not pending and cfg.inner.k == 3.0
        for _ in range(2):
            torch.testing.assert_close(point(v)[0], 3.0 * v)


def test_a_first_call_at_a_nan_input_leaves_the_next_call_to_compile():
    # (the first call compared the compiled result with the eager one at x = [nan, 1, 2],
    # read NaN - NaN as a difference "by up to nan at a scale of nan", and kept the entry
    # eager for good: every later call at finite points lost its program)
    from torch_vjp._engine import compiled

    f = lambda x: x.roll(1) * x  # noqa: E731
    before = compiled.builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        got = tv.jacobian(f, torch.tensor([float("nan"), 1.0, 2.0], dtype=D), compile=True)
        assert got.isnan().any()
        for _ in range(2):
            x = torch.randn(3, dtype=D)
            torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                       torch.func.jacrev(f)(x))
    assert compiled.builds() - before == 1  # built by the first finite call, then reused
    assert [e.run is not None for e in compiled._CACHE.values()] == [True]


def test_inputs_that_always_hold_a_nan_the_function_masks_still_compile():
    # (a first call at a non-finite input was never judged, so data that always holds a
    # NaN, masked by the function, ran eagerly on every call: no program was ever built)
    from torch_vjp._engine import compiled

    f = lambda x: torch.nan_to_num(x, nan=0.0).sin()  # noqa: E731
    before = compiled.builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for k in range(3):
            x = torch.randn(4, dtype=D)
            x[k] = float("nan")
            torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                       torch.func.jacrev(f)(x))
    assert compiled.builds() - before == 1
    assert [e.run is not None for e in compiled._CACHE.values()] == [True]


def test_a_nan_in_a_tensor_the_function_captures_compiles_and_agrees_with_eager():
    # (x finite, the result NaN where the captured weight's NaN reaches it: the first
    # call's comparison reads NaN in both results as agreeing, so the entry is compiled
    # once, and every call gives torch.func's NaN entries and values)
    from torch_vjp._engine import compiled

    W = torch.randn(3, 3, dtype=D)
    W[1, 2] = float("nan")
    f = lambda x: torch.tanh(W @ x)  # noqa: E731
    before = compiled.builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for _ in range(3):
            x = torch.randn(3, dtype=D)
            got = tv.jacobian(f, x, compile=True)
            torch.testing.assert_close(got, torch.func.jacrev(f)(x), equal_nan=True)
            assert got.isnan().any()
    assert compiled.builds() - before == 1
    assert [e.run is not None for e in compiled._CACHE.values()] == [True]


def test_results_agree_reads_nan_in_both_and_equal_infinities_as_agreeing():
    from torch_vjp._engine.compile_checks import results_agree

    nan, inf = float("nan"), float("inf")
    a = torch.tensor([nan, inf, -inf, 1.0], dtype=D)
    assert results_agree(a, a.clone()) is None
    assert results_agree((a, a[:2]), (a.clone(), a[:2].clone())) is None
    for b in ([nan, inf, -inf, 1.5], [1.0, inf, -inf, 1.0], [nan, -inf, -inf, 1.0]):
        why = results_agree(a, torch.tensor(b, dtype=D))
        assert why is not None and why.startswith("the compiled result differs from the eager")


@pytest.mark.usefixtures("inductor")
def test_a_float32_step_inside_a_float64_function_compiles():
    # the first call's comparison took float64's tolerance: a float32 step inside f (a
    # float32 submodule, Llama's and T5's norms) rounds the compiled program at float32's,
    # so it warned "the compiled result differs from the eager one by up to 1.25e-07 at a
    # scale of 1.42" and the signature stayed eager
    from torch_vjp._engine import compiled

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    W = torch.randn(16, 16, dtype=D, generator=g)

    def f(x):
        h = torch.tanh(W @ x)
        return lin(h.float()).sin().double() * h

    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for _ in range(2):
            x = torch.randn(16, dtype=D, generator=g)
            torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                       torch.func.jacrev(f)(x), rtol=1e-5, atol=1e-6)
    assert [e.run is not None for e in compiled._CACHE.values()] == [True]


def test_results_agree_rounds_at_the_least_precise_dtype_of_the_graph():
    from torch_vjp._engine.compile_checks import results_agree

    a = torch.tensor([1.0, 2.0, 3.0], dtype=D)
    b = a * (1 + 1e-6)  # float32's rounding, not float64's
    assert results_agree(a, b).startswith("the compiled result differs")
    assert results_agree(a, b, torch.float32) is None
    assert results_agree(a, a * 1.01, torch.float32) is not None  # (a real difference)


def test_a_compiled_program_that_writes_captured_statistics_puts_them_back_every_call():
    # NOTE [a program that writes nothing]: the first compiled run sees F.batch_norm's
    # statistics move (their versions do, compiled), so every later call keeps and puts
    # them back, as the eager path does
    from torch_vjp._engine import compiled

    rm, rv = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)

    def g(x):
        return F.batch_norm(x, rm, rv, training=True)

    def ref(x):
        return F.batch_norm(x, rm.clone(), rv.clone(), training=True)

    for _ in range(3):
        x = torch.randn(4, 3, dtype=D)
        torch.testing.assert_close(tv.jacobian(g, x, compile=True), torch.func.jacrev(ref)(x))
        assert torch.equal(rm, torch.zeros(3, dtype=D))
        assert torch.equal(rv, torch.ones(3, dtype=D))
    (entry,) = compiled._CACHE.values()
    assert entry.run is not None and entry.writes


def test_a_compiled_program_that_writes_nothing_runs_without_copies(monkeypatch):
    # (a pure function's later calls copy and compare none of what it reaches)
    from torch_vjp._engine import compiled

    W, b = torch.randn(5, 3, dtype=D), torch.randn(5, dtype=D)  # (b: small, copied before)
    f = lambda x: torch.tanh(W @ x + b)  # noqa: E731
    x = torch.randn(3, dtype=D)
    torch.testing.assert_close(tv.jacobian(f, x, compile=True), torch.func.jacrev(f)(x))
    (entry,) = compiled._CACHE.values()
    assert entry.run is not None and not entry.writes
    kept = []
    real = compiled.buffers_kept
    monkeypatch.setattr(compiled, "buffers_kept",
                        lambda *a, **k: kept.append(1) or real(*a, **k))
    for _ in range(2):
        x = torch.randn(3, dtype=D)
        torch.testing.assert_close(tv.jacobian(f, x, compile=True), torch.func.jacrev(f)(x))
    assert kept == []


def test_footprint_sees_writes_versions_and_rebound_buffers():
    from torch_vjp._engine.kept import Footprint

    t, bn = torch.zeros(3), torch.nn.BatchNorm1d(3)
    assert not Footprint([t], [bn]).moved()
    fp = Footprint([t], [bn])
    t.add_(0)  # (the same values: a write all the same)
    assert fp.moved()
    fp = Footprint([t], [bn])
    bn.running_mean = bn.running_mean * 2  # (a buffer rebound)
    assert fp.moved()
    fp = Footprint([t], [bn])
    with torch.no_grad():
        bn.weight.mul_(2)
    assert fp.moved()
    with torch.inference_mode():
        u = torch.zeros(2)
    assert not Footprint([u], []).moved()  # (no version: left out)


@pytest.mark.parametrize("batched", [False, True])
def test_jvp_strict_inside_the_users_compile_raises_as_eagerly(batched):
    # (the plain form dropped strict: inside the user's torch.compile, an output that does
    # not depend on the input gave zero tangents where the eager call raises)
    x, v = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    v = v.expand(2, 3) if batched else v
    f = lambda x: torch.ones(2, dtype=D)  # noqa: E731
    with pytest.raises(RuntimeError, match="The output of f is independent of the inputs"):
        tv.jvp(f, (x,), (v,), strict=True, batched=batched)
    compiled = torch.compile(lambda x, v: tv.jvp(f, (x,), (v,), strict=True, batched=batched),
                             backend=_USERS_BACKEND)
    with pytest.raises(RuntimeError, match="The output of f is independent of the inputs"):
        compiled(x, v)
    g = lambda x: x * 2  # noqa: E731  (a dependent output: the same tangents as eagerly)
    got = torch.compile(lambda x, v: tv.jvp(g, (x,), (v,), strict=True, batched=batched),
                        backend=_USERS_BACKEND)(x, v)
    torch.testing.assert_close(got[1], 2 * v)



def _inductor_compiles(monkeypatch) -> bool:
    import torch._inductor

    calls = []
    real = torch._inductor.compile
    monkeypatch.setattr(torch._inductor, "compile",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(3, dtype=D)
    torch.testing.assert_close(tv.jacobian(torch.sin, x, compile=True), torch.diag(x.cos()))
    return bool(calls)


def test_the_tests_programs_are_aot_eagers_by_default(monkeypatch):
    # (NOTE [the backend of the tests]: the tests here rely on it)
    assert not _inductor_compiles(monkeypatch)


def test_a_test_that_asks_for_inductor_gets_it(inductor, monkeypatch):
    assert _inductor_compiles(monkeypatch)
