"""Per-sample gradients of models that order the examples' rows by their own data (NOTE
[orders that depend on the data] in torch_vjp/_per_sample/order.py): the plan is made on a
batch whose order is the identity, and the next batch's order exchanges examples; every
result against the per-example loop in float64. The layers between an order and its
restore (or after an order never restored) leave the rules, saying why; the others, and
models whose indices are constant, keep them."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import torch_vjp as tv

D = torch.float64
B = 6
WHY = "the rows of the layer's input are ordered by the model's own data"
WHY_OUT = "the rows of the model's output are ordered by its own data"
# (vmap cannot batch a boolean mask: the masked model's fallback is the loop, with a warning)
pytestmark = pytest.mark.filterwarnings("ignore:.*could not vectorise")


def _loss(out, t=None):
    flat = out.flatten(1) if t is None else out.flatten(1) - t
    return (flat * torch.linspace(-1.0, 1.0, flat.shape[1], dtype=flat.dtype)).sum() \
        + 0.3 * flat.pow(2).sum()


def _loop(model, xs, t=None):
    named = list(model.named_parameters())
    rows = []
    for i in range(xs[0].shape[0]):
        out = model(*(x[i:i + 1] for x in xs))
        loss = _loss(out, None if t is None else t[i:i + 1])
        rows.append(torch.autograd.grad(loss, [p for _, p in named]))
    return {n: torch.stack([r[j] for r in rows]) for j, (n, _) in enumerate(named)}


def _batches():
    """A first batch whose sort key is constant (the order is the identity), then one whose
    key orders the examples otherwise."""
    torch.manual_seed(0)
    first, x = torch.randn(B, 4, dtype=D), torch.randn(B, 4, dtype=D)
    first[:, 0] = 1.0
    x[:, 0] = torch.tensor([0.0, 3.0, 2.0, 1.0, 5.0, 4.0], dtype=D)
    return first, x


class _SortRestore(nn.Module):
    """``b`` sees the rows sorted by the first feature; the result is put back in order."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        order = torch.argsort(x[:, 0], stable=True)
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))[order])[torch.argsort(order)]))


class _GatherWriteBack(nn.Module):
    """Sorted with ``sort`` and ``gather``, put back by writing the rows at the order."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        _, order = x[:, 0].sort(descending=True)
        h = torch.tanh(self.a(x))
        h = h.gather(0, order.unsqueeze(1).expand(-1, h.shape[1]))
        g = torch.tanh(self.b(h))
        back = torch.zeros_like(g)
        back[order] = g
        return self.c(back)


class _IndexCopyBack(_GatherWriteBack):
    def forward(self, x):
        order = torch.argsort(x[:, 0])
        g = torch.tanh(self.b(torch.tanh(self.a(x)).index_select(0, order)))
        return self.c(torch.zeros_like(g).index_copy(0, order, g))


class _Masked(_GatherWriteBack):
    """``b`` sees the examples whose first feature is positive, written back by the mask."""

    def forward(self, x):
        keep = x[:, 0] > 0.5
        h = torch.tanh(self.a(x))
        g = torch.tanh(self.b(h[keep]))
        back = h.new_zeros(h.shape[0], g.shape[1])
        back[keep] = g
        return self.c(back + h)


class _NotRestored(nn.Module):
    """Returns the examples sorted: the output's row i is not example i's."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        order = torch.argsort(x[:, 0])
        return self.b(torch.tanh(self.a(x)))[order]


class _Constant(nn.Module):
    """Indices that do not depend on the data: the examples reversed by an index made
    with ``arange`` and back (the rules see them in place), a column."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(5, 3)

    def forward(self, x):
        back = torch.arange(x.shape[0]).flip(0)
        h = torch.tanh(self.a(x))[back].index_select(0, back)
        return self.b(torch.cat([h, x[:, -1:]], 1))


class _Packed(nn.Module):
    """Tokens embedded, packed by their lengths (sorted and restored inside torch)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.rnn = nn.GRU(4, 4, batch_first=True)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        lengths = (x != 0).sum(1)
        packed = pack_padded_sequence(self.emb(x), lengths, batch_first=True,
                                      enforce_sorted=False)
        out, h = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.fc(out.sum(1) + h[-1])


# (model, the parameters the rules keep, those that leave them, the reason's words)
CASES = {
    "argsort-and-restore": (_SortRestore, ["a", "c"], ["b"], WHY),
    "sort-gather-and-write-back": (_GatherWriteBack, ["a", "c"], ["b"], WHY),
    "index-select-and-index-copy": (_IndexCopyBack, ["a", "c"], ["b"], WHY),
    "masked-and-written-back": (_Masked, ["a", "c"], ["b"], WHY),
    "not-restored": (_NotRestored, [], ["a", "b"], WHY_OUT),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_layers_between_an_order_and_its_restore_leave_the_rules(case):
    cls, kept, moved, why = CASES[case]
    torch.manual_seed(0)
    model = cls().to(D)
    first, x = _batches()
    plan = tv.per_sample_plan(model, _loss, first)
    for layer in kept:
        assert plan[f"{layer}.weight"].method == "rule", str(plan)
    for layer in moved:
        row = plan[f"{layer}.weight"]
        assert row.method == "vmap" and why in row.reason, str(plan)
        assert (f"in '{layer}', " in row.reason) == (why == WHY)
    tv.per_sample_grads(model, _loss, first)  # (the plan made on the identity order)
    want = _loop(model, (x,))
    got = tv.per_sample_grads(model, _loss, x)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)


@pytest.mark.parametrize("case", list(CASES))
def test_norms_and_the_clipped_sum_after_a_plan_made_on_the_identity_order(case):
    torch.manual_seed(0)
    model = CASES[case][0]().to(D)
    first, x = _batches()
    tv.per_sample_grad_norms(model, _loss, first)
    want = _loop(model, (x,))
    norms = torch.cat([w.flatten(1) for w in want.values()], 1).norm(dim=1)
    torch.testing.assert_close(tv.per_sample_grad_norms(model, _loss, x), norms)
    tv.accumulate_clipped_grads(model, _loss, first, max_norm=0.5)
    model.zero_grad()
    tv.accumulate_clipped_grads(model, _loss, x, max_norm=0.5)
    scale = (0.5 / norms).clamp(max=1.0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, (want[n] * scale.view(-1, *[1] * p.dim())).sum(0),
                                   msg=n)


def test_a_target_paired_with_rows_the_model_sorted():
    """With targets, a loss whose rows the model ordered is not split by example: every
    rule parameter leaves the rules."""
    torch.manual_seed(0)
    model = _NotRestored().to(D)
    first, x = _batches()
    t = torch.randn(B, 3, dtype=D)
    tv.per_sample_grads(model, _loss, first, t)
    want = _loop(model, (x,), t)
    got = tv.per_sample_grads(model, _loss, x, t)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)


def test_hooks_refuses_a_layer_after_an_order_saying_why_and_what_to_use():
    torch.manual_seed(0)
    model = _SortRestore().to(D)
    first, _ = _batches()
    with pytest.raises(tv.StrategyError) as info:
        tv.per_sample_grads(model, _loss, first, strategy="hooks")
    msg = str(info.value)
    assert "'b.weight': in 'b', " + WHY + " (index, sort)" in msg  # what, and by which ops
    assert "which row belongs to which example changes from one batch to the next" in msg
    assert "'a.weight'" not in msg and "'c.weight'" not in msg
    assert "strategy='auto'" in msg  # the fix


def test_constant_indices_keep_the_rules():
    torch.manual_seed(0)
    model = _Constant().to(D)
    first, x = _batches()
    plan = tv.per_sample_plan(model, _loss, first)
    assert {r.method for r in plan} == {"rule"}, str(plan)
    want = _loop(model, (x,))
    got = tv.per_sample_grads(model, _loss, x, strategy="hooks")
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)


def test_packed_sequences_keep_the_rules_before_and_after_the_packing():
    """pack_padded_sequence(enforce_sorted=False) sorts the batch by its lengths and
    pad_packed_sequence puts it back: the Embedding before and the Linear after keep their
    rules."""
    torch.manual_seed(0)
    model = _Packed().to(D)
    x = torch.randint(1, 7, (B, 5))
    x[1, 3:] = 0
    x[4, 1:] = 0
    plan = tv.per_sample_plan(model, _loss, x)
    assert plan["emb.weight"].method == "rule", str(plan)
    assert plan["fc.weight"].method == "rule", str(plan)
    assert plan["rnn.weight_ih_l0"].method != "rule", str(plan)
    want = _loop(model, (x,))
    got = tv.per_sample_grads(model, _loss, x)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)


def test_hooks_refuses_a_model_whose_output_rows_it_orders_saying_why():
    torch.manual_seed(0)
    first, _ = _batches()
    with pytest.raises(tv.StrategyError) as info:
        tv.per_sample_grads(_NotRestored().to(D), _loss, first, strategy="hooks")
    msg = str(info.value)
    for name in ("a.weight", "a.bias", "b.weight", "b.bias"):
        assert f"'{name}': {WHY_OUT} (index, sort), so the split of the loss into the " \
               f"examples' losses changes from one batch to the next" in msg
    assert "strategy='auto'" in msg
