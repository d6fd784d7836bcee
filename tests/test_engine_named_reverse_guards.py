"""Named reverse strategies read f's graph for operators torch (2.13) differentiates wrongly
(NOTE [named reverse strategies and wrong formulas]) also where torch.func cannot run f (the
plain-autograd loop of "rev-loop") and inside an outer transform. float64, against
torch.func.jvp columns and a loop of torch.autograd.grad rows."""
import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64
_S = torch.randn(2, dtype=D, generator=torch.Generator().manual_seed(0))
_Y = torch.randn(4, 3, dtype=D, generator=torch.Generator().manual_seed(3))


class _OldIdentity(torch.autograd.Function):  # (forward takes ctx: torch.func cannot run it)
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g


def _scatter(x):
    return torch.as_strided_scatter(x * 1.0, _S * x[:2], (2,), (1,), 0) * x.sum()


def _cdist(x):
    return torch.cdist(x.view(2, 3), _Y).reshape(-1)


def _grad_rows(f, x):
    rows = []
    for i in range(f(x).numel()):
        xx = x.detach().clone().requires_grad_(True)
        rows.append(torch.autograd.grad(f(xx)[i], xx)[0])
    return torch.stack(rows)


def _refused(msg, strategy):
    assert msg.startswith(f"torch_vjp.jacobian: strategy={strategy!r} computes with "
                          f"reverse-mode AD, and torch's backward formula of "
                          f"torch.as_strided_scatter is wrong for the tensor scattered into")
    assert "the Jacobian would be wrong" in msg
    assert "\n  Fix: strategy='fwd-loop'" in msg


def test_rev_loop_with_plain_autograd_through_as_strided_scatter_is_refused():
    x = torch.randn(4, dtype=D)
    with pytest.raises(tv.StrategyError) as info:
        tv.jacobian(lambda v: _scatter(_OldIdentity.apply(v)), x, strategy="rev-loop")
    _refused(str(info.value), "rev-loop")
    # (the plain-autograd loop without the operator is unchanged)
    f = lambda v: _OldIdentity.apply(v).sin() * v.sum()  # noqa: E731
    torch.testing.assert_close(tv.jacobian(f, x, strategy="rev-loop"),
                               torch.func.jacrev(lambda v: v.sin() * v.sum())(x))


@pytest.mark.parametrize("strategy", ["rev", "rev-loop"])
def test_named_reverse_inside_an_outer_transform_through_as_strided_scatter_is_refused(
        strategy):
    x = torch.randn(4, dtype=D)
    with pytest.raises(tv.StrategyError) as info:
        torch.func.grad(lambda v: tv.jacobian(_scatter, v, strategy=strategy).sum())(x)
    _refused(str(info.value), strategy)


def test_named_rev_inside_vmap_through_cdist_computes_rows_without_vmap():
    xs = torch.randn(3, 6, dtype=D, generator=torch.Generator().manual_seed(4))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", tv.JacobianWarning)
        J = torch.func.vmap(lambda v: tv.jacobian(_cdist, v, strategy="rev"))(xs)
    for i in range(3):
        torch.testing.assert_close(J[i], _grad_rows(_cdist, xs[i]))
    said = [str(w.message) for w in got if issubclass(w.category, tv.JacobianWarning)]
    assert len(said) == 1 and "torch.cdist" in said[0] and "batching rule" in said[0]
