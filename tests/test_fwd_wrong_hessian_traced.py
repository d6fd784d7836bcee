"""torch_vjp.hessian through torch.linalg.det at singular matrices inside the user's
torch.compile and under compile=True (NOTE [forward over reverse through det, traced]), and
eagerly under torch.inference_mode() and torch.no_grad(). float64, against reverse over
reverse with torch.func (torch.func.hessian, forward over reverse, is not a reference here)
and central differences of the gradient."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64
S2 = torch.tensor([[1., 2.], [2., 4.]], dtype=D)
R1 = torch.outer(torch.tensor([1., 2., 3.], dtype=D), torch.tensor([1., -1., 2.], dtype=D))
R2 = torch.tensor([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]], dtype=D)
POINTS = pytest.mark.parametrize("S", [S2, R1, R2], ids=["2x2", "rank1", "rank2"])
STRATEGIES = ["auto", "fwd", "fwd-loop", "rev", "rev-loop"]

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _det_sum(A):  # (det inside other operations)
    return torch.linalg.det(A) * 3.0 + A.sum()


def _reference(f, S):
    ref = torch.func.jacrev(torch.func.jacrev(f))(S)
    # (central differences of the gradient: the reference is right at this point)
    g, eps = torch.func.grad(f), 1e-6
    fd = torch.stack([(g(S + eps * e.view_as(S)) - g(S - eps * e.view_as(S))) / (2 * eps)
                      for e in torch.eye(S.numel(), dtype=D)]).reshape(*S.shape, *S.shape)
    torch.testing.assert_close(ref, fd, atol=1e-6, rtol=1e-6)
    return ref


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager")


# (every strategy at one point; forward over reverse ('auto') and reverse over reverse at
# the others: the loops and a named 'fwd' trace the same plain form as their mode's)
_CASES = [(S2, torch.det, s) for s in STRATEGIES] + [
    (S, f, s) for S, f in ((R1, torch.det), (R2, torch.det), (R2, _det_sum))
    for s in ("auto", "rev")]


@pytest.mark.parametrize("S, f, strategy", _CASES, ids=[
    f"{n}-{s}" for n, s in [("2x2", s) for s in STRATEGIES]
    + [(n, s) for n in ("rank1", "rank2", "det_sum") for s in ("auto", "rev")]])
def test_hessian_in_torch_compile_is_right(S, f, strategy):
    ref = _reference(f, S)
    S0 = S.clone()
    H = _quiet(lambda: _compiled(lambda x: tv.hessian(f, x, strategy=strategy))(S))
    torch.testing.assert_close(H, ref)
    torch.testing.assert_close(S, S0, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ["auto", "fwd"])
def test_hessian_in_torch_compile_of_input_that_requires_grad(strategy):
    x = R2.clone().requires_grad_()
    H = _quiet(lambda: _compiled(lambda x: tv.hessian(torch.det, x, strategy=strategy))(x))
    assert not H.requires_grad
    torch.testing.assert_close(H, _reference(torch.det, R2))


def test_hessian_in_inductor_compile_is_right():
    torch._dynamo.reset()
    H = _quiet(lambda: torch.compile(lambda x: tv.hessian(torch.det, x))(R1))
    torch.testing.assert_close(H, _reference(torch.det, R1))


@pytest.mark.parametrize("strategy", ["auto", "rev"])
def test_hessian_compile_true_is_right(strategy):
    torch._dynamo.reset()
    for S in (S2, S2 * 2):  # (the second call runs the compiled program)
        H = _quiet(lambda: tv.hessian(torch.det, S, strategy=strategy, compile=True))
        torch.testing.assert_close(H, _reference(torch.det, S))


@POINTS
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("context", [torch.inference_mode, torch.no_grad],
                         ids=["inference_mode", "no_grad"])
def test_hessian_in_inference_mode_and_no_grad_is_right(S, strategy, context):
    ref = _reference(torch.det, S)
    with context():
        H = _quiet(lambda: tv.hessian(torch.det, S.clone(), strategy=strategy))
    torch.testing.assert_close(H, ref)
