"""Nothing of the user's changes (SPEC §0, NOTE [what a call puts back]): a BatchNorm held in
a plain list attribute of a module, and running statistics a function captures and updates
with F.batch_norm (a kernel that bumps no version counter), are as they were after a call."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv

D = torch.float64


class _ListNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()
        self.norms = [torch.nn.BatchNorm1d(3).double()]  # plain list, not a ModuleList

    def forward(self, x):
        return self.norms[0](self.lin(x))


def _reference(net, x):
    # (the Jacobian of one call by torch.func.jacrev, which refuses the running statistics'
    # update: the same function without them)
    bn = net.norms[0]
    return torch.func.jacrev(lambda t: F.batch_norm(
        net.lin(t), None, None, bn.weight, bn.bias, training=True, eps=bn.eps))(x)


@pytest.mark.parametrize("strategy", ["auto", "rev-loop", "fwd-loop"])
def test_a_batchnorm_in_a_plain_list_keeps_its_statistics(strategy):
    x = torch.randn(4, 3, dtype=D)
    net = _ListNet()
    bn = net.norms[0]
    want = _reference(net, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.jacobian(net, x, strategy=strategy)
    torch.testing.assert_close(got, want)
    assert bn.num_batches_tracked.item() == 0
    torch.testing.assert_close(bn.running_mean, torch.zeros(3, dtype=D))
    torch.testing.assert_close(bn.running_var, torch.ones(3, dtype=D))


@pytest.mark.parametrize("strategy", ["auto", "rev", "rev-loop", "fwd-loop"])
def test_captured_running_statistics_are_put_back(strategy):
    x = torch.randn(4, 3, dtype=D)
    rm, rv = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)

    def f(t):
        return F.batch_norm(t, rm, rv, training=True)

    want = torch.func.jacrev(lambda t: F.batch_norm(t, None, None, training=True))(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.jacobian(f, x, strategy=strategy)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(rm, torch.zeros(3, dtype=D))
    torch.testing.assert_close(rv, torch.ones(3, dtype=D))


def test_batch_jacobian_and_hessian_put_captured_statistics_back():
    x = torch.randn(4, 3, dtype=D)
    rm, rv = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)

    def f(t):
        return torch.tanh(t) + 0 * F.batch_norm(t, rm, rv, training=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tv.batch_jacobian(f, x)
        tv.hessian(lambda t: f(t).sum(), x)
    torch.testing.assert_close(rm, torch.zeros(3, dtype=D))
    torch.testing.assert_close(rv, torch.ones(3, dtype=D))


def test_a_large_captured_tensor_is_not_copied():
    # (NOTE [what a call puts back]: over KEPT_ELEMENTS, a tensor is not copied per call)
    from torch_vjp._engine.context import KEPT_ELEMENTS, buffers_kept

    big = torch.zeros(KEPT_ELEMENTS + 1, dtype=D)
    small = torch.zeros(3, dtype=D)

    def f(t):
        return t * big[:3] + small

    with buffers_kept(f) as _:
        pass
    ctx = buffers_kept(f)
    kept = [t for _, _, t, _, _ in ctx.entries]
    assert any(t is small for t in kept) and not any(t is big for t in kept)
