"""The measurement that chooses between a 2-D convolution's two ways to its per-sample
gradients (NOTE [two ways to a convolution's per-sample gradients] in
``torch_vjp/_per_sample/rules/conv.py``): each way is timed on the whole batch, every chunk
of it, and the measured calls' results (norms, and the clipped sums from the gradients the
measurement kept) agree with the per-example loop in float64, whichever way ran last."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv
from torch_vjp._per_sample.rules import conv

from _references import per_example_grads

DT = torch.float64
loss_fn = nn.CrossEntropyLoss()


def make():
    torch.manual_seed(0)
    x = torch.randn(7, 3, 11, 12, dtype=DT)
    model = nn.Sequential(nn.Conv2d(3, 5, 5), nn.Tanh(), nn.Flatten(),
                          nn.Linear(5 * 7 * 8, 3)).to(DT)
    t = torch.randint(0, 3, (7,))
    return model, x, t


def loop_reference(model, x, t):
    return per_example_grads(model, loss_fn, x, t)


@pytest.fixture
def measured(monkeypatch):
    """The chunks each way computed during the measured calls: one list per call of
    ``_measure``, of ``(way, start, stop)``."""
    monkeypatch.setattr(conv, "PATCHES_FASTER", {})
    monkeypatch.setattr(conv, "_PATCHES_TIMES", {})
    # (chunks of two examples for the grouped convolution, whose temporary is an example's
    # 5 x 3 x 5 x 5 gradient, and of one for the product: the batch takes several of each)
    monkeypatch.setattr(conv, "NORM_CHUNK_ELEMENTS", 2 * 5 * 3 * 5 * 5)
    calls: list[list[tuple[str, int, int]]] = []
    inside = []
    measure = conv.ConvFactor._measure
    grouped, patches = conv.ConvFactor._per_sample, conv.ConvFactor._per_sample_last

    def spy_measure(self, chunk_size):
        calls.append([])
        inside.append(True)
        try:
            return measure(self, chunk_size)
        finally:
            inside.pop()

    def spy(way, fn):
        def run(self, s, e):
            if inside:
                calls[-1].append((way, s, e))
            return fn(self, s, e)
        return run

    monkeypatch.setattr(conv.ConvFactor, "_measure", spy_measure)
    monkeypatch.setattr(conv.ConvFactor, "_per_sample", spy("grouped", grouped))
    monkeypatch.setattr(conv.ConvFactor, "_per_sample_last", spy("patches", patches))
    return calls


def _covers(ranges, batch):
    """Whether the ranges, in order, are the chunks of the whole batch (more than one)."""
    ranges = sorted(ranges)
    return (len(ranges) > 1 and ranges[0][0] == 0 and ranges[-1][1] == batch
            and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])))


def test_each_way_is_timed_on_every_chunk_of_the_batch(measured):
    model, x, t = make()
    ref = loop_reference(model, x, t)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    for _ in range(conv._PATCHES_CALLS + 1):
        got = tv.per_sample_grad_norms(model, loss_fn, x, t, strategy="hooks")
        torch.testing.assert_close(got, norms, rtol=1e-10, atol=1e-12)
    assert len(measured) == conv._PATCHES_CALLS
    for call in measured:
        for way in ("grouped", "patches"):
            assert _covers([(s, e) for w, s, e in call if w == way], x.shape[0]), (way, call)
    # the order of the two ways alternates from call to call
    assert [call[0][0] for call in measured[:2]] == ["grouped", "patches"]
    assert conv._PATCHES_TIMES == {} and len(conv.PATCHES_FASTER) == 1


def test_the_clipped_sum_of_a_measured_call_uses_what_the_second_way_kept(measured):
    model, x, t = make()
    ref = loop_reference(model, x, t)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    max_norm = norms.median().item()
    c = (max_norm / norms).clamp(max=1.0)
    for _ in range(conv._PATCHES_CALLS):
        model.zero_grad(set_to_none=True)
        tv.accumulate_clipped_grads(model, loss_fn, x, t, max_norm=max_norm,
                                    strategy="hooks")
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, ref[n]),
                                       rtol=1e-10, atol=1e-12)
    assert len(measured) == conv._PATCHES_CALLS
    # (both orders ran: the kept gradients came from either way)
    assert {call[-1][0] for call in measured} == {"grouped", "patches"}
