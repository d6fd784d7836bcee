"""The normalisation rules' affine factors: ``x_hat * g`` is written over the rule's own
``x_hat`` (one buffer the size of the input, not two), with results unchanged (float64,
against ``x_hat * g`` formed apart)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torch_vjp._per_sample.registry import Call
from torch_vjp._per_sample.rules import norm as norm_mod

DT = torch.float64

_VIEWS = {"aten::view", "aten::reshape", "aten::_unsafe_view", "aten::unsqueeze",
          "aten::expand", "aten::detach", "aten::alias", "aten::permute", "aten::transpose"}


class _Buffers(TorchDispatchMode):
    """Counts the new (not view, not in-place) tensors of ``numel`` elements ops return."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += sum(1 for t in (out if isinstance(out, (tuple, list)) else (out,))
                          if isinstance(t, torch.Tensor) and t.numel() == self.numel
                          and func._schema.name not in _VIEWS and not func._schema.is_mutable)
        return out


def test_layer_norm_rule_makes_one_buffer_the_size_of_the_input():
    torch.manual_seed(0)
    ln = nn.LayerNorm(8).to(DT)
    x = torch.randn(4, 5, 8, dtype=DT)
    call = Call(rule=norm_mod.LayerNormRule(), module=ln, path="norm",
                params={"weight": (ln.weight, None), "bias": (ln.bias, None)}, args=(x,),
                kwargs={}, outputs=[ln(x)], out_edges=[], in_edges=[])
    g = torch.randn(4, 5, 8, dtype=DT)
    g0, x0 = g.clone(), x.clone()
    with torch.no_grad(), _Buffers(x.numel()) as mode:
        found = dict(call.rule.factors(call, [g], {"weight", "bias"}, 4))
    assert mode.count == 1
    xhat = F.layer_norm(x, (8,))
    torch.testing.assert_close(found["weight"].value, (xhat * g).sum(1))
    torch.testing.assert_close(found["bias"].value, g.sum(1))
    # the recorded input and the output gradient are left as they were
    assert torch.equal(g, g0) and torch.equal(x, x0)


def test_affine_factors_keep_a_wider_product_out_of_place():
    # a float32 x_hat times a float64 gradient: the product is float64, so it cannot be
    # written over x_hat, and x_hat is left as it was
    xhat = torch.randn(3, 4, 5)
    g = torch.randn(3, 4, 5, dtype=DT)
    xhat0 = xhat.clone()
    found = dict(norm_mod.affine_factors(xhat, g, (1,), {"weight", "bias"}))
    assert found["weight"].value.dtype == DT
    torch.testing.assert_close(found["weight"].value, (xhat0.to(DT) * g).sum(1))
    assert torch.equal(xhat, xhat0)
