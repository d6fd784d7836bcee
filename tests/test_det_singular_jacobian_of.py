"""tv.jacobian_of through torch.linalg.det at a singular matrix: torch's backward of det is
right there only in grad mode (NOTE [a backward right only in grad mode] in
torch_vjp._engine.wrongops), and jacobian_of's products are backward passes of the caller's
graph without create_graph. float64 against torch.func.jacrev of the same function."""

from __future__ import annotations

import pytest
import torch

import torch_vjp as tv

D = torch.float64
SINGULAR = [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [4.0, 5.0, 7.0]]
RANK_TWO = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
REGULAR = [[2.0, 1.0, 0.5], [0.3, 3.0, 1.0], [1.0, 0.2, 4.0]]
W = torch.tensor([1.0, -2.0, 0.5], dtype=D)


def _f(a):
    return torch.linalg.det(a) * W + a.sum()


@pytest.mark.parametrize("point", [SINGULAR, RANK_TWO, REGULAR])
@pytest.mark.parametrize("chunk_size", [None, 1])
def test_jacobian_of_through_det_matches_jacrev(point, chunk_size):
    a = torch.tensor(point, dtype=D, requires_grad=True)
    want = torch.func.jacrev(_f)(a.detach())
    got = tv.jacobian_of(_f(a), a, chunk_size=chunk_size)
    torch.testing.assert_close(got, want)
    assert not got.requires_grad


def test_jacobian_of_through_det_with_create_graph_stays_differentiable():
    a = torch.tensor(SINGULAR, dtype=D, requires_grad=True)
    got = tv.jacobian_of(_f(a), a, create_graph=True)
    torch.testing.assert_close(got.detach(), torch.func.jacrev(_f)(a.detach()))
    assert got.requires_grad
