"""Sparse Jacobians through F.fold (col2im): each output pixel depends on the column
elements whose windows land on it (against a naive loop in float64), not on all of them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F


_FOLD = [
    # (shape of the columns, fold's arguments)
    ((1, 4, 6), dict(output_size=(3, 4), kernel_size=2)),
    ((2, 8, 6), dict(output_size=(3, 4), kernel_size=2)),
    ((4, 6), dict(output_size=(3, 4), kernel_size=2)),
    ((1, 6, 6), dict(output_size=(4, 5), kernel_size=(2, 3), stride=2, padding=(0, 1))),
    ((1, 4, 4), dict(output_size=(4, 4), kernel_size=2, dilation=2)),
    ((1, 9, 4), dict(output_size=(3, 3), kernel_size=3, padding=1, stride=2)),
]


@pytest.mark.parametrize("shape, options", _FOLD,
                         ids=[f"{c[0]}-" + "-".join(f"{k}={v}" for k, v in c[1].items())
                              for c in _FOLD])
def test_a_fold_gets_the_pattern_of_its_windows(shape, options, ruled_pattern):
    # col2im had no rule: every output pixel was taken to depend on every column element
    # (a dense pattern, with a warning)
    n = math.prod(shape)

    def f(v):
        return F.fold(v.reshape(shape), **options).flatten()

    x = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ruled_pattern(f, x)
