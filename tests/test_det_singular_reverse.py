"""Reverse products through torch.linalg.det at singular matrices (NOTE [a backward right
only in grad mode]): every reverse product runs its backward in grad mode where f's graph
holds det, detached after. float64, against torch.func.jacrev (right there) at singular
and regular matrices."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64
W = torch.randn(20, dtype=D, generator=torch.Generator().manual_seed(3))
SINGULAR = torch.tensor([[1., 2, 3], [0, 0, 0], [4, 5, 7]], dtype=D)
RANK_2 = torch.tensor([[1., 2, 3], [4, 5, 6], [7, 8, 9]], dtype=D)  # (a pivot of rounding size)
REGULAR = torch.randn(3, 3, dtype=D, generator=torch.Generator().manual_seed(4))
POINTS = pytest.mark.parametrize("A", [SINGULAR, RANK_2, REGULAR],
                                 ids=["zero-pivot", "rank-2", "regular"])

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _tall(A):
    return torch.linalg.det(A) * W + A.sum()


def _wide(A):
    return torch.linalg.det(A).unsqueeze(0) * 2


class _Old(torch.autograd.Function):  # (no setup_context: torch.func cannot run it)
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g


def _old_style(A):
    return torch.linalg.det(_Old.apply(A)) * W


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        return fn()


@POINTS
@pytest.mark.parametrize("strategy", ["auto", "rev", "rev-loop"])
@pytest.mark.parametrize("f", [_tall, _wide], ids=["tall", "wide"])
def test_reverse_and_auto_jacobians_through_det_are_right(A, strategy, f):
    J = _quiet(lambda: tv.jacobian(f, A, strategy=strategy))
    torch.testing.assert_close(J, torch.func.jacrev(f)(A))
    assert not J.requires_grad


@POINTS
@pytest.mark.parametrize("strategy", ["auto", "rev-loop"])
def test_the_plain_autograd_loop_through_det_is_right(A, strategy):
    J = _quiet(lambda: tv.jacobian(_old_style, A, strategy=strategy))
    torch.testing.assert_close(J, torch.func.jacrev(lambda B: torch.linalg.det(B) * W)(A))


@POINTS
def test_a_jacobian_that_keeps_its_graph_through_det_is_right(A):
    a = A.clone().requires_grad_()
    J = tv.jacobian(_tall, a, strategy="rev", create_graph=True)
    torch.testing.assert_close(J.detach(), torch.func.jacrev(_tall)(A))
    assert J.requires_grad


@POINTS
def test_vjp_fn_through_det_is_right_without_grad_mode(A):
    ref = torch.func.jacrev(torch.linalg.det)(A)
    one = torch.ones((), dtype=D)
    _, vjp_fn = tv.vjp(torch.linalg.det, A)
    for run, want in ((lambda: vjp_fn(one)[0], ref),
                      (lambda: vjp_fn(one, create_graph=False)[0], ref),
                      (lambda: vjp_fn(torch.ones(3, dtype=D), batched=True)[0],
                       ref.expand(3, 3, 3))):
        with torch.no_grad():
            g = run()
        torch.testing.assert_close(g, want)
        assert not g.requires_grad
    with torch.no_grad():
        _, vjp_fn = tv.vjp(torch.linalg.det, A)
        torch.testing.assert_close(vjp_fn(one)[0], ref)


def test_vjp_fn_through_det_with_create_graph_is_differentiable():
    a = SINGULAR.clone().requires_grad_()
    _, vjp_fn = tv.vjp(torch.linalg.det, a)
    g = vjp_fn(torch.ones((), dtype=D), create_graph=True)[0]
    assert g.requires_grad
    torch.testing.assert_close(g.detach(), torch.func.jacrev(torch.linalg.det)(SINGULAR))


@POINTS
def test_hessian_through_det_is_right(A):
    torch.testing.assert_close(tv.hessian(torch.linalg.det, A),
                               torch.func.jacrev(torch.func.jacrev(torch.linalg.det))(A))


def test_batch_jacobian_through_det_at_singular_matrices_is_right():
    As = torch.stack([SINGULAR, RANK_2, REGULAR])

    def rows(Bs):
        return torch.linalg.det(Bs).unsqueeze(-1) * W + Bs.sum((-2, -1)).unsqueeze(-1)

    J = _quiet(lambda: tv.batch_jacobian(rows, As))
    ref = torch.stack([torch.func.jacrev(_tall)(A) for A in As])
    torch.testing.assert_close(J, ref)
