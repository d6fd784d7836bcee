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
    xs = x if isinstance(x, tuple) else (x,)
    for i in range(y.shape[0]):
        out = model(*(t[i:i + 1] for t in xs))
        gs = torch.autograd.grad(loss_fn(out, y[i:i + 1]), params)
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
        if n in want:
            torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, want[n]), msg=n)
        else:
            assert p.grad is None, n


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
    with pytest.raises(tv.StrategyError, match=r"cannot compute 1 parameter\(s\) with a per-layer rule") as e:
        tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
    assert "'proto'" in str(e.value)
    # the layer's own parameters keep their rule; the prototype takes the fallback, from
    # the plan (not from the first call's check against the loop). (Under "auto" this model,
    # which draws random numbers, gets one method for all: NOTE [one draw per example].)
    plan = tv.per_sample_plan(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
    assert plan["layer.weight"].method == "rule"
    assert plan["proto"].method != "rule"
    assert "rerouted" not in plan["proto"].how


class _FrozenEncoder(nn.Module):
    """A frozen pretrained encoder in eval mode with a trained head: with a padding mask,
    torch's TransformerEncoder runs its layers on a nested tensor (its fast path)."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(8, 3)

    def forward(self, x, pad):
        return self.head(self.enc(x, src_key_padding_mask=pad).mean(1))


@pytest.mark.parametrize("strategy", ["hooks", "auto"])
def test_a_trained_head_on_a_frozen_transformer_encoder_in_its_fast_path(strategy):
    # The recorder hooked every nn.MultiheadAttention, frozen or not; a hook on a layer's
    # attention turns off that TransformerEncoderLayer's fast path, which then handed the
    # attention the nested tensor the encoder had made: "MultiheadAttention does not support
    # NestedTensor outside of its fast path", and strategy='hooks' refused the head.
    torch.manual_seed(0)
    model = _FrozenEncoder().to(DT).eval()
    model.enc.requires_grad_(False)
    x = torch.randn(5, 6, 8, dtype=DT)
    pad = torch.zeros(5, 6, dtype=torch.bool)
    pad[1, 4:], pad[3, 1:] = True, True
    y = torch.randint(0, 3, (5,))
    _check_all(model, nn.CrossEntropyLoss(), (x, pad), y, strategy)
