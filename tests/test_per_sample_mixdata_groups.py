"""Models that mix examples through rows written at an index computed from their own data
(NOTE [writes at an index of the data] in torch_vjp/_per_sample/order.py): a group mean
over a group id in the input mixes the examples of a group only where ids repeat. Planned
on a batch whose ids are all distinct, then called on one where they repeat, every result
is checked against the per-example loop in float64, or the call is refused naming the
module that mixes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv
from torch_vjp._per_sample.order import OrderWatch

from _references import per_example_grads_of_two

D = torch.float64
B = 6
DISTINCT = torch.arange(B)
REPEATS = torch.tensor([0, 1, 2, 1, 3, 0])
# (vmap cannot batch int(g.max()): the fallback of 'auto' is the loop, with a warning)
pytestmark = pytest.mark.filterwarnings("ignore:.*could not vectorise")


def _add(h, g, n):
    return h.new_zeros(n, h.shape[1]).index_add(0, g, h)


def _scatter(h, g, n):
    return h.new_zeros(n, h.shape[1]).scatter_add(0, g, h)


def _put(h, g, n):
    return h.new_zeros(n, h.shape[1]).index_put((g,), h, accumulate=True)


def _reduce(h, g, n):
    return h.new_zeros(n, h.shape[1]).scatter_reduce(0, g, h, "sum", include_self=True)


_SUMS = {"index_add": _add, "scatter_add": _scatter, "index_put": _put,
         "scatter_reduce": _reduce}


class _GroupMean(nn.Module):
    """The mean of the features of the examples that share a group id, gathered back."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, h, g):
        n = int(g.max()) + 1
        if self.how.startswith("scatter"):  # (read back at the index written at)
            g = g.unsqueeze(1).expand_as(h)
            mean = _SUMS[self.how](h, g, n) / _SUMS[self.how](torch.ones_like(h), g, n)
            return mean.gather(0, g)
        total = _SUMS[self.how](h, g, n)
        count = _SUMS[self.how](torch.ones_like(h[:, :1]), g, n)
        return (total / count)[g]


class _Grouped(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.gm = _GroupMean(how)
        self.b = nn.Linear(4, 2)

    def forward(self, x, g):
        return self.b(torch.tanh(self.gm(self.a(x), g)))


_loop = per_example_grads_of_two  # (each example's gradients, one at a time)


def _call(fn, model, x, g, t, strategy):
    loss = nn.CrossEntropyLoss()
    if fn == "grads":
        return tv.per_sample_grads(model, loss, (x, g), t, strategy=strategy)
    if fn == "norms":
        return tv.per_sample_grad_norms(model, loss, (x, g), t, strategy=strategy)
    model.zero_grad(set_to_none=True)
    tv.accumulate_clipped_grads(model, loss, (x, g), t, max_norm=1e9, strategy=strategy)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(fn, got, ref):
    if fn == "grads":
        for n, want in ref.items():
            torch.testing.assert_close(got[n], want, msg=n)
    elif fn == "norms":
        want = torch.stack([r.flatten(1).pow(2).sum(1) for r in ref.values()]).sum(0).sqrt()
        torch.testing.assert_close(got, want)
    else:
        for n, want in ref.items():
            torch.testing.assert_close(got[n], want.sum(0), msg=n)


@pytest.mark.parametrize("how", sorted(_SUMS))
@pytest.mark.parametrize("strategy", ["auto", "hooks"])
@pytest.mark.parametrize("fn", ["grads", "norms", "clipped"])
def test_a_plan_made_on_distinct_ids_is_not_trusted_where_they_repeat(fn, strategy, how):
    # planned on distinct ids (no two examples meet), the next batch's repeated ids gave
    # per-sample gradients, norms and clipped sums up to 0.5 off the loop, silently, under
    # 'auto' and 'hooks', until the plan's check at its 4th use
    torch.manual_seed(0)
    model = _Grouped(how).to(D)
    x, t = torch.randn(B, 3, dtype=D), torch.randint(0, 2, (B,))
    _check(fn, _call(fn, model, x, DISTINCT, t, strategy), _loop(model, x, DISTINCT, t))
    with pytest.raises(tv.PerSampleError, match=r"module 'gm' \(_GroupMean\) mixes examples"):
        _call(fn, model, x, REPEATS, t, strategy)
    # the refusal is of that batch alone: distinct ids again are computed, at the same size
    _check(fn, _call(fn, model, x, DISTINCT.flip(0), t, strategy),
           _loop(model, x, DISTINCT.flip(0), t))
    # (the loop computes the definition, whatever the ids)
    _check(fn, _call(fn, model, x, REPEATS, t, "loop"), _loop(model, x, REPEATS, t))


def _writes(forward, *xs):
    watch = OrderWatch(xs, B)
    with watch:
        forward(*xs)
    return watch.data_writes


def test_writes_that_cannot_mix_examples_are_not_taken_for_mixing():
    torch.manual_seed(0)
    h, g = torch.randn(B, 4, dtype=D), torch.randint(0, 3, (B,))

    def restored(h):  # (written back at a sort's indices: each row once, whatever the data)
        order = h[:, 0].argsort()
        out = torch.empty_like(h)
        out[order] = h[order] * 2
        return out.index_copy(0, order.argsort(), out)

    def one_hot(h, g):  # (written within each example's row)
        return torch.zeros(B, 3, dtype=D).scatter_(1, g.unsqueeze(1), 1.0)

    def constant(h):  # (an index not computed from the data: the same on every batch)
        return h.new_zeros(3, 4).index_add(0, torch.tensor([0, 1, 2, 0, 1, 2]), h)

    assert _writes(restored, h) == set()
    assert _writes(one_hot, h, g) == set()
    assert _writes(constant, h) == set()
    assert _writes(lambda h, g: _add(h, g, 3), h, g) == {"index_add"}
    assert _writes(lambda h, g: _scatter(h, g.unsqueeze(1).expand_as(h), 3), h, g) == {
        "scatter_add"}
    assert _writes(lambda h, g: _put(h, g, 3), h, g) == {"index_put_"} or \
        _writes(lambda h, g: _put(h, g, 3), h, g) == {"index_put"}
    assert _writes(lambda h, g: torch.bincount(g), h, g) == {"bincount"}
    lengths = torch.tensor([2, 1, 3])
    assert _writes(lambda h: torch.segment_reduce(h, "sum", lengths=lengths), h) == set()
    assert _writes(lambda h, n: torch.segment_reduce(h, "sum", lengths=n), h, lengths) == {
        "segment_reduce"}  # (segments whose lengths are the data's: several examples each)
    assert _writes(lambda h, g: torch.unique(g, return_counts=True), h, g)
    assert _writes(lambda h, g: h.topk(3, 0).indices.new_zeros(B).index_add(
        0, h[:, 0].topk(B).indices, g), h, g) == {"index_add"}  # (topk: not each row once)


def _bincount(g):
    return torch.bincount(g)[g]


def _ones(g):
    return torch.zeros(int(g.max()) + 1, dtype=D).index_add(0, g, torch.ones(g.shape, dtype=D))[g]


def _unique(g):
    _, inverse, counts = torch.unique(g, return_inverse=True, return_counts=True)
    return counts[inverse]


class _GroupSize(nn.Module):
    """Scales each example's features by the size of its group: it mixes the examples of a
    group through the counts alone, which carry no gradient from one example to another."""

    def __init__(self, count):
        super().__init__()
        self.count = count

    def forward(self, h, g):
        return h / self.count(g).unsqueeze(1).to(h.dtype)


class _Sized(nn.Module):
    def __init__(self, count):
        super().__init__()
        self.a, self.size, self.b = nn.Linear(3, 4), _GroupSize(count), nn.Linear(4, 2)

    def forward(self, x, g):
        return self.b(torch.tanh(self.size(self.a(x), g)))


@pytest.mark.parametrize("count", [_bincount, _ones, _unique], ids=["bincount", "index_add",
                                                                     "unique"])
@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_examples_mixed_through_counts_of_the_data_are_refused(strategy, count):
    # examples 1 and 2 share an id: the data-flow tests follow gradients and see no mixing,
    # and the check against the loop looked at examples 0, 2 and 4 (rules, 0.2 off the loop
    # for example 1, silently)
    torch.manual_seed(0)
    model = _Sized(count).to(D)
    x, t = torch.randn(B, 3, dtype=D), torch.randint(0, 2, (B,))
    distinct, shared = torch.tensor([0, 1, 2, 3, 4, 7]), torch.tensor([0, 2, 2, 4, 5, 7])
    _check("grads", _call("grads", model, x, distinct, t, "auto"),
           _loop(model, x, distinct, t))
    with pytest.raises(tv.PerSampleError, match=r"torch_vjp\.per_sample_grads: module 'size' "
                       r"\(_GroupSize\) mixes examples: the output it gives one example "
                       r"depends on the other examples of the batch.*\n  Fix: .*"
                       r"strategy='vmap' or strategy='loop'"):
        _call("grads", model, x, shared, t, strategy)
    _check("grads", _call("grads", model, x, shared, t, "loop"), _loop(model, x, shared, t))
