"""A model whose forward runs an operator torch has no derivative for with respect to the
model's inputs (``torch.bincount`` weighted by a function of the input): the plan's data-flow
test differentiates by the inputs, and torch's "derivative for aten::bincount is not
implemented" came out of 'auto' and 'hooks' raw, though vmap and the loop need no such
derivative and compute the per-sample gradients. 'auto' now plans those parameters for vmap,
saying why, and 'hooks' refuses them with that reason."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import torch_vjp as tv

from _references import per_example_grads_of_two

D = torch.float64


class _Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.a = nn.Linear(1, 3), nn.Linear(3, 3)

    def forward(self, x, g):
        # (a sum of the input's rows per group, looked up at each example's group)
        table = torch.bincount(g, weights=x.sum(1), minlength=8)[:, None]
        return self.fc(table)[g] + self.a(x)


def _batch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, dtype=D, generator=gen)
    return x, torch.tensor([0, 1, 2, 3, 4]), torch.randint(0, 3, (5,), generator=gen)


def _loss(out, t):
    return nn.functional.cross_entropy(out, t)


@pytest.mark.parametrize("strategy", ["auto", "vmap", "loop"])
def test_grads_norms_and_clipped_sums_against_the_loop(strategy):
    torch.manual_seed(0)
    model = _Counted().to(D)
    x, g, t = _batch()
    want = per_example_grads_of_two(model, x, g, t)
    got = tv.per_sample_grads(model, _loss, (x, g), t, strategy=strategy)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)
    norms = torch.cat([w.flatten(1) for w in want.values()], 1).norm(dim=1)
    torch.testing.assert_close(tv.per_sample_grad_norms(model, _loss, (x, g), t,
                                                        strategy=strategy), norms)
    model.zero_grad(set_to_none=True)
    tv.accumulate_clipped_grads(model, _loss, (x, g), t, max_norm=0.5, strategy=strategy)
    c = (0.5 / norms).clamp(max=1.0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, want[n]), msg=n)


def test_the_plan_says_why_and_hooks_refuses_with_it():
    model = _Counted().to(D)
    x, g, t = _batch()
    why = ("the plan's data-flow test differentiates by the inputs, which torch cannot "
           "(RuntimeError: derivative for aten::bincount is not implemented); vmap needs "
           "none there")
    plan = tv.per_sample_plan(model, _loss, (x, g), t)
    assert {(r.method, r.reason) for r in plan} == {("vmap", why)}
    with pytest.raises(tv.StrategyError, match=r"strategy='hooks' cannot compute 4 parameter"
                       r"\(s\) with a per-layer rule:\n    'fc\.weight': " + re.escape(why)):
        tv.per_sample_grads(model, _loss, (x, g), t, strategy="hooks")
