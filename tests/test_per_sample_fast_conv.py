"""A 2-D convolution's direct norms by the channels-last patches' product or by grouped
convolutions (NOTE [two ways to a convolution's per-sample gradients] in
``torch_vjp/_per_sample/rules/conv.py``): both ways against the per-example loop in float64,
for the norms and the clipped step, with the per-sample gradients kept or not; the choice
measured on the first calls of each layer shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv
from torch_vjp._per_sample import factors, run
from torch_vjp._per_sample.rules import conv

from _references import per_example_grads

DT = torch.float64
loss_fn = nn.CrossEntropyLoss()


class Net(nn.Module):
    def __init__(self, layers, x):
        super().__init__()
        self.body = nn.Sequential(*layers).to(x.dtype)
        with torch.no_grad():
            width = self.body(x[:1]).flatten(1).shape[1]
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)).flatten(1))


def _layers(kind):
    if kind == "stride-padding-dilation":
        return [nn.Conv2d(3, 5, 5, padding=2), nn.Tanh(),
                nn.Conv2d(5, 4, (3, 5), stride=(2, 1), padding=(1, 2), dilation=(1, 2))]
    if kind == "no-bias-rectangular":
        return [nn.Conv2d(5, 6, (5, 3), stride=(1, 2), bias=False)]
    if kind == "padding-modes":
        return [nn.Conv2d(3, 4, 5, padding="same", padding_mode="reflect"),
                nn.Conv2d(4, 3, 5, padding="same")]
    if kind == "conv1d":  # (a 2-D convolution of height 1)
        return [nn.Conv1d(8, 6, 9, stride=2, padding=3)]
    raise ValueError(kind)


def make(kind):
    torch.manual_seed(0)
    shape = (6, 8, 20) if kind == "conv1d" else (6, 3 if kind != "no-bias-rectangular" else 5,
                                                  11, 12)
    x = torch.randn(*shape, dtype=DT)
    model = Net(_layers(kind), x).to(DT)
    t = torch.randint(0, 3, (shape[0],))
    return model, x, t


def loop_reference(model, x, t):
    return per_example_grads(model, loss_fn, x, t)


@pytest.fixture
def forced(monkeypatch):
    """Sets the way every eligible layer takes; returns the keys of the layers that took
    the choice."""
    seen = []

    def force(patches):
        def choice(self, chunk_size):
            key = self._patches_key(chunk_size)
            if key is None:
                return False
            seen.append(key)
            return patches
        monkeypatch.setattr(conv.ConvFactor, "_patches_choice", choice)
        return seen

    return force


KINDS = ["stride-padding-dilation", "no-bias-rectangular", "padding-modes", "conv1d"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("patches", [True, False], ids=["patches", "grouped"])
@pytest.mark.parametrize("keep", ["kept", "nothing-kept"])
def test_norms_and_clipped_sums_against_the_loop(kind, patches, keep, forced, monkeypatch):
    model, x, t = make(kind)
    ref = loop_reference(model, x, t)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    seen = forced(patches)
    if keep == "nothing-kept":
        monkeypatch.setattr(run, "KEEP_ELEMENTS", 0)
    got = tv.per_sample_grad_norms(model, loss_fn, x, t, strategy="hooks")
    torch.testing.assert_close(got, norms, rtol=1e-10, atol=1e-12)
    assert seen, "no layer took the choice"
    max_norm = norms.median().item()
    c = (max_norm / norms).clamp(max=1.0)
    assert (c < 1).any() and (c == 1).any()
    model.zero_grad(set_to_none=True)
    got = tv.accumulate_clipped_grads(model, loss_fn, x, t, max_norm=max_norm,
                                      strategy="hooks")
    torch.testing.assert_close(got, norms, rtol=1e-10, atol=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, ref[n]),
                                   rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("patches", [True, False], ids=["patches", "grouped"])
def test_chunked(patches, forced, monkeypatch):
    # budgets of a few elements: the patches and the per-sample gradients in chunks of
    # one or two examples, each chunk kept as it is for the clipped sum
    monkeypatch.setattr(factors, "NORM_CHUNK_ELEMENTS", 64)
    monkeypatch.setattr(conv, "NORM_CHUNK_ELEMENTS", 64)
    forced(patches)
    model, x, t = make("stride-padding-dilation")
    ref = loop_reference(model, x, t)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    max_norm = norms.median().item()
    c = (max_norm / norms).clamp(max=1.0)
    got = tv.accumulate_clipped_grads(model, loss_fn, x, t, max_norm=max_norm,
                                      strategy="hooks")
    torch.testing.assert_close(got, norms, rtol=1e-10, atol=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, ref[n]),
                                   rtol=1e-10, atol=1e-12, msg=n)


def test_clipped_step_sums_the_kept_channels_last_gradients(forced, monkeypatch):
    # the kept per-sample gradients give the sum: no second weight gradient
    def forbidden(self, c):
        raise AssertionError("the weight gradient was computed again")

    forced(True)
    monkeypatch.setattr(conv.ConvFactor, "weighted_sum", forbidden)
    model, x, t = make("no-bias-rectangular")
    ref = loop_reference(model, x, t)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    c = (norms.median() / norms).clamp(max=1.0)
    tv.accumulate_clipped_grads(model, loss_fn, x, t, max_norm=norms.median().item(),
                                strategy="hooks")
    w = model.body[0].weight
    torch.testing.assert_close(w.grad, torch.einsum("b,b...->...", c, ref["body.0.weight"]),
                               rtol=1e-10, atol=1e-12)


def test_the_choice_is_measured_on_the_first_calls_of_each_layer_shape(monkeypatch):
    monkeypatch.setattr(conv, "PATCHES_FASTER", {})
    monkeypatch.setattr(conv, "_PATCHES_TIMES", {})
    measured = []
    measure = conv.ConvFactor._measure

    def spy(self, chunk_size):
        measured.append(self._patches_key(chunk_size))
        return measure(self, chunk_size)

    monkeypatch.setattr(conv.ConvFactor, "_measure", spy)
    model, x, t = make("stride-padding-dilation")
    ref = loop_reference(model, x, t)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    calls = conv._PATCHES_CALLS + 2
    for _ in range(calls):
        got = tv.per_sample_grad_norms(model, loss_fn, x, t, strategy="hooks")
        torch.testing.assert_close(got, norms, rtol=1e-10, atol=1e-12)
    # two layers of their own shapes: each measured on the first calls (the plan's first
    # call computes twice, the second time to check), then its choice recorded and used
    assert len(set(measured)) == 2
    assert all(measured.count(k) == conv._PATCHES_CALLS for k in set(measured))
    assert set(conv.PATCHES_FASTER) == set(measured)
    assert conv._PATCHES_TIMES == {}
    assert all(isinstance(v, bool) for v in conv.PATCHES_FASTER.values())


@pytest.mark.parametrize("layer,shape", [
    (lambda: nn.Conv2d(4, 6, 5, groups=2), (5, 4, 9, 9)),  # groups
    (lambda: nn.Conv2d(2, 6, 5), (5, 2, 9, 9)),  # short patches: unfold already
    (lambda: nn.Conv3d(4, 6, 3), (5, 4, 6, 6, 6)),  # 3-D
], ids=["groups", "short-patches", "conv3d"])
def test_no_choice_where_the_patches_product_does_not_apply(layer, shape, monkeypatch):
    monkeypatch.setattr(conv, "PATCHES_FASTER", {})
    monkeypatch.setattr(conv, "_PATCHES_TIMES", {})
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=DT)
    model = Net([layer()], x).to(DT)
    t = torch.randint(0, 3, (shape[0],))
    ref = loop_reference(model, x, t)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    got = tv.per_sample_grad_norms(model, loss_fn, x, t, strategy="hooks")
    torch.testing.assert_close(got, norms, rtol=1e-10, atol=1e-12)
    assert conv.PATCHES_FASTER == {} and conv._PATCHES_TIMES == {}


def test_patches_last_against_unfold():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 9, 10, dtype=DT, generator=gen)
    kernel, dilation, padding, stride = (3, 2), (2, 1), (1, 2), (2, 3)
    got = conv.patches_last(x, kernel, dilation, padding, stride)
    ref = torch.nn.functional.unfold(x, kernel, dilation, padding, stride)  # (B, C k, L)
    B, _, L = ref.shape
    ref = ref.view(B, 4, *kernel, L).permute(0, 4, 2, 3, 1).reshape(B, L, -1)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
