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
