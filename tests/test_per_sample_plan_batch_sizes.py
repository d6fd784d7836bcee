"""Plans and batch sizes: a plan that refuses a model at one batch size does not replay at
another (NOTE [plans of one batch size] in torch_vjp/_per_sample/plan.py), and a plan made
at one size is checked again at each new one (NOTE [checked at each batch size] in
torch_vjp/_per_sample/verify.py); float64, against the per-example loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv

D = torch.float64


class _CentredWhenLarge(nn.Module):
    """Centres its features over the batch once the batch holds more than 4 examples: it
    mixes examples at those sizes only."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x):
        h = self.a(x)
        if x.shape[0] > 4:
            h = h - h.mean(0)
        return h


class _FailsWhenLarge(nn.Module):
    """A forward that fails on batches of more than 4 examples (a cache of 4 rows)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x):
        if x.shape[0] > 4:
            raise ValueError("the cache holds 4 rows")
        return self.a(x)


def _loss(out):
    return (out ** 2).sum() + out[:, 0].sum()


def _loop(model, x):
    names = [n for n, _ in model.named_parameters()]
    rows = [torch.autograd.grad(_loss(model(x[i:i + 1])), list(model.parameters()))
            for i in range(x.shape[0])]
    return {n: torch.stack([r[j] for r in rows]) for j, n in enumerate(names)}


def _check(model, x, strategy):
    want = _loop(model, x)
    got = tv.per_sample_grads(model, _loss, x, strategy=strategy)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)
    norms = sum(g.flatten(1).pow(2).sum(1) for g in want.values()).sqrt()
    torch.testing.assert_close(tv.per_sample_grad_norms(model, _loss, x, strategy=strategy),
                               norms)


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_a_mixing_refusal_at_one_batch_size_does_not_replay_at_another(strategy):
    # the plan made at 6 (which mixes) was cached under a key without the batch size: the
    # batch of 3, where the model is per-example, was refused as mixing
    torch.manual_seed(0)
    model = _CentredWhenLarge().to(D)
    with pytest.raises(tv.PerSampleError, match="mixes examples"):
        tv.per_sample_grads(model, _loss, torch.randn(6, 4, dtype=D), strategy=strategy)
    x = torch.randn(3, 4, dtype=D)
    _check(model, x, strategy)
    assert {r.method for r in tv.per_sample_plan(model, _loss, x, strategy=strategy).rows} \
        == {"rule"}
    with pytest.raises(tv.PerSampleError, match="mixes examples"):  # (and still at 6)
        tv.per_sample_grads(model, _loss, torch.randn(6, 4, dtype=D), strategy=strategy)


def test_a_failure_on_the_whole_batch_at_one_size_leaves_the_rules_to_the_others():
    # at 6 every parameter goes to vmap (the model fails on the whole batch); that plan
    # served the batch of 3 too, where the rules' pass works
    torch.manual_seed(0)
    model = _FailsWhenLarge().to(D)
    _check(model, torch.randn(6, 4, dtype=D), "auto")
    x = torch.randn(3, 4, dtype=D)
    _check(model, x, "auto")
    plan = tv.per_sample_plan(model, _loss, x)
    assert {r.method for r in plan.rows} == {"rule"}, str(plan)


def test_a_plan_made_where_the_model_is_per_example_is_checked_at_a_new_size():
    # planned and checked at 3; at 6 the forward centres over the batch, and the rules'
    # results of the batch of 6 were given as they were: wrong for every example
    torch.manual_seed(0)
    model = _CentredWhenLarge().to(D)
    _check(model, torch.randn(3, 4, dtype=D), "auto")
    x = torch.randn(6, 4, dtype=D)
    want = _loop(model, x)
    with pytest.warns(tv.TorchVJPWarning) as caught:
        got = tv.per_sample_grads(model, _loss, x)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)
    msg = str(caught[0].message)
    assert "disagree with the per-example loop" in msg
    assert "checked at (3), not at this batch of 6" in msg
    assert "control flow on x.shape[0]" in msg
    assert "make the forward per-example at every batch size, or use strategy='loop'" in msg
    with pytest.raises(tv.PerSampleError, match="mixes examples"):  # (the next call's plan)
        tv.per_sample_grads(model, _loss, x)


def test_hooks_refuses_a_plan_that_is_wrong_at_a_new_batch_size():
    torch.manual_seed(0)
    model = _CentredWhenLarge().to(D)
    _check(model, torch.randn(3, 4, dtype=D), "hooks")
    with pytest.raises(tv.PerSampleError) as info:
        tv.per_sample_grads(model, _loss, torch.randn(6, 4, dtype=D), strategy="hooks")
    msg = str(info.value)
    assert "strategy='hooks' gives wrong per-sample gradients" in msg
    assert "not at this batch of 6" in msg and "Fix: strategy='auto'" in msg


def test_the_check_at_a_new_batch_size_runs_once_per_size():
    torch.manual_seed(0)
    model = _CentredWhenLarge().to(D)
    runs = []  # (every forward, those of the planning and of the checks too)
    model.register_forward_pre_hook(lambda m, args: runs.append(args[0].shape[0]))
    counts = []
    for b in (3, 3, 2, 2, 4, 3):
        before = len(runs)
        _check(model, torch.randn(b, 4, dtype=D), "auto")
        counts.append(len(runs) - before)
    # each _check: the reference loop (b forwards), the grads and the norms calls; a
    # call whose check is due adds the loop's forwards of its examples
    plain = [b + 2 for b in (3, 3, 2, 2, 4, 3)]
    extra = [c - p for c, p in zip(counts, plain)]
    assert extra[1] == extra[3] == extra[5] == 0, counts
    assert extra[2] > 0 and extra[4] > 0, counts
