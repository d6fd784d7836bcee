"""Per-sample gradients on layer uses past the configuration sweeps: a positional table
looked up with indices that have no batch dimension (and a batch as long as the sequence), a
module called a second time under no_grad or detached, a layer on the batch concatenated with
itself, a Linear on a learned or constant table broadcast to every example, initial hidden
states passed as inputs that require grad, spectral_norm in training mode (whose power
iteration moves buffers on every forward). Every strategy against the per-example loop, each
example from the model's state at the call, in float64; the model's state kept; a refusal is a
StrategyError that names strategy='auto'."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torch_vjp as tv

D = torch.float64
STRATEGIES = ("auto", "hooks", "vmap", "loop")


def _r(*shape):
    return torch.randn(*shape, dtype=D)


def _loss(out):
    flat = out.flatten(1)
    return (flat * torch.linspace(-1.0, 1.0, flat.shape[1], dtype=D)).sum() \
        + 0.3 * flat.pow(2).sum()


class _Positions(nn.Module):
    """Token and positional Embeddings; the positions' indices have no batch dimension."""

    def __init__(self, T, mode):
        super().__init__()
        self.tok, self.pos, self.mode = nn.Embedding(7, 4), nn.Embedding(T, 4), mode
        self.head = nn.Linear(4, 3)

    def forward(self, idx):
        p = torch.arange(idx.shape[1])
        pe = self.pos(p) if self.mode == "1d" else self.pos(p.unsqueeze(0))
        return self.head(self.tok(idx) + pe)


class _SecondCall(nn.Module):
    """The layer called once for the output and once more under no_grad or detached."""

    def __init__(self, kind, how):
        super().__init__()
        self.m = {"linear": lambda: nn.Linear(4, 4), "layernorm": lambda: nn.LayerNorm(4),
                  "conv": lambda: nn.Conv1d(3, 3, 1), "groupnorm": lambda: nn.GroupNorm(1, 3)
                  }[kind]()
        self.how = how

    def forward(self, x):
        if self.how == "no_grad":
            with torch.no_grad():
                t = self.m(3 * x)
            return self.m(x) * t
        a = self.m(x)
        return a * self.m(3 * x).detach()


class _Concatenated(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.m = nn.Linear(4, 3) if kind == "linear" else nn.Conv1d(4, 3, 2)

    def forward(self, x):
        y = self.m(torch.cat([x, 2 * x]))
        return y[:x.shape[0]] + y[x.shape[0]:] ** 2


class _Table(nn.Module):
    """A Linear and a LayerNorm on a (T, 4) table without batch, broadcast to the examples."""

    def __init__(self, T, learned):
        super().__init__()
        t = torch.randn(T, 4)
        if learned:
            self.table = nn.Parameter(t)
        else:
            self.register_buffer("table", t)
        self.lin, self.ln, self.out = nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(x * self.ln(self.lin(self.table)))


class _GivenState(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn, self.lstm = kind(3, 4, num_layers=2, batch_first=True), kind is nn.LSTM

    def forward(self, x, h0, c0):
        h = h0.transpose(0, 1).contiguous()
        return self.rnn(x, (h, c0.transpose(0, 1).contiguous()) if self.lstm else h)[0]


def _idx(B, T):
    return torch.randint(0, 7, (B, T), generator=torch.Generator().manual_seed(B + T))


CONFIGS = {}
for _B in (1, 3):
    for _mode in ("1d", "unsqueezed"):
        CONFIGS[f"positions_{_mode}_B{_B}_T{_B}"] = (
            lambda T=_B, m=_mode: _Positions(T, m), lambda B=_B: (_idx(B, B),))
    CONFIGS[f"learned_table_B{_B}_T{_B}"] = (lambda T=_B: _Table(T, True),
                                             lambda B=_B: (_r(B, B, 4),))
CONFIGS["positions_1d_B3_T4"] = (lambda: _Positions(4, "1d"), lambda: (_idx(3, 4),))
CONFIGS["constant_table_B3_T3"] = (lambda: _Table(3, False), lambda: (_r(3, 3, 4),))
for _kind in ("linear", "layernorm", "conv", "groupnorm"):
    for _how in ("no_grad", "detached"):
        CONFIGS[f"{_kind}_second_call_{_how}"] = (
            lambda k=_kind, h=_how: _SecondCall(k, h), lambda: (_r(3, 3, 4),))
for _kind in ("linear", "conv"):
    CONFIGS[f"{_kind}_on_concatenated_batch"] = (lambda k=_kind: _Concatenated(k),
                                                 lambda: (_r(3, 4, 4),))
for _kind in (nn.GRU, nn.LSTM):
    CONFIGS[f"{_kind.__name__}_initial_state_requiring_grad"] = (
        lambda k=_kind: _GivenState(k),
        lambda: (_r(3, 3, 3), _r(3, 2, 4).requires_grad_(), _r(3, 2, 4).requires_grad_()))
CONFIGS["spectral_norm_training"] = (
    lambda: nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(4, 3)),
                          nn.Tanh(), nn.Linear(3, 2)), lambda: (_r(3, 4),))


def _fresh(name):
    torch.manual_seed(0)
    make, inputs = CONFIGS[name]
    return make().to(D), inputs()


def _loop(model, xs):
    """Example i alone, from the model's state at the call (a copy per example: a forward
    that moves buffers does not reach the next example)."""
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


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_config(name, strategy):
    model, xs = _fresh(name)
    want = _loop(model, xs)
    arg = xs if len(xs) > 1 else xs[0]
    before = _state(model)
    try:
        got = tv.per_sample_grads(model, _loss, arg, strategy=strategy)
    except tv.StrategyError as err:  # (no rule, or no vmap batching rule: by design)
        assert strategy in ("hooks", "vmap") and "strategy='auto'" in str(err), str(err)
        _same_state(before, _state(model))
        return
    assert list(got) == list(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-9, msg=n)
    kept = {n: g.clone() for n, g in got.items()}
    norms = sum(g.flatten(1).pow(2).sum(1) for g in want.values()).sqrt()
    torch.testing.assert_close(tv.per_sample_grad_norms(model, _loss, arg, strategy=strategy),
                               norms, rtol=1e-9, atol=1e-9)
    for max_norm in (float(norms.median()), 0.5 * float(norms.min())):
        for p in model.parameters():
            p.grad = None
        torch.testing.assert_close(tv.accumulate_clipped_grads(
            model, _loss, arg, max_norm=max_norm, strategy=strategy), norms,
            rtol=1e-9, atol=1e-9)
        c = (max_norm / norms).clamp(max=1.0)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, want[n]),
                                       rtol=1e-9, atol=1e-9, msg=n)
    for n in got:  # (later calls leave an earlier result alone)
        assert torch.equal(got[n], kept[n]), n
    for p in model.parameters():
        p.grad = None
    _same_state(before, _state(model))
