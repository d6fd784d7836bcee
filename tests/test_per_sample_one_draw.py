"""A model that draws random numbers (dropout in training mode) gets, for each example, the
gradients of one draw for all its parameters (NOTE [one draw per example] in
torch_vjp/_per_sample/plan.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv

D = torch.float64


class _Scaled(nn.Module):
    """Linear -> Dropout -> a scale no rule covers -> Linear."""

    def __init__(self, p=0.5):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.drop = nn.Dropout(p)
        self.scale = nn.Parameter(torch.ones(6))
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        return self.b(self.drop(self.a(x)) * self.scale)


def _data():
    return torch.randn(8, 4, dtype=D), torch.randn(8, 3, dtype=D)


def test_per_sample_grads_of_one_draw_with_a_hooked_parameter():
    # b.weight's hook sends it to the loop, the others went to the rules' pass: each
    # example's b.weight gradient was of the loop's mask, a.bias's of the batch's (the
    # dropped units differed for all 8 examples)
    torch.manual_seed(0)
    model = _Scaled().to(D).train()
    model.b.weight.register_hook(lambda g: g)
    x, y = _data()
    grads = tv.per_sample_grads(model, nn.MSELoss(), x, y)
    dropped = []
    for i in range(8):
        dropped_b = grads["b.weight"][i].abs().sum(0) == 0  # (unit j dropped: column j zero)
        dropped_a = grads["a.bias"][i] == 0
        assert torch.equal(dropped_b, dropped_a), i
        dropped.append(int(dropped_a.sum()))
    assert any(0 < n < 6 for n in dropped)  # (masks that drop some units, not all or none)


@pytest.mark.parametrize("hooked", [False, True])
def test_a_random_model_split_between_methods_gets_one(hooked):
    torch.manual_seed(0)
    model = _Scaled().to(D).train()
    if hooked:
        model.b.weight.register_hook(lambda g: g)
    plan = tv.per_sample_plan(model, nn.MSELoss(), *_data())
    assert {row.method for row in plan.rows} == {"loop" if hooked else "vmap"}
    assert "all of one draw" in plan["a.weight"].reason


def test_a_model_that_draws_nothing_keeps_its_split():
    # dropout with p=0 draws nothing: the rules keep their parameters
    torch.manual_seed(0)
    model = _Scaled(p=0.0).to(D).train()
    plan = tv.per_sample_plan(model, nn.MSELoss(), *_data())
    assert plan["a.weight"].method == "rule" and plan["scale"].method == "vmap"


def test_a_random_model_in_eval_mode_keeps_its_split():
    torch.manual_seed(0)
    model = _Scaled().to(D).eval()
    plan = tv.per_sample_plan(model, nn.MSELoss(), *_data())
    assert plan["a.weight"].method == "rule" and plan["scale"].method == "vmap"


class _InPlaceAfter(nn.Module):
    """Linear -> Dropout -> Linear whose input is changed in place after the layer used it
    (b.weight frozen, so autograd saves no input for it): the rules' pass leaves b.bias to
    the fallback on every call."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(6, 3)
        self.b.weight.requires_grad_(False)

    def forward(self, x):
        h = self.drop(self.a(x))
        out = self.b(h)
        h.add_(0.0)
        return out


def test_a_parameter_moved_off_the_rules_on_a_call_takes_the_others_along():
    # b.bias went to vmap (another dropout mask), a.* stayed with the rules' pass: a.bias's
    # gradient of example i was not mask_i * 2 * (W_b^T b.bias_i)
    torch.manual_seed(0)
    model = _InPlaceAfter().to(D).train()
    x, y = torch.randn(6, 4, dtype=D), torch.randn(6, 3, dtype=D)
    g = tv.per_sample_grads(model, nn.MSELoss(), x, y)
    back = g["b.bias"] @ model.b.weight
    kept = g["a.bias"] != 0
    assert kept.any() and (~kept).any()
    torch.testing.assert_close(g["a.bias"][kept], 2 * back[kept])


@pytest.mark.parametrize("fn", ["grads", "norms", "clipped"])
def test_hooks_refuses_a_random_model_whose_rule_cannot_take_a_call(fn):
    torch.manual_seed(0)
    model = _InPlaceAfter().to(D).train()
    x, y = torch.randn(6, 4, dtype=D), torch.randn(6, 3, dtype=D)
    call = {"grads": lambda: tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="hooks"),
            "norms": lambda: tv.per_sample_grad_norms(model, nn.MSELoss(), x, y,
                                                      strategy="hooks"),
            "clipped": lambda: tv.accumulate_clipped_grads(model, nn.MSELoss(), x, y,
                                                           max_norm=1.0, strategy="hooks")}[fn]
    with pytest.raises(tv.StrategyError) as info:
        call()
    msg = str(info.value)
    assert "'b.bias'" in msg and "modified in place" in msg  # what was wrong
    assert "draws random numbers" in msg and "another random draw" in msg  # why
    assert "strategy='auto'" in msg and "strategy='loop'" in msg  # the fix
    assert all(p.grad is None for p in model.parameters())
