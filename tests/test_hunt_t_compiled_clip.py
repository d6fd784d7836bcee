"""compile=True for the clipped step when the clipping bound changes from call to call
(adaptive clipping sets max_norm anew each step): one compiled program, right on every
call, in float64 against a per-example loop."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import torch_vjp as tv

D = torch.float64
pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def _loop(model, loss_fn, x, y):
    out = {n: [] for n, _ in model.named_parameters()}
    for i in range(len(x)):
        gs = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]),
                                 list(model.parameters()))
        for (n, _), g in zip(model.named_parameters(), gs):
            out[n].append(g)
    return {n: torch.stack(v) for n, v in out.items()}


def test_a_clipping_bound_that_changes_each_step_reuses_the_compiled_program():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(D)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(8, 4, dtype=D), torch.randint(0, 3, (8,))
    ref = _loop(model, loss_fn, x, y)
    norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in ref.values()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)  # nothing falls back
        for max_norm in (0.3, 0.45, float(norms.median()), 10.0):
            model.zero_grad(set_to_none=True)
            got = tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=max_norm,
                                              compile=True)
            torch.testing.assert_close(got, norms)
            factors = (max_norm / norms).clamp(max=1.0)
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad,
                                           torch.einsum("b,b...->...", factors, ref[n]))
    assert counters["stats"]["unique_graphs"] == 1  # (not one program per bound)
