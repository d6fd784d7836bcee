"""Random operators that draw nothing: ``F.scaled_dot_product_attention`` with
``dropout_p=0`` (every ``nn.MultiheadAttention`` of ``dropout=0.0`` in training mode) and
rrelu in eval mode are tagged random by torch, but leave the generator as it was; a plan
that took them for random skipped its check against the per-example loop and gave every
parameter one method (NOTE [one draw per example] in torch_vjp/_per_sample/plan.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torch_vjp as tv
from torch_vjp._per_sample import probe, registry

D = torch.float64


class _Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return x * self.w


class _Block(nn.Module):
    """Self-attention (dropout 0.0, training mode) and a layer of the user's own type."""

    def __init__(self, scale_type=_Scale):
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, batch_first=True)
        self.scale = scale_type(4)
        self.gain = nn.Parameter(torch.tensor(1.25))  # (no rule: vmap)

    def forward(self, x):
        return self.scale(self.mha(x, x, x, need_weights=False)[0]) * self.gain


def _loss(out):
    return (out ** 2).sum() + out[..., 0].sum()


def _loop(model, x):
    names = [n for n, _ in model.named_parameters()]
    rows = [torch.autograd.grad(_loss(model(x[i:i + 1])), list(model.parameters()))
            for i in range(x.shape[0])]
    return {n: torch.stack([r[j] for r in rows]) for j, n in enumerate(names)}


def test_attention_without_dropout_keeps_its_rules_beside_a_parameter_on_vmap():
    # taken for random, the model had every parameter moved to vmap (one draw per example)
    torch.manual_seed(0)
    model = _Block().to(D).train()
    x = torch.randn(4, 3, 4, dtype=D)
    plan = tv.per_sample_plan(model, _loss, x)
    assert plan["mha.in_proj_weight"].method == "rule", str(plan)
    assert plan["mha.out_proj.weight"].method == "rule", str(plan)
    assert plan["gain"].method == "vmap", str(plan)
    want = _loop(model, x)
    got = tv.per_sample_grads(model, _loss, x)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_a_wrong_rule_beside_attention_without_dropout_is_caught(strategy):
    # the plan's check against the loop was skipped (the model "drew" random numbers and
    # had no dropout layer to turn off): a registered rule that gives twice the gradient
    # was given as it was, silently wrong
    class Scale(_Scale):
        pass

    def doubled(module, inputs, g):  # (twice each example's gradient)
        t = inputs[0] * g
        return {"w": 2 * t.reshape(t.shape[0], -1, t.shape[-1]).sum(1)}

    tv.register_per_sample_rule(Scale, doubled)
    probe.forget_plans()
    try:
        torch.manual_seed(0)
        model = _Block(Scale).to(D).train()
        x = torch.randn(4, 3, 4, dtype=D)
        want = _loop(model, x)
        if strategy == "hooks":
            model.gain.requires_grad_(False)
            with pytest.raises(tv.PerSampleError, match="rule you registered"):
                tv.per_sample_grads(model, _loss, x, strategy="hooks")
            return
        norms = sum(g.reshape(len(g), -1).pow(2).sum(1) for g in want.values()).sqrt()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = tv.per_sample_grad_norms(model, _loss, x)  # (the rules' norms)
        torch.testing.assert_close(got, norms)
        assert any("gives wrong per-sample gradients for 'scale.w'" in str(w.message)
                   for w in caught)
    finally:
        registry._RULES.pop(Scale, None)
        probe.forget_plans()


def test_rrelu_in_eval_mode_is_not_random_but_in_training_mode_is():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.RReLU(), _Scale(4), nn.Linear(4, 2)).to(D)
    model[2].w.register_hook(lambda g: g)  # (the loop's: the others stay apart unless random)
    x = torch.randn(5, 3, dtype=D)
    model.eval()
    assert tv.per_sample_plan(model, _loss, x)["0.weight"].method == "rule"
    model.train()
    assert tv.per_sample_plan(model, _loss, x)["0.weight"].method == "loop"


class _Encoder(nn.Module):
    """A transformer encoder layer with dropout (its attention's own too), in training
    mode, then a layer of the user's own type."""

    def __init__(self, scale_type):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.2, batch_first=True)
        self.scale = scale_type(4)

    def forward(self, x):
        return self.scale(self.enc(x))


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_a_wrong_rule_beside_attention_with_dropout_is_caught(strategy):
    # the check turns dropout off to compare with the loop; attention's own dropout (not a
    # Dropout module) still drew, so the check was skipped and the wrong rule's results
    # given as they were
    class Scale(_Scale):
        pass

    def doubled_after_encoder(module, inputs, g):  # (its own name: warned once per rule)
        t = inputs[0] * g
        return {"w": 2 * t.reshape(t.shape[0], -1, t.shape[-1]).sum(1)}

    tv.register_per_sample_rule(Scale, doubled_after_encoder)
    probe.forget_plans()
    try:
        torch.manual_seed(0)
        model = _Encoder(Scale).to(D).train()
        x = torch.randn(4, 3, 4, dtype=D)
        if strategy == "hooks":
            with pytest.raises(tv.PerSampleError, match="rule you registered"):
                tv.per_sample_grad_norms(model, _loss, x, strategy="hooks")
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tv.per_sample_grad_norms(model, _loss, x)
        assert any("gives wrong per-sample gradients for 'scale.w'" in str(w.message)
                   for w in caught)
        assert tv.per_sample_plan(model, _loss, x)["scale.w"].method != "rule"
        assert all(m.training for m in model.modules())  # (put back after the check)
    finally:
        registry._RULES.pop(Scale, None)
        probe.forget_plans()
