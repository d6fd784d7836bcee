"""Rows of the examples added up by a table built from the model's own data (NOTE [tables of
the data in a product] in torch_vjp/_per_sample/products.py): a one-hot table of group ids
used transposed (``.T``, ``.transpose(0, 1)``, ``.mT``, an ``einsum``) or a same-group table
in a matrix product with activations. On a first batch whose ids are distinct and in order
the table is the identity; a plan made there and reused gave the next batch (ids exchanged,
or repeated) silently wrong per-sample gradients. Every result against the per-example loop
in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_vjp as tv
from torch_vjp._per_sample.order import OrderWatch

from _references import per_example_grads_of_two

D = torch.float64
B = 6
MIXES = r"module 'group' \(_Group\) mixes examples"
PERMUTED = torch.tensor([3, 0, 5, 1, 4, 2])
REPEATED = torch.tensor([0, 0, 1, 1, 2, 2])
pytestmark = pytest.mark.filterwarnings("ignore:.*could not vectorise",
                                        "ignore:.*performance drop")


def _one_hot_T(h, g):
    t = F.one_hot(g, B).to(h.dtype)
    return t @ torch.tanh(t.T @ h)


def _one_hot_transpose(h, g):
    t = F.one_hot(g, B).to(h.dtype)
    return t @ torch.tanh(t.transpose(0, 1) @ h)


def _one_hot_mT(h, g):
    t = F.one_hot(g, B).to(h.dtype)
    return t @ torch.tanh(t.mT @ h)


def _one_hot_einsum(h, g):
    t = F.one_hot(g, B).to(h.dtype)
    return torch.einsum("bc,cf->bf", t, torch.tanh(torch.einsum("bc,bf->cf", t, h)))


def _scattered_one_hot_T(h, g):
    t = torch.zeros(h.shape[0], B, dtype=h.dtype).scatter_(1, g[:, None], 1.0)
    return t @ torch.tanh(t.T @ h)


def _same_group_mean(h, g):
    same = (g[:, None] == g[None, :]).to(h.dtype)
    return (same.T @ h) / same.sum(1, keepdim=True)


def _same_group_broadcast(h, g):
    same = (g[:, None] == g[None, :]).to(h.dtype)
    return (same[:, :, None] * h[None]).sum(1) / same.sum(1, keepdim=True)


def _same_group_masked(h, g):
    n = h.shape[0]
    apart = (g[:, None] != g[None, :]).unsqueeze(2)
    return h[None].expand(n, n, h.shape[1]).masked_fill(apart, float("-inf")).amax(1)


HOWS = [_one_hot_T, _one_hot_transpose, _one_hot_mT, _one_hot_einsum, _scattered_one_hot_T,
        _same_group_mean, _same_group_broadcast, _same_group_masked]
IDS = ["T", "transpose", "mT", "einsum", "scatter-in-place", "same-group", "broadcast",
       "masked-fill"]


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


def _model_and_data(how):
    torch.manual_seed(0)
    return _Model(how).to(D), torch.randn(B, 3, dtype=D), torch.randint(0, 2, (B,))


@pytest.mark.parametrize("how", HOWS, ids=IDS)
@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_grads_after_a_plan_made_where_the_table_is_the_identity(strategy, how):
    model, x, t = _model_and_data(how)
    loss = nn.CrossEntropyLoss()
    tv.per_sample_grads(model, loss, (x, torch.arange(B)), t, strategy=strategy)
    # (ids exchanged: a one-hot table exchanges the rows and puts them back)
    got = tv.per_sample_grads(model, loss, (x, PERMUTED), t, strategy=strategy)
    for n, want in per_example_grads_of_two(model, x, PERMUTED, t).items():
        torch.testing.assert_close(got[n], want, msg=n)
    with pytest.raises(tv.PerSampleError, match=MIXES):
        tv.per_sample_grads(model, loss, (x, REPEATED), t, strategy=strategy)


@pytest.mark.parametrize("how", HOWS, ids=IDS)
def test_norms_and_the_clipped_sum_after_a_plan_made_where_the_table_is_the_identity(how):
    model, x, t = _model_and_data(how)
    loss = nn.CrossEntropyLoss()
    g = PERMUTED
    tv.per_sample_grad_norms(model, loss, (x, torch.arange(B)), t)
    want = per_example_grads_of_two(model, x, g, t)
    norms = torch.cat([w.flatten(1) for w in want.values()], 1).norm(dim=1)
    torch.testing.assert_close(tv.per_sample_grad_norms(model, loss, (x, g), t), norms)
    tv.accumulate_clipped_grads(model, loss, (x, torch.arange(B)), t, max_norm=0.1)
    model.zero_grad()
    tv.accumulate_clipped_grads(model, loss, (x, g), t, max_norm=0.1)
    scale = (0.1 / norms).clamp(max=1.0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, (want[n] * scale.view(-1, *[1] * p.dim())).sum(0),
                                   msg=n)
    with pytest.raises(tv.PerSampleError, match=MIXES):
        tv.per_sample_grad_norms(model, loss, (x, REPEATED), t)


def _writes(forward, *xs):
    watch = OrderWatch(xs, B)
    with watch:
        forward(*xs)
    return watch.data_writes


def test_which_products_are_named():
    torch.manual_seed(0)
    h, g, w = torch.randn(B, 4, dtype=D), torch.randperm(B), torch.randn(B, 4, dtype=D)
    scale = torch.tensor(2.0, dtype=D)
    for how in HOWS:
        assert _writes(how, h, g), how.__name__
    # (a table scaled by a parameter is still a table; a vector product too)
    assert _writes(lambda h, g: (F.one_hot(g, B).to(h.dtype) * scale).T @ h, h, g)
    assert _writes(lambda h, g: F.one_hot(g, B).to(h.dtype).T @ h[:, 0], h, g)
    # (a table written over in place by rows is a table no more)
    assert not _writes(lambda h, g: F.one_hot(g, B).to(h.dtype).add_(h[:, :1]).T @ h, h, g)
    # (a table by a parameter: an embedding; rows by rows: attention, whose gradients the
    # data-flow tests follow; a table by a table; a product over the features)
    assert not _writes(lambda h, g: F.one_hot(g, B).to(h.dtype) @ w, h, g)
    assert not _writes(lambda h, g: torch.softmax(h @ h.T, 1) @ h, h, g)
    assert not _writes(lambda h, g: F.one_hot(g, B).to(h.dtype).T @ F.one_hot(g, B).to(h.dtype),
                       h, g)
    assert not _writes(lambda h, g: F.one_hot(g % 4, 4).to(h.dtype) @ h.T, h, g)
    # (a padding mask over a sequence of length B pairs each example's rows with its own
    # entries: mean pooling, and attention scores masked)
    tokens, lengths = torch.randn(B, B, 4, dtype=D), torch.arange(1, B + 1)
    mask = torch.arange(B)[None, :] < lengths[:, None]
    assert not _writes(lambda x, n: (x * mask[..., None].to(x.dtype)).sum(1), tokens, lengths)
    assert not _writes(lambda x, n: (x @ x.transpose(1, 2)).masked_fill(
        ~(torch.arange(B)[None, :] < n[:, None])[:, None, :], -1e9).softmax(-1) @ x,
        tokens, lengths)
