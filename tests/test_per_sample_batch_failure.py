"""A model that fails on the whole batch: under 'auto' its parameters go to the per-example
computation, and an error the model raises there says where it was raised (a note; the
error itself is the model's, untouched)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv

D = torch.float64


class _Viewed(nn.Module):
    """A view with a size written in: fails on the batch (4 x 3) and on one example."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(3, 2)

    def forward(self, x):
        return self.l(x.view(8, -1))


class _OneAtATime(nn.Module):
    """Runs on one example only."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(3, 2)

    def forward(self, x):
        if x.shape[0] != 1:
            raise ValueError("one example at a time")
        return torch.tanh(self.l(x))


def _loss(o):
    return o.pow(2).sum()


@pytest.mark.parametrize("fn", ["grads", "norms", "clipped"])
def test_auto_says_where_the_error_was_raised(fn):
    model, x = _Viewed().to(D), torch.randn(4, 3, dtype=D)
    call = {"grads": lambda: tv.per_sample_grads(model, _loss, x),
            "norms": lambda: tv.per_sample_grad_norms(model, _loss, x),
            "clipped": lambda: tv.accumulate_clipped_grads(model, _loss, x, max_norm=1.0)}[fn]
    with pytest.raises(RuntimeError) as info:
        call()
    err = info.value
    assert not isinstance(err, tv.TorchVJPError)
    assert str(err) == "shape '[8, -1]' is invalid for input of size 3"  # (the example's)
    (note,) = err.__notes__
    assert "on example 0 alone" in note  # where it was raised
    assert ("failed on the whole batch first (RuntimeError: shape '[8, -1]' is invalid for "
            "input of size 12, on a batch of 4)") in note  # the batch's own error
    assert "shapes are those of a batch of one" in note


def test_hooks_raises_the_batchs_error_as_it_is():
    model, x = _Viewed().to(D), torch.randn(4, 3, dtype=D)
    with pytest.raises(RuntimeError) as info:
        tv.per_sample_grads(model, _loss, x, strategy="hooks")
    assert str(info.value) == "shape '[8, -1]' is invalid for input of size 12"
    assert not getattr(info.value, "__notes__", None)


@pytest.mark.parametrize("strategy", ["auto", "vmap"])
def test_a_model_that_runs_one_example_at_a_time(strategy):
    # strategy='vmap' ran the model on the whole batch to plan, and raised its error there
    torch.manual_seed(0)
    model, x = _OneAtATime().to(D), torch.randn(4, 3, dtype=D)
    got = tv.per_sample_grads(model, _loss, x, strategy=strategy)
    for i in range(4):
        want = torch.autograd.grad(_loss(model(x[i:i + 1])), list(model.parameters()))
        for (n, _), w in zip(model.named_parameters(), want):
            torch.testing.assert_close(got[n][i], w)
