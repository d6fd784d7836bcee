"""Sparsity detection through the in-place ops that change a tensor's view of its storage
(``squeeze_``, ``unsqueeze_``, ``t_``, ``transpose_``, ``as_strided_``), which
``F.linear`` on a vector calls: the pattern is exact, without a warning."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from torch_vjp.sparse import jacobian_sparsity, sparse_jacobian

D = torch.float64
N = 8
_BAND = (torch.arange(N)[:, None] - torch.arange(N)[None, :]).abs() <= 1
W = torch.randn(N, N, dtype=D, generator=torch.Generator().manual_seed(0)) * _BAND


def _linear(u):
    return torch.tanh(F.linear(u, W))  # (a vector: addmm's decomposition squeezes in place)


def _squeeze(u):
    return u.clone().unsqueeze_(0).squeeze_(0) * u.roll(1)


def _transpose(u):
    c = u.clone().view(2, 4)
    c.t_()
    c[0] *= 3
    return c.contiguous().view(-1)


def _as_strided(u):
    c = u.clone()
    c.as_strided_((3, 2), (2, 1), 1)
    return c.sum(1)


def _swapped(u):
    c = (u * u).view(2, 4)
    c.transpose_(0, 1)
    return c.flip(0) * c


@pytest.mark.parametrize("f", [_linear, _squeeze, _transpose, _as_strided, _swapped])
def test_in_place_view_ops_keep_the_pattern_exact(f):
    # these ops were ruled as writes of their result without a rule: every element of the
    # tensor got the union of all its elements' sets (F.linear on a vector without a bias,
    # a banded weight: a dense 8 x 8 pattern and a warning naming aten.squeeze_)
    x = torch.randn(N, dtype=D, generator=torch.Generator().manual_seed(1))
    ref = torch.func.jacrev(f)(x).reshape(-1, N)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "no sparsity rule" warning)
        pattern = jacobian_sparsity(f, x).to_dense()
    assert torch.equal(pattern, ref != 0)
    for mode in ("fwd", "rev", "auto"):
        J = sparse_jacobian(f, x, mode=mode, layout=torch.strided)
        torch.testing.assert_close(J, ref, rtol=0, atol=1e-12)
