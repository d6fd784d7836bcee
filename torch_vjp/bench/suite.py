"""The suite runner: check every method against the reference, time it, tabulate the results.

For each workload, the runner builds the float32 case and the float64 reference
(``torch.func.jacrev``, see :func:`~torch_vjp.bench.methods.reference`), then for each
method: prepares it, calls it once (the warm-up, which for jax includes compilation)
and compares the result with the reference; a method that raises is recorded as
``"failed"`` with its error, one whose result is off as ``"wrong"``. Methods that ran are
timed with ``torch.utils.benchmark.Timer.blocked_autorange`` (median of one call), on the
thread count set for the run. With ``rounds > 1`` every method of a workload is timed once
per round, the methods interleaved (so a busy spell of the machine hits all methods
alike), and the smallest of the rounds' medians is kept: on a shared machine, other
processes can only add time, so the least disturbed round is the best estimate
(``aggregate="median"`` keeps the median of the rounds instead). A method whose checked first call took
longer than ``once_over`` seconds (a Python loop over thousands of products, say) is
timed by one more call alone, with ``time.perf_counter``, in the first round only, and
marked ``timed_once``: that keeps the suite's running time bounded.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from torch_vjp.bench.methods import HEADLINE, Method, get_methods, jax_available, reference
from torch_vjp.bench.workloads import Workload
from torch_vjp._errors import JacobianOptionError
from torch_vjp._measure import (
    check_min_run_time,
    format_table,
    format_time,
    leaves,
    max_error,
    median_time,
    reason,
    shorten,
    tolerance,
)

__all__ = [
    "MethodResult",
    "WorkloadResult",
    "SuiteResult",
    "run_suite",
    "environment",
    "SCHEMA",
]

#: The ``"schema"`` value of the suite's JSON.
SCHEMA = "torch_vjp.bench/1"


@dataclass
class MethodResult:
    """One method on one workload.

    Attributes:
        method: The method's name.
        family: ``"torch_vjp"``, ``"torch.func"``, ``"torch.autograd"`` or ``"jax"``.
        status: ``"ok"``, ``"wrong"`` (its result differs from the reference by more than
            the tolerance) or ``"failed"`` (it raised; ``error`` holds the exception).
        time_s: Median seconds per call, or ``None`` when it failed.
        first_call_s: Seconds of the first (checked) call, compilation included.
        max_abs_error: Largest absolute difference from the float64 reference.
        error: Why the method is not ``"ok"`` (``"TypeName: message"``), else ``None``.
        ratio: ``time_s`` over the workload's fastest correct method's (filled in by the
            runner), or ``None``.
        round_times_s: The median of each round.
        timed_once: The first call took so long that one more call was timed, alone.
    """

    method: str
    family: str
    status: str
    time_s: float | None = None
    first_call_s: float | None = None
    max_abs_error: float | None = None
    error: str | None = None
    ratio: float | None = None
    round_times_s: list[float] = field(default_factory=list)
    timed_once: bool = False


@dataclass
class WorkloadResult:
    """Every method's result on one workload.

    Attributes:
        name: The workload's name.
        title: What it computes.
        kind: ``"jacobian"``, ``"batch_jacobian"`` or ``"jacobian_of"``.
        jacobian_shapes: The shapes of the reference's blocks.
        tolerance: The error an ``"ok"`` method may have.
        results: One :class:`MethodResult` per method.
    """

    name: str
    title: str
    kind: str
    jacobian_shapes: list[list[int]]
    tolerance: float
    results: list[MethodResult]

    @property
    def best(self) -> MethodResult | None:
        """The fastest method whose result matched the reference."""
        timed = [r for r in self.results if r.status == "ok" and r.time_s is not None]
        return min(timed, key=lambda r: r.time_s) if timed else None

    @property
    def headline(self) -> MethodResult | None:
        """torch_vjp's default method on this workload (``"torch_vjp auto"`` and the like)."""
        return self.result(HEADLINE[self.kind])

    def result(self, method: str) -> MethodResult | None:
        """The result of the method of that name, or ``None`` when it was not run."""
        return next((r for r in self.results if r.method == method), None)

    def fastest(self, predicate: Callable[[MethodResult], bool]) -> MethodResult | None:
        """The fastest correct result among those ``predicate`` accepts."""
        timed = [r for r in self.results
                 if r.status == "ok" and r.time_s is not None and predicate(r)]
        return min(timed, key=lambda r: r.time_s) if timed else None


@dataclass
class SuiteResult:
    """The results of one run of the suite, and the environment it ran in."""

    environment: dict[str, Any]
    workloads: list[WorkloadResult]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable values (schema :data:`SCHEMA`; times in seconds)."""
        out = []
        for w in self.workloads:
            item = asdict(w)
            best, head = w.best, w.headline
            item["best"] = best.method if best else None
            item["headline"] = head.method if head else None
            item["headline_over_best"] = _ratio(head, best)
            out.append(item)
        return {"schema": SCHEMA, "environment": self.environment, "workloads": out}

    def write_json(self, path: str | os.PathLike[str]) -> Path:
        """Writes :meth:`to_dict` as indented JSON; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    # ---- tables ------------------------------------------------------------------

    def header_lines(self) -> list[str]:
        env = self.environment
        jax = f", {jax_note(env)}"
        return [
            f"torch_vjp {env['torch_vjp']} Jacobian benchmark: torch {env['torch']}{jax}, "
            f"Python {env['python']}",
            f"{env['device']} ({env['cpu']}), {env['threads']} threads, {env['dtype']}, "
            f"{'quick' if env['quick'] else 'full'} suite, min_run_time {env['min_run_time']} s"
            + (f", {env['rounds']} interleaved rounds ({env.get('aggregate', 'median')} kept)"
               if env.get("rounds", 1) > 1 else ""),
            "time: median of one call (torch.utils.benchmark.Timer.blocked_autorange); "
            "x best: time / fastest correct method on the workload",
        ]

    def summary_rows(self) -> list[tuple[str, ...]]:
        rows = []
        for w in self.workloads:
            best, head = w.best, w.headline
            torch_best = w.fastest(lambda r: r.family != "jax")
            rows.append((
                w.name,
                best.method if best else "-",
                format_time(best.time_s if best else None),
                format_time(head.time_s if head and head.status == "ok" else None),
                _fmt_ratio(_ratio(head, best)),
                _fmt_ratio(_ratio(head, torch_best)),
            ))
        return rows

    SUMMARY_HEADER = ("workload", "fastest method", "its time", "torch_vjp default",
                      "default / fastest", "default / fastest torch")

    def detail_rows(self, w: WorkloadResult, width: int | None = 90) -> list[tuple[str, ...]]:
        """Per method: name (``*`` before the fastest), time, ratio, error, note."""
        best = w.best
        rows = []
        for r in w.results:
            mark = "*" if best is not None and r is best else ""
            if r.status == "failed":
                note = f"FAILED: {r.error}"
            elif r.status == "wrong":
                note = f"WRONG: {r.error}"
            else:
                note = ""
            if width is not None:
                note = shorten(note, width)
            if r.timed_once and not note:
                note = "slow: timed by one call"
            error = "-" if r.max_abs_error is None else f"{r.max_abs_error:.1e}"
            rows.append((mark + r.method, format_time(r.time_s), _fmt_ratio(r.ratio), error, note))
        return rows

    DETAIL_HEADER = ("method", "time", "x best", "max abs err", "")

    def table(self) -> str:
        """The aligned plain-text report: one block per workload, then the summary."""
        lines = self.header_lines() + [""]
        for w in self.workloads:
            shapes = ", ".join(_shape(s) for s in w.jacobian_shapes)
            lines.append(f"{w.name}: {w.title}; Jacobian {shapes}")
            lines += ["  " + line for line in format_table(self.DETAIL_HEADER, self.detail_rows(w),
                                                              "<>>><")]
            lines.append("")
        lines.append("summary (* marks the fastest method in each block above)")
        lines += ["  " + line for line in format_table(self.SUMMARY_HEADER, self.summary_rows(),
                                                          "<<>>>>")]
        return "\n".join(lines)

    def markdown(self, image: str | None = None) -> str:
        """The results as Markdown: environment, summary table, a table per workload."""
        env = self.environment
        out = ["# torch_vjp Jacobian benchmark", ""]
        out.append(
            f"torch {env['torch']}, {jax_note(env)}, "
            f"Python {env['python']}; "
            f"{env['device']} ({env['cpu']}), {env['threads']} threads, {env['dtype']}; "
            f"{'quick' if env['quick'] else 'full'} suite, min_run_time {env['min_run_time']} s"
            + (f", {env['rounds']} interleaved rounds ({env.get('aggregate', 'median')} of "
               "the rounds' medians kept)" if env.get("rounds", 1) > 1 else "")
            + f"; {env['date']}."
        )
        out += ["", "Times are medians of one call "
                "(`torch.utils.benchmark.Timer.blocked_autorange`). "
                "Every method's result was checked against a float64 `torch.func.jacrev` reference "
                "before it was timed. *default* is torch_vjp with default settings "
                "(`jacobian`, `batch_jacobian` or `jacobian_of`, strategy `auto`).", ""]
        if image:
            out += [f"![suite results]({image})", ""]
        out += ["## Summary", ""]
        out += _markdown_table(self.SUMMARY_HEADER, self.summary_rows())
        for w in self.workloads:
            shapes = ", ".join(_shape(s) for s in w.jacobian_shapes)
            out += ["", f"## {w.name}", "", f"{w.title}; Jacobian {shapes}.", ""]
            rows = [(f"**{m[1:]}** (fastest)" if m.startswith("*") else m, *rest)
                    for m, *rest in self.detail_rows(w, width=160)]
            out += _markdown_table(("method", "time", "x best", "max abs err", "note"), rows)
        return "\n".join(out) + "\n"


def jax_note(env: dict[str, Any]) -> str:
    """``jax 0.4.30``, ``jax 0.4.30 (not run)`` or ``jax not installed``."""
    if not env.get("jax"):
        return "jax not installed"
    return f"jax {env['jax']}" + ("" if env.get("jax_used", True) else " (not run)")


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _ratio(a: MethodResult | None, b: MethodResult | None) -> float | None:
    if a is None or b is None or a.status != "ok" or not a.time_s or not b.time_s:
        return None
    return a.time_s / b.time_s


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    def esc(cell: str) -> str:
        return cell.replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return lines


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(*, device: str, threads: int, dtype: torch.dtype, quick: bool,
                min_run_time: float, rounds: int = 1, use_jax: bool = True) -> dict[str, Any]:
    """The facts a reader needs to compare results: versions, machine, settings."""
    import torch_vjp

    jax_version = None
    if jax_available():
        import jax

        jax_version = jax.__version__
    use_jax = use_jax and jax_version is not None
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None
    return {
        "torch_vjp": torch_vjp.__version__,
        "torch": torch.__version__,
        "jax": jax_version,
        "jax_used": use_jax,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu": gpu,
        "device": device,
        "threads": threads,
        "jax_threads": "XLA's default (all cores)" if use_jax else None,
        "dtype": str(dtype).replace("torch.", ""),
        "quick": quick,
        "min_run_time": min_run_time,
        "rounds": rounds,
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
    drop_slow: bool | None = None,
    once_over: float = 1.0,
    aggregate: str = "min",
) -> SuiteResult:
    """Runs ``workloads`` x methods: checks each against the float64 reference, times it.

    Args:
        workloads: From :func:`~torch_vjp.bench.workloads.get_workloads`.
        methods: Method names to keep (exact); ``None`` runs every method of each kind.
        device: ``"cpu"`` or a CUDA device; jax always runs on the CPU (and is left out
            on other devices).
        dtype: Dtype of the timed runs (the reference is float64).
        threads: ``torch.set_num_threads`` for the run (restored afterwards); default: the
            number of cores this process may use.
        min_run_time: ``blocked_autorange``'s budget per method and round, in seconds.
        rounds: Times each method this many times, interleaved (module docstring).
        aggregate: ``"min"`` (default) or ``"median"`` of the rounds' medians.
        quick: Record the run as the quick suite.
        use_jax: Include jax's methods when jax can be imported.
        progress: Show a tqdm progress bar on stderr.
        drop_slow: Leave out the Python-loop methods; default: ``quick``.
        once_over: A method whose first call takes longer (seconds) is timed by that call
            alone (module docstring).

    Returns:
        A :class:`SuiteResult`.

    Raises:
        JacobianOptionError: ``min_run_time`` is not a finite number of seconds > 0,
            ``rounds`` or ``threads`` is not an int >= 1, or ``aggregate`` is neither
            ``"min"`` nor ``"median"`` (checked before anything runs).
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
            f"{call}: aggregate={aggregate!r}, but it must be 'min' (the least disturbed "
            f"round's median, the default) or 'median' (the median of the rounds' medians)."
        )
    if threads is None:
        if hasattr(os, "sched_getaffinity"):
            threads = len(os.sched_getaffinity(0))
        else:
            threads = os.cpu_count() or 1
    drop_slow = quick if drop_slow is None else drop_slow
    use_jax = use_jax and torch.device(device).type == "cpu"
    plan = [(w, get_methods(w.kind, names=methods, jax=use_jax, quick=drop_slow))
            for w in workloads]
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    bar = _progress(sum(len(ms) for _, ms in plan) * (1 + rounds), progress)
    results = []
    try:
        for workload, ms in plan:
            results.append(_run_workload(workload, ms, device, dtype, min_run_time, rounds,
                                         once_over, aggregate, bar))
    finally:
        bar.close()
        torch.set_num_threads(saved_threads)
    env = environment(device=device, threads=threads, dtype=dtype, quick=quick,
                      min_run_time=min_run_time, rounds=rounds, use_jax=use_jax)
    env["once_over_s"] = once_over
    env["aggregate"] = aggregate
    return SuiteResult(env, results)


def _run_workload(workload: Workload, methods: list[Method], device: str, dtype: torch.dtype,
                  min_run_time: float, rounds: int, once_over: float, aggregate: str,
                  bar: Any) -> WorkloadResult:
    import time

    case = workload.build(dtype, device)
    ref = reference(workload, device)
    shapes = [list(t.shape) for t in leaves(ref)]
    worst_tol = 0.0
    results: list[MethodResult] = []
    ready: list[tuple[MethodResult, Callable[[], Any]]] = []
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
                result.first_call_s = time.perf_counter() - start
                out = prepared.to_torch(out)
        except Exception as exc:  # noqa: BLE001 - a failing method is a row with its error
            result.error = reason(exc)
            bar.update(1 + rounds)
            continue
        try:
            result.max_abs_error = max_error(out, ref)
            tol = tolerance(out, ref, None, None)
            worst_tol = max(worst_tol, tol)
            if result.max_abs_error <= tol:
                result.status = "ok"
            else:
                result.status = "wrong"
                result.error = f"max abs error {result.max_abs_error:.2e} > tolerance {tol:.2e}"
        except (ValueError, TypeError) as exc:
            result.status, result.error = "wrong", str(exc)
        del out
        result.timed_once = result.first_call_s > once_over
        ready.append((result, prepared.run))
        bar.update(1)
    for round_ in range(rounds):
        for result, run in ready:
            bar.set_description_str(f"{workload.name}: {result.method}")
            if result.status == "failed" or (result.timed_once and round_ > 0):
                bar.update(1)
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if result.timed_once:
                        start = time.perf_counter()
                        run()
                        result.round_times_s.append(time.perf_counter() - start)
                    else:
                        result.round_times_s.append(median_time(run, min_run_time))
            except Exception as exc:  # noqa: BLE001
                result.status, result.error = "failed", f"on a repeated call: {reason(exc)}"
            bar.update(1)
    for result, _ in ready:
        if result.round_times_s and result.status != "failed":
            pick = min if aggregate == "min" else statistics.median
            result.time_s = pick(result.round_times_s)
    wres = WorkloadResult(workload.name, workload.title, workload.kind, shapes, worst_tol, results)
    best = wres.best
    for r in results:
        if r.time_s is not None and best is not None:
            r.ratio = r.time_s / best.time_s
    return wres


def load_json(path: str | os.PathLike[str]) -> SuiteResult:
    """Reads a suite JSON written by :meth:`SuiteResult.write_json` back into a result."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a torch_vjp suite result (schema {data.get('schema')!r})")
    workloads = []
    for w in data["workloads"]:
        results = [MethodResult(**r) for r in w["results"]]
        workloads.append(WorkloadResult(w["name"], w["title"], w["kind"], w["jacobian_shapes"],
                                        w["tolerance"], results))
    return SuiteResult(data["environment"], workloads)
