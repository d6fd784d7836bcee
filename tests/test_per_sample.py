"""Per-sample gradients, norms and clipped sums against a naive per-example loop (float64).

The reference for every result is the definition itself: for each example ``i``,
``torch.autograd.grad(loss_fn(model(inputs[i:i+1]), targets[i:i+1]), params)``.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_vjp
from torch_vjp import PerSampleError, StrategyError
from torch_vjp.per_sample import (
    PerSampleTypeError,
    PerSampleValueError,
    accumulate_clipped_grads,
    per_sample_grad_norms,
    per_sample_grads,
)

DT = torch.float64
STRATEGIES = ("auto", "hooks", "vmap", "loop")


# ------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------


def mlp():
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.c2 = nn.Conv2d(4, 6, 3, stride=2, groups=2, bias=False)
        self.c3 = nn.Conv1d(6, 4, 2, padding=1, padding_mode="circular")
        self.fc = nn.Linear(4 * 10, 3)

    def forward(self, x):
        h = torch.relu(self.gn(self.c1(x)))  # (B, 4, 7, 7)
        h = self.c2(h).flatten(2)  # (B, 6, 9)
        return self.fc(torch.tanh(self.c3(h)).flatten(1))


class Text(nn.Module):
    """Embedding + LayerNorm + Linear over a sequence, mean-pooled."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8, padding_idx=0)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(self.ln(self.emb(x)))).mean(1))


class Transformer(nn.Module):
    """Stock TransformerEncoderLayer, batch first, no dropout."""

    def __init__(self, batch_first=True):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(20, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=batch_first)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        h = self.emb(x)
        if self.batch_first:
            return self.fc(self.enc(h).mean(1))
        return self.fc(self.enc(h.transpose(0, 1)).mean(0))


class Scale(nn.Module):
    """A custom layer no rule knows."""

    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return x * self.w


def custom():
    return nn.Sequential(nn.Linear(4, 5), Scale(5), nn.ReLU(inplace=True), nn.Linear(5, 3))


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(2, 4)
        self.o = nn.Linear(4, 2)

    def forward(self, x, z):
        return self.o(torch.tanh(self.a(x) + self.b(z)))


def ce(out, t):
    return F.cross_entropy(out, t)


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(9, 2)

    def forward(self, idx, offsets):
        return self.bag(idx, offsets)


class Ids(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 2)

    def forward(self, ids, table):
        return self.emb(ids) + self.emb(table).mean(0)


def _ints(high, *shape):
    return torch.randint(0, high, shape)


def _randn(*shape):
    return torch.randn(*shape, dtype=DT)


# id -> (model factory, loss_fn, inputs factory, targets factory)
CASES = {
    "mlp": (mlp, nn.CrossEntropyLoss(), lambda: _randn(7, 6), lambda: _ints(3, 7)),
    "cnn-conv2d-groupnorm": (CNN, ce, lambda: _randn(5, 2, 7, 7), lambda: _ints(3, 5)),
    "text-embedding-layernorm": (Text, nn.CrossEntropyLoss(), lambda: _ints(11, 6, 5), lambda: _ints(3, 6)),
    "transformer": (Transformer, nn.CrossEntropyLoss(), lambda: _ints(20, 4, 5), lambda: _ints(3, 4)),
    "custom-layer": (custom, nn.CrossEntropyLoss(reduction="sum"), lambda: _randn(6, 4), lambda: _ints(3, 6)),
    "tuple-inputs": (TwoInputs, lambda o, t: F.mse_loss(o, t), lambda: (_randn(5, 3), _randn(5, 2)), lambda: _randn(5, 2)),
    "targets-none": (TwoInputs, lambda o: o.pow(2).sum() + o.sin().mean(), lambda: (_randn(5, 3), _randn(5, 2)), lambda: None),
}
# The strategies each case supports ("hooks" needs a rule for every parameter).
HOOKS_OK = {k for k in CASES if k != "custom-layer"}


def make(case):
    factory, loss_fn, xf, tf = CASES[case]
    torch.manual_seed(0)
    model = factory().to(DT)
    return model, loss_fn, xf(), tf()


def loop_reference(model, loss_fn, inputs, targets):
    """Per-example gradients by definition: one forward and backward per example."""
    xs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = {n: [] for n, _ in named}
    for i in range(xs[0].shape[0]):
        out = model(*(x[i : i + 1] for x in xs))
        loss = loss_fn(out) if targets is None else loss_fn(out, targets[i : i + 1])
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        for (n, p), g in zip(named, grads):
            rows[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(v) for n, v in rows.items()}


def ref_norms(ref):
    return torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)


def strategy_cases():
    return [
        pytest.param(case, s, id=f"{case}-{s}")
        for case in CASES
        for s in STRATEGIES
        if s != "hooks" or case in HOOKS_OK
    ]


# ------------------------------------------------------------------------------------------
# Correctness against the loop
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case,strategy", strategy_cases())
def test_per_sample_grads_match_loop(case, strategy):
    model, loss_fn, x, t = make(case)
    ref = loop_reference(model, loss_fn, x, t)
    got = per_sample_grads(model, loss_fn, x, t, strategy=strategy)
    assert list(got) == list(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=f"{case}/{strategy}: {n}")


@pytest.mark.parametrize("case,strategy", strategy_cases())
def test_norms_match_loop(case, strategy):
    model, loss_fn, x, t = make(case)
    ref = loop_reference(model, loss_fn, x, t)
    norms = per_sample_grad_norms(model, loss_fn, x, t, strategy=strategy)
    torch.testing.assert_close(norms, ref_norms(ref))


@pytest.mark.parametrize("case,strategy", strategy_cases())
def test_clipped_sums_match_loop(case, strategy):
    model, loss_fn, x, t = make(case)
    ref = loop_reference(model, loss_fn, x, t)
    norms = ref_norms(ref)
    max_norm = float(norms.median())  # some examples clipped, some not
    c = (max_norm / norms).clamp(max=1.0)
    got = accumulate_clipped_grads(model, loss_fn, x, t, max_norm=max_norm, strategy=strategy)
    torch.testing.assert_close(got, norms)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, ref[n]), msg=n)


@pytest.mark.parametrize("budget", [0, 600], ids=["nothing-kept", "some-kept"])
@pytest.mark.parametrize("case", sorted(HOOKS_OK))
def test_clipped_sums_with_a_smaller_budget_of_kept_gradients(case, budget, monkeypatch):
    # The clipped step keeps per-sample gradients formed for a norm up to a budget of
    # elements, and recomputes the others' sums: any split must give the same sums.
    from torch_vjp._per_sample import run

    monkeypatch.setattr(run, "KEEP_ELEMENTS", budget)
    test_clipped_sums_match_loop(case, "hooks")


@pytest.mark.parametrize("strategy", ["hooks", "vmap", "auto"])
@pytest.mark.parametrize("chunk_size", [1, 2, 3, 4, 7, 10, 1000])
def test_chunk_size_sweep(strategy, chunk_size):
    model, loss_fn, x, t = make("text-embedding-layernorm")
    ref = loop_reference(model, loss_fn, x, t)
    got = per_sample_grads(model, loss_fn, x, t, strategy=strategy, chunk_size=chunk_size)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n])


def test_auto_uses_rules_where_it_can_and_vmap_for_the_custom_layer():
    model, loss_fn, x, t = make("custom-layer")
    plan = torch_vjp.per_sample_plan(model, loss_fn, x, t)
    methods = {r.name: r.method for r in plan.rows}
    assert methods.pop("1.w") == "vmap"
    assert set(methods.values()) == {"rule"}
    assert "no per-layer rule" in plan["1.w"].reason
    model, loss_fn, x, t = make("transformer")  # stock attention: rules only, no fallback
    plan = torch_vjp.per_sample_plan(model, loss_fn, x, t)
    assert {r.method for r in plan.rows} == {"rule"}, str(plan)


# ------------------------------------------------------------------------------------------
# Harder layouts and layers
# ------------------------------------------------------------------------------------------


def _check(model, loss_fn, x, t, strategies=("hooks",)):
    ref = loop_reference(model, loss_fn, x, t)
    for s in strategies:
        got = per_sample_grads(model, loss_fn, x, t, strategy=s)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], msg=f"{s}: {n}")
        torch.testing.assert_close(per_sample_grad_norms(model, loss_fn, x, t, strategy=s), ref_norms(ref))


@pytest.mark.parametrize("seq", [3, 5], ids=["seq-ne-batch", "seq-eq-batch"])
def test_sequence_first_transformer(seq):
    # The layers see (seq, batch, features); with seq == batch the batch dimension is found
    # by running the first example alone.
    torch.manual_seed(0)
    model = Transformer(batch_first=False).to(DT)
    _check(model, nn.CrossEntropyLoss(), _ints(20, 5, seq), _ints(3, 5))


class PaddedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(8, 2)

    def forward(self, x, mask):
        return self.head(self.enc(x, src_key_padding_mask=mask).mean(1))


def test_encoder_in_eval_mode_with_a_padding_mask():
    # without grad, nn.TransformerEncoder takes its inference fast path (nested tensors,
    # fused kernels that call none of its submodules); the plan is made in grad mode, as
    # the pass it is for, so the rules see the same calls
    torch.manual_seed(0)
    model = PaddedEncoder().to(DT).eval()
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[:, -2:] = True
    x = (_randn(4, 5, 8), mask)
    _check(model, nn.CrossEntropyLoss(), x, _ints(2, 4), ("hooks", "auto", "loop"))
    plan = torch_vjp.per_sample_plan(model, nn.CrossEntropyLoss(), x, _ints(2, 4))
    assert {r.method for r in plan.rows} == {"rule"}, str(plan)


class Cross(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.att = nn.MultiheadAttention(8, 2, batch_first=True, **kw)
        self.fc = nn.Linear(8, 2)

    def forward(self, q, k):
        o, w = self.att(q, k, k, need_weights=True, key_padding_mask=k[..., 0] > 1.0)
        return self.fc(o.mean(1)) + w.sum((1, 2)).unsqueeze(1)


@pytest.mark.parametrize(
    "kw", [{}, {"add_bias_kv": True}, {"add_zero_attn": True}, {"kdim": 5, "vdim": 5}],
    ids=["packed", "bias-kv", "zero-attn", "separate-kdim"],
)
def test_cross_attention_variants(kw):
    torch.manual_seed(0)
    model = Cross(**kw).to(DT)
    kdim = kw.get("kdim", 8)
    _check(model, nn.CrossEntropyLoss(), (_randn(3, 4, 8), _randn(3, 6, kdim)), _ints(2, 3))


class Attend(nn.Module):
    """Attention over the inputs as given: ``model(x, x, x)`` is self-attention."""

    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc = nn.Linear(8, 2)

    def forward(self, q, k, v):
        return self.fc(self.att(q, k, v)[0].mean(1))


@pytest.mark.parametrize("same", ["query-key-value", "key-value"])
def test_one_tensor_passed_as_several_inputs(same):
    # nn.MultiheadAttention projects once where query is key (and key is value): the plan
    # must see the inputs as one tensor too, or its layer calls are not the pass's
    torch.manual_seed(0)
    model = Attend().to(DT)
    q, k = _randn(3, 4, 8), _randn(3, 6, 8)
    x = (q, q, q) if same == "query-key-value" else (q, k, k)
    _check(model, nn.CrossEntropyLoss(), x, _ints(2, 3), ("hooks", "auto"))
    plan = torch_vjp.per_sample_plan(model, nn.CrossEntropyLoss(), x, _ints(2, 3))
    assert {r.method for r in plan.rows} == {"rule"}, str(plan)
    # and a call with distinct tensors of the same shapes is planned apart
    _check(model, nn.CrossEntropyLoss(), (q, k.clone(), k.clone()) if same == "key-value"
           else (q, q.clone(), q.clone()), _ints(2, 3), ("hooks",))
    _check(model, nn.CrossEntropyLoss(), x, _ints(2, 3), ("hooks",))


class PatchTokens(nn.Module):
    """A class token and position embeddings used directly (the broadcast-parameter rule for
    a batch of several), a scale by a parameter and a PReLU (no rule at all), and a Linear
    whose weight is also used directly."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(2, 4, 2, stride=2)
        self.cls = nn.Parameter(torch.randn(1, 1, 4))
        self.pos = nn.Parameter(torch.randn(1, 5, 4))
        self.scale = nn.Parameter(torch.rand(4))
        self.act = nn.PReLU()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), h], 1) + self.pos
        h = self.act(self.lin(h) * self.scale) + F.linear(h, self.lin.weight)
        return self.head(h[:, 0])


@pytest.mark.parametrize("fn", ["grads", "norms", "clipped"])
def test_hooks_computes_a_batch_of_one_with_parameters_used_outside_the_layers(fn):
    # a batch of one (an epoch's short last batch, a small Poisson batch) was refused under
    # 'hooks' for every parameter used outside the layers with rules ('cls' and 'pos', which
    # the broadcast rule computes for larger batches, too), and 'auto' ran vmap for them
    torch.manual_seed(0)
    model = PatchTokens().to(DT)
    loss_fn = nn.CrossEntropyLoss()
    # ('hooks' refuses 'scale', 'act.weight' and 'lin.weight' for a batch of 3)
    for batch, strategies in ((1, ("hooks", "auto")), (3, ("auto",))):
        x, t = _randn(batch, 2, 4, 4), _ints(3, batch)
        ref = loop_reference(model, loss_fn, x, t)
        for strategy in strategies:
            if fn == "grads":
                got = per_sample_grads(model, loss_fn, x, t, strategy=strategy)
                for n in ref:
                    torch.testing.assert_close(got[n], ref[n], msg=n)
            elif fn == "norms":
                torch.testing.assert_close(
                    per_sample_grad_norms(model, loss_fn, x, t, strategy=strategy),
                    ref_norms(ref))
            else:
                model.zero_grad(set_to_none=True)
                accumulate_clipped_grads(model, loss_fn, x, t, max_norm=0.5, strategy=strategy)
                c = (0.5 / ref_norms(ref)).clamp(max=1.0)
                for n, p in model.named_parameters():
                    want = (ref[n] * c.view(-1, *[1] * p.dim())).sum(0)
                    torch.testing.assert_close(p.grad, want, msg=n)
    plan = torch_vjp.per_sample_plan(model, loss_fn, _randn(1, 2, 4, 4), _ints(3, 1),
                                     strategy="hooks")
    assert plan["pos"].method == "rule", str(plan)
    assert plan["pos"].how == ("its whole gradient (a batch of one: the example's gradient "
                               "is the batch's)"), str(plan)
    assert plan["lin.bias"].how == "Linear rule in 'lin'", str(plan)


class Tied(nn.Module):
    """An embedding tied to the output head (GPT-2's token embedding and LM head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)).mean(1))


def test_tied_embedding_and_head():

    model = Tied().to(DT)
    _check(model, nn.CrossEntropyLoss(), _ints(7, 4, 3), _ints(7, 4), ("hooks", "auto"))


def test_weight_used_outside_its_layer_falls_back():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, 4)
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return F.linear(self.fc(self.emb(x)).mean(1), self.emb.weight)

    model = Functional().to(DT)
    x, t = _ints(7, 4, 3), _ints(7, 4)
    _check(model, nn.CrossEntropyLoss(), x, t, ("auto",))
    with pytest.raises(StrategyError, match=r"'emb.weight': it is used outside the layers"):
        per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy="hooks")


def test_weight_the_loss_function_reads_falls_back_and_hooks_says_so():
    # the refusal spoke of uses "directly in a forward, or by a layer without one" only,
    # where the use is the loss's own (an L2 term on a layer's weight)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)

    def loss_fn(out, t):
        return F.cross_entropy(out, t) + 0.1 * model[2].weight.square().sum()

    x, t = _randn(5, 4), _ints(2, 5)
    _check(model, loss_fn, x, t, ("auto", "loop"))
    with pytest.raises(StrategyError, match=r"'2.weight': it is used outside the layers that "
                       r"have rules \(directly in a forward or in the loss function"):
        per_sample_grads(model, loss_fn, x, t, strategy="hooks")


def test_parametrized_weight_falls_back():
    from torch.nn.utils import parametrize

    class Symmetric(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).mT

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    x, t = _randn(5, 4), _ints(2, 5)
    _check(model, nn.CrossEntropyLoss(), x, t, ("auto",))
    with pytest.raises(StrategyError, match=r"'0.parametrizations.weight.original': module "
                       r"'0' is a ParametrizedLinear, which has a rule, but the layer is called "
                       r"with a weight computed from its parameters"):
        per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy="hooks")


def test_layer_called_twice_and_in_place_activation():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(torch.relu_(self.lin(x))).sum(-1)

    _check(Twice().to(DT), lambda o: o.pow(2).sum(), _randn(3, 2, 4), None, ("hooks",))


class ConvPaths(nn.Module):
    """Convs that take each per-sample path: unfold + bmm (short patches, groups), the grouped
    convolution with one group per example (long patches), and the ghost identity (few output
    positions, many channels); plus Conv1d with a long patch and 'same' padding."""

    def __init__(self):
        super().__init__()
        self.short = nn.Conv2d(2, 8, 2, padding=1, groups=2, dilation=(1, 2))
        self.long = nn.Conv2d(8, 12, 3, stride=(2, 1), padding=1)
        self.ghost = nn.Conv2d(12, 16, 3, bias=False)
        self.c1d = nn.Conv1d(16, 8, 5, padding="same", padding_mode="reflect")
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.long(torch.tanh(self.short(x))))  # (B, 12, 3, 4)
        h = torch.tanh(self.ghost(h)).flatten(2).mean(2, keepdim=True)  # (B, 16, 1)
        h = self.c1d(h.expand(-1, -1, 6).contiguous())  # (B, 8, 6)
        return self.fc(h.mean(2))


@pytest.mark.parametrize("small_budget", [False, True], ids=["whole-batch", "chunked"])
def test_conv_paths(monkeypatch, small_budget):
    from torch_vjp._per_sample import factors
    from torch_vjp._per_sample.rules import conv

    if small_budget:  # every temporary split into chunks of examples
        monkeypatch.setattr(factors, "CHUNK_ELEMENTS", 64)
        monkeypatch.setattr(conv, "NORM_CHUNK_ELEMENTS", 64)
        monkeypatch.setattr(factors, "NORM_CHUNK_ELEMENTS", 64)
    torch.manual_seed(0)
    model = ConvPaths().to(DT)
    x, t = _randn(5, 2, 5, 4), _ints(3, 5)
    _check(model, nn.CrossEntropyLoss(), x, t, ("hooks",))
    ref = loop_reference(model, nn.CrossEntropyLoss(), x, t)
    norms = ref_norms(ref)
    c = (0.5 * norms.min() / norms).clamp(max=1.0)
    accumulate_clipped_grads(model, nn.CrossEntropyLoss(), x, t, max_norm=float(0.5 * norms.min()),
                             strategy="hooks")
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, ref[n]), msg=n)


@pytest.mark.parametrize("small_budget", [False, True], ids=["whole-batch", "chunked"])
def test_linear_direct_and_ghost_norms(monkeypatch, small_budget):
    from torch_vjp._per_sample import factors

    if small_budget:
        monkeypatch.setattr(factors, "CHUNK_ELEMENTS", 16)
    # Linear(3, 64) over 20 positions: forming g_i^T a_i is cheaper than the ghost identity;
    # Linear(64, 64) over 20 positions: the ghost identity is cheaper.
    model = nn.Sequential(nn.Linear(3, 64), nn.Tanh(), nn.Linear(64, 64)).to(DT)
    loss_fn = lambda o: o.sin().sum()  # noqa: E731
    _check(model, loss_fn, _randn(4, 20, 3), None, ("hooks",))


def test_under_no_grad_and_mixed_dtypes():
    model = mlp().to(DT)
    model[4].float()
    model[4].to(DT)
    x, t = _randn(4, 6), _ints(3, 4)
    ref = loop_reference(model, nn.CrossEntropyLoss(), x, t)
    with torch.no_grad():
        got = per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy="hooks")
        norms = per_sample_grad_norms(model, nn.CrossEntropyLoss(), x, t, strategy="hooks")
    for n in ref:
        torch.testing.assert_close(got[n], ref[n])
    torch.testing.assert_close(norms, ref_norms(ref))

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 4).double()
            self.b = nn.Linear(4, 2)  # float32

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)).float())

    mixed = Mixed()
    x32 = _randn(3, 3)
    got = per_sample_grads(mixed, lambda o: o.pow(2).sum(), x32, strategy="hooks")
    ref = loop_reference(mixed, lambda o: o.pow(2).sum(), x32, None)
    assert got["a.weight"].dtype == torch.float64 and got["b.weight"].dtype == torch.float32
    for n in ref:
        torch.testing.assert_close(got[n], ref[n])


def test_batchnorm_in_eval_mode_has_a_rule():
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(12, 2))
    model = model.to(DT).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_()
        model[1].running_var.uniform_(0.5, 2.0)
    _check(model, nn.CrossEntropyLoss(), _randn(4, 1, 4, 4), _ints(2, 4), ("hooks",))


def test_batch_of_one():
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 2)).to(DT)
    loss_fn = lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten())  # noqa: E731
    _check(model, loss_fn, _ints(5, 1, 4), _ints(2, 1, 4), STRATEGIES)


class _Squeezed(nn.Module):
    """A binary classifier that squeezes its output: (B,) for a batch, 0-d for one example."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x))).squeeze()


def test_batch_of_one_whose_output_is_squeezed_to_a_scalar():
    # the output of a batch of one example has no batch dimension left; the loss was still
    # sliced example by example: IndexError (slice() cannot be applied to a 0-dim tensor)
    torch.manual_seed(0)
    model = _Squeezed().to(DT)
    loss_fn = lambda o, t: F.binary_cross_entropy_with_logits(o.reshape(-1), t)  # noqa: E731
    x, t = _randn(1, 3), torch.rand(1, dtype=DT)
    _check(model, loss_fn, x, t, STRATEGIES)
    ref = loop_reference(model, loss_fn, x, t)
    for s in STRATEGIES:
        for p in model.parameters():
            p.grad = None
        accumulate_clipped_grads(model, loss_fn, x, t, max_norm=1e9, strategy=s)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[n][0], msg=f"{s}: {n}")


def _weight_set_after(wrap):
    loss_fn = nn.CrossEntropyLoss()
    loss_fn.weight = wrap(torch.tensor([1.0, 2.0, 0.5], dtype=DT))
    return loss_fn


@pytest.mark.parametrize(
    "loss_fn",
    [
        nn.CrossEntropyLoss(ignore_index=2),  # ignored targets: not a plain mean any more
        nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5], dtype=DT)),
        _weight_set_after(lambda w: nn.Parameter(w, requires_grad=False)),  # to parameters
        _weight_set_after(lambda w: w),  # a tensor assigned in place of the None buffer
        nn.CrossEntropyLoss(label_smoothing=0.1),
        lambda o, t: F.cross_entropy(o, t) ** 2,  # not separable: per-example losses by vmap
        lambda o, t: F.cross_entropy(o, t) * float(o.sum() > -1e9),  # not vmappable: a loop
    ],
    ids=["ignore-index", "class-weights", "weight-parameter", "weight-assigned",
         "label-smoothing", "squared", "python-control-flow"],
)
def test_loss_reductions(loss_fn):
    model = mlp().to(DT)
    x, t = _randn(6, 6), torch.tensor([0, 1, 2, 2, 1, 0])
    ref = loop_reference(model, loss_fn, x, t)
    # twice: the second call reuses the plan the first made
    for _ in range(2):
        got = per_sample_grads(model, loss_fn, x, t, strategy="hooks")
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], equal_nan=True)


def test_model_output_not_batch_first_falls_back():
    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x).T

    model = Transposed().to(DT)
    loss_fn = lambda o, t: F.cross_entropy(o.T, t)  # noqa: E731
    _check(model, loss_fn, _randn(5, 4), _ints(3, 5), ("auto",))


def test_vmap_failure_falls_back_to_loop():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.w if x.sum().item() > 0 else x * self.w * 2

    model = Branchy().to(DT)
    with pytest.warns(torch_vjp.TorchVJPWarning, match=r"strategy='auto' could not vectorise the "
                      r"per-sample gradients of Branchy with vmap, so it used one backward pass"):
        _check(model, lambda o: o.pow(2).sum(), _randn(4, 3), None, ("auto",))


def test_params_subset_and_frozen_parameter():
    model = mlp().to(DT)
    model[2].weight.requires_grad_(False)
    x, t = _randn(5, 6), _ints(3, 5)
    names = ["4.bias", "2.weight", "0.weight"]
    ref_model = copy.deepcopy(model)
    ref_model[2].weight.requires_grad_(True)
    ref = loop_reference(ref_model, nn.CrossEntropyLoss(), x, t)
    for s in STRATEGIES:
        got = per_sample_grads(model, nn.CrossEntropyLoss(), x, t, params=names, strategy=s)
        assert list(got) == names
        for n in names:
            torch.testing.assert_close(got[n], ref[n], msg=f"{s}: {n}")
        norms = per_sample_grad_norms(model, nn.CrossEntropyLoss(), x, t, params=names, strategy=s)
        torch.testing.assert_close(norms, torch.cat([ref[n].flatten(1) for n in names], 1).norm(dim=1))
    assert not model[2].weight.requires_grad


def test_default_params_skip_frozen():
    model = mlp().to(DT)
    model[0].weight.requires_grad_(False)
    got = per_sample_grads(model, nn.CrossEntropyLoss(), _randn(3, 6), _ints(3, 3))
    assert "0.weight" not in got and "0.bias" in got


@pytest.mark.parametrize("strategy", ["hooks", "vmap", "loop"])
def test_dropout_gives_each_example_its_own_mask(strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5), nn.Linear(64, 1)).to(DT).train()
    x = _randn(1, 4).expand(6, 4).contiguous()  # six copies of one example
    g = per_sample_grads(model, lambda o: o.sum(), x, strategy=strategy)["2.weight"]
    zero_pattern = (g[:, 0] == 0).to(torch.int8)  # which units each example dropped
    assert len({tuple(r.tolist()) for r in zero_pattern}) > 1
    assert torch.all(zero_pattern.sum(1) > 0) and torch.all(zero_pattern.sum(1) < 64)


# ------------------------------------------------------------------------------------------
# Nothing is mutated; accumulate_clipped_grads adds like backward
# ------------------------------------------------------------------------------------------


def _state(model):
    return (
        {n: p.detach().clone() for n, p in model.named_parameters()},
        {n: b.clone() for n, b in model.named_buffers()},
        {n: m.training for n, m in model.named_modules()},
        {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        {n: p.requires_grad for n, p in model.named_parameters()},
    )


def _hook_counts(model):
    return [
        (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        for m in model.modules()
    ]


def _assert_same_state(before, after):
    for a, b in zip(before, after):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert torch.equal(a[k], b[k]), k
            else:
                assert a[k] == b[k], k


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_mutation(strategy):
    class WithStats(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3)
            self.bn = nn.BatchNorm2d(2)
            self.fc = nn.Linear(8, 2)

        def forward(self, x):
            return self.fc(self.bn(self.conv(x)).flatten(1))

    model = WithStats().to(DT)
    model.bn.eval()  # the rest stays in training mode
    model.fc.weight.grad = torch.ones_like(model.fc.weight)
    x, t = _randn(3, 1, 4, 4), _ints(2, 3)
    x_before = x.clone()
    before, hooks_before = _state(model), _hook_counts(model)
    per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy=strategy)
    per_sample_grad_norms(model, nn.CrossEntropyLoss(), x, t, strategy=strategy)
    _assert_same_state(before, _state(model))
    assert _hook_counts(model) == hooks_before
    assert torch.equal(x, x_before)


def test_hooks_and_attention_mode_removed_after_an_error():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = nn.MultiheadAttention(4, 1, batch_first=True)

        def forward(self, x):
            self.att(x, x, x)
            raise KeyError("raised by the model")

    model = Boom().to(DT)
    before = _hook_counts(model)
    with pytest.raises(KeyError, match="raised by the model"):
        per_sample_grads(model, lambda o: o.sum(), _randn(2, 3, 4), strategy="hooks")
    assert _hook_counts(model) == before
    assert not torch.overrides._is_torch_function_mode_enabled()


def test_accumulate_adds_to_existing_grad_and_creates_missing():
    model, loss_fn, x, t = make("mlp")
    ref = loop_reference(model, loss_fn, x, t)
    norms = ref_norms(ref)
    c = (0.3 / norms).clamp(max=1.0)
    model[0].weight.grad = torch.full_like(model[0].weight, 2.0)
    accumulate_clipped_grads(model, loss_fn, x, t, max_norm=0.3)
    torch.testing.assert_close(model[0].weight.grad, 2.0 + torch.einsum("b,bij->ij", c, ref["0.weight"]))
    torch.testing.assert_close(model[0].bias.grad, torch.einsum("bi,b->i", ref["0.bias"], c))
    # A large max_norm clips nothing: the result is the ordinary gradient of the summed losses.
    for p in model.parameters():
        p.grad = None
    accumulate_clipped_grads(model, loss_fn, x, t, max_norm=1e9)
    total = sum(F.cross_entropy(model(x[i : i + 1]), t[i : i + 1]) for i in range(len(x)))
    expect = torch.autograd.grad(total, list(model.parameters()))
    for p, e in zip(model.parameters(), expect):
        torch.testing.assert_close(p.grad, e)


def test_params_given_as_a_generator_are_read_once():
    # accumulate_clipped_grads read params twice (the requires-grad check, then the
    # selection) and refused a generator: "params is empty; name at least one parameter"
    model, loss_fn, x, t = make("mlp")
    ref = loop_reference(model, loss_fn, x, t)
    norms = ref["0.weight"].flatten(1).norm(dim=1)
    c = (0.3 / norms).clamp(max=1.0)
    got = accumulate_clipped_grads(model, loss_fn, x, t, max_norm=0.3,
                                   params=(n for n in ["0.weight"]))
    torch.testing.assert_close(got, norms)
    torch.testing.assert_close(model[0].weight.grad, torch.einsum("b,bij->ij", c, ref["0.weight"]))
    assert model[0].bias.grad is None
    torch.testing.assert_close(per_sample_grad_norms(model, loss_fn, x, t,
                                                     params=iter(["0.weight"])), norms)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_accumulate_writes_grad_in_the_dtype_backward_gives(strategy):
    # a parameter with grad_dtype=float32 (mixed precision) and no .grad raised torch's
    # "attempting to assign a gradient with dtype 'double' to a tensor with grad_dtype 'Float'"
    model, loss_fn, x, t = make("mlp")
    ref = loop_reference(model, loss_fn, x, t)
    c = (0.3 / ref_norms(ref)).clamp(max=1.0)
    expect = torch.einsum("b,bij->ij", c, ref["0.weight"])
    w = model[0].weight
    w.grad_dtype = torch.float32
    accumulate_clipped_grads(model, loss_fn, x, t, max_norm=0.3, strategy=strategy)
    assert w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad, expect.float())
    # grad_dtype=None: an existing .grad keeps its dtype, as backward accumulates into it
    w.grad_dtype = None
    w.grad = torch.ones(w.shape, dtype=torch.float32)
    accumulate_clipped_grads(model, loss_fn, x, t, max_norm=0.3, strategy=strategy)
    assert w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad, 1.0 + expect.float())


@pytest.mark.parametrize("strategy", STRATEGIES + ("compile",))
def test_accumulate_runs_the_post_accumulate_grad_hooks_as_backward_does(
        strategy, aot_eager_unless_inductor):
    # an optimizer step in backward (register_post_accumulate_grad_hook) never ran (compile
    # =True's program built with aot_eager: the point is the hooks, not inductor's code)
    model, loss_fn, x, t = make("mlp")
    seen = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: seen.append((n, p.grad.clone())))
    loss_fn(model(x), t).backward()
    assert [n for n, _ in seen] and len(seen) == len(list(model.parameters()))
    model.zero_grad(set_to_none=True)
    seen.clear()
    options = {"compile": True} if strategy == "compile" else {"strategy": strategy}
    accumulate_clipped_grads(model, loss_fn, x, t, max_norm=0.3, **options)
    assert sorted(n for n, _ in seen) == sorted(n for n, _ in model.named_parameters())
    for n, g in seen:  # each hook ran after its parameter's .grad was written
        torch.testing.assert_close(g, dict(model.named_parameters())[n].grad)


def test_results_are_never_overwritten_by_a_later_call():
    model = nn.Linear(300, 300).to(DT)  # 8 examples x 90k params
    x1, x2, t = _randn(8, 300), _randn(8, 300), _ints(300, 8)
    first = per_sample_grads(model, nn.CrossEntropyLoss(), x1, t)
    kept = first["weight"].clone()
    storage = first["weight"].untyped_storage()  # a holder the use count does not see
    ptr = first["weight"].data_ptr()
    del first
    second = per_sample_grads(model, nn.CrossEntropyLoss(), x2, t)
    assert second["weight"].data_ptr() != ptr
    held = torch.empty(0, dtype=DT).set_(storage, 0, (8, 300, 300))
    assert torch.equal(held, kept)


# ------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------


def _small():
    return nn.Sequential(nn.Linear(3, 2)).to(DT), nn.CrossEntropyLoss(), _randn(4, 3), _ints(2, 4)


def _err_cases():
    m, lf, x, t = _small()
    bn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Sequential(nn.BatchNorm2d(2)), nn.Flatten())
    bn_stats = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2, track_running_stats=False)).eval()
    frozen = nn.Linear(3, 2).requires_grad_(False)
    return [
        ("strategy", lambda: per_sample_grads(m, lf, x, t, strategy="jacrev"), StrategyError,
         r"invalid strategy 'jacrev'. Supported: \('auto', 'hooks', 'vmap', 'loop'\)"),
        ("hooks-no-rule", lambda: per_sample_grads(custom().to(DT), lf, _randn(4, 4), t, strategy="hooks"),
         StrategyError, r"cannot compute 1 parameter\(s\) with a per-layer rule:\n    '1.w': its module '1' is a Scale"),
        ("batchnorm-train", lambda: per_sample_grads(bn, lambda o: o.sum(), _randn(2, 1, 4, 4)),
         PerSampleError, r"module '1.0' \(BatchNorm2d\) is in training mode.*\n  Fix: put it in eval mode"
         r".*model\[1\]\[0\].eval\(\).*nn.GroupNorm\(num_groups, 2\)"),
        ("batchnorm-no-running-stats", lambda: per_sample_grads(bn_stats, lf, x, t), PerSampleError,
         r"module '1' \(BatchNorm1d\) has no running statistics \(track_running_stats=False\)"),
        ("model-type", lambda: per_sample_grads(lambda z: z, lf, x, t), PerSampleTypeError,
         r"model must be a torch.nn.Module, got function"),
        ("inputs-type", lambda: per_sample_grads(m, lf, [[1.0, 2.0]], t), PerSampleTypeError,
         r"inputs\[0\] is a list, not a tensor"),
        ("inputs-dict", lambda: per_sample_grads(m, lf, {"x": x}, t), PerSampleTypeError,
         r"inputs must be a tensor or a tuple of tensors, got a dict(.|\n)*Keyword inputs are "
         r"not passed as such: pass the tensors as a tuple in the order of the model's forward"),
        # (an empty tuple was told "got tuple", the type it asked for)
        ("inputs-empty", lambda: per_sample_grads(m, lf, (), t), PerSampleTypeError,
         r"inputs must be a tensor or a tuple of tensors, got an empty tuple(.|\n)*at least one "
         r"tensor is needed"),
        # (these two said what was wrong but not how to pass a tensor the examples share)
        ("inputs-0d", lambda: per_sample_grads(m, lf, torch.tensor(1.0), t), PerSampleValueError,
         r"inputs\[0\] is a 0-dimensional tensor(.|\n)*Fix: a tensor that every example shares "
         r"(.|\n)*expand it to the batch \(t.expand\(B\)\) or hold it in the model"),
        ("inputs-batch", lambda: per_sample_grads(TwoInputs(), lf, (_randn(4, 3), _randn(1, 2)), t),
         PerSampleValueError, r"inputs\[1\] has shape \(1, 2\), but inputs\[0\] has shape \(4, 3\)"
         r"(.|\n)*Fix: a tensor that every example shares \(position ids or a mask of shape "
         r"\(1, T\), a scale\) is not an input: expand it to the batch "
         r"\(t.expand\(4, \*t.shape\[1:\]\)\) or hold it in the model"),
        # (EmbeddingBag's flat indices and offsets got no word on how to pass them)
        ("inputs-offsets", lambda: per_sample_grads(Bag(), lf, (_ints(9, 9), torch.tensor([0, 2, 2, 5])), t),
         PerSampleValueError, r"inputs\[1\] has shape \(4,\), but inputs\[0\] has shape \(9,\)(.|\n)*"
         r"Flat indices and offsets \(as nn.EmbeddingBag takes them\) hold no batch dimension: "
         r"pass the indices padded to \(B, L\)"),
        # (any two 1-D integer inputs of unequal lengths were told about EmbeddingBag, in
        # place of the fix for a tensor the examples share: a model without one, or a table
        # of ids that are no offsets)
        ("inputs-shared-ids", lambda: per_sample_grads(Ids(), lf, (_ints(9, 4), _ints(9, 9)), t),
         PerSampleValueError, r"inputs\[1\] has shape \(9,\), but inputs\[0\] has shape \(4,\)"
         r"(.|\n)*\(the batch\) differ, 9 vs 4.(.|\n)*Fix: a tensor that every example shares "
         r"[^$]*expand it to the batch \(t.expand\(4, \*t.shape\[1:\]\)\)(?!(.|\n)*EmbeddingBag)"),
        ("inputs-ids-no-offsets", lambda: per_sample_grads(Bag(), lf, (_ints(9, 4) + 1, _ints(9, 9)), t),
         PerSampleValueError, r"differ, 9 vs 4.(.|\n)*Fix: a tensor that every example shares"
         r"(?!(.|\n)*EmbeddingBag)"),
        ("targets-batch", lambda: per_sample_grads(m, lf, x, _ints(2, 5)), PerSampleValueError,
         r"targets has shape \(5,\), but the batch has 4 examples"),
        # (a pytree's leaf was reported as "targets has shape ()", not which leaf nor why)
        ("targets-leaf-0d", lambda: per_sample_grads(
            m, lambda o, t: F.cross_entropy(o, t["y"]) * t["w"], x, {"y": t, "w": torch.tensor(2.0)}),
         PerSampleValueError, r"targets\['w'\] has shape \(\), but the batch has 4 examples "
         r"\(inputs\[0\] has 4 rows\): it has no batch dimension(.|\n)*Fix: a value shared by all "
         r"examples"),
        ("params-unknown", lambda: per_sample_grads(m, lf, x, t, params=["0.weigth"]), PerSampleValueError,
         r"params names '0.weigth', which is not a parameter of the model.\n  Its parameters are: "
         r"'0.weight', '0.bias'"),
        # (a buffer was called "not a parameter" without a word on what it is)
        ("params-buffer", lambda: per_sample_grads(
            nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).to(DT).eval(), lf, x, t,
            params=["1.running_mean"]), PerSampleValueError,
         r"params names '1.running_mean', which is not a parameter of the model. It is a "
         r"buffer \(a state the forward reads or updates, such as BatchNorm's running "
         r"statistics\), which has no gradient.\n  Its parameters are: '0.weight', '0.bias', "
         r"'1.weight', '1.bias'"),
        ("params-tensor", lambda: per_sample_grads(m, lf, x, t, params=[m[0].weight]), PerSampleTypeError,
         r"params must hold parameter names \(str\), got a Parameter"),
        ("params-empty", lambda: per_sample_grads(m, lf, x, t, params=[]), PerSampleValueError,
         r"params is empty"),
        ("nothing-requires-grad", lambda: per_sample_grads(frozen, lf, x, t), PerSampleValueError,
         r"the model has no parameter that requires grad"),
        ("loss-not-scalar", lambda: per_sample_grads(m, lambda o, t: o.exp(), x, t, strategy="vmap"),
         PerSampleValueError, r"loss_fn returned a tensor of shape \(1, 2\) and dtype torch.float64 "
         r"for one example; it must return one floating-point number"),
        ("loss-not-scalar-hooks", lambda: per_sample_grads(m, lambda o, t: o, x, t, strategy="hooks"),
         PerSampleValueError, r"loss_fn returned a tensor of shape \(1, 2\)"),
        # (a Python number: the fix is not a reduction, it told to avoid reduction='none')
        ("loss-a-python-number", lambda: per_sample_grads(m, lambda o, t: float(o.sum()), x, t,
                                                          strategy="vmap"),
         PerSampleValueError, r"loss_fn returned a float for one example(.|\n)*has no autograd "
         r"graph back to the parameters: compute the loss with torch operations"),
        # (a (loss, aux) pair and an integer loss were told that "a number that is not a
        # tensor has no autograd graph" and to "use reduction='mean'": neither is the fix)
        ("loss-with-aux", lambda: per_sample_grads(m, lambda o, t: (F.cross_entropy(o, t), o), x, t),
         PerSampleValueError, r"loss_fn returned a tuple of 2 items for one example(.|\n)*without "
         r"auxiliary outputs \(a \(loss, aux\) pair\). Fix: return only the loss"),
        ("loss-integer", lambda: per_sample_grads(m, lambda o, t: (o.argmax(1) == t).sum(), x, t),
         PerSampleValueError, r"loss_fn returned a tensor of shape \(\) and dtype torch.int64 for one "
         r"example(.|\n)*an integer or boolean result \(a count of correct predictions, an argmax\) "
         r"has no gradient"),
        # (None and a dict were told that "a number that is not a tensor has no autograd
        # graph", and to avoid .item(): neither is the fix)
        ("loss-none", lambda: per_sample_grads(m, lambda o, t: None, x, t),
         PerSampleValueError, r"loss_fn returned None for one example(.|\n)*A function without "
         r"a return statement returns None. Fix: return the loss tensor"),
        ("loss-dict", lambda: per_sample_grads(m, lambda o, t: {"loss": F.cross_entropy(o, t)},
                                               x, t),
         PerSampleValueError, r"loss_fn returned a dict with keys \['loss'\] for one "
         r"example(.|\n)*not a dict of outputs. Fix: return its loss entry"),
        ("loss-complex", lambda: per_sample_grads(m, lambda o, t: o.sum() * 1j, x, t),
         PerSampleValueError, r"loss_fn returned a tensor of shape \(\) and dtype torch.complex128 "
         r"(.|\n)*A loss is minimised, so it must be real"),
        ("chunk-size", lambda: per_sample_grads(m, lf, x, t, chunk_size=0), PerSampleValueError,
         r"chunk_size=0, but it must be None or an int >= 1"),
        ("max-norm-value", lambda: accumulate_clipped_grads(m, lf, x, t, max_norm=-1.0), PerSampleValueError,
         r"max_norm must be a positive finite number, got -1.0"),
        ("max-norm-several", lambda: accumulate_clipped_grads(m, lf, x, t, max_norm=torch.ones(2)),
         PerSampleTypeError, r"max_norm must be one positive number, got a tensor of shape \(2,\)"),
        ("max-norm-type", lambda: accumulate_clipped_grads(m, lf, x, t, max_norm="1"), PerSampleTypeError,
         r"max_norm must be a positive number, got str"),
    ]


@pytest.mark.parametrize("max_norm", [np.float32(0.3), np.int64(1), torch.tensor(0.3)],
                         ids=["np.float32", "np.int64", "tensor"])
def test_max_norm_of_any_real_number_type(max_norm):
    # numpy's float32 and int64 scalars were refused ("must be a positive number, got float32")
    model, loss_fn, x, t = make("mlp")
    ref = loop_reference(model, loss_fn, x, t)
    c = (float(max_norm) / ref_norms(ref)).clamp(max=1.0)
    accumulate_clipped_grads(model, loss_fn, x, t, max_norm=max_norm)
    torch.testing.assert_close(model[0].weight.grad, torch.einsum("b,bij->ij", c, ref["0.weight"]))


@pytest.mark.parametrize("name,call,exc,match", _err_cases(), ids=[c[0] for c in _err_cases()])
def test_per_sample_err_check(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_errors_derive_from_builtins():
    assert issubclass(PerSampleError, RuntimeError)
    assert issubclass(PerSampleValueError, (PerSampleError, ValueError))
    assert issubclass(PerSampleTypeError, (PerSampleError, TypeError))
    assert issubclass(PerSampleError, torch_vjp.TorchVJPError)


def test_user_errors_pass_through_untouched():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            raise ZeroDivisionError("the model's own error")

    for s in STRATEGIES:
        with pytest.raises(ZeroDivisionError, match="the model's own error"):
            per_sample_grads(Broken(), nn.CrossEntropyLoss(), _randn(2, 3), _ints(2, 2), strategy=s)


@pytest.mark.parametrize("norm", ["layernorm-2d", "rmsnorm", "rmsnorm-2d"])
def test_normalization_rules(norm):
    """LayerNorm and RMSNorm rules (one or two normalized dimensions) against the loop, with
    strategy="hooks" so that a missing rule would raise instead of falling back."""
    torch.manual_seed(0)
    layer = {
        "layernorm-2d": lambda: nn.LayerNorm((3, 4)),
        "rmsnorm": lambda: nn.RMSNorm(4),
        "rmsnorm-2d": lambda: nn.RMSNorm((3, 4), eps=1e-5),
    }[norm]()
    with torch.no_grad():  # non-trivial affine weights
        layer.weight.normal_()
        if getattr(layer, "bias", None) is not None:
            layer.bias.normal_()
    model = nn.Sequential(nn.Linear(4, 4), layer, nn.Flatten(), nn.Linear(12, 3)).to(DT)
    x, t = _randn(5, 3, 4), _ints(3, 5)
    _check(model, nn.CrossEntropyLoss(), x, t, ("hooks", "auto"))
    ref = loop_reference(model, nn.CrossEntropyLoss(), x, t)
    c = (0.5 * ref_norms(ref).min() / ref_norms(ref)).clamp(max=1.0)
    accumulate_clipped_grads(model, nn.CrossEntropyLoss(), x, t,
                             max_norm=float(0.5 * ref_norms(ref).min()), strategy="hooks")
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, ref[n]), msg=n)


class _UnhashableLoss:
    __hash__ = None  # e.g. a dataclass with eq=True

    def __call__(self, out, target):
        return ((out - target) ** 2).sum()


@pytest.mark.parametrize("strategy", ["auto", "hooks", "vmap", "loop"])
def test_unhashable_loss_object_works(strategy):
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    g = per_sample_grads(model, _UnhashableLoss(), x, y, strategy=strategy)
    ref = torch.autograd.grad(_UnhashableLoss()(model(x[1:2]), y[1:2]), model.weight)[0]
    torch.testing.assert_close(g["weight"][1], ref)


def test_torchscript_model_is_refused_with_the_fix():
    model = torch.jit.script(nn.Linear(3, 2).double())
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    with pytest.raises(PerSampleError, match=r"model is a TorchScript module .*pass the "
                       r"module before torch.jit.script") as info:
        per_sample_grads(model, nn.MSELoss(), x, y)
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_inference_mode_is_refused_not_computed_as_zeros(strategy):
    model, loss_fn, x, t = make("mlp")
    calls = {
        "per_sample_grads": lambda: per_sample_grads(model, loss_fn, x, t, strategy=strategy),
        "per_sample_grad_norms": lambda: per_sample_grad_norms(model, loss_fn, x, t,
                                                               strategy=strategy),
        "accumulate_clipped_grads": lambda: accumulate_clipped_grads(
            model, loss_fn, x, t, max_norm=1.0, strategy=strategy),
        "per_sample_plan": lambda: torch_vjp.per_sample_plan(model, loss_fn, x, t,
                                                             strategy=strategy),
    }
    for name, call in calls.items():
        with torch.inference_mode(), pytest.raises(PerSampleError) as info:
            call()
        assert str(info.value).startswith(
            f"torch_vjp.{name}: called inside torch.inference_mode(), where torch records no "
            f"graph"), str(info.value)
        assert "Fix: call it outside the inference_mode block" in str(info.value)
    assert all(p.grad is None for p in model.parameters())
    # torch.no_grad() is lifted for the call
    with torch.no_grad():
        got = per_sample_grads(model, loss_fn, x, t, strategy=strategy)
    for n, g in loop_reference(model, loss_fn, x, t).items():
        torch.testing.assert_close(got[n], g)


class ScalesItsInput(nn.Module):
    """Changes its input in place (x.mul_(2)), as a preprocessing step might."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x.mul_(2)
        return self.fc(torch.tanh(x))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_forward_that_changes_its_input_in_place(strategy):
    # Every forward of the call (planning, the rules' pass, the fallback, the check) must
    # see the input as given, and the caller's input must come back as it was.
    torch.manual_seed(0)
    model = ScalesItsInput().to(DT)
    loss_fn = lambda o: o.sin().sum()  # noqa: E731
    x = _randn(5, 4)
    given = x.clone()
    rows = {n: [] for n, _ in model.named_parameters()}  # each example on its own copy
    for i in range(5):
        grads = torch.autograd.grad(loss_fn(model(given[i:i + 1].clone())),
                                    list(model.parameters()))
        for (n, _), g in zip(model.named_parameters(), grads):
            rows[n].append(g)
    ref = {n: torch.stack(v) for n, v in rows.items()}
    for _ in range(2):  # the planning call, then a call with the plan
        got = per_sample_grads(model, loss_fn, x, strategy=strategy)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], msg=n)
        torch.testing.assert_close(per_sample_grad_norms(model, loss_fn, x, strategy=strategy),
                                   ref_norms(ref))
        model.zero_grad(set_to_none=True)
        accumulate_clipped_grads(model, loss_fn, x, max_norm=1e9, strategy=strategy)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[n].sum(0), msg=n)
        assert torch.equal(x, given)


@pytest.mark.parametrize("layer", ["Embedding", "EmbeddingBag"])
def test_a_layer_setting_changed_after_planning_is_seen(layer):
    # The rules decided on the layers' settings when the plan was made: scale_grad_by_freq
    # switched on later must not be computed with the rule that declines it.
    loss_fn = lambda o: o.sin().sum() + o.pow(2).sum()  # noqa: E731
    x = torch.tensor([[1, 1, 2], [3, 3, 3], [1, 2, 4], [5, 5, 6], [1, 4, 1]])
    torch.manual_seed(0)
    model = nn.Sequential(getattr(nn, layer)(7, 3), nn.Linear(3, 2)).to(DT)
    per_sample_grads(model, loss_fn, x)
    assert torch_vjp.per_sample_plan(model, loss_fn, x)["0.weight"].method == "rule"
    model[0].scale_grad_by_freq = True
    ref = loop_reference(model, loss_fn, x, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (vmap's slow path for embedding_bag)
        got = per_sample_grads(model, loss_fn, x)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)
    plan = torch_vjp.per_sample_plan(model, loss_fn, x)
    assert plan["0.weight"].method != "rule" and "scale_grad_by_freq" in plan["0.weight"].reason
    with pytest.raises(StrategyError, match="does not handle scale_grad_by_freq"):
        per_sample_grads(model, loss_fn, x, strategy="hooks")


def test_recurrent_dropout_set_after_planning_is_seen():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(3, 4, num_layers=2, batch_first=True)

        def forward(self, z):
            return self.rnn(z)[0][:, -1]

    torch.manual_seed(0)
    model = Stack().to(DT).train()
    z = _randn(5, 4, 3)
    loss_fn = lambda o: o.pow(2).sum()  # noqa: E731
    per_sample_grads(model, loss_fn, z)
    model.rnn.dropout = 0.3
    with pytest.raises(StrategyError, match="does not replay dropout between layers"):
        per_sample_grads(model, loss_fn, z, strategy="hooks")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch_vjp.TorchVJPWarning)
        got = per_sample_grads(model, loss_fn, z)  # (the rule's replay gave zeros here)
    assert all(bool(g.abs().amax(dim=tuple(range(1, g.dim()))).gt(0).all())
               for n, g in got.items() if "weight" in n)


def test_autocast_is_checked_at_the_precision_it_computes_in():
    # Under autocast to bfloat16 the rules and the per-example loop both round at bfloat16's
    # precision: the first call's check must not call the rule wrong (it raised under
    # 'hooks' and sent the layer to vmap under 'auto').
    torch.manual_seed(0)
    md = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    xd, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    ref = loop_reference(md, nn.CrossEntropyLoss(), xd, y)
    for strategy in ("hooks", "auto"):
        m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        m.load_state_dict({k: v.float() for k, v in md.state_dict().items()})
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = per_sample_grads(m, nn.CrossEntropyLoss(), xd.float(), y, strategy=strategy)
            plan = torch_vjp.per_sample_plan(m, nn.CrossEntropyLoss(), xd.float(), y)
        for n in ref:
            assert float((got[n].double() - ref[n]).norm() / ref[n].norm()) < 3e-2, n
        assert {r.method for r in plan.rows} == {"rule"}, str(plan)


@pytest.mark.parametrize("fn", [per_sample_grads, per_sample_grad_norms, "clipped"])
def test_a_lazy_module_not_yet_run_is_refused_with_the_fix(fn):
    # torch's ValueError ('uninitialized parameter') came out of the copy of the parameters
    model = nn.Sequential(nn.LazyLinear(6), nn.Tanh(), nn.LazyLinear(3))
    x, t = torch.randn(5, 4), torch.randint(0, 3, (5,))
    call = ((lambda *a: accumulate_clipped_grads(*a, max_norm=1.0)) if fn == "clipped"
            else fn)
    with pytest.raises(torch_vjp.PerSampleValueError,
                       match=r"(?s)lazy module has not created yet \('0\.weight', '0\.bias', "
                             r"'2\.weight', '2\.bias'\).*Fix: run the model once first"):
        call(model, nn.CrossEntropyLoss(), x, t)
    with torch.no_grad():
        model(x)  # the fix
    got = per_sample_grads(model, nn.CrossEntropyLoss(), x, t)
    assert got["0.weight"].shape == (5, 6, 4)


@pytest.mark.parametrize("compile", [False, True])
def test_tied_parameters_names_each_get_a_tensor_of_their_own(compile):
    # an embedding tied to the output head: both names held one tensor, so clipping each
    # entry in place in a loop scaled the tied one twice
    torch.manual_seed(0)
    model = Tied().to(DT)
    x, t = _ints(7, 5, 3), _ints(7, 5)
    got = per_sample_grads(model, nn.CrossEntropyLoss(), x, t,
                           params=["emb.weight", "head.weight"], compile=compile)
    a, b = got["emb.weight"], got["head.weight"]
    torch.testing.assert_close(a, b)
    a.mul_(0.5)
    torch.testing.assert_close(b, 2 * a)  # the other name's tensor is untouched


# ---- the ghost-norm identity in low precision --------------------------------------------


class _SignedTokens(nn.Module):
    """A layer over 24 near-identical tokens: the loss below gives them output gradients
    of alternating sign, so each example's weight gradient is far smaller than its terms."""

    def __init__(self, conv):
        super().__init__()
        self.conv = conv
        self.layer = nn.Conv1d(64, 64, 1, bias=False) if conv else nn.Linear(64, 64, bias=False)

    def forward(self, x):  # (B, 24, 64)
        return self.layer(x.transpose(1, 2)).transpose(1, 2) if self.conv else self.layer(x)


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv1d"])
def test_ghost_norms_in_float32_do_not_cancel_to_zero(conv):
    # <a_i a_i^T, g_i g_i^T> summed over 24^2 token pairs cancelled in float32 to 0 (or a
    # fraction of the norm): a clip factor of 1, an example's contribution past max_norm
    # (27x the bound on the clipped sum), silently, on every batch after the checked first
    gen = torch.Generator().manual_seed(0)
    model = _SignedTokens(conv)
    w = torch.randn(64, generator=gen)
    sign = torch.tensor([1.0, -1.0]).repeat(12)

    def loss(out):
        return (out @ w.to(out.dtype) * sign.to(out.dtype)).sum()

    B = 8
    torch_vjp.per_sample_grad_norms(model, loss, torch.randn(B, 24, 64, generator=gen))
    x = torch.randn(B, 1, 64, generator=gen) + 3e-5 * torch.randn(B, 24, 64, generator=gen)
    wide = copy.deepcopy(model).double()
    rows = [torch.func.grad(lambda p, i=i: loss(torch.func.functional_call(
        wide, p, (x[i:i + 1].double(),))))({"layer.weight": wide.layer.weight.detach()})
        ["layer.weight"].reshape(-1) for i in range(B)]
    truth = torch.stack(rows).norm(dim=1)
    for strategy in ("auto", "hooks"):
        norms = torch_vjp.per_sample_grad_norms(model, loss, x, strategy=strategy)
        torch.testing.assert_close(norms.double(), truth, rtol=1e-3, atol=0)
        model.zero_grad(set_to_none=True)
        C = 1e-4
        torch_vjp.accumulate_clipped_grads(model, loss, x, max_norm=C, strategy=strategy)
        c = (C / truth).clamp(max=1.0)
        want = (c[:, None] * torch.stack(rows)).sum(0).reshape(model.layer.weight.shape)
        torch.testing.assert_close(model.layer.weight.grad.double(), want, rtol=2e-3,
                                   atol=1e-3 * B * C)


@pytest.mark.parametrize("loss_fn", [nn.L1Loss(), nn.MSELoss(), nn.HuberLoss(), F.l1_loss],
                         ids=["l1", "mse", "huber", "F.l1_loss"])
@pytest.mark.parametrize("strategy", ["auto", "hooks", "vmap", "loop"])
def test_an_elementwise_loss_with_broadcast_targets_keeps_its_examples_apart(loss_fn, strategy):
    # a (B, 1) output against (B,) targets: the batched loss broadcasts to (B, B) and pairs
    # every output with every target, so it is not the sum of the examples' losses (taken
    # as one: 'auto' and 'hooks' were off by up to 5.0, silently)
    model = nn.Linear(1, 1).double()
    x = torch.tensor([[0.0], [1.0], [2.0], [10.0], [3.0], [11.0]], dtype=torch.float64)
    y = torch.tensor([0.5, 1.5, 2.5, 0.0, 3.5, 0.0], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's "target size ... different"
        ref = loop_reference(model, loss_fn, x, y)
        got = per_sample_grads(model, loss_fn, x, y, strategy=strategy)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n])
        torch.testing.assert_close(per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy),
                                   ref_norms(ref))


@pytest.mark.parametrize("strategy", ["auto", "loop"])
def test_norms_and_clipped_sums_under_bfloat16_autocast_are_taken_at_float32_precision(strategy):
    # under autocast the recorded inputs and output gradients are bfloat16: the ghost norms
    # of near-cancelling tokens were off by up to 24% (the cancellation check read float32's
    # rounding off bfloat16 products), one example's clipped contribution reached 1.15x
    # max_norm, and the direct norm that the check falls back to raised a dtype error
    gen = torch.Generator().manual_seed(0)
    B, T, d = 8, 24, 64
    model = nn.Linear(d, d, bias=False)
    sign = torch.tensor([1.0, -1.0]).repeat(T // 2)
    W0 = torch.randn(B, d, generator=gen)

    def loss(out, tgt):  # d loss / d out[i, t] = sign_t W0[i] + 0.1 noise
        return (out.float() * (sign[None, :, None] * tgt[:, :1] + 0.1 * tgt[:, 1:])).sum()

    tgt = torch.cat([W0[:, None], torch.randn(B, T, d, generator=gen)], 1)
    x = torch.randn(B, 1, d, generator=gen) + 0.05 * torch.randn(B, T, d, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch_vjp.per_sample_grad_norms(model, loss, torch.randn(B, T, d, generator=gen), tgt,
                                        strategy=strategy)
        norms = torch_vjp.per_sample_grad_norms(model, loss, x, tgt, strategy=strategy)
    truth = []
    for i in range(B):  # each example alone, under the same autocast
        with torch.autocast("cpu", dtype=torch.bfloat16):
            one = loss(model(x[i:i + 1]), tgt[i:i + 1])
        (g,) = torch.autograd.grad(one, model.weight)
        truth.append(g.double().norm())
    truth = torch.stack(truth)
    torch.testing.assert_close(norms.double(), truth, rtol=5e-3, atol=0)
    C = float(truth.min()) / 2
    for i in range(B):  # each example's clipped contribution is max_norm, not past it
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch_vjp.accumulate_clipped_grads(model, loss, x[i:i + 1], tgt[i:i + 1], max_norm=C,
                                               strategy=strategy)
        # (the clipped sum at float32's precision: the loop's was summed in bfloat16, 0.3%
        # past max_norm)
        assert float(model.weight.grad.double().norm()) <= C * (1 + 1e-4)


@pytest.mark.parametrize("strategy", ["auto", "hooks", "vmap", "loop"])
def test_per_sample_grads_under_bfloat16_autocast_with_a_sequence_input(strategy):
    # a Linear over (B, T, d) under autocast: the rule's bfloat16 input and output gradient
    # met a float32 result buffer in torch.bmm(out=...): "expected scalar type BFloat16"
    gen = torch.Generator().manual_seed(0)
    m = nn.Linear(8, 4)
    x, y = torch.randn(6, 5, 8, generator=gen), torch.randn(6, 5, 4, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = per_sample_grads(m, nn.MSELoss(), x, y, strategy=strategy)
        want = per_sample_grads(m, nn.MSELoss(), x, y, strategy="loop")
    assert got["weight"].dtype == torch.float32
    torch.testing.assert_close(got["weight"], want["weight"], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("strategy", ["vmap", "auto", "hooks", "loop"])
def test_a_python_number_in_targets_is_shared_by_every_example(strategy):
    # the refusal of a 0-d tensor in targets says a shared value belongs "in targets as a
    # Python number"; strategy='vmap' then failed (vmap's in_dims gave every leaf of targets
    # dimension 0: "Got in_dim=0 for an input but the input is of type <class 'float'>")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    x, y = torch.randn(5, 3, dtype=DT), torch.randint(0, 2, (5,))
    ref = loop_reference(model, lambda o, t: F.cross_entropy(o, t) * 0.5, x, y)

    def loss_fn(out, t):
        return F.cross_entropy(out, t["y"]) * t["w"]

    targets = {"y": y, "w": 0.5, "none": None}
    got = per_sample_grads(model, loss_fn, x, targets, strategy=strategy)
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g)
    torch.testing.assert_close(per_sample_grad_norms(model, loss_fn, x, targets,
                                                     strategy=strategy), ref_norms(ref))


@pytest.mark.filterwarnings("ignore:Complex modules")  # (torch's, on .to(complex))
def test_complex_parameters_follow_torchs_convention():
    # the Linear rule gave x^T g for a complex weight where torch gives x^H g (off by 0.91
    # under auto and hooks), and the norms and the clipped sum raised "clamp is not
    # supported for complex types" under every strategy
    torch.manual_seed(0)
    C = torch.complex128
    m = nn.Sequential(nn.Linear(4, 4).to(C), nn.Linear(4, 2).to(C))
    x = torch.randn(5, 4, dtype=C)
    lf = lambda o: o.abs().pow(2).sum()  # noqa: E731
    params = list(m.parameters())
    per = [torch.autograd.grad(lf(m(x[i:i + 1])), params) for i in range(5)]
    ref = {n: torch.stack([g[k] for g in per]) for k, (n, _) in enumerate(m.named_parameters())}
    norms = torch.cat([r.flatten(1) for r in ref.values()], 1).norm(dim=1)
    for strategy in ("auto", "vmap", "loop"):
        got = per_sample_grads(m, lf, x, strategy=strategy)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], msg=n)
        torch.testing.assert_close(per_sample_grad_norms(m, lf, x, strategy=strategy), norms)
        for p in params:
            p.grad = None
        torch.testing.assert_close(
            accumulate_clipped_grads(m, lf, x, max_norm=1.0, strategy=strategy), norms)
        c = (1.0 / norms).clamp(max=1.0).to(C)
        for n, p in m.named_parameters():
            torch.testing.assert_close(p.grad, torch.tensordot(c, ref[n], dims=1), msg=n)
    with pytest.raises(StrategyError, match=r"'0.weight': in '0', its parameters are complex, "
                                            r"and the rules give the per-sample gradients of "
                                            r"real parameters"):
        per_sample_grads(m, lf, x, strategy="hooks")


def test_the_row_test_of_a_complex_layer_reads_both_parts():
    # the plan's test that each row keeps its example's loss weights took .double() of the
    # complex gradients: torch warned "Casting complex values to real discards the imaginary
    # part" on every plan, and the test saw the real parts alone
    torch.manual_seed(0)
    C = torch.complex128
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (torch's note on complex modules)
        m = nn.Sequential(nn.Linear(4, 4).to(C), nn.Linear(4, 2).to(C))
    x = torch.randn(5, 4, dtype=C)
    lf = lambda o: o.abs().pow(2).sum()  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = per_sample_grads(m, lf, x)
    assert not [str(w.message) for w in caught if "imaginary" in str(w.message)]
    params = list(m.parameters())
    for i in range(5):
        want = torch.autograd.grad(lf(m(x[i:i + 1])), params)
        for (n, _), g in zip(m.named_parameters(), want):
            torch.testing.assert_close(got[n][i], g, msg=n)
