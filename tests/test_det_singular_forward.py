"""Forward mode through torch.linalg.det (NOTE [forward mode through a wrong formula]): its
forward-mode formula is wrong at singular matrices, a property of the point, so a named
forward strategy refuses it at every point, naming reverse mode, torch_vjp.jvp computes J t
by reverse over reverse at every point, and "auto" does not remember forward mode through
it. float64, against torch.func.jacrev."""

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

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _tall(A):
    return torch.linalg.det(A) * W + A.sum()


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        return fn()


def test_torchs_forward_formula_of_det_is_wrong_at_a_singular_matrix():
    # (the premise: if torch fixes its formula, the entry in WRONG_FORWARD is to go)
    jf = torch.func.jacfwd(_tall)(SINGULAR)
    assert (jf - torch.func.jacrev(_tall)(SINGULAR)).abs().max() > 0.5


@pytest.mark.parametrize("strategy", ["fwd", "fwd-loop"])
@pytest.mark.parametrize("det", [torch.linalg.det, torch.det, torch.Tensor.det],
                         ids=["linalg.det", "torch.det", "Tensor.det"])
def test_named_forward_through_det_is_refused_naming_reverse_mode(strategy, det):
    def f(A):
        return det(A) * W

    with pytest.raises(tv.StrategyError) as err:
        tv.jacobian(f, REGULAR, strategy=strategy)
    msg = str(err.value)
    assert f"strategy={strategy!r} computes with forward-mode AD" in msg
    assert "forward-mode formula of torch.linalg.det is wrong at singular" in msg
    assert "refused at every point" in msg
    assert "Fix: strategy='rev'" in msg
    # (the fix named is right)
    torch.testing.assert_close(tv.jacobian(f, SINGULAR, strategy="rev"),
                               torch.func.jacrev(f)(SINGULAR))


def test_jvp_through_det_is_computed_by_reverse_mode_at_every_point():
    t = torch.randn(3, 3, dtype=D, generator=torch.Generator().manual_seed(6))
    with pytest.warns(tv.JacobianWarning) as rec:
        _, jt = tv.jvp(_tall, (REGULAR,), (t,))
    msg = " ".join(str(w.message) for w in rec if w.category is tv.JacobianWarning)
    assert "forward-mode formula of torch.linalg.det is wrong at singular" in msg
    assert "J t is computed this way at every point" in msg
    for A in (REGULAR, SINGULAR, RANK_2):
        _, jt = _quiet(lambda: tv.jvp(_tall, (A,), (t,)))
        torch.testing.assert_close(jt, torch.func.jacrev(_tall)(A).reshape(20, 9)
                                   @ t.reshape(9))


def test_auto_remembered_at_a_regular_matrix_is_right_at_a_later_singular_one():
    _quiet(lambda: tv.jacobian(_tall, REGULAR))
    for A in (SINGULAR, RANK_2):
        J = _quiet(lambda: tv.jacobian(_tall, A))
        torch.testing.assert_close(J, torch.func.jacrev(_tall)(A))


def test_auto_does_not_take_forward_mode_through_det_at_a_regular_matrix():
    W2 = torch.randn(2000, dtype=D, generator=torch.Generator().manual_seed(5))

    def f(A):  # (tall: "auto" tries forward mode first)
        return torch.linalg.det(A) * W2 + A.sum()

    with pytest.warns(tv.JacobianWarning) as rec:
        J = tv.jacobian(f, REGULAR)
    torch.testing.assert_close(J, torch.func.jacrev(f)(REGULAR))
    msg = " ".join(str(w.message) for w in rec if w.category is tv.JacobianWarning)
    assert "forward-mode formula of torch.linalg.det in f" in msg
    assert "they agree at this matrix, and forward mode would be wrong at singular ones" in msg
    assert "strategy='auto' computed the Jacobian with reverse mode" in msg
    assert "Pass strategy='rev'" in msg
    # (remembered: later singular matrices take reverse mode, right there)
    for A in (SINGULAR, RANK_2):
        torch.testing.assert_close(tv.jacobian(f, A), torch.func.jacrev(f)(A))
