"""Per-sample gradients, norms and clipped sums of models run under hooks and layouts that
change what a layer's call looks like from outside, compared in float64 with the
definition, one example at a time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv

DT = torch.float64
STRATEGIES = ("auto", "hooks", "vmap", "loop")


def _loss(o):
    return (torch.sin(o) * o).sum()


def loop_reference(model, loss_fn, x):
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    per = [torch.autograd.grad(loss_fn(model(x[i:i + 1])), params) for i in range(x.shape[0])]
    return {n: torch.stack([g[k] for g in per]) for k, n in enumerate(names)}


def _check_all(model, x, strategy, max_norm=0.3):
    ref = loop_reference(model, _loss, x)
    got = tv.per_sample_grads(model, _loss, x, strategy=strategy)
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, rtol=1e-7, atol=1e-9)
    want_norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    torch.testing.assert_close(tv.per_sample_grad_norms(model, _loss, x, strategy=strategy),
                               want_norms, rtol=1e-7, atol=1e-9)
    for p in model.parameters():
        p.grad = None
    norms = tv.accumulate_clipped_grads(model, _loss, x, max_norm=max_norm, strategy=strategy)
    torch.testing.assert_close(norms, want_norms, rtol=1e-7, atol=1e-9)
    scale = (max_norm / want_norms).clamp(max=1.0)
    for n, p in model.named_parameters():
        want = (ref[n] * scale.view(-1, *[1] * p.dim())).sum(0)
        torch.testing.assert_close(p.grad, want, rtol=1e-7, atol=1e-9)
        p.grad = None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_global_forward_hook_that_changes_layer_outputs(strategy):
    # the hook clamps the first layer's output of example 1 only: the rules must use the
    # gradient of the layer's own output, not that of the hook's result
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    x = torch.randn(6, 3, dtype=DT) * 0.1
    x[1] = torch.tensor([30.0, -20.0, 25.0], dtype=DT)
    handle = nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: out.clamp(-3, 3) if isinstance(mod, nn.Linear) else None)
    try:
        assert model[0](x[1:2]).abs().max() == 3  # (the clamp acts on example 1)
        _check_all(model, x, strategy)
    finally:
        handle.remove()


def test_a_global_forward_hook_scaling_outputs_under_hooks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    x = torch.randn(5, 3, dtype=DT)
    handle = nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: out * 2 if isinstance(mod, nn.Linear) else None)
    try:
        _check_all(model, x, "hooks")
    finally:
        handle.remove()


def test_vmap_failure_from_a_full_backward_hook_on_the_first_layer_names_it():
    # the input does not require grad, so torch wraps only the layer's outputs, after its
    # forward hooks ran: the failure comes from a module no longer running
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    model[0].register_full_backward_hook(lambda mod, gi, go: None)
    x = torch.randn(4, 3, dtype=DT)
    with pytest.raises(tv.StrategyError, match=(
            r"cannot batch this model in module '0' \(Linear\); '0' has a full backward hook "
            r"\(register_full_backward_hook or register_full_backward_pre_hook\)")):
        tv.per_sample_grads(model, _loss, x, strategy="vmap")
    _check_all(model, x, "auto")


def _patched_first_layer(model):
    # a forward set on the instance: the layer no longer computes what the type's does
    layer = model[0]
    layer.forward = lambda x: nn.functional.linear(x.clamp(-1, 1), layer.weight, layer.bias)


def _clamped_data():
    torch.manual_seed(0)
    x = torch.randn(6, 3, dtype=DT) * 0.3
    x[1] = torch.tensor([3.0, -2.0, 2.5], dtype=DT)  # (only example 1 reaches the clamp)
    return x


@pytest.mark.parametrize("called_before", [False, True])
@pytest.mark.parametrize("strategy", ("auto", "vmap", "loop"))
def test_a_layer_whose_forward_is_replaced_on_the_instance(strategy, called_before):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    x = _clamped_data()
    if called_before:  # (a plan made for the stock layer is not reused)
        tv.per_sample_grads(model, _loss, x, strategy=strategy)
    _patched_first_layer(model)
    _check_all(model, x, strategy)


def test_hooks_names_a_layer_whose_forward_is_replaced_on_the_instance():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    _patched_first_layer(model)
    with pytest.raises(tv.StrategyError, match=(
            r"'0.weight': its module '0' is a Linear, whose forward is replaced on the "
            r"instance \(layer.forward = \.\.\.\): the layer's rule replays only the type's "
            r"own forward")):
        tv.per_sample_grads(model, _loss, _clamped_data(), strategy="hooks")


@pytest.mark.parametrize("strategy", ("auto", "vmap", "loop"))
def test_a_layer_type_whose_forward_is_replaced_on_the_class(strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    x = _clamped_data()
    tv.per_sample_grads(model, _loss, x, strategy=strategy)  # (a plan for the stock layer)
    stock = nn.Linear.forward

    def forward(self, t):
        return nn.functional.linear(t.clamp(-1, 1), self.weight, self.bias)

    nn.Linear.forward = forward
    try:
        _check_all(model, x, strategy)
        if strategy == "auto":
            with pytest.raises(tv.StrategyError, match=(
                    r"'0.weight': its module '0' is a Linear, whose forward is not the one "
                    r"torch defines \(Linear.forward was replaced on the class\): the layer's "
                    r"rule replays only torch's own forward")):
                tv.per_sample_grads(model, _loss, x, strategy="hooks")
    finally:
        nn.Linear.forward = stock
    _check_all(model, x, strategy)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = nn.MultiheadAttention(6, 2, batch_first=True)

    def forward(self, x):
        return self.m(x, x, x)[0]


def test_attention_whose_forward_is_wrapped_on_the_class_keeps_its_rule():
    # the attention rule records the projections inside the forward, whatever wraps it
    stock = nn.MultiheadAttention.forward

    def forward(self, q, k, v, **kwargs):
        return stock(self, q.clamp(-1, 1), k, v, **kwargs)

    torch.manual_seed(0)
    model = _Attention().to(DT)
    x = torch.randn(6, 3, 6, dtype=DT) * 0.3
    x[1] *= 10
    nn.MultiheadAttention.forward = forward
    try:
        _check_all(model, x, "hooks")
    finally:
        nn.MultiheadAttention.forward = stock
