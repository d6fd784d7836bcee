"""compile=True's oneDNN products (NOTE [oneDNN products] in torch_vjp/_engine/onednn.py),
against MKL's, on this machine.

Two parts, each a ratio of medians measured in the same run, rounds alternated:

* the float32 product alone: ``torch.mm`` (MKL) against oneDNN's kernel, as the pass calls
  it, on the shapes of the suite's MLP programs and a few small ones the pass leaves alone;
* the compiled Jacobian of suite workloads with the pass on and off: each round runs one
  fresh process per setting, alternated, and each process reports its steady-state median.

Run: ``python benchmarks/bench_onednn.py [--rounds 3] [--out benchmarks/results]``; writes
``onednn_products.md`` and ``.json`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch
from torch.utils.benchmark import Timer

SHAPES = [(1024, 256, 1024), (1024, 256, 256), (256, 256, 256), (2048, 256, 256),
          (2048, 256, 32), (512, 256, 8), (128, 128, 128), (8, 256, 512),
          (640, 10, 32), (1, 1024, 256), (32, 32, 32)]
WORKLOADS = ["mlp_256x256", "mlp_1024x1024", "batch_mlp_64x32"]


def _median_s(fn, *args) -> float:
    return Timer("fn(*args)", globals={"fn": fn, "args": args},
                 num_threads=torch.get_num_threads()).blocked_autorange(
                     min_run_time=0.2).median


def products(rounds: int) -> list[dict]:
    from torch_vjp._engine import onednn

    rows = []
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        times: dict[str, list[float]] = {"mm": [], "onednn": []}
        for _ in range(rounds):
            times["mm"].append(_median_s(torch.mm, a, b))
            times["onednn"].append(_median_s(lambda x, w: onednn._linear(x, w.t(), None), a, b))
        mm, dnn = statistics.median(times["mm"]), statistics.median(times["onednn"])
        rows.append({"m": m, "k": k, "n": n, "mm_s": mm, "onednn_s": dnn, "ratio": dnn / mm,
                     "rewritten": m * k * n >= onednn.MIN_WORK
                     and min(m, n) >= onednn.MIN_SIDE})
    return rows


def _one(workload: str, on: bool) -> float:
    """Steady-state median (s) of the compiled Jacobian of ``workload`` in this process."""
    import torch_vjp as tv
    from torch_vjp._engine import onednn
    from torch_vjp.bench import get_workloads

    onednn._FASTER = on
    w = get_workloads([workload])[0]
    case = w.build(torch.float32, "cpu")
    if w.kind == "batch_jacobian":
        def call():
            return tv.batch_jacobian(case.f, *case.primals, compile=True)
    else:
        def call():
            return tv.jacobian(case.f, *case.primals, argnums=case.argnums, compile=True)
    for _ in range(3):
        call()
    return _median_s(call)


def jacobians(rounds: int, threads: int) -> list[dict]:
    rows = []
    for workload in WORKLOADS:
        times: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(rounds):
            for mode in ("off", "on"):
                out = subprocess.run(
                    [sys.executable, __file__, "--one", workload, mode, "--threads",
                     str(threads)], capture_output=True, text=True, check=True,
                    env={**os.environ, "PYTHONWARNINGS": "ignore"})
                times[mode].append(float(out.stdout.strip().splitlines()[-1]))
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        rows.append({"workload": workload, "off_s": off, "on_s": on, "ratio": on / off,
                     "rounds_on_s": times["on"], "rounds_off_s": times["off"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--one", nargs=2, metavar=("WORKLOAD", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.one:
        print(_one(args.one[0], args.one[1] == "on"))
        return 0
    from torch_vjp._engine import onednn

    faster = onednn.faster_here()
    prod, jac = products(args.rounds), jacobians(args.rounds, args.threads)
    lines = [
        "# compile=True's oneDNN products against MKL",
        "",
        f"torch {torch.__version__}, {args.threads} threads, float32; {args.rounds} rounds, "
        f"alternated; medians of `Timer.blocked_autorange` medians. This machine's "
        f"one-time measurement (`faster_here`): {faster}. Made by "
        f"`python benchmarks/bench_onednn.py`.",
        "",
        "## The product alone",
        "",
        "| m x k x n | torch.mm (MKL) | oneDNN | oneDNN / MKL | rewritten by the pass |",
        "|---|---:|---:|---:|---|",
    ]
    for r in prod:
        lines.append(f"| {r['m']} x {r['k']} x {r['n']} | {r['mm_s'] * 1e6:.1f} us | "
                     f"{r['onednn_s'] * 1e6:.1f} us | {r['ratio']:.2f} | "
                     f"{'yes' if r['rewritten'] else 'no'} |")
    lines += ["", "## Compiled Jacobians, pass on against off (one process each, alternated)",
              "", "| workload | off | on | on / off | rounds on / off |", "|---|---:|---:|---:|---|"]
    for r in jac:
        rounds = ", ".join(f"{a * 1e3:.2f}/{b * 1e3:.2f}"
                           for a, b in zip(r["rounds_on_s"], r["rounds_off_s"]))
        lines.append(f"| {r['workload']} | {r['off_s'] * 1e3:.3f} ms | {r['on_s'] * 1e3:.3f} ms"
                     f" | {r['ratio']:.2f} | {rounds} ms |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "onednn_products.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(args.out, "onednn_products.json"), "w") as fh:
        json.dump({"faster_here": faster, "threads": args.threads, "products": prod,
                   "jacobians": jac}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
