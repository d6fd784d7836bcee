import pytest
import torch
from torch import nn

import torch_vjp as tv

D = torch.float64


class _InPlaceAfter(nn.Module):
    """b's input changed in place after b used it (b.weight frozen: autograd saves no
    input for it, so the model's own backward works)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)
        self.b.weight.requires_grad_(False)

    def forward(self, x):
        h = self.a(x)
        out = self.b(h)
        h.add_(1.0)
        return out


@pytest.mark.parametrize("fn", ["grads", "norms", "clipped"])
def test_hooks_refuses_a_deterministic_layer_call_it_cannot_replay(fn):
    torch.manual_seed(0)
    model = _InPlaceAfter().to(D)
    x, y = torch.randn(5, 4, dtype=D), torch.randn(5, 3, dtype=D)
    call = {"grads": lambda s: tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy=s),
            "norms": lambda s: tv.per_sample_grad_norms(model, nn.MSELoss(), x, y, strategy=s),
            "clipped": lambda s: tv.accumulate_clipped_grads(model, nn.MSELoss(), x, y,
                                                             max_norm=1.0, strategy=s)}[fn]
    with pytest.raises(tv.StrategyError) as info:
        call("hooks")
    msg = str(info.value)
    assert "strategy='hooks' cannot compute" in msg
    assert "'b.bias': in 'b', its input was modified in place after the layer used it" in msg
    assert "strategy='auto'" in msg and "strategy='vmap'" in msg
    assert all(p.grad is None for p in model.parameters())
    call("auto")  # (which computes b.bias with vmap)
