"""Per-sample gradients stay right where the plan's first-call check or its cache could be
fooled: a model with dropout (whose draws no per-example run replays), a rule that cannot
split a call, a plan reused after a flag changed, a model that loops over its examples.

Every result is compared in float64 with the definition, one example at a time.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_vjp as tv

DT = torch.float64


def definition(model, loss_fn, xs, t, names=None):
    """Each example alone, from a copy of the model as passed."""
    if not isinstance(xs, tuple):
        xs = (xs,)
    out = []
    for i in range(xs[0].shape[0]):
        m = copy.deepcopy(model)
        ps = dict(m.named_parameters())
        sel = names or [n for n, p in ps.items() if p.requires_grad]
        loss = loss_fn(m(*(x[i:i + 1] for x in xs)), t[i:i + 1])
        gs = torch.autograd.grad(loss, [ps[n] for n in sel], allow_unused=True)
        out.append({n: torch.zeros_like(ps[n]) if g is None else g for n, g in zip(sel, gs)})
    return {n: torch.stack([o[n] for o in out]) for n in out[0]}


def norms_of(ref):
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in ref.values()]).sum(0).sqrt()


def linear_loss(o, t):  # linear in the output: a dropout branch leaves the others' gradients
    return (o * t).sum()


# ------------------------------------------------------------------------------------------
# Dropout does not skip the check; a rule that cannot split a call says so
# ------------------------------------------------------------------------------------------


class _Hier(nn.Module):
    """Folds (B, S, T, F) into B * S sequences; a dropout on another branch."""

    def __init__(self, p=0.5):
        super().__init__()
        self.word = nn.GRU(3, 3, batch_first=True)
        self.aux = nn.Linear(3, 3)
        self.drop = nn.Dropout(p)

    def forward(self, x, z):
        b, s = x.shape[:2]
        h = self.word(x.reshape(b * s, x.shape[2], 3))[0][:, -1].view(b, s, 3).tanh().sum(1)
        return h + self.aux(self.drop(z))


@pytest.mark.filterwarnings("ignore")  # (vmap cannot batch the GRU of one example: the loop)
@pytest.mark.parametrize("fn", ["grads", "norms", "clipped"])
def test_a_folded_recurrent_call_with_one_example_is_not_zero(fn):
    torch.manual_seed(0)
    model = _Hier().double()
    x, z, t = torch.randn(1, 3, 2, 3, dtype=DT), torch.randn(1, 3, dtype=DT), torch.randn(1, 3, dtype=DT)
    names = [n for n, _ in model.named_parameters() if n.startswith("word.")]
    ref = definition(model, linear_loss, (x, z), t, names)
    if fn == "grads":
        got = tv.per_sample_grads(model, linear_loss, (x, z), t, params=names)
        for n in names:
            torch.testing.assert_close(got[n], ref[n])
    elif fn == "norms":
        got = tv.per_sample_grad_norms(model, linear_loss, (x, z), t, params=names)
        torch.testing.assert_close(got, norms_of(ref))
    else:
        for p in model.parameters():
            p.grad = None
        tv.accumulate_clipped_grads(model, linear_loss, (x, z), t, max_norm=1e6, params=names)
        for n in names:
            torch.testing.assert_close(model.get_parameter(n).grad, ref[n][0])


def test_a_rule_that_cannot_split_a_call_is_refused_under_hooks():
    torch.manual_seed(0)
    model = _Hier(0.0).double()
    x, z, t = torch.randn(1, 3, 2, 3, dtype=DT), torch.randn(1, 3, dtype=DT), torch.randn(1, 3, dtype=DT)
    with pytest.raises(tv.StrategyError, match="3 sequences for a batch of 1"):
        tv.per_sample_grad_norms(model, linear_loss, (x, z), t, strategy="hooks")


class _EMA(nn.Module):
    """Mixes examples through a detached batch statistic, which the data flow cannot see."""

    def __init__(self, p):
        super().__init__()
        self.l = nn.Linear(4, 2)
        self.aux = nn.Linear(4, 2)
        self.drop = nn.Dropout(p)
        self.register_buffer("ema", torch.zeros(4, dtype=DT))

    def forward(self, x, z):
        self.ema.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.l(x - self.ema) + self.aux(self.drop(z))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("fn", ["grads", "norms"])
def test_dropout_does_not_skip_the_check_against_the_loop(fn):
    torch.manual_seed(0)
    model = _EMA(0.5).double()
    x, z, t = torch.randn(5, 4, dtype=DT), torch.randn(5, 4, dtype=DT), torch.randn(5, 2, dtype=DT)
    ref = definition(model, linear_loss, (x, z), t, ["l.weight", "l.bias"])
    if fn == "grads":
        got = tv.per_sample_grads(model, linear_loss, (x, z), t)
        torch.testing.assert_close(got["l.weight"], ref["l.weight"])
    else:
        got = tv.per_sample_grad_norms(model, linear_loss, (x, z), t,
                                       params=["l.weight", "l.bias"])
        torch.testing.assert_close(got, norms_of(ref))
    assert torch.equal(model.ema, torch.zeros(4, dtype=DT))
    assert model.drop.training
