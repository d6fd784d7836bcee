"""Jacobians of real models (tiny, random-initialised, float64) against torch.func: input
embeddings of transformers models, parameters as pytrees, with the model's state kept."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.func import functional_call, jacrev

import torch_vjp as tv

transformers = pytest.importorskip("transformers")

D = torch.float64


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        attention_dropout=0.0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(
        cfg, attn_implementation="eager").to(D).eval()


def _jacobian_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]


def test_llama_logits_by_input_embeddings_auto_agrees_without_warning():
    # Llama's RMSNorm computes in float32 inside a float64 model: "auto"'s check of its
    # route warned that f "draws random numbers, is not smooth at this point, or computes
    # otherwise on each call" (a gap of 2.2e-08 at a scale of 0.23, float32's rounding).
    model = _llama()
    emb = torch.randn(1, 4, 16, dtype=D)
    mask = torch.tensor([[1, 1, 1, 0]])

    def logits(e):
        return model(inputs_embeds=e, attention_mask=mask).logits

    got, warned = _jacobian_warnings(lambda: tv.jacobian(logits, emb))
    assert warned == []
    torch.testing.assert_close(got, jacrev(logits)(emb), rtol=0, atol=1e-12)
    assert not model.training


def test_llama_jacobian_by_parameters_as_a_dict():
    model = _llama()
    emb = torch.randn(1, 3, 16, dtype=D)
    params = {k: v.detach() for k, v in model.named_parameters()}
    few = {k: params[k] for k in list(params)[1:3]}
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def g(p, e):
        return functional_call(model, {**params, **p}, (), {"inputs_embeds": e}).logits

    want = jacrev(g, argnums=(0, 1))(few, emb)
    for strategy in ("auto", "rev", "rev-loop"):
        got, warned = _jacobian_warnings(
            lambda s=strategy: tv.jacobian(g, few, emb, argnums=(0, 1), strategy=s))
        assert warned == []
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_t5_encoder_with_relative_position_bias_every_strategy_agrees():
    # T5LayerNorm computes in float32 too: routes agree at float32's rounding, and "auto"
    # must neither warn nor switch routes for it.
    cfg = transformers.T5Config(vocab_size=20, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                num_heads=2, dropout_rate=0.0)
    torch.manual_seed(0)
    model = transformers.T5EncoderModel._from_config(cfg, attn_implementation="eager").to(D)
    model.eval()
    emb = torch.randn(1, 3, 16, dtype=D)
    mask = torch.tensor([[1, 1, 0]])

    def hidden(e):
        return model(inputs_embeds=e, attention_mask=mask).last_hidden_state

    want = jacrev(hidden)(emb)
    for strategy in ("auto", "rev", "fwd", "rev-loop"):
        got, warned = _jacobian_warnings(lambda s=strategy: tv.jacobian(hidden, emb, strategy=s))
        assert warned == [], strategy
        # (at float32's rounding: forward mode sums in another order)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=strategy)


def test_packed_lstm_falls_back_to_the_loop_and_matches_autograd():
    torch.manual_seed(0)
    rnn = torch.nn.LSTM(3, 4, batch_first=True).to(D)
    x = torch.randn(2, 5, 3, dtype=D)
    lengths = torch.tensor([5, 3])

    def f(x):
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
        out, _ = rnn(packed)
        return torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]

    xx = x.clone().requires_grad_()
    y = f(xx).reshape(-1)
    want = torch.stack([torch.autograd.grad(y[i], xx, retain_graph=True)[0]
                        for i in range(y.numel())]).reshape(f(x).shape + x.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for strategy in ("auto", "rev-loop"):
            torch.testing.assert_close(tv.jacobian(f, x, strategy=strategy), want,
                                       rtol=0, atol=1e-12)
