"""A vectorised strategy where torch.vmap has no batching rule for an operator in f is
refused with a StrategyError naming vmap, the operator and the fix; the loop strategy it
names computes the Jacobian (float64, against torch.func.jvp columns)."""
import pytest
import torch

import torch_vjp as tv


def _f_and_x():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, dtype=torch.float64, generator=g)
    x = torch.randn(4, dtype=torch.float64, generator=g)

    def f(x):
        return torch.as_strided_scatter(x * 1.0, s * x[:2], (2,), (1,), 0) * x.sum()

    return f, x


def _jvp_columns(f, x):
    eye = torch.eye(x.numel(), dtype=x.dtype)
    return torch.stack([torch.func.jvp(f, (x,), (e,))[1] for e in eye], dim=1)


def test_fwd_without_batching_rule_names_vmap_op_and_fix():
    f, x = _f_and_x()
    with pytest.raises(tv.StrategyError) as info:
        tv.jacobian(f, x, strategy="fwd")
    msg = str(info.value)
    assert "strategy='fwd'" in msg and "torch.vmap" in msg
    assert "no batching rule for aten::as_strided_scatter" in msg
    assert "does not yet have a batching rule" in msg  # torch's own words, quoted
    assert "Fix: strategy='fwd-loop'" in msg
    assert isinstance(info.value, tv.TorchVJPError)


def test_fwd_loop_named_by_the_fix_is_right():
    f, x = _f_and_x()
    torch.testing.assert_close(tv.jacobian(f, x, strategy="fwd-loop"), _jvp_columns(f, x))


def test_errors_of_the_users_f_pass_through_under_fwd():
    def f(x):
        raise RuntimeError("my own failure")

    with pytest.raises(RuntimeError, match="^my own failure$") as info:
        tv.jacobian(f, torch.randn(3, dtype=torch.float64), strategy="fwd")
    assert not isinstance(info.value, tv.TorchVJPError)
