"""Overhead of checked autograd, measured in one run.

1. ``tv.grad`` vs ``torch.autograd.grad`` on a 10-output call (target ratio <= 1.05).
2. A small MLP training step (forward, ``loss.backward()``, SGD update) inside
   ``tv.checked()`` vs plain (target <= 1.10).
3. The same step in a fresh process with ``TORCH_VJP_CHECKED=1`` vs plain in that process
   (checks switched off there with ``torch_vjp.autograd._uninstall`` for the reference).
4. The step of 2. with its first layer a custom ``torch.autograd.Function`` (a linear layer
   with a hand-written backward), inside ``tv.checked()`` vs plain: checked mode checks what
   that backward returns on every call (target <= 1.10).

Medians from ``torch.utils.benchmark.Timer.blocked_autorange``; ratios against the
reference measured in the same run (process). Writes ``results/checks_overhead.json`` and
``.md`` next to this file.

Run: ``python benchmarks/bench_checks.py [--min-run-time 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.utils.benchmark as tb

RESULTS = Path(__file__).resolve().parent / "results"

STEP_SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
def step():
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
"""

CUSTOM_STEP_SETUP = """
import torch
torch.manual_seed(0)

class LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return torch.addmm(b, x, w.t())

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x, g.sum(0)

w1 = torch.nn.Parameter(torch.randn(128, 64) / 8)
b1 = torch.nn.Parameter(torch.zeros(128))
head = torch.nn.Linear(128, 10)
opt = torch.optim.SGD([w1, b1, *head.parameters()], lr=1e-3)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
def step():
    opt.zero_grad(set_to_none=True)
    h = torch.tanh(LinearFn.apply(x, w1, b1))
    loss = torch.nn.functional.cross_entropy(head(h), y)
    loss.backward()
    opt.step()
"""


def _median(stmt: str, setup: str, globals_: dict | None, min_run_time: float) -> float:
    timer = tb.Timer(stmt, setup=setup, globals=globals_ or {}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def bench_grad(min_run_time: float) -> dict:
    import torch_vjp as tv

    x = torch.randn(64, requires_grad=True)
    outs = [torch.tanh(x * (i + 1)) for i in range(10)]
    gos = [torch.randn(64) for _ in range(10)]
    g = {"tv": tv, "torch": torch, "outs": outs, "x": x, "gos": gos}
    # Alternate the two twice and keep each one's best median, to damp drift on a busy box.
    ref, ours = [], []
    for _ in range(2):
        ref.append(_median("torch.autograd.grad(outs, x, gos, retain_graph=True)", "", g,
                           min_run_time))
        ours.append(_median("tv.grad(outs, x, gos, retain_graph=True)", "", g, min_run_time))
    return {"case": "grad, 10 outputs of 64 elements", "reference": "torch.autograd.grad",
            "reference_s": min(ref), "torch_vjp_s": min(ours), "ratio": min(ours) / min(ref),
            "target": 1.05}


def bench_step_checked(min_run_time: float) -> dict:
    import torch_vjp as tv

    ref, ours = [], []
    for _ in range(2):
        ref.append(_median("step()", STEP_SETUP, None, min_run_time))
        ours.append(_median("with tv.checked():\n    step()", STEP_SETUP + "import torch_vjp as tv\n",
                            None, min_run_time))
    return {"case": "MLP 64-128-10 training step, batch 32, inside tv.checked()",
            "reference": "the same step, plain", "reference_s": min(ref),
            "torch_vjp_s": min(ours), "ratio": min(ours) / min(ref), "target": 1.10}


def bench_step_custom(min_run_time: float) -> dict:
    ref, ours = [], []
    for _ in range(2):
        ref.append(_median("step()", CUSTOM_STEP_SETUP, None, min_run_time))
        ours.append(_median("with tv.checked():\n    step()",
                            CUSTOM_STEP_SETUP + "import torch_vjp as tv\n", None, min_run_time))
    return {"case": "the same step, first layer a custom autograd.Function, inside tv.checked()",
            "reference": "the same step, plain", "reference_s": min(ref),
            "torch_vjp_s": min(ours), "ratio": min(ours) / min(ref), "target": 1.10}


def bench_step_env(min_run_time: float) -> dict:
    code = f"""
import json, torch, torch.utils.benchmark as tb
torch.set_num_threads({torch.get_num_threads()})
import torch_vjp
from torch_vjp import autograd
assert autograd.is_checked(), "TORCH_VJP_CHECKED=1 did not switch checking on"
setup = {STEP_SETUP!r}
def med():
    return tb.Timer("step()", setup=setup).blocked_autorange(min_run_time={min_run_time}).median
checked, plain = [], []
for _ in range(2):
    autograd._install(); checked.append(med())
    autograd._uninstall(); plain.append(med())
print(json.dumps({{"checked": min(checked), "plain": min(plain)}}))
"""
    env = dict(os.environ, TORCH_VJP_CHECKED="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"case": "MLP 64-128-10 training step, batch 32, TORCH_VJP_CHECKED=1",
            "reference": "the same step, plain (same process)", "reference_s": r["plain"],
            "torch_vjp_s": r["checked"], "ratio": r["checked"] / r["plain"], "target": 1.10}


def environment() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "cpu": cpu, "device": "cpu"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-run-time", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [bench_grad(args.min_run_time), bench_step_checked(args.min_run_time),
            bench_step_env(args.min_run_time), bench_step_custom(args.min_run_time)]
    result = {"environment": environment(), "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "checks_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Checking overhead",
        "",
        f"torch {result['environment']['torch']}, Python {result['environment']['python']}, "
        f"{result['environment']['threads']} threads, {result['environment']['cpu']}.",
        "Medians of `torch.utils.benchmark.Timer.blocked_autorange`, ratio = torch_vjp / reference.",
        "",
        "| case | reference | reference (us) | torch_vjp (us) | ratio | target |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ok = "yes" if r["ratio"] <= r["target"] else "NO"
        lines.append(f"| {r['case']} | {r['reference']} | {r['reference_s'] * 1e6:.1f} | "
                     f"{r['torch_vjp_s'] * 1e6:.1f} | {r['ratio']:.3f} | <= {r['target']} ({ok}) |")
    (RESULTS / "checks_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
