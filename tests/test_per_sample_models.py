"""Per-sample gradients on whole models users train with DP-SGD, against the per-example loop.

GPT-2 and BERT come from ``transformers`` (random weights from a small config; skipped when
it is not installed); the ViT below follows torchvision's ``VisionTransformer`` layout (a
class token expanded over the batch and concatenated, a positional table added). Every
parameter of those must be computed by rules (``per_sample_plan``), and the results must equal
the definition in float64. Further transformers models (Llama, Mistral, Qwen2, Gemma, Phi,
Falcon, GPT-Neo, OPT, T5, BART, ALBERT, RoBERTa, DistilBERT, ELECTRA, DeBERTa-v2, ViT, Swin,
ConvNeXt, wav2vec2, ResNet) must equal the definition under every strategy that takes them.
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


# More transformers models, each in a tiny random configuration: what their layers do that
# GPT-2 and BERT do not (rotary embeddings, RMSNorm and grouped-query attention, a relative
# attention bias from an Embedding called without the batch, layers sharing parameters, a
# bias table indexed directly, a layer-scale Parameter, weight_norm's parametrization, a
# GroupNorm-swapped ResNet; local and sliding-window attention, offset learned positions,
# fused and parallel attention blocks, disentangled relative attention, an encoder-decoder
# classifier, a class token). "auto" and "vmap" must equal the definition; "hooks" must equal
# it or refuse with StrategyError (a layer class of the model's own has no rule).


def _hf(name):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    T, v = transformers, 40
    torch.manual_seed(0)
    ids = torch.randint(2, v, (3, 5))
    labels = torch.randint(0, 3, (3,))

    class Logits(nn.Module):
        def __init__(self, m, **kw):
            super().__init__()
            self.m, self.kw = m, kw

        def forward(self, *xs):
            keys = self.kw["keys"]
            return self.m(**dict(zip(keys, xs)), **self.kw.get("extra", {})).logits

    ce_sum = nn.CrossEntropyLoss(reduction="sum")

    def lm_sum(out, t):
        return ce_sum(out.reshape(-1, out.shape[-1]), t.reshape(-1))

    if name == "llama":  # rotary, RMSNorm, gated MLP, grouped-query attention, tied head
        m = T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=v, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
            tie_word_embeddings=True))
        mask = torch.ones(3, 5, dtype=torch.long)
        mask[1, 3:] = 0
        return Logits(m, keys=("input_ids", "attention_mask"), extra={"use_cache": False}), \
            lm_sum, (ids, mask), ids
    if name == "t5":  # relative attention bias: an Embedding called on a (T, T) table
        m = T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=v, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
            num_heads=2, relative_attention_num_buckets=8, dropout_rate=0.0,
            decoder_start_token_id=0))
        dec = ids[:, :4]
        return Logits(m, keys=("input_ids", "decoder_input_ids"), extra={"use_cache": False}), \
            lm_sum, (ids, dec), dec
    if name == "albert":  # one layer's parameters shared by every layer
        m = T.AlbertForSequenceClassification(T.AlbertConfig(
            vocab_size=v, embedding_size=8, hidden_size=16, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=32, max_position_embeddings=16,
            hidden_dropout_prob=0, attention_probs_dropout_prob=0, classifier_dropout_prob=0,
            num_labels=3))
        return Logits(m, keys=("input_ids",)), nn.CrossEntropyLoss(), ids, labels
    if name == "swin":  # a relative position bias table indexed directly
        m = T.SwinForImageClassification(T.SwinConfig(
            image_size=8, patch_size=2, num_channels=3, embed_dim=8, depths=[1, 1],
            num_heads=[2, 2], window_size=2, num_labels=3, hidden_dropout_prob=0,
            attention_probs_dropout_prob=0, drop_path_rate=0))
        return Logits(m, keys=("pixel_values",)), ce_sum, torch.randn(3, 3, 8, 8), labels
    if name == "convnext":  # layer-scale Parameter, channels-first LayerNorm
        m = T.ConvNextForImageClassification(T.ConvNextConfig(
            num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3,
            drop_path_rate=0, layer_scale_init_value=0.5))
        return Logits(m, keys=("pixel_values",)), ce_sum, torch.randn(3, 3, 16, 16), labels
    if name == "wav2vec2":  # Conv1d, GroupNorm, a weight_norm positional convolution
        m = T.Wav2Vec2ForSequenceClassification(T.Wav2Vec2Config(
            vocab_size=v, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4),
            num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
            feat_extract_norm="group", hidden_dropout=0, attention_dropout=0,
            activation_dropout=0, feat_proj_dropout=0, final_dropout=0, layerdrop=0,
            mask_time_prob=0, num_labels=3, classifier_proj_size=8))
        return Logits(m, keys=("input_values",)), ce_sum, torch.randn(3, 60), labels
    causal = {"gpt_neo": lambda: T.GPTNeoForCausalLM(T.GPTNeoConfig(  # local attention
                  vocab_size=v, max_position_embeddings=16, hidden_size=16, num_layers=2,
                  num_heads=2, attention_types=[[["global", "local"], 1]], window_size=2,
                  resid_dropout=0, embed_dropout=0, attention_dropout=0)),
              "opt": lambda: T.OPTForCausalLM(T.OPTConfig(  # positions offset by 2
                  vocab_size=v, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                  num_attention_heads=2, max_position_embeddings=16, word_embed_proj_dim=16,
                  dropout=0, attention_dropout=0)),
              "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(  # sliding window
                  vocab_size=v, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=16,
                  sliding_window=2)),
              "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(  # biased q, k, v only
                  vocab_size=v, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)),
              "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(  # scaled embedding, 1 + w
                  vocab_size=v, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                  max_position_embeddings=16)),
              "phi": lambda: T.PhiForCausalLM(T.PhiConfig(  # partial rotary, parallel block
                  vocab_size=v, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, max_position_embeddings=16, resid_pdrop=0,
                  embd_pdrop=0, attention_dropout=0)),
              "falcon": lambda: T.FalconForCausalLM(T.FalconConfig(  # fused query_key_value
                  vocab_size=v, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  hidden_dropout=0, attention_dropout=0))}
    if name in causal:
        return Logits(causal[name](), keys=("input_ids",), extra={"use_cache": False}), \
            lm_sum, ids, ids
    encoders = {"roberta": lambda: T.RobertaForSequenceClassification(T.RobertaConfig(
                    vocab_size=v, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32, max_position_embeddings=16, pad_token_id=0,
                    hidden_dropout_prob=0, attention_probs_dropout_prob=0, num_labels=3)),
                "distilbert": lambda: T.DistilBertForSequenceClassification(
                    T.DistilBertConfig(vocab_size=v, dim=16, n_layers=1, n_heads=2,
                                       hidden_dim=32, max_position_embeddings=16, dropout=0,
                                       attention_dropout=0, seq_classif_dropout=0,
                                       num_labels=3)),
                "electra": lambda: T.ElectraForSequenceClassification(T.ElectraConfig(
                    vocab_size=v, embedding_size=8, hidden_size=16, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=32, max_position_embeddings=16,
                    hidden_dropout_prob=0, attention_probs_dropout_prob=0, num_labels=3)),
                "deberta_v2": lambda: T.DebertaV2ForSequenceClassification(T.DebertaV2Config(
                    vocab_size=v, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0,
                    attention_probs_dropout_prob=0, pooler_dropout=0, num_labels=3)),
                "bart": lambda: T.BartForSequenceClassification(T.BartConfig(
                    vocab_size=v, d_model=16, encoder_layers=1, decoder_layers=1,
                    encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                    decoder_ffn_dim=32, max_position_embeddings=16, dropout=0,
                    attention_dropout=0, activation_dropout=0, classifier_dropout=0,
                    num_labels=3, eos_token_id=1, pad_token_id=0))}
    if name in encoders:  # (relative positions, disentangled attention, encoder-decoder)
        x = ids.clone()
        x[:, -1] = 1  # (BART classifies at its end-of-sequence token, id 1 here)
        return Logits(encoders[name](), keys=("input_ids",)), ce_sum, x, labels
    if name == "vit":  # a class token concatenated, a position table added
        m = T.ViTForImageClassification(T.ViTConfig(
            image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
            num_attention_heads=2, intermediate_size=32, num_labels=3, hidden_dropout_prob=0,
            attention_probs_dropout_prob=0))
        return Logits(m, keys=("pixel_values",)), ce_sum, torch.randn(3, 3, 8, 8), labels
    if name == "resnet_groupnorm":  # BatchNorm swapped for GroupNorm, as Opacus users do
        m = T.ResNetForImageClassification(T.ResNetConfig(
            num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
            layer_type="basic", num_labels=3))

        def swap(mod):
            for n, c in mod.named_children():
                if isinstance(c, nn.BatchNorm2d):
                    setattr(mod, n, nn.GroupNorm(4, c.num_features))
                else:
                    swap(c)
        swap(m)
        return Logits(m, keys=("pixel_values",)), ce_sum, torch.randn(3, 3, 16, 16), labels
    raise AssertionError(name)


def _cast(x):
    if isinstance(x, tuple):
        return tuple(_cast(t) for t in x)
    return x.to(DT) if x.is_floating_point() else x


def _definition(model, loss_fn, x, t):
    """The per-example loop, written out with torch.autograd.grad."""
    xs = x if isinstance(x, tuple) else (x,)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for i in range(xs[0].shape[0]):
        loss = loss_fn(model(*(a[i:i + 1] for a in xs)), t[i:i + 1])
        rows.append(torch.autograd.grad(loss, [p for _, p in named]))
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(named)}


@pytest.mark.parametrize("name", ["llama", "t5", "albert", "swin", "convnext", "wav2vec2",
                                  "resnet_groupnorm", "gpt_neo", "opt", "mistral", "qwen2",
                                  "gemma", "phi", "falcon", "roberta", "distilbert",
                                  "electra", "deberta_v2", "bart", "vit"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_more_transformers_models_against_the_definition(name, mode):
    model, loss_fn, x, t = _hf(name)
    model = getattr(model.to(DT), mode)()
    x, t = _cast(x), _cast(t)
    ref = _definition(model, loss_fn, x, t)
    want = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    max_norm = float(want.median())
    clip = (max_norm / want).clamp(max=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for strategy in ("auto", "hooks", "vmap"):
            try:
                got = tv.per_sample_grads(model, loss_fn, x, t, strategy=strategy)
            except tv.StrategyError:
                assert strategy != "auto"
                continue
            for n in ref:
                torch.testing.assert_close(got[n], ref[n], msg=f"{strategy} {n}")
            norms = tv.per_sample_grad_norms(model, loss_fn, x, t, strategy=strategy)
            torch.testing.assert_close(norms, want, msg=strategy)
            for p in model.parameters():
                p.grad = None
            tv.accumulate_clipped_grads(model, loss_fn, x, t, max_norm=max_norm,
                                        strategy=strategy)
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", clip, ref[n]),
                                           msg=f"{strategy} {n}")
    assert model.training == (mode == "train")


def test_resnet_batchnorm_in_training_mode_is_refused_with_the_fix_and_right_in_eval():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    net = transformers.ResNetForImageClassification(transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
        layer_type="basic", num_labels=3)).to(DT)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = net

        def forward(self, x):
            return self.m(pixel_values=x).logits

    model, loss_fn = Net(), nn.CrossEntropyLoss(reduction="sum")
    x, y = torch.randn(3, 3, 16, 16, dtype=DT), torch.randint(0, 3, (3,))
    for strategy in ("auto", "hooks", "vmap", "loop"):
        with pytest.raises(tv.PerSampleError, match=(
                r"module 'm.resnet.embedder.embedder.normalization' \(BatchNorm2d\) is in "
                r"training mode(.|\n)*Fix: put it in eval mode(.|\n)*nn.GroupNorm")):
            tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
    model.eval()
    ref = _definition(model, loss_fn, x, y)
    got = tv.per_sample_grads(model, loss_fn, x, y, strategy="hooks")
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)
    assert not model.training


def test_bloom_with_a_fully_masked_row_gives_the_definition_not_a_mixing_error():
    """A left-padded mask makes Bloom's attention softmax a row of -inf for the padded
    positions: NaN in that example's output alone. The loop gives NaN for that example and
    exact gradients for the others; the plan's data-flow probe took the NaN that reaches
    every row in the backward pass for a layer that mixes examples (PerSampleError naming
    ln_f)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=40, hidden_size=16, n_layer=1, n_head=2, hidden_dropout=0,
        attention_dropout=0)).to(DT).eval()

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = bloom

        def forward(self, ids, mask):
            return self.m(input_ids=ids, attention_mask=mask, use_cache=False).logits

    model = LM()
    ids = torch.randint(0, 40, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[2, :2] = 0
    ref = _definition(model, lambda o, t: _lm_loss(o, t) * t.numel(), (ids, mask), ids)
    assert ref["m.transformer.ln_f.weight"][2].isnan().any()
    assert ref["m.transformer.ln_f.weight"][:2].isfinite().all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.per_sample_grads(model, lambda o, t: _lm_loss(o, t) * t.numel(), (ids, mask),
                                  ids)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], equal_nan=True, msg=n)
