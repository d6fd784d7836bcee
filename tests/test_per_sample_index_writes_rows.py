"""Writes at an index computed from the model's own data that provably keep each example's
entries apart (NOTE [writes at an index of the data] in torch_vjp/_per_sample/order.py): a
one-hot target built in the forward (``out[torch.arange(B), y] = 1``), an ``index_put``
over several indices one of which is the examples' own order, a write along a dimension
that does not hold the examples. The plan is made once and kept; every result against the
per-example loop in float64. Writes where examples can meet are still watched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv
import torch_vjp._per_sample.probe as probe
from torch_vjp._per_sample.order import OrderWatch

from _references import per_example_grads_of_two

D = torch.float64
B = 6
C = 5


def _one_hot(x, y):  # (row i, column y[i]: example i's own row)
    out = x.new_zeros(x.shape[0], C)
    out[torch.arange(x.shape[0]), y] = 1.0
    return out


def _two_indices(x, y):  # (index_put over two index tensors, added up)
    n = x.shape[0]
    return x.new_zeros(n, C).index_put((torch.arange(n), y), x[:, 0], accumulate=True)


def _permuted(x, y):  # (the examples' order: a sort's indices, whatever the data)
    order = x[:, 0].argsort()
    return x.new_zeros(x.shape[0], C).index_put((order, y[order]), x[order, 1],
                                                accumulate=True)


class _Target(nn.Module):
    def __init__(self, build):
        super().__init__()
        self.build = build
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4 + C, 2)

    def forward(self, x, y):
        return self.b(torch.cat([torch.tanh(self.a(x)), self.build(x, y)], 1))


_loop = per_example_grads_of_two  # (each example's gradients, one at a time)


@pytest.mark.parametrize("build", [_one_hot, _two_indices, _permuted],
                         ids=["one_hot", "two_indices", "sorted"])
@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_writes_within_each_examples_row_are_planned_once(monkeypatch, strategy, build):
    # each call planned again (22.6 ms against 0.9 ms cached, B = 64), as if the target's
    # classes could make examples meet
    made = []
    build_plan = probe.build_plan
    monkeypatch.setattr(probe, "build_plan", lambda job: made.append(1) or build_plan(job))
    torch.manual_seed(0)
    model = _Target(build).to(D)
    x, t = torch.randn(B, 3, dtype=D), torch.randint(0, 2, (B,))
    for y in (torch.arange(B) % C, torch.tensor([1, 1, 1, 3, 3, 0]), torch.zeros(B).long()):
        got = tv.per_sample_grads(model, nn.CrossEntropyLoss(), (x, y), t, strategy=strategy)
        for n, want in _loop(model, x, y, t).items():
            torch.testing.assert_close(got[n], want, msg=n)
    assert len(made) == 1


def _writes(forward, *xs):
    watch = OrderWatch(xs, B)
    with watch:
        forward(*xs)
    return watch.data_writes


def test_writes_where_examples_can_meet_are_still_watched():
    torch.manual_seed(0)
    x, y = torch.randn(B, 3, dtype=D), torch.randint(0, C, (B,))
    assert _writes(_one_hot, x, y) == set()
    assert _writes(_two_indices, x, y) == set()
    assert _writes(_permuted, x, y) == set()
    # (arange(B) // 2: two examples share each value; two indices of the data; a write at
    # an index of the data along the examples' dimension; a constant index in the data's
    # dimension while the examples' dimension is addressed by the data)
    pairs = lambda x, y: x.new_zeros(B, C).index_put(  # noqa: E731
        (torch.arange(B) // 2, y), x[:, 0], accumulate=True)
    assert _writes(pairs, x, y)
    both = lambda x, y: x.new_zeros(C, C).index_put(  # noqa: E731
        (y, y.flip(0)), x[:, 0], accumulate=True)
    assert _writes(both, x, y)
    rows = lambda x, y: x.new_zeros(C, 3).index_put((y,), x, accumulate=True)  # noqa: E731
    assert _writes(rows, x, y)
    # (columns picked from the data of the whole batch: an index of several examples)
    def cols(x, y):
        out = x.new_zeros(B, C)
        out[:, y[:2]] = x[:, :2]
        return out

    assert _writes(cols, x, y)
    swapped = lambda x, y: x.new_zeros(C, B).index_put(  # noqa: E731
        (y, torch.zeros(B).long()), x[:, 0], accumulate=True)
    assert _writes(swapped, x, y)
