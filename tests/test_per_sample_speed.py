"""The clipped step's fast paths give the per-example loop's results: the clip factor
folded into the narrower side of a layer's product, a cached plan's call noticing a
changed model."""

import pytest
import torch
from torch import nn

import torch_vjp as tv


def _loop_clipped(model, loss_fn, x, y, max_norm):
    names = [n for n, _ in model.named_parameters()]
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(x.shape[0]):
        model.zero_grad()
        loss_fn(model(x[i:i + 1]), y[i:i + 1]).backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.sqrt(sum((g[n] ** 2).sum() for n in names))
        c = min(1.0, max_norm / float(norm))
        for n in names:
            total[n] += c * g[n]
    model.zero_grad()
    return total


class Seq(nn.Module):
    def __init__(self, p, q):
        super().__init__()
        self.lin = nn.Linear(p, q)
        self.head = nn.Linear(q, 3)

    def forward(self, x):  # (B, T, p) -> (B, 3)
        return self.head(torch.tanh(self.lin(x)).mean(1))


@pytest.mark.parametrize("p,q", [(3, 9), (9, 3), (5, 5)])
@pytest.mark.parametrize("seq", [False, True])
def test_clipped_sum_either_side_scaled(p, q, seq):
    torch.manual_seed(0)
    if seq:
        model = Seq(p, q).double()
        x = torch.randn(6, 4, p, dtype=torch.float64)
    else:
        model = nn.Sequential(nn.Linear(p, q), nn.Tanh(), nn.Linear(q, 3)).double()
        x = torch.randn(6, p, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    loss_fn = nn.CrossEntropyLoss()
    ref = _loop_clipped(model, loss_fn, x, y, 0.05)
    for _ in range(3):  # (the first call plans and checks; the later ones use the plan)
        model.zero_grad(set_to_none=True)
        tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=0.05, strategy="hooks")
        for n, p_ in model.named_parameters():
            torch.testing.assert_close(p_.grad, ref[n], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("p,q", [(3, 7), (7, 3)])
@pytest.mark.parametrize("T", [None, 1, 4])
def test_outer_factor_weighted_sum_against_einsum(transposed, p, q, T):
    # the clipped sum sum_i c_i G_i of a Linear (or a Conv1D, stored transposed) layer,
    # whichever of a and g carries the clip factors
    from torch_vjp._per_sample.factors import OuterFactor

    torch.manual_seed(1)
    B = 5
    shape = (B, p) if T is None else (B, T, p)
    a = torch.randn(shape, dtype=torch.float64)
    g = torch.randn(*shape[:-1], q, dtype=torch.float64)
    c = torch.rand(B, dtype=torch.float64)
    a3, g3 = (a.unsqueeze(1), g.unsqueeze(1)) if T is None else (a, g)
    per_sample = torch.einsum("btq,btp->bqp", g3, a3)
    want = torch.einsum("b,bqp->qp", c, per_sample)
    f = OuterFactor(a, g, (p, q) if transposed else (q, p), transposed=transposed)
    got = f.weighted_sum(c)
    torch.testing.assert_close(got, want.T if transposed else want, rtol=1e-12, atol=1e-12)
    a_before, g_before, c_before = a.clone(), g.clone(), c.clone()
    f.weighted_sum(c)
    assert a.equal(a_before) and g.equal(g_before) and c.equal(c_before)  # (not in place)
