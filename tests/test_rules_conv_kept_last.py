"""A 2-D convolution's clipped sum from its kept channels-last per-sample gradients
(ConvFactor.kept_sum, the patches' way of NOTE [two ways to a convolution's per-sample
gradients]), taken chunk by chunk: against the per-example loop in float64, for a
channels_last input and a contiguous one, in one chunk and in several of uneven size, and
bit for bit the sum tensordot gave chunk by chunk."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv
from torch_vjp._per_sample import factors
from torch_vjp._per_sample.rules import conv

from _references import per_example_grads

DT = torch.float64
loss_fn = nn.CrossEntropyLoss()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(6, 5, (3, 4), stride=(1, 2), padding=1)
        self.head = nn.Linear(5 * 7 * 4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(1))


@pytest.fixture
def patches_kept(monkeypatch):
    """Every eligible convolution takes the patches' way; its kept chunks and sums are
    recorded, and the second weight gradient is forbidden (the kept chunks give it)."""
    seen = {"chunks": [], "sums": []}

    def choice(self, chunk_size):
        return self._patches_key(chunk_size) is not None

    def forbidden(self, c):
        raise AssertionError("the weight gradient was computed again")

    kept_sum = conv.ConvFactor.kept_sum

    def spy(self, c):
        out = kept_sum(self, c)
        if self.kept_last:
            seen["chunks"].append([(s, e) for s, e, _ in self.kept])
            seen["sums"].append((out, [(s, e, G.clone()) for s, e, G in self.kept], c,
                                 self.weight_shape))
        return out

    monkeypatch.setattr(conv.ConvFactor, "_patches_choice", choice)
    monkeypatch.setattr(conv.ConvFactor, "weighted_sum", forbidden)
    monkeypatch.setattr(conv.ConvFactor, "kept_sum", spy)
    return seen


@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
@pytest.mark.parametrize("step", [None, 3], ids=["one-chunk", "chunks-3-3-1"])
def test_kept_channels_last_sum_matches_the_loop(patches_kept, monkeypatch, layout, step):
    if step is not None:
        monkeypatch.setattr(conv, "chunks", lambda batch, per, size=None, budget=None:
                            factors.chunks(batch, per, step, budget))
    torch.manual_seed(0)
    model = Net().to(DT)
    x = torch.randn(7, 6, 7, 9, dtype=DT)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    t = torch.randint(0, 3, (7,))
    before = x.clone()
    ref = per_example_grads(model, loss_fn, x, t)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    max_norm = norms.median().item()
    c = (max_norm / norms).clamp(max=1.0)
    model.zero_grad(set_to_none=True)
    got = tv.accumulate_clipped_grads(model, loss_fn, x, t, max_norm=max_norm,
                                      strategy="hooks")
    torch.testing.assert_close(got, norms, rtol=1e-10, atol=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, ref[n]),
                                   rtol=1e-10, atol=1e-12, msg=n)
    assert torch.equal(x, before)
    # the kept path ran, in the chunks asked for
    want = [(0, 7)] if step is None else [(0, 3), (3, 6), (6, 7)]
    assert patches_kept["chunks"] == [want]
    # bit for bit tensordot's sum, chunk by chunk
    (out, kept, cc, (O, C, kh, kw)), = patches_kept["sums"]
    total = None
    for s, e, G in kept:
        w = torch.tensordot(cc[s:e].to(G.dtype), G, dims=1)
        total = w if total is None else total.add_(w)
    old = total.view(O, kh, kw, C).permute(0, 3, 1, 2).contiguous()
    assert torch.equal(out.view(O, C, kh, kw), old)
