"""A sweep over layer configurations (more than Opacus's test set): every strategy's
per-sample gradients, norms and clipped sums against the per-example loop in float64, the
model's state (state_dict, training flags, ``.grad``) left as it was, and each refusal a
StrategyError that names the fix."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch import nn

import torch_vjp as tv

D = torch.float64
B = 3
IDX = torch.tensor([[0, 1, 2, 1], [3, 0, 0, 5], [2, 2, 4, 1]])


def _r(*shape):
    return torch.randn(*shape, dtype=D)


class _First(nn.Module):
    """A layer whose output is a tuple (recurrent layers, attention): its first entry."""

    def __init__(self, layer, seq_first=False):
        super().__init__()
        self.layer, self.seq_first = layer, seq_first

    def forward(self, x):
        if self.seq_first:
            return self.layer(x.transpose(0, 1))[0].transpose(0, 1)
        return self.layer(x)[0]


class _Unbatched(nn.Module):
    """A recurrent layer called on each example's unbatched (L, H) input."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return torch.stack([self.layer(xi)[0] for xi in x])


class _LearnedH0(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn = kind(3, 4, num_layers=2, batch_first=True)
        self.h0 = nn.Parameter(torch.randn(2, 1, 4))

    def forward(self, x):
        h = self.h0.expand(2, x.shape[0], 4).contiguous()
        return self.rnn(x, (h, torch.zeros_like(h)) if isinstance(self.rnn, nn.LSTM) else h)[0]


class _Attention(nn.Module):
    """``nn.MultiheadAttention`` on batch-first inputs (sequence-first modules get them
    transposed), with the masks asked for."""

    def __init__(self, batch_first=True, padding=False, causal=False, weights=True, **kw):
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, batch_first=batch_first, **kw)
        self.bf, self.padding, self.causal, self.weights = batch_first, padding, causal, weights

    def forward(self, q, k, v):
        mask = torch.triu(torch.ones(q.shape[1], k.shape[1], dtype=torch.bool), 1) \
            if self.causal else None
        pad = None
        if self.padding:
            pad = torch.zeros(q.shape[0], k.shape[1], dtype=torch.bool)
            pad[:, -1] = True
        if not self.bf:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        out = self.mha(q, k, v, key_padding_mask=pad, attn_mask=mask,
                       need_weights=self.weights)[0]
        return out if self.bf else out.transpose(0, 1)


class _SelfAttention(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, batch_first=True, **kw)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


class _Bag(nn.Module):
    """EmbeddingBag on each example's row split into bags of two, through offsets (1-D
    input), optionally with per-sample weights."""

    def __init__(self, weighted=False, **kw):
        super().__init__()
        self.bag, self.weighted = nn.EmbeddingBag(6, 3, **kw), weighted
        self.last = kw.get("include_last_offset", False)

    def forward(self, idx, w=None):
        flat = idx.reshape(-1)
        offsets = torch.arange(0, flat.numel(), 2)
        if self.last:
            offsets = torch.cat([offsets, torch.tensor([flat.numel()])])
        w = None if w is None else w.reshape(-1)
        return self.bag(flat, offsets, per_sample_weights=w).reshape(idx.shape[0], -1)


class _Bag2d(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.bag = nn.EmbeddingBag(6, 3, **kw)

    def forward(self, idx, w=None):
        return self.bag(idx, per_sample_weights=w)


class _TiedEmbedding(nn.Module):
    """An Embedding whose table is the output Linear's weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.emb(idx))).sum(1)


class _TiedConv(nn.Module):
    """A Conv1d's kernel used again by a ConvTranspose1d, and a GroupNorm's weight by a
    LayerNorm."""

    def __init__(self):
        super().__init__()
        self.conv, self.convt = nn.Conv1d(2, 3, 3), nn.ConvTranspose1d(3, 2, 3)
        self.convt.weight = self.conv.weight
        self.gn, self.ln = nn.GroupNorm(1, 3), nn.LayerNorm(3)
        self.ln.weight = self.gn.weight

    def forward(self, x):
        h = self.gn(self.conv(x))
        return self.convt(self.ln(h.transpose(1, 2)).transpose(1, 2))


class _Shared(nn.Module):
    """One Linear called twice, on a batch-first and on a sequence-first input."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x):
        a = self.lin(torch.tanh(self.norm(self.lin(x))))
        return a + self.lin(x.transpose(0, 1)).transpose(0, 1)


class _Frozen(nn.Module):
    """A frozen bias holding a ``.grad`` of its own, which nothing may change."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Conv1d(1, 2, 3)
        self.a.bias.requires_grad_(False)

    def forward(self, x):
        return self.b(self.a(x).unsqueeze(1))


def _convs():
    out = {}
    for d in (1, 2, 3):
        conv, convt = getattr(nn, f"Conv{d}d"), getattr(nn, f"ConvTranspose{d}d")
        side = 5 if d < 3 else 4
        sp, sp2 = (side,) * d, (3,) * d
        out.update({
            f"conv{d}d_groups_dilation": (lambda c=conv: c(4, 6, 3, groups=2, dilation=2,
                                                           padding=2), (4, *sp)),
            f"conv{d}d_same_nobias": (lambda c=conv: c(2, 3, 3, padding="same", bias=False),
                                      (2, *sp)),
            f"conv{d}d_same_even_kernel": (lambda c=conv: c(2, 3, 2, padding="same"),
                                           (2, *sp)),
            f"conv{d}d_valid_stride": (lambda c=conv: c(2, 3, 2, stride=2, padding="valid"),
                                       (2, *sp)),
            f"conv{d}d_tuple_padding": (lambda c=conv, d=d: c(
                2, 3, 3, padding=tuple(range(1, d + 1)), stride=(1,) * (d - 1) + (2,)),
                (2, *sp)),
            f"conv{d}d_depthwise": (lambda c=conv: c(3, 6, 3, groups=3, padding=1), (3, *sp)),
            f"convT{d}d_output_padding": (lambda c=convt: c(2, 3, 3, stride=2,
                                                            output_padding=1), (2, *sp2)),
            f"convT{d}d_groups_dilation": (lambda c=convt: c(4, 6, 3, groups=2, dilation=2,
                                                             padding=1), (4, *sp2)),
            f"convT{d}d_stride_dilation_nobias": (lambda c=convt: c(
                2, 2, 2, stride=3, output_padding=1, dilation=2, bias=False), (2, *sp2)),
        })
        for mode in ("reflect", "replicate", "circular"):
            out[f"conv{d}d_{mode}"] = (lambda c=conv, m=mode: c(2, 3, 3, padding=1,
                                                                padding_mode=m), (2, *sp))
        out[f"conv{d}d_same_dilated_{d}"] = (lambda c=conv, m=("zeros", "reflect",
                                                               "circular")[d - 1]: c(
            2, 4, 2, padding="same", dilation=2, groups=2, padding_mode=m), (2, *sp))
    return {n: (mk, lambda s=s: (_r(B, *s),)) for n, (mk, s) in out.items()}


_NORMS = {
    "layernorm_no_affine": (lambda: nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(
        4, elementwise_affine=False)), lambda: (_r(B, 4),)),
    "layernorm_no_bias": (lambda: nn.LayerNorm(4, bias=False), lambda: (_r(B, 3, 4),)),
    "layernorm_2d_shape": (lambda: nn.LayerNorm((3, 4)), lambda: (_r(B, 2, 3, 4),)),
    "layernorm_whole_example": (lambda: nn.LayerNorm((2, 3, 4)), lambda: (_r(B, 2, 3, 4),)),
    "rmsnorm": (lambda: nn.RMSNorm(4), lambda: (_r(B, 3, 4),)),
    "rmsnorm_eps_2d_shape": (lambda: nn.RMSNorm((3, 4), eps=1e-3), lambda: (_r(B, 2, 3, 4),)),
    "rmsnorm_no_affine": (lambda: nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(
        4, elementwise_affine=False)), lambda: (_r(B, 4),)),
    "groupnorm_1": (lambda: nn.GroupNorm(1, 4), lambda: (_r(B, 4, 3, 2),)),
    "groupnorm_2": (lambda: nn.GroupNorm(2, 4, eps=1e-2), lambda: (_r(B, 4, 2, 2, 2),)),
    "groupnorm_C": (lambda: nn.GroupNorm(4, 4), lambda: (_r(B, 4, 3),)),
    "groupnorm_2d_input": (lambda: nn.Sequential(nn.Linear(4, 4), nn.GroupNorm(2, 4)),
                           lambda: (_r(B, 4),)),
    "groupnorm_no_affine": (lambda: nn.Sequential(nn.Conv1d(4, 4, 1), nn.GroupNorm(
        2, 4, affine=False)), lambda: (_r(B, 4, 5),)),
}
for _d in (1, 2, 3):
    _in = getattr(nn, f"InstanceNorm{_d}d")
    _sp = (5,) * _d if _d < 3 else (3,) * 3
    _NORMS[f"instancenorm{_d}d_affine"] = (lambda n=_in: n(3, affine=True),
                                           lambda s=_sp: (_r(B, 3, *s),))
    _NORMS[f"instancenorm{_d}d_affine_running"] = (
        lambda n=_in: n(3, affine=True, track_running_stats=True),
        lambda s=_sp: (_r(B, 3, *s),))
_NORMS["instancenorm_running_no_affine"] = (lambda: nn.Sequential(
    nn.Conv1d(2, 3, 1), nn.InstanceNorm1d(3, track_running_stats=True)),
    lambda: (_r(B, 2, 5),))

_EMBEDDINGS = {
    "embedding_padding_idx": (lambda: nn.Embedding(6, 3, padding_idx=0), lambda: (IDX,)),
    "embedding_max_norm": (lambda: nn.Embedding(6, 3, max_norm=1.0), lambda: (IDX,)),
    "embedding_freq": (lambda: nn.Embedding(6, 3, scale_grad_by_freq=True), lambda: (IDX,)),
    "embedding_freq_padding": (lambda: nn.Embedding(6, 3, scale_grad_by_freq=True,
                                                    padding_idx=2), lambda: (IDX,)),
    "bag_psw_2d": (lambda: _Bag2d(mode="sum"), lambda: (IDX, _r(B, 4))),
    "bag_psw_padding": (lambda: _Bag2d(mode="sum", padding_idx=2), lambda: (IDX, _r(B, 4))),
    "bag_offsets_psw": (lambda: _Bag(mode="sum"), lambda: (IDX, _r(B, 4))),
    "bag_max_norm": (lambda: _Bag2d(mode="mean", max_norm=1.0), lambda: (IDX,)),
    "bag_freq": (lambda: _Bag2d(mode="sum", scale_grad_by_freq=True), lambda: (IDX,)),
}
for _m in ("sum", "mean", "max"):
    _EMBEDDINGS[f"bag_{_m}_2d_padding"] = (lambda m=_m: _Bag2d(mode=m, padding_idx=1),
                                           lambda: (IDX,))
    _EMBEDDINGS[f"bag_{_m}_offsets"] = (lambda m=_m: _Bag(mode=m), lambda: (IDX,))
    _EMBEDDINGS[f"bag_{_m}_offsets_last_padding"] = (
        lambda m=_m: _Bag(mode=m, include_last_offset=True, padding_idx=1), lambda: (IDX,))

_RECURRENT = {}
for _k in (nn.RNN, nn.GRU, nn.LSTM):
    _n = _k.__name__
    _RECURRENT.update({
        f"{_n}_2_layers_bidirectional_batch_first": (
            lambda k=_k: _First(k(3, 4, num_layers=2, bidirectional=True, batch_first=True)),
            lambda: (_r(B, 5, 3),)),
        f"{_n}_2_layers_bidirectional_sequence_first": (
            lambda k=_k: _First(k(3, 4, num_layers=2, bidirectional=True), seq_first=True),
            lambda: (_r(B, 5, 3),)),
        f"{_n}_unbatched": (lambda k=_k: _Unbatched(k(3, 4, num_layers=2, bidirectional=True)),
                            lambda: (_r(B, 5, 3),)),
        f"{_n}_learned_h0": (lambda k=_k: _LearnedH0(k), lambda: (_r(B, 5, 3),)),
    })
_RECURRENT["LSTM_proj_size"] = (lambda: _First(nn.LSTM(
    3, 4, num_layers=2, batch_first=True, proj_size=2, bidirectional=True)),
    lambda: (_r(B, 5, 3),))
_RECURRENT["RNN_relu_no_bias"] = (lambda: _First(nn.RNN(
    3, 4, nonlinearity="relu", bias=False, batch_first=True)), lambda: (_r(B, 5, 3),))


def _qkv(kdim=4, vdim=4):
    return lambda: (_r(B, 3, 4), _r(B, 5, kdim), _r(B, 5, vdim))


_ATTENTION = {
    "mha_batch_first": (lambda: _Attention(), _qkv()),
    "mha_sequence_first": (lambda: _Attention(batch_first=False), _qkv()),
    "mha_kdim_vdim": (lambda: _Attention(kdim=3, vdim=5), _qkv(3, 5)),
    "mha_bias_kv_zero_attn": (lambda: _Attention(add_bias_kv=True, add_zero_attn=True), _qkv()),
    "mha_masks_no_weights": (lambda: _Attention(padding=True, causal=True, weights=False),
                             _qkv()),
    "mha_sequence_first_padding_bias_kv": (lambda: _Attention(
        batch_first=False, padding=True, add_bias_kv=True, weights=False), _qkv()),
    "mha_sequence_first_kdim_no_bias": (lambda: _Attention(
        batch_first=False, kdim=3, vdim=5, add_zero_attn=True, bias=False), _qkv(3, 5)),
    "self_attention_packed": (lambda: _SelfAttention(), lambda: (_r(B, 3, 4),)),
    "self_attention_bias_kv_no_bias": (lambda: _SelfAttention(
        add_bias_kv=True, bias=False, add_zero_attn=True), lambda: (_r(B, 3, 4),)),
    "transformer_encoder_layer_norm_first": (lambda: nn.TransformerEncoderLayer(
        4, 2, 8, dropout=0.0, batch_first=True, norm_first=True), lambda: (_r(B, 3, 4),)),
}

class _EncoderWithPadding(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x):
        pad = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool)
        pad[:, -1] = True
        return self.enc(x, src_key_padding_mask=pad)


class _Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.Transformer(4, 2, 1, 1, 8, dropout=0.0, batch_first=True)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=D)
        return self.t(src, tgt, tgt_mask=mask, tgt_is_causal=True)


class _Sdpa(nn.Module):
    """F.scaled_dot_product_attention between two Linear projections, causal."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return nn.functional.scaled_dot_product_attention(self.q(x), self.k(x), x,
                                                          is_causal=True)


_ATTENTION.update({
    "transformer_encoder_padding_mask": (_EncoderWithPadding, lambda: (_r(B, 3, 4),)),
    "transformer_causal": (_Transformer, lambda: (_r(B, 3, 4), _r(B, 2, 4))),
    "sdpa_causal": (_Sdpa, lambda: (_r(B, 3, 4),)),
})
_RECURRENT["LSTM_dropout_eval"] = (lambda: _First(nn.LSTM(
    3, 4, num_layers=2, batch_first=True, dropout=0.5)).eval(), lambda: (_r(B, 5, 3),))

_OTHER = {
    "linear_3d": (lambda: nn.Linear(4, 3), lambda: (_r(B, 2, 4),)),
    "linear_4d_no_bias": (lambda: nn.Linear(4, 3, bias=False), lambda: (_r(B, 2, 3, 4),)),
    # (both sides of the norms' choice: the ghost-norm identity over the positions, or the
    # per-sample gradient formed)
    "linear_wide_short": (lambda: nn.Linear(40, 30), lambda: (_r(B, 2, 40),)),
    "linear_narrow_long": (lambda: nn.Linear(3, 2), lambda: (_r(B, 60, 3),)),
    "conv1d_long": (lambda: nn.Conv1d(2, 2, 3, padding=1, groups=2), lambda: (_r(B, 2, 80),)),
    "conv2d_wide": (lambda: nn.Conv2d(16, 16, 3, padding=1), lambda: (_r(B, 16, 3, 3),)),
    "embedding_long": (lambda: nn.Embedding(50, 8, padding_idx=3),
                       lambda: (torch.randint(0, 50, (B, 40)),)),
    "bilinear": (lambda: nn.Bilinear(3, 4, 2), lambda: (_r(B, 3), _r(B, 4))),
    "bilinear_3d": (lambda: nn.Bilinear(3, 4, 2), lambda: (_r(B, 5, 3), _r(B, 5, 4))),
    "prelu": (lambda: nn.Sequential(nn.Linear(4, 4), nn.PReLU()), lambda: (_r(B, 4),)),
    "prelu_channels": (lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.PReLU(3)),
                       lambda: (_r(B, 2, 3, 3),)),
    "tied_embedding_head": (_TiedEmbedding, lambda: (torch.tensor([[0, 1, 2], [3, 0, 6],
                                                                   [2, 2, 4]]),)),
    "tied_conv_transpose_and_norms": (_TiedConv, lambda: (_r(B, 2, 6),)),
    "shared_module_twice": (_Shared, lambda: (_r(B, 3, 4),)),
    "frozen_bias_with_grad": (_Frozen, lambda: (_r(B, 4),)),
}

CONFIGS = {**_convs(), **_NORMS, **_EMBEDDINGS, **_RECURRENT, **_ATTENTION, **_OTHER}

# Refusals by design, each a StrategyError naming its cause: (strategy, config words) ->
# a phrase of the reason. hooks: no rule for the layer or this use of it; vmap: torch.func
# has no batching rule for the layer (the same example runs without vmap).
_NO_RULE = "cannot compute"
_NO_VMAP = "vmap lacks a batching rule"
REFUSED = {
    ("hooks", "embedding_max_norm"): _NO_RULE, ("hooks", "embedding_freq"): _NO_RULE,
    ("hooks", "bag_max_norm"): _NO_RULE, ("hooks", "bag_freq"): _NO_RULE,
    ("hooks", "_offsets"): _NO_RULE, ("hooks", "bilinear"): _NO_RULE,
    ("hooks", "prelu"): _NO_RULE,
    ("hooks", "_unbatched"): _NO_RULE,
    ("vmap", "max_norm"): _NO_VMAP, ("vmap", "_running"): _NO_VMAP,
    ("vmap", "RNN_"): _NO_VMAP, ("vmap", "GRU_"): _NO_VMAP, ("vmap", "LSTM_"): _NO_VMAP,
}


def _refusal(strategy, name):
    for (s, words), why in REFUSED.items():
        if s == strategy and words in name:
            return why
    return None


def _loss(out):
    flat = out.flatten(1)
    return (flat * torch.linspace(-1.0, 1.0, flat.shape[1], dtype=D)).sum() \
        + 0.3 * flat.pow(2).sum()


def _loop(model, xs):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(B):
        gs = torch.autograd.grad(_loss(model(*(x[i:i + 1] for x in xs))), params,
                                 allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, p in zip(gs, params)])
    return {n: torch.stack([r[j] for r in rows]) for j, n in enumerate(names)}


def _state(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [m.training for m in model.modules()],
            {n: None if p.grad is None else p.grad.clone()
             for n, p in model.named_parameters() if not p.requires_grad})


def _same_state(a, b):
    assert a[0].keys() == b[0].keys() and a[1] == b[1]
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k
    assert a[2].keys() == b[2].keys()
    for k in a[2]:
        assert (a[2][k] is None) == (b[2][k] is None), k
        assert a[2][k] is None or torch.equal(a[2][k], b[2][k]), k


STRATEGIES = ("auto", "hooks", "vmap", "loop")


def _fresh(name, state=None):
    """The configuration's model in float64 from seed 0 (with ``state`` loaded: the one the
    reference loop left), and its inputs."""
    torch.manual_seed(0)
    make, inputs = CONFIGS[name]
    model = make().to(D)
    if state is not None:
        model.load_state_dict(state)
    if name == "frozen_bias_with_grad":
        model.a.bias.grad = torch.ones(4, dtype=D)
    return model, inputs()


def _check(name, strategy, model, xs, want):
    """One strategy on a model no strategy has seen: its grads, norms and clipped sum equal
    the reference's, or it refuses naming the cause; the model's state is kept."""
    arg = xs if len(xs) > 1 else xs[0]
    refused = _refusal(strategy, name)
    before = _state(model)
    if refused is not None:
        with pytest.raises(tv.StrategyError) as info:
            tv.per_sample_grads(model, _loss, arg, strategy=strategy)
        msg = str(info.value)
        assert refused in msg and "strategy='auto'" in msg, msg
        _same_state(before, _state(model))
        return
    got = tv.per_sample_grads(model, _loss, arg, strategy=strategy)
    assert list(got) == list(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)
    norms = sum(g.flatten(1).pow(2).sum(1) for g in want.values()).sqrt()
    torch.testing.assert_close(tv.per_sample_grad_norms(model, _loss, arg, strategy=strategy),
                               norms)
    _same_state(before, _state(model))
    max_norm = float(norms.median())  # (some examples clipped, some not)
    assert (norms > max_norm).any() and (norms < max_norm).any()
    got_norms = tv.accumulate_clipped_grads(model, _loss, arg, max_norm=max_norm,
                                            strategy=strategy)
    torch.testing.assert_close(got_norms, norms)
    c = (max_norm / norms).clamp(max=1.0)
    for n, p in model.named_parameters():
        if n in want:
            torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, want[n]), msg=n)
            p.grad = None
    _same_state(before, _state(model))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config(name):
    """Every strategy against one reference: the per-example loop, run first (its forwards
    move running statistics, renormalise rows) on a model of its own; each strategy then gets
    a fresh model and inputs, the model holding the state the loop left, so that none sees
    another's plans or ``.grad``. A failure names its strategy; the strategies after it
    still run."""
    model, xs = _fresh(name)
    want = _loop(model, xs)
    after = {k: v.clone() for k, v in model.state_dict().items()}
    failures = []
    for strategy in STRATEGIES:  # (a refusal's model as built: no forward has run on it)
        fresh, fresh_xs = _fresh(name, None if _refusal(strategy, name) else after)
        try:
            _check(name, strategy, fresh, fresh_xs, want)
        except Exception:  # (each strategy's failure, named, then the others)
            failures.append(f"strategy={strategy!r} on {name}:\n{traceback.format_exc()}")
    if failures:
        pytest.fail("\n".join(failures))
