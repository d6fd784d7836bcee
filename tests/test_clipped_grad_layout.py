"""accumulate_clipped_grads adds to ``.grad`` as backward does, across calls whose layout
of the gradient changes (an Embedding's ``sparse`` switched between steps); float64
against a per-example loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv

DT = torch.float64


class _Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(10, 6), nn.Linear(6, 3)

    def forward(self, i):
        return self.lin(self.emb(i).mean(1))


def _clipped_sum(model, loss_fn, i, y, max_norm):
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    rows = []
    for k in range(i.shape[0]):
        gs = torch.autograd.grad(loss_fn(model(i[k:k + 1]), y[k:k + 1]), params)
        rows.append(torch.cat([g.flatten() for g in gs]))
    g = torch.stack(rows)
    c = (max_norm / g.norm(dim=1)).clamp(max=1.0)
    flat = c @ g
    return dict(zip(names, flat.split([p.numel() for p in params]))), params


# (not "vmap": it refuses an Embedding with sparse=True, whose sparse gradient it cannot batch)
@pytest.mark.parametrize("strategy", ["auto", "hooks", "loop"])
@pytest.mark.parametrize("first_sparse", [True, False], ids=["sparse-then-dense",
                                                             "dense-then-sparse"])
def test_a_sparse_grad_then_a_dense_sum_add_up_as_backward_adds_them(strategy, first_sparse):
    # a sparse .grad left by a step with sparse=True, then a step with sparse=False: the
    # sum was added as sparse + dense, which torch refuses ("add(sparse, dense) is not
    # supported"); backward adds them as dense + sparse, to a dense .grad
    torch.manual_seed(0)
    model = _Bag().to(DT)
    loss_fn = nn.CrossEntropyLoss()
    i, y = torch.randint(0, 10, (6, 4)), torch.randint(0, 3, (6,))
    want, _ = _clipped_sum(model, loss_fn, i, y, 0.5)
    model.emb.sparse = first_sparse
    tv.accumulate_clipped_grads(model, loss_fn, i, y, max_norm=0.5, strategy=strategy)
    assert model.emb.weight.grad.is_sparse == first_sparse
    model.emb.sparse = not first_sparse
    tv.accumulate_clipped_grads(model, loss_fn, i, y, max_norm=0.5, strategy=strategy)
    g = model.emb.weight.grad
    assert g.layout == torch.strided  # (as backward leaves it)
    torch.testing.assert_close(g, 2 * want["emb.weight"].reshape(g.shape))
    torch.testing.assert_close(model.lin.weight.grad,
                               2 * want["lin.weight"].reshape(model.lin.weight.shape))


@pytest.mark.parametrize("strategy", ["auto", "hooks", "loop"])
def test_a_dense_grad_takes_a_sparse_sum_in_place_as_backward_adds_it(strategy):
    # a dense .grad the user holds (zeroed by the optimizer, read by a logging hook), then
    # a step with sparse=True: backward adds the sparse gradient into that same tensor; the
    # clipped step put a new tensor in .grad and left the user's one stale
    torch.manual_seed(0)
    model = _Bag().to(DT)
    loss_fn = nn.CrossEntropyLoss()
    i, y = torch.randint(0, 10, (6, 4)), torch.randint(0, 3, (6,))
    want, _ = _clipped_sum(model, loss_fn, i, y, 0.5)
    held = torch.ones_like(model.emb.weight)
    model.emb.weight.grad = held
    model.emb.sparse = True
    tv.accumulate_clipped_grads(model, loss_fn, i, y, max_norm=0.5, strategy=strategy)
    assert model.emb.weight.grad is held
    assert held.layout == torch.strided
    torch.testing.assert_close(held, 1 + want["emb.weight"].reshape(held.shape))

    # backward itself, for the record of what is mirrored
    b = nn.Embedding(3, 2, sparse=True).to(DT)
    kept = torch.zeros_like(b.weight)
    b.weight.grad = kept
    b(torch.tensor([0, 2])).sum().backward()
    assert b.weight.grad is kept
