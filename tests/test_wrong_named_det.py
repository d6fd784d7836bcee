"""torch's (2.13) derivatives of torch.linalg.det at singular matrices (an exact zero pivot,
or one of rounding size): the forward-mode formula is wrong there, and so is the backward
formula where it runs without grad mode (torch.autograd.grad without create_graph, a
pullback under torch.no_grad(), as the engine's detached products run it); the backward
run in grad mode (torch.func.jacrev) is right. A defect of the point, not of the function.
float64, against central differences."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64
W = torch.randn(20, dtype=D, generator=torch.Generator().manual_seed(0))
SINGULAR = torch.tensor([[1., 2, 3], [0, 0, 0], [4, 5, 7]], dtype=D)

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _central(f, x, eps=1e-6):
    cols = []
    for i in range(x.numel()):
        e = torch.zeros(x.numel(), dtype=D)
        e[i] = eps
        e = e.reshape(x.shape)
        cols.append(((f(x + e) - f(x - e)) / (2 * eps)).reshape(-1))
    return torch.stack(cols, 1)


def _tall(A):  # (more output than input elements)
    return torch.linalg.det(A) * W + A.sum()


@pytest.mark.parametrize("A", [SINGULAR, torch.tensor([[1., 2, 3], [4, 5, 6], [7, 8, 9]],
                                                      dtype=D)], ids=["zero-pivot", "rank-2"])
def test_torchs_own_forward_formula_of_det_is_wrong_at_singular_matrices(A):
    fd = _central(torch.linalg.det, A)
    assert (torch.func.jacfwd(torch.linalg.det)(A).reshape(1, -1) - fd).abs().max() > 0.5
    torch.testing.assert_close(torch.func.jacrev(torch.linalg.det)(A).reshape(1, -1), fd,
                               atol=1e-6, rtol=1e-6)


def test_torchs_own_backward_of_det_is_wrong_at_a_singular_matrix_without_grad_mode():
    fd = _central(torch.linalg.det, SINGULAR).reshape(3, 3)
    a = SINGULAR.clone().requires_grad_()
    assert (torch.autograd.grad(torch.linalg.det(a), a)[0] - fd).abs().max() > 0.5
    torch.testing.assert_close(torch.autograd.grad(torch.linalg.det(a), a, create_graph=True)[0]
                               .detach(), fd, atol=1e-6, rtol=1e-6)
    _, pullback = torch.func.vjp(torch.linalg.det, SINGULAR)
    one = torch.ones((), dtype=D)
    torch.testing.assert_close(pullback(one)[0], fd, atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        assert (pullback(one)[0] - fd).abs().max() > 0.5


@pytest.mark.parametrize("strategy", ["auto", "rev", "rev-loop"])
def test_reverse_and_auto_through_det_at_a_singular_matrix_are_right(strategy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J = tv.jacobian(_tall, SINGULAR, strategy=strategy)
    torch.testing.assert_close(J.reshape(20, 9), _central(_tall, SINGULAR))


def test_auto_through_det_at_a_later_singular_matrix_is_right():
    regular = torch.randn(3, 3, dtype=D, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        tv.jacobian(_tall, regular)
        J = tv.jacobian(_tall, SINGULAR)
    torch.testing.assert_close(J.reshape(20, 9), _central(_tall, SINGULAR))
