"""compile=True at the edges of what tests/test_compiled.py covers (NOTE [compiled
Jacobians] in torch_vjp/_engine/compiled.py): every result in float64 against torch.func,
and what a call leaves of the user's tensors and modules."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv
from torch_vjp._engine import compiled

D = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "aot_eager_unless_inductor")  # conftest


#: The backend of the tests' own ``torch.compile`` of a function that calls torch_vjp,
#: whose point is what dynamo traces of it (no graph break, no recompile, the eager errors):
#: aot_eager, which compiles no C++ (the per-sample tests inside the user's compile keep
#: inductor, for the numerics through it).
_USERS_BACKEND = "aot_eager"


class _Stats(torch.nn.Module):
    """A module whose training-mode forward updates running statistics in a kernel (no
    version bump eagerly, one compiled), as BatchNorm's do."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rm", torch.zeros(3, dtype=D))
        self.register_buffer("rv", torch.ones(3, dtype=D))

    def forward(self, x):
        return F.batch_norm(x, self.rm, self.rv, training=True).sin()


@pytest.mark.parametrize("call,strategy", [("jacobian", "rev"), ("jacobian", "fwd"),
                                           ("hessian", "auto")])
def test_a_training_module_passed_as_an_argument_keeps_its_buffers(call, strategy):
    # (f(x, m) with argnums=0: the module is reached only through an argument, and the eager
    # call puts its buffers back; so must the first compiled run and every later call)
    m = _Stats()

    def f(x, m):
        return m(x) if call == "jacobian" else m(x).sum()

    def ref(x):
        out = torch.func.functional_call(m, {"rm": m.rm.clone(), "rv": m.rv.clone()}, (x,))
        return out if call == "jacobian" else out.sum()

    for i in range(3):
        x = torch.randn(4, 3, dtype=D) + i
        got = getattr(tv, call)(f, x, m, argnums=0, strategy=strategy, compile=True)
        want = (torch.func.jacrev if call == "jacobian" else torch.func.hessian)(ref)(x)
        torch.testing.assert_close(got, want)
        assert torch.equal(m.rm, torch.zeros(3, dtype=D)), i
        assert torch.equal(m.rv, torch.ones(3, dtype=D)), i
    (entry,) = compiled._CACHE.values()
    assert entry.run is not None


def _pair(x, w):
    y = torch.tanh(w @ x)
    return {"y": y, "s": (y * x[:4]).sum()}, x.norm()


@pytest.mark.parametrize("chunk_size", [1, 3, 5])
@pytest.mark.parametrize("has_aux", [False, True])
def test_a_batched_jvp_in_chunks_compiles(chunk_size, has_aux):
    # (the primal output and aux have no batch dimension: vmap's own chunk_size cannot
    # concatenate them, so compile=True fell back to eager with a warning)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 6, dtype=D, generator=g)

    def f(x):
        out, aux = _pair(x, w)
        return (out, aux) if has_aux else out

    for i in range(2):
        x = torch.randn(6, dtype=D, generator=g) + i
        vs = torch.randn(5, 6, dtype=D, generator=g)
        with warnings.catch_warnings():
            warnings.simplefilter("error", tv.JacobianWarning)
            got = tv.jvp(f, (x,), (vs,), batched=True, chunk_size=chunk_size,
                         has_aux=has_aux, compile=True)
        want_out = _pair(x, w)[0]
        want_tan = torch.func.vmap(lambda v: torch.func.jvp(lambda x: _pair(x, w)[0],
                                                            (x,), (v,))[1])(vs)
        torch.testing.assert_close(got[0], want_out)
        torch.testing.assert_close(got[1], want_tan)
        if has_aux:
            torch.testing.assert_close(got[2], x.norm())
    (entry,) = compiled._CACHE.values()
    assert entry.run is not None


def test_a_batched_jvp_in_chunks_inside_users_torch_compile():
    w = torch.randn(4, 6, dtype=D)
    f = lambda x: _pair(x, w)[0]  # noqa: E731
    x, vs = torch.randn(6, dtype=D), torch.randn(5, 6, dtype=D)
    got = torch.compile(lambda x, vs: tv.jvp(f, (x,), (vs,), batched=True, chunk_size=2),
                        fullgraph=True, backend=_USERS_BACKEND)(x, vs)
    want = torch.func.vmap(lambda v: torch.func.jvp(f, (x,), (v,))[1])(vs)
    torch.testing.assert_close(got[0], f(x))
    torch.testing.assert_close(got[1], want)


def test_a_fallback_for_a_module_that_updates_its_buffers_names_the_cause():
    # (spectral norm in training mode runs a power iteration on every forward: each run of
    # f computes from other vectors, so the compiled result differs from the eager one;
    # the warning says why and how to fix it, and the buffers are left as they were)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(4, 5, dtype=D)),
        torch.nn.Tanh(), torch.nn.Linear(5, 2, dtype=D)).train()
    before = {n: b.clone() for n, b in model.named_buffers()}
    x = torch.randn(3, 4, dtype=D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = tv.jacobian(model, x, compile=True)
    msgs = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)
            and "compile=True" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert "Why: the compiled result differs from the eager one" in msgs[0]
    assert "A module the function calls updates its buffers on every forward" in msgs[0]
    assert "Fix: put the model in eval mode for the call (model.eval())" in msgs[0]
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n
    # (the eager result: 'auto' ran f on the vectors of the power iteration's steps)
    torch.testing.assert_close(got, torch.func.jacrev(model)(x), atol=1e-5, rtol=1e-5)


def test_forward_mode_with_create_graph_is_not_compiled_into_a_crashing_program():
    # NOTE [forward mode with create_graph, eager]: inductor's forward-mode programs with
    # create_graph=True crashed the process in backward (a segmentation fault), so the
    # calls run in a process of their own here
    import textwrap

    from _shared_functions import run_forked

    code = textwrap.dedent("""
        import itertools, warnings
        import torch, torch_vjp as tv
        from torch._inductor import config
        # (inductor's scalar C++ kernels, compiled in the process itself: no probing of the
        # CPU's vector instructions by compiling test programs, no pool of compile workers
        # each importing torch; half the CPU time on a cold cache. The crash is in the
        # backward of inductor's forward-mode programs, whatever their kernels' instructions)
        config.cpp.vec_isa_ok, config.compile_threads = False, 1
        D = torch.float64
        W = torch.randn(3, 3, dtype=D, requires_grad=True)
        f = lambda x: torch.tanh(x @ W.T) * x
        calls = {
            "jacobian": (lambda x, s: tv.jacobian(f, x, strategy=s, compile=True,
                                                  create_graph=True),
                         lambda x: torch.func.jacrev(f)(x), (3,)),
            "batch_jacobian": (lambda x, s: tv.batch_jacobian(f, x, strategy=s, compile=True,
                                                              create_graph=True),
                               lambda x: torch.func.vmap(torch.func.jacrev(f))(x), (4, 3)),
            "hessian": (lambda x, s: tv.hessian(lambda x: f(x).sum(), x, strategy=s,
                                                compile=True, create_graph=True),
                        lambda x: torch.func.hessian(lambda x: f(x).sum())(x), (3,)),
        }
        for (name, (call, ref_of, shape)), strategy in itertools.product(
                calls.items(), ("auto", "fwd")):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(3):
                    x = torch.randn(shape, dtype=D, requires_grad=True)
                    (g,) = torch.autograd.grad(call(x, strategy).sum(), W)
                    ref = torch.autograd.grad(ref_of(x).sum(), W)[0]
                    torch.testing.assert_close(g, ref)
            said = [str(w.message) for w in caught
                    if issubclass(w.category, tv.JacobianWarning)]
            if strategy == "auto":
                assert not said, (name, said)
            else:
                assert len(said) == 1 and "crashes the process" in said[0], (name, said)
        print("done")
    """)
    # (a child of the fork server the distributed tests' ranks share: torch and torch_vjp
    # imported there once, not again in a fresh interpreter; a crash ends the child only)
    printed, error = run_forked(code, timeout=600)
    assert not error, error
    assert printed.strip().endswith("done")


def test_no_grad_and_inference_mode_alternated_each_keep_their_program():
    # (grad mode is off in both: keyed alike, each switch made dynamo recompile the one
    # entry, a first call again, and after REBUILD_WARN_AT of them it stayed eager with a
    # warning that blamed a global the function reads)
    x = torch.randn(3, dtype=D)
    f = lambda x: x.sin() * x  # noqa: E731
    ref = torch.func.jacrev(f)(x)
    before = compiled.builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for i in range(2 * compiled.REBUILD_WARN_AT + 2):
            with torch.no_grad() if i % 2 == 0 else torch.inference_mode():
                got = tv.jacobian(f, x, compile=True)
            torch.testing.assert_close(got, ref)
            assert not got.is_inference()  # (as the eager call's: autograd can save it)
    assert compiled.builds() - before == 2
    w = torch.randn(3, 3, dtype=D, requires_grad=True)
    (got * w).sum().backward()
    torch.testing.assert_close(w.grad, ref)


@pytest.mark.parametrize("stance", [
    {"stance": "eager_on_recompile"}, {"stance": "fail_on_recompile"},
    {"force_backend": "eager"}, {"stance": "force_eager"},
], ids=["eager_on_recompile", "fail_on_recompile", "force_backend", "force_eager"])
def test_a_recompile_under_the_users_stance_changes_no_buffer(stance):
    # (under eager_on_recompile, or a forced backend, dynamo ran the recompiled entry
    # without asking its sealed backend: spectral norm's power iteration wrote into the
    # module's buffers on every call; under fail_on_recompile the entry went eager for good)
    import copy

    x = torch.randn(3, dtype=D)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                torch.nn.Linear(4, 3)).to(D)
    before = compiled.builds()
    with torch.compiler.set_stance(**stance), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tv.JacobianWarning)
        for _ in range(2):
            torch.testing.assert_close(tv.jacobian(model, x, compile=True),
                                       torch.func.jacrev(model)(x))
        torch.nn.utils.parametrizations.spectral_norm(model[2])
        norm = model[2].parametrizations.weight[0]
        for _ in range(2):
            u, v, twin = norm._u.clone(), norm._v.clone(), copy.deepcopy(model)
            got = tv.jacobian(model, x, compile=True)
            assert torch.equal(norm._u, u) and torch.equal(norm._v, v)
            torch.testing.assert_close(got, torch.func.jacrev(twin)(x))
        from torch._dynamo import eval_frame  # (the user's stance, as it was set)
        assert eval_frame._stance.stance == stance.get("stance", "default")
    assert not [w for w in caught if "recompile" in str(w.message)]
    if stance.get("stance") == "force_eager":  # (every torch.compile ignored: eager calls)
        assert compiled.builds() == before


@pytest.mark.parametrize("dtype,scale", [(D, 1.0), (D, 1e-9), (torch.float32, 1e-4)],
                         ids=["float64", "float64-tiny", "float32-tiny"])
@pytest.mark.usefixtures("inductor")
def test_the_first_call_check_is_relative_to_the_results_scale(dtype, scale):
    # (the check allowed sqrt(eps) of max(scale, 1): for a Jacobian whose entries are all
    # far below 1 that is no check at all, and dropout's other mask in the compiled run
    # passed for the eager one's, unnoticed; float32's sqrt(eps) is 3.5e-4)
    x = torch.randn(6, dtype=dtype)
    f = lambda x: scale * F.dropout(x.sin(), 0.5, training=True)  # noqa: E731
    with pytest.warns(tv.JacobianWarning, match=r"compile=True could not compile the "
                      r"computation for .*\n  Why: the compiled result differs from the "
                      r"eager one by up to .*The function draws random numbers"):
        tv.jacobian(f, x, compile=True)


@pytest.mark.usefixtures("inductor")
@pytest.mark.parametrize("dtype", [D, torch.float32], ids=["float64", "float32"])
def test_a_valid_program_with_a_tiny_jacobian_compiles(dtype):
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4)).to(dtype)
    x = torch.randn(8, dtype=dtype)
    f = lambda x: 1e-7 * model(x).softmax(-1)  # noqa: E731
    before = compiled.builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for _ in range(2):
            got = tv.jacobian(f, x, compile=True)
    assert compiled.builds() - before == 1
    twin = copy.deepcopy(model).double()
    ref = torch.func.jacrev(lambda x: 1e-7 * twin(x).softmax(-1))(x.double())
    torch.testing.assert_close(got.double(), ref, rtol=1e-4 if dtype != D else 1e-7, atol=0)


_GLOBALS = {
    "default_dtype": (torch.set_default_dtype, torch.float32, torch.float64),
    "deterministic": (torch.use_deterministic_algorithms, False, True),
    "num_threads": (torch.set_num_threads, 1, 2),
    "matmul_precision": (torch.set_float32_matmul_precision, "highest", "high"),
}


@pytest.mark.parametrize("name", list(_GLOBALS))
def test_global_state_dynamo_guards_alternated_keeps_a_program_each(name):
    # (dynamo guards these process-wide settings; left out of the key, each switch
    # recompiled the one entry, and after REBUILD_WARN_AT switches it stayed eager with a
    # warning that blamed a global the function reads)
    setter, *values = _GLOBALS[name]
    getter = {"default_dtype": torch.get_default_dtype,
              "deterministic": torch.are_deterministic_algorithms_enabled,
              "num_threads": torch.get_num_threads,
              "matmul_precision": torch.get_float32_matmul_precision}[name]
    saved = getter()
    x = torch.randn(3, dtype=D)
    f = lambda x: x.sin() * x + torch.ones(3).to(x.dtype)  # noqa: E731
    before = compiled.builds()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", tv.JacobianWarning)
            for i in range(compiled.REBUILD_WARN_AT + 4):
                setter(values[i % 2])
                torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                           torch.func.jacrev(f)(x))
    finally:
        setter(saved)
    assert compiled.builds() - before == 2


@pytest.mark.usefixtures("inductor")
@pytest.mark.parametrize("dtype", [D, torch.float32], ids=["float64", "float32"])
def test_a_block_zero_but_for_rounding_compiles(dtype):
    # (the derivative of a layer norm with respect to a shift of all its inputs is zero;
    # computed, it is rounding, which the compiled program rounds otherwise: judged at the
    # scale of the other block, or of the rounding floor where it stands alone)
    torch.manual_seed(0)
    x, c = 3 * torch.randn(16, dtype=dtype), torch.tensor(0.7, dtype=dtype)
    w = torch.randn(16, dtype=dtype)
    f = lambda x, c: F.layer_norm(5 * x + c, (16,)) * w  # noqa: E731
    before = compiled.builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for _ in range(2):
            got = tv.jacobian(f, x, c, argnums=(0, 1), compile=True)
        alone = tv.jacobian(lambda c: f(x, c), c, strategy="rev", compile=True)
    assert compiled.builds() - before == 2
    ref = torch.func.jacrev(f, argnums=(0, 1))(x.double(), c.double())
    tol = 1e-12 if dtype == D else 1e-5
    torch.testing.assert_close(got[0].double(), ref[0], rtol=tol, atol=tol)
    assert got[1].abs().max() < tol and alone.abs().max() < tol


def _spectral_calls(model, x):
    """Two calls, a spectral norm registered, two more: each right, no buffer changed."""
    import copy

    for _ in range(2):
        torch.testing.assert_close(tv.jacobian(model, x, strategy="rev", compile=True),
                                   torch.func.jacrev(model)(x))
    torch.nn.utils.parametrizations.spectral_norm(model[2])
    norm = model[2].parametrizations.weight[0]
    for _ in range(2):
        u, v, twin = norm._u.clone(), norm._v.clone(), copy.deepcopy(model)
        got = tv.jacobian(model, x, strategy="rev", compile=True)
        assert torch.equal(norm._u, u) and torch.equal(norm._v, v)
        torch.testing.assert_close(got, torch.func.jacrev(twin)(x))


@pytest.mark.parametrize("how", ["environment", "config"])
def test_with_dynamo_disabled_compile_true_runs_the_eager_call(how, monkeypatch):
    # (TORCHDYNAMO_DISABLE=1 makes torch.compile return the function itself: the entry ran
    # the plain form eagerly, unguarded, without the eager call's buffers_kept; with
    # dynamo's config.disable, fullgraph found no frame to compile and the signature went
    # eager for good with a warning that blamed an internal error of torch.compile)
    import torch._dynamo.config

    import contextlib

    if how == "environment":
        monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    x = torch.randn(3, dtype=D)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                torch.nn.Linear(4, 3)).to(D)
    before = compiled.builds()
    with (torch._dynamo.config.patch(disable=True) if how == "config"
          else contextlib.nullcontext()), warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        _spectral_calls(model, x)
    assert compiled.builds() == before


def test_under_a_dispatch_mode_compile_true_runs_the_eager_call():
    # (dynamo compiles no frame under a TorchDispatchMode: the signature went eager for
    # good, after the mode was left too, with a warning that blamed torch.compile)
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(3, dtype=D)
    f = lambda x: x.sin() * x  # noqa: E731
    before = compiled.builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        with FlopCounterMode(display=False) as counter:
            got = tv.jacobian(f, x, compile=True)
        torch.testing.assert_close(got, torch.func.jacrev(f)(x))
        assert counter.get_total_flops() >= 0
        for _ in range(2):
            torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                       torch.func.jacrev(f)(x))
    assert compiled.builds() - before == 1


def test_a_compile_failure_ending_in_a_colon_is_quoted_with_what_follows():
    # (a first line that ends in a colon is not always an error without a message: dynamo's
    # "Skipped frames:" was said to be an internal error of torch.compile)
    from torch_vjp._engine.compile_checks import compile_failure

    err = RuntimeError("torch.compile with fullgraph=True found no compiled frames. Skipped "
                       "frames:\n  - run (compiled.py:193): Dynamo tracing is disabled")
    assert compile_failure(err) == (
        "RuntimeError: torch.compile with fullgraph=True found no compiled frames. Skipped "
        "frames: - run (compiled.py:193): Dynamo tracing is disabled")
    bare = RuntimeError("torch.compile with fullgraph=True found no compiled frames. "
                        "Skipped frames:")
    assert compile_failure(bare).endswith("Skipped frames: (none said)")

    class InductorError(Exception):
        pass

    assert compile_failure(InductorError("AssertionError:")) == (
        "InductorError: AssertionError: (an internal error of torch.compile with no message "
        "of its own, not an error of the function; TORCHDYNAMO_VERBOSE=1 shows where it "
        "arose)")
