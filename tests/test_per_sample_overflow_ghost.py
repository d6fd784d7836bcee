"""Per-sample norms past the square of float32 (NOTE [norms past the square] in
torch_vjp/_per_sample/norms_wide.py): the ghost norms of an example with no gradient whose
activations' squares overflow, and ``compile=True``'s program, which took the squared norms
in float32."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torch_vjp as tv

from _references import float64_per_example


def _mse(out, t):
    return (out - t).pow(2).sum()


def _weighted(out, t):
    return (out * t).sum()


class _Seq(nn.Module):
    def __init__(self, p, q):
        super().__init__()
        self.lin = nn.Linear(p, q)

    def forward(self, x):
        return self.lin(x).sum(1)


@pytest.mark.parametrize("strategy", ("auto", "hooks", "vmap"))
@pytest.mark.parametrize("conv", (False, True))
def test_ghost_norm_of_an_example_with_no_gradient_and_huge_activations(strategy, conv):
    """The ghost identity's products are inf times 0, NaN, for an example whose output
    gradient is 0 and whose activations' squares overflow: its norm is 0, not NaN (its
    NaN clip factor made the whole clipped sum NaN)."""
    torch.manual_seed(0)
    if conv:  # (few output positions, wide patches: the ghost identity)
        model = nn.Sequential(nn.Conv2d(16, 16, 3), nn.Flatten())
        x, t = torch.randn(3, 16, 4, 4), torch.randn(3, 64)
    else:
        model = _Seq(16, 16)
        x, t = torch.randn(3, 4, 16), torch.randn(3, 16)
    x[1] *= 1e20
    t[1] = 0.0
    got = tv.per_sample_grad_norms(model, _weighted, x, t, strategy=strategy)
    assert got[1] == 0 and torch.isfinite(got).all()
    tv.accumulate_clipped_grads(model, _weighted, x, t, max_norm=1.0, strategy=strategy)
    for p in model.parameters():
        assert torch.isfinite(p.grad).all()


def test_compiled_program_norms_past_the_square():
    """compile=True: its program took the squared norms in float32 (inf above 1.8e19)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(3, 4)
    t = torch.randn(3, 3)
    t[1] = 1e19
    torch.manual_seed(0)
    ref, want = float64_per_example(nn.Linear(4, 3), _mse, x, t)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.TorchVJPWarning)  # (nothing falls back)
        for _ in range(2):
            got = tv.per_sample_grad_norms(model, _mse, x, t, compile=True)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0.0)
            for p in model.parameters():
                p.grad = None
            tv.accumulate_clipped_grads(model, _mse, x, t, max_norm=1.0, compile=True)
            c = (1.0 / want).clamp(max=1.0)
            for n, p in model.named_parameters():
                expected = torch.einsum("b,b...->...", c, ref[n])
                torch.testing.assert_close(p.grad.double(), expected, rtol=1e-5, atol=1e-6)
