"""Reads at an index computed from the model's own data that give each example its own
group's value (NOTE [writes at an index of the data] in torch_vjp/_per_sample/order.py): a
table of counts looked up at the group ids (``torch.bincount(g)[g]``), and a group sum
scattered at an expanded index and read back at the index itself (``total[g]``). On a batch
of B distinct groups the table has B rows, as the examples do, and was taken for rows of the
examples reordered by the data, so 'hooks' refused a model its rules compute; every result
against the per-example loop in float64. Where ids repeat, the module is still refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv
from torch_vjp._per_sample.order import OrderWatch

from _references import per_example_grads_of_two

D = torch.float64
B = 6
# (vmap cannot batch int(g.max()) or bincount: the fallback of 'auto' is the loop)
pytestmark = pytest.mark.filterwarnings("ignore:.*could not vectorise",
                                        "ignore:.*performance drop")


def _bincount(h, g):
    return h / torch.bincount(g)[g].unsqueeze(1).to(h.dtype)


def _unique(h, g):
    _, inverse, counts = torch.unique(g, return_inverse=True, return_counts=True)
    return h / counts[inverse].unsqueeze(1).to(h.dtype)


def _scatter(h, g):
    n = int(g.max()) + 1
    expanded = g.unsqueeze(1).expand_as(h)
    total = h.new_zeros(n, h.shape[1]).scatter_add(0, expanded, h)
    count = h.new_zeros(n, h.shape[1]).scatter_add(0, expanded, torch.ones_like(h))
    return (total / count)[g]


class _Group(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, h, g):
        return self.how(h, g)


class _Model(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.a, self.group, self.b = nn.Linear(3, 4), _Group(how), nn.Linear(4, 2)

    def forward(self, x, g):
        return self.b(torch.tanh(self.group(self.a(x), g)))


_loop = per_example_grads_of_two  # (each example's gradients, one at a time)


@pytest.mark.parametrize("how", [_bincount, _unique, _scatter],
                         ids=["bincount", "unique", "scatter"])
@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_each_examples_own_group_read_back_is_computed(strategy, how):
    # 'hooks' refused: "the rows of the model's output are ordered by its own data"
    torch.manual_seed(0)
    model = _Model(how).to(D)
    x, t = torch.randn(B, 3, dtype=D), torch.randint(0, 2, (B,))
    for g in (torch.arange(B), torch.tensor([3, 0, 5, 1, 4, 2]), torch.tensor([7, 0, 9, 2, 4, 8])):
        got = tv.per_sample_grads(model, nn.CrossEntropyLoss(), (x, g), t, strategy=strategy)
        for n, want in _loop(model, x, g, t).items():
            torch.testing.assert_close(got[n], want, msg=n)
    with pytest.raises(tv.PerSampleError, match=r"module 'group' \(_Group\) mixes examples"):
        tv.per_sample_grads(model, nn.CrossEntropyLoss(), (x, torch.tensor([0, 1, 1, 2, 3, 0])),
                            t, strategy=strategy)


def _word(forward, *xs):
    watch = OrderWatch(xs, B)
    with watch:
        out = forward(*xs)
    return watch.word_of(out)


def test_rows_of_the_examples_read_at_the_data_are_still_an_order():
    torch.manual_seed(0)
    h, g = torch.randn(B, B, dtype=D), torch.randperm(B)
    assert _word(_bincount, h, g) == ()
    assert _word(_scatter, h[:, :4], g) == ()
    # (the examples' own rows read at the data; counts added to them first; a scatter along
    # the features' dimension read back along the examples': none is a look-up or undone)
    assert _word(lambda h, g: h[g], h, g)
    assert _word(lambda h, g: (torch.bincount(g).to(h.dtype) + h[:, 0])[g], h, g)
    assert _word(lambda h, g: h.new_zeros(B, B).scatter(
        1, g.unsqueeze(1).expand(B, B), h)[g], h, g)
    assert _word(lambda h, g: h.new_zeros(B, B).scatter(
        0, g.unsqueeze(0).expand(B, B), h)[g], h, g)
