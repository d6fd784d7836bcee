"""The suite's results: per method, per workload and per run, with the tables, Markdown
and JSON they are shown and saved as (:mod:`torch_vjp.bench.runner` measures them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from torch_vjp.bench.methods import COMPILED, HEADLINE
from torch_vjp._measure import (
    NOISY_SPREAD,
    Timing,
    format_spread,
    format_table,
    format_time,
    noisy_note,
    shorten,
)

__all__ = [
    "MethodResult",
    "WorkloadResult",
    "SuiteResult",
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
        tolerance: The largest tolerance of an entry the methods were judged by (each entry:
            atol + rtol * max(|its reference entry|, 0.1 * max|reference|)).
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
                f"interleaved round{'s' if rounds != 1 else ''}"
                + (f"; interrupted (Ctrl-C) after {env['interrupted']}"
                   if env.get("interrupted") else ""))

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
            f"{machine_note(env)}, {env['threads']} threads, {env['dtype']}, "
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
            f"{machine_note(env)}, {env['threads']} threads, {env['dtype']}; "
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
                "result is checked); *time* is the steady state after it."
                + (f" Float32 arithmetic: {env['float32_arithmetic']}."
                   if env.get("float32_arithmetic") else ""), ""]
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


def machine_note(env: dict[str, Any]) -> str:
    """``cpu (AMD EPYC ...)`` or, on a GPU, ``cuda (NVIDIA H200; host AMD EPYC ...)``."""
    if env.get("gpu"):
        return f"{env['device']} ({env['gpu']}; host {env['cpu']})"
    return f"{env['device']} ({env['cpu']})"


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
