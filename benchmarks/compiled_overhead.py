"""Where a compiled torch_vjp Jacobian spends its time, against torch.compile of torch.func
alone and jax.jit, on suite workloads of kind ``jacobian`` (a module's parameters too).

For each workload it times (``Timer.blocked_autorange``, median; the methods alternated
round by round, so that each round is a paired sample) the steady state of
``jacobian(f, x, compile=True)``, of ``torch.compile`` applied to ``torch.func.jacrev`` and
``jacfwd`` of the same function, and, where jax runs on the device, of the suite's
``jax.jit(jax.jacrev)`` and ``jax.jit(jax.jacfwd)``; prints each one's median and
interquartile range over the rounds, torch_vjp's ratio to the faster torch.compile and to
the faster jax, and profiles the compiled torch_vjp call (``torch.profiler``, CPU and, on a
GPU, CUDA activity): the operators and runtime calls that take the most time of the host,
and the device synchronisations, which a fast path must not have.

On a machine shared with other work, ``--process-time`` times with ``time.process_time``
(the CPU time of this process, which other processes' load disturbs less than the wall
clock; for one thread it is the time of the call, for several it adds up the threads').

Run: ``python benchmarks/compiled_overhead.py [--device cuda] [--only mlp_8x512,...]
[--threads 2] [--rounds 10] [--process-time] [--no-profile]``. Prints its report;
``--out FILE`` also writes it there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.utils.benchmark import Timer

import torch_vjp as tv
from torch_vjp.bench import get_workloads
from torch_vjp.bench.methods import METHODS, jax_runs_on

_JAX = ("jax.jit(jax.jacrev)", "jax.jit(jax.jacfwd)")


def _median_s(fn: Callable[[], object], min_run_time: float,
              timer: Callable[[], float] = time.perf_counter) -> float:
    bench = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads(),
                  timer=timer)
    return bench.blocked_autorange(min_run_time=min_run_time).median


def _iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", default="mlp_8x512,mlp_512x8,two_input")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for the run (default: torch's)")
    parser.add_argument("--process-time", action="store_true",
                        help="time with time.process_time instead of the wall clock")
    parser.add_argument("--no-jax", action="store_true")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    timer = time.process_time if args.process_time else time.perf_counter
    use_jax = not args.no_jax and jax_runs_on(args.device)
    by_name = {m.name: m for m in METHODS}
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"torch {torch.__version__}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else "")
        + f", {torch.get_num_threads()} threads, "
        + ("process time" if args.process_time else "wall clock")
        + f", {args.rounds} alternated rounds")
    for workload in get_workloads(args.only.split(",")):
        if workload.kind != "jacobian":
            continue
        case = workload.build(torch.float32, args.device)
        f, primals, argnums = case.f, case.primals, case.argnums
        methods = {
            "torch_vjp compile=True": lambda: tv.jacobian(f, *primals, argnums=argnums,
                                                          compile=True),
            "torch.compile(jacrev)": torch.compile(torch.func.jacrev(f, argnums=argnums)),
            "torch.compile(jacfwd)": torch.compile(torch.func.jacfwd(f, argnums=argnums)),
        }
        calls = {}
        for name, fn in methods.items():
            calls[name] = (lambda fn=fn: fn(*primals)) if name.startswith("torch.compile") \
                else fn
            for _ in range(3):  # compile and warm up
                calls[name]()
        if use_jax and workload.jax_fn is not None:
            for name in _JAX:
                calls[name] = by_name[name].prepare(case).run
                for _ in range(3):  # jit and warm up
                    calls[name]()
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                times[name].append(_median_s(call, args.min_run_time, timer))
        say()
        say(f"{workload.name}: {workload.title}")
        ours = statistics.median(times["torch_vjp compile=True"])
        best = min(statistics.median(t) for n, t in times.items() if n.startswith("torch.c"))
        for name, t in times.items():
            say(f"  {name:<26} {statistics.median(t) * 1e6:9.1f} us  "
                f"IQR {_iqr(t) * 1e6:7.1f} us  "
                f"(rounds {', '.join(f'{x * 1e6:.1f}' for x in t)})")
        say(f"  torch_vjp / best torch.compile: {ours / best:.2f}")
        jax_times = [statistics.median(t) for n, t in times.items() if n in _JAX]
        if jax_times:
            say(f"  torch_vjp / best jax.jit: {ours / min(jax_times):.2f}")
        if args.no_profile:
            continue
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(50):
                calls["torch_vjp compile=True"]()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
        say("  profile of 50 compiled torch_vjp calls, by the host's own time:")
        say(table)
        syncs = [e for e in prof.key_averages() if "ynchronize" in e.key or "MemGetInfo" in e.key]
        say("  synchronising runtime calls in 50 calls: "
            + (", ".join(f"{e.key} x{e.count}" for e in syncs) or "none"))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
