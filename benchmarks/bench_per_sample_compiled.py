"""The per-sample functions with ``compile=True`` against the same calls eagerly (strategy
``auto``), on the workloads of ``bench_per_sample.py``.

Per workload and function: the compiled call's first call (one eager call, compiling, one
compiled call), and the steady-state time as a ratio to the eager call, in paired,
alternated samples (median and IQR of the per-pair ratios). A signature that cannot be
compiled runs eagerly (with a JacobianWarning): its row says so and why.

Run: ``python benchmarks/bench_per_sample_compiled.py [--pairs 21] [--only mlp_b64,...]``.
Writes ``results/per_sample_compiled.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import torch_vjp as tv

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_per_sample import MAX_NORM, THREADS, WORKLOADS, build, paired_times  # noqa: E402

RESULTS = HERE / "results"
DEFAULT = ("mlp_b64", "mlp_b256", "cnn_b64", "transformer_b32")
FUNCTIONS = ("per_sample_grads", "per_sample_grad_norms", "accumulate_clipped_grads")


def _call(name: str, model, loss_fn, x, y, compile: bool):
    if name == "accumulate_clipped_grads":
        def step():
            for p in model.parameters():
                p.grad = None
            return tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=MAX_NORM,
                                               compile=compile)
    else:
        fn = getattr(tv, name)

        def step():
            return fn(model, loss_fn, x, y, compile=compile)
    return step


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def run(workload: str, name: str, pairs: int) -> dict:
    model, loss_fn, x, y = build(workload)
    eager = _call(name, model, loss_fn, x, y, compile=False)
    compiled = _call(name, model, loss_fn, x, y, compile=True)
    eager()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tv.JacobianWarning)
        start = time.perf_counter()
        compiled()
        first = time.perf_counter() - start
    fell_back = [str(w.message).split("\n")[1].strip() for w in caught
                 if "could not compile" in str(w.message)]
    a, b, n = paired_times(compiled, eager, pairs)
    ratios = [x / y for x, y in zip(a, b)]
    q1, med, q3 = _quartiles(ratios)
    return dict(workload=workload, function=name, first_call_s=first,
                compiled_s=statistics.median(a), eager_s=statistics.median(b),
                ratio=med, ratio_q1=q1, ratio_q3=q3, pairs=pairs, calls_per_sample=n,
                eager_fallback=fell_back[0] if fell_back else None)


def markdown(rows: list[dict], env: dict) -> str:
    out = ["# Per-sample functions: compile=True against eager", "",
           f"torch {env['torch']}, Python {env['python']}; cpu, {env['threads']} threads, "
           f"float32; {env['pairs']} paired, alternated samples per row; {env['date']}.", "",
           "*ratio*: compiled time / eager time (strategy `auto`), the median of the per-pair "
           "ratios, with their IQR; *first call*: the compiled call's first call (one eager "
           "call, compiling, one compiled call), with an empty inductor cache for the first "
           "program of the run.", "",
           "| workload | function | eager | compiled | ratio | IQR | first call | note |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = f"runs eagerly: {r['eager_fallback']}" if r["eager_fallback"] else ""
        out.append(f"| {r['workload']} | {r['function']} | {r['eager_s'] * 1e3:.3g} ms | "
                   f"{r['compiled_s'] * 1e3:.3g} ms | {r['ratio']:.2f} | "
                   f"{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f} | {r['first_call_s']:.2f} s | "
                   f"{note} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=21)
    parser.add_argument("--only", default=",".join(DEFAULT))
    parser.add_argument("--out", default=str(RESULTS / "per_sample_compiled"))
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    warnings.filterwarnings("ignore", category=FutureWarning)
    rows = []
    for workload in args.only.split(","):
        if workload not in WORKLOADS:
            raise SystemExit(f"unknown workload {workload!r}")
        for name in FUNCTIONS:
            row = run(workload, name, args.pairs)
            rows.append(row)
            print(f"{workload:16s} {name:26s} ratio {row['ratio']:.2f} "
                  f"({row['ratio_q1']:.2f}-{row['ratio_q3']:.2f}) first {row['first_call_s']:.2f}"
                  f" s {'EAGER: ' + row['eager_fallback'] if row['eager_fallback'] else ''}",
                  flush=True)
    env = dict(torch=torch.__version__, python=platform.python_version(), threads=THREADS,
               pairs=args.pairs,
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
    out.with_suffix(".md").write_text(markdown(rows, env))
    print(f"results: {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
