"""Shared test configuration: deterministic seeds, hypothesis profiles, the ``cuda`` marker."""

from __future__ import annotations

import os

import pytest
import torch

try:
    from hypothesis import settings

    settings.register_profile("ci", deadline=None, print_blob=True)
    settings.register_profile("dev", deadline=None, max_examples=50)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass


@pytest.fixture
def op_log():
    """A TorchDispatchMode class whose instances record, in ``ops``, the aten ops that run
    under them: what a user's op logger or FLOP counter would see."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    return OpLog


@pytest.fixture
def float32_step():
    """A float64 function with a normalisation computed in float32 inside (as Llama's and
    T5's RMSNorm cast), and its point: every route rounds at float32's there."""
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(64, 32, generator=g, dtype=torch.float64)
    w2 = torch.randn(48, 64, generator=g, dtype=torch.float64)

    def f(x):
        h = (w1 @ x).float()
        h = (h - h.mean()) / (h - h.mean()).pow(2).mean().sqrt()
        return w2 @ h.double()

    return f, torch.randn(32, generator=g, dtype=torch.float64)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped where none is present")
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("OMP_NUM_THREADS") is None:
        # ``-n 2`` (the README's test command) runs two worker processes: each with torch's
        # default of one thread per core would run twice as many threads as there are cores.
        torch.set_num_threads(max(1, torch.get_num_threads() // int(
            os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


#: A test that runs longer has hung (a process group's teardown, say): pytest-timeout (in
#: the test extra) fails it with its stack instead of letting CI run to its own limit. The
#: slowest test takes under a minute on two cores.
TEST_TIMEOUT_S = 600


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.pluginmanager.hasplugin("timeout"):
        for item in items:
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_and_unchecked():
    """Every test starts from the same seed, and leaves torch's autograd unpatched."""
    from torch_vjp import autograd

    torch.manual_seed(0)
    yield
    assert not autograd.is_checked() or os.environ.get("TORCH_VJP_CHECKED") == "1", (
        "a test left torch_vjp.checked() installed"
    )


@pytest.fixture(autouse=True)
def _per_sample_rules_kept():
    """Rules a test (or a doctest) registers for its own layers are gone after it, as in a
    fresh process; the plans made with them go too."""
    from torch_vjp._per_sample import probe, registry

    rules, named = dict(registry._RULES), dict(registry._NAMED)
    yield
    if rules != registry._RULES or named != registry._NAMED:
        registry._RULES.clear()
        registry._RULES.update(rules)
        registry._NAMED.clear()
        registry._NAMED.update(named)
        probe.forget_plans()


@pytest.fixture
def fresh_dynamo(monkeypatch):
    """A test of compile=True starts and ends with dynamo's caches, its counters and
    torch_vjp's compiled entries empty (so that it counts only its own compilations).

    Within it a function is warned about after 3 programs rebuilt or recompiled for one
    signature, not 8 (``REBUILD_WARN_AT``): the same behaviour, with fewer of the slow
    compilations that lead up to it. The tests read the threshold, never assume its value."""
    from torch._dynamo.utils import counters

    from torch_vjp._engine import compiled

    monkeypatch.setattr(compiled, "REBUILD_WARN_AT", 3)
    torch._dynamo.reset()
    compiled.clear_cache()
    counters.clear()
    yield
    torch._dynamo.reset()
    compiled.clear_cache()


@pytest.fixture
def aot_eager_unless_inductor(request, monkeypatch):
    """compile=True programs built with ``aot_eager``, which compiles no C++, unless the test
    asks for :func:`inductor` (NOTE [the backend of the tests] in
    torch_vjp/_engine/compile_checks.py): for the tests of keys, caching, recompiles, guards,
    fallbacks and messages, whose point does not depend on what the graph is compiled to."""
    from torch_vjp._engine import compile_checks

    if "inductor" not in request.fixturenames:
        monkeypatch.setattr(compile_checks, "BACKEND", "aot_eager")


@pytest.fixture
def inductor():
    """The test's point is numerics through inductor: its compile=True programs are
    inductor's (under :func:`aot_eager_unless_inductor`)."""


def _spawn_within(worker, world, seconds, *, forkserver=False):
    """Runs ``worker(rank, world, init_file)`` on ``world`` ranks; a rank that still runs
    after ``seconds`` (a collective waiting for ever) fails the test instead of blocking it.

    With ``forkserver``, each rank is forked from one server process that imported torch,
    torch_vjp (``_shared_functions.FORKSERVER_PRELOAD``) and the worker's module once for
    every such run in this process (``mp.spawn`` starts a fresh interpreter per rank, which
    imports them again: seconds of CPU each). The
    ranks then inherit the server's environment, as it was when it started, not the test's:
    for workers that read no environment variable a test sets."""
    import tempfile
    import time

    import torch.multiprocessing as mp

    from _shared_functions import FORKSERVER_PRELOAD

    with tempfile.TemporaryDirectory() as d:
        args = (world, os.path.join(d, "init"))
        if forkserver and "forkserver" in mp.get_all_start_methods():
            mp.set_forkserver_preload([*FORKSERVER_PRELOAD, worker.__module__])
            ctx = mp.start_processes(worker, args=args, nprocs=world, join=False,
                                     start_method="forkserver")
        else:
            ctx = mp.spawn(worker, args=args, nprocs=world, join=False)
        deadline = time.monotonic() + seconds
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                pytest.fail(f"the ranks were still running after {seconds} s")


@pytest.fixture
def spawn_within():
    """:func:`_spawn_within`: the distributed tests' way to run ranks with a deadline."""
    return _spawn_within


def _ruled_pattern(f, x, exact=True):
    """Checks a sparsity rule on ``f`` at ``x``: no "no sparsity rule" warning; the pattern
    equal to the nonzeros of ``f``'s float64 Jacobian (``exact``), or a superset of them that
    is not dense; and ``sparse_jacobian``'s values equal to that Jacobian."""
    import warnings

    import torch_vjp as tv

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pattern = tv.jacobian_sparsity(f, x).to_dense().bool()
    assert not [w for w in caught if "no sparsity rule" in str(w.message)]
    reference = torch.autograd.functional.jacobian(f, x).reshape(pattern.shape)
    if exact:
        assert torch.equal(pattern, reference.ne(0))
    else:
        assert not bool((reference.ne(0) & ~pattern).any())
        assert pattern.sum() < pattern.numel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.sparse_jacobian(f, x, layout=torch.strided)
    torch.testing.assert_close(got, reference)


@pytest.fixture
def ruled_pattern():
    """:func:`_ruled_pattern`: the check of one sparsity rule, pattern and values."""
    return _ruled_pattern


@pytest.fixture
def fresh_route_checks(monkeypatch):
    """The route checks of "auto" and of batched VJPs forgotten (and warnings not yet
    given), so that a test sees its own first call; put back afterwards."""
    from torch_vjp import _errors
    from torch_vjp._engine import fwdcheck

    monkeypatch.setattr(_errors, "_WARNED", set())  # (once per function otherwise)
    saved = dict(fwdcheck.CHECKED)
    fwdcheck.CHECKED.clear()
    yield
    fwdcheck.CHECKED.clear()
    fwdcheck.CHECKED.update(saved)


@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone."""
    import tempfile

    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'init')}",
                                rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
