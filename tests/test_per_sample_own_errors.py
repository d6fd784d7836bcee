"""A model's own error on one example passes through every strategy untouched: vmap is not
blamed for it, and no fallback is announced before it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torch_vjp as tv


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)).double()


@pytest.mark.parametrize("strategy", ["auto", "hooks", "vmap", "loop"])
@pytest.mark.parametrize("call", ["grads", "norms", "clipped"])
def test_an_id_beyond_the_table_in_a_later_example_is_the_model_s_own_error(strategy, call):
    model = _model()
    ids = torch.tensor([[1, 2], [3, 10]])  # example 1 holds an id beyond the table
    loss = lambda out: out.pow(2).sum()  # noqa: E731
    with pytest.raises(IndexError, match="^index out of range in self$"):
        model(ids[1:2])  # the premise: the model itself refuses example 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(IndexError) as info:
            if call == "grads":
                tv.per_sample_grads(model, loss, ids, strategy=strategy)
            elif call == "norms":
                tv.per_sample_grad_norms(model, loss, ids, strategy=strategy)
            else:
                tv.accumulate_clipped_grads(model, loss, ids, max_norm=1.0,
                                            strategy=strategy)
    assert str(info.value) == "index out of range in self"  # (a note may say where it ran)
    assert not isinstance(info.value, tv.TorchVJPError)
    assert not [w for w in caught if issubclass(w.category, tv.TorchVJPWarning)]
    assert all(p.grad is None for p in model.parameters())


def test_vmap_is_still_named_where_every_example_runs_without_it():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            if (x > -100).all():  # a Python branch on a value: vmap cannot batch it
                x = x * 1.0
            return self.fc(x)

    model = DataDependent().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(tv.StrategyError, match="strategy='vmap'"):
        tv.per_sample_grads(model, lambda o: o.sum(), x, strategy="vmap")
