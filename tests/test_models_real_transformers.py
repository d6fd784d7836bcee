"""The per-sample functions and the Jacobians on transformers models nobody here wrote.

Each model is built from a tiny random configuration (no download) in float64: GPT-2, BERT,
RoBERTa, DistilBERT, ViT, DeiT, T5, Llama, Mistral, GPT-NeoX, OPT, Whisper (encoder
classifier and encoder-decoder), CLIP text and vision towers, BART, ALBERT (one layer's
parameters shared by both layers), MobileBERT, ConvNeXt, Swin and ResNet (BatchNorm in eval
mode, GroupNorm swapped in). References are independent of the package: the per-example
loop written with ``torch.autograd.grad``, ``torch.func.jacrev`` and
``torch.autograd.functional.jacobian``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.func import jacrev

import torch_vjp as tv

T = pytest.importorskip("transformers")
T.logging.set_verbosity_error()

DT = torch.float64
V = 40
STRATEGIES = ("auto", "hooks", "vmap", "loop")


class Head(nn.Module):
    """A transformers model called with keyword inputs, one output field taken."""

    def __init__(self, m: nn.Module, keys: tuple[str, ...], take: str = "logits", **extra):
        super().__init__()
        self.m, self.keys, self.take, self.extra = m, keys, take, extra

    def forward(self, *xs):
        return getattr(self.m(**dict(zip(self.keys, xs)), **self.extra), self.take)


_ce = nn.CrossEntropyLoss(reduction="sum")


def _lm(out, t):
    return _ce(out.reshape(-1, out.shape[-1]), t.reshape(-1))


def _sq(out):
    return out.pow(2).sum()


def _swap_batchnorm(mod: nn.Module) -> None:
    for n, c in mod.named_children():
        if isinstance(c, nn.BatchNorm2d):
            setattr(mod, n, nn.GroupNorm(4, c.num_features))
        else:
            _swap_batchnorm(c)


def _text(name):
    enc = dict(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=32, max_position_embeddings=16, num_labels=3)
    dec = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
               max_position_embeddings=16)
    return {
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=V, n_positions=8)),
        "bert": lambda: T.BertForSequenceClassification(T.BertConfig(**enc)),
        "roberta": lambda: T.RobertaForSequenceClassification(T.RobertaConfig(
            pad_token_id=0, **enc)),
        "distilbert": lambda: T.DistilBertForSequenceClassification(T.DistilBertConfig(
            vocab_size=V, dim=16, n_layers=1, n_heads=2, hidden_dim=32,
            max_position_embeddings=16, num_labels=3)),
        "albert": lambda: T.AlbertForSequenceClassification(T.AlbertConfig(
            embedding_size=8, **{**enc, "num_hidden_layers": 2})),
        "mobilebert": lambda: T.MobileBertForSequenceClassification(T.MobileBertConfig(
            embedding_size=8, intra_bottleneck_size=8, true_hidden_size=8,
            num_feedforward_networks=2, **{**enc, "intermediate_size": 16})),
        "bart": lambda: T.BartForSequenceClassification(T.BartConfig(
            vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32, max_position_embeddings=16, num_labels=3, eos_token_id=1,
            pad_token_id=0)),
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(
            num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1, **dec)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(
            num_attention_heads=4, num_key_value_heads=1, sliding_window=3, **dec)),
        "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            num_attention_heads=2, rotary_pct=0.5, hidden_dropout=0.1, attention_dropout=0.1,
            **dec)),
        "opt": lambda: T.OPTForCausalLM(T.OPTConfig(
            vocab_size=V, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
            num_attention_heads=2, max_position_embeddings=16, word_embed_proj_dim=16)),
        "clip_text": lambda: T.CLIPTextModel(T.CLIPTextConfig(
            vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, max_position_embeddings=8, eos_token_id=1, dropout=0.1,
            attention_dropout=0.1)),
    }[name]()


def _vision(name):
    vit = dict(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
               num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    return {
        "vit": lambda: T.ViTForImageClassification(T.ViTConfig(num_labels=3, **vit)),
        "deit": lambda: T.DeiTForImageClassificationWithTeacher(T.DeiTConfig(
            num_labels=3, **vit)),
        "clip_vision": lambda: T.CLIPVisionModel(T.CLIPVisionConfig(
            dropout=0.1, attention_dropout=0.1,
            **{k: v for k, v in vit.items() if k != "num_channels"})),
        "swin": lambda: T.SwinForImageClassification(T.SwinConfig(
            image_size=8, patch_size=2, num_channels=3, embed_dim=8, depths=[1, 1],
            num_heads=[2, 2], window_size=2, num_labels=3, drop_path_rate=0.1)),
        "convnext": lambda: T.ConvNextForImageClassification(T.ConvNextConfig(
            num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3,
            drop_path_rate=0.1, layer_scale_init_value=0.5)),
        "resnet_bn": lambda: T.ResNetForImageClassification(T.ResNetConfig(
            num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
            layer_type="basic", num_labels=3)),
    }[name]()


def _whisper(s2s: bool):
    cfg = T.WhisperConfig(
        vocab_size=V, num_mel_bins=4, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, d_model=16, max_source_positions=4, max_target_positions=8,
        num_labels=3, dropout=0.1, decoder_start_token_id=0, pad_token_id=0, bos_token_id=0,
        eos_token_id=1)
    return (T.WhisperForConditionalGeneration if s2s else T.WhisperForAudioClassification)(cfg)


#: what "hooks" computes for every parameter (every layer has a rule): the plan must say so
ALL_RULES = {"gpt2", "bert", "roberta", "distilbert", "albert", "gpt_neox", "clip_text", "vit",
             "deit", "clip_vision", "resnet_bn", "resnet_gn", "whisper"}
MODELS = ["gpt2", "bert", "roberta", "distilbert", "albert", "mobilebert", "bart", "llama",
          "mistral", "gpt_neox", "opt", "clip_text", "t5", "whisper", "whisper_s2s", "vit",
          "deit", "clip_vision", "swin", "convnext", "resnet_bn", "resnet_gn"]


def build(name: str, batch: int = 3, seq: int = 6):
    """``(model, loss_fn, inputs, targets)`` in float64, weights drawn from seed 0."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, V, (batch, seq), generator=g)
    labels = torch.randint(0, 3, (batch,), generator=g)
    torch.manual_seed(0)
    if name in ("gpt2", "mistral", "gpt_neox", "opt"):
        return Head(_text(name), ("input_ids",), use_cache=False).to(DT), _lm, ids, ids
    if name == "llama":  # a padding mask: vmap cannot batch transformers' mask code
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[1, seq - 2:] = 0
        m = Head(_text(name), ("input_ids", "attention_mask"), use_cache=False)
        return m.to(DT), _lm, (ids, mask), ids
    if name == "bart":
        ids[:, -1] = 1  # (BART classifies at its end-of-sequence token)
    if name in ("bert", "roberta", "distilbert", "albert", "mobilebert", "bart"):
        return Head(_text(name), ("input_ids",)).to(DT), _ce, ids, labels
    if name == "clip_text":
        return Head(_text(name), ("input_ids",), take="pooler_output").to(DT), _sq, ids, None
    if name == "t5":
        m = T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
            num_heads=2, relative_attention_num_buckets=8, decoder_start_token_id=0))
        dec = ids[:, :4]
        return (Head(m, ("input_ids", "decoder_input_ids"), use_cache=False).to(DT), _lm,
                (ids, dec), dec)
    if name.startswith("whisper"):
        feats = torch.randn(batch, 4, 8, generator=g, dtype=DT)
        if name == "whisper":
            return Head(_whisper(False), ("input_features",)).to(DT), _ce, feats, labels
        dec = ids[:, :4]
        m = Head(_whisper(True), ("input_features", "decoder_input_ids"), use_cache=False)
        return m.to(DT), _lm, (feats, dec), dec
    size = 16 if name in ("convnext", "resnet_bn", "resnet_gn") else 8
    img = torch.randn(batch, 3, size, size, generator=g, dtype=DT)
    if name == "resnet_gn":
        m = _vision("resnet_bn")
        _swap_batchnorm(m)
    else:
        m = _vision(name)
    if name == "clip_vision":
        return Head(m, ("pixel_values",), take="pooler_output").to(DT), _sq, img, None
    return Head(m, ("pixel_values",)).to(DT), _ce, img, labels


def definition(model, loss_fn, x, t):
    """The per-example loop: example i's own gradient, with ``torch.autograd.grad``."""
    xs = x if isinstance(x, tuple) else (x,)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for i in range(xs[0].shape[0]):
        out = model(*(a[i:i + 1] for a in xs))
        loss = loss_fn(out) if t is None else loss_fn(out, t[i:i + 1])
        rows.append(torch.autograd.grad(loss, [p for _, p in named]))
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(named)}


def _state(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [m.training for m in model.modules()],
            [(p.requires_grad, None if p.grad is None else p.grad.clone())
             for p in model.parameters()])


def _assert_same_state(before, after):
    assert before[0].keys() == after[0].keys()
    for k in before[0]:
        assert torch.equal(before[0][k], after[0][k]), k
    assert before[1] == after[1]
    for (r1, g1), (r2, g2) in zip(before[2], after[2]):
        assert r1 == r2 and (g1 is None) == (g2 is None)
        assert g1 is None or torch.equal(g1, g2)


def _cat_norms(grads):
    return torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)


@pytest.mark.parametrize("name", MODELS)
def test_every_strategy_equals_the_per_example_loop_and_keeps_the_model(name):
    """Eval mode: grads, norms and the clipped step equal the definition under every
    strategy that takes the model; one that does not raises StrategyError naming the way
    out; the plan names each parameter's route; nothing of the model changes but .grad by
    accumulate_clipped_grads, which adds the clipped sum to what was there."""
    model, loss_fn, x, t = build(name)
    model.eval()
    ref = definition(model, loss_fn, x, t)
    want = _cat_norms(ref)
    max_norm = float(want.median())
    clip = (max_norm / want).clamp(max=1.0)
    params = [p for p in model.parameters() if p.requires_grad]
    for k, p in enumerate(params):  # a .grad the user holds already
        p.grad = torch.full_like(p, 0.5 + k)
    done = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for strategy in STRATEGIES:
            before = _state(model)
            try:
                plan = tv.per_sample_plan(model, loss_fn, x, t, strategy=strategy)
                got = tv.per_sample_grads(model, loss_fn, x, t, strategy=strategy)
            except tv.StrategyError as e:
                assert strategy in ("hooks", "vmap"), (strategy, str(e))
                assert f"strategy={strategy!r}" in str(e)
                assert ("strategy='auto'" in str(e)) and (
                    "strategy='loop'" in str(e) or "strategy='vmap'" in str(e))
                continue
            assert list(got) == [n for n, _ in model.named_parameters() if n in ref]
            for n in ref:
                torch.testing.assert_close(got[n], ref[n], msg=f"{strategy} {n}")
                row = plan[n]
                assert row.method in ("rule", "vmap", "loop"), (strategy, row)
                assert (row.how if row.method == "rule" else row.reason), (strategy, row)
            if strategy in ("vmap", "loop"):
                assert {plan[n].method for n in ref} == {strategy}
            if strategy == "hooks" or (strategy == "auto" and name in ALL_RULES):
                assert {plan[n].method for n in ref} == {"rule"}, strategy
            norms = tv.per_sample_grad_norms(model, loss_fn, x, t, strategy=strategy)
            torch.testing.assert_close(norms, want, msg=strategy)
            _assert_same_state(before, _state(model))
            held = [p.grad.clone() for p in params]
            back = tv.accumulate_clipped_grads(model, loss_fn, x, t, max_norm=max_norm,
                                               strategy=strategy)
            torch.testing.assert_close(back, want, msg=strategy)
            for (n, p), g in zip([(n, p) for n, p in model.named_parameters()
                                  if p.requires_grad], held):
                torch.testing.assert_close(p.grad - g, torch.einsum("b,b...->...", clip, ref[n]),
                                           msg=f"{strategy} {n}")
                p.grad = g
            done.append(strategy)
    assert "auto" in done and "loop" in done
    assert (name in ALL_RULES) <= ("hooks" in done)
    assert not model.training


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "gpt_neox", "clip_vision", "swin",
                                  "convnext", "whisper_s2s", "resnet_gn"])
def test_train_mode_with_dropout_works_under_every_strategy_that_takes_the_model(name):
    """Train mode, dropout (and stochastic depth) drawing: every strategy computes or
    refuses with StrategyError; the results are finite, the norms are those of one draw's
    per-sample gradients, and the model stays in train mode with its state."""
    model, loss_fn, x, t = build(name)
    model.train()
    before = _state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for strategy in STRATEGIES:
            try:
                got = tv.per_sample_grads(model, loss_fn, x, t, strategy=strategy)
            except tv.StrategyError as e:
                assert strategy in ("hooks", "vmap"), (strategy, str(e))
                continue
            assert all(torch.isfinite(g).all() for g in got.values()), strategy
            norms = tv.per_sample_grad_norms(model, loss_fn, x, t, strategy=strategy)
            assert norms.shape == (3,) and torch.isfinite(norms).all()
            _assert_same_state(before, _state(model))
    assert all(m.training for m in model.modules())


def test_resnet_with_batchnorm_in_train_mode_is_refused_naming_the_layer_and_fixes():
    model, loss_fn, x, t = build("resnet_bn")
    model.train()
    for strategy in STRATEGIES:
        with pytest.raises(tv.PerSampleError, match=(
                r"(?s)'m.resnet.embedder.embedder.normalization' \(BatchNorm2d\) is in "
                r"training mode.*eval mode.*GroupNorm")):
            tv.per_sample_grads(model, loss_fn, x, t, strategy=strategy)
    assert model.training


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_example_gets_its_own_dropout_mask_and_all_its_gradients_share_it(strategy):
    """BERT's classifier dropout (p=0.5) on four copies of one example: the units a copy's
    mask dropped have zero gradient in the classifier's weight columns and, one layer down,
    in the pooler's bias, the same units (one draw per example for all its gradients); the
    copies' masks differ (each example draws its own). The call that plans draws from the
    caller's generator as a later call does: the same seed gives the same gradients."""
    torch.manual_seed(0)
    m = T.BertForSequenceClassification(T.BertConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=3, classifier_dropout=0.5))
    model = Head(m, ("input_ids",)).to(DT).train()
    ids = torch.randint(2, V, (1, 6)).expand(4, -1).contiguous()
    y = torch.zeros(4, dtype=torch.long)
    torch.manual_seed(3)
    g = tv.per_sample_grads(model, _ce, ids, y, strategy=strategy)
    torch.manual_seed(3)  # (the first call planned and checked: its forwards drew nothing)
    again = tv.per_sample_grads(model, _ce, ids, y, strategy=strategy)
    for n in g:
        assert torch.equal(g[n], again[n]), n
    dropped = g["m.classifier.weight"].abs().sum(1) == 0
    assert torch.equal(dropped, g["m.bert.pooler.dense.bias"] == 0)
    assert dropped.any(1).all() and not dropped.all(1).any()
    assert len({tuple(r.tolist()) for r in dropped}) > 1


def test_a_padding_mask_vmap_cannot_batch_is_refused_by_vmap_and_looped_by_auto():
    """transformers' mask code asks ``padding_mask.all()``, which vmap cannot batch:
    ``"vmap"`` raises StrategyError naming the module and the alternatives, ``"auto"`` warns
    and computes the definition."""
    model, loss_fn, x, t = build("llama")
    model.eval()

    class LlamaHead(Head):  # (the warning is shown once per model class)
        pass

    model.__class__ = LlamaHead
    with pytest.raises(tv.StrategyError, match=(
            r"(?s)strategy='vmap' cannot batch this model in module 'm.model' \(LlamaModel\)"
            r".*Alternatives: strategy='loop'.*strategy='auto'")):
        tv.per_sample_grads(model, loss_fn, x, t, strategy="vmap")
    ref = definition(model, loss_fn, x, t)
    with pytest.warns(tv.TorchVJPWarning, match="could not vectorise"):
        got = tv.per_sample_grads(model, loss_fn, x, t, strategy="auto")
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_a_model_wrapped_in_torch_compile(name):
    model, loss_fn, x, t = build(name)
    model.eval()
    ref = definition(model, loss_fn, x, t)
    compiled = torch.compile(model, backend="aot_eager")
    for strategy in STRATEGIES:
        got = tv.per_sample_grads(compiled, loss_fn, x, t, strategy=strategy)
        for n in ref:
            torch.testing.assert_close(got["_orig_mod." + n], ref[n], msg=f"{strategy} {n}")


def _of_embeddings(name):
    """A small function of a model's input embeddings (``f(e)``), its point, and a function
    of one 2-D parameter (``fp(w)``) with its point."""
    model, _, x, _ = build(name, batch=2, seq=4)
    inner = model.m.eval()
    ids = x[0] if isinstance(x, tuple) else x
    rest = dict(zip(model.keys[1:], x[1:])) if isinstance(x, tuple) else {}
    e = inner.get_input_embeddings()(ids).detach()

    def f(e):
        out = inner(inputs_embeds=e, **rest, **model.extra)
        return getattr(out, model.take)[..., :3].tanh()

    pname = {"gpt2": "transformer.wpe.weight", "t5": "lm_head.weight"}.get(name,
                                                                         "classifier.weight")
    p = inner.get_parameter(pname)
    state = {n: q.detach() for n, q in inner.named_parameters()}
    state.update(inner.named_buffers())

    def fp(w):
        out = torch.func.functional_call(inner, {**state, pname: w}, (),
                                         {"input_ids": ids, **rest, **model.extra})
        return getattr(out, model.take)[..., :3].tanh()

    return f, e, fp, p.detach().clone()


@pytest.mark.parametrize("name", ["bert", "gpt2", "albert"])
def test_jacobians_vjp_jvp_of_a_model_against_jacrev(name):
    """The logits w.r.t. the input embeddings and w.r.t. a parameter, every strategy.
    Forward mode through scaled_dot_product_attention's CPU kernel, which has no
    forward-mode formula, must refuse with the fix (reverse mode) or be right; BERT's
    classifier weight does not reach the attention, and forward mode must be right there."""
    f, e, fp, w = _of_embeddings(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fn, x in ((f, e), (fp, w)):
            ref = jacrev(fn)(x)
            for strategy in ("auto", "rev", "fwd", "rev-loop", "fwd-loop"):
                if fn is fp and name == "bert":
                    torch.testing.assert_close(tv.jacobian(fn, x, strategy=strategy), ref)
                    continue
                try:
                    J = tv.jacobian(fn, x, strategy=strategy)
                except tv.StrategyNotImplementedError as err:
                    assert strategy.startswith("fwd")
                    assert "forward-mode" in str(err) and "Fix: strategy='rev" in str(err)
                    continue
                torch.testing.assert_close(J, ref, msg=strategy)
            x2 = x.clone().requires_grad_()
            torch.testing.assert_close(tv.jacobian_of(fn(x2), x2), ref)
            out, pull = tv.vjp(fn, x)
            flat = ref.reshape(out.numel(), x.numel())
            ct = torch.randn(3, *out.shape, dtype=DT)
            (vb,) = pull(ct, batched=True)
            torch.testing.assert_close(vb.flatten(1), ct.flatten(1) @ flat)
            tan = torch.randn(3, *x.shape, dtype=DT)
            try:
                _, tb = tv.jvp(fn, (x,), (tan,), batched=True)
            except tv.JacobianNotImplementedError as err:
                assert "forward-mode" in str(err)
                continue
            torch.testing.assert_close(tb.flatten(1), tan.flatten(1) @ flat.T)


def test_t5_jacobian_where_torch_func_cannot_differentiate_its_attention():
    """T5's attention adds a position bias that torch.func.jacrev cannot differentiate
    through scaled_dot_product_attention's CPU kernel; torch_vjp.jacobian computes it, and it
    equals plain autograd's (torch.autograd.functional.jacobian)."""
    f, e, _, _ = _of_embeddings("t5")
    ref = torch.autograd.functional.jacobian(f, e)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for strategy in ("auto", "rev"):
            torch.testing.assert_close(tv.jacobian(f, e, strategy=strategy), ref, msg=strategy)


def test_compiled_jacobian_of_a_model(fresh_dynamo, aot_eager_unless_inductor):
    f, e, _, _ = _of_embeddings("bert")
    ref = jacrev(f)(e)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):  # compiled and checked, then the program reused
            torch.testing.assert_close(tv.jacobian(f, e, strategy="rev", compile=True), ref)
