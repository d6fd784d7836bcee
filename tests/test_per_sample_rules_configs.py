"""Per-sample gradients through the per-layer rules on layer configurations the other sweeps
leave out: convolutions whose padding mode (reflect, replicate, circular) meets groups,
dilation, a stride above the kernel or 'same' padding with an even kernel, on each of the
rule's three paths (unfolded patches, grouped convolutions, the ghost norms); transposed
convolutions with groups, dilation and output padding together, or ``output_size``;
channels-last inputs; Linear and GPT-2's Conv1D on inputs where the batch is as long as
another dimension; EmbeddingBag offsets with empty bags, ``include_last_offset``, int32
offsets, ties in mode max, and tables without a batch; Embedding with a negative
``padding_idx``, ``max_norm`` tied to the output layer; LSTM projections over three
bidirectional layers with their final states; packed sequences of equal lengths;
MultiheadAttention with kdim/vdim, bias_kv, zero attention and rows masked by the data,
``is_causal`` with a mask, per-example 3-D masks; norms over three dimensions, GroupNorm with
one group or one per channel without affine, InstanceNorm with running statistics in eval.

Every strategy against the per-example loop in float64 (each example from the model's state
at the call), grads, norms and clipped sums with two ``max_norm`` (one that clips every
example); the model's state kept, and a result unchanged by the calls after it. A refusal is
a StrategyError that names ``strategy='auto'``, by design where the table says so.
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import torch_vjp as tv

D = torch.float64
STRATEGIES = ("auto", "hooks", "vmap", "loop")


def _r(*shape):
    return torch.randn(*shape, dtype=D)


def _ids(B, T=4, V=6, dtype=torch.long):
    return torch.randint(0, V, (B, T), dtype=dtype)


def _loss(out):
    flat = out.flatten(1)
    return (flat * torch.linspace(-1.0, 1.0, flat.shape[1], dtype=D)).sum() \
        + 0.3 * flat.pow(2).sum()


# -- models --------------------------------------------------------------------------------

class _OutputSize(nn.Module):
    """A transposed convolution given ``output_size`` (twice its input's length)."""

    def __init__(self, d, cin):
        super().__init__()
        self.t = getattr(nn, f"ConvTranspose{d}d")(cin, 16 if cin > 4 else 2, 3, stride=2,
                                                   groups=2, padding=1)

    def forward(self, x):
        return self.t(x, output_size=[2 * s for s in x.shape[2:]])


class _ChannelsLast(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 2, padding=1, padding_mode="reflect")
        self.g = nn.GroupNorm(2, 4)
        self.t = nn.ConvTranspose2d(4, 2, 2, stride=2, groups=2)

    def forward(self, x):
        h = self.g(self.c(x.contiguous(memory_format=torch.channels_last)))
        return self.t(h.contiguous(memory_format=torch.channels_last))


class Conv1D(nn.Module):
    """GPT-2's Conv1D (``transformers.pytorch_utils.Conv1D``): a Linear layer whose weight is
    stored ``(in, out)``; named as transformers names it, so that its rule applies."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.5)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


Conv1D.__module__ = Conv1D.forward.__module__ = "transformers.pytorch_utils"


class _Bags(nn.Module):
    """An EmbeddingBag on 1-D input with offsets: each example's row split into bags
    ``[0:2]``, an empty one, and ``[2:T]``; the last offset included."""

    def __init__(self, mode, **kw):
        super().__init__()
        self.bag = nn.EmbeddingBag(6, 3, mode=mode, include_last_offset=True, **kw)

    def forward(self, idx, w=None):
        B, T = idx.shape
        offsets = torch.tensor([o for i in range(B) for o in (i * T, i * T + 2, i * T + 2)]
                               + [B * T])
        w = None if w is None else w.reshape(-1)
        return self.bag(idx.reshape(-1), offsets, per_sample_weights=w).reshape(B, 3, 3)


class _OneBagEach(nn.Module):
    """One bag per example through int32 offsets (the last one included)."""

    def __init__(self, mode):
        super().__init__()
        self.bag = nn.EmbeddingBag(6, 3, mode=mode, include_last_offset=True)

    def forward(self, idx):
        B, T = idx.shape
        return self.bag(idx.reshape(-1), torch.arange(0, B * T + 1, T, dtype=torch.int32))


class _TiedBagMax(nn.Module):
    """Mode max on a table whose rows 1, 3 and 4 are equal (ties between distinct rows)."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(6, 3, mode="max", padding_idx=0)
        with torch.no_grad():
            self.bag.weight[3] = self.bag.weight[1]
            self.bag.weight[4] = self.bag.weight[1]
        self.lin = nn.Linear(3, 2)

    def forward(self, idx):
        return self.lin(self.bag(idx))


class _SharedBag(nn.Module):
    """An EmbeddingBag on a fixed table of ids (no batch), its weights a parameter."""

    def __init__(self, mode):
        super().__init__()
        self.bag = nn.EmbeddingBag(6, 4, mode=mode)
        self.register_buffer("ids", torch.tensor([0, 2, 3]))
        self.w = nn.Parameter(torch.randn(3)) if mode == "sum" else None
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        e = self.bag(self.ids, torch.tensor([0, 1]), per_sample_weights=self.w).sum(0)
        return self.lin(torch.tanh(x * e))


class _TiedMaxNorm(nn.Module):
    """An Embedding with max_norm whose table is also the output layer's weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4, max_norm=0.8)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.emb(idx)).sum(1)


class _States(nn.Module):
    """A recurrent layer's output and final states, both in the loss."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        out, h = self.layer(x)
        if isinstance(h, tuple):
            h = h[0] + h[1].sum(-1, keepdim=True)
        return out.sum(1) + h.transpose(0, 1).reshape(x.shape[0], -1).sum(1, keepdim=True)


class _SequenceFirst(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x.transpose(0, 1))[0].transpose(0, 1)


class _PackedEqual(nn.Module):
    """A packed batch whose sequences all have the same length, unsorted packing."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(3, 4, num_layers=3, bidirectional=True, proj_size=2,
                           batch_first=True)

    def forward(self, x):
        lengths = torch.full((x.shape[0],), 3, dtype=torch.long)
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, (h, _) = self.rnn(packed)
        o = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]
        return o.sum(1) + h.sum(0).sum(-1, keepdim=True)


class _Attention(nn.Module):
    """MultiheadAttention with key rows masked where the key's first feature is negative
    (``pad='data'``), or every key of the examples whose first key is negative
    (``pad='rows'``: a fully masked example); NaN outputs zeroed."""

    def __init__(self, kdim=4, vdim=4, pad=None, causal=False, bf=True, **kw):
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, kdim=kdim, vdim=vdim, batch_first=bf, **kw)
        self.pad, self.causal, self.bf = pad, causal, bf

    def forward(self, q, k, v):
        B, Lq, Lk = q.shape[0], q.shape[1], k.shape[1]
        pad = None
        if self.pad == "data":
            pad = k[..., 0] < 0
        elif self.pad == "rows":
            pad = (k[:, :1, 0] < 0).expand(B, Lk)
        mask = torch.triu(torch.ones(Lq, Lk, dtype=torch.bool), 1) if self.causal else None
        if not self.bf:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        out = self.mha(q, k, v, key_padding_mask=pad, attn_mask=mask, need_weights=False,
                       is_causal=self.causal)[0]
        return torch.nan_to_num(out if self.bf else out.transpose(0, 1), nan=0.0)


class _PerExampleMask(nn.Module):
    """A 3-D ``attn_mask`` (B * heads, L, S) computed from each example's keys."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, batch_first=True, kdim=3, vdim=3)

    def forward(self, q, kv):
        B, L, S = q.shape[0], q.shape[1], kv.shape[1]
        mask = (kv[..., 0] < -0.5)[:, None, None, :].expand(B, 2, L, S).reshape(B * 2, L, S)
        mask = mask.clone()
        mask[..., 0] = False
        return self.mha(q, kv, kv, attn_mask=mask, need_weights=False)[0]


def _qkv(kdim=4, vdim=4, Lq=3, Lk=5):
    def make(B):
        q, k, v = _r(B, Lq, 4), _r(B, Lk, kdim), _r(B, Lk, vdim)
        k[:, 0, 0] = k[:, 0, 0].abs() * torch.tensor([(-1.0) ** i for i in range(B)], dtype=D)
        return q, k, v
    return make


_IN = {d: (getattr(nn, f"InstanceNorm{d}d"), (4,) * d if d < 3 else (3,) * 3)
       for d in (1, 2, 3)}

# name: (model, inputs(B))
CONFIGS = {
    "conv2d_circular_groups_dilation": (
        lambda: nn.Conv2d(4, 6, 3, groups=2, dilation=2, padding=2, padding_mode="circular"),
        lambda B: (_r(B, 4, 6, 6),)),
    "conv3d_reflect_stride_above_kernel_uneven_padding": (
        lambda: nn.Conv3d(2, 4, 2, stride=3, padding=(1, 2, 3), padding_mode="reflect",
                          groups=2), lambda B: (_r(B, 2, 5, 5, 5),)),
    "conv1d_replicate_same_even_kernel_dilated": (
        lambda: nn.Conv1d(2, 2, 4, padding="same", dilation=2, padding_mode="replicate",
                          groups=2, bias=False), lambda B: (_r(B, 2, 7),)),
    "conv2d_grouped_path_reflect_same_even_kernel": (
        lambda: nn.Conv2d(16, 4, 4, padding="same", dilation=2, padding_mode="reflect",
                          groups=2), lambda B: (_r(B, 16, 6, 6),)),
    "conv2d_ghost_circular_groups_stride": (
        lambda: nn.Conv2d(64, 64, 2, groups=2, padding=1, padding_mode="circular", stride=2),
        lambda B: (_r(B, 64, 2, 2),)),
    "conv_transpose3d_groups_dilation_output_padding": (
        lambda: nn.ConvTranspose3d(4, 6, 3, stride=3, groups=2, dilation=2, output_padding=2,
                                   padding=1), lambda B: (_r(B, 4, 3, 3, 3),)),
    "conv_transpose1d_grouped_path_output_size": (lambda: _OutputSize(1, 48),
                                                  lambda B: (_r(B, 48, 3),)),
    "conv_transpose2d_output_size": (lambda: _OutputSize(2, 4), lambda B: (_r(B, 4, 3, 3),)),
    "conv_channels_last": (_ChannelsLast, lambda B: (_r(B, 3, 4, 4),)),
    "linear_5d_batch_as_long_as_two_dims": (lambda: nn.Linear(4, 3),
                                            lambda B: (_r(B, B, 2, B, 4),)),
    "flatten_linear_unflatten": (lambda: nn.Sequential(
        nn.Flatten(), nn.Linear(12, 6), nn.Unflatten(1, (2, 3)), nn.Linear(3, 2, bias=False)),
        lambda B: (_r(B, 3, 4),)),
    "gpt2_conv1d_batch_as_long_as_sequence": (lambda: nn.Sequential(
        Conv1D(5, 4), nn.Tanh(), Conv1D(2, 5)), lambda B: (_r(B, B, 4),)),
    "embedding_negative_padding_idx_freq": (
        lambda: nn.Embedding(6, 3, padding_idx=-2, scale_grad_by_freq=True),
        lambda B: (torch.tensor([[1, 1, 4, 2, 4]]).repeat(B, 1),)),
    "embedding_max_norm_tied_head": (_TiedMaxNorm, lambda B: (_ids(B, 2, 7),)),
    "bag_mean_empty_bags_last_offset_padding": (lambda: _Bags("mean", padding_idx=0),
                                                lambda B: (_ids(B, 5),)),
    "bag_sum_weights_empty_bags_last_offset": (lambda: _Bags("sum"),
                                               lambda B: (_ids(B, 5), _r(B, 5))),
    "bag_max_int32_offsets_one_bag_each": (lambda: _OneBagEach("max"),
                                           lambda B: (_ids(B, dtype=torch.int32),)),
    "bag_max_ties_between_rows": (_TiedBagMax, lambda B: (_ids(B),)),
    "bag_sum_without_batch_weights_learned": (lambda: _SharedBag("sum"),
                                              lambda B: (_r(B, 4),)),
    "bag_max_without_batch": (lambda: _SharedBag("max"), lambda B: (_r(B, 4),)),
    "lstm_projection_3_bidirectional_layers_states": (lambda: _States(nn.LSTM(
        3, 4, num_layers=3, bidirectional=True, proj_size=2, batch_first=True)),
        lambda B: (_r(B, 4, 3),)),
    "lstm_projection_sequence_first_batch_as_long_as_time": (lambda: _SequenceFirst(nn.LSTM(
        3, 4, num_layers=3, bidirectional=True, proj_size=2)), lambda B: (_r(B, B, 3),)),
    "rnn_relu_states_no_bias": (lambda: _States(nn.RNN(
        3, 4, num_layers=2, nonlinearity="relu", batch_first=True, bias=False)),
        lambda B: (_r(B, 4, 3),)),
    "packed_equal_lengths_lstm_projection": (_PackedEqual, lambda B: (_r(B, 4, 3),)),
    "mha_sequence_first_kdim_vdim_bias_kv_zero_attn_padding": (lambda: _Attention(
        3, 5, pad="data", bf=False, add_bias_kv=True, add_zero_attn=True, bias=False),
        _qkv(3, 5)),
    "mha_fully_masked_examples_zero_attn": (lambda: _Attention(
        3, 5, pad="rows", add_zero_attn=True, add_bias_kv=True), _qkv(3, 5)),
    "mha_fully_masked_examples_nan": (lambda: _Attention(pad="rows"), _qkv()),
    "mha_causal_with_mask_no_bias_bias_kv": (lambda: _Attention(
        3, 5, causal=True, bias=False, add_bias_kv=True), _qkv(3, 5, 4, 4)),
    "mha_per_example_3d_mask": (_PerExampleMask, lambda B: (_r(B, 3, 4), _r(B, 4, 3))),
    "layernorm_3_dims_batch_as_long_as_rows": (lambda: nn.LayerNorm((2, 3, 4)),
                                               lambda B: (_r(B, B, 2, 3, 4),)),
    "rmsnorm_3_dims_no_affine": (lambda: nn.Sequential(
        nn.Linear(4, 4), nn.RMSNorm((2, 3, 4), elementwise_affine=False)),
        lambda B: (_r(B, 2, 3, 4),)),
    "groupnorm_per_channel_no_affine": (lambda: nn.Sequential(
        nn.Conv2d(4, 4, 1), nn.GroupNorm(4, 4, affine=False)), lambda B: (_r(B, 4, 2, 3),)),
    "groupnorm_one_group_5d": (lambda: nn.GroupNorm(1, 2), lambda B: (_r(B, 2, 2, 3, 2),)),
    "prelu_channels_batch_as_long_as_channels": (lambda: nn.PReLU(3),
                                                 lambda B: (_r(B, 3, B, 3),)),
}
for _d, (_cls, _sp) in _IN.items():
    CONFIGS[f"instancenorm{_d}d_running_eval"] = (
        lambda c=_cls, d=_d: nn.Sequential(getattr(nn, f"Conv{d}d")(2, 3, 1), c(
            3, affine=True, track_running_stats=True, momentum=None)).eval(),
        lambda B, s=_sp: (_r(B, 2, *s),))
CONFIGS["instancenorm2d_running_train"] = (
    lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True),
    lambda B: (_r(B, 3, 4, 4),))

_NO_RULE = "cannot compute"
_NO_VMAP = "cannot batch"
# (strategy, config) -> a phrase of the refusal, by design: the layer has no rule, or a
# configuration its rule declines, or a bag's output is no row per example (bags reshaped
# into examples, a table's bags summed); vmap has no batching rule for what the layer runs.
REFUSED = {
    ("hooks", "embedding_negative_padding_idx_freq"): _NO_RULE,
    ("hooks", "embedding_max_norm_tied_head"): _NO_RULE,
    ("vmap", "embedding_max_norm_tied_head"): _NO_VMAP,
    ("hooks", "bag_mean_empty_bags_last_offset_padding"): _NO_RULE,
    ("hooks", "bag_sum_weights_empty_bags_last_offset"): _NO_RULE,
    ("vmap", "lstm_projection_3_bidirectional_layers_states"): _NO_VMAP,
    ("vmap", "lstm_projection_sequence_first_batch_as_long_as_time"): _NO_VMAP,
    ("vmap", "rnn_relu_states_no_bias"): _NO_VMAP,
    ("hooks", "packed_equal_lengths_lstm_projection"): "PackedSequence",
    ("vmap", "packed_equal_lengths_lstm_projection"): _NO_VMAP,
    ("hooks", "bag_sum_without_batch_weights_learned"): _NO_RULE,
    ("hooks", "bag_max_without_batch"): _NO_RULE,
    ("hooks", "prelu_channels_batch_as_long_as_channels"): _NO_RULE,
    ("vmap", "conv_channels_last"): _NO_VMAP,
    ("vmap", "instancenorm2d_running_train"): _NO_VMAP,
}
# refused only with more than one example (a batch of one has nothing to mix or reshape)
_ONLY_BATCHED = {("hooks", "bag_mean_empty_bags_last_offset_padding"),
                 ("hooks", "bag_sum_weights_empty_bags_last_offset"),
                 ("hooks", "embedding_max_norm_tied_head"),
                 ("hooks", "embedding_negative_padding_idx_freq"),
                 ("hooks", "bag_sum_without_batch_weights_learned"),
                 ("hooks", "bag_max_without_batch"),
                 ("hooks", "prelu_channels_batch_as_long_as_channels")}


def _loop(model, xs):
    """Example i alone, from the model's state at the call (a copy per example: max_norm
    renormalises rows, running statistics move)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for i in range(xs[0].shape[0]):
        m = copy.deepcopy(model)
        params = [p for p in m.parameters() if p.requires_grad]
        gs = torch.autograd.grad(_loss(m(*(x[i:i + 1] for x in xs))), params,
                                 allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, p in zip(gs, params)])
    return {n: torch.stack([r[j] for r in rows]) for j, n in enumerate(names)}


def _state(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [m.training for m in model.modules()])


def _same_state(a, b):
    assert a[0].keys() == b[0].keys() and a[1] == b[1]
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k


def _close(got, want, msg):
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, equal_nan=True, msg=msg)


def _same(a, b):
    return torch.equal(a.nan_to_num(7.5), b.nan_to_num(7.5))


def _check(name, strategy, B):
    torch.manual_seed(0)
    make, inputs = CONFIGS[name]
    model = make().to(D)
    torch.manual_seed(1)
    xs = inputs(B)
    want = _loop(model, xs)
    arg = xs if len(xs) > 1 else xs[0]
    before = _state(model)
    refused = REFUSED.get((strategy, name))
    if refused is not None and (B > 1 or (strategy, name) not in _ONLY_BATCHED):
        with pytest.raises(tv.StrategyError) as info:
            tv.per_sample_grads(model, _loss, arg, strategy=strategy)
        msg = str(info.value)
        assert refused in msg and "strategy='auto'" in msg, msg
        _same_state(before, _state(model))
        return
    got = tv.per_sample_grads(model, _loss, arg, strategy=strategy)
    assert list(got) == list(want)
    for n in want:
        _close(got[n], want[n], n)
    kept = {n: g.clone() for n, g in got.items()}
    norms = sum(g.flatten(1).pow(2).sum(1) for g in want.values()).sqrt()
    _close(tv.per_sample_grad_norms(model, _loss, arg, strategy=strategy), norms, "norms")
    finite = norms[torch.isfinite(norms)]
    for max_norm in (float(finite.max()) * 0.75 + 1e-3, 0.5 * float(finite.min()) + 1e-6):
        for p in model.parameters():
            p.grad = None
        _close(tv.accumulate_clipped_grads(model, _loss, arg, max_norm=max_norm,
                                           strategy=strategy), norms, "clipped norms")
        c = (max_norm / norms).clamp(max=1.0)
        for n, p in model.named_parameters():
            _close(p.grad, torch.einsum("b,b...->...", c, want[n]), n)
    for p in model.parameters():
        p.grad = None
    again = tv.per_sample_grads(model, _loss, arg, strategy=strategy)
    for n in got:  # (the calls after it leave a result alone, and give it again)
        assert _same(got[n], kept[n]), n
        assert _same(again[n], kept[n]), n
    _same_state(before, _state(model))


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_config(name, B):
    """Each strategy on the configuration; a failure names its strategy, and the strategies
    after it still run."""
    failures = []
    for strategy in STRATEGIES:
        try:
            _check(name, strategy, B)
        except Exception:  # (each strategy's failure, named, then the others)
            failures.append(f"strategy={strategy!r} on {name}, B={B}:\n"
                            f"{traceback.format_exc()}")
    if failures:
        pytest.fail("\n".join(failures))


class _BagMaxWeighted(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(6, 3, mode="max")

    def forward(self, idx, w):
        return self.bag(idx, per_sample_weights=w)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bag_max_with_weights_is_torchs_own_error(strategy):
    """per_sample_weights in mode max: torch's own NotImplementedError, as the model raises
    it, untouched."""
    torch.manual_seed(0)
    model = _BagMaxWeighted().to(D)
    idx, w = _ids(3), _r(3, 4)
    with pytest.raises(NotImplementedError) as want:
        model(idx, w)
    with pytest.raises(NotImplementedError) as got:
        tv.per_sample_grads(model, _loss, (idx, w), strategy=strategy)
    assert str(got.value) == str(want.value)
    assert "per_sample_weights is only supported for mode='sum'" in str(got.value)


class _BiasAddedSequenceFirst(nn.Module):
    """A parameter added directly to a (T, B, F) activation: the examples' dimension is the
    second, so with T == B the broadcast's first dimension of size B is the wrong one."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.tanh(self.lin(x).transpose(0, 1) + self.b).transpose(0, 1)


class _BiasAdded(nn.Module):
    """A parameter added directly to a (B, T, F) activation."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.tanh(self.lin(x) + self.b)


@pytest.mark.parametrize("T", [2, 3])
def test_bias_added_with_batch_as_long_as_sequence(T):
    """``x + b`` on a (B, T, F) activation: each example's gradient of ``b`` by the
    broadcast rule under 'hooks', whatever T is (here B = 3)."""
    torch.manual_seed(0)
    model = _BiasAdded().to(D)
    x = _r(3, T, 4)
    want = _loop(model, (x,))
    got = tv.per_sample_grads(model, _loss, x, strategy="hooks")
    for n in want:
        _close(got[n], want[n], n)


@pytest.mark.parametrize("T", [2, 3])
def test_bias_added_to_a_sequence_first_activation_with_batch_as_long_as_sequence(T):
    """The same parameter added to a (T, B, F) activation, B = 3: with T == B the broadcast
    could have added either dimension of size 3. 'hooks' is right or refuses the parameter
    with a StrategyError; 'auto' is right; never a silently wrong row."""
    torch.manual_seed(0)
    model = _BiasAddedSequenceFirst().to(D)
    x = _r(3, T, 4)
    want = _loop(model, (x,))
    try:
        got = tv.per_sample_grads(model, _loss, x, strategy="hooks")
    except tv.StrategyError as e:
        assert "'b'" in str(e)
        assert "rows do not belong to single examples" in str(e)
    else:
        for n in want:
            _close(got[n], want[n], n)
    got = tv.per_sample_grads(model, _loss, x)
    for n in want:
        _close(got[n], want[n], n)
