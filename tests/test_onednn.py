"""compile=True's float32 CPU products by oneDNN (torch_vjp/_engine/onednn.py; NOTE [oneDNN
products]).

The pass is forced on (or off) here, whatever this machine's measurement says; every result
is checked against torch.func.jacrev in float64, and the products oneDNN ran are counted where
they run, not assumed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import torch_vjp as tv
from torch_vjp._engine import compiled, onednn

pytestmark = [
    pytest.mark.usefixtures("fresh_dynamo"),  # tests/conftest.py
    pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN"),
]


@pytest.fixture
def counted(monkeypatch):
    """The products oneDNN runs, as ``(m, k, n, with_bias)``, with the pass on."""
    monkeypatch.setattr(onednn, "_FASTER", True)
    calls = []
    real = onednn._linear

    def linear(a, w, bias):
        calls.append((a.shape[0], a.shape[1], w.shape[0], bias is not None))
        return real(a, w, bias)

    monkeypatch.setattr(onednn, "_linear", linear)
    return calls


def _mlp(sizes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ws = [(torch.randn(o, i, dtype=torch.float64, generator=g) / i ** 0.5).to(dtype)
          for i, o in zip(sizes[:-1], sizes[1:])]  # (the same numbers in either dtype)
    bs = [torch.randn(o, dtype=torch.float64, generator=g).to(dtype) for o in sizes[1:]]

    def f(x):
        for w, b in zip(ws[:-1], bs[:-1]):
            x = torch.tanh(x @ w.T + b)
        return x @ ws[-1].T + bs[-1]
    return f, ws, bs


def _in64(f_maker, sizes, seed=0):
    return f_maker(sizes, torch.float64, seed)[0]


@pytest.mark.parametrize("strategy", ["fwd", "rev"])
def test_the_large_products_of_a_float32_jacobian_run_on_onednn_and_agree(counted, strategy):
    sizes = (96, 256, 256, 96)
    f, _, _ = _mlp(sizes, torch.float32)
    x = torch.randn(96)
    got = tv.jacobian(f, x, strategy=strategy, compile=True)
    assert counted, "no product reached oneDNN"
    assert all(m * k * n >= onednn.MIN_WORK for m, k, n, _ in counted)
    want = torch.func.jacrev(_in64(_mlp, sizes))(x.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    calls = len(counted)
    again = tv.jacobian(f, x, strategy=strategy, compile=True)  # (the cached program)
    assert len(counted) > calls
    torch.testing.assert_close(again, got)


def test_float64_and_small_products_stay_with_aten(counted):
    f64 = _in64(_mlp, (96, 256, 256, 96))
    x = torch.randn(96, dtype=torch.float64)
    torch.testing.assert_close(tv.jacobian(f64, x, compile=True), torch.func.jacrev(f64)(x))
    small, _, _ = _mlp((8, 16, 16, 8), torch.float32)
    xs = torch.randn(8)
    got = tv.jacobian(small, xs, compile=True)
    torch.testing.assert_close(got.double(), torch.func.jacrev(_in64(_mlp, (8, 16, 16, 8)))(
        xs.double()), rtol=1e-5, atol=1e-6)
    assert counted == []


def test_a_batch_jacobians_bias_products_run_as_one_onednn_call(counted):
    sizes = (32, 256, 256, 16)
    f, _, _ = _mlp(sizes, torch.float32)
    x = torch.randn(64, 32)
    got = tv.batch_jacobian(f, x, compile=True)
    assert any(bias for *_, bias in counted), counted  # (addmm: x @ W.T + b, 64 x 256 x 256)
    want = torch.func.vmap(torch.func.jacrev(_in64(_mlp, sizes)))(x.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_the_pass_off_gives_the_same_jacobian(monkeypatch, counted):
    sizes = (64, 256, 64)
    f, _, _ = _mlp(sizes, torch.float32)
    x = torch.randn(64)
    on = tv.jacobian(f, x, compile=True)
    assert counted
    monkeypatch.setattr(onednn, "_FASTER", False)
    torch._dynamo.reset()
    compiled.clear_cache()  # (compiled again, without the pass)
    n = len(counted)
    off = tv.jacobian(f, x, compile=True)
    assert len(counted) == n
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["plain", "a.T", "b.T", "sliced", "expanded"])
def test_the_operators_agree_with_a_float64_product_on_any_layout(layout):
    ops = onednn.OneDnnProducts().ops
    g = torch.Generator().manual_seed(1)
    a = torch.randn(40, 24, generator=g)
    b = torch.randn(24, 30, generator=g)
    if layout == "a.T":
        a = a.T.contiguous().T
    elif layout == "b.T":
        b = b.T.contiguous().T
    elif layout == "sliced":
        a = torch.randn(80, 50, generator=g)[::2, 1:25]
    elif layout == "expanded":
        b = torch.randn(24, 1, generator=g).expand(24, 30)
    bias = torch.randn(30, generator=g)
    want = a.double() @ b.double()
    torch.testing.assert_close(ops.mm(a, b).double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.addmm(bias, a, b).double(), want + bias.double(),
                               rtol=1e-5, atol=1e-5)


def test_without_onednn_nothing_is_measured_or_rewritten(monkeypatch):
    monkeypatch.setattr(onednn, "_FASTER", None)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert onednn.faster_here() is False
    monkeypatch.setattr(onednn, "_linear", lambda *a: pytest.fail("oneDNN was called"))
    f, _, _ = _mlp((64, 256, 64), torch.float32)
    x = torch.randn(64)
    got = tv.jacobian(f, x, compile=True)
    torch.testing.assert_close(got.double(), torch.func.jacrev(_in64(_mlp, (64, 256, 64)))(
        x.double()), rtol=1e-5, atol=1e-6)


def test_a_program_read_from_inductors_disk_cache_finds_its_operators(tmp_path):
    # (a second process finds the first one's compiled program on disk, which calls
    # torch_vjp::mm, without running the pass that defines it: it must be defined anyway)
    script = textwrap.dedent("""
        import warnings
        import torch
        import torch_vjp as tv
        from torch_vjp._engine import onednn
        onednn._FASTER = True
        runs, real = [], onednn._linear
        onednn._linear = lambda *a: runs.append(1) or real(*a)
        torch.manual_seed(0)
        w1, w2 = torch.randn(256, 64), torch.randn(64, 256)
        f = lambda x: torch.tanh(x @ w1.T) @ w2.T
        x = torch.randn(64)
        with warnings.catch_warnings():
            warnings.simplefilter("error", tv.JacobianWarning)  # (no fallback to eager)
            got = tv.jacobian(f, x, compile=True)
            got = tv.jacobian(f, x, compile=True)
        want = torch.func.jacrev(f)(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        print("ok" if runs else "oneDNN never ran")
    """)
    # (scalar C++ kernels compiled in the process itself: no probing of the CPU's vector
    # instructions by compiling test programs into the empty cache, no pool of compile
    # workers each importing torch; the program still calls torch_vjp::mm, which is what
    # the second process must find defined)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
           "TORCHINDUCTOR_VEC_ISA_OK": "0", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    import torch.multiprocessing as mp

    from _shared_functions import FORKSERVER_PRELOAD

    # (each process forked from the fork server the distributed tests' ranks share, which
    # imported torch and torch_vjp and ran nothing: a fresh interpreter imports them again,
    # seconds of CPU each. Where the environment checks every call, or there is no fork
    # server, a fresh interpreter)
    forked = ("forkserver" in mp.get_all_start_methods()
              and os.environ.get("TORCH_VJP_CHECKED") != "1")
    if forked:
        mp.set_forkserver_preload([*FORKSERVER_PRELOAD, __name__])
        ctx = mp.get_context("forkserver")
    for run in ("writes the cache", "reads it"):
        if forked:
            reply = ctx.Queue()
            child = ctx.Process(target=_run_in_child, args=(script, env, reply), daemon=True)
            child.start()
            try:
                said, err = reply.get(timeout=300)
            finally:
                child.join(timeout=30)
                if child.is_alive():
                    child.kill()
                    child.join()
        else:
            out = subprocess.run([sys.executable, "-c", script],
                                 env={k: v for k, v in {**os.environ, **env}.items()
                                      if k != "TORCH_VJP_CHECKED"},
                                 capture_output=True, text=True, timeout=300)
            said, err = out.stdout if out.returncode == 0 else "", out.stderr[-3000:]
        assert said.strip() == "ok", (run, err)


def _run_in_child(script, env, reply):
    """Runs ``script`` in a child of the fork server, with inductor configured as ``env``
    would configure it in a fresh interpreter (the server read its own environment when it
    imported torch); puts what it printed and its traceback, if any, on ``reply``."""
    import contextlib
    import io
    import traceback

    from torch._functorch import config as functorch_config
    from torch._inductor import config

    os.environ.update(env)  # (TORCHINDUCTOR_CACHE_DIR is read when a program is cached)
    config.fx_graph_cache = env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1"
    functorch_config.enable_autograd_cache = env["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"
    config.cpp.vec_isa_ok = env["TORCHINDUCTOR_VEC_ISA_OK"] == "1"
    config.compile_threads = int(env["TORCHINDUCTOR_COMPILE_THREADS"])
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(script, "<child>", "exec"), {})
        reply.put((printed.getvalue(), ""))
    except BaseException:
        reply.put(("", traceback.format_exc()[-3000:]))


def test_the_measurement_compares_the_two_kernels(monkeypatch):
    # (a machine where oneDNN is no faster keeps aten.mm: the decision is measured, never
    # assumed; here oneDNN is made slow)
    import time

    monkeypatch.setattr(onednn, "_FASTER", None)
    real = onednn._linear

    def slow(a, w, bias):
        time.sleep(0.02)
        return real(a, w, bias)

    monkeypatch.setattr(onednn, "_linear", slow)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert onednn.faster_here() is False
