"""Per-sample gradients, their norms and the DP-SGD clipped sum: torch_vjp against its peers.

Workloads (float32, cross-entropy, 2 threads):

- ``mlp_b64`` / ``mlp_b256``: MLP 784-512-512-10 at batch 64 and 256;
- ``cnn_b64``: conv 1->16 k5, maxpool, conv 16->32 k5, maxpool, linear 512->10 on 1x28x28, B=64;
- ``transformer_b32``: Embedding(1000, 128) + TransformerEncoderLayer(128, 4 heads, ff 256,
  dropout 0, batch_first) + mean-pool + Linear(128, 10), sequence length 32, B=32.

Methods, in three groups:

- per-sample gradients: ``torch_vjp.per_sample_grads(strategy="auto")``; the torch.func recipe
  ``vmap(grad(functional_call))``; Opacus ``GradSampleModule`` in modes hooks, functorch and ew;
  BackPACK ``BatchGrad``; the naive per-example loop;
- norms only: ``torch_vjp.per_sample_grad_norms``; Opacus ghost clipping's first pass
  (``GradSampleModuleFastGradientClipping``, norms); BackPACK ``BatchL2Grad``;
- clipped sum: ``torch_vjp.accumulate_clipped_grads``; Opacus ghost clipping's step
  (``DPLossFastGradientClipping``: two backward passes).

Every method is first checked against the per-example loop in float64 (max abs error over
all parameters relative to the largest reference entry; must be below 2e-3); a method that
raises or disagrees is recorded with its error and not timed. Times are medians of
``torch.utils.benchmark.Timer.blocked_autorange``. In each of ``--rounds`` rounds every method
is timed right after one plain forward+backward of the same batch, and its ratio is taken to
that neighbour; the table gives the medians over rounds of the time and of the ratio. Peak memory is
measured per method in a fresh subprocess, two ways: the rise of the peak resident set
(VmHWM, reset through /proc/self/clear_refs where the kernel allows) over the resident set
after setup, for the first call; and, on a second call, the peak of live tensor bytes
created during the call (``torch_vjp.compare``'s TorchDispatchMode counter; torch_vjp's
kept buffers released first). The "no B x P buffer" targets are judged on the second: the
resident set moves by a few MB between runs (the allocator, one-time costs), which on the
CNN is as large as B x P itself. Peers are optional imports; a missing one is listed with
the reason.

Writes ``results/per_sample.json`` and ``results/per_sample.md`` next to this file.

Run: ``python benchmarks/bench_per_sample.py`` (about 6 minutes on 2 idle cores), or
``python benchmarks/bench_per_sample.py --quick`` for a smoke run (short timings, no memory
subprocesses, nothing written unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.benchmark as tb
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"
THREADS = 2
CHECK_TOL = 2e-3

warnings.filterwarnings("ignore", message=".*performance drop because we have not yet implemented.*")
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")


# ============================================================================================
# Workloads
# ============================================================================================


class TransformerClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 128)
        self.enc = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
        self.fc = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc(self.enc(self.emb(x)).mean(1))


def _mlp():
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(512, 10),
    )


WORKLOADS: dict[str, dict[str, Any]] = {
    "mlp_b64": dict(model=_mlp, batch=64, input=lambda B: torch.randn(B, 784),
                    text="MLP 784-512-512-10, B=64"),
    "mlp_b256": dict(model=_mlp, batch=256, input=lambda B: torch.randn(B, 784),
                     text="MLP 784-512-512-10, B=256"),
    "cnn_b64": dict(model=_cnn, batch=64, input=lambda B: torch.randn(B, 1, 28, 28),
                    text="CNN conv16-conv32-linear on 1x28x28, B=64"),
    "transformer_b32": dict(model=TransformerClassifier, batch=32,
                            input=lambda B: torch.randint(0, 1000, (B, 32)),
                            text="Embedding + TransformerEncoderLayer(128, 4 heads) + Linear, seq 32, B=32"),
}


def build(workload: str, dtype=torch.float32):
    w = WORKLOADS[workload]
    torch.manual_seed(0)
    model = w["model"]().to(dtype).train()
    x = w["input"](w["batch"])
    if x.is_floating_point():
        x = x.to(dtype)
    y = torch.randint(0, 10, (w["batch"],))
    return model, nn.CrossEntropyLoss(), x, y


# ============================================================================================
# Methods: each makes (step, result) from a fresh model copy; result() returns what the
# check compares: {"grads": {name: (B, ...)}} or {"norms": (B,)} or {"clipped": {name: grad}}
# ============================================================================================

MAX_NORM = 1.0


def _clear(model):
    for p in model.parameters():
        p.grad = None


def m_plain(model, loss_fn, x, y):
    def step():
        _clear(model)
        loss_fn(model(x), y).backward()

    return step, None


def m_tv_grads(model, loss_fn, x, y):
    from torch_vjp.per_sample import per_sample_grads

    def step():
        return per_sample_grads(model, loss_fn, x, y, strategy="auto")

    return step, lambda: {"grads": step()}


def m_tv_norms(model, loss_fn, x, y):
    from torch_vjp.per_sample import per_sample_grad_norms

    def step():
        return per_sample_grad_norms(model, loss_fn, x, y)

    return step, lambda: {"norms": step()}


def m_tv_clip(model, loss_fn, x, y):
    from torch_vjp.per_sample import accumulate_clipped_grads

    def step():
        _clear(model)
        return accumulate_clipped_grads(model, loss_fn, x, y, max_norm=MAX_NORM)

    def result():
        step()
        return {"clipped": {n: p.grad.clone() for n, p in model.named_parameters()}}

    return step, result


def m_torch_func(model, loss_fn, x, y):
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss_one(p, b, xi, yi):
        out = functional_call(model, (p, b), (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    f = vmap(grad(loss_one), in_dims=(None, None, 0, 0))

    def step():
        return f(params, buffers, x, y)

    return step, lambda: {"grads": step()}


def m_loop(model, loss_fn, x, y):
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]

    def step():
        rows = []
        for i in range(x.shape[0]):
            rows.append(torch.autograd.grad(loss_fn(model(x[i : i + 1]), y[i : i + 1]), params))
        return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(names)}

    return step, lambda: {"grads": step()}


def _opacus_mode(mode: str):
    def make(model, loss_fn, x, y):
        from opacus.grad_sample.utils import wrap_model

        gsm = wrap_model(model, grad_sample_mode=mode, loss_reduction="mean", batch_first=True)

        def step():
            gsm.zero_grad(set_to_none=True)
            loss_fn(gsm(x), y).backward()

        def result():
            step()
            out = {}
            for n, p in model.named_parameters():
                gs = getattr(p, "grad_sample", None)
                if gs is None:
                    raise RuntimeError(f"no grad_sample for {n}")
                out[n] = gs
            return {"grads": out}

        return step, result

    return make


def m_opacus_ghost_norms(model, loss_fn, x, y):
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(
        model, max_grad_norm=MAX_NORM, use_ghost_clipping=True, loss_reduction="mean"
    )

    def step():
        gsm.zero_grad(set_to_none=True)
        loss_fn(gsm(x), y).backward()
        return gsm.get_norm_sample()

    return step, lambda: {"norms": step()}


def m_opacus_ghost_clip(model, loss_fn, x, y):
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(
        model, max_grad_norm=MAX_NORM, use_ghost_clipping=True, loss_reduction="mean"
    )
    opt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=MAX_NORM,
        expected_batch_size=x.shape[0], loss_reduction="mean",
    )
    crit = DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss(), loss_reduction="mean")

    def step():
        opt.zero_grad(set_to_none=True)
        crit(gsm(x), y).backward()

    def result():
        step()
        return {"clipped": {n: p.grad.clone() for n, p in model.named_parameters()}}

    return step, result


def m_backpack(extension: str):
    def make(model, loss_fn, x, y):
        from backpack import backpack, extend
        from backpack import extensions as ext

        emodel = extend(model)
        eloss = extend(nn.CrossEntropyLoss())
        B = x.shape[0]
        quantity = getattr(ext, extension)()

        def step():
            _clear(emodel)
            with backpack(quantity):
                eloss(emodel(x), y).backward()

        def result():
            step()
            if extension == "BatchGrad":
                out = {}
                for n, p in emodel.named_parameters():
                    gb = getattr(p, "grad_batch", None)
                    if gb is None:
                        raise RuntimeError(f"no grad_batch for {n} (BackPACK skipped its module)")
                    out[n] = gb * B  # BackPACK scales by 1/B for a mean-reduced loss
                return {"grads": out}
            sq = 0
            for n, p in emodel.named_parameters():
                l2 = getattr(p, "batch_l2", None)
                if l2 is None:
                    raise RuntimeError(f"no batch_l2 for {n} (BackPACK skipped its module)")
                sq = sq + l2
            return {"norms": sq.sqrt() * B}

        return step, result

    return make


# group -> [(label, factory, peer package or None)]
METHODS: dict[str, list[tuple[str, Callable, str | None]]] = {
    "per-sample gradients": [
        ("torch_vjp per_sample_grads (auto)", m_tv_grads, None),
        ("torch.func recipe vmap(grad)", m_torch_func, None),
        ("Opacus hooks", _opacus_mode("hooks"), "opacus"),
        ("Opacus functorch", _opacus_mode("functorch"), "opacus"),
        ("Opacus ew", _opacus_mode("ew"), "opacus"),
        ("BackPACK BatchGrad", m_backpack("BatchGrad"), "backpack"),
        ("naive loop", m_loop, None),
    ],
    "norms only": [
        ("torch_vjp per_sample_grad_norms", m_tv_norms, None),
        ("Opacus ghost (norms pass)", m_opacus_ghost_norms, "opacus"),
        ("BackPACK BatchL2Grad", m_backpack("BatchL2Grad"), "backpack"),
    ],
    "clipped sum": [
        ("torch_vjp accumulate_clipped_grads", m_tv_clip, None),
        ("Opacus ghost clipping step", m_opacus_ghost_clip, "opacus"),
    ],
}
OURS = {
    "per-sample gradients": "torch_vjp per_sample_grads (auto)",
    "norms only": "torch_vjp per_sample_grad_norms",
    "clipped sum": "torch_vjp accumulate_clipped_grads",
}


def find_method(label: str) -> Callable:
    if label == "plain forward+backward":
        return m_plain
    for entries in METHODS.values():
        for name, make, _ in entries:
            if name == label:
                return make
    raise KeyError(label)


# ============================================================================================
# Reference and check
# ============================================================================================


def reference(workload: str) -> dict[str, Any]:
    """Per-example gradients by the loop in float64, their norms and the clipped sum."""
    model, loss_fn, x, y = build(workload, torch.float64)
    grads = m_loop(model, loss_fn, x, y)[1]()["grads"]
    norms = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    c = (MAX_NORM / norms).clamp(max=1.0)
    clipped = {n: torch.einsum("b,b...->...", c, g) for n, g in grads.items()}
    return {"grads": grads, "norms": norms, "clipped": clipped}


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.detach().to(torch.float64).reshape(ref.shape)
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def check(result: dict[str, Any], ref: dict[str, Any]) -> float:
    """Largest relative error of a method's result against the reference (raises if malformed)."""
    (kind, got), = result.items()
    if kind == "norms":
        return _rel_err(got, ref["norms"])
    missing = [n for n in ref[kind] if n not in got]
    if missing:
        raise RuntimeError(f"no result for {len(missing)} parameter(s): {', '.join(missing[:4])}")
    return max(_rel_err(got[n], ref[kind][n]) for n in ref[kind])


# ============================================================================================
# Timing and memory
# ============================================================================================


def peer_status() -> dict[str, str]:
    """Version of each optional peer, or ``"unavailable: <why>"``."""
    from importlib import metadata

    status = {}
    for pkg, dist in (("opacus", "opacus"), ("backpack", "backpack-for-pytorch")):
        try:
            mod = __import__(pkg)
            try:
                status[pkg] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                status[pkg] = getattr(mod, "__version__", "installed")
        except Exception as exc:  # noqa: BLE001 - report any import failure
            status[pkg] = f"unavailable: {type(exc).__name__}: {exc}"
    return status


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def memory_child(workload: str, label: str) -> None:
    """Runs in a fresh process: prints the peak resident-set rise of one call, in bytes."""
    torch.set_num_threads(THREADS)
    model, loss_fn, x, y = build(workload)
    step, _ = find_method(label)(model, loss_fn, x, y)
    gc.collect()
    reset = False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        pass
    base = _vm("VmRSS") if reset else _vm("VmHWM")
    out = step()
    peak = _vm("VmHWM")
    del out
    # Second figure, on a second call: the peak of live tensor bytes created during the
    # call (torch_vjp.compare's TorchDispatchMode counter), free of the allocator's and the
    # first call's one-time costs. Buffers torch_vjp keeps between calls are released
    # first, so that they are counted as new.
    from torch_vjp.compare import _LiveTensorBytes
    from torch_vjp.per_sample import release_cached_buffers

    gc.collect()
    release_cached_buffers()
    mode = _LiveTensorBytes()
    with mode:
        out = step()
    del out
    print(json.dumps({"peak_bytes": max(0, peak - base), "hwm_reset": reset,
                      "tensor_peak_bytes": mode.peak}))


def measure_memory(workload: str, label: str) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--threads", str(THREADS),
           "--memory-child", workload, label]
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        if proc.returncode != 0 or not line.startswith("{"):
            return {"peak_mb": None, "memory_error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
        data = json.loads(line)
        return {"peak_mb": data["peak_bytes"] / 2**20, "hwm_reset": data["hwm_reset"],
                "tensor_peak_mb": data["tensor_peak_bytes"] / 2**20}
    except Exception as exc:  # noqa: BLE001
        return {"peak_mb": None, "memory_error": f"{type(exc).__name__}: {exc}"}


TIMERS = {"wall": time.perf_counter, "process": time.process_time}


def median_time(step: Callable, min_run_time: float, timer: str = "wall") -> float:
    t = tb.Timer("step()", globals={"step": step}, num_threads=THREADS, timer=TIMERS[timer])
    return t.blocked_autorange(min_run_time=min_run_time).median


def run_workload(workload: str, args, peers: dict[str, str]) -> dict[str, Any]:
    print(f"\n== {workload}: {WORKLOADS[workload]['text']}", flush=True)
    ref = reference(workload)
    model0, loss_fn, x, y = build(workload)
    n_params = sum(p.numel() for p in model0.parameters())
    B = x.shape[0]
    rows: list[dict[str, Any]] = []
    steps: dict[str, Callable] = {}
    plain_step, _ = m_plain(copy.deepcopy(model0), loss_fn, x, y)
    plain_step()
    steps["plain forward+backward"] = plain_step
    for group, entries in METHODS.items():
        for label, make, pkg in entries:
            row: dict[str, Any] = {"group": group, "method": label}
            rows.append(row)
            if pkg is not None and str(peers.get(pkg, "")).startswith("unavailable"):
                row.update(status="skipped", error=peers[pkg])
                continue
            try:
                model = copy.deepcopy(model0)
                step, result = make(model, loss_fn, x, y)
                err = check(result(), ref)
            except Exception as exc:  # noqa: BLE001 - a failing peer is a result
                msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                row.update(status="failed", error=msg[:300])
                print(f"  {label:40s} failed: {msg[:120]}", flush=True)
                if args.verbose:
                    traceback.print_exc()
                continue
            row["check_rel_err"] = err
            if not err <= CHECK_TOL:
                row.update(status="wrong", error=f"max relative error {err:.2e} against the loop")
                print(f"  {label:40s} WRONG: {err:.2e}", flush=True)
                continue
            row["status"] = "ok"
            steps[label] = step
    # Rounds: in each, every method is timed right after a plain forward+backward, and its
    # ratio is taken to that neighbour; the medians over rounds damp a busy machine's drift.
    plain_label = "plain forward+backward"
    plain_times: list[float] = []
    times: dict[str, list[float]] = {k: [] for k in steps if k != plain_label}
    ratios: dict[str, list[float]] = {k: [] for k in times}
    for _ in range(args.rounds):
        for label in times:
            budget = args.min_run_time
            if label == "naive loop":
                budget = min(budget, 0.5)
            tp = median_time(steps[plain_label], args.min_run_time / 2, args.timer)
            tm = median_time(steps[label], budget, args.timer)
            plain_times.append(tp)
            times[label].append(tm)
            ratios[label].append(tm / tp)
    plain = statistics.median(plain_times)
    out_plain = {"median_s": plain, "round_medians_s": plain_times}
    for row in rows:
        if row.get("status") == "ok":
            row["median_s"] = statistics.median(times[row["method"]])
            row["round_medians_s"] = times[row["method"]]
            row["round_ratios"] = ratios[row["method"]]
            row["ratio_to_plain"] = statistics.median(ratios[row["method"]])
            print(f"  {row['method']:40s} {row['median_s'] * 1e3:9.2f} ms  {row['ratio_to_plain']:7.2f}x", flush=True)
    if args.memory:
        out_plain.update(measure_memory(workload, "plain forward+backward"))
        for row in rows:
            if row.get("status") == "ok":
                row.update(measure_memory(workload, row["method"]))
    return {
        "description": WORKLOADS[workload]["text"],
        "batch": B,
        "parameters": n_params,
        "per_sample_fp32_mb": B * n_params * 4 / 2**20,
        "plain": out_plain,
        "methods": rows,
    }


# ============================================================================================
# Targets and report
# ============================================================================================


def _row(res, label):
    for r in res["methods"]:
        if r["method"] == label:
            return r
    return None


def _memory_target(add: Callable, name: str, wl: str, res: dict[str, Any], row: dict[str, Any]) -> None:
    """No B x P buffer: the peak of live tensor bytes rises over plain forward+backward's by
    less than B x P / 2 (the resident-set figures are given alongside)."""
    peak, plain = row.get("tensor_peak_mb"), res["plain"].get("tensor_peak_mb")
    if peak is None or plain is None:
        return
    bp = res["per_sample_fp32_mb"]
    extra = peak - plain
    rss, rss_plain = row.get("peak_mb"), res["plain"].get("peak_mb")
    rss_text = ("" if rss is None or rss_plain is None else
                f"; resident set {rss:.1f} MB, plain {rss_plain:.1f} MB ({rss - rss_plain:+.1f} MB)")
    add(f"{name}: no B x P buffer (tensor peak over plain < B x P / 2)", wl, extra,
        extra < bp / 2,
        f"tensor peak {peak:.1f} MB, plain {plain:.1f} MB ({extra:+.1f} MB); "
        f"B x P = {bp:.1f} MB{rss_text}")


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []

    def add(target, workload, value, met, detail):
        out.append({"target": target, "workload": workload, "value": value, "met": met, "detail": detail})

    for wl, res in results.items():
        ours = _row(res, OURS["per-sample gradients"])
        if ours is None or ours.get("status") != "ok":
            add("per_sample_grads(auto) runs", wl, None, False, ours.get("error") if ours else "missing")
            continue
        peers = [r for r in res["methods"] if r["group"] == "per-sample gradients"
                 and r["method"] != ours["method"] and r.get("status") == "ok"]
        # Methods are compared through their ratios to plain (each timed next to its own
        # plain neighbour), which a busy machine disturbs less than raw times.
        if peers:
            best = min(peers, key=lambda r: r["ratio_to_plain"])
            speed = ours["ratio_to_plain"] / best["ratio_to_plain"]
            if wl.startswith("mlp"):
                add("per_sample_grads(auto) faster than every peer", wl, speed, speed < 1.0,
                    f"{speed:.2f}x the time of the fastest peer ({best['method']})")
            else:
                add("per_sample_grads(auto) within 1.1x of the fastest peer", wl, speed, speed <= 1.1,
                    f"{speed:.2f}x the time of the fastest peer ({best['method']})")
        if wl.startswith("mlp"):
            add("per_sample_grads(auto) <= 10x plain", wl, ours["ratio_to_plain"],
                ours["ratio_to_plain"] <= 10, f"{ours['ratio_to_plain']:.2f}x plain")
        norms = _row(res, OURS["norms only"])
        if norms and norms.get("status") == "ok":
            if not wl.startswith("transformer"):
                add("per_sample_grad_norms <= 1.3x plain", wl, norms["ratio_to_plain"],
                    norms["ratio_to_plain"] <= 1.3, f"{norms['ratio_to_plain']:.2f}x plain")
            for peer in ("Opacus ghost (norms pass)", "BackPACK BatchL2Grad"):
                r = _row(res, peer)
                if r and r.get("status") == "ok":
                    s = norms["ratio_to_plain"] / r["ratio_to_plain"]
                    add(f"per_sample_grad_norms faster than {peer}", wl, s, s < 1.0, f"{s:.2f}x its time")
            _memory_target(add, "per_sample_grad_norms", wl, res, norms)
        clip = _row(res, OURS["clipped sum"])
        if clip and clip.get("status") == "ok":
            if wl.startswith("mlp"):
                add("accumulate_clipped_grads <= 2x plain", wl, clip["ratio_to_plain"],
                    clip["ratio_to_plain"] <= 2, f"{clip['ratio_to_plain']:.2f}x plain")
            r = _row(res, "Opacus ghost clipping step")
            if r and r.get("status") == "ok":
                s = clip["ratio_to_plain"] / r["ratio_to_plain"]
                add("accumulate_clipped_grads faster than Opacus ghost clipping", wl, s, s < 1.0,
                    f"{s:.2f}x its time")
            _memory_target(add, "accumulate_clipped_grads", wl, res, clip)
    return out


def environment(peers: dict[str, str]) -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch_vjp

        tv_version = torch_vjp.__version__
    except Exception:  # noqa: BLE001
        tv_version = "unknown"
    return {
        "torch": torch.__version__,
        "torch_vjp": tv_version,
        "opacus": peers.get("opacus"),
        "backpack": peers.get("backpack"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# Per-sample gradients: torch_vjp against Opacus, BackPACK and the torch.func recipe",
        "",
        f"torch {env['torch']}, torch_vjp {env['torch_vjp']}, Opacus {env['opacus']}, "
        f"BackPACK {env['backpack']}, Python {env['python']}; {env['cpu']} ({env['cpu_count']} cores), "
        f"{env['threads']} threads; {env['date']}."
        + ("" if report["settings"]["timer"] == "wall" else
           f" Times are this process's CPU time ({report['settings']['timer']} timer), "
           f"not wall-clock time."),
        "",
        "Ratios are to one plain forward+backward of the same batch, timed right before each "
        "method in each round (medians over rounds of `blocked_autorange` medians). Memory, "
        "in a fresh process per method: *peak RSS* is the rise of the peak resident set "
        "for the first call (it includes one-time costs and moves by a few MB between runs); "
        "*tensor peak* is, on a second call, the peak of live tensor bytes created during "
        "the call (counted by a TorchDispatchMode; exact, but blind to a kernel's internal "
        "scratch buffers). Every method was first checked against the per-example loop in "
        "float64 (relative error column).",
        "",
    ]
    lines += summary_table(report) + [""]
    for wl, res in report["workloads"].items():
        plain = res["plain"]
        pm = plain.get("peak_mb")
        lines += [
            f"## {res['description']}",
            "",
            f"{res['parameters']:,} parameters; B x P in float32 = {res['per_sample_fp32_mb']:.1f} MB. "
            f"Plain forward+backward: {plain['median_s'] * 1e3:.2f} ms"
            + (f", peak RSS {pm:.1f} MB" if pm is not None else "")
            + (f", tensor peak {plain['tensor_peak_mb']:.1f} MB."
               if plain.get("tensor_peak_mb") is not None else "."),
            "",
            "| group | method | time (ms) | x plain | peak RSS (MB) | tensor peak (MB) "
            "| check (rel. err) |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for r in res["methods"]:
            if r.get("status") == "ok":
                peak, tpeak = r.get("peak_mb"), r.get("tensor_peak_mb")
                lines.append(
                    f"| {r['group']} | {r['method']} | {r['median_s'] * 1e3:.2f} | "
                    f"{r['ratio_to_plain']:.2f} | {'' if peak is None else f'{peak:.1f}'} | "
                    f"{'' if tpeak is None else f'{tpeak:.1f}'} | "
                    f"ok ({r['check_rel_err']:.1e}) |"
                )
            else:
                err = str(r.get("error", "")).replace("|", "/")
                lines.append(f"| {r['group']} | {r['method']} | | | | | {r['status']}: {err} |")
        lines.append("")
    lines += ["## Targets", "", "| target | workload | result | met |", "|---|---|---|---|"]
    for t in report["targets"]:
        lines.append(f"| {t['target']} | {t['workload']} | {t['detail']} | {'yes' if t['met'] else 'NO'} |")
    lines.append("")
    return "\n".join(lines)


def summary_table(report: dict[str, Any]) -> list[str]:
    """One row per method, one column per workload: time as a multiple of plain fwd+bwd."""
    workloads = list(report["workloads"])
    labels = [label for entries in METHODS.values() for label, _, _ in entries]
    lines = [
        "## Summary: time per call as a multiple of one plain forward+backward",
        "",
        "| method | " + " | ".join(workloads) + " |",
        "|---|" + "---:|" * len(workloads),
    ]
    for label in labels:
        cells = []
        for wl in workloads:
            r = _row(report["workloads"][wl], label)
            if r is None:
                cells.append("")
            elif r.get("status") == "ok":
                cells.append(f"{r['ratio_to_plain']:.2f}")
            else:
                cells.append(r["status"])
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: short timings, no memory")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--min-run-time", type=float, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--memory", dest="memory", action="store_true", default=None)
    parser.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument("--out", type=Path, default=None, help="folder for per_sample.json/.md")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--threads", type=int, default=2,
                        help="intra-op threads (the reference setting is 2)")
    parser.add_argument("--timer", choices=list(TIMERS), default="wall",
                        help="wall clock (the reference), or this process's CPU time, which "
                             "a busy machine disturbs less (use with --threads 1)")
    parser.add_argument("--memory-child", nargs=2, metavar=("WORKLOAD", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global THREADS
    THREADS = args.threads
    torch.set_num_threads(THREADS)
    if args.memory_child:
        memory_child(*args.memory_child)
        return 0
    if args.min_run_time is None:
        args.min_run_time = 0.05 if args.quick else 0.5
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.memory is None:
        args.memory = not args.quick
    out_dir = args.out if args.out is not None else (None if args.quick else RESULTS)
    peers = peer_status()
    results = {wl: run_workload(wl, args, peers) for wl in args.workloads}
    report = {
        "environment": environment(peers),
        "settings": {"threads": THREADS, "timer": args.timer, "min_run_time_s": args.min_run_time,
                     "rounds": args.rounds,
                     "check_tolerance": CHECK_TOL, "max_norm": MAX_NORM, "memory": args.memory},
        "workloads": results,
    }
    report["targets"] = evaluate_targets(results)
    text = markdown(report)
    print("\n" + text)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "per_sample.json").write_text(json.dumps(report, indent=2) + "\n")
        (out_dir / "per_sample.md").write_text(text)
        print(f"wrote {out_dir / 'per_sample.json'} and {out_dir / 'per_sample.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
