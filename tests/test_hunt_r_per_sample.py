"""Per-sample gradients, norms and the clipped step on layer patterns of DP-SGD models,
float64, against the per-example loop (``torch.autograd.grad`` of each example's loss)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv

DT = torch.float64


def _loop(model, loss_fn, x, y):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    rows = {n: [] for n in names}
    for i in range(x.shape[0]):
        gs = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), params)
        for n, g in zip(names, gs):
            rows[n].append(g)
    return {n: torch.stack(v) for n, v in rows.items()}


def _check_all(model, loss_fn, x, y, strategy, max_norm=0.5):
    want = _loop(model, loss_fn, x, y)
    got = tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)
    norms = sum(g.flatten(1).pow(2).sum(1) for g in want.values()).sqrt()
    torch.testing.assert_close(
        tv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy), norms)
    for p in model.parameters():
        p.grad = None
    tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=max_norm, strategy=strategy)
    c = (max_norm / norms).clamp(max=1.0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, want[n]), msg=n)


class _SharedInput(nn.Module):
    """A layer called on the batch and on a learned prototype of one row (a parameter of
    leading size 1, shared by every example); the forward draws random numbers (noise of
    scale ``sigma``), so the first call is not checked against the per-example loop."""

    def __init__(self, layer: nn.Module, proto_shape, out: int, sigma: float = 0.0):
        super().__init__()
        self.layer, self.sigma = layer, sigma
        self.proto = nn.Parameter(torch.randn(1, *proto_shape))
        self.head = nn.Linear(out, 3)

    def forward(self, x):
        x = x + self.sigma * torch.randn_like(x)
        return self.head((self.layer(x) * self.layer(self.proto)).flatten(1))


_LAYERS = {
    "linear": lambda: (nn.Linear(5, 4), (5,), (5,), 4),
    "layernorm": lambda: (nn.LayerNorm(5), (5,), (5,), 5),
    "conv2d": lambda: (nn.Conv2d(2, 3, 3), (2, 5, 5), (2, 5, 5), 27),
}


@pytest.mark.parametrize("strategy", ["auto", "loop", "vmap"])
@pytest.mark.parametrize("layer", list(_LAYERS))
def test_a_layer_called_on_a_shared_parameter_gives_that_parameter_its_own_gradients(
        layer, strategy):
    # The layer's call on the (1, ...) prototype is a call shared by every example; the
    # recorder expands its input to the batch for the layer's rule, and that expansion of
    # the tracked prototype was recorded as a use of it broadcast over the examples: an
    # expanded tensor the forward never uses, whose gradient is zero, so the prototype's
    # per-sample gradients were zero wherever the first call's check was not made.
    torch.manual_seed(0)
    mod, pshape, xshape, out = _LAYERS[layer]()
    model = _SharedInput(mod, pshape, out).to(DT)
    x, y = torch.randn(5, *xshape, dtype=DT), torch.randint(0, 3, (5,))
    _check_all(model, nn.CrossEntropyLoss(), x, y, strategy)


@pytest.mark.parametrize("layer", list(_LAYERS))
def test_hooks_names_a_parameter_a_shared_layer_call_reads(layer):
    torch.manual_seed(0)
    mod, pshape, xshape, out = _LAYERS[layer]()
    model = _SharedInput(mod, pshape, out).to(DT)
    x, y = torch.randn(4, *xshape, dtype=DT), torch.randint(0, 3, (4,))
    with pytest.raises(tv.StrategyError, match=r"has no per-layer rule for 1 parameter") as e:
        tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
    assert "'proto'" in str(e.value)
    # the layer's own parameters keep their rule; the prototype takes the fallback, from
    # the plan (not from the first call's check against the loop)
    plan = tv.per_sample_plan(model, nn.CrossEntropyLoss(), x, y)
    assert plan["layer.weight"].method == "rule"
    assert plan["proto"].method != "rule"
    assert "rerouted" not in plan["proto"].how
