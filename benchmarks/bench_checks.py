"""Overhead of checked autograd, measured in one run.

1. ``tv.grad`` vs ``torch.autograd.grad`` on a 10-output call (target ratio <= 1.05).
2. A small MLP training step (forward, ``loss.backward()``, SGD update) inside
   ``tv.checked()`` vs plain (target <= 1.10).
3. The same step in a fresh process with ``TORCH_VJP_CHECKED=1`` vs plain in that process
   (checks switched off there with ``torch_vjp._checked_mode._uninstall`` for the reference).
4. The step of 2. with its first layer a custom ``torch.autograd.Function`` (a linear layer
   with a hand-written backward), inside ``tv.checked()`` vs plain: checked mode checks what
   that backward returns on every call (target <= 1.10).

Each ratio is paired: ``--pairs`` pairs of ``torch.utils.benchmark.Timer.blocked_autorange``
medians of the reference and of torch_vjp, taken back to back with the order alternating
(the drift of a shared machine cancels within a pair); reported: the median of the pairs'
ratios and their interquartile range. Writes ``results/checks_overhead.json`` and
``.md`` next to this file (or into ``--out``).

Run: ``python benchmarks/bench_checks.py [--pairs 41] [--pair-time 0.05] [--out DIR]``
(about a minute and a half).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.utils.benchmark as tb

from torch_vjp._measure import cpu_model, summarize_times

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


def _paired(ref: "tb.Timer", ours: "tb.Timer", pairs: int, pair_time: float) -> dict:
    """``pairs`` pairs of ``blocked_autorange`` medians taken back to back, the order
    alternating; the ratio of each pair (drift of a shared machine cancels within a pair).
    Returns the medians of both and the ratios' median and quartiles."""
    refs, mine, ratios = [], [], []
    for k in range(pairs):
        order = (ref, ours) if k % 2 == 0 else (ours, ref)
        t = {id(timer): timer.blocked_autorange(min_run_time=pair_time).median
             for timer in order}
        refs.append(t[id(ref)])
        mine.append(t[id(ours)])
        ratios.append(t[id(ours)] / t[id(ref)])
    t = summarize_times([ratios])
    return {"reference_s": statistics.median(refs), "torch_vjp_s": statistics.median(mine),
            "ratio": t.median, "ratio_q1": t.q1, "ratio_q3": t.q3, "pairs": pairs}


def _timer(stmt: str, setup: str = "", globals_: dict | None = None) -> "tb.Timer":
    return tb.Timer(stmt, setup=setup, globals=globals_ or {},
                    num_threads=torch.get_num_threads())


def bench_grad(pairs: int, pair_time: float) -> dict:
    import torch_vjp as tv

    x = torch.randn(64, requires_grad=True)
    outs = [torch.tanh(x * (i + 1)) for i in range(10)]
    gos = [torch.randn(64) for _ in range(10)]
    g = {"tv": tv, "torch": torch, "outs": outs, "x": x, "gos": gos}
    row = _paired(_timer("torch.autograd.grad(outs, x, gos, retain_graph=True)", "", g),
                  _timer("tv.grad(outs, x, gos, retain_graph=True)", "", g), pairs, pair_time)
    return {"case": "grad, 10 outputs of 64 elements", "reference": "torch.autograd.grad",
            **row, "target": 1.05}


def bench_step_checked(pairs: int, pair_time: float) -> dict:
    row = _paired(_timer("step()", STEP_SETUP),
                  _timer("with tv.checked():\n    step()", STEP_SETUP + "import torch_vjp as tv\n"),
                  pairs, pair_time)
    return {"case": "MLP 64-128-10 training step, batch 32, inside tv.checked()",
            "reference": "the same step, plain", **row, "target": 1.10}


def bench_step_custom(pairs: int, pair_time: float) -> dict:
    row = _paired(_timer("step()", CUSTOM_STEP_SETUP),
                  _timer("with tv.checked():\n    step()",
                         CUSTOM_STEP_SETUP + "import torch_vjp as tv\n"), pairs, pair_time)
    return {"case": "the same step, first layer a custom autograd.Function, inside tv.checked()",
            "reference": "the same step, plain", **row, "target": 1.10}


def bench_step_env(pairs: int, pair_time: float) -> dict:
    # In a fresh process with TORCH_VJP_CHECKED=1; the reference is the same step with the
    # checks uninstalled in that process, the two alternated in pairs.
    code = f"""
import json, statistics, torch, torch.utils.benchmark as tb
torch.set_num_threads({torch.get_num_threads()})
import torch_vjp
from torch_vjp import _checked_mode, autograd
assert autograd.is_checked(), "TORCH_VJP_CHECKED=1 did not switch checking on"
setup = {STEP_SETUP!r}
timer = tb.Timer("step()", setup=setup)
def med():
    return timer.blocked_autorange(min_run_time={pair_time}).median
checked, plain, ratios = [], [], []
for k in range({pairs}):
    t = {{}}
    for arm in (("checked", "plain") if k % 2 == 0 else ("plain", "checked")):
        (_checked_mode._install if arm == "checked" else _checked_mode._uninstall)()
        t[arm] = med()
    checked.append(t["checked"]); plain.append(t["plain"])
    ratios.append(t["checked"] / t["plain"])
print(json.dumps({{"checked": checked, "plain": plain, "ratios": ratios}}))
"""
    env = dict(os.environ, TORCH_VJP_CHECKED="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    t = summarize_times([r["ratios"]])
    q1, med, q3 = t.q1, t.median, t.q3
    return {"case": "MLP 64-128-10 training step, batch 32, TORCH_VJP_CHECKED=1",
            "reference": "the same step, plain (same process)",
            "reference_s": statistics.median(r["plain"]),
            "torch_vjp_s": statistics.median(r["checked"]), "ratio": med, "ratio_q1": q1,
            "ratio_q3": q3, "pairs": pairs, "target": 1.10}


def environment() -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "cpu": cpu_model(), "device": "cpu"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=41)
    parser.add_argument("--pair-time", type=float, default=0.05,
                        help="min_run_time of each blocked_autorange in a pair (seconds)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="folder for checks_overhead.json/.md (default: results/)")
    args = parser.parse_args()
    out = args.out
    torch.set_num_threads(args.threads)
    rows = [f(args.pairs, args.pair_time)
            for f in (bench_grad, bench_step_checked, bench_step_env, bench_step_custom)]
    result = {"environment": environment(), "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "checks_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Checking overhead",
        "",
        f"torch {result['environment']['torch']}, Python {result['environment']['python']}, "
        f"{result['environment']['threads']} threads, {result['environment']['cpu']}.",
        f"Ratio = torch_vjp / reference: the median over {args.pairs} pairs, each pair both "
        f"medians of `torch.utils.benchmark.Timer.blocked_autorange(min_run_time="
        f"{args.pair_time})` taken back to back, the order alternating; IQR over the pairs. "
        f"Times: medians over the pairs.",
        "",
        "| case | reference | reference (us) | torch_vjp (us) | ratio | IQR | target |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        ok = "yes" if r["ratio"] <= r["target"] else "NO"
        lines.append(f"| {r['case']} | {r['reference']} | {r['reference_s'] * 1e6:.1f} | "
                     f"{r['torch_vjp_s'] * 1e6:.1f} | {r['ratio']:.3f} | "
                     f"{r['ratio_q1']:.3f}-{r['ratio_q3']:.3f} | <= {r['target']} ({ok}) |")
    (out / "checks_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
