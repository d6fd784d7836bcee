"""A model that torch.func.vmap cannot batch (an Embedding with max_norm, a stock recurrent
layer) is planned for the loop where it would have gone to vmap, and strategy='hooks'
refuses it suggesting what runs (torch_vjp._per_sample.plan.vmap_blockers)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torch_vjp as tv

D = torch.float64


class _Table(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(10, 4, max_norm=1.0)
        self.scale = nn.Parameter(torch.ones(4))
        self.l = nn.Linear(4, 2)

    def forward(self, x):
        return self.l(self.e(x).mean(1) * self.scale)


class _Recurrent(nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.r = cls(3, 4, batch_first=True)
        self.scale = nn.Parameter(torch.ones(4))
        self.l = nn.Linear(4, 2)

    def forward(self, x):
        return self.l(self.r(x)[0][:, -1] * self.scale)


def _case(kind):
    torch.manual_seed(0)
    y = torch.randn(5, 2, dtype=D)
    if kind == "table":
        return _Table().to(D), torch.randint(0, 10, (5, 3)), y, "'e' (Embedding with max_norm)"
    cls = {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}[kind]
    return _Recurrent(cls).to(D), torch.randn(5, 6, 3, dtype=D), y, f"'r' ({cls.__name__})"


KINDS = ["table", "rnn", "gru", "lstm"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_plan_shows_the_loop_that_runs(kind):
    model, x, y, where = _case(kind)
    plan = tv.per_sample_plan(model, nn.MSELoss(), x, y)
    assert plan["scale"].method == "loop"
    assert f"vmap cannot batch {where}" in plan["scale"].reason
    assert not plan.one_run
    if kind == "table":
        assert plan["e.weight"].method == "loop"


@pytest.mark.parametrize("kind", KINDS)
def test_auto_computes_it_without_trying_vmap(kind):
    model, x, y, _ = _case(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (vmap's attempt warned, then fell to the loop)
        got = tv.per_sample_grads(model, nn.MSELoss(), x, y)
        norms = tv.per_sample_grad_norms(model, nn.MSELoss(), x, y)
    ref = tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="loop")
    for n in ref:
        torch.testing.assert_close(got[n], ref[n])
    want = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    torch.testing.assert_close(norms, want)


@pytest.mark.parametrize("kind", KINDS)
def test_hooks_refusal_suggests_what_runs(kind):
    model, x, y, _ = _case(kind)
    with pytest.raises(tv.StrategyError) as info:
        tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="hooks")
    msg = str(info.value)
    assert "'scale'" in msg and "no per-layer rule" in msg  # what and why
    assert "strategy='vmap'" not in msg  # (vmap cannot run it)
    assert "strategy='auto'" in msg and "strategy='loop'" in msg  # the fix


def test_hooks_refusal_of_a_model_vmap_runs_still_suggests_vmap():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    model.register_parameter("scale", nn.Parameter(torch.ones(2, dtype=D)))
    model.forward = lambda x: nn.Sequential.forward(model, x) * model.scale
    with pytest.raises(tv.StrategyError, match="strategy='vmap'"):
        tv.per_sample_grads(model, nn.MSELoss(), torch.randn(5, 3, dtype=D),
                            torch.randn(5, 2, dtype=D), strategy="hooks")


def test_a_subclass_with_its_own_forward_keeps_vmap():
    class Own(nn.GRU):
        def forward(self, x):  # (not torch's fused kernel)
            return torch.tanh(x @ self.weight_ih_l0[:4].T), None

    model = _Recurrent(nn.GRU).to(D)
    model.r = Own(3, 4, batch_first=True).to(D)
    plan = tv.per_sample_plan(model, nn.MSELoss(), torch.randn(5, 6, 3, dtype=D),
                              torch.randn(5, 2, dtype=D))
    assert plan["scale"].method == "vmap"
