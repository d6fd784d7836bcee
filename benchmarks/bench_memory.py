"""Peak memory of a Jacobian under a ``max_memory`` budget, against plain ``torch.func.jacrev``.

Each case runs in a fresh Python process, so that one case's freed memory, allocator
caches and lazily initialised state do not blur the next one's figure. In the child:

1. build the workload (the suite's own, ``torch_vjp.bench``), warm up (one small Jacobian
   with the same method, so that one-time initialisation is not counted), ``gc.collect()``;
2. read the resident set size (``VmRSS``) and reset the kernel's peak RSS counter
   (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0; where that is refused, the figure is
   marked and ``ru_maxrss`` is used instead, which may include earlier peaks);
3. compute the Jacobian once, keep it alive, and read the peak (``VmHWM``).

*peak extra* = peak RSS - RSS before. The check for a ``max_memory=M`` row is the issue's:
``peak extra <= size(J) + M`` (torch_vjp's own budget is stricter: ``M`` already includes
the Jacobian). The same case under ``torch.func.jacrev`` (and torch_vjp without a budget)
is reported for comparison. Resident memory also counts allocator slack and page
rounding, so it is an upper bound of the tensors' own bytes.

Writes ``results/jacobian_memory.json`` and ``.md`` next to this file (or under ``--out``).

Run: ``python benchmarks/bench_memory.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import resource
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MB = 10**6

# (workload, method, max_memory in bytes or None)
CASES = [
    ("elementwise_4096", "torch.func.jacrev", None),
    ("elementwise_4096", "torch_vjp auto", None),
    ("elementwise_4096", "torch_vjp rev", 80 * MB),
    ("elementwise_4096", "torch_vjp fwd", 80 * MB),
    ("elementwise_4096", "torch_vjp auto", 80 * MB),
    ("mlp_1024x1024", "torch.func.jacrev", None),
    ("mlp_1024x1024", "torch_vjp auto", None),
    ("mlp_1024x1024", "torch_vjp auto", 6 * MB),
    ("mlp_1024x1024", "torch_vjp rev", 6 * MB),
]


def _status_kb(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024


def child(workload_name: str, method: str, max_memory: int | None, threads: int) -> dict:
    import torch

    from torch_vjp.bench import get_workloads
    from torch_vjp.jacobians import jacobian

    torch.set_num_threads(threads)
    (workload,) = [w for w in get_workloads(workload_name) if w.name == workload_name]
    case = workload.build(torch.float32)

    if method == "torch.func.jacrev":
        def run(f=case.f, primals=case.primals):
            return torch.func.jacrev(f, argnums=case.argnums)(*primals)
    else:
        strategy = method.split()[-1]

        def run(f=case.f, primals=case.primals):
            return jacobian(f, *primals, argnums=case.argnums, strategy=strategy,
                            max_memory=max_memory)

    # Warm-up on a tiny problem with the same method: one-time initialisation is not counted.
    small = torch.ones(4)
    if method == "torch.func.jacrev":
        torch.func.jacrev(torch.sin)(small)
    else:
        jacobian(torch.sin, small, strategy=method.split()[-1])
    case.f(*case.primals)
    gc.collect()

    before = _status_kb("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")
        peak_source = "VmHWM after clear_refs"
    except OSError:
        peak_source = "ru_maxrss (peak since process start)"
    jac = run()
    if peak_source.startswith("VmHWM"):
        peak = _status_kb("VmHWM")
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    leaves = jac if isinstance(jac, tuple) else (jac,)
    size = sum(t.numel() * t.element_size() for t in leaves)
    del jac
    return {
        "workload": workload_name,
        "method": method,
        "max_memory": max_memory,
        "jacobian_bytes": size,
        "rss_before": before,
        "peak_rss": peak,
        "peak_extra": peak - before,
        "peak_source": peak_source,
        "threads": threads,
    }


def _fmt_bytes(n: int | None) -> str:
    from torch_vjp._errors import format_bytes  # torch_vjp's one byte format

    return format_bytes(n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", nargs=3, metavar=("WORKLOAD", "METHOD", "MAX_MEMORY"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, method, budget = args.child
        out = child(name, method, None if budget == "none" else int(budget), args.threads)
        print("RESULT " + json.dumps(out))
        return 0

    rows = []
    for name, method, budget in CASES:
        cmd = [sys.executable, __file__, "--threads", str(args.threads), "--child", name, method,
               "none" if budget is None else str(budget)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            row = {"workload": name, "method": method, "max_memory": budget, "error": err}
        else:
            row = json.loads(line[len("RESULT "):])
            if budget is not None:
                row["bound"] = row["jacobian_bytes"] + budget
                row["within_bound"] = row["peak_extra"] <= row["bound"]
                row["within_max_memory"] = row["peak_extra"] <= budget
        rows.append(row)
        label = f"{name}: {method}" + (f" (max_memory={_fmt_bytes(budget)})" if budget else "")
        if "error" in row:
            print(f"{label:<58} FAILED: {row['error']}")
        else:
            verdict = ""
            if budget is not None:
                verdict = ("<= size(J) + M: ok" if row["within_bound"]
                           else "<= size(J) + M: EXCEEDED")
            print(f"{label:<58} J {_fmt_bytes(row['jacobian_bytes']):>10}  peak extra "
                  f"{_fmt_bytes(row['peak_extra']):>10}  {verdict}")

    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "threads": args.threads, "cpu_count": os.cpu_count()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "jacobian_memory.json").write_text(
        json.dumps({"environment": env, "cases": rows}, indent=2) + "\n")
    md = [
        "# Jacobian peak memory (peak RSS, one fresh process per case)",
        "",
        f"torch {env['torch']}, Python {env['python']}, {env['threads']} threads; "
        "written by `benchmarks/bench_memory.py`. *peak extra* = peak resident set size during "
        "the call minus resident size before it (Jacobian included). Check for a "
        "`max_memory=M` row: peak extra <= size(J) + M.",
        "",
        "| workload | method | max_memory M | size(J) | peak extra | size(J) + M | check |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['workload']} | {r['method']} | {_fmt_bytes(r['max_memory'])} | | "
                      f"failed: {r['error']} | | |")
            continue
        check = "-"
        if r.get("max_memory") is not None:
            check = "ok" if r["within_bound"] else "**exceeded**"
        md.append(f"| {r['workload']} | {r['method']} | {_fmt_bytes(r['max_memory'])} | "
                  f"{_fmt_bytes(r['jacobian_bytes'])} | {_fmt_bytes(r['peak_extra'])} | "
                  f"{_fmt_bytes(r.get('bound'))} | {check} |")
    (args.out / "jacobian_memory.md").write_text("\n".join(md) + "\n")
    print(f"\nwrote {args.out / 'jacobian_memory.json'} and {args.out / 'jacobian_memory.md'}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
