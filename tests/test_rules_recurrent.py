"""The per-layer rules of nn.RNN, nn.LSTM and nn.GRU (``rules/recurrent.py``) against the loop.

Every case runs under ``strategy="hooks"``, which refuses a parameter no rule covers, so a
passing case proves the recurrent rule computed the layer's parameters. The reference is the
definition in float64: one forward and backward per example.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import torch_vjp as tv
from torch_vjp.per_sample import accumulate_clipped_grads, per_sample_grad_norms, per_sample_grads

DT = torch.float64
VOCAB, EMB, HIDDEN, CLASSES = 11, 3, 4, 3
LAYERS = {"rnn": nn.RNN, "lstm": nn.LSTM, "gru": nn.GRU}


@dataclass
class Config:
    """One recurrent layer in the model below.

    Attributes:
        kind: ``"rnn"``, ``"lstm"`` or ``"gru"``.
        batch_first: the layer's ``batch_first``.
        readout: what the head reads: ``"last"`` (the output at the last time step),
            ``"mean"`` (over time), ``"hn"`` (the last layer's ``h_n``, both directions),
            ``"cn"`` (the last layer's ``c_n`` and the last output, LSTM only).
        hx: pass an initial state computed from the example (positionally).
        kw: the layer's other arguments.
        batch, time: the input's shape.
    """

    kind: str
    batch_first: bool
    readout: str
    hx: bool = False
    kw: dict = field(default_factory=dict)
    batch: int = 4
    time: int = 5


class Seq(nn.Module):
    """Embedding -> recurrent layer -> readout -> Linear."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Embedding(VOCAB, EMB)
        self.rnn = LAYERS[cfg.kind](EMB, HIDDEN, batch_first=cfg.batch_first, **cfg.kw)
        self.states = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
        self.out_size = cfg.kw.get("proj_size") or HIDDEN
        if cfg.hx:
            # the initial state depends on the example, so its gradient reaches `init`
            self.init = nn.Linear(EMB, self.states * self.out_size)
            if cfg.kind == "lstm":
                self.init_c = nn.Linear(EMB, self.states * HIDDEN)
        D = 2 if self.rnn.bidirectional else 1
        feat = D * self.out_size + (HIDDEN if cfg.readout == "cn" else 0)
        self.fc = nn.Linear(feat, CLASSES)

    def _state(self, e, lin, size):
        B = e.shape[0]
        return torch.tanh(lin(e.mean(1))).view(B, self.states, size).transpose(0, 1).contiguous()

    def forward(self, x):
        cfg = self.cfg
        e = self.emb(x)  # (B, T, E)
        h = e if cfg.batch_first else e.transpose(0, 1)
        args = ()
        if cfg.hx:
            h0 = self._state(e, self.init, self.out_size)
            args = ((h0, self._state(e, self.init_c, HIDDEN)),) if cfg.kind == "lstm" else (h0,)
        out, state = self.rnn(h, *args)
        if not cfg.batch_first:
            out = out.transpose(0, 1)
        if cfg.readout == "last":
            feat = out[:, -1]
        elif cfg.readout == "mean":
            feat = out.mean(1)
        else:
            hn = state[0] if cfg.kind == "lstm" else state
            D = 2 if self.rnn.bidirectional else 1
            feat = torch.cat(list(hn[-D:]), 1)  # the last layer's directions, (B, D * H)
            if cfg.readout == "cn":
                feat = torch.cat([out[:, -1], state[1][-1]], 1)
        return self.fc(feat)


CONFIGS = {
    "rnn-tanh-batchfirst-last": Config("rnn", True, "last"),
    "rnn-tanh-seqfirst-mean-hx": Config("rnn", False, "mean", hx=True),
    "rnn-relu-2layer-bidir-batchfirst-hn": Config(
        "rnn", True, "hn", kw=dict(nonlinearity="relu", num_layers=2, bidirectional=True)),
    "rnn-relu-nobias-seqfirst-last-hx": Config(
        "rnn", False, "last", hx=True, kw=dict(nonlinearity="relu", bias=False)),
    "lstm-batchfirst-last": Config("lstm", True, "last"),
    "lstm-seqfirst-hn": Config("lstm", False, "hn"),
    "lstm-2layer-batchfirst-mean-hx": Config("lstm", True, "mean", hx=True, kw=dict(num_layers=2)),
    "lstm-bidir-seqfirst-last": Config("lstm", False, "last", kw=dict(bidirectional=True)),
    "lstm-proj-batchfirst-hn-hx": Config("lstm", True, "hn", hx=True, kw=dict(proj_size=2)),
    "lstm-proj-2layer-bidir-seqfirst-mean": Config(
        "lstm", False, "mean", kw=dict(proj_size=3, num_layers=2, bidirectional=True)),
    "lstm-nobias-batchfirst-cn": Config("lstm", True, "cn", kw=dict(bias=False)),
    "lstm-3layer-bidir-batchfirst-cn-hx": Config(
        "lstm", True, "cn", hx=True, kw=dict(num_layers=3, bidirectional=True)),
    "lstm-dropout-eval-2layer-seqfirst-last": Config(
        "lstm", False, "last", kw=dict(num_layers=2, dropout=0.5)),  # eval mode: no dropout
    "gru-batchfirst-last": Config("gru", True, "last"),
    "gru-seqfirst-hn-hx": Config("gru", False, "hn", hx=True),
    "gru-2layer-bidir-batchfirst-mean": Config(
        "gru", True, "mean", kw=dict(num_layers=2, bidirectional=True)),
    "gru-nobias-bidir-seqfirst-hn": Config(
        "gru", False, "hn", kw=dict(bias=False, bidirectional=True)),
    "gru-2layer-seqfirst-last-hx-time-eq-batch": Config(
        "gru", False, "last", hx=True, kw=dict(num_layers=2), batch=4, time=4),
}


def make(case, dtype=DT):
    cfg = CONFIGS[case]
    torch.manual_seed(0)
    model = Seq(cfg).to(dtype).eval()
    x = torch.randint(0, VOCAB, (cfg.batch, cfg.time))
    t = torch.randint(0, CLASSES, (cfg.batch,))
    return model, nn.CrossEntropyLoss(), x, t


def loop_reference(model, loss_fn, x, t, names=None):
    """The definition: each example alone."""
    named = [(n, p) for n, p in model.named_parameters()
             if p.requires_grad and (names is None or n in names)]
    rows = {n: [] for n, _ in named}
    for i in range(x.shape[0]):
        loss = loss_fn(model(x[i:i + 1]), t[i:i + 1])
        gs = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        for (n, p), g in zip(named, gs):
            rows[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(v) for n, v in rows.items()}


def ref_norms(ref):
    return torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)


_REFS: dict = {}


def reference(case):
    """The loop's per-sample gradients of a case, computed once per session."""
    if case not in _REFS:
        _REFS[case] = loop_reference(*make(case))
    return _REFS[case]


def assert_matches(got, ref):
    assert list(got) == list(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)


# ------------------------------------------------------------------------------------------
# The case table, under strategy="hooks"
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CONFIGS))
def test_per_sample_grads(case):
    model, loss_fn, x, t = make(case)
    assert_matches(per_sample_grads(model, loss_fn, x, t, strategy="hooks"), reference(case))


@pytest.mark.parametrize("case", list(CONFIGS))
def test_per_sample_grad_norms(case):
    model, loss_fn, x, t = make(case)
    norms = per_sample_grad_norms(model, loss_fn, x, t, strategy="hooks")
    torch.testing.assert_close(norms, ref_norms(reference(case)))


@pytest.mark.parametrize("case", list(CONFIGS))
def test_accumulate_clipped_grads(case):
    model, loss_fn, x, t = make(case)
    ref = reference(case)
    norms = ref_norms(ref)
    max_norm = float(norms.median())  # some examples clipped, some not
    c = (max_norm / norms).clamp(max=1.0)
    assert bool((c < 1).any()) and bool((c == 1).any())
    got = accumulate_clipped_grads(model, loss_fn, x, t, max_norm=max_norm, strategy="hooks")
    torch.testing.assert_close(got, norms)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, ref[n]), msg=n)


# ------------------------------------------------------------------------------------------
# The plan, and strategy="auto"
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["lstm-proj-2layer-bidir-seqfirst-mean", "gru-seqfirst-hn-hx",
                                  "rnn-relu-2layer-bidir-batchfirst-hn"])
def test_plan_shows_the_recurrent_rule(case):
    model, loss_fn, x, t = make(case)
    plan = tv.per_sample_plan(model, loss_fn, x, t)
    name = type(model.rnn).__name__
    rnn_rows = [r for r in plan.rows if r.name.startswith("rnn.")]
    assert len(rnn_rows) == len(list(model.rnn.parameters()))
    for r in rnn_rows:
        assert (r.method, r.how) == ("rule", f"{name} rule in 'rnn'"), str(plan)
    assert f"{name} rule in 'rnn'" in str(plan)


def test_auto_uses_the_rules_and_matches_the_loop():
    case = "lstm-3layer-bidir-batchfirst-cn-hx"
    model, loss_fn, x, t = make(case)
    with warnings.catch_warnings():
        # a fallback to vmap or the loop would warn (vmap fails on stock recurrent layers)
        warnings.simplefilter("error", tv.TorchVJPWarning)
        got = per_sample_grads(model, loss_fn, x, t, strategy="auto")
        norms = per_sample_grad_norms(model, loss_fn, x, t, strategy="auto")
    assert_matches(got, reference(case))
    torch.testing.assert_close(norms, ref_norms(reference(case)))
    plan = tv.per_sample_plan(model, loss_fn, x, t, strategy="auto")
    assert {r.method for r in plan.rows} == {"rule"}, str(plan)


def test_params_subset_frozen_parameters_and_chunks():
    case = "lstm-proj-2layer-bidir-seqfirst-mean"
    model, loss_fn, x, t = make(case)
    ref = reference(case)
    names = ["rnn.weight_hh_l1_reverse", "rnn.weight_hr_l0", "rnn.bias_ih_l1"]
    got = per_sample_grads(model, loss_fn, x, t, params=names, strategy="hooks", chunk_size=1)
    assert_matches(got, {n: ref[n] for n in names})
    model.rnn.weight_ih_l0.requires_grad_(False)  # frozen, but named: computed all the same
    got = per_sample_grads(model, loss_fn, x, t, params=["rnn.weight_ih_l0"], strategy="hooks")
    assert_matches(got, {"rnn.weight_ih_l0": ref["rnn.weight_ih_l0"]})


# ------------------------------------------------------------------------------------------
# Batches of one, other dtypes
# ------------------------------------------------------------------------------------------


class Unbatched(nn.Module):
    """Feeds the one example to the layer as an unbatched (2-D) sequence."""

    def __init__(self, layer):
        super().__init__()
        self.rnn = layer
        self.init = nn.Linear(EMB, HIDDEN)
        self.fc = nn.Linear(2 * HIDDEN, CLASSES)

    def forward(self, x):  # x: (1, T, E)
        h0 = torch.tanh(self.init(x[0, :2 * self.rnn.num_layers]))  # (L * D, H): unbatched
        out, _ = self.rnn(x[0], h0)
        return self.fc(out.mean(0)).unsqueeze(0)


@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_unbatched_input_is_one_example(kind):
    torch.manual_seed(0)
    layer = LAYERS[kind](EMB, HIDDEN, num_layers=2, bidirectional=True)
    model = Unbatched(layer).to(DT)
    x, t = torch.randn(1, 5, EMB, dtype=DT), torch.tensor([1])
    assert_matches(per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy="hooks"),
                   loop_reference(model, nn.CrossEntropyLoss(), x, t))


def test_batch_of_one():
    model, loss_fn, x, t = make("lstm-proj-batchfirst-hn-hx")
    x, t = x[:1], t[:1]
    assert_matches(per_sample_grads(model, loss_fn, x, t, strategy="hooks"),
                   loop_reference(model, loss_fn, x, t))


def test_float32():
    # float32 takes the fused (oneDNN) kernels on CPU: the replay check must tolerate them
    model, loss_fn, x, t = make("lstm-2layer-batchfirst-mean-hx", dtype=torch.float32)
    ref = loop_reference(model, loss_fn, x, t)
    got = per_sample_grads(model, loss_fn, x, t, strategy="hooks")
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-5, msg=n)


# ------------------------------------------------------------------------------------------
# What the rule declines
# ------------------------------------------------------------------------------------------


def test_dropout_in_training_mode_is_declined():
    model, loss_fn, x, t = make("lstm-dropout-eval-2layer-seqfirst-last")
    model.train()  # dropout=0.5 between the two layers: masks a rule cannot replay
    plan = tv.per_sample_plan(model, loss_fn, x, t)
    assert plan["rnn.weight_ih_l0"].method in ("vmap", "loop"), str(plan)
    # the reason names the rule that declined, not a missing rule
    assert "LSTM rule does not replay dropout" in plan["rnn.weight_ih_l0"].reason
    # (the head follows: a model that draws gets one method for all its parameters, so
    # that an example's gradients are of one dropout mask: NOTE [one draw per example])
    assert plan["fc.weight"].method == plan["rnn.weight_ih_l0"].method
    assert "all of one draw" in plan["fc.weight"].reason
    with pytest.raises(tv.StrategyError, match="rnn.weight_ih_l0"):
        per_sample_grads(model, loss_fn, x, t, strategy="hooks")


class Packed(nn.Module):
    """Pads with token 0 and packs the sequences by their lengths."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMB)
        self.rnn = nn.GRU(EMB, HIDDEN, batch_first=True)
        self.fc = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        lengths = (x != 0).sum(1)
        packed = pack_padded_sequence(self.emb(x), lengths, batch_first=True,
                                      enforce_sorted=False)
        out, h = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.fc(out.sum(1) / lengths.unsqueeze(1) + h[-1])


# batch == EMB: the packed flat data (sum of lengths, EMB) has a feature dimension of size B
# that does not shrink with the batch; it was read as the examples' dimension and the GRU as
# a layer that mixes them (a PerSampleError for a valid model)
@pytest.mark.parametrize("batch", [4, EMB], ids=["batch4", "batch-equals-input-size"])
def test_packed_sequences_are_declined(batch):
    torch.manual_seed(0)
    model = Packed().to(DT)
    x = torch.randint(1, VOCAB, (batch, 5))
    x[1, 3:] = 0
    x[2, 2:] = 0
    t = torch.randint(0, CLASSES, (batch,))
    plan = tv.per_sample_plan(model, nn.CrossEntropyLoss(), x, t)
    assert plan["rnn.weight_ih_l0"].method in ("vmap", "loop"), str(plan)
    assert "rule does not handle this call's input (a PackedSequence)" in (
        plan["rnn.weight_ih_l0"].reason), str(plan)
    assert plan["emb.weight"].method == "rule"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap cannot batch packing: the loop, with a warning
        got = per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy="auto")
    assert_matches(got, loop_reference(model, nn.CrossEntropyLoss(), x, t))


class KeywordState(nn.Module):
    """Passes the initial state by keyword, which forward hooks do not see."""

    def __init__(self):
        super().__init__()
        self.init = nn.Linear(EMB, HIDDEN)
        self.rnn = nn.RNN(EMB, HIDDEN, batch_first=True)
        self.fc = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        h0 = torch.tanh(self.init(x.mean(1))).unsqueeze(0)
        return self.fc(self.rnn(x, hx=h0)[0][:, -1])


def test_state_passed_by_keyword():
    # the recorder moves keyword arguments to their positions, so the rule sees the state
    torch.manual_seed(0)
    model = KeywordState().to(DT)
    x, t = torch.randn(4, 5, EMB, dtype=DT), torch.randint(0, CLASSES, (4,))
    ref = loop_reference(model, nn.CrossEntropyLoss(), x, t)
    assert_matches(per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy="hooks"), ref)


def test_a_forward_the_rule_cannot_replay_is_caught_and_rerouted(monkeypatch):
    # When the recomputed forward differs from the recorded outputs (an input the rule did not
    # see, a forward that is not the stock one), the rule declines the call: hooks refuses
    # (naming the parameters and why), auto computes them with the fallback.
    from torch_vjp._per_sample.rules import recurrent

    monkeypatch.setattr(recurrent, "_replays", lambda got, recorded: False)
    model, loss_fn, x, t = make("gru-seqfirst-hn-hx")
    with pytest.raises(tv.StrategyError, match=r"(?s)rnn\.weight_ih_l0.*cannot compute this "
                       r"call of the layer.*Fix: strategy='auto'"):
        per_sample_grads(model, loss_fn, x, t, strategy="hooks")
    model, loss_fn, x, t = make("gru-seqfirst-hn-hx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap fails on stock recurrent layers: the loop
        assert_matches(per_sample_grads(model, loss_fn, x, t, strategy="auto"),
                       reference("gru-seqfirst-hn-hx"))
    # (a declined call goes to the fallback for that call; the plan keeps the rule for
    # calls it can split, and the first-call check agrees with the loop)
    plan = tv.per_sample_plan(model, loss_fn, x, t)
    assert plan["init.weight"].method == "rule"


# ------------------------------------------------------------------------------------------
# Every output that holds the examples is checked, not only the first
# ------------------------------------------------------------------------------------------


class ReadsState(nn.Module):
    """Reads the last layer's h_n (``flip``: with the examples reversed, which the plan
    must not take for the layer's own rows)."""

    def __init__(self, flip):
        super().__init__()
        self.flip = flip
        self.rnn = nn.LSTM(EMB, HIDDEN, batch_first=True)
        self.fc = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        _, (h, _) = self.rnn(x)
        h = h[-1]
        return self.fc(h.flip(0) if self.flip else h)


def test_state_output_with_examples_reversed_is_mixing():
    # row i of the output is computed from example B-1-i: the model mixes examples, which
    # the plan finds from h_n's data flow (the first output is unused)
    torch.manual_seed(0)
    x, t = torch.randn(5, 4, EMB, dtype=DT), torch.randint(0, CLASSES, (5,))
    model = ReadsState(flip=True).to(DT)
    with pytest.raises(tv.PerSampleError, match="mixes examples"):
        per_sample_grads(model, nn.CrossEntropyLoss(), x, t)
    # the same model reading h_n in order: the rule, from the state's gradient alone
    model = ReadsState(flip=False).to(DT)
    plan = tv.per_sample_plan(model, nn.CrossEntropyLoss(), x, t)
    assert plan["rnn.weight_ih_l0"].method == "rule", str(plan)
    assert_matches(per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy="hooks"),
                   loop_reference(model, nn.CrossEntropyLoss(), x, t))


def test_every_output_is_checked_along_the_dimension_its_rule_names(monkeypatch):
    # A rule that names the wrong dimension for h_n (0, of size 1, where the examples are
    # along 1) is not trusted, although the first output (unused here) says nothing.
    from torch_vjp._per_sample.rules import recurrent

    monkeypatch.setattr(recurrent.RecurrentRule, "other_output_dims",
                        lambda self, module, x: {1: 0, 2: 0})
    torch.manual_seed(0)
    x, t = torch.randn(5, 4, EMB, dtype=DT), torch.randint(0, CLASSES, (5,))
    model = ReadsState(flip=False).to(DT)
    plan = tv.per_sample_plan(model, nn.CrossEntropyLoss(), x, t)
    row = plan["rnn.weight_ih_l0"]
    assert row.method in ("vmap", "loop"), str(plan)
    assert "its output 1 of shape (1, 5, 4) has no dimension 0 of size 5" in row.reason
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap fails on stock recurrent layers: the loop
        got = per_sample_grads(model, nn.CrossEntropyLoss(), x, t)
    assert_matches(got, loop_reference(model, nn.CrossEntropyLoss(), x, t))


class ZeroGradient(nn.Module):
    """The reverse direction's top-layer recurrent weight gets an exactly zero gradient:
    adding the same number to every logit (c_n summed) leaves cross-entropy unchanged."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(EMB, HIDDEN, num_layers=2, bidirectional=True, proj_size=3,
                           batch_first=True)
        self.fc = nn.Linear(6, CLASSES)

    def forward(self, x):
        o, (_, c) = self.rnn(x)
        return self.fc(o[:, -1]) + c[-1].sum(-1, keepdim=True)


def test_a_gradient_zero_but_for_rounding_is_not_a_disagreement():
    # the loop's 1e-17 against the rule's exact 0 is rounding, measured against the
    # example's whole gradient
    for seed, batch in ((1, 4), (2, 5), (8, 3)):  # seeds where the loop rounds to non-zero
        torch.manual_seed(seed)
        model = ZeroGradient().to(DT)
        x = torch.randn(batch, 5, EMB, dtype=DT)
        t = torch.randint(0, CLASSES, (batch,))
        ref = loop_reference(model, nn.CrossEntropyLoss(), x, t)
        got = per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy="hooks")
        assert_matches(got, ref)


class LearnedState(nn.Module):
    """A learned initial state (layers, 1, hidden) expanded over the examples along
    dimension 1, where a recurrent layer takes them."""

    def __init__(self, batch_dim_twice=False):
        super().__init__()
        self.twice = batch_dim_twice
        self.rnn = nn.GRU(EMB, HIDDEN, num_layers=2, batch_first=True)
        self.h0 = nn.Parameter(torch.randn(2, 1, HIDDEN))
        self.fc = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        B = x.shape[0]
        if self.twice:  # (B, B, hidden): which dimension holds the examples is ambiguous
            e = self.h0[:1].expand(B, B, HIDDEN).mean(0, keepdim=True)
            h0 = torch.cat([e, e]).contiguous()
        else:
            h0 = self.h0.expand(2, B, HIDDEN).contiguous()
        return self.fc(self.rnn(x, h0)[0][:, -1])


def test_learned_initial_state_is_a_broadcast_parameter():
    torch.manual_seed(0)
    model = LearnedState().to(DT)
    x, t = torch.randn(5, 6, EMB, dtype=DT), torch.randint(0, CLASSES, (5,))
    plan = tv.per_sample_plan(model, nn.CrossEntropyLoss(), x, t)
    assert plan["h0"].how == "broadcast parameter rule in 'h0'", str(plan)
    assert {row.method for row in plan} == {"rule"}, str(plan)
    assert_matches(per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy="hooks"),
                   loop_reference(model, nn.CrossEntropyLoss(), x, t))


def test_an_expansion_with_two_candidate_dimensions_is_not_guessed():
    torch.manual_seed(0)
    model = LearnedState(batch_dim_twice=True).to(DT)
    x, t = torch.randn(5, 6, EMB, dtype=DT), torch.randint(0, CLASSES, (5,))
    plan = tv.per_sample_plan(model, nn.CrossEntropyLoss(), x, t)
    assert plan["h0"].method in ("vmap", "loop"), str(plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap fails on stock recurrent layers: the loop
        got = per_sample_grads(model, nn.CrossEntropyLoss(), x, t)
    assert_matches(got, loop_reference(model, nn.CrossEntropyLoss(), x, t))
