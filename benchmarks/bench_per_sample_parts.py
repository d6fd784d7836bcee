"""The per-sample mechanisms whose speed the code and docs cite, each against what it
replaced, measured in one run, paired and alternated (median and IQR of per-pair ratios).

- ``huge_pages``: ``per_sample_grads`` (strategy ``hooks``) on ``mlp_b256`` with result
  buffers advised to use huge pages, against ``TORCH_VJP_HUGE_PAGES=0`` (NOTE [huge pages]
  in ``torch_vjp/_engine/memory.py``). The switch is read on every allocation, so the two
  arms alternate in one process.
- ``conv_chunks``: ``ConvFactor.write`` (per-sample weight gradients of one convolution,
  B = 16) in the norms' small chunks (as now) against chunks of the default budget (as
  before), on ResNet-sized layers.
- ``layer_norm_xhat``: the LayerNorm rule's normalised input from ``F.layer_norm`` without
  the affine map (as now) against ``var_mean`` (as before), on the transformer workload's
  LayerNorm input (32, 32, 128).
- ``ghost_check``: ``OuterFactor.sq_norms`` by the ghost-norm identity with its check for
  cancellation (NOTE [ghost norms, checked] in ``torch_vjp/_per_sample/factors.py``, as
  now) against the identity alone (as before), on ordinary random data of transformer
  shapes.
- ``kept_chunks``: the clipped step (``accumulate_clipped_grads``, ``auto``) on
  ``cnn_b64``, a convolution keeping its per-sample gradient chunks as formed (as now)
  against copying them into one new ``(B, *weight)`` buffer (as before).

- ``conv_norms``: a 2-D convolution's direct squared norms (``ConvFactor.sq_norms``) with
  the per-sample gradients from the channels-last patches and one batched product against
  one grouped convolution per chunk (NOTE [two ways to a convolution's per-sample
  gradients] in ``torch_vjp/_per_sample/rules/conv.py``), on cnn_b64's second convolution
  and on 3x3 layers; and ``per_sample_grad_norms`` / ``accumulate_clipped_grads`` on
  ``cnn_b64`` with the choice the measurement made (patches) against the grouped
  convolution. Both arms alternate in one process (the recorded choice is switched).

Run: ``python benchmarks/bench_per_sample_parts.py [--pairs 15] [--mechanisms NAMES]``.
Writes ``results/per_sample_parts.json`` and ``.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import torch_vjp as tv
from torch_vjp._per_sample.factors import CHUNK_ELEMENTS, NORM_CHUNK_ELEMENTS, chunks
from torch_vjp._per_sample.rules.conv import ConvFactor

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_per_sample import THREADS, _quartiles, build, paired_times  # noqa: E402

RESULTS = HERE / "results"
CONV_LAYERS = ((128, 16), (256, 8), (512, 4))  # (channels, spatial size), 3x3, padding 1


def _ratio(new, old, pairs: int) -> dict:
    a, b, n = paired_times(new, old, pairs)
    q1, med, q3 = _quartiles([x / y for x, y in zip(a, b)])
    return dict(new_ms=_quartiles(a)[1] * 1e3, old_ms=_quartiles(b)[1] * 1e3, ratio=med,
                q1=q1, q3=q3, calls_per_sample=n)


def huge_pages(pairs: int) -> dict:
    model, loss_fn, x, y = build("mlp_b256")

    def step(on: bool):
        def run():
            os.environ["TORCH_VJP_HUGE_PAGES"] = "1" if on else "0"
            tv.per_sample_grads(model, loss_fn, x, y, strategy="hooks")
        return run

    try:
        return dict(case="per_sample_grads(hooks), mlp_b256 (686 MB of results)",
                    **_ratio(step(True), step(False), pairs))
    finally:
        os.environ.pop("TORCH_VJP_HUGE_PAGES", None)


def conv_chunks(pairs: int) -> list[dict]:
    rows = []
    for c, s in CONV_LAYERS:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(16, c, s, s, generator=g)
        go = torch.randn(16, c, s, s, generator=g)
        f = ConvFactor(x, go, (c, c, 3, 3), (c, c, 3, 3), (1, 1), (1, 1), (1, 1), 1)
        out = torch.empty(16, c, c, 3, 3)

        def write(budget):
            def run():
                for a, e in chunks(16, c * c * 9, None, budget):
                    f.write_range(out[a:e], a, e, False)
            return run

        rows.append(dict(case=f"conv {c} channels, {s}x{s}, 3x3, B = 16",
                         **_ratio(write(NORM_CHUNK_ELEMENTS), write(CHUNK_ELEMENTS), pairs)))
    return rows


def layer_norm_xhat(pairs: int) -> dict:
    x = torch.randn(32, 32, 128, generator=torch.Generator().manual_seed(0))

    def new():
        F.layer_norm(x, x.shape[2:], eps=1e-5)

    def old():
        var, mean = torch.var_mean(x, dim=(2,), keepdim=True, unbiased=False)
        (x - mean) * torch.rsqrt(var + 1e-5)

    return dict(case="LayerNorm x_hat, (32, 32, 128)", **_ratio(new, old, pairs))


GHOST_SHAPES = ((32, 32, 128, 128), (8, 64, 256, 256), (16, 128, 768, 768))  # (B, T, p, q)


def ghost_check(pairs: int) -> list[dict]:
    from torch_vjp._per_sample import factors

    checked = factors.ghost_unsure

    def unchecked(sq, products, width):
        return sq.new_zeros(0, dtype=torch.long)

    rows = []
    gen = torch.Generator().manual_seed(0)
    for B, T, p, q in GHOST_SHAPES:
        f = factors.OuterFactor(torch.randn(B, T, p, generator=gen),
                                torch.randn(B, T, q, generator=gen), (q, p))
        assert f.use_ghost()

        def new(f=f):
            factors.ghost_unsure = checked
            f.sq_norms(None)

        def old(f=f):
            factors.ghost_unsure = unchecked
            try:
                f.sq_norms(None)
            finally:
                factors.ghost_unsure = checked

        rows.append(dict(case=f"ghost norms, B={B} T={T} p={p} q={q}", **_ratio(new, old, pairs)))
    return rows


def kept_chunks(pairs: int) -> dict:
    from torch_vjp._per_sample.factors import sq_norms_rows

    model, loss_fn, x, y = build("cnn_b64")
    kept_now = ConvFactor.sq_norms

    def copied(self, chunk_size, keep=None):  # (as before: one buffer, the chunks copied in)
        if self._ghost_cheaper():
            return kept_now(self, chunk_size, keep)
        out = self.x.new_zeros(self.batch)
        kept = keep.buffer(self.batch, self.weight_shape, self.x) if keep is not None else None
        for a, e in chunks(self.batch, self._per_example(), chunk_size, NORM_CHUNK_ELEMENTS):
            per_sample = self._per_sample(a, e)
            out[a:e] = sq_norms_rows(per_sample)
            if kept is not None:
                kept[a:e] = per_sample
        self.kept = kept
        return out

    def step(sq_norms):
        def run():
            ConvFactor.sq_norms = sq_norms
            try:
                model.zero_grad(set_to_none=True)
                tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=1.0)
            finally:
                ConvFactor.sq_norms = kept_now
        return run

    return dict(case="accumulate_clipped_grads(auto), cnn_b64",
                **_ratio(step(kept_now), step(copied), pairs))


CONV_NORM_LAYERS = (  # (B, C, spatial size, O, kernel, padding)
    (64, 16, 12, 32, 5, 0), (64, 8, 14, 16, 3, 1), (64, 32, 16, 32, 3, 1),
    (16, 64, 32, 64, 3, 1), (16, 128, 16, 128, 3, 1),
)


def conv_norms(pairs: int) -> list[dict]:
    from torch_vjp._per_sample.rules import conv

    def forced(f, key, patches):
        def run():
            conv.PATCHES_FASTER[key] = patches
            f.sq_norms(None)
        return run

    rows = []
    gen = torch.Generator().manual_seed(0)
    for B, C, S, O, k, pad in CONV_NORM_LAYERS:
        x = torch.randn(B, C, S, S, generator=gen)
        L = S + 2 * pad - k + 1
        f = ConvFactor(x, torch.randn(B, O, L, L, generator=gen), (O, C, k, k), (O, C, k, k),
                       (1, 1), (pad, pad), (1, 1), 1)
        key = f._patches_key(None)
        assert key is not None and not f._ghost_cheaper()
        rows.append(dict(case=f"norms of conv {C}->{O}, {k}x{k}, {S}x{S}, B = {B}",
                         **_ratio(forced(f, key, True), forced(f, key, False), pairs)))
    model, loss_fn, x, y = build("cnn_b64")
    for name, fn in (("per_sample_grad_norms", tv.per_sample_grad_norms),
                     ("accumulate_clipped_grads", tv.accumulate_clipped_grads)):
        kwargs = {"max_norm": 1.0} if name == "accumulate_clipped_grads" else {}
        conv.PATCHES_FASTER.clear()
        for _ in range(conv._PATCHES_CALLS):  # (measure and record the choice)
            fn(model, loss_fn, x, y, **kwargs)
        keys = list(conv.PATCHES_FASTER)

        def step(patches, fn=fn, kwargs=kwargs, keys=keys):
            def run():
                conv.PATCHES_FASTER.update(dict.fromkeys(keys, patches))
                model.zero_grad(set_to_none=True)
                fn(model, loss_fn, x, y, **kwargs)
            return run

        chosen = ", ".join(str(v) for v in conv.PATCHES_FASTER.values())
        rows.append(dict(case=f"{name}(auto), cnn_b64 (patches chosen: {chosen})",
                         **_ratio(step(True), step(False), pairs)))
    return rows


def markdown(rows: list[dict], env: dict) -> str:
    lines = [
        "# Per-sample mechanisms, each against what it replaced",
        "",
        f"torch {env['torch']}, Python {env['python']}; {env['threads']} threads, float32; "
        f"{env['pairs']} paired, alternated samples per row; {env['date']}.",
        "",
        "*ratio*: the new mechanism's time / the old one's, median of the per-pair ratios "
        "(IQR); below 1 is faster. Made by `python benchmarks/bench_per_sample_parts.py`.",
        "",
        "| mechanism | case | new | old | ratio | IQR |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['mechanism']} | {r['case']} | {r['new_ms']:.2f} ms | "
                     f"{r['old_ms']:.2f} ms | {r['ratio']:.2f} | {r['q1']:.2f}-{r['q3']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--out", type=Path, default=RESULTS / "per_sample_parts")
    parser.add_argument("--mechanisms", default="huge_pages,conv_chunks,layer_norm_xhat,"
                        "ghost_check,kept_chunks,conv_norms",
                        help="comma-separated names of the rows to measure")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    wanted = set(args.mechanisms.split(","))
    rows = []
    if "huge_pages" in wanted:
        rows.append(dict(mechanism="huge_pages", **huge_pages(args.pairs)))
    if "conv_chunks" in wanted:
        rows += [dict(mechanism="conv_chunks", **r) for r in conv_chunks(args.pairs)]
    if "layer_norm_xhat" in wanted:
        rows.append(dict(mechanism="layer_norm_xhat", **layer_norm_xhat(args.pairs)))
    if "ghost_check" in wanted:
        rows += [dict(mechanism="ghost_check", **r) for r in ghost_check(args.pairs)]
    if "kept_chunks" in wanted:
        rows.append(dict(mechanism="kept_chunks", **kept_chunks(args.pairs)))
    if "conv_norms" in wanted:
        rows += [dict(mechanism="conv_norms", **r) for r in conv_norms(args.pairs)]
    env = dict(torch=torch.__version__, python=platform.python_version(), threads=THREADS,
               pairs=args.pairs,
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(dict(environment=env, rows=rows),
                                                        indent=1))
    args.out.with_suffix(".md").write_text(markdown(rows, env))
    print(markdown(rows, env))


if __name__ == "__main__":
    main()
