"""A batch of two is planned against a run on three examples, not one (NOTE [the per-sample
plan], step 1): a forward that squeezes, ``x.squeeze()``, keeps its batch dimension."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv

D = torch.float64


class _Squeezing(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 1)
        self.b = nn.Linear(3, 2)

    def forward(self, x):  # (B, 3, 4) -> (B, 3, 1) -> squeezed (B, 3) for B > 1
        return self.b(self.a(x).squeeze())


class _Folding(nn.Module):
    """(B, T, D) folded to (B * T, D) for a Linear, and back: 'a' is left to vmap (rules
    need the examples along a dimension of their own), as for larger batches."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 2)

    def forward(self, x):
        b, t, d = x.shape
        h = torch.tanh(self.a(x.reshape(b * t, d))).reshape(b, t, -1)
        return self.b(h.mean(1))


def _loop_norms(ref):
    return torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)


@pytest.mark.parametrize("cls,strategy", [(_Squeezing, "hooks"), (_Squeezing, "auto"),
                                          (_Folding, "auto")])
def test_a_batch_of_two(cls, strategy):
    torch.manual_seed(0)
    model = cls().to(D)
    x, y = torch.randn(2, 3, 4, dtype=D), torch.randn(2, 2, dtype=D)
    loss = nn.MSELoss()
    ref = tv.per_sample_grads(model, loss, x, y, strategy="loop")
    plan = tv.per_sample_plan(model, loss, x, y, strategy=strategy)
    assert [r.method for r in plan] == (
        ["rule"] * 4 if cls is _Squeezing else ["vmap", "vmap", "rule", "rule"])
    got = tv.per_sample_grads(model, loss, x, y, strategy=strategy)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n])
    torch.testing.assert_close(tv.per_sample_grad_norms(model, loss, x, y, strategy=strategy),
                               _loop_norms(ref))
    tv.accumulate_clipped_grads(model, loss, x, y, max_norm=0.1, strategy=strategy)
    c = (0.1 / _loop_norms(ref)).clamp(max=1.0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.tensordot(c, ref[n], dims=1))


def test_a_batch_of_two_then_three_squeezing():
    # the plan made at B=2 serves B=3 (its key holds no batch size but one)
    torch.manual_seed(0)
    model = _Squeezing().to(D)
    loss = nn.MSELoss()
    for b in (2, 3):
        x, y = torch.randn(b, 3, 4, dtype=D), torch.randn(b, 2, dtype=D)
        got = tv.per_sample_grads(model, loss, x, y, strategy="hooks")
        ref = tv.per_sample_grads(model, loss, x, y, strategy="loop")
        for n in ref:
            torch.testing.assert_close(got[n], ref[n])
