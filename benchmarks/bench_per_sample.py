"""Per-sample gradients, their norms and the DP-SGD clipped sum: torch_vjp against its peers.

Workloads (float32, cross-entropy, random weights, 2 threads; ``<model>_b<B>`` names the
batch size B):

- ``mlp_b64`` / ``mlp_b256``: MLP 784-512-512-10 at batch 64 and 256;
- ``cnn_b64``: conv 1->16 k5, maxpool, conv 16->32 k5, maxpool, linear 512->10 on 1x28x28, B=64;
- ``transformer_b32``: Embedding(1000, 128) + TransformerEncoderLayer(128, 4 heads, ff 256,
  dropout 0, batch_first) + mean-pool + Linear(128, 10), sequence length 32, B=32;
- ``gpt2_b8``: ``transformers.GPT2LMHeadModel`` from a ``GPT2Config`` (4 layers, n_embd 256,
  4 heads, vocabulary 2000, 64 positions, dropout 0; lm head tied to the token embedding),
  next-token cross-entropy over all 64 positions, B=8;
- ``bert_b8``: ``transformers.BertForSequenceClassification`` from a ``BertConfig`` (4 layers,
  hidden 256, 4 heads, intermediate 1024, vocabulary 2000, dropout 0), sequence 64,
  10 classes, B=8;
- ``vit_b16`` (batch 16, not ViT-B/16): torchvision's VisionTransformer layout written here
  (Conv2d patch projection, class token and positional table as parameters broadcast over the
  batch, pre-norm blocks of LayerNorm, ``nn.MultiheadAttention`` and Linear-GELU-Linear, final
  LayerNorm, Linear head on the class token): 3x32x32, patch 4, width 192, 4 blocks,
  3 heads, 10 classes, B=16;
- ``resnet18gn_b16``: torchvision's resnet18 layout written here (BasicBlocks) with
  GroupNorm(32, C) for BatchNorm, 3x32x32, 10 classes, B=16.

The Hugging Face workloads need ``transformers`` (nothing is downloaded: the models come from
configs); without it they are listed as skipped, with the reason. Every model maps
``model(x)`` to logits and every loss is a plain function of (output, target).

Methods, in three groups, torch_vjp's under each strategy (``auto``, ``hooks``, ``vmap``,
``loop``; a workload may leave one out, with the reason, and ``hooks`` is "n/a" where no rule
covers a parameter):

- per-sample gradients: ``torch_vjp.per_sample_grads``; the torch.func recipe
  ``vmap(grad(functional_call))``; Opacus ``GradSampleModule`` in modes hooks, functorch and ew;
  BackPACK ``BatchGrad``; the naive per-example loop;
- norms only: ``torch_vjp.per_sample_grad_norms``; Opacus ghost clipping's first pass
  (``GradSampleModuleFastGradientClipping``, norms); BackPACK ``BatchL2Grad``;
- clipped sum: ``torch_vjp.accumulate_clipped_grads``; Opacus ghost clipping's step
  (``DPLossFastGradientClipping``: two backward passes; on GPT-2 its sequence call, which
  averages each sequence's token losses).

Every method is first checked against the per-example loop in float64 (max abs error of each
parameter relative to its largest reference entry, or to a millionth of the largest entry of
all parameters where that is larger (a gradient that is zero in exact arithmetic is rounding
noise on both sides); must be below 2e-3); a method that
raises or disagrees is recorded with its error and not timed. Times are medians of
``torch.utils.benchmark.Timer.blocked_autorange``. In each of ``--rounds`` rounds every method
is timed right after one plain forward+backward of the same batch, and its ratio is taken to
that neighbour; the table gives the medians over rounds of the time and of the ratio.

strategy='auto' against torch_vjp's own strategies: per workload and function, auto and the
fastest of hooks, vmap and loop (by the rounds) are timed in ``--pairs`` alternated pairs;
the median of the pairs' ratios is the figure (target: at most 1.1 on GPT-2, BERT, ViT).

Fixed cost per call: on ``nn.Linear(16, 4)`` with B=8, ``per_sample_grad_norms`` and
``accumulate_clipped_grads`` minus a plain forward+backward of the same batch, in
``--fixed-pairs`` alternated pairs of runs of many calls; median and interquartile range of
the differences (target: at most 0.2 ms).

Peak memory is measured for 'auto' and the peers, per method in a fresh subprocess, two
ways: the rise of the peak resident set
(VmHWM, reset through /proc/self/clear_refs where the kernel allows) over the resident set
after setup, for the first call; and, on a second call, the peak of live tensor bytes
created during the call (``torch_vjp.compare``'s TorchDispatchMode counter; torch_vjp's
kept buffers released first). The "no B x P buffer" targets are judged on the second: the
resident set moves by a few MB between runs (the allocator, one-time costs), which on the
CNN is as large as B x P itself. Peers are optional imports; a missing one is listed with
the reason. The targets (``TARGETS``) are evaluated at the end of the markdown.

Writes ``results/per_sample.json`` and ``results/per_sample.md`` next to this file.

Run: ``python benchmarks/bench_per_sample.py`` (about 15 minutes on 2 idle cores), or
``python benchmarks/bench_per_sample.py --quick`` for a smoke run (short timings, one round,
few pairs, no memory subprocesses, nothing written unless ``--out`` is given). Select
workloads with ``--workloads``, e.g. ``--quick --workloads vit_b16 gpt2_b8``.
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
warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
warnings.filterwarnings("ignore", message=".*does not have an extension for Module.*")


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


# --- Hugging Face models, from a config with random weights (nothing is downloaded) --------

VOCAB, SEQ = 2000, 64


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


class GPT2LM(nn.Module):
    """``GPT2LMHeadModel`` (4 layers, n_embd 256, 4 heads, vocabulary 2000, 64 positions):
    ``model(ids)`` gives the logits ``(B, T, V)``. The lm head is tied to the token embedding,
    so ``wte.weight`` has two uses (an Embedding and a Linear); the projections are GPT-2's
    ``Conv1D``. Attention is transformers' default (``sdpa``)."""

    def __init__(self):
        super().__init__()
        tf = _quiet_transformers()
        cfg = tf.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=4, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )
        self.gpt2 = tf.GPT2LMHeadModel(cfg)

    def forward(self, ids):
        return self.gpt2(input_ids=ids, use_cache=False).logits


def lm_loss(logits, targets):
    """Next-token cross-entropy over all positions, the mean over every (example, position)
    of the batch; for a batch of one, the mean over that sequence's positions."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _lm_data(B):
    # Targets are the next tokens of one random sequence of SEQ + 1 tokens.
    seq = torch.randint(0, VOCAB, (B, SEQ + 1))
    return seq[:, :-1], seq[:, 1:]


class BertClassifier(nn.Module):
    """``BertForSequenceClassification`` (4 layers, hidden 256, 4 heads, intermediate 1024,
    vocabulary 2000, 64 positions, 10 labels): ``model(ids)`` gives the logits ``(B, 10)``.
    No attention mask (every token is real); token types are BERT's buffered zeros."""

    def __init__(self):
        super().__init__()
        tf = _quiet_transformers()
        cfg = tf.BertConfig(
            vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=1024, max_position_embeddings=SEQ, num_labels=10,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        self.bert = tf.BertForSequenceClassification(cfg)

    def forward(self, ids):
        return self.bert(input_ids=ids).logits


# --- Vision models written here (torchvision cannot be installed beside this torch) --------


class ViTBlock(nn.Module):
    """torchvision's ``EncoderBlock``: pre-norm attention and MLP, each with a residual."""

    def __init__(self, dim, heads, mlp_dim):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(dim, heads, dropout=0.0, batch_first=True)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim))

    def forward(self, x):
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + y
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    """torchvision's ``VisionTransformer`` layout at a small size: 32x32 images, patch 4 (64
    patches), width 192, 4 blocks, 3 heads, MLP 768, 10 classes. The class token and the
    positional table are bare parameters broadcast over the batch, which torch_vjp's
    broadcast rule covers; BackPACK skips them, and Opacus, which has no rule for them,
    applies functorch to the module that holds them: here the whole model."""

    def __init__(self, image=32, patch=4, dim=192, layers=4, heads=3, mlp_dim=768, classes=10):
        super().__init__()
        n = (image // patch) ** 2
        self.conv_proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.empty(1, n + 1, dim).normal_(std=0.02))
        self.layers = nn.Sequential(*(ViTBlock(dim, heads, mlp_dim) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim, eps=1e-6)
        # torchvision zeroes the head; a random one keeps every gradient non-zero, so that
        # the correctness check sees every parameter.
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.conv_proj(x).flatten(2).transpose(1, 2)  # (B, N, D)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.ln(self.layers(x + self.pos_embedding))
        return self.head(x[:, 0])


class BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock`` with GroupNorm(32, C) for BatchNorm (BatchNorm in
    training mode mixes examples; DP training replaces it so). ReLU is not in place, unlike
    torchvision's: the peers' full backward hooks refuse an in-place change of a hooked
    module's output (Opacus and BackPACK raise "Output 0 of BackwardHookFunction is a view
    and is being modified inplace"); torch_vjp gives the same results either way."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.GroupNorm(32, cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.GroupNorm(32, cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.GroupNorm(32, cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18GN(nn.Module):
    """torchvision's ``resnet18`` (7x7 stem, max-pool, 2+2+2+2 basic blocks of 64-512
    channels, average pool, Linear) with GroupNorm, 10 classes; on 3x32x32 input."""

    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.GroupNorm(32, 64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _classes(inputs: Callable[[int], torch.Tensor]) -> Callable[[int], tuple]:
    # Inputs first, then the labels: the draws the first workloads have always made.
    return lambda B: (inputs(B), torch.randint(0, 10, (B,)))


# Each workload: model() builds it (seeded by build()), data(B) gives (inputs, targets),
# loss() the loss function of (output, targets) (default cross-entropy). Optional: requires
# (a package whose absence skips the workload), skip ({strategy: why} for torch_vjp strategies
# not timed on it).
WORKLOADS: dict[str, dict[str, Any]] = {
    "mlp_b64": dict(model=_mlp, batch=64, data=_classes(lambda B: torch.randn(B, 784)),
                    text="MLP 784-512-512-10, B=64"),
    "mlp_b256": dict(model=_mlp, batch=256, data=_classes(lambda B: torch.randn(B, 784)),
                     text="MLP 784-512-512-10, B=256",
                     # 256 passes of one example per call, three times (one per function):
                     # the naive loop's row gives that time, and the run stays short.
                     skip={"loop": "not timed: 256 one-example passes per call (see the "
                                   "naive loop)"}),
    "cnn_b64": dict(model=_cnn, batch=64, data=_classes(lambda B: torch.randn(B, 1, 28, 28)),
                    text="CNN conv16-conv32-linear on 1x28x28, B=64"),
    "transformer_b32": dict(model=TransformerClassifier, batch=32,
                            data=_classes(lambda B: torch.randint(0, 1000, (B, 32))),
                            text="Embedding + TransformerEncoderLayer(128, 4 heads) + Linear, seq 32, B=32"),
    "gpt2_b8": dict(model=GPT2LM, batch=8, data=_lm_data, loss=lambda: lm_loss,
                    requires="transformers",
                    text="GPT-2 (transformers GPT2LMHeadModel: 4 layers, n_embd 256, 4 heads, "
                         "vocab 2000), LM loss over all 64 positions, B=8"),
    "bert_b8": dict(model=BertClassifier, batch=8,
                    data=_classes(lambda B: torch.randint(0, VOCAB, (B, SEQ))),
                    requires="transformers",
                    text="BERT (transformers BertForSequenceClassification: 4 layers, hidden 256, "
                         "4 heads, vocab 2000), seq 64, 10 classes, B=8"),
    "vit_b16": dict(model=ViT, batch=16, data=_classes(lambda B: torch.randn(B, 3, 32, 32)),
                    text="ViT (torchvision layout: patch 4 on 3x32x32, width 192, 4 blocks, "
                         "3 heads), 10 classes, B=16"),
    "resnet18gn_b16": dict(model=ResNet18GN, batch=16,
                           data=_classes(lambda B: torch.randn(B, 3, 32, 32)),
                           text="ResNet-18 with GroupNorm(32, C) (torchvision layout) on 3x32x32, "
                                "10 classes, B=16"),
}


# The targets, by workload (issue #10 and before): grads_max, norms_max, clip_max: time of
# per_sample_grads, per_sample_grad_norms, accumulate_clipped_grads (auto) as a multiple of
# plain forward+backward; grads_peer_within: per_sample_grads against the fastest peer;
# auto_own_max: auto against the fastest of torch_vjp's own strategies, per function. Every
# workload also has: per_sample_grads faster than every peer, the norms and the clipped step
# faster than the peers that compute them, and no B x P buffer for those two.
TARGETS: dict[str, dict[str, float]] = {
    "mlp_b64": dict(grads_max=10, norms_max=1.3, clip_max=1.3),
    "mlp_b256": dict(grads_max=10, norms_max=1.3, clip_max=1.3),
    "cnn_b64": dict(grads_peer_within=1.1, norms_max=1.3, clip_max=1.3),
    "transformer_b32": dict(grads_peer_within=1.1, norms_max=1.2, clip_max=1.3),
    "gpt2_b8": dict(auto_own_max=1.1),
    "bert_b8": dict(auto_own_max=1.1),
    "vit_b16": dict(auto_own_max=1.1),
}
FIXED_MAX_MS = 0.2  # fixed cost per call of the norms and of the clipped step


def unavailable(workload: str) -> str | None:
    """Why a workload cannot run here (its optional package is missing), or None."""
    pkg = WORKLOADS[workload].get("requires")
    if pkg is None:
        return None
    try:
        __import__(pkg)
    except Exception as exc:  # noqa: BLE001 - report any import failure
        return f"{pkg} not importable: {type(exc).__name__}: {exc}"
    return None


def build(workload: str, dtype=torch.float32):
    w = WORKLOADS[workload]
    torch.manual_seed(0)
    model = w["model"]().to(dtype).train()
    x, y = w["data"](w["batch"])
    if x.is_floating_point():
        x = x.to(dtype)
    loss_fn = w["loss"]() if "loss" in w else nn.CrossEntropyLoss()
    return model, loss_fn, x, y


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


STRATEGIES = ("auto", "hooks", "vmap", "loop")


def m_tv_grads(strategy: str):
    def make(model, loss_fn, x, y):
        from torch_vjp.per_sample import per_sample_grads

        def step():
            return per_sample_grads(model, loss_fn, x, y, strategy=strategy)

        return step, lambda: {"grads": step()}

    return make


def m_tv_norms(strategy: str):
    def make(model, loss_fn, x, y):
        from torch_vjp.per_sample import per_sample_grad_norms

        def step():
            return per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy)

        return step, lambda: {"norms": step()}

    return make


def m_tv_clip(strategy: str):
    def make(model, loss_fn, x, y):
        from torch_vjp.per_sample import accumulate_clipped_grads

        def step():
            _clear(model)
            return accumulate_clipped_grads(model, loss_fn, x, y, max_norm=MAX_NORM,
                                            strategy=strategy)

        def result():
            step()
            return {"clipped": {n: p.grad.clone() for n, p in model.named_parameters()}}

        return step, result

    return make


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
        out = gsm(x)
        if out.dim() == 3:
            # Sequence outputs (B, T, V): Opacus' generative-NLP call, the flattened logits
            # with the shape that lets it average each sequence's T losses into one.
            crit(out.reshape(-1, out.shape[-1]), y.reshape(-1), shape=out.shape).backward()
        else:
            crit(out, y).backward()

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
                out = emodel(x)
                # BackPACK's losses take (N, C) logits; a sequence model's are flattened
                # (B x T rows), so the results are checked below to have one row per example.
                eloss(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()

        def result():
            step()
            if extension == "BatchGrad":
                out = {}
                for n, p in emodel.named_parameters():
                    gb = getattr(p, "grad_batch", None)
                    if gb is None:
                        raise RuntimeError(f"no grad_batch for {n} (BackPACK skipped its module)")
                    if gb.shape[0] != B:
                        raise RuntimeError(f"grad_batch of {n} has {gb.shape[0]} rows for a "
                                           f"batch of {B}")
                    out[n] = gb * B  # BackPACK scales by 1/B for a mean-reduced loss
                return {"grads": out}
            sq = 0
            for n, p in emodel.named_parameters():
                l2 = getattr(p, "batch_l2", None)
                if l2 is None:
                    raise RuntimeError(f"no batch_l2 for {n} (BackPACK skipped its module)")
                if l2.shape[0] != B:
                    raise RuntimeError(f"batch_l2 of {n} has {l2.shape[0]} rows for a "
                                       f"batch of {B}")
                sq = sq + l2
            return {"norms": sq.sqrt() * B}

        return step, result

    return make


FUNCTIONS = {  # group -> (torch_vjp function, factory of its method for a strategy)
    "per-sample gradients": ("per_sample_grads", m_tv_grads),
    "norms only": ("per_sample_grad_norms", m_tv_norms),
    "clipped sum": ("accumulate_clipped_grads", m_tv_clip),
}


def ours_label(group: str, strategy: str) -> str:
    return f"torch_vjp {FUNCTIONS[group][0]} ({strategy})"


def _ours(group: str) -> list[tuple[str, Callable, str | None]]:
    return [(ours_label(group, s), FUNCTIONS[group][1](s), None) for s in STRATEGIES]


# group -> [(label, factory, peer package or None)]; torch_vjp's rows first, one per strategy.
METHODS: dict[str, list[tuple[str, Callable, str | None]]] = {
    "per-sample gradients": _ours("per-sample gradients") + [
        ("torch.func recipe vmap(grad)", m_torch_func, None),
        ("Opacus hooks", _opacus_mode("hooks"), "opacus"),
        ("Opacus functorch", _opacus_mode("functorch"), "opacus"),
        ("Opacus ew", _opacus_mode("ew"), "opacus"),
        ("BackPACK BatchGrad", m_backpack("BatchGrad"), "backpack"),
        ("naive loop", m_loop, None),
    ],
    "norms only": _ours("norms only") + [
        ("Opacus ghost (norms pass)", m_opacus_ghost_norms, "opacus"),
        ("BackPACK BatchL2Grad", m_backpack("BatchL2Grad"), "backpack"),
    ],
    "clipped sum": _ours("clipped sum") + [
        ("Opacus ghost clipping step", m_opacus_ghost_clip, "opacus"),
    ],
}
OURS = {group: ours_label(group, "auto") for group in FUNCTIONS}


def strategy_of(label: str) -> str | None:
    """The strategy of one of torch_vjp's rows, None for a peer's."""
    if not label.startswith("torch_vjp "):
        return None
    return label.rsplit("(", 1)[1].rstrip(")")


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


# A parameter's error is taken relative to its own largest reference entry, but to no less
# than this fraction of the largest entry over all parameters: a gradient that is zero in
# exact arithmetic (BERT's attention key bias: softmax ignores a shift shared by all keys)
# is 1e-19 of the largest in the float64 reference and float32 rounding (about 1e-10 of it)
# in every method, the loop included, which its own scale would call an error of 1e8.
CHECK_FLOOR = 1e-6


def _rel_err(got: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    got = got.detach().to(torch.float64).reshape(ref.shape)
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(max(floor, 1e-30)))


def check(result: dict[str, Any], ref: dict[str, Any]) -> float:
    """Largest relative error of a method's result against the reference (raises if malformed)."""
    (kind, got), = result.items()
    if kind == "norms":
        return _rel_err(got, ref["norms"])
    missing = [n for n in ref[kind] if n not in got]
    if missing:
        raise RuntimeError(f"no result for {len(missing)} parameter(s): {', '.join(missing[:4])}")
    top = max(float(r.abs().max()) for r in ref[kind].values())
    return max(_rel_err(got[n], ref[kind][n], CHECK_FLOOR * top) for n in ref[kind])


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
    # call (torch_vjp's TorchDispatchMode counter), free of the allocator's and the first
    # call's one-time costs. Buffers torch_vjp keeps between calls, in versions that keep
    # any, are released first, so that they are counted as new.
    import torch_vjp.per_sample as tv_per_sample

    gc.collect()
    release = getattr(tv_per_sample, "release_cached_buffers", None)
    if release is not None:
        release()
    mode = _live_tensor_bytes()
    with mode:
        out = step()
    del out
    print(json.dumps({"peak_bytes": max(0, peak - base), "hwm_reset": reset,
                      "tensor_peak_bytes": mode.peak}))


def _live_tensor_bytes():
    """torch_vjp's counter of live tensor bytes (in torch_vjp._measure; torch_vjp.compare
    before)."""
    try:
        from torch_vjp._measure import LiveTensorBytes
    except ImportError:
        from torch_vjp.compare import _LiveTensorBytes as LiveTensorBytes
    return LiveTensorBytes()


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
        return {"peak_mb": data["peak_bytes"] / 1e6, "hwm_reset": data["hwm_reset"],
                "tensor_peak_mb": data["tensor_peak_bytes"] / 1e6}
    except Exception as exc:  # noqa: BLE001
        return {"peak_mb": None, "memory_error": f"{type(exc).__name__}: {exc}"}


TIMERS = {"wall": time.perf_counter, "process": time.process_time}


def median_time(step: Callable, min_run_time: float, timer: str = "wall") -> float:
    t = tb.Timer("step()", globals={"step": step}, num_threads=THREADS, timer=TIMERS[timer])
    return t.blocked_autorange(min_run_time=min_run_time).median


def paired_times(step_a: Callable, step_b: Callable, pairs: int, timer: str = "wall",
                 sample_s: float = 0.02) -> tuple[list[float], list[float], int]:
    """Per-call times of ``a`` and ``b`` in ``pairs`` pairs, timed back to back with the
    order alternated (a b, b a, ...), so that a drift of the machine's speed falls on both
    members of a pair alike. Each sample is a run of ``n`` calls (``n`` chosen for about
    ``sample_s`` seconds) through ``Timer.timeit``. Returns (a's, b's, n)."""
    ta = tb.Timer("step()", globals={"step": step_a}, num_threads=THREADS, timer=TIMERS[timer])
    tb_ = tb.Timer("step()", globals={"step": step_b}, num_threads=THREADS, timer=TIMERS[timer])
    one = min(ta.timeit(1).median, tb_.timeit(1).median)  # also a warm-up call of each
    n = max(1, min(10_000, round(sample_s / max(one, 1e-7))))
    ta.timeit(n), tb_.timeit(n)
    a_times, b_times = [], []
    for k in range(pairs):
        if k % 2 == 0:
            a, b = ta.timeit(n).median, tb_.timeit(n).median
        else:
            b, a = tb_.timeit(n).median, ta.timeit(n).median
        a_times.append(a)
        b_times.append(b)
    return a_times, b_times, n


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3) of ``xs`` by torch_vjp's own summary (one sample: all three)."""
    from torch_vjp._measure import summarize_times

    t = summarize_times([xs])
    return t.q1, t.median, t.q3


def _failure(exc: BaseException, label: str, strategy: str | None) -> tuple[str, str]:
    """(status, message) of a method that raised: "n/a" where strategy='hooks' refuses a
    model with a parameter no rule covers (by design: 'auto' sends those to vmap), else
    "failed"."""
    text = str(exc).strip()
    msg = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    if strategy == "hooks" and type(exc).__name__ == "StrategyError" and "no per-layer rule" in text:
        return "n/a", msg
    return "failed", msg


def _plan_summary(model, loss_fn, x, y) -> dict[str, Any]:
    """How strategy='auto' computes the parameters (rules, vmap, loop), from per_sample_plan:
    what explains auto's time against the other strategies."""
    try:
        from torch_vjp.per_sample import per_sample_plan

        plan = per_sample_plan(model, loss_fn, x, y)
    except Exception as exc:  # noqa: BLE001 - reported with the workload
        return {"error": f"{type(exc).__name__}: {str(exc).strip()[:300]}"}
    counts: dict[str, int] = {}
    others = []
    for r in plan.rows:
        counts[r.method] = counts.get(r.method, 0) + 1
        if r.method != "rule":
            others.append(f"{r.name}: {r.method} ({r.reason})")
    return {"methods": counts, "not_by_rules": others[:20]}


def run_workload(workload: str, args, peers: dict[str, str]) -> dict[str, Any]:
    w = WORKLOADS[workload]
    print(f"\n== {workload}: {w['text']}", flush=True)
    why = unavailable(workload)
    if why is not None:
        print(f"  skipped: {why}", flush=True)
        return {"description": w["text"], "batch": w["batch"], "skipped": why}
    ref = reference(workload)
    model0, loss_fn, x, y = build(workload)
    n_params = sum(p.numel() for p in model0.parameters())
    B = x.shape[0]
    rows: list[dict[str, Any]] = []
    steps: dict[str, Callable] = {}
    plain_step, _ = m_plain(copy.deepcopy(model0), loss_fn, x, y)
    plain_step()
    steps["plain forward+backward"] = plain_step
    plan = _plan_summary(copy.deepcopy(model0), loss_fn, x, y)
    skip = w.get("skip", {})
    for group, entries in METHODS.items():
        for label, make, pkg in entries:
            row: dict[str, Any] = {"group": group, "method": label}
            rows.append(row)
            strategy = strategy_of(label)
            if pkg is not None and str(peers.get(pkg, "")).startswith("unavailable"):
                row.update(status="skipped", error=peers[pkg])
                continue
            if strategy in skip:
                row.update(status="skipped", error=skip[strategy])
                continue
            # The first call is the check against the per-example loop in float64; for
            # torch_vjp it also builds and verifies the plan, which later calls reuse.
            try:
                model = copy.deepcopy(model0)
                step, result = make(model, loss_fn, x, y)
                err = check(result(), ref)
            except Exception as exc:  # noqa: BLE001 - a failing method is a result
                status, msg = _failure(exc, label, strategy)
                row.update(status=status, error=msg[:300])
                if strategy is not None:  # ours: keep where it failed, for the report
                    row["traceback"] = traceback.format_exc()[-3000:]
                print(f"  {label:48s} {status}: {msg[:200]}", flush=True)
                if args.verbose:
                    traceback.print_exc()
                continue
            row["check_rel_err"] = err
            if not err <= CHECK_TOL:
                row.update(status="wrong", error=f"max relative error {err:.2e} against the loop")
                print(f"  {label:48s} WRONG: {err:.2e}", flush=True)
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
            if label == "naive loop" or strategy_of(label) == "loop":
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
            print(f"  {row['method']:48s} {row['median_s'] * 1e3:9.2f} ms  "
                  f"{row['ratio_to_plain']:7.2f}x", flush=True)
    auto_vs_own = compare_auto(rows, steps, args)
    if args.memory:
        # Memory is measured for 'auto' and the peers: one fresh process each. The explicit
        # strategies would double the run's length; their time is what the auto target needs.
        out_plain.update(measure_memory(workload, "plain forward+backward"))
        for row in rows:
            if row.get("status") == "ok" and strategy_of(row["method"]) in (None, "auto"):
                row.update(measure_memory(workload, row["method"]))
    return {
        "description": w["text"],
        "batch": B,
        "parameters": n_params,
        "per_sample_fp32_mb": B * n_params * 4 / 1e6,
        "auto_plan": plan,
        "plain": out_plain,
        "methods": rows,
        "auto_vs_own": auto_vs_own,
    }


def compare_auto(rows: list[dict[str, Any]], steps: dict[str, Callable], args) -> dict[str, Any]:
    """Per function: strategy='auto' against the fastest of the explicit strategies.

    The fastest is picked from the rounds (ratio to plain); then the two are timed in
    ``--pairs`` alternated pairs and the ratio of each pair taken: auto and its fastest
    strategy often do the same work, and the 1.1x target needs a figure steadier than two
    separately timed medians."""
    by_label = {r["method"]: r for r in rows}
    out: dict[str, Any] = {}
    for group, (fn, _) in FUNCTIONS.items():
        auto = by_label.get(ours_label(group, "auto"), {})
        own = [by_label[ours_label(group, s)] for s in STRATEGIES[1:]
               if by_label.get(ours_label(group, s), {}).get("status") == "ok"]
        entry: dict[str, Any] = {
            "strategies": {s: (by_label[ours_label(group, s)].get("ratio_to_plain")
                               if by_label.get(ours_label(group, s), {}).get("status") == "ok"
                               else by_label.get(ours_label(group, s), {}).get("status"))
                           for s in STRATEGIES},
        }
        out[fn] = entry
        if auto.get("status") != "ok" or not own:
            entry["error"] = ("auto did not run" if auto.get("status") != "ok"
                              else "no other strategy ran")
            continue
        best = min(own, key=lambda r: r["ratio_to_plain"])
        a, b, n = paired_times(steps[auto["method"]], steps[best["method"]], args.pairs, args.timer)
        pair_ratios = [x / y for x, y in zip(a, b)]
        q1, med, q3 = _quartiles(pair_ratios)
        entry.update(fastest=strategy_of(best["method"]),
                     rounds_ratio=auto["ratio_to_plain"] / best["ratio_to_plain"], ratio=med,
                     q1=q1, q3=q3, pairs=len(pair_ratios), calls_per_sample=n,
                     auto_s=statistics.median(a), fastest_s=statistics.median(b))
        print(f"  auto / fastest own strategy ({entry['fastest']}), {fn}: {med:.3f}x "
              f"(IQR {q1:.3f}-{q3:.3f}, {len(pair_ratios)} pairs)", flush=True)
    return out


# The fixed cost per call: what torch_vjp adds to a plain forward+backward where the
# arithmetic is negligible (argument checks, plan lookup, hooks, the norms' reductions).
FIXED_MODEL = "nn.Linear(16, 4), B=8, cross-entropy"


def fixed_cost(args) -> dict[str, Any]:
    """Time per call of accumulate_clipped_grads and per_sample_grad_norms (auto) minus a plain
    forward+backward of the same batch, on a tiny model: alternated pairs, median and IQR of
    the per-pair differences."""
    print(f"\n== fixed cost per call: {FIXED_MODEL}", flush=True)
    torch.manual_seed(0)
    model, loss_fn = nn.Linear(16, 4), nn.CrossEntropyLoss()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    plain, _ = m_plain(copy.deepcopy(model), loss_fn, x, y)
    out: dict[str, Any] = {"model": FIXED_MODEL}
    for fn, make in (("per_sample_grad_norms", m_tv_norms("auto")),
                     ("accumulate_clipped_grads", m_tv_clip("auto"))):
        step, _ = make(copy.deepcopy(model), loss_fn, x, y)
        step()  # builds and verifies the plan, once per model
        # A sample of a few ms: many calls, so that the timer's resolution and overhead
        # vanish, few enough for many pairs.
        a, b, n = paired_times(step, plain, args.fixed_pairs, args.timer, sample_s=0.005)
        diffs = [(x1 - x2) * 1e3 for x1, x2 in zip(a, b)]
        q1, med, q3 = _quartiles(diffs)
        out[fn] = {"extra_ms": med, "q1_ms": q1, "q3_ms": q3, "pairs": len(diffs),
                   "calls_per_sample": n, "method_ms": statistics.median(a) * 1e3,
                   "plain_ms": statistics.median(b) * 1e3}
        print(f"  {fn:28s} +{med:.3f} ms (IQR {q1:.3f}-{q3:.3f}) over plain "
              f"{out[fn]['plain_ms']:.3f} ms; {len(diffs)} pairs of {n} calls", flush=True)
    return out


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


def evaluate_targets(results: dict[str, Any], fixed: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The targets of the issues (#10 and before), as declared per workload in TARGETS.

    Methods are compared through their ratios to plain (each timed next to its own plain
    neighbour), which a busy machine disturbs less than raw times; auto against its own
    strategies through the alternated pairs of :func:`compare_auto`."""
    out = []

    def add(target, workload, value, met, detail):
        out.append({"target": target, "workload": workload, "value": value, "met": met, "detail": detail})

    for wl, res in results.items():
        want = TARGETS.get(wl, {})
        if "skipped" in res:
            if want:  # a target that could not be judged is listed as such, not dropped
                add("targets of this workload", wl, None, None, f"not evaluated: {res['skipped']}")
            continue
        ours = _row(res, OURS["per-sample gradients"])
        if ours is None or ours.get("status") != "ok":
            add("per_sample_grads(auto) runs", wl, None, False, ours.get("error") if ours else "missing")
        else:
            peers = [r for r in res["methods"] if r["group"] == "per-sample gradients"
                     and strategy_of(r["method"]) is None and r.get("status") == "ok"]
            if peers:
                best = min(peers, key=lambda r: r["ratio_to_plain"])
                speed = ours["ratio_to_plain"] / best["ratio_to_plain"]
                detail = f"{speed:.2f}x the time of the fastest peer ({best['method']})"
                add("per_sample_grads(auto) faster than every peer", wl, speed, speed < 1.0, detail)
                if "grads_peer_within" in want:
                    lim = want["grads_peer_within"]
                    add(f"per_sample_grads(auto) within {lim}x of the fastest peer", wl, speed,
                        speed <= lim, detail)
            if "grads_max" in want:
                lim = want["grads_max"]
                add(f"per_sample_grads(auto) <= {lim}x plain", wl, ours["ratio_to_plain"],
                    ours["ratio_to_plain"] <= lim, f"{ours['ratio_to_plain']:.2f}x plain")
        norms = _row(res, OURS["norms only"])
        if norms and norms.get("status") == "ok":
            if "norms_max" in want:
                lim = want["norms_max"]
                add(f"per_sample_grad_norms <= {lim}x plain", wl, norms["ratio_to_plain"],
                    norms["ratio_to_plain"] <= lim, f"{norms['ratio_to_plain']:.2f}x plain")
            for peer in ("Opacus ghost (norms pass)", "BackPACK BatchL2Grad"):
                r = _row(res, peer)
                if r and r.get("status") == "ok":
                    s = norms["ratio_to_plain"] / r["ratio_to_plain"]
                    add(f"per_sample_grad_norms faster than {peer}", wl, s, s < 1.0, f"{s:.2f}x its time")
            _memory_target(add, "per_sample_grad_norms", wl, res, norms)
        elif "norms_max" in want:
            add("per_sample_grad_norms runs", wl, None, False, norms.get("error") if norms else "missing")
        clip = _row(res, OURS["clipped sum"])
        if clip and clip.get("status") == "ok":
            if "clip_max" in want:
                lim = want["clip_max"]
                add(f"accumulate_clipped_grads <= {lim}x plain", wl, clip["ratio_to_plain"],
                    clip["ratio_to_plain"] <= lim, f"{clip['ratio_to_plain']:.2f}x plain")
            r = _row(res, "Opacus ghost clipping step")
            if r and r.get("status") == "ok":
                s = clip["ratio_to_plain"] / r["ratio_to_plain"]
                add("accumulate_clipped_grads faster than Opacus ghost clipping", wl, s, s < 1.0,
                    f"{s:.2f}x its time")
            _memory_target(add, "accumulate_clipped_grads", wl, res, clip)
        elif "clip_max" in want:
            add("accumulate_clipped_grads runs", wl, None, False, clip.get("error") if clip else "missing")
        if "auto_own_max" in want:
            lim = want["auto_own_max"]
            for fn, e in res.get("auto_vs_own", {}).items():
                if "ratio" not in e:
                    add(f"{fn}: auto <= {lim}x its fastest own strategy", wl, None, False,
                        e.get("error", "?"))
                    continue
                add(f"{fn}: auto <= {lim}x its fastest own strategy", wl, e["ratio"], e["ratio"] <= lim,
                    f"{e['ratio']:.3f}x {e['fastest']} (pairs' IQR {e['q1']:.3f}-{e['q3']:.3f}; "
                    f"rounds {e['rounds_ratio']:.2f}x)")
    if fixed:
        for fn in ("per_sample_grad_norms", "accumulate_clipped_grads"):
            e = fixed.get(fn)
            if e:
                add(f"{fn}: fixed cost per call <= {FIXED_MAX_MS} ms", "fixed cost", e["extra_ms"],
                    e["extra_ms"] <= FIXED_MAX_MS,
                    f"+{e['extra_ms']:.3f} ms (IQR {e['q1_ms']:.3f}-{e['q3_ms']:.3f}) over plain "
                    f"{e['plain_ms']:.3f} ms, {fixed['model']}")
    return out


def environment(peers: dict[str, str]) -> dict[str, Any]:
    from torch_vjp._measure import cpu_model

    cpu = cpu_model()
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
        "float64 (relative error column). torch_vjp's functions are timed under each "
        "strategy; memory is measured for 'auto' and the peers only.",
        "",
    ]
    lines += summary_table(report) + [""]
    lines += auto_table(report) + [""]
    lines += fixed_cost_lines(report.get("fixed_cost")) + [""]
    for wl, res in report["workloads"].items():
        if "skipped" in res:
            lines += [f"## {res['description']}", "", f"Skipped: {res['skipped']}.", ""]
            continue
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
            plan_line(res.get("auto_plan", {})),
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
        failed = [(name, r["memory_error"]) for name, r in
                  [("plain forward+backward", plain)] + [(r["method"], r) for r in res["methods"]]
                  if r.get("memory_error")]
        if failed:
            lines += [f"- memory not measured for {name}: {err}" for name, err in failed] + [""]
    lines += ["## Targets", "", "| target | workload | result | met |", "|---|---|---|---|"]
    for t in report["targets"]:
        met = "skipped" if t["met"] is None else ("yes" if t["met"] else "NO")
        lines.append(f"| {t['target']} | {t['workload']} | {t['detail']} | {met} |")
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
            res = report["workloads"][wl]
            r = None if "skipped" in res else _row(res, label)
            if "skipped" in res:
                cells.append("skipped")
            elif r is None:
                cells.append("")
            elif r.get("status") == "ok":
                cells.append(f"{r['ratio_to_plain']:.2f}")
            else:
                cells.append(r["status"])
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def plan_line(plan: dict[str, Any]) -> str:
    if "error" in plan:
        return f"per_sample_plan failed: {plan['error']}"
    counts = plan.get("methods", {})
    text = ", ".join(f"{n} by {m}" for m, n in counts.items())
    rest = plan.get("not_by_rules") or []
    return (f"strategy='auto' computes the parameters: {text or '?'}"
            + ("." if not rest else "; not by rules: " + "; ".join(rest)))


def auto_table(report: dict[str, Any]) -> list[str]:
    """Per workload and function: each strategy's time as a multiple of plain, and auto
    against the fastest of the others in alternated pairs."""
    lines = [
        "## strategy='auto' against torch_vjp's own strategies",
        "",
        "Each strategy's time as a multiple of plain forward+backward (from the rounds), and "
        "auto / the fastest of hooks, vmap and loop: the median over alternated pairs of the "
        "two (interquartile range in parentheses). Target: at most 1.1 on GPT-2, BERT and ViT.",
        "",
        "| workload | function | " + " | ".join(STRATEGIES) + " | auto / fastest own |",
        "|---|---|" + "---:|" * len(STRATEGIES) + "---|",
    ]
    for wl, res in report["workloads"].items():
        for fn, e in res.get("auto_vs_own", {}).items():
            cells = []
            for s in STRATEGIES:
                v = e["strategies"].get(s)
                cells.append(f"{v:.2f}" if isinstance(v, float) else str(v or ""))
            if "ratio" in e:
                last = f"{e['ratio']:.3f} ({e['q1']:.3f}-{e['q3']:.3f}) vs {e['fastest']}"
            else:
                last = e.get("error", "")
            lines.append(f"| {wl} | {fn} | " + " | ".join(cells) + f" | {last} |")
    return lines


def fixed_cost_lines(fixed: dict[str, Any] | None) -> list[str]:
    if not fixed:
        return []
    lines = [
        "## Fixed cost per call",
        "",
        f"On {fixed['model']}: time per call minus one plain forward+backward of the same "
        f"batch, in alternated pairs (each sample a run of many calls); median and "
        f"interquartile range over pairs. Target: at most {FIXED_MAX_MS} ms.",
        "",
        "| function (auto) | extra per call (ms) | IQR (ms) | call (ms) | plain (ms) | pairs |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for fn in ("per_sample_grad_norms", "accumulate_clipped_grads"):
        e = fixed.get(fn)
        if e:
            lines.append(f"| {fn} | {e['extra_ms']:.3f} | {e['q1_ms']:.3f}-{e['q3_ms']:.3f} | "
                         f"{e['method_ms']:.3f} | {e['plain_ms']:.3f} | {e['pairs']} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: short timings, no memory")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--min-run-time", type=float, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--pairs", type=int, default=None,
                        help="alternated pairs for auto against its fastest own strategy")
    parser.add_argument("--fixed-pairs", type=int, default=None,
                        help="alternated pairs for the fixed cost per call")
    parser.add_argument("--no-fixed-cost", dest="fixed_cost", action="store_false",
                        help="leave out the fixed-cost measurement")
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
    if args.pairs is None:
        args.pairs = 3 if args.quick else 15
    if args.fixed_pairs is None:
        args.fixed_pairs = 7 if args.quick else 41
    if args.memory is None:
        args.memory = not args.quick
    out_dir = args.out if args.out is not None else (None if args.quick else RESULTS)
    peers = peer_status()
    results = {wl: run_workload(wl, args, peers) for wl in args.workloads}
    fixed = fixed_cost(args) if args.fixed_cost else None
    report = {
        "environment": environment(peers),
        "settings": {"threads": THREADS, "timer": args.timer, "min_run_time_s": args.min_run_time,
                     "rounds": args.rounds, "pairs": args.pairs, "fixed_pairs": args.fixed_pairs,
                     "check_tolerance": CHECK_TOL, "check_floor": CHECK_FLOOR, "max_norm": MAX_NORM,
                     "memory": args.memory},
        "workloads": results,
        "fixed_cost": fixed,
    }
    report["targets"] = evaluate_targets(results, fixed)
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
