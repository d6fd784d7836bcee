"""An Embedding with max_norm whose table the forward reads again (a tied output layer, a
product with the table): in a batch, that read sees rows other examples renormalised, so the
per-sample gradients must come from each example alone (NOTE [renormalised tables read
again] in torch_vjp._per_sample.renorm). Float64, against a per-example loop."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torch_vjp as tv

DT = torch.float64
V, D = 6, 4


class TiedHead(nn.Module):
    """Embedding(max_norm) -> Linear -> an output layer tied to the table."""

    def __init__(self, frozen: bool, small: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D, max_norm=1.0)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight
        with torch.no_grad():
            if small:  # (no row above max_norm yet: as a table that grows in training)
                self.emb.weight.normal_(std=0.02)
        self.emb.weight.requires_grad_(not frozen)

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.emb(idx)))).flatten(1)


class TableProduct(nn.Module):
    """Embedding(max_norm), then a product with the whole (detached) table."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D, max_norm=1.0)
        self.mid = nn.Linear(D, D)

    def forward(self, idx):
        return (torch.tanh(self.mid(self.emb(idx))) @ self.emb.weight.detach().t()).flatten(1)


class LookupOnly(nn.Module):
    """Embedding(max_norm) looked up twice, then a Linear: no other read of the table."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D, max_norm=1.0)
        self.out = nn.Linear(D, 3)

    def forward(self, idx):
        return self.out(torch.tanh(self.emb(idx) + self.emb(idx.flip(1)))).sum(1)


def mixed_rows():
    """Examples 0, 2 and 4 (those the plan checks against the loop) look up every row,
    examples 1 and 3 only row 0: in the batch, 1 and 3 see rows they do not renormalise."""
    every, one = torch.arange(V), torch.zeros(V, dtype=torch.long)
    return torch.stack([every, one, every, one, every])


def loss_fn(out, t):
    return (torch.tanh(out) * t).sum()


def loop_reference(model, x, t):
    """Each example alone, from a copy of the caller's model (its own renormalisation)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        m = copy.deepcopy(model)
        params = dict(m.named_parameters())
        loss = loss_fn(m(x[i : i + 1]), t[i : i + 1])
        rows.append(torch.autograd.grad(loss, [params[n] for n in names]))
    return {n: torch.stack(r) for n, r in zip(names, zip(*rows))}


def check(model, x, t, strategy="auto"):
    ref = loop_reference(model, x, t)
    table = model.emb.weight.detach().clone()
    got = tv.per_sample_grads(model, loss_fn, x, t, strategy=strategy)
    assert list(got) == list(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    torch.testing.assert_close(
        tv.per_sample_grad_norms(model, loss_fn, x, t, strategy=strategy), norms)
    max_norm = float(norms.median())
    c = (max_norm / norms).clamp(max=1.0)
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(
        tv.accumulate_clipped_grads(model, loss_fn, x, t, max_norm=max_norm,
                                    strategy=strategy), norms)
    for n, p in model.named_parameters():
        if n in ref:
            torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, ref[n]), msg=n)
    model.zero_grad(set_to_none=True)
    assert torch.equal(model.emb.weight, table)  # (the caller's table, not renormalised)


@pytest.mark.parametrize("make", [
    lambda: TiedHead(frozen=True), lambda: TiedHead(frozen=False), TableProduct,
], ids=["tied-head-frozen-table", "tied-head-trained-table", "product-with-table"])
def test_table_read_again_matches_the_loop(make):
    model = make().to(DT)
    x = mixed_rows()
    t = torch.randn(x.shape[0], x.shape[1] * V, dtype=DT)
    check(model, x, t)


def test_rows_that_grow_past_max_norm_after_the_first_call():
    # The plan is made while no row is above max_norm (no renormalisation happens); the
    # rows then grow, as in training: every later call is still each example's own.
    model = TiedHead(frozen=False, small=True).to(DT)
    torch.manual_seed(1)
    for step in range(6):
        if step == 2:
            with torch.no_grad():
                model.emb.weight.mul_(100)
        x = torch.randint(0, V, (6, 3))
        t = torch.randn(6, 3 * V, dtype=DT)
        check(model, x, t)


def test_hooks_refuses_and_says_why():
    model = TiedHead(frozen=True).to(DT)
    x = mixed_rows()
    t = torch.randn(x.shape[0], x.shape[1] * V, dtype=DT)
    with pytest.raises(tv.StrategyError, match=r"(?s)'mid.weight'.*max_norm renormalises "
                       r"rows of its table in place, and the forward reads the table again"):
        tv.per_sample_grads(model, loss_fn, x, t, strategy="hooks")
    plan = tv.per_sample_plan(model, loss_fn, x, t)
    assert plan["mid.weight"].method == "loop"


@pytest.mark.parametrize("flat", [False, True], ids=["own-storage", "one-flat-buffer"])
def test_lookups_alone_keep_the_rules(flat):
    # A table read only by its own renormalising lookups gives each example what it gets
    # alone: the layers after it keep their rules (also where the table and the layer's
    # weight are views of one flat buffer: a read of the weight is no read of the table).
    model = LookupOnly().to(DT)
    if flat:
        buf = torch.cat([model.emb.weight.detach().flatten(), model.out.weight.detach().flatten()])
        model.emb.weight = nn.Parameter(buf[: V * D].view(V, D))
        model.out.weight = nn.Parameter(buf[V * D :].view(3, D))
        assert model.emb.weight.untyped_storage().data_ptr() == (
            model.out.weight.untyped_storage().data_ptr())
    x = mixed_rows()
    t = torch.randn(x.shape[0], 3, dtype=DT)
    plan = tv.per_sample_plan(model, loss_fn, x, t)
    assert plan["out.weight"].method == "rule"
    check(model, x, t)
