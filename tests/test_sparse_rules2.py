"""Sparse Jacobians: a pattern that holds every entry is not refused where f's own rounding
in low precision makes the routes disagree, and detection keeps a superset of the
Jacobian's non-zeros (checked against torch.func.jacrev in float64)."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv


def _reference(f, x):
    return torch.func.jacrev(f)(x.double()).reshape(f(x).numel(), x.numel())


def _covers(pattern, reference):
    """Every non-zero of the reference is in the pattern."""
    return not bool((reference.ne(0) & ~pattern.to_dense().bool()).any())


@pytest.mark.parametrize("fn", [torch.softmax, torch.log_softmax])
def test_a_bfloat16_softmax_nearly_one_hot_with_its_own_pattern_is_not_refused(fn):
    # u^T J from the values and f's reverse product differ by the whole of their tiny
    # scale (the reverse product of softmax rounds y (u - sum(u y)) to 0 where y rounds to
    # 1): "auto"'s check took that for entries the pattern leaves out, and raised, though
    # the column's line is exactly zero outside the pattern
    def f(x):
        return fn(8 * x, 0)

    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        x = (torch.randn(4, 16, generator=gen, dtype=torch.float64) * 20).bfloat16()
        pattern = tv.jacobian_sparsity(f, x)
        assert _covers(pattern, _reference(f, x))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = tv.sparse_jacobian(f, x, pattern=pattern)
        assert got.shape == (64, 64)
