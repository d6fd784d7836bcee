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

import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from torch_vjp.bench.methods import (
    COMPILED,
    HEADLINE,
    Method,
    get_methods,
    jax_available,
    reference,
)
from torch_vjp.bench.workloads import Case, Workload
from torch_vjp._errors import JacobianOptionError
from torch_vjp._measure import (
    NOISY_SPREAD,
    Timing,
    block_times,
    check_min_run_time,
    cpu_model,
    format_spread,
    format_table,
    format_time,
    leaves,
    max_error,
    noisy_note,
    reason,
    shorten,
    summarize_times,
    tolerance,
)

__all__ = [
    "MethodResult",
    "WorkloadResult",
    "SuiteResult",
    "run_suite",
    "environment",
    "tool_of",
    "SCHEMA",
]

#: The ``"schema"`` value of the suite's JSON (2: spreads, ``"unsupported"``, sizes).
SCHEMA = "torch_vjp.bench/2"
#: Older schemas :func:`load_json` still reads (their missing fields take defaults).
_READABLE = ("torch_vjp.bench/1", SCHEMA)


def tool_of(family: str) -> str:
    """The tool a method family belongs to, as "not supported by <tool>" names it.

    Example:
        >>> tool_of("torch.autograd"), tool_of("jax")
        ('torch', 'jax')
    """
    return "jax" if family == "jax" else "torch" if family.startswith("torch.") else family


@dataclass
class MethodResult:
    """One method on one workload.

    Attributes:
        method: The method's name.
        family: ``"torch_vjp"``, ``"torch.func"``, ``"torch.autograd"`` or ``"jax"``.
        status: ``"ok"``; ``"wrong"`` (its result differs from the reference by more than
            the tolerance); ``"failed"`` (a torch_vjp method raised; ``error`` holds the
            exception); ``"unsupported"`` (a method of another tool raised: that tool does
            not support the workload; ``error`` says how it refused).
        time_s: Seconds per call: the median of the rounds' medians; ``None`` when it did
            not run.
        q1_s: First quartile of every timed block's seconds per call, all rounds together.
        q3_s: Third quartile of the same.
        iqr_s: ``q3_s - q1_s``; ``None`` from a single timed call.
        samples: How many blocks (or single calls) were timed, all rounds together.
        noisy: The IQR exceeds ``NOISY_SPREAD`` of ``time_s``: too wide to rank.
        first_call_s: Seconds of the first (checked) call, compilation included.
        max_abs_error: Largest absolute difference from the float64 reference.
        error: Why the method is not ``"ok"`` (``"TypeName: message"``), else ``None``.
        ratio: ``time_s`` over the workload's fastest correct method's (filled in by the
            runner), or ``None``.
        round_times_s: The median of each round.
        timed_once: Its calls took longer than the timing budget, so the rounds after the
            first timed one call each.
    """

    method: str
    family: str
    status: str
    time_s: float | None = None
    q1_s: float | None = None
    q3_s: float | None = None
    iqr_s: float | None = None
    samples: int = 0
    noisy: bool = False
    first_call_s: float | None = None
    max_abs_error: float | None = None
    error: str | None = None
    ratio: float | None = None
    round_times_s: list[float] = field(default_factory=list)
    timed_once: bool = False

    @property
    def timing(self) -> Timing | None:
        """The time with its quartiles, or ``None`` when the method was not timed."""
        if self.time_s is None:
            return None
        q1 = self.q1_s if self.q1_s is not None else self.time_s
        q3 = self.q3_s if self.q3_s is not None else self.time_s
        return Timing(self.time_s, q1, q3, max(self.samples, 1))

    @property
    def tool(self) -> str:
        """``"torch_vjp"``, ``"torch"`` or ``"jax"``: whose method this is."""
        return tool_of(self.family)

    def note(self) -> str:
        """What the tables say about the row besides its numbers (``""`` when nothing)."""
        if self.status == "unsupported":
            return f"not supported by {self.tool} ({self.error})"
        if self.status == "failed":
            return f"FAILED: {self.error}"
        if self.status == "wrong":
            return f"WRONG: {self.error}"
        notes = []
        if self.noisy and self.timing is not None:
            notes.append(noisy_note(self.timing))
        if self.timed_once:
            notes.append("slow: one call per round")
        return "; ".join(notes)


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
        n_in: Input elements differentiated (per example for ``"batch_jacobian"``): the
            Jacobian's columns.
        n_out: Output elements (per example for ``"batch_jacobian"``): its rows.
    """

    name: str
    title: str
    kind: str
    jacobian_shapes: list[list[int]]
    tolerance: float
    results: list[MethodResult]
    n_in: int | None = None
    n_out: int | None = None

    @property
    def best(self) -> MethodResult | None:
        """The fastest method whose result matched the reference (by median time)."""
        return self.fastest(lambda r: True)

    @property
    def headline(self) -> MethodResult | None:
        """torch_vjp's default method on this workload (``"torch_vjp auto"`` and the like)."""
        return self.result(HEADLINE[self.kind])

    @property
    def compiled(self) -> MethodResult | None:
        """torch_vjp's ``compile=True`` method on this workload, if it ran."""
        name = COMPILED.get(self.kind)
        return self.result(name) if name else None

    def result(self, method: str) -> MethodResult | None:
        """The result of the method of that name, or ``None`` when it was not run."""
        return next((r for r in self.results if r.method == method), None)

    def fastest(self, predicate: Callable[[MethodResult], bool]) -> MethodResult | None:
        """The fastest correct result among those ``predicate`` accepts (by median time)."""
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

    def settings(self) -> str:
        """The suite and its timing settings, in words."""
        env = self.environment
        rounds = env.get("rounds", 1)
        return (f"{suite_name(env)}, min_run_time {env['min_run_time']} s, {rounds} "
                f"interleaved round{'s' if rounds != 1 else ''}")

    def how_timed(self) -> str:
        """How the figures were obtained, in one sentence per column."""
        env = self.environment
        if env.get("aggregate", "median") == "min":
            time_word = "the smallest of the rounds' medians"
        else:
            time_word = "the median of the rounds' medians"
        noisy = env.get("noisy_spread", NOISY_SPREAD)
        return (f"time: {time_word} (each round's by torch.utils.benchmark.Timer."
                f"blocked_autorange); IQR: interquartile range of every timed block, as a "
                f"percentage of the time; noisy: IQR over {100 * noisy:.0f}% of the time, "
                f"too wide to rank; x best: time / the fastest correct method's")

    def header_lines(self) -> list[str]:
        env = self.environment
        jax = f", {jax_note(env)}"
        return [
            f"torch_vjp {env['torch_vjp']} Jacobian benchmark: torch {env['torch']}{jax}, "
            f"Python {env['python']}",
            f"{env['device']} ({env['cpu']}), {env['threads']} threads, {env['dtype']}, "
            f"{self.settings()}",
            self.how_timed(),
        ]

    def summary_rows(self) -> list[tuple[str, ...]]:
        rows = []
        for w in self.workloads:
            best, head = w.best, w.headline
            torch_best = w.fastest(lambda r: r.family != "jax")
            comp = w.compiled
            jax_best = w.fastest(lambda r: r.family == "jax")
            rows.append((
                w.name,
                best.method if best else "-",
                format_timing(best),
                format_timing(head if head and head.status == "ok" else None),
                _fmt_ratio(_ratio(head, best), head, best),
                _fmt_ratio(_ratio(head, torch_best), head, torch_best),
                format_timing(comp if comp and comp.status == "ok" else None),
                _fmt_ratio(_ratio(comp, jax_best), comp, jax_best),
            ))
        return rows

    SUMMARY_HEADER = ("workload", "fastest method", "its time", "torch_vjp default",
                      "default / fastest", "default / fastest torch", "torch_vjp compiled",
                      "compiled / fastest jax")

    def detail_rows(self, w: WorkloadResult, width: int | None = 90) -> list[tuple[str, ...]]:
        """Per method: name (``*`` before the fastest), time, IQR, ratio, error, note."""
        best = w.best
        rows = []
        for r in w.results:
            mark = "*" if best is not None and r is best else ""
            note = r.note()
            if width is not None:
                note = shorten(note, width)
            error = "-" if r.max_abs_error is None else f"{r.max_abs_error:.1e}"
            rows.append((mark + r.method, format_time(r.time_s), format_spread(r.timing),
                         "-" if r.ratio is None else f"{r.ratio:.2f}", error,
                         format_time(r.first_call_s), note))
        return rows

    DETAIL_HEADER = ("method", "time", "IQR", "x best", "max abs err", "first call", "")

    def table(self) -> str:
        """The aligned plain-text report: one block per workload, then the summary."""
        lines = self.header_lines() + [""]
        for w in self.workloads:
            shapes = ", ".join(_shape(s) for s in w.jacobian_shapes)
            lines.append(f"{w.name}: {w.title}; Jacobian {shapes}")
            lines += ["  " + line for line in format_table(self.DETAIL_HEADER, self.detail_rows(w),
                                                              "<>>>>><")]
            lines.append("")
        lines.append("summary (* marks the fastest method in each block above)")
        lines += ["  " + line for line in format_table(self.SUMMARY_HEADER, self.summary_rows(),
                                                          "<<>>>>>>")]
        return "\n".join(lines)

    def markdown(self, image: str | None = None) -> str:
        """The results as Markdown: environment, summary table, a table per workload.

        Args:
            image: The figure's path relative to the Markdown file; it is shown and links
                to itself, so that a click opens it at full size.
        """
        env = self.environment
        out = ["# torch_vjp Jacobian benchmark", ""]
        out.append(
            f"torch {env['torch']}, {jax_note(env)}, "
            f"Python {env['python']}; "
            f"{env['device']} ({env['cpu']}), {env['threads']} threads, {env['dtype']}; "
            f"{self.settings()}; {env['date']}."
        )
        out += ["", _capitalise(self.how_timed()) + ". "
                "Every method's result was checked against a float64 `torch.func.jacrev` "
                "reference before it was timed. *default* is torch_vjp with default settings "
                "(`jacobian`, `batch_jacobian` or `jacobian_of`, strategy `auto`). "
                "*not supported by torch* marks a method that torch itself refuses on that "
                "workload, not a failure of torch_vjp. *first call*: the first, untimed call, "
                "which for `jax.jit` and for *torch_vjp compiled* (`compile=True`) includes "
                "compiling (for torch_vjp also one eager call, against which the compiled "
                "result is checked); *time* is the steady state after it.", ""]
        if image:
            out += [f"[![suite results]({image})]({image})", "",
                    "(Click the figure for the full-size image.)", ""]
        out += ["## Summary", ""]
        out += _markdown_table(self.SUMMARY_HEADER, self.summary_rows())
        for w in self.workloads:
            shapes = ", ".join(_shape(s) for s in w.jacobian_shapes)
            out += ["", f"## {w.name}", "", f"{w.title}; Jacobian {shapes}.", ""]
            rows = [(f"**{m[1:]}** (fastest)" if m.startswith("*") else m, *rest)
                    for m, *rest in self.detail_rows(w, width=160)]
            out += _markdown_table(("method", "time", "IQR", "x best", "max abs err",
                                    "first call", "note"), rows)
        return "\n".join(out) + "\n"


def suite_name(env: dict[str, Any]) -> str:
    """``"default suite"``, ``"quick suite"``, or ``"full suite with the loop and
    full-then-diagonal methods"`` (``--all``)."""
    if env.get("all_methods"):
        return (f"{'quick' if env.get('quick') else 'full'} suite with the loop and "
                f"full-then-diagonal methods")
    return f"{'quick' if env.get('quick') else 'default'} suite"


def jax_note(env: dict[str, Any]) -> str:
    """``jax 0.4.30``, ``jax 0.4.30 (not run)`` or ``jax not installed``."""
    if not env.get("jax"):
        return "jax not installed"
    return f"jax {env['jax']}" + ("" if env.get("jax_used", True) else " (not run)")


def format_timing(r: MethodResult | None) -> str:
    """A result's time with its spread: ``'1.5 ms (IQR 6%)'``, ``'1.5 ms (IQR 40%, noisy)'``."""
    if r is None or r.time_s is None:
        return "-"
    spread = format_spread(r.timing)
    if spread == "-":
        return format_time(r.time_s)
    return f"{format_time(r.time_s)} (IQR {spread}{', noisy' if r.noisy else ''})"


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _ratio(a: MethodResult | None, b: MethodResult | None) -> float | None:
    if a is None or b is None or a.status != "ok" or not a.time_s or not b.time_s:
        return None
    return a.time_s / b.time_s


def _fmt_ratio(x: float | None, *results: MethodResult | None) -> str:
    if x is None:
        return "-"
    noisy = any(r is not None and r.noisy for r in results)
    return f"{x:.2f}" + (" (noisy)" if noisy else "")


def _markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    def esc(cell: str) -> str:
        return cell.replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return lines


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
        device: ``"cpu"`` or a CUDA device; jax always runs on the CPU (and is left out
            on other devices).
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
    use_jax = use_jax and torch.device(device).type == "cpu"
    plan = [(w, get_methods(w.kind, names=methods, jax=use_jax, include_slow=not drop_slow))
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
                      min_run_time=min_run_time, rounds=rounds, use_jax=use_jax,
                      all_methods=not drop_slow)
    env["once_over_s"] = once_over
    env["aggregate"] = aggregate
    return SuiteResult(env, results)


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
                result.first_call_s = time.perf_counter() - start
                out = prepared.to_torch(out)
        except Exception as exc:  # noqa: BLE001 - a failing method is a row with its error
            result.error = reason(exc)
            if method.family != "torch_vjp":
                result.status = "unsupported"  # the other tool refuses this workload
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


def load_json(path: str | os.PathLike[str]) -> SuiteResult:
    """Reads a suite JSON written by :meth:`SuiteResult.write_json` back into a result.

    Raises:
        ValueError: The file is not a suite result of a schema this version reads.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if data.get("schema") not in _READABLE:
        raise ValueError(f"{path}: not a torch_vjp suite result (schema {data.get('schema')!r}; "
                         f"this version reads {', '.join(_READABLE)})")
    known = {f.name for f in fields(MethodResult)}
    workloads = []
    for w in data["workloads"]:
        results = [MethodResult(**{k: v for k, v in r.items() if k in known})
                   for r in w["results"]]
        workloads.append(WorkloadResult(w["name"], w["title"], w["kind"], w["jacobian_shapes"],
                                        w["tolerance"], results, w.get("n_in"), w.get("n_out")))
    return SuiteResult(data["environment"], workloads)
