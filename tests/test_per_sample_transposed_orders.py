"""Steps of the order watch through a transpose (torch_vjp/_per_sample/transposed.py): a
``(B, B)`` table written at a sort's indices along its rows, transposed (``.T``,
``.transpose(0, 1)``, ``.mT``, ``permute``), then read at those indices along its rows again
is not put back: the read runs along what were its columns. The watch took the two steps for
one and its inverse, so a plan made on a batch in order gave silently wrong per-sample
gradients on the next. Every result against the per-example loop in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv
from torch_vjp._per_sample.order import OrderWatch

D = torch.float64
B = 6
TRANSPOSES = {"T": lambda p: p.T, "transpose": lambda p: p.transpose(0, 1),
              "mT": lambda p: p.mT, "permute": lambda p: p.permute(1, 0)}
pytestmark = pytest.mark.filterwarnings("ignore:.*could not vectorise",
                                        "ignore:.*performance drop")


def _word(forward, *xs):
    watch = OrderWatch(xs, B)
    with watch:
        out = forward(*xs)
    return watch.word_of(out)


def _written(h):
    order = h[:, 0].argsort()
    return torch.zeros(B, B, dtype=D).index_copy(0, order, h), order


@pytest.mark.parametrize("how", list(TRANSPOSES))
def test_a_step_follows_its_dimension_through_a_transpose(how):
    torch.manual_seed(0)
    h = torch.randn(B, B, dtype=D)
    move = TRANSPOSES[how]

    def along_rows(h):
        p, order = _written(h)
        return move(p).index_select(0, order)

    def along_columns(h):
        p, order = _written(h)
        return move(p).index_select(1, order)

    assert _word(along_rows, h)  # (rows written, read along what were the columns)
    assert _word(along_columns, h) == ()  # (read along the dimension written: in place)

    def twice(h):  # (transposed back: the rows are where they were written)
        p, order = _written(h)
        return move(move(p)).index_select(0, order)

    assert _word(twice, h) == ()


class _Permuted(nn.Module):
    """A permutation table built at a sort's indices, transposed and read at them: the rows
    of ``b``'s input, and of the output, are the examples in another order."""

    def __init__(self, how):
        super().__init__()
        self.a, self.b, self.how = nn.Linear(4, 4), nn.Linear(4, 3), how

    def forward(self, x):
        n, order = x.shape[0], torch.argsort(x[:, 0])
        p = torch.zeros(n, n, dtype=x.dtype).index_copy(0, order, torch.eye(n, dtype=x.dtype))
        return self.b(TRANSPOSES[self.how](p).index_select(0, order) @ torch.tanh(self.a(x)))


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


@pytest.mark.parametrize("how", list(TRANSPOSES))
def test_grads_norms_and_the_clipped_sum_after_a_plan_made_on_the_identity_order(how):
    model = _Permuted(how).to(D)
    first, x = _batches()
    tv.per_sample_grads(model, _loss, first)
    want = _loop(model, x)
    got = tv.per_sample_grads(model, _loss, x)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)
    norms = torch.cat([w.flatten(1) for w in want.values()], 1).norm(dim=1)
    torch.testing.assert_close(tv.per_sample_grad_norms(model, _loss, x), norms)
    model.zero_grad()
    tv.accumulate_clipped_grads(model, _loss, x, max_norm=0.5)
    scale = (0.5 / norms).clamp(max=1.0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, (want[n] * scale.view(-1, *[1] * p.dim())).sum(0),
                                   msg=n)


def test_hooks_refuses_the_layers_saying_why():
    model = _Permuted("T").to(D)
    first, _ = _batches()
    with pytest.raises(tv.StrategyError) as info:
        tv.per_sample_grads(model, _loss, first, strategy="hooks")
    assert "the rows of the model's output are ordered by its own data" in str(info.value)
