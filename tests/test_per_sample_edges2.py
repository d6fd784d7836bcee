"""Edge cases of the per-sample functions: unusual strides of an input, loss settings the
plan's key must tell apart, optional inputs, and other cases once refused or mishandled.
Every result is compared in float64 with the definition, one example at a time
(``torch.autograd.grad`` of ``loss_fn(model(x[i:i+1]), t[i:i+1])``)."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_vjp as tv

DT = torch.float64


def loop_reference(model, loss_fn, inputs, targets=None):
    """The definition: one forward and backward per example (a None input passed as is)."""
    xs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out = {n: [] for n, _ in named}
    for i in range(next(x for x in xs if x is not None).shape[0]):
        o = model(*(x if x is None else x[i:i + 1] for x in xs))
        loss = loss_fn(o) if targets is None else loss_fn(o, targets[i:i + 1])
        gs = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        for (n, p), g in zip(named, gs):
            out[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(v) for n, v in out.items()}


def assert_matches(got, ref):
    assert list(got) == list(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-10, atol=1e-12, msg=n)


def norms_of(ref):
    return sum(g.flatten(1).pow(2).sum(1) for g in ref.values()).sqrt()


# ------------------------------------------------------------------------------------------
# An input whose examples have the strides of a transposed tensor
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["vmap", "auto"])
@pytest.mark.parametrize("conv", ["1d", "2d"])
def test_a_conv_input_of_length_one_transposed_is_batched_by_vmap(strategy, conv):
    # (B, 1, C) transposed to (B, C, 1): "contiguous" to torch, its size-one dimension's
    # stride is C; vmap's backward of the convolution refused it, and the weight, computed
    # by a parametrization (no rule), went to vmap under "auto"
    torch.manual_seed(0)
    if conv == "1d":
        model = nn.Conv1d(3, 4, 3, padding=1).to(DT)
        x = torch.randn(5, 1, 3, dtype=DT).transpose(1, 2)
    else:
        model = nn.Conv2d(3, 4, 3, padding=1).to(DT)
        x = torch.randn(5, 1, 1, 3, dtype=DT).permute(0, 3, 1, 2)
    if strategy == "auto":
        torch.nn.utils.parametrizations.weight_norm(model)
    loss_fn = lambda o: o.pow(2).sum()  # noqa: E731
    ref = loop_reference(model, loss_fn, x)
    got = tv.per_sample_grads(model, loss_fn, x, strategy=strategy)
    assert_matches(got, ref)
    norms = tv.per_sample_grad_norms(model, loss_fn, x, strategy=strategy)
    torch.testing.assert_close(norms, norms_of(ref), rtol=1e-10, atol=1e-12)
    if strategy == "auto":  # (vmap, not the loop it fell back to)
        plan = tv.per_sample_plan(model, loss_fn, x)
        assert {r.method for r in plan if r.name != "bias"} == {"vmap"}, str(plan)


class _ToConv(nn.Module):
    """A Linear over (B, T, C) and a Conv1d over its transpose, (B, C, T)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.conv = nn.Conv1d(4, 5, 3, padding=1)

    def forward(self, x):
        return self.conv(self.lin(x).transpose(1, 2)).sum(-1)


@pytest.mark.parametrize("strategy", ["vmap", "auto"])
def test_a_conv_input_the_model_transposes_to_length_one_is_batched_by_vmap(strategy):
    # (the model makes the (B, C, 1) input with a size-one dimension of stride C itself:
    # vmap's backward of the convolution refused it)
    torch.manual_seed(0)
    model = _ToConv().to(DT)
    if strategy == "auto":
        torch.nn.utils.parametrizations.weight_norm(model.conv)
    x = torch.randn(5, 1, 3, dtype=DT)
    loss_fn = lambda o: o.pow(2).sum()  # noqa: E731
    ref = loop_reference(model, loss_fn, x)
    got = tv.per_sample_grads(model, loss_fn, x, strategy=strategy)
    assert_matches(got, ref)
    if strategy == "auto":  # (vmap, not the loop it fell back to)
        plan = tv.per_sample_plan(model, loss_fn, x)
        assert {r.method for r in plan if "parametrizations" in r.name} == {"vmap"}, str(plan)


# ------------------------------------------------------------------------------------------
# A loss that reads a parameter through the model
# ------------------------------------------------------------------------------------------


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)


def _batch():
    torch.manual_seed(1)
    return torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))


@pytest.mark.parametrize("strategy", ["vmap", "auto"])
def test_an_l2_term_read_through_the_model_is_differentiated_by_vmap(strategy):
    # (the loss read model[0].weight after functional_call had put the parameter back, so
    # vmap's gradients left the term out; "auto" reached it through a plan made while the
    # term's coefficient was zero, whose first check could not tell)
    model, (x, y) = _mlp(), _batch()

    def make(c):
        return lambda o, t: F.cross_entropy(o, t) + c * model[0].weight.pow(2).sum()

    for c in (0.0, 1.0):
        loss_fn = make(torch.tensor(c, dtype=DT))
        got = tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
        assert_matches(got, loop_reference(model, loss_fn, x, y))


@pytest.mark.parametrize("strategy", ["loop", "vmap", "auto"])
def test_an_l2_term_on_a_frozen_selected_parameter_read_through_the_model(strategy):
    model, (x, y) = _mlp(), _batch()
    model[0].weight.requires_grad_(False)
    loss_fn = lambda o, t: F.cross_entropy(o, t) + model[0].weight.pow(2).sum()  # noqa: E731
    got = tv.per_sample_grads(model, loss_fn, x, y, params=["0.weight", "2.weight"],
                              strategy=strategy)
    model[0].weight.requires_grad_(True)
    ref = loop_reference(model, loss_fn, x, y)
    assert_matches(got, {n: ref[n] for n in ("0.weight", "2.weight")})


def _l2(o, t, w):
    return F.cross_entropy(o, t) + 0.5 * w.pow(2).sum()


class _L2Loss(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, o, t):
        return _l2(o, t, self.w)


@pytest.mark.parametrize("kind", ["closure", "partial", "module", "view", "layer"])
def test_a_loss_made_again_over_another_parameter_gets_its_own_plan(kind):
    # (a factory's loss over model[0].weight, then over model[2].weight: the plan made for
    # the first gave model[2].weight to its rules alone, the L2 term left out, silently)
    model, (x, y) = _mlp(), _batch()

    def make(w):
        if kind == "closure":
            return lambda o, t: _l2(o, t, w)
        if kind == "partial":
            return functools.partial(_l2, w=w)
        if kind == "view":
            v = w.t()
            return lambda o, t: _l2(o, t, v)
        if kind == "layer":  # (the layer held, its weight read in the loss)
            layer = model[0] if w is model[0].weight else model[2]
            return lambda o, t: _l2(o, t, layer.weight)
        return _L2Loss(w)

    for w in (model[0].weight, model[0].weight, model[0].weight, model[2].weight):
        loss_fn = make(w)
        got = tv.per_sample_grads(model, loss_fn, x, y)
        assert_matches(got, loop_reference(model, loss_fn, x, y))
        norms = tv.per_sample_grad_norms(model, loss_fn, x, y)
        torch.testing.assert_close(norms, norms_of(loop_reference(model, loss_fn, x, y)),
                                   rtol=1e-10, atol=1e-12)


def test_a_loss_over_a_tensor_made_anew_each_step_keeps_its_plan(monkeypatch):
    from torch_vjp._per_sample import probe

    model, (x, y) = _mlp(), _batch()
    built = []
    build = probe.build_plan
    monkeypatch.setattr(probe, "build_plan", lambda job: built.append(1) or build(job))
    for step in range(3):
        weight = torch.tensor([1.0, 2.0, 0.5 + step], dtype=DT)  # (class weights per step)
        def loss_fn(o, t):
            return F.cross_entropy(o, t, weight=weight, label_smoothing=0.1)

        got = tv.per_sample_grads(model, loss_fn, x, y)
        assert_matches(got, loop_reference(model, loss_fn, x, y))
    assert len(built) == 1


# ------------------------------------------------------------------------------------------
# A forward replaced on the instance, and replaced again
# ------------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)

    def forward(self, x):
        return self.a(x)


def test_a_forward_replaced_again_gets_its_own_plan():
    # (the plan's key held which method was replaced, not by what: a forward replaced by
    # one that mixes the examples kept the plan of the one before it, and one replaced back
    # kept the refusal the mixing one had made)
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), nn.Tanh(), nn.Linear(8, 3)).to(DT)
    x, y = _batch()
    block = model[0]

    def plain(x):
        return block.a(x)

    def mixing(x):
        h = block.a(x)
        return h + h.mean(0, keepdim=True)

    def doubled(x):
        return 2 * block.a(x)

    for forward in (plain, mixing, plain, doubled):
        block.forward = forward
        if forward is mixing:
            with pytest.raises(tv.PerSampleError, match="module '0' \\(_Block\\) mixes examples"):
                tv.per_sample_grads(model, F.cross_entropy, x, y)
            got = tv.per_sample_grads(model, F.cross_entropy, x, y, strategy="vmap")
        else:
            got = tv.per_sample_grads(model, F.cross_entropy, x, y)
        assert_matches(got, loop_reference(model, F.cross_entropy, x, y))


# ------------------------------------------------------------------------------------------
# An optional input passed as None
# ------------------------------------------------------------------------------------------


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, mask, x, extra=None):
        o = self.a(x)
        o = o if mask is None else o * mask
        return o if extra is None else o + extra


@pytest.mark.parametrize("strategy", ["auto", "hooks", "vmap", "loop"])
@pytest.mark.parametrize("which", ["first", "last", "both"])
def test_an_input_none_is_passed_as_it_is(strategy, which):
    torch.manual_seed(0)
    model = _Masked().to(DT)
    x, y = _batch()
    mask = torch.rand(6, 3, dtype=DT)
    inputs = {"first": (None, x), "last": (mask, x, None), "both": (None, x, None)}[which]
    ref = loop_reference(model, F.cross_entropy, inputs, y)
    got = tv.per_sample_grads(model, F.cross_entropy, inputs, y, strategy=strategy)
    assert_matches(got, ref)
    norms = tv.per_sample_grad_norms(model, F.cross_entropy, inputs, y, strategy=strategy)
    torch.testing.assert_close(norms, norms_of(ref), rtol=1e-10, atol=1e-12)
    model.zero_grad()
    tv.accumulate_clipped_grads(model, F.cross_entropy, inputs, y, max_norm=1e9,
                                strategy=strategy)
    torch.testing.assert_close(model.a.weight.grad, ref["a.weight"].sum(0))


def test_inputs_that_are_all_none_are_explained():
    model = _Masked().to(DT)
    with pytest.raises(tv.PerSampleTypeError, match=r"every input is None, so no input holds "
                       r"the examples\.\n  .*pass at least one tensor"):
        tv.per_sample_grads(model, F.cross_entropy, (None, None), torch.zeros(2))


# ------------------------------------------------------------------------------------------
# A forward that fails only while the plan records it
# ------------------------------------------------------------------------------------------


class _NoModes(nn.Module):
    """Refuses to run under a TorchDispatchMode (as code guarding against FLOP counters
    does): the plan's recording pass runs one, the ordinary forward does not."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x):
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if _get_current_dispatch_mode() is not None:
            raise RuntimeError("no dispatch modes here")
        return self.a(x)


def test_a_forward_that_fails_while_recorded_goes_to_vmap_and_says_why():
    torch.manual_seed(0)
    model, (x, y) = _NoModes().to(DT), _batch()
    why = ("the model's forward fails while the hooks record it (RuntimeError: no dispatch "
           "modes here)")
    plan = tv.per_sample_plan(model, F.cross_entropy, x, y)
    assert [(r.method, r.reason) for r in plan] == [("vmap", why)] * 2
    assert_matches(tv.per_sample_grads(model, F.cross_entropy, x, y),
                   loop_reference(model, F.cross_entropy, x, y))
    with pytest.raises(tv.StrategyError, match=r"strategy='hooks' cannot compute 2 parameter\(s\) "
                       r"with a per-layer rule:\n    'a\.weight': " + re.escape(why)):
        tv.per_sample_grads(model, F.cross_entropy, x, y, strategy="hooks")
