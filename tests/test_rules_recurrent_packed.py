"""A recurrent layer called with a PackedSequence on a batch of one, where the plan trusts
every call (NOTE [a batch of one] in torch_vjp/_per_sample/hooks.py): the rule declines the
call, and 'auto' computes its parameters with the fallback (it raised a PerSampleError that
suggested strategy='vmap', which cannot batch the layer)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import torch_vjp as tv

D = torch.float64


class _Packed(nn.Module):
    def __init__(self, cls, batch_first, **kw):
        super().__init__()
        self.r = cls(3, 4, batch_first=batch_first, **kw)
        self.batch_first = batch_first
        out = (kw.get("proj_size") or 4) * (2 if kw.get("bidirectional") else 1)
        self.l = nn.Linear(out, 2)

    def forward(self, x, lengths):
        xx = x if self.batch_first else x.transpose(0, 1)
        p = pack_padded_sequence(xx, lengths, batch_first=self.batch_first,
                                 enforce_sorted=False)
        y, _ = pad_packed_sequence(self.r(p)[0], batch_first=self.batch_first,
                                   total_length=x.shape[1])
        if not self.batch_first:
            y = y.transpose(0, 1)
        return self.l(y.sum(1))


CASES = {
    "lstm-proj-bi": lambda: _Packed(nn.LSTM, True, proj_size=2, bidirectional=True),
    "gru-2-layers-seq-first": lambda: _Packed(nn.GRU, False, num_layers=2),
    "rnn": lambda: _Packed(nn.RNN, True),
}


def _case(name):
    torch.manual_seed(0)
    model = CASES[name]().to(D)
    x, lengths = torch.randn(1, 5, 3, dtype=D), torch.tensor([4])
    with torch.no_grad():
        y = torch.randn_like(model(x, lengths))
    return model, (x, lengths), y


@pytest.mark.parametrize("name", list(CASES))
def test_auto_computes_a_packed_batch_of_one(name):
    model, xs, y = _case(name)
    loss = nn.MSELoss()
    params = list(model.parameters())
    want = torch.autograd.grad(loss(model(*xs), y), params)
    got = tv.per_sample_grads(model, loss, xs, y)
    for (n, _), w in zip(model.named_parameters(), want):
        torch.testing.assert_close(got[n][0], w)
    norm = torch.cat([w.flatten() for w in want]).norm()
    torch.testing.assert_close(tv.per_sample_grad_norms(model, loss, xs, y)[0], norm)
    tv.accumulate_clipped_grads(model, loss, xs, y, max_norm=0.01)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w * min(1.0, 0.01 / float(norm)))


@pytest.mark.parametrize("name", list(CASES))
def test_hooks_refuses_a_packed_batch_of_one_saying_what_runs(name):
    model, xs, y = _case(name)
    with pytest.raises(tv.StrategyError) as info:
        tv.per_sample_grads(model, nn.MSELoss(), xs, y, strategy="hooks")
    msg = str(info.value)
    assert "'r.weight_ih_l0'" in msg  # what
    assert "called with a PackedSequence" in msg and "packed sequences" in msg  # why
    assert "strategy='auto'" in msg and "strategy='loop'" in msg  # the fix
    assert "strategy='vmap'" not in msg  # (vmap cannot batch torch's recurrent layers)
