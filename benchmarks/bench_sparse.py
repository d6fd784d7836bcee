"""Sparse Jacobians against the dense methods, as speed-ups measured in one run (issue #15).

Workloads (the suite's own, ``torch_vjp.bench``, float32 on the CPU):

* ``elementwise_4096``: ``x * tanh(x) + sin(x)``, a diagonal Jacobian;
* ``pde_1d_4096``: the 1-d Bratu residual, tridiagonal;
* ``laplace_2d_64x64``: the 2-d Bratu residual (5-point Laplacian + exp), 64 x 64 grid;
* ``rowwise_mlp_64x32``: a tanh MLP 32 -> 256 -> 256 -> 32 row by row on a flat batch of 64
  (2048 -> 2048, 64 diagonal blocks of 32 x 32).

Peers: ``torch.func.jacrev``, ``torch.func.jacfwd``, and ``jax.jit(jax.jacrev)``,
``jax.jit(jax.jacfwd)`` (compiled once, before timing; left out with a note when jax cannot
be imported). Every method's result is checked against a float64 ``torch.func.jacrev``
reference first.

Measured:

1. steady state: ``Timer.blocked_autorange`` medians of ``tv.sparse_jacobian(f, x)`` (mode
   ``"auto"``, CSR result; ``"fwd"``, ``"rev"`` and a dense result too, for information) and
   of each peer;
2. the speed-up, paired: ``--pairs`` times, the median of ``tv.sparse_jacobian`` and the
   median of each peer within 1.3x of the fastest peer (step 1) are taken back to back, the
   order alternating; each pair gives fastest peer / torch_vjp. Reported: the median over
   the pairs and their interquartile range (the machine may be shared: within a pair, its
   drift cancels). Target: >= 10 on every workload;

   every measurement starts after ``--settle`` seconds of sleep: jax's thread pool (and
   torch's OpenMP threads) keep spinning for a while after their work, and on a machine with
   few cores that spinning steals the cores from whatever runs next (a sub-millisecond
   ``tv.sparse_jacobian`` right after a jax call measured up to 70 times slower, 2 threads on
   2 cores);
3. the first call, separately: the pattern and colourings cleared, one call timed
   (detection, colouring and the products), ``--first-calls`` times; also detection alone
   (``tv.jacobian_sparsity``) and colouring alone (both modes, as ``"auto"`` does).

The load average of the machine is recorded before and after. On a machine busy with other
work, torch's intra-op threads wait for each other at every parallel op whenever one of them
is descheduled, which makes sub-millisecond calls many times slower with ``--threads 2`` on
2 cores; ``--threads 1`` gives stable figures there (jax keeps its own thread pool either
way, so the peers lose nothing). Writes ``results/sparse.json`` and ``results/sparse.md``
next to this file (or under ``--out``).

Run: ``python benchmarks/bench_sparse.py [--pairs 21] [--pair-time 0.05] [--settle 0.2]
[--threads 2]`` (about 3 minutes, most of it the dense peers on the MLP).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torch_vjp._engine.problem import Problem
from torch_vjp._measure import check_result, cpu_model, median_time
from torch_vjp._sparse import compute
from torch_vjp._sparse.compute import Plan
from torch_vjp._sparse.pattern import Pattern
from torch_vjp.bench import get_workloads
from torch_vjp.bench.methods import get_methods, jax_available, reference
from torch_vjp.sparse import clear_cache, jacobian_sparsity, sparse_jacobian

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS = ("elementwise_4096", "pde_1d_4096", "laplace_2d_64x64", "rowwise_mlp_64x32")
PEERS = ("torch.func.jacrev", "torch.func.jacfwd", "jax.jit(jax.jacrev)", "jax.jit(jax.jacfwd)")
TARGET = 10.0


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (xs[0], xs[0])
    q = statistics.quantiles(xs, n=4)
    return (q[0], q[2])


def _load() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def environment(threads: int) -> dict[str, Any]:
    cpu = cpu_model()
    jax_version = None
    if jax_available():
        import jax

        jax_version = jax.__version__
    return {
        "torch": torch.__version__, "jax": jax_version, "python": platform.python_version(),
        "threads": threads, "cores": os.cpu_count(), "cpu": cpu, "device": "cpu",
        "dtype": "float32", "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def _timed(run: Callable[[], Any], min_run_time: float, settle: float) -> float:
    """``median_time`` after ``settle`` seconds of sleep (see the module docstring)."""
    time.sleep(settle)
    return median_time(run, min_run_time)


def _first_calls(f: Callable[[Any], Any], x: Any, repeats: int, settle: float) -> dict[str, Any]:
    """Seconds of first calls (cache cleared before each), of detection and of colouring."""
    first, detect, color = [], [], []
    for _ in range(repeats):
        clear_cache(f)
        time.sleep(settle)
        t0 = time.perf_counter()
        sparse_jacobian(f, x)
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pattern = jacobian_sparsity(f, x)
        detect.append(time.perf_counter() - t0)
        idx = pattern.indices()
        p = Pattern(pattern.shape[0], pattern.shape[1], idx[0], idx[1], ordered=True)
        t0 = time.perf_counter()
        Plan(p).coloring("auto")
        color.append(time.perf_counter() - t0)
    return {
        "first_call_s": statistics.median(first), "first_call_range_s": [min(first), max(first)],
        "detection_s": statistics.median(detect), "coloring_s": statistics.median(color),
    }


def bench_workload(name: str, args: argparse.Namespace, use_jax: bool) -> dict[str, Any]:
    (w,) = get_workloads(name)
    case = w.build(torch.float32)
    f, x = case.f, case.primals[0]
    ref = reference(w)
    out: dict[str, Any] = {"name": name, "title": w.title, "n": x.numel()}
    print(f"{name}: {w.title}", file=sys.stderr, flush=True)

    # torch_vjp: check, then the plan's facts
    clear_cache()
    variants = {
        "torch_vjp auto": lambda: sparse_jacobian(f, x),
        "torch_vjp fwd": lambda: sparse_jacobian(f, x, mode="fwd"),
        "torch_vjp rev": lambda: sparse_jacobian(f, x, mode="rev"),
        "torch_vjp auto, dense result": lambda: sparse_jacobian(f, x, layout=torch.strided),
    }
    ours: dict[str, Any] = {}
    for label, run in variants.items():
        result = run()
        dense = result if result.layout is torch.strided else result.to_dense()
        err, _, why = check_result(dense.view(ref.shape), ref, None, None)
        ok = why is None
        ours[label] = {"error": err, "ok": ok}
    plan = compute.cached_plan(Problem(f, (x,), 0, has_aux=False, call="bench"))
    out.update({
        "m": plan.pattern.m, "nnz": plan.pattern.nnz,
        "colours_fwd": plan.coloring("fwd").count, "colours_rev": plan.coloring("rev").count,
        "mode_auto": plan.coloring("auto").mode,
    })

    # the peers: check, compile (jax), time
    peers: dict[str, Any] = {}
    runs: dict[str, Callable[[], Any]] = {}
    for method in get_methods("jacobian", names=list(PEERS), jax=use_jax):
        try:
            prepared = method.prepare(case)
            got = prepared.to_torch(prepared.run())
            err, _, why = check_result(got, ref, None, None)
            ok = why is None
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            peers[method.name] = {"ok": False, "failed": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        runs[method.name] = prepared.run
        peers[method.name] = {"error": err, "ok": ok}
    for label, run in variants.items():
        ours[label]["time_s"] = _timed(run, args.min_run_time, args.settle)
    for label, run in runs.items():
        peers[label]["time_s"] = _timed(run, args.min_run_time, args.settle)
    out["torch_vjp"], out["peers"] = ours, peers

    # paired speed-ups against the fastest peers
    timed = {k: v["time_s"] for k, v in peers.items() if v.get("ok") and "time_s" in v}
    if not timed:
        out["speedup"] = None
        return out
    best = min(timed.values())
    rivals = [k for k, t in timed.items() if t <= 1.3 * best]
    ours_run = variants["torch_vjp auto"]
    ratios = []
    for k in range(args.pairs):
        order = [True, False] if k % 2 == 0 else [False, True]
        t_ours = t_peer = 0.0
        for mine in order:
            if mine:
                t_ours = _timed(ours_run, args.pair_time, args.settle)
            else:
                t_peer = min(_timed(runs[r], args.pair_time, args.settle) for r in rivals)
        ratios.append(t_peer / t_ours)
    out["speedup"] = {
        "against": rivals, "median": statistics.median(ratios), "iqr": _quartiles(ratios),
        "min": min(ratios), "pairs": ratios, "target": TARGET,
        "passed": statistics.median(ratios) >= TARGET,
    }
    out.update(_first_calls(f, x, args.first_calls, args.settle))
    return out


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.3g}"


def markdown(env: dict[str, Any], rows: list[dict[str, Any]], args: argparse.Namespace,
             load: dict[str, Any], note: str) -> str:
    lines = [
        "# Sparse Jacobians against dense methods",
        "",
        f"torch {env['torch']}, jax {env['jax'] or '(not installed)'}, Python {env['python']}; "
        f"{env['device']} ({env['cpu']}), {env['threads']} threads on {env['cores']} cores, "
        f"{env['dtype']}; {env['date']}. Load average (1, 5, 15 min) before: "
        f"{load['before']}, after: {load['after']}. Written by `benchmarks/bench_sparse.py`.",
        "",
        f"Speed-up: fastest peer / `tv.sparse_jacobian` (mode auto, CSR result), median over "
        f"{args.pairs} pairs, each pair both medians of "
        f"`Timer.blocked_autorange(min_run_time={args.pair_time})` taken back to back, the "
        f"order alternating; IQR over the pairs. Times: `blocked_autorange("
        f"min_run_time={args.min_run_time})` medians, in ms. Every measurement after "
        f"{args.settle} s of sleep (spinning thread pools settle). First call: pattern and "
        f"colourings cleared, median of {args.first_calls}.",
    ]
    if note:
        lines += ["", note]
    lines += [
        "",
        "| workload | n | nnz | colours fwd / rev | auto | torch_vjp (ms) | fastest peer (ms) "
        "| speed-up (paired median) | IQR | target | first call (ms) | detection (ms) "
        "| colouring (ms) |",
        "|---|---:|---:|---|---|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        sp = r.get("speedup")
        peer_times = {k: v["time_s"] for k, v in r["peers"].items() if "time_s" in v}
        best = min(peer_times, key=peer_times.get) if peer_times else None
        peer = f"{_ms(peer_times[best])} ({best})" if best else "-"
        if sp is None:
            speedup = iqr = verdict = "-"
        else:
            speedup = f"{sp['median']:.0f}x"
            iqr = f"{sp['iqr'][0]:.0f}-{sp['iqr'][1]:.0f}"
            verdict = "pass" if sp["passed"] else "**below target**"
        lines.append(
            f"| {r['name']} | {r['n']} | {r['nnz']} | {r['colours_fwd']} / {r['colours_rev']} "
            f"| {r['mode_auto']} | {_ms(r['torch_vjp']['torch_vjp auto']['time_s'])} | {peer} "
            f"| {speedup} | {iqr} | >= {TARGET:.0f}x {verdict} | {_ms(r.get('first_call_s'))} "
            f"| {_ms(r.get('detection_s'))} | {_ms(r.get('coloring_s'))} |"
        )
    lines += ["", "## Every method (ms, `blocked_autorange` medians)", ""]
    lines += ["| workload | method | time (ms) | max abs error | |", "|---|---|---:|---:|---|"]
    for r in rows:
        for label, v in {**r["torch_vjp"], **r["peers"]}.items():
            status = "ok" if v.get("ok") else ("failed: " + v["failed"] if "failed" in v
                                                else "**wrong**")
            err = f"{v['error']:.2g}" if "error" in v else "-"
            lines.append(f"| {r['name']} | {label} | {_ms(v.get('time_s'))} | {err} | {status} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=21)
    parser.add_argument("--pair-time", type=float, default=0.05)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    parser.add_argument("--first-calls", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--settle", type=float, default=0.2,
                        help="seconds of sleep before each measurement (module docstring)")
    parser.add_argument("--only", default=None, help="comma-separated workload names")
    parser.add_argument("--no-jax", action="store_true", help="leave out jax's methods")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    use_jax = not args.no_jax and jax_available()
    note = ""
    if not use_jax:
        note = ("jax's methods are left out (" + ("--no-jax" if args.no_jax else
                "jax cannot be imported") + "): the speed-ups are against torch.func only.")
    names = args.only.split(",") if args.only else list(WORKLOADS)
    load = {"before": _load()}
    env = environment(args.threads)
    rows = [bench_workload(name, args, use_jax) for name in names]
    load["after"] = _load()
    text = markdown(env, rows, args, load, note)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"environment": env, "load_average": load, "pairs": args.pairs,
            "pair_time_s": args.pair_time, "min_run_time_s": args.min_run_time,
            "settle_s": args.settle,
            "target": TARGET, "note": note, "workloads": rows}
    (args.out / "sparse.json").write_text(json.dumps(data, indent=2) + "\n")
    (args.out / "sparse.md").write_text(text)
    print(f"wrote {args.out / 'sparse.json'} and {args.out / 'sparse.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
