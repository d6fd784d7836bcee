"""Steps of the order watch along different dimensions (NOTE [orders that depend on the
data] in torch_vjp/_per_sample/order.py): rows written at an index along one dimension of a
``(B, B)`` tensor are not put back by a read at that index along its other dimension. Every
result against the per-example loop in float64, on a batch whose order is the identity
planned first, then one whose order is not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv
from torch_vjp._per_sample.order import OrderWatch

D = torch.float64
B = 6
# (vmap cannot batch an index_copy at an index of the data: the fallback is the loop)
pytestmark = pytest.mark.filterwarnings("ignore:.*could not vectorise",
                                        "ignore:.*performance drop")


def _word(forward, *xs):
    watch = OrderWatch(xs, B)
    with watch:
        out = forward(*xs)
    return watch.word_of(out)


def _sorted(h, write, read):
    """``h`` written at a sort's indices along ``write``, read back at them along ``read``."""
    order = h[:, 0].argsort()
    return torch.zeros(B, B, dtype=D).index_copy(write, order, h).index_select(read, order)


def test_a_write_along_one_dimension_is_not_undone_by_a_read_along_another():
    torch.manual_seed(0)
    h, g = torch.randn(B, B, dtype=D), torch.randperm(B)
    assert _word(lambda h, g: torch.zeros(B, B, dtype=D).index_add(0, g, h).index_select(1, g),
                 h, g)
    assert _word(lambda h, g: torch.zeros(B, B, dtype=D).index_copy(1, g, h)[g], h, g)
    assert _word(lambda h: _sorted(h, 0, 1), h)
    # (along the same dimension the rows are back in place)
    assert _word(lambda h, g: torch.zeros(B, B, dtype=D).index_add(0, g, h).index_select(0, g),
                 h, g) == ()
    assert _word(lambda h: _sorted(h, 1, 1), h) == ()


class _Permuted(nn.Module):
    """A permutation matrix built at the sort's indices along its rows and read back at them
    along its columns: the rows of ``b``'s input are the examples in another order."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        n, order = x.shape[0], torch.argsort(x[:, 0])
        eye = torch.eye(n, dtype=x.dtype)
        p = torch.zeros(n, n, dtype=x.dtype).index_copy(0, order, eye).index_select(1, order)
        return self.b(p @ torch.tanh(self.a(x)))


def _loss(out):
    return (out * torch.linspace(-1.0, 1.0, out.shape[1], dtype=out.dtype)).sum() \
        + 0.3 * out.pow(2).sum()


def _loop(model, x):
    named = list(model.named_parameters())
    rows = [torch.autograd.grad(_loss(model(x[i:i + 1])), [p for _, p in named])
            for i in range(x.shape[0])]
    return {n: torch.stack([r[j] for r in rows]) for j, (n, _) in enumerate(named)}


def _batches():
    torch.manual_seed(0)
    first, x = torch.randn(B, 4, dtype=D), torch.randn(B, 4, dtype=D)
    first[:, 0] = torch.arange(B, dtype=D)
    x[:, 0] = torch.tensor([2.0, 0.0, 1.0, 5.0, 3.0, 4.0], dtype=D)
    return first, x


def test_grads_after_a_plan_made_on_the_identity_order():
    model = _Permuted().to(D)
    first, x = _batches()
    tv.per_sample_grads(model, _loss, first)
    want = _loop(model, x)
    got = tv.per_sample_grads(model, _loss, x)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)


def test_norms_and_the_clipped_sum_after_a_plan_made_on_the_identity_order():
    model = _Permuted().to(D)
    first, x = _batches()
    tv.per_sample_grad_norms(model, _loss, first)
    want = _loop(model, x)
    norms = torch.cat([w.flatten(1) for w in want.values()], 1).norm(dim=1)
    torch.testing.assert_close(tv.per_sample_grad_norms(model, _loss, x), norms)
    tv.accumulate_clipped_grads(model, _loss, first, max_norm=0.5)
    model.zero_grad()
    tv.accumulate_clipped_grads(model, _loss, x, max_norm=0.5)
    scale = (0.5 / norms).clamp(max=1.0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, (want[n] * scale.view(-1, *[1] * p.dim())).sum(0),
                                   msg=n)


def test_hooks_refuses_the_layer_saying_why():
    model = _Permuted().to(D)
    first, _ = _batches()
    with pytest.raises(tv.StrategyError) as info:
        tv.per_sample_grads(model, _loss, first, strategy="hooks")
    msg = str(info.value)
    assert "the rows of the model's output are ordered by its own data" in msg
    assert "strategy='auto'" in msg


def test_a_weighted_bincount_is_rows_added_up_at_the_data():
    """``torch.bincount(g, weights=w)`` adds ``w`` up at ``g`` (``index_add(0, g, w)``): its
    rows are in the order of the data's values, and read back at ``g`` they are in place; a
    count table (no weights) is in no order of the rows."""
    torch.manual_seed(0)
    h, g = torch.randn(B, B, dtype=D), torch.randperm(B)
    assert _word(lambda h, g: torch.bincount(g, weights=h[:, 0]).unsqueeze(1), h, g)
    assert _word(lambda h, g: torch.bincount(g, h[:, 0], B).unsqueeze(1), h, g)
    assert _word(lambda h, g: torch.bincount(g, weights=h[:, 0])[g], h, g) == ()
    assert _word(lambda h, g: (torch.bincount(g, weights=h[:, 0]) / torch.bincount(g))[g],
                 h, g) == ()
    assert _word(lambda h, g: torch.bincount(g).to(h.dtype)[g] + h[:, 0], h, g) == ()


class _WeightedCounts(nn.Module):
    """``fc`` sees the first feature added up at the group ids, read back at them."""

    def __init__(self):
        super().__init__()
        self.a, self.fc = nn.Linear(4, 3), nn.Linear(1, 3)

    def forward(self, x, g):
        t = torch.bincount(g, weights=x[:, 0].detach())
        return self.fc(t.unsqueeze(1))[g] + self.a(x)


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_a_layer_fed_a_weighted_bincount_leaves_the_rules(strategy):
    torch.manual_seed(0)
    model = _WeightedCounts().to(D)
    x = torch.randn(B, 4, dtype=D)
    plan = tv.per_sample_plan(model, _loss, (x, torch.arange(B)))
    assert plan["a.weight"].method == "rule", str(plan)
    assert plan["fc.weight"].method == "vmap", str(plan)
    assert "in 'fc', the rows of the layer's input are ordered by the model's own data " \
           "(bincount, index)" in plan["fc.weight"].reason
    named = list(model.named_parameters())
    for g in (torch.arange(B), torch.tensor([3, 0, 5, 1, 4, 2])):
        if strategy == "hooks":
            with pytest.raises(tv.StrategyError, match="'fc.weight': in 'fc', "):
                tv.per_sample_grads(model, _loss, (x, g), strategy=strategy)
            continue
        got = tv.per_sample_grads(model, _loss, (x, g), strategy=strategy)
        rows = [torch.autograd.grad(_loss(model(x[i:i + 1], g[i:i + 1])),
                                    [p for _, p in named]) for i in range(B)]
        for j, (n, _) in enumerate(named):
            torch.testing.assert_close(got[n], torch.stack([r[j] for r in rows]), msg=n)
