"""Per-sample gradients on whole models users train with DP-SGD, against the per-example loop.

GPT-2 and BERT come from ``transformers`` (random weights from a small config; skipped when
it is not installed); the ViT below follows torchvision's ``VisionTransformer`` layout (a
class token expanded over the batch and concatenated, a positional table added). Every
parameter must be computed by rules (``per_sample_plan``), and the results must equal the
definition in float64.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torch_vjp as tv
from torch_vjp._measure import measure_peak

DT = torch.float64


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.self_attention = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + y
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    """torchvision's VisionTransformer layout, small."""

    def __init__(self, image=8, patch=4, d=16, layers=1, heads=2, classes=3):
        super().__init__()
        self.conv_proj = nn.Conv2d(3, d, patch, patch)
        n = (image // patch) ** 2
        self.class_token = nn.Parameter(torch.randn(1, 1, d))
        self.pos_embedding = nn.Parameter(torch.randn(1, n + 1, d) * 0.1)
        self.layers = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embedding
        return self.head(self.ln(self.layers(x))[:, 0])


def _lm_loss(out, target):
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()

    class GPT2(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
                n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=8, bos_token_id=0,
                eos_token_id=0))

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits

    ids = torch.randint(0, 40, (3, 6))
    return GPT2(), _lm_loss, ids, ids


def _bert():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = transformers.BertForSequenceClassification(transformers.BertConfig(
                num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                intermediate_size=32, vocab_size=40, max_position_embeddings=8, num_labels=3))

        def forward(self, ids):
            return self.m(input_ids=ids).logits

    return Bert(), nn.CrossEntropyLoss(), torch.randint(0, 40, (3, 6)), torch.randint(0, 3, (3,))


def _vit():
    return ViT(), nn.CrossEntropyLoss(), torch.randn(3, 3, 8, 8, dtype=DT), torch.randint(0, 3, (3,))


MODELS = {"gpt2": _gpt2, "bert": _bert, "vit": _vit}


@pytest.mark.parametrize("name", MODELS)
def test_whole_model_is_covered_by_rules_and_right(name):
    torch.manual_seed(0)
    model, loss_fn, x, t = MODELS[name]()
    model = model.to(DT).eval()
    plan = tv.per_sample_plan(model, loss_fn, x, t)
    assert {r.method for r in plan.rows} == {"rule"}, str(plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = tv.per_sample_grads(model, loss_fn, x, t, strategy="loop")
        got = tv.per_sample_grads(model, loss_fn, x, t, strategy="hooks")
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], msg=n)
        norms = tv.per_sample_grad_norms(model, loss_fn, x, t, strategy="auto")
        want = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
        torch.testing.assert_close(norms, want)
        for p in model.parameters():
            p.grad = None
        max_norm = float(want.median())
        tv.accumulate_clipped_grads(model, loss_fn, x, t, max_norm=max_norm, strategy="auto")
        c = (max_norm / want).clamp(max=1.0)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, ref[n]), msg=n)


def test_gpt2_uses_its_conv1d_rule_and_shared_position_table():
    torch.manual_seed(0)
    model, loss_fn, x, t = _gpt2()
    plan = tv.per_sample_plan(model.to(DT).eval(), loss_fn, x, t)
    assert "Conv1D (transformers) rule" in plan["m.transformer.h.0.attn.c_attn.weight"].how
    assert "Embedding rule in 'm.transformer.wpe'" in plan["m.transformer.wpe.weight"].how
    # the tied embedding is also the output layer's weight
    assert "Linear rule in 'm.lm_head'" in plan["m.transformer.wte.weight"].how


class TiedLM(nn.Module):
    """An embedding table that is also the output layer's weight (tied weights)."""

    def __init__(self, vocab=300, d=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.emb(ids))))


def test_tied_weights_norms_need_no_batch_times_parameter_buffer():
    torch.manual_seed(0)
    model = TiedLM().to(DT)
    ids = torch.randint(0, 300, (64, 5))
    norms = tv.per_sample_grad_norms(model, _lm_loss, ids, ids)
    ref = tv.per_sample_grads(model, _lm_loss, ids, ids)
    torch.testing.assert_close(norms, torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1))
    batch_times_table = 64 * 300 * 64 * 8  # B x P of the tied table, in bytes
    cpu = torch.device("cpu")
    peak = measure_peak(lambda: tv.per_sample_grad_norms(model, _lm_loss, ids, ids), cpu)
    plain = measure_peak(  # an ordinary forward and backward of the batch
        lambda: torch.autograd.grad(_lm_loss(model(ids), ids), list(model.parameters())), cpu)
    # the tied table's per-sample gradients are written a chunk of examples at a time
    assert peak - plain < batch_times_table / 2, (peak, plain)


@pytest.mark.parametrize("tool", ["ModuleTracker", "FlopCounterMode"])
def test_works_under_torch_tools_that_hook_every_module(tool):
    """torch's ModuleTracker (and FlopCounterMode, which uses it) registers a global forward
    pre-hook that puts a multi-grad hook on each module's inputs; such a hook cannot take a
    leaf inside ``torch.autograd.grad``, and the plan's data-flow probe ran the model on
    leaves that require grad (valid code raised torch's "A leaf node was passed to
    _will_engine_execute_node")."""
    from torch.utils.flop_counter import FlopCounterMode
    from torch.utils.module_tracker import ModuleTracker

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(3 * 4 * 4, 2)).to(DT)
    x, y = torch.randn(5, 2, 6, 6, dtype=DT), torch.randn(5, 2, dtype=DT)
    loss = nn.MSELoss()
    want = tv.per_sample_grads(model, loss, x, y, strategy="loop")
    want_norms = torch.stack([torch.cat([g[i].reshape(-1) for g in want.values()]).norm()
                              for i in range(5)])
    for strategy in ("auto", "hooks", "vmap", "loop"):  # (the plan is built under the tool)
        ctx = ModuleTracker() if tool == "ModuleTracker" else FlopCounterMode(display=False)
        with ctx:
            got = tv.per_sample_grads(model, loss, x, y, strategy=strategy)
            norms = tv.per_sample_grad_norms(model, loss, x, y, strategy=strategy)
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, msg=f"{strategy} {name}")
        torch.testing.assert_close(norms, want_norms, msg=strategy)


class GradSampleModule(nn.Module):
    """Stands in for opacus.GradSampleModule (importing opacus takes seconds): its type's
    module and hooks flag are what the check reads. The real one's hooks broke on the
    plan's second run ("einsum(): subscript n has size 3 ... 4", raised from inside Opacus)
    and left .grad_sample on the parameters."""

    __module__ = "opacus.grad_sample.grad_sample_module"

    def __init__(self, module):
        super().__init__()
        self._module = module
        self.hooks_enabled = True

    def disable_hooks(self):
        self.hooks_enabled = False

    def forward(self, *args):
        return self._module(*args)


def test_an_opacus_grad_sample_module_with_its_hooks_on_is_refused_with_the_fix():
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(DT)
    gsm = GradSampleModule(inner)
    x, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
    loss_fn = nn.CrossEntropyLoss()
    for holder, where in ((gsm, r"model is"), (nn.Sequential(gsm), r"module '0' is")):
        with pytest.raises(tv.PerSampleTypeError, match=(
                rf"{where} an Opacus GradSampleModule with its hooks on(.|\n)*Fix: pass the "
                rf"module it wraps, model(\[0\])?._module")):
            tv.per_sample_grads(holder, loss_fn, x, y)
    gsm.disable_hooks()  # the fix the message names
    got = tv.per_sample_grads(gsm, loss_fn, x, y)
    ref = tv.per_sample_grads(inner, loss_fn, x, y, strategy="loop")
    for n, g in ref.items():
        torch.testing.assert_close(got["_module." + n], g)
