"""The advice of a vectorised Hessian's refusal works: strategy='fwd' through
torch.as_strided_scatter (which torch.vmap cannot batch) named strategy='fwd-loop', which
then refused the Hessian (the operator's backward is wrong for the tensor scattered into).
The error now is the loop's own refusal, whose fix runs; where the loop computes the
Hessian rightly (only the scattered source is differentiated), 'fwd-loop' stays the fix.
float64, against central differences of a forward-mode gradient."""
import re

import pytest
import torch

import torch_vjp as tv

D = torch.float64


def _into_input(x):
    return torch.as_strided_scatter(x, x[:2] ** 2, (2,), (1,)).pow(3).sum()


_BASE = torch.linspace(-1.0, 1.0, 4, dtype=D)


def _source_only(x):
    # (the tensor scattered into is a constant: only the source is differentiated)
    return torch.as_strided_scatter(_BASE, x[:2] ** 2, (2,), (1,)).pow(3).sum() + x.sin().sum()


def _fd_hessian(f, x, eps=1e-5):
    def grad(v):  # (forward-mode gradient: torch's forward formula is right)
        return tv.jacobian(f, v, strategy="fwd-loop")
    eye = torch.eye(x.numel(), dtype=D)
    cols = [(grad(x + eps * e) - grad(x - eps * e)) / (2 * eps) for e in eye]
    return torch.stack(cols, dim=1)


def _run_fix(message, f, x):
    code = re.search(r"Fix: [^:]*: (torch_vjp\.[^\n]*?) for a scalar f", message).group(1)
    return eval(code, {"torch_vjp": tv, "f": f, "x": x})


@pytest.mark.parametrize("strategy", ["fwd", "fwd-loop", "rev", "auto"])
def test_refusal_through_the_wrong_backward_names_a_fix_that_runs(strategy):
    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(0))
    with pytest.raises(tv.JacobianCallError) as info:
        tv.hessian(_into_input, x, strategy=strategy)
    message = str(info.value)
    assert "as_strided_scatter is wrong for the tensor scattered into" in message
    assert f"strategy={strategy!r} names the outer Jacobian only" in message
    H = _run_fix(message, _into_input, x)
    torch.testing.assert_close(H, _fd_hessian(_into_input, x), rtol=1e-6, atol=1e-6)


def test_fwd_names_the_loop_where_the_loop_is_right():
    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))
    with pytest.raises(tv.StrategyError, match=r"no batching rule for aten::as_strided_scatter"
                       r"(.|\n)*Fix: strategy='fwd-loop'"):
        tv.hessian(_source_only, x, strategy="fwd")
    H = tv.hessian(_source_only, x, strategy="fwd-loop")  # (the advice, followed)
    torch.testing.assert_close(H, _fd_hessian(_source_only, x), rtol=1e-6, atol=1e-6)
