"""A model whose output is an object torch's pytree does not open (a dataclass): the rules
cannot split its loss, and the message says why and what to return instead."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_vjp as tv

DT = torch.float64


@dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return Out(self.b(h), h)


def loss_fn(out, t):
    return F.cross_entropy(out.logits, t) + out.hidden.pow(2).sum()


def test_hooks_names_the_output_type_and_the_fix():
    model = Net().to(DT)
    x, t = torch.randn(4, 4, dtype=DT), torch.tensor([0, 1, 1, 0])
    with pytest.raises(tv.StrategyError, match=(
            r"'a.weight': the model's output, an Out, holds no tensor that torch's pytree "
            r"reaches \(a dataclass .*\).*Fix: return the tensors in a dict, a tuple or a "
            r"namedtuple")):
        tv.per_sample_grads(model, loss_fn, x, t, strategy="hooks")


def test_auto_matches_the_loop():
    model = Net().to(DT)
    x, t = torch.randn(4, 4, dtype=DT), torch.tensor([0, 1, 1, 0])
    want = tv.per_sample_grads(model, loss_fn, x, t, strategy="loop")
    got = tv.per_sample_grads(model, loss_fn, x, t)
    for n in want:
        rows = [torch.autograd.grad(loss_fn(model(x[i : i + 1]), t[i : i + 1]),
                                    dict(model.named_parameters())[n])[0] for i in range(4)]
        torch.testing.assert_close(want[n], torch.stack(rows))
        torch.testing.assert_close(got[n], want[n])
