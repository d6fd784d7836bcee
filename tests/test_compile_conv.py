"""``compile=True`` through convolutions: the reverse-mode program pulls its rows back with
transposed convolutions (NOTE [a convolution's input gradient, transposed] in
torch_vjp/_engine/compile_conv.py), each Jacobian checked in float64 against torch.func."""

from __future__ import annotations

import pytest
import torch

import torch_vjp as tv

D = torch.float64
F = torch.nn.functional

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "aot_eager_unless_inductor", "inductor")


def _ops_of_steady_call(f, x):
    for _ in range(2):  # (the first call, then one that runs the program)
        tv.jacobian(f, x, compile=True, strategy="rev")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        J = tv.jacobian(f, x, compile=True, strategy="rev")
    return J, {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("conv", [
    dict(stride=1, padding=1),
    dict(stride=2, padding=1),  # (an output padding of 1 gives back the even size)
    dict(stride=2, padding=0, dilation=2),
    dict(stride=3, padding=2, groups=2),
])
def test_a_convolution_pulled_back_as_a_transposed_one(conv):
    g = torch.Generator().manual_seed(0)
    groups = conv.get("groups", 1)
    w = torch.randn(4, 4 // groups, 3, 3, generator=g, dtype=D)
    b = torch.randn(4, generator=g, dtype=D)
    v = torch.randn(3, 4, generator=g, dtype=D)
    x = torch.randn(4, 11, 12, generator=g, dtype=D)

    def f(x):
        h = torch.tanh(F.conv2d(x.unsqueeze(0), w, b, **conv))
        return v @ h.mean(dim=(2, 3)).squeeze(0)

    J, ops = _ops_of_steady_call(f, x)
    torch.testing.assert_close(J, torch.func.jacrev(f)(x))
    assert "aten::convolution_backward" not in ops


def test_a_1d_convolution_and_weights_that_are_differentiated_too():
    # (1-d, and a Jacobian with respect to the weight: its gradient stays a backward)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 2, 5, generator=g, dtype=D)
    x = torch.randn(2, 17, generator=g, dtype=D)

    def f(x):
        return torch.sin(F.conv1d(x.unsqueeze(0), w, stride=2, padding=2)).sum(-1).squeeze(0)

    J, ops = _ops_of_steady_call(f, x)
    torch.testing.assert_close(J, torch.func.jacrev(f)(x))
    assert "aten::convolution_backward" not in ops

    def of_w(w):
        return torch.sin(F.conv1d(x.unsqueeze(0), w, stride=2, padding=2)).sum(-1).squeeze(0)

    for _ in range(3):
        torch.testing.assert_close(tv.jacobian(of_w, w, compile=True, strategy="rev"),
                                   torch.func.jacrev(of_w)(w))
