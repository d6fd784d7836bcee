"""Jacobian strategies on the benchmark grid, as ratios measured in one run.

The workloads and methods are the suite's own (``torch_vjp.bench``), so this grid and
``python -m torch_vjp bench`` time the same functions with the same weights:

* the grid: tanh MLPs with (n_in, n_out) in (8, 512), (512, 8), (256, 256), (1024, 1024),
  an elementwise function of 4096 elements, a two-input function: every torch_vjp strategy
  and ``torch.func.jacrev``/``jacfwd``;
* ``batch_jacobian`` with B = 64 on a 32 -> 32 MLP, against the full ``jacobian`` plus
  diagonal extraction and a hand-written ``vmap(jacrev(f_single))``;
* ``jacobian_of`` on a 256-output graph, against a Python loop of ``torch.autograd.grad``.

Every method is checked against a float64 ``torch.func.jacrev`` reference first. The run has
two phases:

1. the suite phase (the per-method time tables and the plot): medians of
   ``torch.utils.benchmark.Timer.blocked_autorange``; with ``--rounds R`` (default 3) each
   workload's methods are timed R times, interleaved, and the smallest of the R medians is
   kept (other processes only ever add time; see ``torch_vjp.bench.suite``);
2. the paired phase (the ratios): for each ratio, its numerator and denominator are timed
   back to back, ``--pairs P`` times (default 41), each time the median of a
   ``Timer.blocked_autorange(min_run_time=--pair-time)``, the order alternating; the ratio
   reported is the median over the P pairs of numerator / denominator, with its
   interquartile range. The methods compared by the 1.05 targets run the same vmapped
   products and differ by microseconds of Python, so a ratio of two separately taken
   figures would mostly measure how the machine's speed drifted between them (with two
   threads on two cores, by 10-30%); within a pair the drift cancels.

Reported ratios, with their targets:

* ``"rev"`` / ``torch.func.jacrev`` and ``"fwd"`` / ``torch.func.jacfwd``: <= 1.05;
* ``"auto"`` / the best of all strategies on the case: <= 1.15;
* ``batch_jacobian`` / (full ``jacobian`` + diagonal): <= 1/16;
  ``batch_jacobian`` / ``vmap(jacrev(f_single))``: <= 1.05;
* ``jacobian_of`` / loop of ``torch.autograd.grad`` rows: <= 1/5.

Writes ``results/jacobian_ratios.json``, ``.md`` and ``jacobian_strategies.png`` next to
this file (or under ``--out``).

Run: ``python benchmarks/bench_jacobian.py [--rounds 3] [--min-run-time 0.3] [--pairs 41]
[--pair-time 0.05] [--threads 2]`` (about 6 minutes with the defaults, 2 threads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torch_vjp.bench import get_workloads, run_suite
from torch_vjp.bench.methods import get_methods
from torch_vjp.bench.suite import SuiteResult, WorkloadResult

RESULTS = Path(__file__).resolve().parent / "results"

GRID = ("mlp_8x512", "mlp_512x8", "mlp_256x256", "mlp_1024x1024", "elementwise_4096", "two_input")
STRATEGIES = ("rev", "fwd", "rev-loop", "fwd-loop")
METHODS = (
    [f"torch_vjp {s}" for s in ("auto", *STRATEGIES)]
    + ["torch.func.jacrev", "torch.func.jacfwd"]
    + ["torch_vjp batch_jacobian", "torch_vjp jacobian + diagonal", "vmap(jacrev(f_single))"]
    + ["torch_vjp jacobian_of", "autograd.grad loop"]
)


@dataclass
class Ratio:
    case: str
    name: str
    numerator: str
    denominator: str
    value: float | None
    target: float
    note: str = ""
    #: The ratio of the suite phase's two figures (each the min of its rounds' medians).
    suite_value: float | None = None
    #: Interquartile range of the paired ratios.
    iqr: tuple[float, float] | None = None
    pair_ratios: list[float] = field(default_factory=list, repr=False)

    @property
    def passed(self) -> bool | None:
        return None if self.value is None else self.value <= self.target

    def to_dict(self) -> dict:
        return {**self.__dict__, "passed": self.passed}


def _timer_median(run: Callable[[], object], min_run_time: float) -> float:
    from torch.utils.benchmark import Timer

    timer = Timer("run()", globals={"run": run}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def paired_ratios(num: Callable[[], object], dens: list[Callable[[], object]], pairs: int,
                  min_run_time: float) -> list[float]:
    """``pairs`` ratios num / min(dens), each from medians timed back to back, the order
    alternating between pairs (numerator first, then last)."""
    out = []
    for k in range(pairs):
        if k % 2 == 0:
            a = _timer_median(num, min_run_time)
            b = min(_timer_median(d, min_run_time) for d in dens)
        else:
            b = min(_timer_median(d, min_run_time) for d in reversed(dens))
            a = _timer_median(num, min_run_time)
        out.append(a / b)
    return out


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (xs[0], xs[0])
    q = statistics.quantiles(xs, n=4)
    return (q[0], q[2])


def measure_pairs(result: SuiteResult, rs: list[Ratio], pairs: int, min_run_time: float,
                  progress: bool = True) -> None:
    """Fills each ratio's ``value`` with the median of ``pairs`` paired ratios (the suite
    phase's figure is kept in ``suite_value``). Only methods that passed the suite's
    correctness check are timed."""
    by_name = {w.name: w for w in result.workloads}
    prepared: dict[tuple[str, str], Callable[[], object]] = {}
    cases: dict[str, object] = {}

    def run_of(case_name: str, method: str) -> Callable[[], object]:
        key = (case_name, method)
        if key not in prepared:
            (w,) = get_workloads(case_name)
            (m,) = get_methods(w.kind, names=[method], jax=False)
            if case_name not in cases:
                cases[case_name] = w.build(torch.float32)
            prepared[key] = m.prepare(cases[case_name]).run
        return prepared[key]

    for i, r in enumerate(rs):
        r.suite_value = r.value
        w = by_name[r.case]
        dens = [r.denominator]
        if r.name == "auto / best strategy":
            # Every strategy within 1.3x of the suite phase's fastest competes in each pair.
            best = _time(w, r.denominator)
            dens = [f"torch_vjp {s}" for s in STRATEGIES
                    if (t := _time(w, f"torch_vjp {s}")) is not None and best is not None
                    and t <= 1.3 * best]
        if r.value is None or not dens:
            continue
        if progress:
            print(f"  pairs {i + 1}/{len(rs)}: {r.case}: {r.name}", file=sys.stderr, flush=True)
        num = run_of(r.case, r.numerator)
        den_runs = [run_of(r.case, d) for d in dens]
        for fn in (num, *den_runs):  # warm up
            fn()
        r.pair_ratios = paired_ratios(num, den_runs, pairs, min_run_time)
        r.value = statistics.median(r.pair_ratios)
        r.iqr = _quartiles(r.pair_ratios)
        if len(dens) > 1:
            r.denominator = "fastest of " + ", ".join(dens)


def _time(w: WorkloadResult, method: str) -> float | None:
    r = w.result(method)
    return r.time_s if r is not None and r.status == "ok" else None


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def ratios(result: SuiteResult) -> list[Ratio]:
    """The issue's ratios from one suite run."""
    out: list[Ratio] = []
    by_name = {w.name: w for w in result.workloads}
    for name in GRID:
        w = by_name.get(name)
        if w is None:
            continue
        out.append(Ratio(name, "rev / jacrev", "torch_vjp rev", "torch.func.jacrev",
                         _div(_time(w, "torch_vjp rev"), _time(w, "torch.func.jacrev")), 1.05))
        out.append(Ratio(name, "fwd / jacfwd", "torch_vjp fwd", "torch.func.jacfwd",
                         _div(_time(w, "torch_vjp fwd"), _time(w, "torch.func.jacfwd")), 1.05))
        best = w.fastest(lambda r: r.method in {f"torch_vjp {s}" for s in STRATEGIES})
        out.append(Ratio(name, "auto / best strategy", "torch_vjp auto",
                         best.method if best else "-",
                         _div(_time(w, "torch_vjp auto"), best.time_s if best else None), 1.15))
    w = by_name.get("batch_mlp_64x32")
    if w is not None:
        batch = _time(w, "torch_vjp batch_jacobian")
        out.append(Ratio(w.name, "batch_jacobian / (jacobian + diagonal)",
                         "torch_vjp batch_jacobian", "torch_vjp jacobian + diagonal",
                         _div(batch, _time(w, "torch_vjp jacobian + diagonal")), 1 / 16))
        out.append(Ratio(w.name, "batch_jacobian / vmap(jacrev(f_single))",
                         "torch_vjp batch_jacobian", "vmap(jacrev(f_single))",
                         _div(batch, _time(w, "vmap(jacrev(f_single))")), 1.05))
    w = by_name.get("jacobian_of_256")
    if w is not None:
        out.append(Ratio(w.name, "jacobian_of / autograd.grad loop", "torch_vjp jacobian_of",
                         "autograd.grad loop",
                         _div(_time(w, "torch_vjp jacobian_of"), _time(w, "autograd.grad loop")),
                         1 / 5))
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _fmt_iqr(r: Ratio) -> str:
    return "-" if r.iqr is None else f"{r.iqr[0]:.3f}-{r.iqr[1]:.3f}"


def markdown(result: SuiteResult, rs: list[Ratio], image: str, pairs: int,
             pair_time: float) -> str:
    env = result.environment
    lines = [
        "# Jacobian strategies: ratios on the benchmark grid",
        "",
        f"torch {env['torch']}, Python {env['python']}; {env['device']} ({env['cpu']}), "
        f"{env['threads']} threads, {env['dtype']}; {env['rounds']} interleaved rounds of "
        f"`Timer.blocked_autorange(min_run_time={env['min_run_time']})`, the "
        f"{env.get('aggregate', 'median')} of the rounds' medians kept (the time tables); "
        f"{env['date']}. Written by `benchmarks/bench_jacobian.py`.",
        "",
        f"The ratios: median over {pairs} pairs, each pair the numerator's and the "
        f"denominator's `Timer.blocked_autorange(min_run_time={pair_time})` medians taken back "
        "to back (order alternating); IQR: the pairs' interquartile range; suite: the ratio of "
        "the two time-table figures, for comparison.",
        "",
        "| case | ratio | numerator | denominator | paired median | IQR | suite | target | |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        verdict = {True: "pass", False: "**over target**", None: "not measured"}[r.passed]
        target = f"1/{round(1 / r.target)}" if r.target < 1 else f"{r.target:.2f}"
        lines.append(f"| {r.case} | {r.name} | {r.numerator} | {r.denominator} | {_fmt(r.value)} "
                     f"| {_fmt_iqr(r)} | {_fmt(r.suite_value)} | <= {target} | {verdict} |")
    lines += ["", f"![strategy times]({image})", "", "## Times", ""]
    body = result.markdown().split("## Summary", 1)[1]
    lines.append("## Summary" + body)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-run-time", type=float, default=0.3)
    parser.add_argument("--pairs", type=int, default=41,
                        help="paired timings per ratio (0: report the suite phase's ratios)")
    parser.add_argument("--pair-time", type=float, default=0.05,
                        help="min_run_time of each paired Timer measurement, seconds")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: the usable cores)")
    parser.add_argument("--only", default=None, help="workload filter, as for the suite's --only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    names = args.only or ",".join((*GRID, "batch_mlp_64x32", "jacobian_of_256"))
    workloads = get_workloads(names)
    result = run_suite(workloads, methods=METHODS, threads=args.threads,
                       min_run_time=args.min_run_time, rounds=args.rounds, use_jax=False,
                       progress=not args.no_progress, drop_slow=False)
    rs = ratios(result)
    if args.pairs > 0:
        measure_pairs(result, rs, args.pairs, args.pair_time, progress=not args.no_progress)
    print(result.table())
    print()
    print(f"ratios: median of {args.pairs} paired timings (target in brackets)"
          if args.pairs > 0 else "ratios (target in brackets)")
    width = max(len(f"{r.case}: {r.name}") for r in rs)
    for r in rs:
        verdict = {True: "ok", False: "OVER TARGET", None: "not measured"}[r.passed]
        print(f"  {f'{r.case}: {r.name}':<{width}}  {_fmt(r.value):>7}  "
              f"IQR {_fmt_iqr(r):>11}  suite {_fmt(r.suite_value):>6}  "
              f"(<= {r.target:.3f})  {verdict}")

    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "jacobian_strategies.png"
    try:
        from torch_vjp.bench.plot import plot_suite

        plot_suite(result, png, title="Jacobian strategies on the benchmark grid "
                   "(benchmarks/bench_jacobian.py)")
    except ImportError as exc:
        print(f"plot not written: {exc}", file=sys.stderr)
    data = {"pairs": args.pairs, "pair_time_s": args.pair_time,
            "ratios": [r.to_dict() for r in rs], "suite": result.to_dict()}
    (args.out / "jacobian_ratios.json").write_text(json.dumps(data, indent=2) + "\n")
    (args.out / "jacobian_ratios.md").write_text(
        markdown(result, rs, png.name, args.pairs, args.pair_time))
    print(f"\nwrote {args.out / 'jacobian_ratios.json'}, {args.out / 'jacobian_ratios.md'}, {png}")
    return 0


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
