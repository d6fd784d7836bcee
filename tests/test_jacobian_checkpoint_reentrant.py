"""torch.utils.checkpoint with use_reentrant=True: its backward refuses torch.autograd.grad
(it runs only inside .backward() without inputs), torch.func cannot run it (an old-style
custom Function) and it has no forward-mode formula, so no strategy computes through it.
"auto" and the reverse loops leaked torch's RuntimeError, which blames ".grad()" the user
never called; they now say what f uses, why it cannot be computed, and the fix
(use_reentrant=False, with which every strategy computes the Jacobian)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint as ck

import torch_vjp as tv

D = torch.float64


def _inner(t):
    return t.sin() * t.sum()


def _reentrant(a):
    return ck.checkpoint(_inner, a, use_reentrant=True)


def _not_reentrant(a):
    return ck.checkpoint(_inner, a, use_reentrant=False)


@pytest.mark.parametrize("call", ["jacobian-auto", "jacobian-rev-loop", "batch-jacobian-auto",
                                  "batch-jacobian-rev-loop"])
def test_a_reentrant_checkpoint_is_refused_with_its_fix(call):
    x = torch.randn(3, 4, dtype=D)
    strategy = "rev-loop" if call.endswith("rev-loop") else "auto"
    fn = tv.jacobian if call.startswith("jacobian") else tv.batch_jacobian
    name = f"torch_vjp.{fn.__name__}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("auto" warns that it could not vectorise)
        with pytest.raises(tv.JacobianCallError) as info:
            fn(_reentrant, x, strategy=strategy)
    msg = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert msg.startswith(f"{name}: f uses torch.utils.checkpoint with use_reentrant=True, "
                          "whose backward runs only inside .backward() called without inputs")
    assert "it has no forward-mode formula" in msg
    assert msg.rstrip().endswith("Fix: pass use_reentrant=False to torch.utils.checkpoint "
                                 "(torch's recommended setting; every strategy computes "
                                 "through it).")


@pytest.mark.parametrize("strategy", ["auto", "fwd", "rev-loop", "fwd-loop"])
def test_the_fix_computes_the_jacobian(strategy):
    x = torch.randn(3, 4, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        J = tv.jacobian(_not_reentrant, x, strategy=strategy)
    # (the reference: the same function without the checkpoint)
    torch.testing.assert_close(J, torch.func.jacrev(_inner)(x))


def test_an_error_of_fs_own_in_a_reentrant_checkpoint_passes_through():
    def raises(a):
        raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        tv.jacobian(lambda a: ck.checkpoint(raises, a, use_reentrant=True),
                    torch.randn(3, dtype=D), strategy="rev-loop")
