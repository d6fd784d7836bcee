"""The clipped step of a model that draws random numbers (dropout), with parameters for both
fallback groups (vmap and the loop, which it now gets for all: NOTE [one draw per example]
in torch_vjp._per_sample.plan): each example's clipped contribution is that of the
gradient whose norm made its clip factor (NOTE [one pass of the fallback] in
torch_vjp._per_sample.run), so it is at most max_norm, the bound DP-SGD rests on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv

DT = torch.float64


class DropoutNet(nn.Module):
    """Dropout, a scale the model owns (no rule: vmap), and a Linear whose weight has a
    gradient hook (the loop)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.scale = nn.Parameter(torch.ones(16))
        self.b = nn.Linear(16, 2)
        self.b.weight.register_hook(lambda g: g)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x))) * self.scale)


def loss_fn(out):
    return 10 * out.pow(2).sum()


@pytest.mark.parametrize("batch", [2, 3])
def test_every_clipped_contribution_is_within_max_norm(batch):
    model = DropoutNet().to(DT)
    plan = tv.per_sample_plan(model, loss_fn, torch.randn(batch, 8, dtype=DT))
    # (one method for all, the loop, since the model draws: NOTE [one draw per example])
    assert {row.method for row in plan.rows} == {"loop"}
    max_norm = 1e-3  # (far below every example's norm: each is clipped to max_norm)
    for seed in range(8):
        torch.manual_seed(seed)
        x = torch.randn(batch, 8, dtype=DT)
        model.zero_grad(set_to_none=True)
        norms = tv.accumulate_clipped_grads(model, loss_fn, x, max_norm=max_norm)
        assert (norms > max_norm).all()
        total = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
        # the sum of `batch` vectors of norm max_norm each
        assert total <= batch * max_norm * (1 + 1e-9), (seed, float(total / max_norm))


def test_the_sum_is_of_the_gradients_whose_norms_it_returns():
    # Without randomness, the clipped sum is the clip-weighted sum of the per-sample
    # gradients, the per-sample gradients from the loop (float64).
    model = DropoutNet().to(DT).eval()
    torch.manual_seed(3)
    x = torch.randn(3, 8, dtype=DT)
    ref = tv.per_sample_grads(model, loss_fn, x, strategy="loop")
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    max_norm = float(norms.median())
    c = (max_norm / norms).clamp(max=1.0)
    model.zero_grad(set_to_none=True)
    got = tv.accumulate_clipped_grads(model, loss_fn, x, max_norm=max_norm)
    torch.testing.assert_close(got, norms)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, ref[n]), msg=n)
