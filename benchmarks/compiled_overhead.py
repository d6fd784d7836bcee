"""Where a compiled torch_vjp Jacobian spends its time, against torch.compile of torch.func
alone, on suite workloads of kind ``jacobian``.

For each workload it times (``Timer.blocked_autorange``, median, rounds interleaved) the
steady state of ``jacobian(f, x, compile=True)`` and of ``torch.compile`` applied to
``torch.func.jacrev`` and ``jacfwd`` of the same function, prints their ratio, and profiles
the compiled torch_vjp call (``torch.profiler``, CPU and, on a GPU, CUDA activity): the
operators and runtime calls that take the most time of the host, and the device
synchronisations, which a fast path must not have.

Run: ``python benchmarks/compiled_overhead.py [--device cuda] [--only mlp_8x512,...]``.
Prints its report; ``--out FILE`` also writes it there.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch.utils.benchmark import Timer

import torch_vjp as tv
from torch_vjp.bench import get_workloads


def _median_s(fn, min_run_time: float) -> float:
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", default="mlp_8x512,mlp_512x8,two_input")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"torch {torch.__version__}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    for workload in get_workloads(args.only.split(",")):
        if workload.kind != "jacobian" or workload.primal_is_params:
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
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                times[name].append(_median_s(call, args.min_run_time))
        say()
        say(f"{workload.name}: {workload.title}")
        ours = statistics.median(times["torch_vjp compile=True"])
        best = min(statistics.median(t) for n, t in times.items() if n.startswith("torch.c"))
        for name, t in times.items():
            say(f"  {name:<26} {statistics.median(t) * 1e6:9.1f} us  "
                f"(rounds {', '.join(f'{x * 1e6:.1f}' for x in t)})")
        say(f"  torch_vjp / best torch.compile: {ours / best:.2f}")
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
