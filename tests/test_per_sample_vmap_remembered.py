"""Under "auto", a model vmap cannot batch is remembered as such, also where it draws
random numbers (whose plan is not checked against the loop on its first call): later calls
go to the loop at once, and the plan says so."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torch_vjp as tv
from torch_vjp._per_sample import fallback


class _RandomBranching(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.drop = nn.Dropout(0.1)  # draws: every parameter gets one method
        self.scale = nn.Parameter(torch.ones(2))  # no rule

    def forward(self, x):
        if (x > -100).all():  # a Python branch on a value: vmap cannot batch it
            x = x * 1.0
        return self.drop(self.lin(x)) * self.scale


@pytest.mark.parametrize("call", ["grads", "norms", "clipped"])
def test_a_failed_vmap_is_not_tried_again(call, monkeypatch):
    torch.manual_seed(0)
    model = _RandomBranching().double().train()
    x = torch.randn(8, 4, dtype=torch.float64)
    loss = lambda o: o.pow(2).sum()  # noqa: E731
    tried = []
    real = fallback.vmap_grads
    monkeypatch.setattr(fallback, "vmap_grads", lambda *a, **k: tried.append(1) or real(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            if call == "grads":
                g = tv.per_sample_grads(model, loss, x)
                assert g["lin.weight"].shape == (8, 2, 4)
            elif call == "norms":
                assert tv.per_sample_grad_norms(model, loss, x).shape == (8,)
            else:
                tv.accumulate_clipped_grads(model, loss, x, max_norm=1.0)
    assert len(tried) == 1
    rows = tv.per_sample_plan(model, loss, x).rows
    assert {r.method for r in rows} == {"loop"}
    assert all("vmap cannot batch this model" in r.reason for r in rows)
