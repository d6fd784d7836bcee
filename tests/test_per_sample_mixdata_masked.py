"""Models that pack or unpack the examples' rows at a boolean mask computed from their own
data with ``masked_select`` or ``masked_scatter`` (NOTE [orders that depend on the data] in
torch_vjp/_per_sample/order.py): row ``k`` of the result is another example's row, by how
many rows before ``k`` the mask sets. Planned on a batch whose mask is all set (the order is
the identity), then called on one where it is not; every result against the per-example
loop in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv

D = torch.float64
B = 6
ALL = torch.ones(B, dtype=torch.long)
SOME = torch.tensor([1, 0, 1, 1, 0, 1])
WHY_OUT = r"the rows of the model's output are ordered by its own data \(.*{op}.*\)"
pytestmark = pytest.mark.filterwarnings("ignore:.*could not vectorise")


class _Unpacked(nn.Module):
    """The rows of ``b``'s output written, in order, at the examples the flag sets."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x, flag):
        y = self.b(torch.tanh(self.a(x)))
        return torch.zeros_like(y).masked_scatter((flag > 0)[:, None].expand_as(y), y)


class _Packed(nn.Module):
    """``b`` sees the rows of the examples the flag sets, packed; zeros for the others."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x, flag):
        h = torch.tanh(self.a(x))
        y = self.b(torch.masked_select(h, (flag > 0)[:, None].expand_as(h)).view(-1, 4))
        return torch.cat([y, y.new_zeros(x.shape[0] - y.shape[0], 2)])


def _loop(model, x, flag, t):
    named = list(model.named_parameters())
    rows = []
    for i in range(B):
        loss = nn.functional.cross_entropy(model(x[i:i + 1], flag[i:i + 1]), t[i:i + 1])
        rows.append(torch.autograd.grad(loss, [p for _, p in named], allow_unused=True))
    return {n: torch.stack([torch.zeros_like(p) if r[j] is None else r[j] for r in rows])
            for j, (n, p) in enumerate(named)}


@pytest.mark.parametrize("make, op", [(_Unpacked, "masked_scatter"), (_Packed, "masked_select")])
def test_rows_moved_by_a_mask_of_the_data_are_computed_alone(make, op):
    # planned on an all-set mask, the next batch's mask moved rows to other examples: the
    # rules handed example 2's gradient to example 1 and so on (1.0 off the loop, silently)
    torch.manual_seed(0)
    model = make().to(D)
    x, t = torch.randn(B, 3, dtype=D), torch.randint(0, 2, (B,))
    loss = nn.CrossEntropyLoss()
    for flag in (ALL, SOME):
        got = tv.per_sample_grads(model, loss, (x, flag), t)
        for n, want in _loop(model, x, flag, t).items():
            torch.testing.assert_close(got[n], want, msg=n)
        norms = tv.per_sample_grad_norms(model, loss, (x, flag), t)
        torch.testing.assert_close(norms, torch.stack([
            w.flatten(1).pow(2).sum(1) for w in _loop(model, x, flag, t).values()]).sum(0).sqrt())
    with pytest.raises(tv.StrategyError, match=r"strategy='hooks' cannot compute 4 "
                       r"parameter\(s\) with a per-layer rule:\n    'a\.weight': "
                       + WHY_OUT.format(op=op)):
        tv.per_sample_grads(model, loss, (x, ALL), t, strategy="hooks")
