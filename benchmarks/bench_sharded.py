"""Sharded Jacobians: ``tv.jacobian(..., process_group=group)`` on 1, 2, 4 CPU ranks against
single-process ``tv.jacobian``, measured in the same run.

Workload: ``f(x) = W2 @ tanh(W1 @ x)``, ``x`` of ``--n-in`` elements, hidden width
``--hidden``, ``--n-out`` outputs, float64, ``strategy="rev"`` (one VJP per output element:
the ``n_out`` products are what the ranks share). With the defaults (512 -> 1024 -> 2048) a
Jacobian is 2048 x 512 and its products take about a second on one thread, so the work
dominates the cost of the exchange (one ``all_gather_object`` of the call's signature, one
``all_reduce`` of a status code, one ``all_gather`` of the shards: 8 MiB in all).

For each world size W in ``--ranks`` (a group of 1 is the sharded code path with nothing to
share: its ratio is the overhead of the checks and the exchange), W processes are spawned
with ``torch.multiprocessing`` and joined in a gloo group (``file://`` rendezvous), each with
``--threads`` threads (1 by default, so that W ranks need W cores: run it where there are at
least ``max(--ranks)`` idle cores, or the figures measure the scheduler). Every rank builds
the same ``f`` and ``x`` from one seed. The first call (the warm-up) is checked against
single-process ``tv.jacobian`` on every rank (float64, rtol 1e-10). Then ``--rounds`` times:
a barrier, one call, a barrier; the round's time is the slowest rank's (all_reduce MAX), so a
call counts until every rank holds the whole Jacobian. The single-process reference is timed
the same way, in one process with the same thread count, in the same run. Reported per W:
median and interquartile range of the rounds, the ratio to the reference's median (below 1:
faster) and its inverse, the speed-up.

Writes ``benchmarks/results/sharded.json`` and ``sharded.md`` (``--out`` for another folder,
``--no-save`` for neither). The default run (``--ranks 1,2,4 --rounds 10``) takes about two
minutes on a machine with 4 idle cores; ``--ranks 1,2 --n-in 32 --hidden 32 --n-out 64
--rounds 3 --no-save`` is a smoke run of about half a minute, nearly all of it starting
processes (its figures mean nothing: the work is too small). Usage::

    python benchmarks/bench_sharded.py                 # the committed run
    python benchmarks/bench_sharded.py --ranks 1,2 --threads 1 --rounds 20
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_vjp as tv
from torch_vjp._measure import summarize_times

HERE = Path(__file__).resolve().parent
DT = torch.float64


def _workload(n_in: int, hidden: int, n_out: int):
    g = torch.Generator().manual_seed(0)
    W1 = torch.randn(hidden, n_in, dtype=DT, generator=g) / n_in ** 0.5
    W2 = torch.randn(n_out, hidden, dtype=DT, generator=g) / hidden ** 0.5
    x = torch.randn(n_in, dtype=DT, generator=g)

    def f(x):
        return W2 @ torch.tanh(W1 @ x)

    return f, x


def _rank(rank: int, world: int, init_file: str, args: argparse.Namespace, results) -> None:
    torch.set_num_threads(args.threads)
    f, x = _workload(args.n_in, args.hidden, args.n_out)
    if world == 0:  # the single-process reference
        group = None
        call = lambda: tv.jacobian(f, x, strategy="rev")  # noqa: E731
        sync = lambda: None  # noqa: E731
    else:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(minutes=10))
        group = dist.group.WORLD
        call = lambda: tv.jacobian(f, x, strategy="rev", process_group=group)  # noqa: E731
        sync = lambda: dist.barrier(group=group)  # noqa: E731
    try:
        got = call()  # the warm-up doubles as the correctness check
        want = tv.jacobian(f, x, strategy="rev")
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        times = []
        for _ in range(args.rounds):
            sync()
            t0 = time.perf_counter()
            call()
            sync()
            dt = torch.tensor([time.perf_counter() - t0], dtype=DT)
            if group is not None:
                dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
            times.append(float(dt))
        if rank == 0:
            results.put((world, times))
    finally:
        if group is not None:
            dist.destroy_process_group()


def _measure(world: int, args: argparse.Namespace) -> list[float]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "init")
        mp.spawn(_rank, args=(world, init, args, results), nprocs=max(1, world), join=True)
    _, times = results.get()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2,4", help="world sizes, comma-separated")
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    p.add_argument("--n-in", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--n-out", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    if not ranks or min(ranks) < 1 or args.rounds < 1 or args.threads < 1:
        p.error("--ranks, --rounds and --threads take positive integers")

    print(f"reference: single-process tv.jacobian, {args.threads} thread(s) ...", flush=True)
    ref = _measure(0, args)
    ref_t = summarize_times([ref])
    rows = []
    for world in ranks:
        print(f"{world} rank(s) ...", flush=True)
        t = summarize_times([_measure(world, args)])
        rows.append({"ranks": world, "median_s": t.median, "iqr_s": t.q3 - t.q1,
                     "ratio_to_single": t.median / ref_t.median,
                     "speedup": ref_t.median / t.median})
    env = {
        "torch": torch.__version__, "torch_vjp": tv.__version__,
        "python": platform.python_version(), "machine": platform.processor() or
        platform.machine(), "cpu_count": os.cpu_count(), "threads_per_rank": args.threads,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
    }
    workload = {"f": "W2 @ tanh(W1 @ x)", "n_in": args.n_in, "hidden": args.hidden,
                "n_out": args.n_out, "dtype": "float64", "strategy": "rev",
                "rounds": args.rounds}
    doc = {"schema": 1, "env": env, "workload": workload,
           "single_process": {"median_s": ref_t.median, "iqr_s": ref_t.q3 - ref_t.q1},
           "sharded": rows}
    lines = [
        "# Sharded Jacobians: time against the number of ranks",
        "",
        f"torch {env['torch']}, torch_vjp {env['torch_vjp']}, Python {env['python']}; "
        f"{env['cpu_count']} cores, {args.threads} thread(s) per rank, gloo; {env['date']}; "
        f"load average {env['load_average']}.",
        "",
        f"`f(x) = W2 @ tanh(W1 @ x)`, {args.n_in} -> {args.hidden} -> {args.n_out}, float64, "
        f"`strategy=\"rev\"`. Single-process `tv.jacobian`: {ref_t.median * 1e3:.1f} ms (IQR "
        f"{(ref_t.q3 - ref_t.q1) * 1e3:.1f} ms). Each time is the median over {args.rounds} "
        f"rounds of the slowest rank's call, barrier to barrier; ratio = sharded / "
        f"single-process, in the same run.",
        "",
        "| ranks | median (ms) | IQR (ms) | ratio to single process | speed-up |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['ranks']} | {r['median_s'] * 1e3:.1f} | {r['iqr_s'] * 1e3:.1f} | "
                     f"{r['ratio_to_single']:.2f} | {r['speedup']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_save:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sharded.json").write_text(json.dumps(doc, indent=2) + "\n")
        (args.out / "sharded.md").write_text(text)
        print(f"wrote {args.out / 'sharded.json'} and {args.out / 'sharded.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
