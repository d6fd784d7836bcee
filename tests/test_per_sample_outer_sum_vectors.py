"""The clipped sum of a Linear's weight on a batch of vectors (OuterFactor with T == 1, the
common case): sum_i c_i g_i a_i^T, right in float64 against the sum of the examples' own
outer products, taken by one broadcast product and one matrix product."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_vjp as tv
from torch_vjp._per_sample.factors import OuterFactor


def _reference(a, g, c, transposed):
    out = sum(c[i] * torch.outer(g[i], a[i]) for i in range(a.shape[0]))
    return out.T if transposed else out


@pytest.mark.parametrize("p,q", [(3, 7), (7, 3), (5, 5)])
@pytest.mark.parametrize("transposed", [False, True])
def test_weighted_sum_of_vectors_float64(p, q, transposed):
    gen = torch.Generator().manual_seed(p * 10 + q)
    B = 6
    a = torch.randn(B, p, dtype=torch.float64, generator=gen)
    g = torch.randn(B, q, dtype=torch.float64, generator=gen)
    c = torch.rand(B, dtype=torch.float64, generator=gen)
    c[2] = 0.0  # (an example clipped away entirely)
    shape = (p, q) if transposed else (q, p)
    got = OuterFactor(a, g, shape, transposed=transposed).weighted_sum(c)
    assert got.shape == shape
    torch.testing.assert_close(got, _reference(a, g, c, transposed), rtol=1e-12, atol=1e-12)
    # the caller's tensors are untouched
    assert torch.equal(c[2], torch.zeros((), dtype=torch.float64))


def test_weighted_sum_of_vectors_reads_factors_in_their_dtype():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(4, 3, generator=gen)
    g = torch.randn(4, 2, generator=gen)
    c = torch.rand(4, dtype=torch.float64, generator=gen)
    got = OuterFactor(a, g, (2, 3)).weighted_sum(c)
    assert got.dtype == torch.float32
    ref = _reference(a.double(), g.double(), c, False)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)


def test_weighted_sum_of_vectors_keeps_the_graph():
    # (under grad mode, as a compiled or transformed program may run it)
    a = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 2, dtype=torch.float64)
    c = torch.rand(4, dtype=torch.float64)
    got = OuterFactor(a, g, (2, 3)).weighted_sum(c)
    (ga,) = torch.autograd.grad(got.sum(), a)
    torch.testing.assert_close(ga, c[:, None] * g.sum(1, keepdim=True).expand(4, 3))


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_weighted_sum_of_vectors_is_one_scale_and_one_product():
    a, g, c = torch.randn(8, 16), torch.randn(8, 4), torch.rand(8)
    f = OuterFactor(a, g, (4, 16))
    with _Ops() as m:
        f.weighted_sum(c)
    assert sorted(m.ops) == ["mm", "mul"], m.ops


def test_clipped_step_of_a_linear_against_the_loop_float64():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(),
                                torch.nn.Linear(7, 3)).double()
    x, y = torch.randn(9, 5, dtype=torch.float64), torch.randint(0, 3, (9,))
    loss_fn = torch.nn.CrossEntropyLoss()
    max_norm = 0.05
    ref = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(9):
        model.zero_grad()
        loss_fn(model(x[i:i + 1]), y[i:i + 1]).backward()
        gs = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.sqrt(sum((v ** 2).sum() for v in gs.values()))
        for n in ref:
            ref[n] += gs[n] * min(1.0, max_norm / float(norm))
    model.zero_grad(set_to_none=True)
    tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=max_norm)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-10, atol=1e-12)
