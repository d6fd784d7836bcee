"""An error f raises itself propagates untouched: after one call under every named strategy
(the loops fall back to plain autograd only where torch.func refused f), with nothing of the
library chained to it; "auto" calls f at most once more (NOTE [a probe f cannot answer])."""

import warnings

import pytest
import torch

import torch_vjp as tv

from _references import OldStyleSquare


def _counting():
    calls = [0]

    def f(x):
        calls[0] += 1
        raise ValueError("mine")

    return f, calls


@pytest.mark.parametrize("n", [3, 30])
@pytest.mark.parametrize("strategy", ["auto", "rev", "rev-loop", "fwd", "fwd-loop"])
def test_own_error_untouched(strategy, n):
    f, calls = _counting()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no fallback warning either)
        with pytest.raises(ValueError) as info:
            tv.jacobian(f, torch.randn(n, dtype=torch.float64), strategy=strategy)
    assert str(info.value) == "mine"
    assert info.value.__cause__ is None and info.value.__context__ is None
    assert calls[0] == (2 if strategy == "auto" else 1)


def test_refused_by_torch_func_still_runs_in_plain_autograd():
    # (an old-style custom Function: torch.func refuses it, plain autograd runs it)
    x = torch.randn(4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        j = tv.jacobian(lambda y: OldStyleSquare.apply(y).sin(), x, strategy="rev-loop")
    torch.testing.assert_close(j, torch.diag(2 * x * (x * x).cos()))
