"""Sparse Jacobians through F.affine_grid: each coordinate of a grid point depends on its
example's row of theta only (against a naive loop in float64)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F


_GRIDS = [
    ((2, 2, 3), (2, 1, 3, 4)),
    ((1, 2, 3), (1, 3, 1, 5)),
    ((2, 3, 4), (2, 1, 2, 3, 2)),
]


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("theta_shape, size", _GRIDS, ids=[str(c[1]) for c in _GRIDS])
def test_an_affine_grid_depends_on_its_row_of_theta(theta_shape, size, align_corners, ruled_pattern):
    # affine_grid_generator had no rule: every grid coordinate was taken to depend on every
    # element of theta, of every example (a dense pattern, with a warning)
    n = math.prod(theta_shape)

    def f(v):
        return F.affine_grid(v.reshape(theta_shape), list(size),
                             align_corners=align_corners).flatten()

    x = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ruled_pattern(f, x, exact=False)
