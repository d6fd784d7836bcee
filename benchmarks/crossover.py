"""Where forward mode overtakes reverse mode: the measurement behind ``strategy="auto"``.

``"rev"`` costs about one VJP per output element and ``"fwd"`` one JVP per input element, so
``"fwd"`` wins once ``n_out / n_in`` exceeds the cost ratio of a vmapped JVP to a vmapped VJP.
This script measures that ratio instead of guessing it:

1. **Sweep.** tanh MLPs ``n_in -> 256 -> 256 -> n_out`` (the benchmark suite's architecture)
   for several ``n_in`` and ratios ``n_out / n_in``: ``"rev"`` and ``"fwd"`` are timed,
   interleaved, and for each ``n_in`` the crossover ratio (where ``t_fwd == t_rev``) is
   interpolated on a log scale. Their geometric mean is the measured crossover, which
   ``torch_vjp._strategies.FWD_OUT_IN_RATIO`` should match.
2. **Grid.** The benchmark grid (MLPs (8, 512), (512, 8), (256, 256), (1024, 1024), an
   elementwise function of 4096 elements, a two-input function): every strategy, and
   ``"auto"`` / best — which must stay <= 1.15.

Every strategy is first checked against ``torch.func.jacrev`` (float64 on the same weights).
Times are medians of ``torch.utils.benchmark.Timer.blocked_autorange`` in float32; each case
is timed ``--rounds`` times, interleaved; a time reported is the median over rounds, and a
ratio the median over rounds of that round's ratio (times taken back to back, under the same
load), which tolerates a noisy machine. Writes ``results/crossover.json`` and
``results/crossover.md``.

Run: ``python benchmarks/crossover.py [--rounds 3] [--min-run-time 0.2] [--threads N]
[--clock wall|thread] [--quick]``. On a shared, busy machine, ``--threads 1 --clock thread``
times this thread's CPU time, which other processes do not inflate.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.benchmark import Timer

from torch_vjp._strategies import FWD_OFFSET, FWD_OUT_IN_RATIO, STRATEGIES, choose_mode
from torch_vjp.jacobians import jacobian

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN = 256


def mlp(n_in: int, n_out: int, seed: int, dtype: torch.dtype) -> tuple[Callable, tuple]:
    """tanh MLP ``n_in -> 256 -> 256 -> n_out`` with biases, and an input."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [n_in, HIDDEN, HIDDEN, n_out]
    ws = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        ws.append((torch.randn(b, a, generator=gen, dtype=torch.float64) / a**0.5,
                   0.1 * torch.randn(b, generator=gen, dtype=torch.float64)))
    x = torch.randn(n_in, generator=gen, dtype=torch.float64)
    ws = [(w.to(dtype), b.to(dtype)) for w, b in ws]

    def f(x: torch.Tensor) -> torch.Tensor:
        (w0, b0), (w1, b1), (w2, b2) = ws
        h = torch.tanh(w0 @ x + b0)
        h = torch.tanh(w1 @ h + b1)
        return w2 @ h + b2

    return f, (x.to(dtype),)


def elementwise(n: int, seed: int, dtype: torch.dtype) -> tuple[Callable, tuple]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
    return (lambda x: x * torch.tanh(x) + torch.sin(x)), (x,)


def two_input(seed: int, dtype: torch.dtype) -> tuple[Callable, tuple]:
    """tanh(A x + B y) * (C y), x (128,), y (64,) -> (256,): the suite's two-input case."""
    gen = torch.Generator().manual_seed(seed)
    n_x, n_y, n_out = 128, 64, 256
    a = (torch.randn(n_out, n_x, generator=gen, dtype=torch.float64) / n_x**0.5).to(dtype)
    b = (torch.randn(n_out, n_y, generator=gen, dtype=torch.float64) / n_y**0.5).to(dtype)
    c = (torch.randn(n_out, n_y, generator=gen, dtype=torch.float64) / n_y**0.5).to(dtype)
    x = torch.randn(n_x, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randn(n_y, generator=gen, dtype=torch.float64).to(dtype)
    return (lambda x, y: torch.tanh(a @ x + b @ y) * (c @ y)), (x, y)


GRID: dict[str, Callable[[torch.dtype], tuple[Callable, tuple, Any]]] = {
    "mlp_8x512": lambda dt: (*mlp(8, 512, 1, dt), 0),
    "mlp_512x8": lambda dt: (*mlp(512, 8, 2, dt), 0),
    "mlp_256x256": lambda dt: (*mlp(256, 256, 3, dt), 0),
    "mlp_1024x1024": lambda dt: (*mlp(1024, 1024, 4, dt), 0),
    "elementwise_4096": lambda dt: (*elementwise(4096, 5, dt), 0),
    "two_input": lambda dt: (*two_input(6, dt), (0, 1)),
}


CLOCK = {"wall": time.perf_counter, "thread": time.thread_time}
_clock: list[Callable[[], float]] = [time.perf_counter]


def median_time(fn: Callable[[], Any], min_run_time: float) -> float:
    timer = Timer("fn()", globals={"fn": fn}, timer=_clock[0])
    return timer.blocked_autorange(min_run_time=min_run_time).median


def time_interleaved(fns: dict[str, Callable[[], Any]], rounds: int, min_run_time: float
                     ) -> dict[str, list[float]]:
    """Each function's median time in each of ``rounds`` rounds; within a round the
    functions run one after the other (in reversed order every other round), so that the
    ratios of one round compare times taken under the same machine load."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            samples[name].append(median_time(fns[name], min_run_time))
    return samples


def ratio(samples: dict[str, list[float]], num: str, den: str | list[str]) -> float:
    """The median over rounds of time(num) / time(den) (den: the fastest of several)."""
    dens = [den] if isinstance(den, str) else den
    per_round = [
        samples[num][r] / min(samples[d][r] for d in dens) for r in range(len(samples[num]))
    ]
    return statistics.median(per_round)


def med(samples: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in samples.items()}


def check(build: Callable, strategy: str) -> float:
    """Max abs error of ``strategy`` against torch.func.jacrev, both in float64 on the
    case's weights and point."""
    f, p64, argnums = build(torch.float64)
    got = jacobian(f, *p64, argnums=argnums, strategy=strategy)
    want = torch.func.jacrev(f, argnums=argnums)(*p64)
    got_l = got if isinstance(got, tuple) else (got,)
    want_l = want if isinstance(want, tuple) else (want,)
    return max(float((g - w).abs().max()) for g, w in zip(got_l, want_l))


RATIOS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)
OFFSETS = (0, 8, 16, 32, 64, 128, 256)


def fit_rule(sweep: list[dict[str, Any]]) -> dict[str, Any]:
    """The rule "fwd when n_out > ratio * n_in + offset" with the least worst regret
    (time of the picked strategy / time of the faster one) over the sweep; ties go to the
    smallest offset, then the ratio nearest 2."""
    best = None
    for ratio in RATIOS:
        for offset in OFFSETS:
            regrets = []
            for s in sweep:
                pick = s["fwd_s"] if s["n_out"] > ratio * s["n_in"] + offset else s["rev_s"]
                regrets.append(pick / min(s["fwd_s"], s["rev_s"]))
            key = (round(max(regrets), 3), offset, abs(math.log(ratio / 2)))
            if best is None or key < best[0]:
                best = (key, ratio, offset, max(regrets), statistics.mean(regrets))
    _, ratio, offset, worst, mean = best  # type: ignore[misc]
    return {"ratio": ratio, "offset": offset, "worst_regret": worst, "mean_regret": mean}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    _clock[0] = CLOCK[args.clock]
    dtype = torch.float32
    out: dict[str, Any] = {
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
            "device": "cpu",
            "dtype": "float32",
            "rounds": args.rounds,
            "clock": args.clock,
            "min_run_time": args.min_run_time,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "FWD_OUT_IN_RATIO": FWD_OUT_IN_RATIO,
        "FWD_OFFSET": FWD_OFFSET,
    }

    # 1. the sweep
    n_ins = (8, 32, 128) if args.quick else (8, 32, 128, 512)
    n_outs = (8, 32, 128, 512) if args.quick else (8, 32, 128, 512, 2048)
    sweep = []
    for n_in in n_ins:
        for n_out in n_outs:
            f, primals = mlp(n_in, n_out, 100 + n_in + n_out, dtype)
            fns = {s: (lambda s=s: jacobian(f, *primals, strategy=s)) for s in ("rev", "fwd")}
            samples = time_interleaved(fns, args.rounds, args.min_run_time)
            t = med(samples)
            q = ratio(samples, "fwd", "rev")
            sweep.append({"n_in": n_in, "n_out": n_out, "rev_s": t["rev"], "fwd_s": t["fwd"],
                          "fwd_over_rev": q})
            print(f"sweep n_in={n_in:4d} n_out={n_out:5d}  rev {t['rev'] * 1e3:8.3f} ms  "
                  f"fwd {t['fwd'] * 1e3:8.3f} ms  fwd/rev {q:5.2f}", flush=True)
    out["sweep"] = sweep
    out["fit"] = fit_rule(sweep)
    print(f"fit: fwd when n_out > {out['fit']['ratio']} * n_in + {out['fit']['offset']} "
          f"(worst regret on the sweep {out['fit']['worst_regret']:.3f})", flush=True)

    # 2. the grid
    grid = []
    for name, build in GRID.items():
        f, primals, argnums = build(dtype)
        errors = {s: check(build, s) for s in STRATEGIES}
        fns = {s: (lambda s=s: jacobian(f, *primals, argnums=argnums, strategy=s))
               for s in STRATEGIES}
        fns["jacrev"] = lambda: torch.func.jacrev(f, argnums=argnums)(*primals)
        fns["jacfwd"] = lambda: torch.func.jacfwd(f, argnums=argnums)(*primals)
        samples = time_interleaved(fns, args.rounds, args.min_run_time)
        t = med(samples)
        strategies = {s: t[s] for s in STRATEGIES if s != "auto"}
        best = min(strategies, key=strategies.get)
        concrete = [s for s in STRATEGIES if s != "auto"]
        n_in = sum(p.numel() for i, p in enumerate(primals)
                   if i in ((argnums,) if isinstance(argnums, int) else argnums))
        with torch.no_grad():
            n_out = f(*primals).numel()
        row = {
            "case": name, "n_in": n_in, "n_out": n_out, "auto_picks": choose_mode(n_in, n_out),
            "times_s": t, "max_abs_error_float64": errors, "best": best,
            "auto_over_best": ratio(samples, "auto", concrete),
            "rev_over_jacrev": ratio(samples, "rev", "jacrev"),
            "fwd_over_jacfwd": ratio(samples, "fwd", "jacfwd"),
        }
        grid.append(row)
        print(f"grid {name:18s} auto->{row['auto_picks']}  best {best:8s}  "
              f"auto/best {row['auto_over_best']:.3f}  rev/jacrev {row['rev_over_jacrev']:.3f}  "
              f"fwd/jacfwd {row['fwd_over_jacfwd']:.3f}", flush=True)
    out["grid"] = grid
    return out


def markdown(res: dict[str, Any]) -> str:
    env = res["environment"]
    lines = [
        "# Crossover of forward and reverse mode (`strategy=\"auto\"`)",
        "",
        f"torch {env['torch']}, Python {env['python']}, {env['device']}, {env['threads']} "
        f"threads, {env['dtype']}, {env.get('clock', 'wall')} clock, {env['rounds']} "
        f"interleaved rounds of "
        f"`Timer.blocked_autorange(min_run_time={env['min_run_time']})` medians; {env['date']}.",
        "Produced by `benchmarks/crossover.py`.",
        "",
        "## Sweep: tanh MLP n_in -> 256 -> 256 -> n_out, `fwd` time / `rev` time",
        "",
        "| n_in | n_out | rev (ms) | fwd (ms) | fwd / rev |",
        "|---:|---:|---:|---:|---:|",
    ]
    for s in res["sweep"]:
        lines.append(f"| {s['n_in']} | {s['n_out']} | {s['rev_s'] * 1e3:.3f} "
                     f"| {s['fwd_s'] * 1e3:.3f} | {s['fwd_over_rev']:.2f} |")
    fit = res["fit"]
    lines += [
        "",
        f"Best rule on this sweep: `\"fwd\"` when n_out > **{fit['ratio']}** * n_in + "
        f"**{fit['offset']}** (worst regret {fit['worst_regret']:.3f}, mean "
        f"{fit['mean_regret']:.3f}; regret = time of the picked strategy / the faster one).",
        f"In `torch_vjp._strategies`: FWD_OUT_IN_RATIO = {res['FWD_OUT_IN_RATIO']}, "
        f"FWD_OFFSET = {res['FWD_OFFSET']}.",
        "",
        "## The benchmark grid: every strategy, and `auto` / best",
        "",
        "| case | n_in | n_out | auto picks | rev (ms) | fwd (ms) | rev-loop (ms) | fwd-loop (ms) "
        "| auto (ms) | auto / best | rev / jacrev | fwd / jacfwd | max error (f64) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for g in res["grid"]:
        t = g["times_s"]
        err = max(g["max_abs_error_float64"].values())
        lines.append(
            f"| {g['case']} | {g['n_in']} | {g['n_out']} | {g['auto_picks']} "
            f"| {t['rev'] * 1e3:.2f} | {t['fwd'] * 1e3:.2f} | {t['rev-loop'] * 1e3:.2f} "
            f"| {t['fwd-loop'] * 1e3:.2f} | {t['auto'] * 1e3:.2f} | {g['auto_over_best']:.3f} "
            f"| {g['rev_over_jacrev']:.3f} | {g['fwd_over_jacfwd']:.3f} | {err:.1e} |"
        )
    worst = max(g["auto_over_best"] for g in res["grid"])
    lines += ["", f"Worst `auto` / best on the grid: {worst:.3f} (target <= 1.15).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads (default: torch's default for this machine)")
    parser.add_argument("--quick", action="store_true", help="a smaller sweep")
    parser.add_argument(
        "--clock", choices=tuple(CLOCK), default="wall",
        help="wall: elapsed time (a quiet machine); thread: this thread's CPU time, which "
        "other processes do not inflate (a shared machine; use with --threads 1)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    res = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "crossover.json").write_text(json.dumps(res, indent=2) + "\n")
    (args.out / "crossover.md").write_text(markdown(res))
    print(f"wrote {args.out / 'crossover.json'} and {args.out / 'crossover.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
