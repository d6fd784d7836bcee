"""The convolution rules (Conv3d, ConvTranspose1d/2d/3d) against a per-example loop (float64).

Every case runs under ``strategy="hooks"``, which raises if a parameter has no rule, so a
passing case shows the rule was used; the plan must also say "rule" for the layer's
parameters. Each case names the paths of :class:`ConvFactor` it takes (per-sample gradients
by unfold + bmm or by one grouped convolution; squared norms by the ghost identity or
directly), and the table covers each path for each family of layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_vjp as tv
from torch_vjp._per_sample import factors, run
from torch_vjp._per_sample.rules import conv

DT = torch.float64


@dataclass
class Case:
    """A layer, the input shape it is called on, and the paths its factor takes."""

    layer: Callable[[], nn.Module]
    shape: tuple[int, ...]
    paths: tuple[str, str]  # (per-sample: "unfold" | "grouped", norms: "ghost" | "direct")
    prep: Callable[[torch.Tensor], torch.Tensor] | None = None  # makes the input
    post: Callable[[torch.Tensor], torch.Tensor] | None = None  # applied to the output
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the layer's forward


def channels_last_3d(x):
    return x.contiguous(memory_format=torch.channels_last_3d)


def batch_in_middle(x):
    """A non-contiguous input: the batch laid out in memory as the second dimension."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


def swap_last(y):
    """Makes the layer's output gradient non-contiguous."""
    return y.transpose(-1, -2)


CASES = {
    # Conv3d ---------------------------------------------------------------------------
    "conv3d-basic": Case(lambda: nn.Conv3d(2, 3, 2), (4, 2, 3, 4, 3), ("unfold", "direct")),
    "conv3d-stride-padding-dilation-tuples": Case(
        lambda: nn.Conv3d(2, 4, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 2),
                          dilation=(2, 1, 1)),
        (3, 2, 4, 5, 3), ("unfold", "direct")),
    "conv3d-groups-no-bias": Case(
        lambda: nn.Conv3d(4, 6, (1, 2, 2), groups=2, bias=False), (3, 4, 2, 3, 3),
        ("unfold", "direct")),
    "conv3d-same-even-kernel-reflect": Case(
        lambda: nn.Conv3d(2, 3, (3, 2, 3), padding="same", padding_mode="reflect"),
        (3, 2, 3, 4, 3), ("unfold", "direct")),
    "conv3d-valid-stride": Case(
        lambda: nn.Conv3d(2, 3, 2, padding="valid", stride=2), (3, 2, 4, 5, 4),
        ("unfold", "direct")),
    "conv3d-replicate-padding": Case(
        lambda: nn.Conv3d(2, 3, (2, 3, 3), padding=(1, 2, 1), padding_mode="replicate"),
        (3, 2, 2, 3, 3), ("unfold", "direct")),
    "conv3d-depthwise-circular": Case(
        lambda: nn.Conv3d(4, 4, 3, padding=1, padding_mode="circular", groups=4),
        (3, 4, 3, 3, 4), ("unfold", "direct")),
    "conv3d-long-patch-grouped": Case(
        lambda: nn.Conv3d(8, 4, 3, padding=1), (3, 8, 2, 3, 3), ("grouped", "direct")),
    "conv3d-ghost-norms-groups": Case(
        lambda: nn.Conv3d(16, 32, 3, groups=2), (3, 16, 3, 3, 4), ("grouped", "ghost")),
    "conv3d-channels-last-input": Case(
        lambda: nn.Conv3d(3, 4, 2, stride=(1, 2, 1)), (3, 3, 3, 4, 3), ("unfold", "direct"),
        prep=channels_last_3d),
    "conv3d-batch-of-one": Case(
        lambda: nn.Conv3d(2, 3, 2, padding=1), (1, 2, 2, 3, 2), ("unfold", "direct")),
    # ConvTranspose1d ------------------------------------------------------------------
    "convT1d-basic": Case(lambda: nn.ConvTranspose1d(3, 4, 3), (4, 3, 5), ("unfold", "direct")),
    "convT1d-stride-padding-output-padding": Case(
        lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1),
        (3, 3, 5), ("unfold", "direct")),
    # output_padding >= stride (allowed below the dilation): g is padded unevenly
    "convT1d-output-padding-beyond-stride": Case(
        lambda: nn.ConvTranspose1d(2, 3, 3, stride=2, dilation=4, padding=2,
                                   output_padding=3),
        (3, 2, 5), ("unfold", "direct")),
    "convT1d-groups-no-bias": Case(
        lambda: nn.ConvTranspose1d(4, 6, 2, stride=3, groups=2, bias=False), (3, 4, 4),
        ("unfold", "direct")),
    "convT1d-output-size-keyword": Case(
        lambda: nn.ConvTranspose1d(2, 3, 3, stride=3, padding=1), (3, 2, 4),
        ("unfold", "direct"), kwargs={"output_size": [12]}),
    "convT1d-long-patch-grouped": Case(
        lambda: nn.ConvTranspose1d(3, 40, 2, stride=2), (3, 3, 4), ("grouped", "direct")),
    # ConvTranspose2d ------------------------------------------------------------------
    "convT2d-tuples": Case(
        lambda: nn.ConvTranspose2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 0)),
        (3, 4, 3, 4), ("unfold", "direct")),
    "convT2d-groups-dilation-output-padding": Case(
        lambda: nn.ConvTranspose2d(4, 6, 2, stride=2, dilation=(2, 1), output_padding=(1, 0),
                                   groups=2),
        (3, 4, 3, 3), ("unfold", "direct")),
    "convT2d-long-patch-grouped": Case(
        lambda: nn.ConvTranspose2d(6, 16, 3, stride=2, padding=1), (3, 6, 3, 3),
        ("grouped", "direct")),
    "convT2d-ghost-norms": Case(
        lambda: nn.ConvTranspose2d(32, 16, 3), (3, 32, 2, 1), ("grouped", "ghost")),
    "convT2d-non-contiguous-input-and-grad": Case(
        lambda: nn.ConvTranspose2d(3, 4, 2, stride=2), (3, 3, 2, 3), ("unfold", "direct"),
        prep=batch_in_middle, post=swap_last),
    "convT2d-batch-of-one": Case(
        lambda: nn.ConvTranspose2d(2, 3, 3, stride=2, output_padding=1), (1, 2, 2, 3),
        ("unfold", "direct")),
    # ConvTranspose3d ------------------------------------------------------------------
    "convT3d-dilation-output-padding": Case(
        lambda: nn.ConvTranspose3d(2, 4, 2, stride=2, output_padding=1, dilation=2),
        (3, 2, 2, 2, 3), ("unfold", "direct")),
    "convT3d-groups-tuples-no-bias": Case(
        lambda: nn.ConvTranspose3d(4, 4, (2, 3, 2), stride=(2, 1, 2), padding=(1, 1, 0),
                                   groups=2, bias=False),
        (3, 4, 2, 3, 2), ("unfold", "direct")),
}


class Net(nn.Module):
    """The layer alone (with forward keywords, and an optional view of its output)."""

    def __init__(self, case: Case):
        super().__init__()
        self.layer = case.layer()
        self.kwargs = case.kwargs
        self.post = case.post

    def forward(self, x):
        y = self.layer(x, **self.kwargs)
        return y if self.post is None else self.post(y)


def loss_fn(out, t):
    return F.mse_loss(torch.tanh(out), t)


def make(name):
    case = CASES[name]
    torch.manual_seed(0)
    model = Net(case).to(DT)
    x = torch.randn(case.shape, dtype=DT)
    if case.prep is not None:
        x = case.prep(x)
    with torch.no_grad():
        t = torch.randn_like(model(x), memory_format=torch.contiguous_format)
    return model, x, t


def loop_reference(model, x, t):
    """Per-example gradients by definition: one forward and backward per example."""
    names = [n for n, _ in model.named_parameters()]
    rows = []
    for i in range(x.shape[0]):
        loss = loss_fn(model(x[i : i + 1]), t[i : i + 1])
        rows.append(torch.autograd.grad(loss, list(model.parameters())))
    return {n: torch.stack(r) for n, r in zip(names, zip(*rows))}


def ref_norms(ref):
    return torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)


def check_against_loop(model, x, t, chunk_size=None):
    ref = loop_reference(model, x, t)
    got = tv.per_sample_grads(model, loss_fn, x, t, strategy="hooks", chunk_size=chunk_size)
    assert list(got) == list(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)
    norms = ref_norms(ref)
    torch.testing.assert_close(
        tv.per_sample_grad_norms(model, loss_fn, x, t, strategy="hooks"), norms)
    # some examples clipped, some not (all of them with a batch of one)
    max_norm = float(norms.median()) * (0.5 if x.shape[0] == 1 else 1.0)
    c = (max_norm / norms).clamp(max=1.0)
    assert (c < 1).any()
    model.zero_grad(set_to_none=True)
    got_norms = tv.accumulate_clipped_grads(model, loss_fn, x, t, max_norm=max_norm,
                                            strategy="hooks")
    torch.testing.assert_close(got_norms, norms)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, ref[n]), msg=n)


@pytest.fixture
def paths_taken(monkeypatch):
    """The ``(per-sample, norms)`` paths of every ConvFactor made while the test runs."""
    taken = set()
    init = conv.ConvFactor.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        taken.add(("unfold" if self._unfolds() else "grouped",
                   "ghost" if self._ghost_cheaper() else "direct"))

    monkeypatch.setattr(conv.ConvFactor, "__init__", spy)
    return taken


@pytest.mark.parametrize("name", list(CASES))
def test_matches_loop(name, paths_taken):
    model, x, t = make(name)
    check_against_loop(model, x, t)
    assert paths_taken == {CASES[name].paths}
    plan = tv.per_sample_plan(model, loss_fn, x, t, strategy="hooks")
    kind = "ConvTranspose" if "Transpose" in type(model.layer).__name__ else "Conv"
    for n, _ in model.named_parameters():
        assert plan[n].method == "rule", str(plan)
        assert plan[n].how == f"{kind} rule in 'layer'", str(plan)


@pytest.mark.parametrize("keep", [0, 1], ids=["nothing-kept", "partly-kept"])
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.paths[1] == "direct"])
def test_clipped_sums_whether_or_not_per_sample_gradients_are_kept(name, keep, monkeypatch):
    # The direct norms form per-sample gradients; the clipped step keeps them within a
    # budget (its sum is then c @ G) and otherwise computes one weight gradient with the
    # output gradient scaled. Budget 0 keeps nothing, one example's worth less than the
    # weight keeps the bias alone where there is one.
    model, x, t = make(name)
    budget = 0 if keep == 0 else x.shape[0] * model.layer.weight.numel() - 1
    monkeypatch.setattr(run, "KEEP_ELEMENTS", budget)
    check_against_loop(model, x, t)


def test_clipped_step_sums_kept_per_sample_gradients_without_a_second_weight_gradient(
        monkeypatch):
    def forbidden(self, c):
        raise AssertionError("the weight gradient was computed again")

    model, x, t = make(next(n for n, c in CASES.items() if c.paths[1] == "direct"))
    monkeypatch.setattr(conv.ConvFactor, "weighted_sum", forbidden)
    check_against_loop(model, x, t)


def test_cases_cover_every_path_of_every_family():
    for family in ("conv3d", "convT"):
        got = {c.paths for n, c in CASES.items() if n.startswith(family)}
        assert {p for p, _ in got} == {"unfold", "grouped"}, family
        assert {q for _, q in got} == {"ghost", "direct"}, family


@pytest.mark.parametrize("name", [
    "conv3d-groups-no-bias", "conv3d-long-patch-grouped", "conv3d-ghost-norms-groups",
    "convT1d-output-padding-beyond-stride", "convT2d-long-patch-grouped",
    "convT2d-ghost-norms", "convT2d-non-contiguous-input-and-grad",
    "convT3d-groups-tuples-no-bias",
])
def test_chunked(name, monkeypatch):
    # Budgets of a few elements: every temporary (unfolded inputs, per-sample gradients,
    # ghost Gram matrices, scaled gradients) is split into chunks of examples.
    monkeypatch.setattr(factors, "CHUNK_ELEMENTS", 64)
    monkeypatch.setattr(factors, "NORM_CHUNK_ELEMENTS", 64)
    monkeypatch.setattr(conv, "NORM_CHUNK_ELEMENTS", 64)
    model, x, t = make(name)
    check_against_loop(model, x, t, chunk_size=2)


@pytest.mark.parametrize("name", ["conv3d-ghost-norms-groups", "convT2d-ghost-norms"])
def test_norms_and_clipped_sums_form_no_per_sample_gradient(name, monkeypatch):
    def forbidden(self, s, e):
        raise AssertionError("per-sample gradients formed")

    model, x, t = make(name)
    ref = loop_reference(model, x, t)
    monkeypatch.setattr(conv.ConvFactor, "_per_sample", forbidden)
    norms = tv.accumulate_clipped_grads(model, loss_fn, x, t, max_norm=1e-3, strategy="hooks")
    torch.testing.assert_close(norms, ref_norms(ref))


class Folded(nn.Module):
    """Calls its layer on rows of its own: the one example split in two (``(1, 2 C, *S) ->
    (2, C, *S)``), or unbatched (``(1, C, *S) -> (C, *S)``)."""

    def __init__(self, layer, split):
        super().__init__()
        self.layer, self.split = layer, split

    def forward(self, x):
        if self.split:
            y = self.layer(x.reshape(2, x.shape[1] // 2, *x.shape[2:]))
            return y.reshape(1, -1)
        return self.layer(x[0]).unsqueeze(0)


@pytest.mark.parametrize("split", [True, False], ids=["rows-of-its-own", "unbatched"])
@pytest.mark.parametrize("layer,shape", [
    (lambda: nn.Conv2d(2, 3, 2, padding=1), (1, 2, 3, 3)),
    (lambda: nn.Conv3d(2, 3, 2, groups=1), (1, 2, 2, 3, 2)),
    (lambda: nn.ConvTranspose1d(2, 4, 3, stride=2, groups=2), (1, 2, 3)),
    (lambda: nn.ConvTranspose2d(2, 3, 2, stride=2, output_padding=1, dilation=2), (1, 2, 2, 3)),
], ids=["conv2d", "conv3d", "convT1d", "convT2d"])
def test_batch_of_one_whose_layer_sees_other_rows(layer, shape, split):
    # With one example, everything the layer sees is that example's, whatever its own batch.
    torch.manual_seed(0)
    lay = layer()
    shape = (1, 2 * shape[1], *shape[2:]) if split else shape
    model = Folded(lay, split).to(DT)
    x = torch.randn(shape, dtype=DT)
    with torch.no_grad():
        t = torch.randn_like(model(x))
    check_against_loop(model, x, t)
    plan = tv.per_sample_plan(model, loss_fn, x, t, strategy="hooks")
    assert all(r.method == "rule" for r in plan.rows), str(plan)


def _random_layer(rng, family):
    """A random configuration of a layer of ``family`` and an input shape it accepts."""
    r = rng.randint
    dims = {"conv3d": 3, "convT1d": 1, "convT2d": 2, "convT3d": 3}[family]
    groups = r(1, 2)
    cin, cout = groups * r(1, 3), groups * r(1, 3)
    k = tuple(r(1, 3) for _ in range(dims))
    s = tuple(r(1, 3) for _ in range(dims))
    d = tuple(r(1, 2) for _ in range(dims))
    spatial = tuple(r(2, 4) + d_ * (k_ - 1) for k_, d_ in zip(k, d))
    bias = bool(r(0, 1))
    if family == "conv3d":
        p = tuple(r(0, 2) for _ in range(dims))
        mode = ("zeros", "reflect", "replicate", "circular")[r(0, 3)]
        if mode == "reflect":  # reflection needs padding below the size
            p = tuple(min(p_, n - 1) for p_, n in zip(p, spatial))
        layer = nn.Conv3d(cin, cout, k, stride=s, padding=p, dilation=d, groups=groups,
                          bias=bias, padding_mode=mode)
    else:
        p = tuple(r(0, d_ * (k_ - 1)) for k_, d_ in zip(k, d))
        op = tuple(r(0, max(s_, d_) - 1) for s_, d_ in zip(s, d))
        cls = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[dims]
        layer = cls(cin, cout, k, stride=s, padding=p, output_padding=op, dilation=d,
                    groups=groups, bias=bias)
    return layer, (r(1, 3), cin, *spatial)


@pytest.mark.parametrize("family", ["conv3d", "convT1d", "convT2d", "convT3d"])
def test_random_configurations(family):
    # Seeded random strides, paddings, dilations, output paddings, groups and modes: the
    # per-sample gradients and norms against the loop.
    rng = random.Random(family)
    for _ in range(12):
        torch.manual_seed(0)
        layer, shape = _random_layer(rng, family)
        model = nn.Sequential(layer).to(DT)
        x = torch.randn(shape, dtype=DT)
        with torch.no_grad():
            t = torch.randn_like(model(x))
        ref = loop_reference(model, x, t)
        got = tv.per_sample_grads(model, loss_fn, x, t, strategy="hooks")
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], msg=f"{layer}: {n}")
        torch.testing.assert_close(
            tv.per_sample_grad_norms(model, loss_fn, x, t, strategy="hooks"), ref_norms(ref),
            msg=str(layer))
