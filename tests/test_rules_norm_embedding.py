"""Per-layer rules for InstanceNorm and EmbeddingBag (and the channels-first normalisation
rules on a batch of one), against a per-example loop in float64.

Every case runs under ``strategy="hooks"``, which raises where a parameter has no rule, so a
passing case shows that the rule itself computed the result; the plan must name the rule.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import torch_vjp as tv

DT = torch.float64
V, D = 10, 4  # EmbeddingBag table


# ------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------

_INSTANCE = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}
_SPATIAL = {1: (5,), 2: (3, 4), 3: (2, 3, 2)}


class NormNet(nn.Module):
    """Linear -> ``(B, C, *S)`` -> a normalisation layer -> Linear.

    With ``unbatched`` the layer sees the one example's ``(C, *S)`` (a batch of one only).
    """

    def __init__(self, make_norm, dims: int, unbatched: bool = False):
        super().__init__()
        self.shape = (3, *_SPATIAL[dims])
        n = math.prod(self.shape)
        self.inp = nn.Linear(2, n)
        self.norm = make_norm(3)
        self.out = nn.Linear(n, 3)
        self.unbatched = unbatched

    def forward(self, x):
        h = self.inp(x).unflatten(1, self.shape)
        h = self.norm(h[0]).unsqueeze(0) if self.unbatched else self.norm(h)
        return self.out(torch.tanh(h).flatten(1))


def norm_net(kind: str, dims: int, *, track=False, eval_mode=False, unbatched=False):
    make = {
        "instance": lambda c: _INSTANCE[dims](c, affine=True, track_running_stats=track),
        "group": lambda c: nn.GroupNorm(1, c),
        "batch": lambda c: nn.BatchNorm1d(c) if dims == 1 else nn.BatchNorm2d(c),
    }[kind]

    def factory():
        model = NormNet(make, dims, unbatched)
        with torch.no_grad():  # affine maps and running statistics away from 0 and 1
            model.norm.weight.normal_()
            model.norm.bias.normal_()
            if getattr(model.norm, "running_mean", None) is not None:
                model.norm.running_mean.normal_()
                model.norm.running_var.uniform_(0.5, 2.0)
        return model.eval() if eval_mode else model

    return factory


class BagNet(nn.Module):
    """An EmbeddingBag over each example's indices, then a Linear.

    Inputs: ``idx (B, T)`` indices, ``lengths (B,)`` and ``weights (B, T)``. With
    ``layout="2d"`` the bag gets ``idx`` as it is (one bag per row); with ``"1d"``, the
    first ``lengths[i]`` indices of each row concatenated, with ``offsets`` (a bag per
    example, empty where ``lengths[i] == 0``). ``weighted`` passes the matching
    ``per_sample_weights``; ``learned_weights`` computes them from a Linear of ``weights``.
    """

    def __init__(self, layout, weighted=False, learned_weights=False, **bag_kw):
        super().__init__()
        self.layout = layout
        self.weighted = weighted or learned_weights
        self.score = nn.Linear(1, 1) if learned_weights else None
        self.bag = nn.EmbeddingBag(V, D, **bag_kw)
        self.fc = nn.Linear(D, 3)

    def forward(self, idx, lengths, weights):
        if self.score is not None:
            weights = torch.sigmoid(self.score(weights.unsqueeze(-1))).squeeze(-1)
        if self.layout == "2d":
            args = (idx, None, weights) if self.weighted else (idx,)
        else:
            keep = torch.arange(idx.shape[1]) < lengths.unsqueeze(1)
            ends = lengths.cumsum(0)
            if self.bag.include_last_offset:
                offsets = torch.cat([ends.new_zeros(1), ends])
            else:
                offsets = torch.cat([ends.new_zeros(1), ends[:-1]])
            # flattened, the weights have no dimension of size B, where the plan's probe
            # would take their gradient for mixing (see test_flat_weights_that_require_grad)
            flat = weights[keep] if self.score is not None else weights[keep].detach()
            args = (idx[keep], offsets, flat) if self.weighted else (idx[keep], offsets)
        return self.fc(torch.tanh(self.bag(*args)))


class BagTwice(nn.Module):
    """One EmbeddingBag called on two inputs (its factors merge), in mode ``max``."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, mode="max")
        self.fc = nn.Linear(D, 3)

    def forward(self, idx, lengths, weights):
        return self.fc(self.bag(idx) * self.bag(idx.flip(1)[:, :2]))


class BagTied(nn.Module):
    """An EmbeddingBag whose table is also an Embedding's (factors of two kinds on one
    parameter)."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, mode="mean", padding_idx=0)
        self.emb = nn.Embedding(V, D)
        self.emb.weight = self.bag.weight
        self.fc = nn.Linear(D, 3)

    def forward(self, idx, lengths, weights):
        return self.fc(self.bag(idx) + self.emb(idx[:, 0]))


class BagShared(nn.Module):
    """An EmbeddingBag of a bag every example shares: ``ids`` of shape ``(1, T)`` (with
    ``per_sample_weights``), or one index as a 1-D input of shape ``(1,)`` with offsets; the
    recorder expands the call to the batch."""

    def __init__(self, layout="2d", mode="sum"):
        super().__init__()
        self.layout = layout
        self.register_buffer("ids", torch.tensor([[1, 4, 4, 7]]) if layout == "2d"
                             else torch.tensor([6]))
        self.bag = nn.EmbeddingBag(V, D, mode=mode)
        self.fc = nn.Linear(D, 3)

    def forward(self, idx, lengths, weights):
        if self.layout == "2d":
            w = torch.linspace(0.5, 2.0, 4, dtype=weights.dtype)[None]
            h = self.bag(self.ids, None, w)
        else:
            h = self.bag(self.ids, torch.zeros(1, dtype=torch.long))
        return self.fc(torch.tanh(h + weights[:, :1]))


def bag_inputs(B, T=4, lengths=None):
    def make():
        idx = torch.randint(0, V, (B, T))
        idx[:, 1] = idx[:, 0]  # repeated indices within a bag
        lens = torch.tensor(lengths) if lengths is not None else torch.full((B,), T)
        return idx, lens, torch.rand(B, T, dtype=DT) + 0.5

    return make


def vec_inputs(B):
    return lambda: torch.randn(B, 2, dtype=DT)


# id -> (model factory, inputs factory, batch, {parameter: rule name in the plan})
_IN = {"norm.weight": "InstanceNorm", "norm.bias": "InstanceNorm"}
_BAG = {"bag.weight": "EmbeddingBag"}
_LENS = [3, 0, 4, 1, 2]  # an empty bag among them
CASES = {
    # InstanceNorm: each example's own statistics (training mode, or no running statistics)
    "instancenorm1d-train": (norm_net("instance", 1), vec_inputs(5), _IN),
    "instancenorm2d-train": (norm_net("instance", 2), vec_inputs(4), _IN),
    "instancenorm3d-train": (norm_net("instance", 3), vec_inputs(3), _IN),
    "instancenorm1d-eval-no-running-stats": (norm_net("instance", 1, eval_mode=True),
                                             vec_inputs(4), _IN),
    # ... and eval mode with running statistics
    "instancenorm1d-eval-running-stats": (norm_net("instance", 1, track=True, eval_mode=True),
                                          vec_inputs(4), _IN),
    "instancenorm2d-eval-running-stats": (norm_net("instance", 2, track=True, eval_mode=True),
                                          vec_inputs(4), _IN),
    "instancenorm3d-eval-running-stats": (norm_net("instance", 3, track=True, eval_mode=True),
                                          vec_inputs(3), _IN),
    # ... and training mode with running statistics: each example still normalised by its
    # own statistics (the running ones, which the forward updates, are put back)
    "instancenorm1d-train-running-stats": (norm_net("instance", 1, track=True),
                                           vec_inputs(4), _IN),
    "instancenorm2d-train-running-stats": (norm_net("instance", 2, track=True),
                                           vec_inputs(4), _IN),
    "instancenorm2d-batch-of-one": (norm_net("instance", 2), vec_inputs(1), _IN),
    "instancenorm1d-unbatched-input-batch-of-one": (
        norm_net("instance", 1, unbatched=True), vec_inputs(1), _IN),
    "instancenorm2d-eval-running-stats-batch-of-one": (
        norm_net("instance", 2, track=True, eval_mode=True), vec_inputs(1), _IN),
    # GroupNorm and BatchNorm (eval) share the channels-first handling of a batch of one
    "groupnorm-batch-of-one": (norm_net("group", 2), vec_inputs(1),
                               {"norm.weight": "GroupNorm"}),
    "batchnorm2d-eval-batch-of-one": (norm_net("batch", 2, eval_mode=True), vec_inputs(1),
                                      {"norm.weight": "BatchNorm (eval)"}),
    # EmbeddingBag with a 2-D input: a bag per row
    "bag2d-sum": (lambda: BagNet("2d", mode="sum"), bag_inputs(5), _BAG),
    "bag2d-mean-padding": (lambda: BagNet("2d", mode="mean", padding_idx=3), bag_inputs(5),
                           _BAG),
    "bag2d-max": (lambda: BagNet("2d", mode="max"), bag_inputs(5), _BAG),
    "bag2d-max-padding": (lambda: BagNet("2d", mode="max", padding_idx=3), bag_inputs(5),
                          _BAG),
    "bag2d-sum-weights-padding": (lambda: BagNet("2d", True, mode="sum", padding_idx=3),
                                  bag_inputs(5), _BAG),
    "bag2d-sum-learned-weights": (lambda: BagNet("2d", learned_weights=True, mode="sum"),
                                  bag_inputs(4), {**_BAG, "score.weight": "Linear"}),
    # ... with a 1-D input and offsets: a bag per example, one of them empty
    "bag1d-sum-offsets": (lambda: BagNet("1d", mode="sum"), bag_inputs(5, lengths=_LENS),
                          _BAG),
    "bag1d-mean-offsets-padding": (lambda: BagNet("1d", mode="mean", padding_idx=3),
                                   bag_inputs(5, lengths=_LENS), _BAG),
    "bag1d-max-offsets-padding": (lambda: BagNet("1d", mode="max", padding_idx=3),
                                  bag_inputs(5, lengths=_LENS), _BAG),
    "bag1d-sum-weights-include-last-offset": (
        lambda: BagNet("1d", True, mode="sum", include_last_offset=True),
        bag_inputs(5, lengths=_LENS), _BAG),
    "bag1d-mean-include-last-offset": (
        lambda: BagNet("1d", mode="mean", include_last_offset=True),
        bag_inputs(5, lengths=_LENS), _BAG),
    "bag1d-max-include-last-offset": (
        lambda: BagNet("1d", mode="max", include_last_offset=True, padding_idx=0),
        bag_inputs(5, lengths=_LENS), _BAG),
    # ... a batch of one
    "bag1d-max-batch-of-one": (lambda: BagNet("1d", mode="max"), bag_inputs(1, lengths=[3]),
                               _BAG),
    "bag1d-sum-weights-batch-of-one": (lambda: BagNet("1d", True, mode="sum", padding_idx=3),
                                       bag_inputs(1, lengths=[4]), _BAG),
    "bag2d-mean-batch-of-one": (lambda: BagNet("2d", mode="mean"), bag_inputs(1), _BAG),
    # ... called twice, tied to an Embedding, shared by every example
    "bag2d-max-called-twice": (BagTwice, bag_inputs(5), _BAG),
    "bag2d-mean-tied-with-embedding": (BagTied, bag_inputs(5),
                                       {"bag.weight": "EmbeddingBag"}),
    "bag2d-sum-weights-shared-by-all-examples": (BagShared, bag_inputs(4), _BAG),
    "bag1d-max-shared-by-all-examples": (lambda: BagShared("1d", "max"), bag_inputs(4), _BAG),
}


def make(case):
    factory, inputs, _ = CASES[case]
    torch.manual_seed(0)
    model = factory().to(DT)
    xs = inputs()
    xs = xs if isinstance(xs, tuple) else (xs,)
    return model, xs, torch.randint(0, 3, (xs[0].shape[0],))


LOSS = nn.CrossEntropyLoss()


def loop_reference(model, xs, t):
    """Per-example gradients by definition: one forward and backward per example."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = {n: [] for n, _ in named}
    for i in range(xs[0].shape[0]):
        loss = LOSS(model(*(x[i : i + 1] for x in xs)), t[i : i + 1])
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        for (n, p), g in zip(named, grads):
            rows[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(v) for n, v in rows.items()}


def ref_norms(ref):
    return torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)


# ------------------------------------------------------------------------------------------
# Each case against the loop
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_per_sample_grads(case):
    model, xs, t = make(case)
    ref = loop_reference(model, xs, t)
    got = tv.per_sample_grads(model, LOSS, xs, t, strategy="hooks")
    assert list(got) == list(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=f"{case}: {n}")


@pytest.mark.parametrize("case", list(CASES))
def test_per_sample_grad_norms(case):
    model, xs, t = make(case)
    ref = loop_reference(model, xs, t)
    got = tv.per_sample_grad_norms(model, LOSS, xs, t, strategy="hooks")
    torch.testing.assert_close(got, ref_norms(ref))


@pytest.mark.parametrize("case", list(CASES))
def test_accumulate_clipped_grads(case):
    model, xs, t = make(case)
    ref = loop_reference(model, xs, t)
    norms = ref_norms(ref)
    # the median clips about half of a batch; a batch of one is clipped to half its norm
    max_norm = float(norms.median()) if norms.numel() > 1 else 0.5 * float(norms[0])
    c = (max_norm / norms).clamp(max=1.0)
    assert bool((c < 1).any())
    got = tv.accumulate_clipped_grads(model, LOSS, xs, t, max_norm=max_norm, strategy="hooks")
    torch.testing.assert_close(got, norms)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, ref[n]), msg=n)


@pytest.mark.parametrize("case", list(CASES))
def test_plan_uses_the_rule(case):
    model, xs, t = make(case)
    plan = tv.per_sample_plan(model, LOSS, xs, t)
    assert {r.method for r in plan.rows} == {"rule"}, str(plan)
    for name, rule in CASES[case][2].items():
        assert plan[name].how.startswith(f"{rule} rule"), str(plan)


# ------------------------------------------------------------------------------------------
# Configurations the rules leave to the fallback, and a call they cannot read
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{"max_norm": 1.0}, {"scale_grad_by_freq": True}],
                         ids=["max-norm", "scale-grad-by-freq"])
def test_embedding_bag_configurations_without_a_rule_fall_back(kw):
    torch.manual_seed(0)
    model = BagNet("2d", mode="mean", **kw).to(DT)
    xs, t = bag_inputs(4)(), torch.randint(0, 3, (4,))
    plan = tv.per_sample_plan(model, LOSS, xs, t)
    # (vmap cannot batch embedding_renorm_: max_norm goes to the loop)
    assert plan["bag.weight"].method == ("loop" if "max_norm" in kw else "vmap")
    assert plan["fc.weight"].method == "rule"
    with pytest.raises(tv.StrategyError, match="bag.weight"):
        tv.per_sample_grads(model, LOSS, xs, t, strategy="hooks")


@pytest.mark.parametrize("how", ["offsets", "weights", "all"])
def test_embedding_bag_arguments_by_keyword(how):
    # the recorder binds the call to the forward's signature: arguments passed by keyword
    # reach the rule as if passed by position
    class Keyword(BagNet):
        def forward(self, idx, lengths, weights):
            offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
            keep = torch.arange(idx.shape[1]) < lengths.unsqueeze(1)
            flat, w = idx[keep], weights[keep]
            if how == "offsets":
                out = self.bag(flat, offsets=offsets, per_sample_weights=None)
            elif how == "weights":
                out = self.bag(flat, offsets, per_sample_weights=w)
            else:
                out = self.bag(input=flat, offsets=offsets, per_sample_weights=w)
            return self.fc(out)

    torch.manual_seed(0)
    model = Keyword("1d", mode="sum").to(DT)
    xs, t = bag_inputs(5, lengths=_LENS)(), torch.randint(0, 3, (5,))
    ref = loop_reference(model, xs, t)
    got = tv.per_sample_grads(model, LOSS, xs, t, strategy="hooks")
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)


def test_flat_weights_that_require_grad():
    # the flat weights have no dimension of size B: the plan cannot tell from their shape
    # whether the layer mixes examples, so it does not call it a mixer (the check against
    # the loop on the first call decides)
    torch.manual_seed(0)
    model = BagNet("1d", learned_weights=True, mode="sum").to(DT)
    xs, t = bag_inputs(5, lengths=_LENS)(), torch.randint(0, 3, (5,))
    ref = loop_reference(model, xs, t)
    got = tv.per_sample_grads(model, LOSS, xs, t, strategy="hooks")
    for n in ref:
        torch.testing.assert_close(got[n], ref[n])


@pytest.mark.parametrize("chunk_size", [1, 2, 4])
@pytest.mark.parametrize("case", ["bag1d-max-offsets-padding", "bag2d-mean-tied-with-embedding"])
def test_embedding_bag_chunks_of_examples(case, chunk_size):
    # written a range of examples at a time (the pairs of a range are a slice of the sorted
    # pairs); the tied table's norms are written that way too
    model, xs, t = make(case)
    ref = loop_reference(model, xs, t)
    got = tv.per_sample_grads(model, LOSS, xs, t, strategy="hooks", chunk_size=chunk_size)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)
