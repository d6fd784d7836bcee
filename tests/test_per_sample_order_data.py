"""Models that reorder, select or place the examples' rows by an index computed from the
inputs (NOTE [orders that depend on the data]): a plan made on a batch whose order is the
identity must not hand one example's gradient to another on the next batch. Constant
indices keep their rules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv

D = torch.float64


def _loss(out, *_):
    flat = out.flatten(1)
    return (flat * torch.linspace(-1.0, 1.0, flat.shape[1], dtype=out.dtype)).sum() \
        + 0.3 * flat.pow(2).sum()


def _loop(model, xs):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for i in range(xs.shape[0]):
        gs = torch.autograd.grad(_loss(model(xs[i:i + 1])), [p for _, p in named],
                                 allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, (_, p) in zip(gs, named)])
    return {n: torch.stack([r[j] for r in rows]) for j, (n, _) in enumerate(named)}


class _Sorted(nn.Module):
    """Sorts the examples by their first feature for the second layer, and back."""

    def __init__(self, how="index"):
        super().__init__()
        self.a, self.b, self.how = nn.Linear(4, 4), nn.Linear(4, 3), how

    def forward(self, x):
        h = torch.tanh(self.a(x))
        order = torch.argsort(x[:, 0], stable=True)
        back = torch.argsort(order)
        if self.how == "index":
            return self.b(h[order])[back]
        if self.how == "index_select":
            return self.b(h.index_select(0, order)).index_select(0, back)
        if self.how == "gather":
            rows = order[:, None].expand(-1, 4)
            return self.b(h.gather(0, rows))[back]
        if self.how == "index_put":  # (row back[i] of the sorted batch is example i's)
            return self.b(torch.zeros_like(h).index_put((back,), h))[back]
        if self.how == "scatter":
            y = self.b(h[order])
            return torch.zeros_like(y).scatter(0, order[:, None].expand(-1, 3), y)
        raise AssertionError(self.how)


def _batches():
    first = torch.randn(6, 4, dtype=D)
    first[:, 0] = 1.0  # (equal keys: the order is the identity)
    x = torch.randn(6, 4, dtype=D)
    x[:, 0] = torch.tensor([0.0, 3.0, 2.0, 1.0, 4.0, 5.0])  # (swaps examples 1 and 3)
    return first, x


@pytest.mark.parametrize("how", ["index", "index_select", "gather", "index_put", "scatter"])
def test_auto_gives_each_example_its_own_gradient_after_an_identity_order(how):
    torch.manual_seed(0)
    model = _Sorted(how).to(D)
    first, x = _batches()
    tv.per_sample_grads(model, _loss, first)
    want = _loop(model, x)
    got = tv.per_sample_grads(model, _loss, x)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)
    norms = sum(g.flatten(1).pow(2).sum(1) for g in want.values()).sqrt()
    torch.testing.assert_close(tv.per_sample_grad_norms(model, _loss, x), norms)
    max_norm = float(norms.median())
    model.zero_grad(set_to_none=True)
    tv.accumulate_clipped_grads(model, _loss, x, max_norm=max_norm)
    c = (max_norm / norms).clamp(max=1.0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, want[n]), msg=n)


def test_the_plan_says_why_the_rules_are_not_used():
    torch.manual_seed(0)
    model = _Sorted().to(D)
    first, _ = _batches()
    plan = tv.per_sample_plan(model, _loss, first)
    for n in ("a.weight", "b.weight", "b.bias"):
        assert plan[n].method in ("vmap", "loop"), n
        assert "reorders or selects the examples' rows by an index it computes from the " \
               "inputs (index, sort)" in plan[n].reason
        assert "each example is computed alone" in plan[n].reason


def test_hooks_refuses_and_names_the_cause_and_the_fix():
    torch.manual_seed(0)
    model = _Sorted().to(D)
    first, x = _batches()
    with pytest.raises(tv.StrategyError) as err:
        tv.per_sample_grads(model, _loss, first, strategy="hooks")
    msg = str(err.value)
    assert "strategy='hooks' cannot compute" in msg and "'b.weight'" in msg
    assert "by an index it computes from the inputs" in msg
    assert "a plan probed on one batch cannot be trusted on the next" in msg
    assert "strategy='auto'" in msg


class _Constant(nn.Module):
    """Indices that do not depend on the inputs (a permutation of the batch held in a buffer,
    a slice, ``torch.arange``), and one that does along another dimension."""

    def __init__(self, how):
        super().__init__()
        self.a, self.b, self.how = nn.Linear(4, 4), nn.Linear(4, 3), how
        self.register_buffer("perm", torch.tensor([2, 0, 1, 5, 3, 4]))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.how == "buffer":
            return self.b(h[self.perm])[self.perm.argsort()]
        if self.how == "last":
            return self.b(h[:, -1:].expand(-1, 4) * h)
        if self.how == "features":  # (the index is the data's, along the features)
            cols = torch.argsort(x, dim=1)
            return self.b(h.gather(1, cols))
        if self.how == "arange":
            s = h.unsqueeze(1).expand(-1, 5, -1) * torch.arange(1, 6, dtype=h.dtype)[:, None]
            pos = (x[:, 0] > 0).long() + 2
            return self.b(s[torch.arange(x.shape[0]), pos])
        raise AssertionError(self.how)


@pytest.mark.parametrize("how", ["buffer", "last", "features", "arange"])
def test_constant_indices_keep_their_rules(how):
    torch.manual_seed(0)
    model = _Constant(how).to(D)
    x = torch.randn(6, 4, dtype=D)
    plan = tv.per_sample_plan(model, _loss, x)
    assert plan["a.weight"].method == "rule", str(plan)
    assert how == "buffer" or plan["b.weight"].method == "rule", str(plan)
    assert not any("computes from the inputs" in plan[n].reason
                   for n in ("a.weight", "a.bias", "b.weight", "b.bias")), str(plan)
    if how == "buffer":
        return  # (a permutation of six rows: no example runs alone)
    want = _loop(model, x)
    got = tv.per_sample_grads(model, _loss, x)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)


class _SortsEachSequence(nn.Module):
    """Sorts each example's own sequence (of as many steps as the batch has examples) by
    its data: the examples' dimension is not the one indexed."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        steps = torch.argsort(x[..., 0], dim=1)
        return self.b(h.gather(1, steps[..., None].expand(-1, -1, 4)))


def test_an_order_along_a_sequence_of_the_batch_size_keeps_the_rules():
    torch.manual_seed(0)
    model = _SortsEachSequence().to(D)
    x = torch.randn(6, 6, 4, dtype=D)
    plan = tv.per_sample_plan(model, _loss, x, strategy="hooks")
    assert all(plan[n].method == "rule" for n in ("a.weight", "b.weight")), str(plan)
    want = _loop(model, x)
    got = tv.per_sample_grads(model, _loss, x, strategy="hooks")
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)
