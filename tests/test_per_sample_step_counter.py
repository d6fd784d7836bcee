"""Python state a forward keeps (a step counter attribute) moves with the forwards that
compute the result, not with those that plan the computation or check it against the loop
(``structure.restore_numbers``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv

D = torch.float64


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(3, 2)
        self.steps = 0
        self.decay = 1.0
        self.started = False

    def forward(self, x):
        self.steps += 1
        self.decay *= 0.5
        self.started = True  # (a flag, not a number: left as the forward set it)
        return self.l(x)


@pytest.mark.parametrize("strategy", ["auto", "hooks", "vmap", "loop"])
def test_a_step_counter_moves_once_per_forward_of_the_computation(strategy):
    # the first call moved it by 7 (three planning forwards, the pass, three examples of the
    # check), the first norms by 1 more, the first clipped call by 4 more
    model = _Counting().to(D)
    x, y = torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D)
    per_call = 4 if strategy == "loop" else 1
    seen = []
    for _ in range(2):
        tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy=strategy)
        seen.append(model.steps)
    tv.per_sample_grad_norms(model, nn.MSELoss(), x, y, strategy=strategy)
    seen.append(model.steps)
    tv.accumulate_clipped_grads(model, nn.MSELoss(), x, y, max_norm=1.0, strategy=strategy)
    seen.append(model.steps)
    assert seen == [per_call * k for k in (1, 2, 3, 4)]
    assert model.decay == 0.5 ** model.steps and type(model.steps) is int
    assert model.started is True


def test_a_random_model_checked_without_dropout_counts_once():
    # (the check of a model with dropout recomputes the pass with it off)
    class Dropping(_Counting):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(super().forward(x))

    torch.manual_seed(0)
    model = Dropping().to(D).train()
    x, y = torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D)
    tv.per_sample_grad_norms(model, nn.MSELoss(), x, y)
    assert model.steps == 1
