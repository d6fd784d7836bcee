"""A named forward strategy through an operator whose forward-mode formula torch has wrong
(torch.linalg.det at a singular matrix: NOTE [forward mode through a wrong formula]) in the
calling contexts where the eager reading did not run: inference mode (NOTE [named forward in
inference mode]) and the user's torch.compile (NOTE [forward mode through a wrong formula,
traced], NOTE [reverse mode through det, traced]). Refused with
the eager path's StrategyError where forward mode is named; "auto" right. float64, against
torch.func.jacrev (torch.autograd.functional.jacobian's det backward is wrong there)."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64
S = torch.tensor([[1., 2.], [2., 4.]], dtype=D)
C = torch.arange(1., 11., dtype=D)

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _tall(A):  # (more outputs than inputs: "auto" chooses forward mode by size)
    return torch.det(A) * C


def _tall_rows(A):
    return torch.det(A)[:, None] * C


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        return fn()


def _assert_refused(err, call, strategy):
    msg = str(err.value)
    assert msg.startswith(f"{call}: strategy={strategy!r} computes with forward-mode AD")
    assert "forward-mode formula of torch.linalg.det is wrong at singular" in msg
    assert "the Jacobian would be wrong" in msg
    assert "Fix: strategy='rev'" in msg


@pytest.mark.parametrize("strategy", ["fwd", "fwd-loop"])
@pytest.mark.parametrize("f", [torch.det, _tall], ids=["det", "tall"])
def test_named_forward_in_inference_mode_is_refused(strategy, f):
    with torch.inference_mode(), pytest.raises(tv.StrategyError) as err:
        tv.jacobian(f, S.clone(), strategy=strategy)
    _assert_refused(err, "torch_vjp.jacobian", strategy)
    # (and remembered: outside the mode, the same refusal)
    with pytest.raises(tv.StrategyError):
        tv.jacobian(f, S, strategy=strategy)


@pytest.mark.parametrize("strategy", ["fwd", "fwd-loop"])
def test_named_forward_batch_jacobian_in_inference_mode_is_refused(strategy):
    with torch.inference_mode(), pytest.raises(tv.StrategyError) as err:
        tv.batch_jacobian(torch.det, S[None].clone(), strategy=strategy)
    _assert_refused(err, "torch_vjp.batch_jacobian", strategy)


@pytest.mark.parametrize("f", [torch.det, _tall], ids=["det", "tall"])
def test_auto_in_inference_mode_is_right(f):
    with torch.inference_mode():
        J = _quiet(lambda: tv.jacobian(f, S.clone()))
    torch.testing.assert_close(J, torch.func.jacrev(f)(S))


def test_auto_batch_jacobian_in_inference_mode_is_right():
    with torch.inference_mode():
        J = _quiet(lambda: tv.batch_jacobian(_tall_rows, S[None].clone()))
    torch.testing.assert_close(J[0], torch.func.jacrev(_tall)(S))


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager")


@pytest.mark.parametrize("f,strategy", [(torch.det, "fwd"), (torch.det, "fwd-loop"),
                                        (_tall, "fwd")], ids=["det-fwd", "det-fwd-loop", "tall-fwd"])
def test_named_forward_in_torch_compile_is_refused(strategy, f):
    with pytest.raises(tv.StrategyError) as err:
        _compiled(lambda x: tv.jacobian(f, x, strategy=strategy))(S)
    _assert_refused(err, "torch_vjp.jacobian", strategy)


@pytest.mark.parametrize("strategy", ["fwd", "fwd-loop"])
def test_named_forward_batch_jacobian_in_torch_compile_is_refused(strategy):
    with pytest.raises(tv.StrategyError) as err:
        _compiled(lambda x: tv.batch_jacobian(torch.det, x, strategy=strategy))(S[None])
    _assert_refused(err, "torch_vjp.batch_jacobian", strategy)


@pytest.mark.parametrize("strategy", ["auto", "rev"])
@pytest.mark.parametrize("f", [torch.det, _tall], ids=["det", "tall"])
def test_auto_and_rev_in_torch_compile_are_right(strategy, f):
    ref = torch.func.jacrev(f)(S)
    J = _quiet(lambda: _compiled(lambda x: tv.jacobian(f, x, strategy=strategy))(S))
    torch.testing.assert_close(J, ref)
    # (a detached result still, for an input that requires grad)
    x = S.clone().requires_grad_()
    J = _quiet(lambda: _compiled(lambda x: tv.jacobian(f, x, strategy=strategy))(x))
    assert not J.requires_grad
    torch.testing.assert_close(J, ref)


@pytest.mark.parametrize("strategy", ["auto", "rev"])
def test_batch_jacobian_auto_and_rev_in_torch_compile_are_right(strategy):
    J = _quiet(lambda: _compiled(lambda x: tv.batch_jacobian(_tall_rows, x,
                                                             strategy=strategy))(S[None]))
    torch.testing.assert_close(J[0], torch.func.jacrev(_tall)(S))


def test_compile_true_auto_is_right():
    # (its mode is chosen eagerly, by one forward product that agrees at a regular matrix)
    R = torch.tensor([[2., 1.], [0., 3.]], dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tv.jacobian(_tall, R, compile=True)
        J = tv.jacobian(_tall, S, compile=True)
    torch.testing.assert_close(J, torch.func.jacrev(_tall)(S))
