"""Per-sample gradients are never silently wrong: the plan (NOTE [the per-sample plan]).

Each model below once fooled a batch dimension read from shapes alone, or mixes examples.
Every result is compared in float64 with the definition, one example at a time.
"""

from __future__ import annotations

import copy
import functools
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_vjp as tv
from torch_vjp._errors import every_time
from torch_vjp._per_sample import probe as plan_module
from torch_vjp._per_sample.args import Job, select

DT = torch.float64
STRATEGIES = ("auto", "hooks", "vmap", "loop")


def loop_reference(model, loss_fn, x, t=None):
    """The definition: each example alone."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    out = {n: [] for n in names}
    for i in range(x.shape[0]):
        o = model(x[i:i + 1])
        loss = loss_fn(o) if t is None else loss_fn(o, t[i:i + 1])
        gs = torch.autograd.grad(loss, params, allow_unused=True)
        for n, g, p in zip(names, gs, params):
            out[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(v) for n, v in out.items()}


def assert_matches(got, ref):
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)


# --------------------------------------------------------------------------------------
# Layouts that shapes alone misread
# --------------------------------------------------------------------------------------


class SequenceFirst(nn.Module):
    """Output (T, B, 3) with T == B; the loss reads the last time step only."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x.transpose(0, 1))


class SortAndRestore(nn.Module):
    """Runs the batch in another order and restores it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        order = torch.arange(x.shape[0] - 1, -1, -1)
        return self.fc(x[order])[order.argsort()]


class SwapFirstTwo(nn.Module):
    """Swaps examples 0 and 1 for a layer and back: the examples probed one at a time (the
    last and the middle one) stay in place, so only a test of every row sees it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        order = torch.arange(x.shape[0])
        if x.shape[0] > 1:
            order[[0, 1]] = order[[1, 0]]
        return self.out(torch.tanh(self.fc(x[order])[order.argsort()]))


class SharedTable(nn.Module):
    """A Linear applied to a (T, F) table used by every example, with T == B."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(4, 4))
        self.pos_fc = nn.Linear(4, 4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x + self.pos_fc(self.pos))


class Scrambled(nn.Module):
    """x.reshape(T, B, F) (not a transpose) around a row-wise Linear: the Linear's rows mix
    examples; the reshape back restores them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        B, T, Fe = x.shape
        h = self.fc(x.reshape(T, B, Fe)).reshape(B, T, Fe)
        return self.out(h)


class SeededNoise(nn.Module):
    """Draws from a generator seeded inside the forward: every example alone gets the same
    draw, which vmap's default randomness does not reproduce."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        g = torch.Generator().manual_seed(0)
        return self.fc(x + torch.randn(x.shape[1:], generator=g, dtype=x.dtype))


LAYOUTS = {
    "sequence-first-T-eq-B": (SequenceFirst, lambda o: o[-1].pow(2).sum(), (4, 4, 4)),
    "sort-and-restore": (SortAndRestore, lambda o: o.pow(2).sum(), (4, 4)),
    "swap-first-two": (SwapFirstTwo, lambda o: o.pow(2).sum(), (6, 4)),
    "shared-table-T-eq-B": (SharedTable, lambda o: o.pow(2).sum(), (4, 4, 4)),
    "reshape-scrambles": (Scrambled, lambda o: o.sin().sum(), (4, 3, 4)),
    "seeded-generator": (SeededNoise, lambda o: o.pow(2).sum(), (5, 4)),
}


@pytest.mark.parametrize("strategy", ["auto", "vmap", "loop"])
@pytest.mark.parametrize("case", LAYOUTS, ids=list(LAYOUTS))
def test_layouts_are_right_under_every_correct_strategy(case, strategy):
    make, loss_fn, shape = LAYOUTS[case]
    torch.manual_seed(0)
    model = make().to(DT)
    x = torch.randn(*shape, dtype=DT)
    ref = loop_reference(model, loss_fn, x)
    assert_matches(tv.per_sample_grads(model, loss_fn, x, strategy=strategy), ref)
    norms = tv.per_sample_grad_norms(model, loss_fn, x, strategy=strategy)
    want = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    torch.testing.assert_close(norms, want)


def test_sequence_first_output_uses_rules_with_the_right_dimension():
    make, loss_fn, shape = LAYOUTS["sequence-first-T-eq-B"]
    torch.manual_seed(0)
    model = make().to(DT)
    x = torch.randn(*shape, dtype=DT)
    plan = tv.per_sample_plan(model, loss_fn, x)
    assert plan["fc.weight"].method == "rule", str(plan)
    assert_matches(tv.per_sample_grads(model, loss_fn, x, strategy="hooks"),
                   loop_reference(model, loss_fn, x))


@pytest.mark.parametrize("case, param, reason", [
    ("sort-and-restore", "fc.weight", "rows do not belong to single examples"),
    ("swap-first-two", "fc.weight", "rows do not all belong to the examples of the same index"),
    ("shared-table-T-eq-B", "pos_fc.weight", "rows do not belong to single examples"),
    ("reshape-scrambles", "fc.weight", "rows do not belong to single examples"),
], ids=["sort-and-restore", "swap-first-two", "shared-table", "reshape-scrambles"])
def test_hooks_refuses_what_rules_cannot_do_and_says_why(case, param, reason):
    make, loss_fn, shape = LAYOUTS[case]
    torch.manual_seed(0)
    model = make().to(DT)
    x = torch.randn(*shape, dtype=DT)
    plan = tv.per_sample_plan(model, loss_fn, x)
    assert plan[param].method == "vmap" and reason in plan[param].reason, str(plan)
    with pytest.raises(tv.StrategyError, match=rf"'{param}': in '.*', its output's {reason}"):
        tv.per_sample_grads(model, loss_fn, x, strategy="hooks")


class _TinyLlama(nn.Module):
    """Embedding, RMSNorm, causal attention and a gated MLP, then a final RMSNorm whose
    weight stays at 1: the squared output of that norm does not depend on its input, so
    every gradient below it is rounding."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(11, d)
        self.n1, self.n2, self.norm = nn.RMSNorm(d), nn.RMSNorm(d), nn.RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.norm.weight.requires_grad_(False)

    def forward(self, ids):
        x = self.emb(ids)
        B, T, D = x.shape
        h = self.n1(x)

        def split(t):
            return t.view(B, T, self.heads, D // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)),
                                           is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        h = self.n2(x)
        return self.norm(x + self.down(F.silu(self.gate(h)) * self.up(h)))


def test_gradients_at_rounding_level_keep_the_rules():
    # every rule layer below the final norm went to the fallback ("rows do not all belong to
    # the examples of the same index"), and hooks refused them: the ratio test compared
    # rounding errors with each other
    torch.manual_seed(0)
    model = _TinyLlama().to(DT)
    ids = torch.randint(0, 11, (4, 5))
    loss_fn = lambda out: out.pow(2).sum()  # noqa: E731
    plan = tv.per_sample_plan(model, loss_fn, ids)
    assert all(plan[n].method == "rule" for n in ("emb.weight", "q.weight", "down.weight",
                                                  "n1.weight")), str(plan)
    ref = loop_reference(model, loss_fn, ids)
    assert_matches(tv.per_sample_grads(model, loss_fn, ids, strategy="hooks"), ref)


@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e30])
def test_a_swap_of_examples_is_found_at_any_scale_of_the_gradients(scale):
    # rounding gets a floor; a row that follows another example's loss is no rounding,
    # however small or large the gradients are
    make, _, shape = LAYOUTS["swap-first-two"]
    torch.manual_seed(0)
    model = make().to(DT)
    x = torch.randn(*shape, dtype=DT)
    loss_fn = lambda o: (scale * o).pow(2).sum()  # noqa: E731
    plan = tv.per_sample_plan(model, loss_fn, x)
    assert plan["fc.weight"].method == "vmap", str(plan)
    assert "rows do not all belong to the examples of the same index" in plan["fc.weight"].reason
    torch.testing.assert_close(tv.per_sample_grads(model, loss_fn, x)["fc.weight"],
                               loop_reference(model, loss_fn, x)["fc.weight"])


def test_hooks_refusal_of_examples_merged_with_another_dimension_says_so():
    # x.reshape(-1, features) before a Linear was called "a table shared by every example"
    class Merged(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 4)

        def forward(self, x):
            return self.fc(x.reshape(-1, 5)).reshape(x.shape[0], -1).sum(1)

    model = Merged().to(DT)
    x = torch.randn(4, 3, 5, dtype=DT)
    with pytest.raises(tv.StrategyError, match=(
            r"'fc.weight': in 'fc', its output of shape \(12, 4\) has no dimension that could "
            r"hold the 4 examples: if the 12 rows of dimension 0 are the examples merged with "
            r"another dimension \(4 x 3, as after x.reshape\(-1, features\)\), rules need the "
            r"examples along a dimension of their own")):
        tv.per_sample_grads(model, lambda o: o.sum(), x, strategy="hooks")
    assert_matches(tv.per_sample_grads(model, lambda o: o.sum(), x),
                   loop_reference(model, lambda o: o.sum(), x))


@pytest.mark.parametrize("keep_dim", [False, True], ids=["x[i]", "x[i:i+1]"])
def test_hooks_refusal_of_a_layer_called_once_per_example_says_so(keep_dim):
    # a loop over the batch, one call per example, was called "a table shared by every
    # example"
    class PerExample(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(3, 2, 2)

        def forward(self, x):
            rows = [x[i:i + 1] if keep_dim else x[i] for i in range(x.shape[0])]
            return torch.stack([self.conv(r).reshape(-1) for r in rows]).tanh().sum(1)

    model = PerExample().to(DT)
    x = torch.randn(4, 3, 5, dtype=DT)
    shape = r"\(1, 2, 4\)" if keep_dim else r"\(2, 4\)"
    with pytest.raises(tv.StrategyError, match=(
            rf"'conv.weight': in 'conv', its output of shape {shape} has no dimension that "
            r"could hold the 4 examples: the layer is called 4 times, once per example it "
            r"seems \(a loop over the batch, each call on one example's rows\); rules need "
            r"one call on the whole batch")):
        tv.per_sample_grads(model, lambda o: o.sum(), x, strategy="hooks")
    assert_matches(tv.per_sample_grads(model, lambda o: o.sum(), x),
                   loop_reference(model, lambda o: o.sum(), x))


def test_seeded_generator_goes_to_vmap_with_shared_randomness():
    make, loss_fn, shape = LAYOUTS["seeded-generator"]
    torch.manual_seed(0)
    model = make().to(DT)
    x = torch.randn(*shape, dtype=DT)
    plan = plan_module.plan_for(Job("per_sample_grads", model, loss_fn, (x,), None,
                                    _selection(model), x.shape[0], "vmap"))
    assert plan.vmap_randomness == "same"


def _selection(model):

    return select("test", model, None)


# --------------------------------------------------------------------------------------
# Models that mix examples
# --------------------------------------------------------------------------------------


class BatchAttention(nn.Module):
    def forward(self, x):
        return torch.softmax(x @ x.T, 0) @ x


class Centered(nn.Module):
    def forward(self, x):
        return x - x.mean(0)


class FunctionalBatchNorm(nn.Module):
    def forward(self, x):
        return F.batch_norm(x, None, None, training=True)


class MixInOwnForward(nn.Module):
    """The mixing happens in the model's own forward, between its layers."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        h = self.a(x)
        return self.b(h - h.mean(0))


MIXERS = {
    "batch-attention": (lambda: nn.Sequential(nn.Linear(5, 4), BatchAttention(), nn.Linear(4, 3)),
                        r"module '1' \(BatchAttention\) mixes examples"),
    "x-minus-mean": (lambda: nn.Sequential(nn.Linear(5, 4), Centered(), nn.Linear(4, 3)),
                     r"module '1' \(Centered\) mixes examples"),
    "functional-batch-norm": (lambda: nn.Sequential(nn.Linear(5, 4), FunctionalBatchNorm(),
                                                    nn.Linear(4, 3)),
                              r"module '1' \(FunctionalBatchNorm\) mixes examples"),
    "in-own-forward": (MixInOwnForward,
                       r"the model's own forward \(MixInOwnForward\) mixes examples"),
}


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
@pytest.mark.parametrize("case", MIXERS, ids=list(MIXERS))
def test_models_that_mix_examples_are_refused(case, strategy):
    make, match = MIXERS[case]
    torch.manual_seed(0)
    model = make().to(DT)
    x, y = torch.randn(6, 5, dtype=DT), torch.randn(6, 3, dtype=DT)
    for fn in (tv.per_sample_grads, tv.per_sample_grad_norms):
        with pytest.raises(tv.PerSampleError, match=match):
            fn(model, nn.MSELoss(), x, y, strategy=strategy)
    with pytest.raises(tv.PerSampleError, match="strategy='vmap' or strategy='loop'"):
        tv.accumulate_clipped_grads(model, nn.MSELoss(), x, y, max_norm=1.0, strategy=strategy)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("strategy", ["vmap", "loop"])
def test_definition_strategies_compute_the_definition_for_mixing_models(strategy):
    torch.manual_seed(0)
    model = MIXERS["batch-attention"][0]().to(DT)
    x, y = torch.randn(6, 5, dtype=DT), torch.randn(6, 3, dtype=DT)
    loss_fn = nn.MSELoss()
    ref = loop_reference(model, loss_fn, x, y)
    assert_matches(tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy), ref)


# --------------------------------------------------------------------------------------
# Nothing of the model changes
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_spectral_norm_buffers_do_not_move(strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 4)), nn.Tanh(),
                          nn.Linear(4, 2)).to(DT)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(5, 4, dtype=DT), torch.randn(5, 2, dtype=DT)
    if strategy == "hooks":  # the weight is computed from weight_orig: no rule for that
        with pytest.raises(tv.StrategyError, match="'0.weight_orig'"):
            tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy=strategy)
    else:
        # every example runs alone from the caller's state, as the definition says
        ref = {}
        for i in range(5):
            model.load_state_dict(before)
            loss = nn.MSELoss()(model(x[i:i + 1]), y[i:i + 1])
            for n, g in zip(["0.bias", "0.weight_orig"],
                            torch.autograd.grad(loss, [model[0].bias, model[0].weight_orig])):
                ref.setdefault(n, []).append(g)
        model.load_state_dict(before)
        got = tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy=strategy)
        for n, gs in ref.items():
            torch.testing.assert_close(got[n], torch.stack(gs), msg=n)
        tv.per_sample_grad_norms(model, nn.MSELoss(), x, y, strategy=strategy)
        tv.accumulate_clipped_grads(model, nn.MSELoss(), x, y, max_norm=1.0, strategy=strategy)
    after = model.state_dict()
    for k, v in before.items():
        if k.endswith("_u") or k.endswith("_v"):
            assert torch.equal(after[k], v), k


class _OwnSequential(nn.Sequential):
    """(auto's vmap-failure warning is shown once per model class: this class's own)"""


class _ShrinkInForward(nn.Module):
    """Changes its own parameter in place on every forward (not idempotent)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, dtype=DT))

    def forward(self, x):
        with torch.no_grad():
            self.w.mul_(0.5)
        return x * self.w


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layer", ["embedding-max-norm", "shrink-in-forward",
                                   "instancenorm-running-stats"])
def test_parameters_a_forward_changes_in_place_are_put_back(strategy, layer):
    # Embedding(max_norm) renormalises the rows it looks up in place; every example runs
    # from the caller's parameters, as the definition says, and the caller gets them back
    torch.manual_seed(0)
    if layer == "embedding-max-norm":
        model = _OwnSequential(nn.Embedding(10, 4, max_norm=1.0), nn.Flatten(),
                               nn.Linear(12, 2)).to(DT)
        with torch.no_grad():
            model[0].weight.mul_(3.0)
        x = torch.randint(0, 10, (5, 3))
    elif layer == "shrink-in-forward":
        model = _OwnSequential(nn.Linear(3, 4), _ShrinkInForward(), nn.Linear(4, 2)).to(DT)
        x = torch.randn(5, 3, dtype=DT)
    else:  # training mode: each example's own statistics; the running ones move
        model = _OwnSequential(nn.Conv1d(2, 3, 2), nn.InstanceNorm1d(3, affine=True,
                               track_running_stats=True), nn.Flatten(), nn.Linear(9, 2)).to(DT)
        x = torch.randn(5, 2, 4, dtype=DT)
    y = torch.randn(5, 2, dtype=DT)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n, p in model.named_parameters()]
    ref = {}
    for i in range(5):
        model.load_state_dict(before)
        loss = nn.MSELoss()(model(x[i:i + 1]), y[i:i + 1])
        for n, g in zip(names, torch.autograd.grad(loss, list(model.parameters()))):
            ref.setdefault(n, []).append(g)
    model.load_state_dict(before)
    ref = {n: torch.stack(g) for n, g in ref.items()}
    calls = {
        "grads": lambda: tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy=strategy),
        "norms": lambda: tv.per_sample_grad_norms(model, nn.MSELoss(), x, y,
                                                  strategy=strategy),
        "clipped": lambda: tv.accumulate_clipped_grads(model, nn.MSELoss(), x, y,
                                                       max_norm=1e9, strategy=strategy),
    }
    for what, call in calls.items():
        for _ in range(2):  # the planning call, and one with the plan reused
            try:
                got = call()
            except tv.StrategyError:
                # no rule (InstanceNorm has one); vmap cannot batch the in-place changes
                assert strategy == "vmap" or (
                    strategy == "hooks" and layer != "instancenorm-running-stats")
            else:
                if what == "grads":
                    for n in names:
                        torch.testing.assert_close(got[n], ref[n], msg=n)
                elif what == "norms":
                    want = torch.cat([r.flatten(1) for r in ref.values()], 1).norm(dim=1)
                    torch.testing.assert_close(got, want)
                else:
                    for n, p in model.named_parameters():
                        torch.testing.assert_close(p.grad, ref[n].sum(0), msg=n)
                        p.grad = None
            for k, v in model.state_dict().items():
                assert torch.equal(v, before[k]), (what, k)


@pytest.mark.parametrize("strategy", ["auto", "loop"])
def test_a_parameter_changed_in_place_by_later_batches_only_is_put_back(strategy):
    # the first batch looks up rows within max_norm (renormalising changes nothing, but
    # the weight's version moves); the second looks up longer rows
    torch.manual_seed(0)
    model = _OwnSequential(nn.Embedding(10, 4, max_norm=1.0), nn.Flatten(),
                           nn.Linear(12, 2)).to(DT)
    with torch.no_grad():
        w = model[0].weight
        w[:5] *= 0.1 / w[:5].norm(dim=1, keepdim=True)
        w[5:] *= 3.0 / w[5:].norm(dim=1, keepdim=True)
    before = model[0].weight.clone()
    y = torch.randn(4, 2, dtype=DT)
    for x in (torch.randint(0, 5, (4, 3)), torch.randint(5, 10, (4, 3))):
        tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy=strategy)
        assert torch.equal(model[0].weight, before)


def test_frozen_parameter_named_for_accumulation_is_refused():
    torch.manual_seed(0)
    model = nn.Linear(3, 2).to(DT)
    model.weight.requires_grad_(False)
    x, y = torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)
    with pytest.raises(tv.PerSampleValueError, match=r"params names 'weight', which does not "
                       r"require grad.*backward never gives a tensor that does not require "
                       r"grad a .grad"):
        tv.accumulate_clipped_grads(model, nn.MSELoss(), x, y, max_norm=1.0, params=["weight"])
    assert model.weight.grad is None
    # the norms accept it, as per_sample_grads does
    tv.per_sample_grad_norms(model, nn.MSELoss(), x, y, params=["weight"])


# --------------------------------------------------------------------------------------
# Empty batches, the loop, sparse embeddings
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_empty_batch(strategy):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    x, y = torch.empty(0, 3, dtype=DT), torch.empty(0, dtype=torch.long)
    g = tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy=strategy)
    assert {n: tuple(t.shape) for n, t in g.items()} == {
        n: (0, *p.shape) for n, p in model.named_parameters()}
    assert tv.per_sample_grad_norms(model, nn.CrossEntropyLoss(), x, y,
                                    strategy=strategy).shape == (0,)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    norms = tv.accumulate_clipped_grads(model, nn.CrossEntropyLoss(), x, y, max_norm=1.0,
                                        strategy=strategy)
    assert norms.shape == (0,)
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))  # nothing added
    assert torch.equal(model[2].weight.grad, torch.zeros_like(model[2].weight))


def test_loop_runs_each_example_once():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.fc(x)

    model = Counting().to(DT)
    x, y = torch.randn(7, 3, dtype=DT), torch.randn(7, 2, dtype=DT)
    tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="loop")
    assert model.calls == 7


@pytest.mark.parametrize("strategy", ["auto", "hooks", "loop"])
def test_sparse_embedding(strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Flatten(), nn.Linear(6, 2)).to(DT)
    x, y = torch.randint(0, 10, (5, 2)), torch.randn(5, 2, dtype=DT)
    ref = loop_reference(model, nn.MSELoss(), x, y)
    ref = {n: g.to_dense() for n, g in ref.items()}
    assert_matches(tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy=strategy), ref)
    for p in model.parameters():
        p.grad = None
    norms = tv.accumulate_clipped_grads(model, nn.MSELoss(), x, y, max_norm=0.5,
                                        strategy=strategy)
    c = (0.5 / norms).clamp(max=1.0)
    weight = model[0].weight
    assert weight.grad.layout == torch.sparse_coo  # as backward gives for sparse=True
    torch.testing.assert_close(weight.grad.to_dense(),
                               torch.einsum("b,b...->...", c, ref["0.weight"]))


@pytest.mark.parametrize("strategy", ["auto", "hooks", "loop"])
def test_sparse_flag_switched_between_calls_is_followed(strategy):
    # Embedding.sparse is a plain attribute: a switch after the first call (whose selection
    # and plan are cached) decides the layout of the next .grad, as it does for backward
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 3), nn.Flatten(), nn.Linear(6, 2)).to(DT)
    x, y = torch.randint(0, 10, (5, 2)), torch.randn(5, 2, dtype=DT)
    ref = loop_reference(model, nn.MSELoss(), x, y)["0.weight"]
    weight = model[0].weight
    for sparse in (False, True, False):
        model[0].sparse = sparse
        weight.grad = None
        norms = tv.accumulate_clipped_grads(model, nn.MSELoss(), x, y, max_norm=0.5,
                                            strategy=strategy)
        assert weight.grad.layout == (torch.sparse_coo if sparse else torch.strided)
        c = (0.5 / norms).clamp(max=1.0)
        torch.testing.assert_close(weight.grad.to_dense(), torch.einsum("b,b...->...", c, ref))


def test_sparse_embedding_under_vmap_is_named():
    model = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Flatten(), nn.Linear(6, 2)).to(DT)
    x, y = torch.randint(0, 10, (5, 2)), torch.randn(5, 2, dtype=DT)
    with pytest.raises(tv.StrategyError, match=r"strategy='vmap' cannot batch this model in "
                       r"module '0' \(Embedding with sparse=True"):
        tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="vmap")


def test_results_survive_being_sent_to_another_process():
    import torch.multiprocessing as mp

    from _shared_functions import FORKSERVER_PRELOAD

    # not forked from this process: a child forked while torch's thread pools hold a lock
    # can hang at exit. Forked from the fork server that imported torch and torch_vjp once
    # (and runs no tensor operation), shared with the distributed tests' ranks
    # (tests/conftest.py's _spawn_within), rather than spawned: a fresh interpreter imports
    # them again, seconds of CPU
    if "forkserver" in mp.get_all_start_methods():
        mp.set_forkserver_preload([*FORKSERVER_PRELOAD, __name__])
        ctx = mp.get_context("forkserver")
    else:
        ctx = mp.get_context("spawn")
    model = nn.Linear(300, 300).to(DT)
    x, y = torch.randn(8, 300, dtype=DT), torch.randint(0, 300, (8,))
    first = tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y)["weight"]
    expected = float(first.sum())
    queue, reply, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_hold_and_report, args=(queue, reply, go), daemon=True)
    child.start()
    queue.put(first)
    del first
    tv.per_sample_grads(model, nn.CrossEntropyLoss(), torch.randn(8, 300, dtype=DT), y)
    go.set()
    try:
        got = reply.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()
    assert got == pytest.approx(expected, rel=1e-12)


def _hold_and_report(queue, reply, go):
    t = queue.get(timeout=120)
    go.wait(timeout=60)
    reply.put(float(t.numpy().sum()))


# --------------------------------------------------------------------------------------
# Failures under vmap name the strategy, the layer and the alternatives
# --------------------------------------------------------------------------------------


class UsesItem(nn.Module):
    """Python control flow on a tensor value: the loop runs it, vmap cannot."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        scale = 2.0 if float(x.abs().max()) > 1e6 else 1.0  # 1 for every batch used here
        return x * self.w * scale


def test_vmap_failure_is_a_strategy_error_naming_the_layer():
    model = nn.Sequential(nn.Linear(3, 3), UsesItem(), nn.Linear(3, 2)).to(DT)
    x, y = torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)
    # the same error from the three functions (the norms and the clipped step did not
    # raise: they looped, with a warning that named strategy='auto')
    for call in (tv.per_sample_grads, tv.per_sample_grad_norms,
                 functools.partial(tv.accumulate_clipped_grads, max_norm=1.0)):
        name = getattr(call, "func", call).__name__
        with pytest.raises(tv.StrategyError, match=rf"(?s)torch_vjp.{name}: strategy='vmap' "
                           r"cannot batch this model in module '1' \(UsesItem\).*"
                           r"strategy='loop'.*strategy='auto'"):
            call(model, nn.MSELoss(), x, y, strategy="vmap")
    assert all(p.grad is None for p in model.parameters())
    # (every_time: the once-only warning may have been shown by an earlier test's model)
    with every_time(), pytest.warns(tv.TorchVJPWarning, match="could not vectorise"):
        got = tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="auto")
    assert_matches(got, loop_reference(model, nn.MSELoss(), x, y))


def test_vmap_failure_from_a_full_backward_hook_names_the_hook():
    # the message blamed "custom autograd Functions without vmap support": the user wrote
    # none, torch made one for their register_full_backward_hook
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2)).to(DT)
    model[2].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    x, y = torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)
    with pytest.raises(tv.StrategyError, match=(
            r"strategy='vmap' cannot batch this model in module '2' \(Linear\); '2' has a full "
            r"backward hook \(register_full_backward_hook or register_full_backward_pre_hook\), "
            r"which torch runs through an autograd Function that torch.func cannot transform")):
        tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="vmap")
    assert_matches(tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="auto"),
                   loop_reference(model, nn.MSELoss(), x, y))


def test_vmap_failure_from_a_global_full_backward_hook_names_it():
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2)).to(DT)
    x, y = torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: None)
    try:
        with pytest.raises(tv.StrategyError, match=(
                r"cannot batch this model in .*; every module has a full backward hook, "
                r"through a global one \(register_module_full_backward_hook or _pre_hook\)")):
            tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="vmap")
    finally:
        handle.remove()


def test_the_models_own_error_passes_through_vmap_untouched():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            raise ZeroDivisionError("the model's own error")

    for strategy in STRATEGIES:
        with pytest.raises(ZeroDivisionError, match="the model's own error"):
            tv.per_sample_grads(Broken(), nn.MSELoss(), torch.randn(3, 3), torch.randn(3, 2),
                                strategy=strategy)


# --------------------------------------------------------------------------------------
# The plan: shown, cached, reused across batch sizes
# --------------------------------------------------------------------------------------


def test_plan_table_names_methods_and_reasons():
    make, loss_fn, shape = LAYOUTS["shared-table-T-eq-B"]
    torch.manual_seed(0)
    model = make().to(DT)
    plan = tv.per_sample_plan(model, loss_fn, torch.randn(*shape, dtype=DT))
    text = str(plan)
    assert text.splitlines()[1].split() == ["parameter", "method", "how", "/", "why"]
    row = next(line for line in text.splitlines() if line.startswith("fc.weight "))
    assert row.split(maxsplit=2) == ["fc.weight", "rule", "Linear rule in 'fc'"]
    assert plan["pos"].method == "vmap"
    with pytest.raises(KeyError):
        plan["missing"]


def test_plan_is_built_once_and_reused_for_other_batch_sizes(monkeypatch):
    built = []
    real = plan_module.build_plan

    def spy(job):
        built.append(job.batch)
        return real(job)

    monkeypatch.setattr(plan_module, "build_plan", spy)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    for b in (8, 5, 8, 3):  # Poisson sampling draws batches of every size
        x, y = torch.randn(b, 3, dtype=DT), torch.randn(b, 2, dtype=DT)
        tv.per_sample_grad_norms(model, nn.MSELoss(), x, y)
    assert built == [8]


def test_verification_reroutes_what_rules_get_wrong(monkeypatch):
    """A rule that lies is caught on the first call and its parameters rerouted (auto) or
    refused (hooks)."""
    from torch_vjp._per_sample.rules import linear

    real = linear.LinearRule.factors

    def lying(self, call, grads, roles, batch):
        return [(r, f) for r, f in real(self, call, [g * 2 for g in grads], roles, batch)]

    monkeypatch.setattr(linear.LinearRule, "factors", lying)
    plan_module.forget_plans()
    model = nn.Sequential(nn.Linear(3, 2)).to(DT)
    x, y = torch.randn(5, 3, dtype=DT), torch.randn(5, 2, dtype=DT)
    ref = loop_reference(model, nn.MSELoss(), x, y)
    with pytest.raises(tv.PerSampleError, match="strategy='hooks' gives wrong per-sample "
                       "gradients for this model"):
        tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="hooks")
    assert_matches(tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="auto"), ref)
    plan = tv.per_sample_plan(model, nn.MSELoss(), x, y)
    assert plan["0.weight"].method == "vmap"
    assert "disagreed with the per-example loop" in plan["0.weight"].reason
    plan_module.forget_plans()


# --------------------------------------------------------------------------------------
# Rules of one's own
# --------------------------------------------------------------------------------------


class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return x * self.w


def test_registered_rule_is_used_and_checked():
    from torch_vjp._per_sample import registry

    class MyScale(Scale):
        pass

    try:
        tv.register_per_sample_rule(MyScale, lambda m, inputs, g: {"w": inputs[0] * g})
        model = nn.Sequential(MyScale(3), nn.Linear(3, 2)).to(DT)
        x, y = torch.randn(5, 3, dtype=DT), torch.randn(5, 2, dtype=DT)
        assert tv.per_sample_plan(model, nn.MSELoss(), x, y)["0.w"].method == "rule"
        assert_matches(tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="hooks"),
                       loop_reference(model, nn.MSELoss(), x, y))
        # one example: the rule gets (1, 3), batch-first as always (it got (1, 1, 3), and its
        # right result was refused as the rule's mistake)
        for strategy in ("hooks", "auto"):
            assert_matches(tv.per_sample_grads(model, nn.MSELoss(), x[:1], y[:1],
                                               strategy=strategy),
                           loop_reference(model, nn.MSELoss(), x[:1], y[:1]))
    finally:
        registry._RULES.pop(MyScale, None)
        plan_module.forget_plans()


def test_registered_rule_mistakes_are_named():
    from torch_vjp._per_sample import registry

    class Other(Scale):
        pass

    with pytest.raises(tv.PerSampleTypeError, match="cannot be called as fn"):
        tv.register_per_sample_rule(Other, lambda m: {})
    with pytest.raises(tv.PerSampleTypeError, match="must be an nn.Module subclass"):
        tv.register_per_sample_rule(int, lambda m, i, g: {})
    try:
        tv.register_per_sample_rule(Other, lambda m, inputs, g: {"w": g.sum(0)})  # not (B, 3)
        model = nn.Sequential(Other(3), nn.Linear(3, 2)).to(DT)
        with pytest.raises(tv.PerSampleTypeError, match=r"returned \(3,\) for '0.w', but it must "
                           r"return its per-sample gradients, of shape \(B, \*param.shape\) = "
                           r"\(5, 3\)"):
            tv.per_sample_grads(model, nn.MSELoss(), torch.randn(5, 3, dtype=DT),
                                torch.randn(5, 2, dtype=DT), strategy="hooks")
        # a key that is no parameter of the layer (a typo) was ignored without a word
        registry._RULES.pop(Other, None)
        plan_module.forget_plans()
        tv.register_per_sample_rule(Other, lambda m, inputs, g: {"weight": inputs[0] * g})
        model = nn.Sequential(Other(3), nn.Linear(3, 2)).to(DT)
        for strategy in ("hooks", "auto"):
            with pytest.raises(tv.PerSampleValueError, match=r"returned a gradient for "
                               r"'weight', but the layer '0' \(Other\) has no parameter of "
                               r"that name: its own are \['w'\].*Fix: return \{'w': \.\.\.\}"):
                tv.per_sample_grads(model, nn.MSELoss(), torch.randn(5, 3, dtype=DT),
                                    torch.randn(5, 2, dtype=DT), strategy=strategy)
    finally:
        registry._RULES.pop(Other, None)
        plan_module.forget_plans()


def test_layer_called_by_keyword_is_computed_by_its_rule():
    # a layer's input passed by keyword (lin(input=x)) is recorded like a positional one
    class ByKeyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(input=x)

    model = ByKeyword().to(DT)
    x, y = torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)
    plan = tv.per_sample_plan(model, nn.MSELoss(), x, y)
    assert plan["lin.weight"].method == "rule"
    assert_matches(tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="hooks"),
                   loop_reference(model, nn.MSELoss(), x, y))


def test_a_rule_that_declines_the_configuration_says_so():
    model = nn.Sequential(nn.Embedding(10, 3, max_norm=1.0), nn.Flatten(), nn.Linear(6, 2))
    model = model.to(DT)
    x, y = torch.randint(0, 10, (5, 2)), torch.randn(5, 2, dtype=DT)
    plan = tv.per_sample_plan(model, nn.MSELoss(), x, y)
    assert plan["0.weight"].method == "loop"  # (vmap cannot batch embedding_renorm_)
    assert plan["0.weight"].reason == (
        "the Embedding rule does not handle max_norm (rows renormalised in place) "
        "(module '0': Embedding); vmap cannot batch '0' (Embedding with max_norm), so the "
        "per-example loop computes it")


def test_a_declined_layer_whose_settings_change_is_planned_again():
    # the plan made while the rule declined scale_grad_by_freq was reused after it was
    # switched off and max_norm set: the reason named the old setting, and once the layer
    # had no setting the rule declines, it stayed on the fallback
    model = nn.Sequential(nn.Embedding(10, 3, scale_grad_by_freq=True), nn.Flatten(),
                          nn.Linear(6, 2)).to(DT)
    x, y = torch.randint(0, 10, (5, 2)), torch.randn(5, 2, dtype=DT)
    assert "handle scale_grad_by_freq" in tv.per_sample_plan(
        model, nn.MSELoss(), x, y)["0.weight"].reason
    model[0].scale_grad_by_freq, model[0].max_norm = False, 1.0
    with pytest.raises(tv.StrategyError, match=r"'0.weight': the Embedding rule does not "
                       r"handle max_norm \(rows renormalised in place\)"):
        tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="hooks")
    model[0].max_norm = None
    assert tv.per_sample_plan(model, nn.MSELoss(), x, y)["0.weight"].method == "rule"


def test_plan_rows_by_name_or_in_order():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)).to(DT)
    x, y = torch.randn(4, 3, dtype=DT), torch.randn(4, 1, dtype=DT)
    plan = tv.per_sample_plan(model, nn.MSELoss(), x, y)
    assert [row.name for row in plan] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert len(plan) == 4 and plan["1.bias"] is plan.rows[3]
    with pytest.raises(TypeError, match=r"indexed by parameter name \(a str\), got int"):
        plan[0]
    with pytest.raises(KeyError):
        plan["2.weight"]


# --------------------------------------------------------------------------------------
# NOTE [one run]: a model that runs under vmap anyway is not run twice
# --------------------------------------------------------------------------------------


class Scaled(nn.Module):
    """A Linear, then a parameter of the model's own (no rule), then a Linear."""

    def __init__(self, item=False):
        super().__init__()
        self.item = item
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        h = torch.tanh(self.fc1(x)) * self.scale
        if self.item:  # Python control flow on a value: vmap cannot batch it
            h = h * (2.0 if float(h.detach().abs().max()) > 1e6 else 1.0)
        return self.fc2(h)


def test_per_sample_grads_runs_a_model_that_needs_vmap_once():
    model = Scaled().to(DT)
    x, y = torch.randn(6, 3, dtype=DT), torch.randn(6, 2, dtype=DT)
    plan = tv.per_sample_plan(model, nn.MSELoss(), x, y)
    assert plan["scale"].method == "vmap" and plan["fc1.weight"].method == "rule"
    assert plan.one_run and "one run is faster than two" in str(plan)
    ref = loop_reference(model, nn.MSELoss(), x, y)
    assert_matches(tv.per_sample_grads(model, nn.MSELoss(), x, y), ref)  # checked once
    model.runs = 0
    assert_matches(tv.per_sample_grads(model, nn.MSELoss(), x, y), ref)
    assert model.runs == 1  # vmap's one trace, no rules' pass
    # the norms keep the rules (no B x P): the rules' pass, then vmap for `scale`
    tv.per_sample_grad_norms(model, nn.MSELoss(), x, y)  # checked once
    model.runs = 0
    norms = tv.per_sample_grad_norms(model, nn.MSELoss(), x, y)
    assert model.runs == 2
    want = sum(g.flatten(1).pow(2).sum(1) for g in ref.values()).sqrt()
    torch.testing.assert_close(norms, want)


def test_one_run_gives_the_rules_back_when_vmap_cannot_batch_the_model():
    model = Scaled(item=True).to(DT)
    x, y = torch.randn(5, 3, dtype=DT), torch.randn(5, 2, dtype=DT)
    ref = loop_reference(model, nn.MSELoss(), x, y)
    with pytest.warns(tv.TorchVJPWarning, match="could not vectorise"):
        got = tv.per_sample_grads(model, nn.MSELoss(), x, y)
    assert_matches(got, ref)
    plan = tv.per_sample_plan(model, nn.MSELoss(), x, y)
    assert plan["fc1.weight"].method == "rule" and plan["scale"].method == "loop"
    assert plan["scale"].reason.startswith("vmap cannot batch this model")
    assert not plan.one_run
    assert_matches(tv.per_sample_grads(model, nn.MSELoss(), x, y), ref)


# --------------------------------------------------------------------------------------
# Models as training code holds them: torch.compile(model), model.compile()
# --------------------------------------------------------------------------------------


def test_a_compiled_model_is_computed_on_the_module_it_compiled():
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)
    x, y = torch.randn(6, 5, dtype=DT), torch.randint(0, 3, (6,))
    ref = loop_reference(model, nn.CrossEntropyLoss(), x, y)
    compiled = torch.compile(model)
    got = tv.per_sample_grads(compiled, nn.CrossEntropyLoss(), x, y)
    # named as compiled.named_parameters() names them
    assert list(got) == [n for n, _ in compiled.named_parameters()]
    assert_matches({n[len("_orig_mod."):]: g for n, g in got.items()}, ref)
    sub = tv.per_sample_grads(compiled, nn.CrossEntropyLoss(), x, y, params=["_orig_mod.2.bias"])
    torch.testing.assert_close(sub["_orig_mod.2.bias"], ref["2.bias"])
    norms = tv.accumulate_clipped_grads(compiled, nn.CrossEntropyLoss(), x, y, max_norm=0.1)
    c = (0.1 / norms).clamp(max=1.0)
    torch.testing.assert_close(model[0].weight.grad, torch.einsum("b,b...->...", c, ref["0.weight"]))


def test_a_model_compiled_in_place_gives_the_definition():
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)
    x, y = torch.randn(6, 5, dtype=DT), torch.randint(0, 3, (6,))
    ref = loop_reference(model, nn.CrossEntropyLoss(), x, y)
    model.compile()
    assert_matches(tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y), ref)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_global_hook_state_is_left_behind(strategy):
    # torch keeps a global hook's with_kwargs flag after the hook is removed; left there,
    # it makes every later torch.compile(module) warn about global hooks
    mod = torch.nn.modules.module
    dicts = ("_global_forward_hooks", "_global_forward_pre_hooks",
             "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called",
             "_global_backward_hooks", "_global_backward_pre_hooks")
    before = {d: dict(getattr(mod, d)) for d in dicts}
    model = nn.Sequential(nn.Linear(5, 3)).to(DT)
    x, y = torch.randn(4, 5, dtype=DT), torch.tensor([0, 1, 2, 1])
    tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy=strategy)
    tv.per_sample_grad_norms(model, nn.CrossEntropyLoss(), x, y, strategy=strategy)
    tv.accumulate_clipped_grads(model, nn.CrossEntropyLoss(), x, y, max_norm=1.0,
                                strategy=strategy)
    for d in dicts:
        assert dict(getattr(mod, d)) == before[d], d


class _RegisteredTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = self.a  # the same module under a second name
        self.head = nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.ones(5))  # no rule: the fallback runs

    def forward(self, x):
        return self.head(self.b(torch.tanh(self.a(x))) * self.scale)


@pytest.mark.parametrize("strategy", ["auto", "vmap", "loop"])
def test_a_module_registered_under_two_names_keeps_its_parameters(strategy):
    # torch.func.functional_call leaves such a module holding detached substitutes; the
    # next calls then left its weights out (they no longer required grad)
    torch.manual_seed(0)
    model = _RegisteredTwice().to(DT)
    params = {n: p for n, p in model.named_parameters()}
    x, y = torch.randn(4, 5, dtype=DT), torch.tensor([0, 1, 2, 1])
    ref = loop_reference(model, nn.CrossEntropyLoss(), x, y)
    for _ in range(2):
        assert_matches(tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y,
                                           strategy=strategy), ref)
        torch.testing.assert_close(
            tv.per_sample_grad_norms(model, nn.CrossEntropyLoss(), x, y, strategy=strategy),
            torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1))
        for n, p in model.named_parameters():
            assert p is params[n] and isinstance(p, nn.Parameter), n
        assert model.a.weight is model.b.weight


class _ReassignsItsBuffer(nn.Module):
    """Assigns a new tensor to its buffer on every forward (a step counter's idiom)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("scale", torch.ones((), dtype=DT))

    def forward(self, x):
        out = self.fc(x) * self.scale
        self.scale = self.scale * 2
        return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_buffer_the_forward_reassigns_is_put_back_by_name(strategy):
    # every example runs from the caller's buffer, and the caller gets the same tensor
    # object back (it was left at 16, and each example ran with the previous one's)
    torch.manual_seed(0)
    model = _ReassignsItsBuffer().to(DT)
    original = model.scale
    x, y = torch.randn(4, 3, dtype=DT), torch.tensor([0, 1, 1, 0])
    ref = {}
    for i in range(4):
        model.scale = original
        loss = nn.CrossEntropyLoss()(model(x[i:i + 1]), y[i:i + 1])
        for (n, _), g in zip(model.named_parameters(),
                             torch.autograd.grad(loss, list(model.parameters()))):
            ref.setdefault(n, []).append(g)
    model.scale = original
    ref = {n: torch.stack(g) for n, g in ref.items()}
    for _ in range(2):
        assert_matches(tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y,
                                           strategy=strategy), ref)
        assert model.scale is original and float(original) == 1.0
        tv.per_sample_grad_norms(model, nn.CrossEntropyLoss(), x, y, strategy=strategy)
        assert model.scale is original and float(original) == 1.0


class _ReassignsItsParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.w = nn.Parameter(torch.randn(2, dtype=DT))

    def forward(self, x):
        out = self.fc(x) * self.w
        self.w = nn.Parameter(self.w.detach() * 2)  # a new Parameter on every forward
        return out


class _RegistersABufferOnFirstCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        if not hasattr(self, "count"):
            self.register_buffer("count", torch.tensor(1.0, dtype=DT))
        else:
            self.count = self.count + 1
        return self.fc(x) * self.count


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cls", [_ReassignsItsParameter, _RegistersABufferOnFirstCall])
def test_what_a_forward_assigns_or_registers_is_put_back(strategy, cls):
    # every example (and every planning run) starts from the caller's model, which comes
    # back holding the same objects (was: results off by up to 1e154, or a hang rerouting a
    # parameter the plan thought no gradient reaches)
    torch.manual_seed(0)
    model = cls().to(DT)
    x, y = torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)
    loss_fn = lambda o, t: ((o - t) ** 2).sum()  # noqa: E731
    ref = {}
    for i in range(4):
        alone = copy.deepcopy(model)
        named = list(alone.named_parameters())
        loss = loss_fn(alone(x[i:i + 1]), y[i:i + 1])
        for (n, p), g in zip(named, torch.autograd.grad(loss, [p for _, p in named])):
            ref.setdefault(n, []).append(g)
    ref = {n: torch.stack(g) for n, g in ref.items()}
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    for _ in range(2):
        try:
            got = tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
        except tv.StrategyError:
            assert strategy == "hooks" and cls is _ReassignsItsParameter  # 'w': no rule
        else:
            assert_matches(got, ref)
            torch.testing.assert_close(
                tv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy),
                torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1))
        assert dict(model.named_parameters()) == params
        assert all(b is buffers[n] for n, b in model.named_buffers())
        assert dict(model.named_buffers()).keys() == buffers.keys()


# ------------------------------------------------------------------------------------------
# Forwards the planning or the recording cannot run as they are
# ------------------------------------------------------------------------------------------


class RepeatsTable(nn.Module):
    """Projects a table of one row and repeats it over the batch by hand (DeBERTa's
    relative positions): expanding the projection to the batch, as the plan first tries,
    makes the repeat B times too large."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, 3, 4))
        self.proj = nn.Linear(4, 4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        rel = self.proj(self.table).repeat(x.shape[0], 1, 1)
        return self.fc(torch.tanh(x + rel)).sum(1)


class MarksItsInput(nn.Module):
    """Sets requires_grad on a view of its input (Wav2Vec2's feature encoder in training)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        h = x[:, None]
        h.requires_grad = True
        return self.fc(h.squeeze(1))


class FrozenEncoder(nn.Module):
    """A frozen nn.TransformerEncoder with a padding mask in eval mode turns its input into a
    nested tensor, which its attention handles only on its fast path; the head alone is
    trained, and the recording leaves the frozen attention unhooked (a hook would turn that
    path off)."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1)
        self.out = nn.Linear(8, 3)

    def forward(self, x, mask):
        return self.out(self.enc(x, src_key_padding_mask=mask)[:, 0])


def _frozen_encoder():
    model = FrozenEncoder().to(DT).eval()
    for p in model.enc.parameters():
        p.requires_grad_(False)
    x = torch.randn(4, 5, 8, dtype=DT)
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[1, 3:] = True
    mask[3, 1:] = True
    return model, (x, mask)


@pytest.mark.filterwarnings("ignore::UserWarning")  # nested tensors are a prototype
@pytest.mark.parametrize("case", ["repeats-table", "marks-its-input", "frozen-encoder"])
def test_forwards_the_recording_cannot_run_as_they_are_go_to_the_fallback(case):
    torch.manual_seed(0)
    if case == "frozen-encoder":
        model, xs = _frozen_encoder()
    else:
        model = (RepeatsTable if case == "repeats-table" else MarksItsInput)().to(DT).train()
        xs = (torch.randn(5, 3, 4, dtype=DT) if case == "repeats-table"
              else torch.randn(5, 4, dtype=DT),)
    loss_fn = lambda o: o.pow(2).sum()  # noqa: E731
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    rows = {n: [] for n in names}
    for i in range(xs[0].shape[0]):
        loss = loss_fn(model(*(x[i:i + 1] for x in xs)))
        grads = torch.autograd.grad(loss, [dict(model.named_parameters())[n] for n in names])
        for n, g in zip(names, grads):
            rows[n].append(g)
    ref = {n: torch.stack(v) for n, v in rows.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.TorchVJPWarning)  # auto's loop fallback
        assert_matches(tv.per_sample_grads(model, loss_fn, xs), ref)
        norms = tv.per_sample_grad_norms(model, loss_fn, xs)
    torch.testing.assert_close(norms, torch.cat([g.flatten(1) for g in ref.values()], 1)
                               .norm(dim=1))
    if case != "repeats-table":  # its layers keep their rules
        assert_matches(tv.per_sample_grads(model, loss_fn, xs, strategy="hooks"), ref)
    else:
        with pytest.raises(tv.StrategyError, match="no dimension that could hold the"):
            tv.per_sample_grads(model, loss_fn, xs, strategy="hooks")


# --------------------------------------------------------------------------------------
# Plans made again, or made right, where what they were made under has changed
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["auto", "vmap", "loop"])
def test_a_gradient_hook_registered_after_the_first_call_is_applied_to_each_example(strategy):
    # NOTE [gradient hooks on a parameter]: the plan made before the hook computed the weight
    # by rules (or vmap), which never see the hook: rows 0-2 came out non-zero, silently
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
    tv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy)
    mask = torch.ones(6, 4, dtype=DT)
    mask[:3] = 0
    model[0].weight.register_hook(lambda g: g * mask)
    ref = loop_reference(model, loss_fn, x, y)
    assert ref["0.weight"][:, :3].abs().max() == 0
    assert_matches(tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy), ref)
    norms = torch.stack([torch.cat([g[i].flatten() for g in ref.values()]).norm()
                         for i in range(5)])
    torch.testing.assert_close(tv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy),
                               norms)
    model.zero_grad(set_to_none=True)
    tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=0.5, strategy=strategy)
    factor = (0.5 / norms).clamp(max=1.0)
    torch.testing.assert_close(model[0].weight.grad,
                               (ref["0.weight"] * factor[:, None, None]).sum(0))
    if strategy != "loop":
        row = tv.per_sample_plan(model, loss_fn, x, y, strategy=strategy)["0.weight"]
        assert row.method == "loop" and "register_hook" in row.reason


def test_hooks_refuses_a_parameter_with_a_gradient_hook_naming_it():
    model = nn.Sequential(nn.Linear(4, 3)).to(DT)
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
    model[0].weight.register_hook(lambda g: g * 2)
    with pytest.raises(tv.StrategyError, match=r"'0\.weight': a gradient hook is registered on "
                                               r"it \(Tensor\.register_hook\)"):
        tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")


class _Temperature(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(p), nn.Linear(8, 3))
        self.temperature = nn.Parameter(torch.ones(3))  # used directly in forward: no rule

    def forward(self, x):
        return self.body(x) * self.temperature


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_a_first_call_under_no_grad_plans_as_in_grad_mode(strategy):
    # planning took its loss outside its grad block: under the caller's no_grad the graph
    # walk saw no gradient reach the temperature and planned it 'zero' (with dropout in
    # training the first-call check is skipped: zero from then on, silently)
    torch.manual_seed(0)
    model = _Temperature().to(DT).eval()
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    with torch.no_grad():
        row = tv.per_sample_plan(model, loss_fn, x, y)["temperature"]
    assert row.method != "zero"
    if strategy == "hooks":  # no rule reaches it: refused for that reason, in any grad mode
        with torch.no_grad(), pytest.raises(tv.StrategyError, match="'temperature'"):
            tv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy)
        return
    with torch.no_grad():
        got = tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
    assert_matches(got, loop_reference(model, loss_fn, x, y))
    model.train()  # dropout with p=0 draws from the global generator: no first-call check
    with torch.no_grad():
        tv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy)
    assert_matches(tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy),
                   loop_reference(model, loss_fn, x, y))


class _Layout(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.o = nn.Linear(4, 6), nn.Linear(6, 3)
        self.time_major = False

    def forward(self, x):  # x: (B, T, 4)
        if self.time_major:  # the same function of x, the Linear sees (T, B, 4)
            h = self.l(x.transpose(0, 1)).transpose(0, 1)
        else:
            h = self.l(x)
        return self.o(torch.tanh(h).mean(1))


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_an_attribute_that_moves_the_batch_dimension_of_a_layer_makes_a_new_plan(strategy):
    torch.manual_seed(0)
    model = _Layout().to(DT)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(5, 7, 4, dtype=DT), torch.randint(0, 3, (5,))
    tv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy)
    model.time_major = True
    ref = loop_reference(model, loss_fn, x, y)
    assert_matches(tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy), ref)
    norms = torch.stack([torch.cat([g[i].flatten() for g in ref.values()]).norm()
                         for i in range(5)])
    torch.testing.assert_close(tv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy),
                               norms)


class _Reentrant(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.b(checkpoint(lambda h: torch.tanh(self.a(h)), x, use_reentrant=True))


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_a_reentrant_checkpoint_is_planned_as_backward_sees_it(strategy):
    # planning made the inputs require grad, and the reentrant checkpoint then refused the
    # plan's autograd.grad with inputs=: torch's raw RuntimeError. Its input does not
    # require grad, so backward (and the loop) give the checkpointed block no gradient.
    torch.manual_seed(0)
    model = _Reentrant().to(DT)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's: no input requires grad
        ref = loop_reference(model, loss_fn, x, y)
        got = tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
        norms = tv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy)
    assert ref["a.weight"].abs().max() == 0
    assert_matches(got, ref)
    torch.testing.assert_close(norms, torch.stack(
        [torch.cat([g[i].flatten() for g in ref.values()]).norm() for i in range(5)]))


@pytest.mark.parametrize("wrap", ["parametrization", "weight_norm"])
def test_hooks_on_a_layer_whose_weight_is_computed_says_so(wrap):
    # the message said "its module '0' is a Linear, which has no per-layer rule" (it has one)
    from torch.nn.utils import parametrizations, weight_norm

    layer = nn.Linear(4, 3).to(DT)
    layer = parametrizations.weight_norm(layer) if wrap == "parametrization" else weight_norm(layer)
    model = nn.Sequential(layer)
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (torch's, on the old weight_norm)
        with pytest.raises(tv.StrategyError, match=r"module '0' is a (Parametrized)?Linear, "
                                                   r"which has a rule, but the layer is called "
                                                   r"with a weight computed from its parameters"):
            tv.per_sample_grad_norms(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
        assert_matches(tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y),
                       loop_reference(model, nn.CrossEntropyLoss(), x, y))


class _ReadsLayerWeights(nn.Module):
    """Reads a Linear's and a LayerNorm's parameters without calling the layers."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.ln = nn.LayerNorm(3)

    def forward(self, x):
        return torch.tanh(x @ (self.lin.weight * 2)) * self.ln.weight


class _HeadInLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.head = nn.Linear(4, 3)  # called by the loss function only

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("where", ["forward", "loss"])
def test_a_layer_with_a_rule_whose_parameters_are_read_directly_says_so(where):
    # the reason said "its module 'lin' is a Linear, which has no per-layer rule"
    torch.manual_seed(0)
    x, y = torch.randn(5, 3, dtype=DT), torch.randint(0, 3, (5,))
    if where == "forward":
        model, loss_fn, name, kind = _ReadsLayerWeights().to(DT), nn.CrossEntropyLoss(), \
            "lin", "Linear"
    else:
        model = _HeadInLoss().to(DT)
        loss_fn, name, kind = (lambda o, t: F.cross_entropy(model.head(o), t)), "head", "Linear"
    with pytest.raises(tv.StrategyError, match=rf"'{name}\.weight': its module '{name}' "
                       rf"\({kind}\) has a rule but is not called: the parameter is read "
                       rf"directly \(by a forward, or by the loss function\)"):
        tv.per_sample_grads(model, loss_fn, x, y, strategy="hooks")
    if where == "forward":
        assert tv.per_sample_plan(model, loss_fn, x, y)["ln.weight"].reason.startswith(
            "its module 'ln' (LayerNorm) has a rule but is not called")


def test_vmap_with_a_loss_that_reads_a_parameter_says_so():
    # the loss holds the model's parameter itself, where vmap's copies do not reach (one
    # read through the model, model.bias, reads the copy): the check against the loop
    # refuses, and said only "randomness drawn with a generator"
    torch.manual_seed(0)
    model = nn.Linear(3, 4).to(DT)
    x, y = torch.randn(5, 3, dtype=DT), torch.randint(0, 4, (5,))
    bias = model.bias
    def loss_fn(o, t):
        return F.cross_entropy(o * bias.sum(), t)
    with pytest.raises(tv.PerSampleError, match=r"(?s)strategy='vmap' gives wrong per-sample "
                       r"gradients .*or a parameter the loss function reads itself, which "
                       r"vmap's copies of the parameters do not reach\)"):
        tv.per_sample_grads(model, loss_fn, x, y, strategy="vmap")
    # the definition is what auto computes
    assert_matches(tv.per_sample_grads(model, loss_fn, x, y),
                   _reference_reading(model, loss_fn, x, y))


def _reference_reading(model, loss_fn, x, y):
    ps = dict(model.named_parameters())
    rows = [torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), list(ps.values()))
            for i in range(x.shape[0])]
    return {n: torch.stack([r[j] for r in rows]) for j, n in enumerate(ps)}


# --------------------------------------------------------------------------------------
# A plan is for one structure (NOTE [the structure a plan is for]): a module replaced, a
# forward hook added or a flag of the model's own modules switched after the first call
# makes a new one
# --------------------------------------------------------------------------------------


class Center(nn.Module):
    """Mixes examples: each is centred by the batch mean."""

    def forward(self, h):
        return h - h.mean(0, keepdim=True)


class Switchable(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 2)
        self.center = False
        self.calls = 0  # a counter: numbers are not part of the structure

    def forward(self, x):
        self.calls += 1
        h = self.a(x)
        return self.b(h - h.mean(0, keepdim=True) if self.center else h)


def _sin_loss(o):
    return o.sin().sum()


def test_a_replaced_submodule_makes_a_new_plan():
    x = torch.randn(4, 3, dtype=DT)
    m = nn.Sequential(nn.Linear(3, 3), nn.Identity(), nn.Linear(3, 2)).double()
    assert_matches(tv.per_sample_grads(m, _sin_loss, x), loop_reference(m, _sin_loss, x))
    m[1] = Center()
    for fn in (tv.per_sample_grads, tv.per_sample_grad_norms):
        with pytest.raises(tv.PerSampleError, match=r"module '1' \(Center\) mixes examples"):
            fn(m, _sin_loss, x)


def test_a_forward_hook_added_later_makes_a_new_plan():
    x = torch.randn(4, 3, dtype=DT)
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    tv.per_sample_grads(m, _sin_loss, x)
    m.register_forward_pre_hook(lambda mod, args: (args[0].flip(0),))  # reverses the batch
    ref = loop_reference(m, _sin_loss, x)
    assert_matches(tv.per_sample_grads(m, _sin_loss, x), ref)
    norms = tv.per_sample_grad_norms(m, _sin_loss, x)
    torch.testing.assert_close(norms, torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1))


def test_a_flag_of_the_models_own_module_makes_a_new_plan():
    x = torch.randn(4, 3, dtype=DT)
    m = Switchable().double()
    assert_matches(tv.per_sample_grads(m, _sin_loss, x), loop_reference(m, _sin_loss, x))
    plans = plan_module._PLANS[m]
    count = len(plans)
    tv.per_sample_grads(m, _sin_loss, x)  # the counter moved: the same plan
    assert len(plans) == count
    m.center = True
    with pytest.raises(tv.PerSampleError, match=r"mixes examples"):
        tv.per_sample_grad_norms(m, _sin_loss, x)


class MaskedAttention(nn.Module):
    """A float mask per example, folded with the heads into attention's (B * heads, T, T)."""

    def __init__(self):
        super().__init__()
        self.a = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x, mask):
        B, H, T, _ = mask.shape
        return self.a(x, x, x, attn_mask=mask.reshape(B * H, T, T), need_weights=False)[0]


class FoldedMixer(nn.Module):
    """Mixes examples through an input folded as (B * T, F): a softmax over all rows."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        B, T, F_ = x.shape
        h = self.fc(x).reshape(B * T, F_)
        return (torch.softmax(h, 0) * h).reshape(B, T, F_)


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_a_per_example_mask_folded_with_the_heads_is_not_mixing(strategy):
    # B == T: the mask's T-sized dimensions were read as batch dimensions, and the model was
    # refused as one that mixes examples
    m = MaskedAttention().double()
    x = torch.randn(3, 3, 4, dtype=DT)
    mask = torch.randn(3, 2, 3, 3, dtype=DT)
    got = tv.per_sample_grad_norms(m, _sin_loss, (x, mask), strategy=strategy)
    torch.testing.assert_close(got, tv.per_sample_grad_norms(m, _sin_loss, (x, mask),
                                                             strategy="loop"))


def test_an_input_folded_with_the_batch_that_mixes_is_still_found():
    m = FoldedMixer().double()
    with pytest.raises(tv.PerSampleError, match=r"mixes examples"):
        tv.per_sample_grad_norms(m, _sin_loss, torch.randn(4, 4, 4, dtype=DT))


class _Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.gate = nn.Parameter(torch.ones(3))

    def forward(self, x):
        o = self.fc(x)
        return o * self.gate if USE_GATE else o


USE_GATE = False
L2 = 0.0


def _l2_loss(model):
    def loss_fn(out, t):
        loss = F.cross_entropy(out, t)
        if L2:
            loss = loss + L2 * model[0].weight.pow(2).sum()
        return loss
    return loss_fn


def test_a_loss_term_switched_on_after_the_first_call_makes_a_new_plan(monkeypatch):
    # the plan was keyed on the loss's code alone: the L2 term's gradient was left out of
    # every later call, silently, under 'auto', 'hooks' and 'vmap'
    model = nn.Sequential(nn.Linear(4, 3)).double()
    loss_fn = _l2_loss(model)
    x, t = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    tv.per_sample_grads(model, loss_fn, x, t)
    monkeypatch.setattr(sys.modules[__name__], "L2", 0.5)
    assert_matches(tv.per_sample_grads(model, loss_fn, x, t),
                   loop_reference(model, loss_fn, x, t))
    with pytest.raises(tv.StrategyError, match=r"'0\.weight': it is used outside the layers"):
        tv.per_sample_grads(model, loss_fn, x, t, strategy="hooks")


def test_a_global_flag_a_forward_reads_makes_a_new_plan(monkeypatch):
    # a parameter the first call did not reach was planned as zero for good
    model = _Gated().double()
    x, t = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    loss = nn.CrossEntropyLoss()
    tv.per_sample_grads(model, loss, x, t)
    monkeypatch.setattr(sys.modules[__name__], "USE_GATE", True)
    got = tv.per_sample_grads(model, loss, x, t)
    assert_matches(got, loop_reference(model, loss, x, t))
    assert got["gate"].abs().max() > 0


def test_a_hook_registered_around_every_step_keeps_the_plan():
    # the plan key held the hooks' handle ids: a hook registered and removed each step made
    # a new plan (several model runs) on every call
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x, t = torch.randn(5, 4, dtype=DT), torch.randint(0, 2, (5,))
    loss = nn.CrossEntropyLoss()
    for _ in range(3):
        handle = model[0].register_forward_hook(lambda m, i, o: None)
        tv.per_sample_grads(model, loss, x, t)
        handle.remove()
    assert len(plan_module._PLANS[model]) == 1


def _scale_hook(mod, inp, out, k):
    return out * k  # per example


def _center_hook(mod, inp, out):
    return out - out.mean(0)  # mixes the examples of the batch


def _hook_factory(k):
    return lambda mod, inp, out: out + k * out.mean(0)


@pytest.mark.parametrize("swap", ["partial", "closure"])
def test_a_hook_swapped_for_one_of_the_same_code_makes_a_new_plan(swap):
    # hooks counted by their code alone: every functools.partial had the same key, and
    # closures from one factory too; a hook that mixes examples took the plan of a benign
    # one (gradients off by 1.07, norms by 1.46, silently)
    x, t = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    loss = nn.CrossEntropyLoss()
    first, second = ((functools.partial(_scale_hook, k=2.0), functools.partial(_center_hook))
                     if swap == "partial" else (_hook_factory(0.0), _hook_factory(1.0)))
    handle = m[0].register_forward_hook(first)
    assert_matches(tv.per_sample_grads(m, loss, x, t), loop_reference(m, loss, x, t))
    handle.remove()
    m[0].register_forward_hook(second)
    with pytest.raises(tv.PerSampleError, match=r"mixes examples"):
        tv.per_sample_grads(m, loss, x, t)
    assert_matches(tv.per_sample_grads(m, loss, x, t, strategy="loop"),
                   loop_reference(m, loss, x, t))


class _FlagHook:
    def __init__(self, mix):
        self.mix = mix
        self.seen = []

    def __call__(self, mod, inp, out):
        return out - out.mean(0, keepdim=True) if self.mix else 2 * out

    def record(self, mod, inp, out):
        self.seen.append(out.detach())


def test_hook_objects_count_by_their_flags_not_their_identity():
    # a callable hook object counted by its type alone: Hook(mix=True) took Hook(mix=False)'s
    # plan (silently wrong); a bound method counted by its object's identity: a tracker made
    # afresh each step made a new plan (several model runs) every step
    x, t = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    loss = nn.CrossEntropyLoss()
    handle = m[0].register_forward_hook(_FlagHook(False))
    assert_matches(tv.per_sample_grads(m, loss, x, t), loop_reference(m, loss, x, t))
    handle.remove()
    handle = m[0].register_forward_hook(_FlagHook(True))
    with pytest.raises(tv.PerSampleError, match=r"mixes examples"):
        tv.per_sample_grads(m, loss, x, t)
    handle.remove()
    plans = plan_module._PLANS[m]
    for step in range(3):
        tracker = _FlagHook(False)
        handle = m[0].register_forward_hook(tracker.record)
        tv.per_sample_grads(m, loss, x, t)
        handle.remove()
        if step == 0:  # (a new hook: planned and checked against the loop)
            count = len(plans)
        else:
            assert len(tracker.seen) == 1  # one model run: the plan was kept
    assert len(plans) == count


_FLAG = {"on": False}


def _dict_flag_hook(mod, inp, out):
    return out - out.mean(0, keepdim=True) if _FLAG["on"] else 2 * out


def _dict_flag_partial(flag, mod, inp, out):
    return out - out.mean(0, keepdim=True) if flag["on"] else 2 * out


class _DictFlagHooks:
    def __init__(self, flag):
        self.cfg = flag

    def hook(self, mod, inp, out):
        return out - out.mean(0, keepdim=True) if self.cfg["on"] else 2 * out

    __call__ = hook


class _GlobalFlagHook:
    # (reads a global dict, not an attribute: its __call__'s globals were not keyed)
    def __call__(self, mod, inp, out):
        return out - out.mean(0, keepdim=True) if _FLAG["on"] else 2 * out


@pytest.mark.parametrize("kind", ["global", "closure", "partial", "method", "object",
                                  "object-global", "partial-object"])
def test_a_hook_reading_a_flag_in_a_dict_makes_a_new_plan_when_it_is_switched(kind):
    # hooks were keyed by route_key, which reads a dict by its identity only: switching
    # flag["on"] on kept the plan made with it off, the hook then mixed the examples and
    # the gradients were off by 0.36 with no error (loss functions read the entries)
    x, t = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    loss = nn.CrossEntropyLoss()
    flag = _FLAG if kind in ("global", "object-global") else {"on": False}
    flag["on"] = False
    hook = (_dict_flag_hook if kind == "global" else
            _GlobalFlagHook() if kind == "object-global" else
            functools.partial(_DictFlagHooks(flag)) if kind == "partial-object" else
            functools.partial(_dict_flag_partial, flag) if kind == "partial" else
            _DictFlagHooks(flag).hook if kind == "method" else
            _DictFlagHooks(flag) if kind == "object" else
            (lambda mod, inp, out: out - out.mean(0, keepdim=True) if flag["on"] else 2 * out))
    m[0].register_forward_hook(hook)
    try:
        for _ in range(2):  # (the dict unchanged: the plan is kept)
            assert_matches(tv.per_sample_grads(m, loss, x, t), loop_reference(m, loss, x, t))
        assert len(plan_module._PLANS[m]) == 1
        flag["on"] = True
        with pytest.raises(tv.PerSampleError, match=r"mixes examples"):
            tv.per_sample_grads(m, loss, x, t)
    finally:
        _FLAG["on"] = False


_CFG_MODULE = types.ModuleType("user_config")  # (a config module: import cfg; cfg.MIX)
_CFG_MODULE.MIX = False


class _CfgClass:  # (a config class: Config.MIX)
    MIX = False


def _module_flag_hook(mod, inp, out):
    return out - out.mean(0, keepdim=True) if _CFG_MODULE.MIX else 2 * out


def _class_flag_hook(mod, inp, out):
    return out - out.mean(0, keepdim=True) if _CfgClass.MIX else 2 * out


@pytest.mark.parametrize("kind", ["module", "class"])
def test_a_hook_reading_a_flag_of_a_config_module_makes_a_new_plan_when_it_is_switched(kind):
    # modules and classes were never read one level deep for flags: a hook reading cfg.MIX
    # (or Config.MIX) kept the plan made with it off; with it on the gradients were off by
    # 0.85, no error
    x, t = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    loss = nn.CrossEntropyLoss()
    cfg = _CFG_MODULE if kind == "module" else _CfgClass
    m[0].register_forward_hook(_module_flag_hook if kind == "module" else _class_flag_hook)
    try:
        for _ in range(2):  # (unchanged: the plan is kept)
            assert_matches(tv.per_sample_grads(m, loss, x, t), loop_reference(m, loss, x, t))
        assert len(plan_module._PLANS[m]) == 1
        cfg.MIX = True
        with pytest.raises(tv.PerSampleError, match=r"mixes examples"):
            tv.per_sample_grads(m, loss, x, t)
    finally:
        cfg.MIX = False


class _Mixer:
    def __init__(self, alpha):
        self.alpha = alpha

    def hook(self, mod, inp, out):
        return out + self.alpha * out.mean(0, keepdim=True)


class _SlotsMixer:
    __slots__ = ("alpha",)

    def __init__(self, alpha):
        self.alpha = alpha

    def __call__(self, mod, inp, out):
        return out + self.alpha * out.mean(0, keepdim=True)


@pytest.mark.parametrize("kind", ["float", "numpy", "tensor", "slots"])
def test_a_hook_objects_number_counts_by_its_truth(kind):
    # a fresh hook object whose mixing weight went from 0.0 to 0.5 took the plan made when it
    # mixed nothing (off by 0.80 from the loop, silently)
    x, y = torch.randn(4, 5, dtype=DT), torch.randn(4, 1, dtype=DT)
    m = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    loss = nn.MSELoss(reduction="sum")
    import numpy as np

    def make(alpha):
        value = {"float": float, "numpy": np.float64, "tensor": torch.tensor,
                 "slots": float}[kind](alpha)
        return _SlotsMixer(value) if kind == "slots" else _Mixer(value).hook

    handle = m[0].register_forward_hook(make(0.0))
    assert_matches(tv.per_sample_grads(m, loss, x, y), loop_reference(m, loss, x, y))
    handle.remove()
    m[0].register_forward_hook(make(0.5))
    with pytest.raises(tv.PerSampleError, match=r"mixes examples"):
        tv.per_sample_grads(m, loss, x, y)
