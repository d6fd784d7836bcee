"""The clipped sum of a Linear layer on sequences (``OuterFactor.weighted_sum``): one product
over all ``B * T`` rows, taken in the order the unscaled operand is stored in, so that an
input stored time-major (a sequence-first attention's output projection) is read in place
rather than copied; float64 against the per-example loop and against an einsum."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torch_vjp as tv
from torch_vjp._per_sample.factors import OuterFactor

DT = torch.float64


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _rows(B, T, width, time_major, gen):
    if time_major:  # (stored (T, B, width), seen batch-first)
        return torch.randn(T, B, width, dtype=DT, generator=gen).transpose(0, 1)
    return torch.randn(B, T, width, dtype=DT, generator=gen)


@pytest.mark.parametrize("p,q", [(6, 6), (4, 9), (9, 4)], ids=["square", "a-narrower",
                                                                 "g-narrower"])
@pytest.mark.parametrize("layout", ["a-time-major", "g-time-major", "both", "neither"])
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d-gpt2"])
def test_weighted_sum_against_einsum(p, q, layout, transposed):
    gen = torch.Generator().manual_seed(0)
    B, T = 5, 7
    a = _rows(B, T, p, layout in ("a-time-major", "both"), gen)
    g = _rows(B, T, q, layout in ("g-time-major", "both"), gen)
    c = torch.rand(B, dtype=DT, generator=gen)
    a_before, g_before = a.clone(), g.clone()
    shape = (p, q) if transposed else (q, p)
    got = OuterFactor(a, g, shape, transposed=transposed).weighted_sum(c)
    want = torch.einsum("b,btq,btp->qp", c, g, a)
    torch.testing.assert_close(got, want.T if transposed else want, rtol=1e-12, atol=1e-12)
    assert torch.equal(a, a_before) and torch.equal(g, g_before)  # (the caller's untouched)


@pytest.mark.parametrize("p,q", [(6, 6), (9, 4)], ids=["square", "g-narrower"])
def test_a_time_major_input_is_read_in_place(p, q):
    # g is scaled (not narrower than a), a is stored time-major: the product reads a as it
    # is stored, with the scaled g written in a's row order; no copy of a
    gen = torch.Generator().manual_seed(1)
    B, T = 4, 6
    a = _rows(B, T, p, True, gen)
    g = _rows(B, T, q, False, gen)
    c = torch.rand(B, dtype=DT, generator=gen)
    ops = Ops()
    with torch.no_grad(), ops:
        got = OuterFactor(a, g, (q, p)).weighted_sum(c)
    assert "aten.clone" not in ops.names and "aten.copy_" not in ops.names, ops.names
    torch.testing.assert_close(got, torch.einsum("b,btq,btp->qp", c, g, a), rtol=1e-12,
                               atol=1e-12)


def test_weighted_sum_under_grad_mode_with_inputs_that_require_grad():
    gen = torch.Generator().manual_seed(2)
    a = _rows(3, 4, 5, True, gen).requires_grad_()
    g = _rows(3, 4, 5, False, gen)
    c = torch.rand(3, dtype=DT, generator=gen)
    got = OuterFactor(a, g, (5, 5)).weighted_sum(c)
    torch.testing.assert_close(got, torch.einsum("b,btq,btp->qp", c, g, a), rtol=1e-12,
                               atol=1e-12)


class SeqFirstAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(8, 2)  # (sequence first)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # x: (B, T, 8)
        s = x.transpose(0, 1)
        return self.head(self.att(s, s, s, need_weights=False)[0].mean(0))


def test_clipped_step_of_a_sequence_first_attention_against_the_loop():
    torch.manual_seed(0)
    model = SeqFirstAttention().to(DT)
    x = torch.randn(5, 6, 8, dtype=DT)
    t = torch.randint(0, 3, (5,))
    loss_fn = nn.CrossEntropyLoss()
    ref = {n: [] for n, _ in model.named_parameters()}
    for i in range(5):
        model.zero_grad(set_to_none=True)
        loss_fn(model(x[i:i + 1]), t[i:i + 1]).backward()
        for n, prm in model.named_parameters():
            ref[n].append(prm.grad.detach().clone())
    ref = {n: torch.stack(v) for n, v in ref.items()}
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    max_norm = norms.median().item()
    c = (max_norm / norms).clamp(max=1.0)
    model.zero_grad(set_to_none=True)
    tv.accumulate_clipped_grads(model, loss_fn, x, t, max_norm=max_norm, strategy="hooks")
    for n, prm in model.named_parameters():
        torch.testing.assert_close(prm.grad, torch.einsum("b,b...->...", c, ref[n]),
                                   rtol=1e-9, atol=1e-12)
