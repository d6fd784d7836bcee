"""The suite runner: check every method against the reference, time it, tabulate the results.

For each workload, the runner builds the float32 case and the float64 reference
(``torch.func.jacrev``, see :func:`~torch_vjp.bench.methods.reference`), then for each
method: prepares it, calls it once (the warm-up, which for jax includes compilation)
and compares the result with the reference. A torch_vjp method that raises is recorded as
``"failed"`` with its error; a method of another tool (``torch.func``,
``torch.autograd``, jax) that raises is ``"unsupported"``: that tool does not support the
workload, which says nothing about torch_vjp. A method whose result is off is ``"wrong"``.

Methods that ran are timed ``rounds`` times, the methods of a workload interleaved (so a
busy spell of the machine hits all methods alike), on the thread count set for the run.
In each round a method is timed by ``torch.utils.benchmark.Timer.blocked_autorange``,
which runs it in blocks of calls until ``min_run_time`` is spent. A method slower than
``once_over`` seconds per call (``min_run_time`` by default) is timed by one call per
round instead, with ``time.perf_counter`` (``blocked_autorange`` would make two, one
untimed), and marked ``timed_once``: from the first round when its checked first call
was that slow, else (jax's first call compiles) from the round after one found it so.
Its time is the median of the rounds' medians, robust to a disturbed round (the
smallest round would keep whichever was luckiest); its spread is the interquartile range
(IQR) of every timed block of every round. A time whose IQR exceeds
:data:`~torch_vjp._measure.NOISY_SPREAD` of it is marked ``noisy``: too wide to rank.
"""


from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from torch_vjp.bench.methods import Method, get_methods, jax_available, jax_runs_on, reference
from torch_vjp.bench.suite import MethodResult, SuiteResult, WorkloadResult
from torch_vjp.bench.workloads import Case, Workload
from torch_vjp._errors import JacobianOptionError
from torch_vjp._measure import (
    NOISY_SPREAD,
    block_times,
    check_min_run_time,
    check_result,
    cpu_model,
    leaves,
    reason,
    summarize_times,
)

__all__ = ["run_suite", "environment", "SuiteInterrupted"]


class SuiteInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run_suite` after one workload or more had finished: still a
    ``KeyboardInterrupt``, with those workloads' results in ``result`` (its environment says
    how many of the suite's had finished)."""

    def __init__(self, result: SuiteResult) -> None:
        super().__init__()
        self.result = result


def environment(*, device: str, threads: int, dtype: torch.dtype, quick: bool,
                min_run_time: float, rounds: int = 1, use_jax: bool = True,
                all_methods: bool = False) -> dict[str, Any]:
    """The facts a reader needs to compare results: versions, machine, settings."""
    import torch_vjp

    jax_version = None
    if jax_available():
        import jax

        jax_version = jax.__version__
    use_jax = use_jax and jax_version is not None
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "torch_vjp": torch_vjp.__version__,
        "torch": torch.__version__,
        "jax": jax_version,
        "jax_used": use_jax,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": load,
        "gpu": gpu,
        "device": device,
        "threads": threads,
        "jax_threads": "XLA's default (all cores)" if use_jax else None,
        "dtype": str(dtype).replace("torch.", ""),
        "quick": quick,
        "all_methods": all_methods,
        "min_run_time": min_run_time,
        "rounds": rounds,
        "noisy_spread": NOISY_SPREAD,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "argv": list(sys.argv),
    }


def _progress(total: int, enabled: bool) -> Any:
    """A tqdm progress bar on stderr, or a silent stand-in when disabled or not installed."""
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(total=total, unit="case", file=sys.stderr, dynamic_ncols=True, leave=False)
        except ImportError:
            pass

    class _Silent:
        def update(self, n: int = 1) -> None:
            pass

        def set_description_str(self, s: str) -> None:
            pass

        def close(self) -> None:
            pass

    return _Silent()


def run_suite(
    workloads: Sequence[Workload],
    *,
    methods: Sequence[str] | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    threads: int | None = None,
    min_run_time: float = 0.3,
    rounds: int = 1,
    quick: bool = False,
    use_jax: bool = True,
    progress: bool = True,
    drop_slow: bool = True,
    once_over: float | None = None,
    aggregate: str = "median",
) -> SuiteResult:
    """Runs ``workloads`` x methods: checks each against the float64 reference, times it.

    Args:
        workloads: From :func:`~torch_vjp.bench.workloads.get_workloads`.
        methods: Method names to keep (exact); ``None`` runs every method of each kind
            (except the slow ones, unless ``drop_slow=False``).
        device: ``"cpu"`` or a CUDA device; jax's methods run on the same device (left
            out where jax has none of its kind, e.g. a CPU-only jax and ``"cuda"``).
        dtype: Dtype of the timed runs (the reference is float64).
        threads: ``torch.set_num_threads`` for the run (restored afterwards); default: the
            number of cores this process may use.
        min_run_time: ``blocked_autorange``'s budget per method and round, in seconds.
        rounds: Times each method this many times, interleaved (module docstring).
        aggregate: ``"median"`` (default) or ``"min"`` of the rounds' medians: the
            method's time, by which methods are ranked.
        quick: Record the run as the quick suite.
        use_jax: Include jax's methods when jax can be imported.
        progress: Show a tqdm progress bar on stderr.
        drop_slow: Leave out the Python-loop and full-then-diagonal methods
            (``Method.slow``), which are 20 to 30,000 times slower than the vectorised ones.
        once_over: A method whose calls take longer (seconds) in the first round is
            timed by one call in each later round (module docstring); default
            ``min_run_time``.

    Returns:
        A :class:`SuiteResult`.

    Raises:
        JacobianOptionError: ``min_run_time`` is not a finite number of seconds > 0,
            ``rounds`` or ``threads`` is not an int >= 1, or ``aggregate`` is neither
            ``"median"`` nor ``"min"`` (checked before anything runs).
        KeyboardInterrupt: Ctrl-C; after one workload or more had finished, a
            ``SuiteInterrupted`` (a ``KeyboardInterrupt``) whose ``result`` holds them.
    """
    call = "torch_vjp.bench.run_suite"
    min_run_time = check_min_run_time(min_run_time, call=call)
    for name, value in (("rounds", rounds), ("threads", threads)):
        if value is None and name == "threads":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise JacobianOptionError(
                f"{call}: {name}={value!r}, but it must be an int >= 1"
                + (": how many times each method is timed (interleaved rounds). Fix: "
                   "rounds=1 for one round." if name == "rounds" else
                   ": the torch.set_num_threads of the run. Fix: leave threads=None for "
                   "the cores this process may use.")
            )
    if aggregate not in ("min", "median"):
        raise JacobianOptionError(
            f"{call}: aggregate={aggregate!r}, but it must be 'median' (the median of the "
            f"rounds' medians, the default) or 'min' (the least disturbed round's median)."
        )
    if threads is None:
        if hasattr(os, "sched_getaffinity"):
            threads = len(os.sched_getaffinity(0))
        else:
            threads = os.cpu_count() or 1
    once_over = min_run_time if once_over is None else once_over
    use_jax = use_jax and jax_runs_on(device)
    plan = [(w, get_methods(w.kind, names=methods, jax=use_jax, include_slow=not drop_slow))
            for w in workloads]
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    bar = _progress(sum(len(ms) for _, ms in plan) * (1 + rounds), progress)
    results = []
    interrupted = False
    try:
        # (grad mode on and inference mode off, whatever the caller's: under torch.no_grad()
        # the jacobian_of workload's graph was never recorded, torch_vjp's method was 'wrong'
        # with zeros and autograd.grad's 'unsupported')
        with torch.inference_mode(False), torch.enable_grad(), _full_float32(device):
            for workload, ms in plan:
                results.append(_run_workload(workload, ms, device, dtype, min_run_time,
                                             rounds, once_over, aggregate, bar))
    except KeyboardInterrupt:
        if not results:
            raise
        interrupted = True  # (the finished workloads are kept: SuiteInterrupted below)
    finally:
        bar.close()
        torch.set_num_threads(saved_threads)
    env = environment(device=device, threads=threads, dtype=dtype, quick=quick,
                      min_run_time=min_run_time, rounds=rounds, use_jax=use_jax,
                      all_methods=not drop_slow)
    env["once_over_s"] = once_over
    env["aggregate"] = aggregate
    if torch.device(device).type == "cuda":
        env["float32_arithmetic"] = "full (TF32 off in torch; jax matmul precision 'highest')"
    if interrupted:
        env["interrupted"] = f"{len(results)} of {len(plan)} workloads"
        raise SuiteInterrupted(SuiteResult(env, results)) from None
    return SuiteResult(env, results)


@contextlib.contextmanager
def _full_float32(device: str) -> Iterator[None]:
    """On a GPU, every method computes in full float32: torch's convolutions there default to
    TF32 (10-bit mantissas), which the check against the float64 reference rightly fails
    (jax's methods are traced with matmul precision 'highest' for the same reason). Both
    settings are restored after; nothing changes on the CPU."""
    if torch.device(device).type != "cuda":
        yield
        return
    cudnn = torch.backends.cudnn
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark,
                         deterministic=cudnn.deterministic, allow_tf32=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _wait(device: str) -> None:
    """Waits for the device's queued work, so that a wall-clock time covers it (CUDA runs
    asynchronously; ``Timer`` waits by itself)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _sizes(case: Case) -> tuple[int, int]:
    """The Jacobian's columns and rows: differentiated input and output elements (per
    example for a ``"batch_jacobian"`` workload)."""
    with torch.no_grad():
        if case.workload.kind == "batch_jacobian":
            x = case.primals[0][0]
            return x.numel(), sum(t.numel() for t in leaves(case.f_single(x)))
        out = case.f(*case.primals)
    nums = (case.argnums,) if isinstance(case.argnums, int) else tuple(case.argnums)
    n_in = sum(t.numel() for i in nums for t in leaves(case.primals[i]))
    return n_in, sum(t.numel() for t in leaves(out))


def _run_workload(workload: Workload, methods: list[Method], device: str, dtype: torch.dtype,
                  min_run_time: float, rounds: int, once_over: float, aggregate: str,
                  bar: Any) -> WorkloadResult:
    case = workload.build(dtype, device)
    n_in, n_out = _sizes(case)
    ref = reference(workload, device)
    shapes = [list(t.shape) for t in leaves(ref)]
    worst_tol = 0.0
    results: list[MethodResult] = []
    ready: list[tuple[MethodResult, Callable[[], Any]]] = []
    samples: dict[int, list[list[float]]] = {}
    for method in methods:
        bar.set_description_str(f"{workload.name}: {method.name} (check)")
        result = MethodResult(method.name, method.family, "failed")
        results.append(result)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prepared = method.prepare(case)
                start = time.perf_counter()
                out = prepared.run()
                _wait(device)
                result.first_call_s = time.perf_counter() - start
                out = prepared.to_torch(out)
        except Exception as exc:  # noqa: BLE001 - a failing method is a row with its error
            result.error = reason(exc)
            if method.family != "torch_vjp":
                result.status = "unsupported"  # the other tool refuses this workload
            bar.update(1 + rounds)
            continue
        try:
            result.max_abs_error, tol, why = check_result(out, ref, None, None)
            worst_tol = max(worst_tol, tol)
            if why is None:
                result.status = "ok"
            else:
                result.status, result.error = "wrong", why
        except (ValueError, TypeError) as exc:
            result.status, result.error = "wrong", str(exc)
        del out
        samples[id(result)] = []
        # Slower than the budget: one call per round from the first (for jax, whose first
        # call compiled, the first round decides). A first call also pays what the process
        # does once (imports, caches of the first workload): the decision is confirmed on a
        # second, warm call.
        result.timed_once = method.family != "jax" and result.first_call_s > once_over
        if result.timed_once:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    start = time.perf_counter()
                    prepared.run()
                    _wait(device)
                    result.timed_once = time.perf_counter() - start > once_over
            except Exception:  # noqa: BLE001 - the rounds below record a failing call
                pass
        ready.append((result, prepared.run))
        bar.update(1)
    for _ in range(rounds):
        for result, run in ready:
            bar.set_description_str(f"{workload.name}: {result.method}")
            if result.status == "failed":
                bar.update(1)
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if result.timed_once:
                        start = time.perf_counter()
                        run()
                        _wait(device)
                        times = [time.perf_counter() - start]
                    else:
                        times = block_times(run, min_run_time)
            except Exception as exc:  # noqa: BLE001
                result.status, result.error = "failed", f"on a repeated call: {reason(exc)}"
            else:
                samples[id(result)].append(times)
                # A call longer than the budget: blocked_autorange timed one call after an
                # untimed one; the later rounds time one call each.
                result.timed_once |= statistics.median(times) > once_over
            bar.update(1)
    for result, _ in ready:
        timed = samples[id(result)]
        if not timed or result.status == "failed":
            continue
        result.round_times_s = [statistics.median(t) for t in timed]
        timing = summarize_times(timed)
        result.time_s = min(result.round_times_s) if aggregate == "min" else timing.median
        result.q1_s, result.q3_s, result.samples = timing.q1, timing.q3, timing.samples
        result.iqr_s = timing.iqr
        result.noisy = result.timing.noisy
    wres = WorkloadResult(workload.name, workload.title, workload.kind, shapes, worst_tol,
                          results, n_in, n_out)
    best = wres.best
    for r in results:
        if r.time_s is not None and best is not None:
            r.ratio = r.time_s / best.time_s
    return wres
