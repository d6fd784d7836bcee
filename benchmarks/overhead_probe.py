"""A quick probe of torch_vjp's per-call overhead against torch.func, on the benchmark grid.

For each case of the grid (the workloads of ``torch_vjp.bench``: tanh MLPs with (n_in,
n_out) in (8, 512), (512, 8), (256, 256), (1024, 1024), an elementwise function of 4096
elements, a two-input function, and ``batch_jacobian`` with B = 64 on a 32 -> 32 MLP) it
prints the ratios

* ``jacobian(strategy="rev")`` / ``torch.func.jacrev(f)(x)``,
* ``jacobian(strategy="fwd")`` / ``torch.func.jacfwd(f)(x)``,
* ``jacobian(strategy="auto")`` / the faster of the two (for information),
* ``batch_jacobian(f, x)`` / ``torch.vmap(torch.func.jacrev(f_single))(x)``,

where the functions being compared differ only in their fixed per-call cost (the same
vmapped products run underneath), so small ratios need careful timing:

* each method is run in blocks of ``k`` calls (``k`` chosen so a block lasts about
  ``--block-ms``), the methods of a case interleaved, for ``--rounds`` rounds; a method's
  time is the smallest per-call time over the rounds (other processes on a shared machine
  only ever add time); the "paired median" is the median over rounds of the ratio within
  each round, robust to slow drifts of the machine's speed;
* with one thread (the default) the clock is ``time.thread_time`` (CPU time of this
  thread, insensitive to being descheduled); with more threads, where the work runs on
  other threads too, ``time.perf_counter``;
* ``--timer`` instead takes the median of ``torch.utils.benchmark.Timer.blocked_autorange``
  per method (min over the rounds), as ``benchmarks/bench_jacobian.py`` does.

Every torch_vjp result is checked against the torch.func result first. On a machine shared
with other work, use one thread: with two, a parallel region waits for a descheduled
thread and times jump by orders of magnitude.
Writes ``results/overhead_probe.json`` and ``.md`` next to this file (or under ``--out``).

Run: ``python benchmarks/overhead_probe.py [--threads 1] [--rounds 25] [--timer]``
(about a minute with the defaults).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torch_vjp.bench.workloads import get_workloads
from torch_vjp.jacobians import batch_jacobian, jacobian

RESULTS = Path(__file__).resolve().parent / "results"
GRID = ("mlp_8x512", "mlp_512x8", "mlp_256x256", "mlp_1024x1024", "elementwise_4096",
        "two_input")
BATCH = "batch_mlp_64x32"
#: The issue's bound on rev / jacrev, fwd / jacfwd and batch_jacobian / vmap(jacrev).
TARGET = 1.05


def _methods(name: str) -> tuple[dict[str, Callable[[], Any]], list[tuple[str, str, str]]]:
    """The callables of one case, and its ratios as (label, numerator, denominator)."""
    (w,) = get_workloads(name)
    case = w.build(torch.float32)
    if w.kind == "batch_jacobian":
        (x,) = case.primals
        ref = torch.vmap(torch.func.jacrev(case.f_single))
        methods = {
            "batch_jacobian": lambda: batch_jacobian(case.f, x),
            "batch_jacobian rev": lambda: batch_jacobian(case.f, x, strategy="rev"),
            "vmap(jacrev(f_single))": lambda: ref(x),
        }
        ratios = [
            ("batch_jacobian / vmap(jacrev)", "batch_jacobian", "vmap(jacrev(f_single))"),
            ("batch_jacobian rev / vmap(jacrev)", "batch_jacobian rev",
             "vmap(jacrev(f_single))"),
        ]
        return methods, ratios
    f, primals, argnums = case.f, case.primals, case.argnums
    jacrev = torch.func.jacrev(f, argnums=argnums)
    jacfwd = torch.func.jacfwd(f, argnums=argnums)
    methods = {
        "rev": lambda: jacobian(f, *primals, argnums=argnums, strategy="rev"),
        "jacrev": lambda: jacrev(*primals),
        "fwd": lambda: jacobian(f, *primals, argnums=argnums, strategy="fwd"),
        "jacfwd": lambda: jacfwd(*primals),
        "auto": lambda: jacobian(f, *primals, argnums=argnums),
    }
    ratios = [
        ("rev / jacrev", "rev", "jacrev"),
        ("fwd / jacfwd", "fwd", "jacfwd"),
        ("auto / best of jacrev, jacfwd", "auto", "best"),
    ]
    return methods, ratios


def _check(methods: dict[str, Callable[[], Any]]) -> None:
    ref = methods.get("jacrev") or methods["vmap(jacrev(f_single))"]
    expected = ref()
    for name, fn in methods.items():
        torch.testing.assert_close(fn(), expected, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _time_blocks(methods: dict[str, Callable[[], Any]], rounds: int, block_s: float,
                 clock: Callable[[], float]) -> dict[str, list[float]]:
    counts, once = {}, {}
    for name, fn in methods.items():
        fn()
        t0 = clock()
        fn()
        once[name] = max(clock() - t0, 1e-6)
        counts[name] = max(1, int(block_s / once[name]))
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    # Cases of more than ~50 ms a call are not overhead-bound: fewer rounds keep the probe quick.
    slowest = max(once.values())
    if slowest > 0.05:
        rounds = min(rounds, max(9, int(2.0 / (slowest * len(names)))))
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            fn, k = methods[name], counts[name]
            t0 = clock()
            for _ in range(k):
                fn()
            times[name].append((clock() - t0) / k)
    return times


def _time_timer(methods: dict[str, Callable[[], Any]], rounds: int, min_run_time: float
                ) -> dict[str, list[float]]:
    from torch.utils.benchmark import Timer

    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            m = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
            times[name].append(m.blocked_autorange(min_run_time=min_run_time).median)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--block-ms", type=float, default=30.0)
    p.add_argument("--timer", action="store_true",
                   help="median of Timer.blocked_autorange (min over rounds) instead")
    p.add_argument("--min-run-time", type=float, default=0.2)
    p.add_argument("--only", default=None, help="comma-separated case names")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    cases = list(GRID) + [BATCH]
    if args.only:
        cases = [c for c in cases if any(s in c for s in args.only.split(","))]
    how = (f"Timer.blocked_autorange median, min over {args.rounds} rounds" if args.timer else
           f"{'thread_time' if args.threads == 1 else 'perf_counter'} blocks of "
           f"~{args.block_ms:g} ms, {args.rounds} interleaved rounds")
    print(f"torch {torch.__version__}, {args.threads} thread(s); {how}")
    rows = []
    start = time.perf_counter()
    for name in cases:
        methods, ratios = _methods(name)
        _check(methods)
        if args.timer:
            times = _time_timer(methods, args.rounds, args.min_run_time)
        else:
            times = _time_blocks(methods, args.rounds, args.block_ms / 1e3, clock)
        if "jacrev" in times:
            times["best"] = [min(a, b) for a, b in zip(times["jacrev"], times["jacfwd"])]
        best = {k: min(v) for k, v in times.items()}
        for label, num, den in ratios:
            paired = statistics.median(a / b for a, b in zip(times[num], times[den]))
            target = TARGET if den != "best" else None
            row = {
                "case": name, "ratio": label,
                "numerator_s": best[num], "denominator_s": best[den],
                "min_ratio": best[num] / best[den], "paired_median_ratio": paired,
                "target": target,
                "passed": None if target is None else paired <= target,
            }
            rows.append(row)
            flag = "" if target is None else ("  ok" if row["passed"] else "  OVER 1.05")  # paired
            print(f"{name:18s} {label:34s} {row['min_ratio']:6.3f} (paired median {paired:6.3f})"
                  f"   {best[num] * 1e6:9.1f} us / {best[den] * 1e6:9.1f} us{flag}", flush=True)
    elapsed = time.perf_counter() - start
    print(f"({elapsed:.0f} s)")
    if not args.no_write:
        args.out.mkdir(parents=True, exist_ok=True)
        env = {"torch": torch.__version__, "python": platform.python_version(),
               "threads": args.threads, "method": how, "rounds": args.rounds}
        (args.out / "overhead_probe.json").write_text(
            json.dumps({"environment": env, "rows": rows}, indent=2) + "\n")
        lines = [
            "# torch_vjp per-call overhead against torch.func",
            "",
            f"torch {env['torch']}, Python {env['python']}, {args.threads} thread(s), float32; "
            f"{how}. Written by `benchmarks/overhead_probe.py`.",
            "",
            "The target is judged on the paired median (the median over rounds of the ratio "
            "within each round); the min ratio (ratio of each method's fastest round) is "
            "shown for comparison, and moves by several percent between runs.",
            "",
            "| case | ratio | torch_vjp | torch.func | min ratio | paired median ratio | "
            "target |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            target = "(info)" if r["target"] is None else (
                f"<= {r['target']:.2f} " + ("pass" if r["passed"] else "**over**"))
            lines.append(
                f"| {r['case']} | {r['ratio']} | {r['numerator_s'] * 1e6:.1f} us | "
                f"{r['denominator_s'] * 1e6:.1f} us | {r['min_ratio']:.3f} | "
                f"{r['paired_median_ratio']:.3f} | {target} |")
        (args.out / "overhead_probe.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
