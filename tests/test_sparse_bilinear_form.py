"""Sparse Jacobians through F.bilinear (aten._trilinear): each output element depends on
its example's rows of both inputs and its output feature's slice of the weight (against a
naive loop in float64), not on every element."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F


_CASES = [
    ("inputs", [(2, 3), (2, 4)], lambda a, b, w: F.bilinear(a, b, w)),
    ("inputs and weight", [(2, 3), (2, 4), (5, 3, 4)], lambda a, b, w: F.bilinear(a, b, w)),
    ("batch dims and bias", [(3, 2, 3), (3, 2, 4), (5, 3, 4), (5,)],
     lambda a, b, w, c: F.bilinear(a, b, w, c)),
]
_W = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


@pytest.mark.parametrize("name, shapes, g", _CASES, ids=[c[0] for c in _CASES])
def test_a_bilinear_form_depends_on_its_rows_and_weight_slice(name, shapes, g, ruled_pattern):
    # _trilinear had no rule: every output element was taken to depend on every element of
    # every operand, across examples (a dense pattern, with a warning)
    sizes = [math.prod(s) for s in shapes]
    n = sum(sizes)

    def f(v):
        parts = [p.reshape(s) for p, s in zip(v.split(sizes), shapes)]
        return (g(*parts) if len(parts) > 2 else g(*parts, _W)).flatten()

    x = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ruled_pattern(f, x)
