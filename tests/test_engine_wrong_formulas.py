"""A backward formula torch computes wrongly (torch 2.13: as_strided_scatter's): "auto"
checks its reverse product against a forward product (NOTE [a reverse product checked
forward]); named reverse strategies read f's graph for operators torch differentiates
wrongly (NOTE [named reverse strategies and wrong formulas]): as_strided_scatter's
backward is refused, cdist's batching rule is not used. float64, against torch.func.jvp columns, finite differences and a loop of
torch.autograd.grad rows."""

import pytest
import torch

import torch_vjp as tv

from _references import caught as _caught, central_difference as _fd, jvp_columns as _jvp_columns

D = torch.float64


# (each test sees its own first call of "auto": conftest's fresh_route_checks)
pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _grad_rows(f, x):
    out = f(x)
    rows = []
    for i in range(out.numel()):
        xx = x.detach().clone().requires_grad_(True)
        rows.append(torch.autograd.grad(f(xx).reshape(-1)[i], xx)[0].reshape(-1))
    return torch.stack(rows).reshape(*out.shape, *x.shape)


def _scatter_f(n_out=None):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, dtype=D, generator=g)
    W = None if n_out is None else torch.randn(n_out, 2, dtype=D, generator=g)

    def f(x):
        y = torch.as_strided_scatter(x * 1.0, s * x[:2], (2,), (1,), 0) * x.sum()
        return y if W is None else W @ y.tanh()

    return f


def test_auto_through_as_strided_scatter_takes_forward_mode_and_says_why():
    f = _scatter_f()
    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))
    want = _jvp_columns(f, x)
    torch.testing.assert_close(want, _fd(f, x))
    J, said = _caught(lambda: tv.jacobian(f, x))
    torch.testing.assert_close(J, want)
    assert len(said) == 1
    msg = said[0]
    assert "disagrees with a forward product" in msg and "central difference" in msg
    assert "wrong backward formula" in msg and "as_strided_scatter" in msg
    assert "Pass strategy='fwd-loop'" in msg
    # later calls take the route remembered, silently, and stay right
    J2, said2 = _caught(lambda: tv.jacobian(f, x))
    torch.testing.assert_close(J2, want)
    assert said2 == []


def test_auto_tall_through_as_strided_scatter_keeps_forward_mode():
    # (forward mode is auto's first route here, and was replaced by the wrong reverse mode)
    f = _scatter_f(n_out=400)
    x = torch.randn(2, dtype=D, generator=torch.Generator().manual_seed(1))
    J, said = _caught(lambda: tv.jacobian(f, x))
    torch.testing.assert_close(J, _jvp_columns(f, x))
    torch.testing.assert_close(J, _fd(f, x))
    assert not any("wrong forward-mode derivative" in m for m in said)


def test_auto_batch_jacobian_through_as_strided_scatter():
    f1 = _scatter_f()
    xb = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(2))
    J, _ = _caught(lambda: tv.batch_jacobian(lambda xb: torch.stack([f1(r) for r in xb]), xb))
    want = torch.stack([_jvp_columns(f1, r) for r in xb])
    torch.testing.assert_close(J, want)


class _NoJvp(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.exp()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


def test_auto_without_a_forward_formula_is_unchanged():
    # (the forward product cannot be taken: the reverse route stands, silently)
    x = torch.randn(3, dtype=D)

    def f(x):
        return _NoJvp.apply(x) * x.sum()

    J, said = _caught(lambda: tv.jacobian(f, x))
    torch.testing.assert_close(J, _grad_rows(f, x))
    assert said == []


# --------------------------------------------------------------------------------------
# Named reverse strategies
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["rev", "rev-loop"])
def test_named_reverse_through_as_strided_scatter_is_refused(strategy):
    f = _scatter_f()
    x = torch.randn(4, dtype=D)
    with pytest.raises(tv.StrategyError) as info:
        tv.jacobian(f, x, strategy=strategy)
    msg = str(info.value)
    assert f"strategy={strategy!r}" in msg
    assert "backward formula of torch.as_strided_scatter is wrong" in msg
    assert "the Jacobian would be wrong" in msg
    assert "Fix: strategy='fwd-loop'" in msg and "'auto'" in msg
    torch.testing.assert_close(tv.jacobian(f, x, strategy="fwd-loop"), _jvp_columns(f, x))


def test_named_reverse_scattering_into_a_constant_is_not_refused():
    # (the gradient of the scattered source is right: only the tensor scattered into's is not)
    def f(x):
        return torch.as_strided_scatter(torch.zeros(9, dtype=D), x, (2, 2), (1, 2), 1)

    x = torch.randn(2, 2, dtype=D)
    torch.testing.assert_close(tv.jacobian(f, x, strategy="rev"), _fd(f, x))


def test_errors_of_the_users_f_pass_through_named_rev():
    def f(x):
        raise RuntimeError("my own failure")

    with pytest.raises(RuntimeError, match="^my own failure$") as info:
        tv.jacobian(f, torch.randn(3, dtype=D), strategy="rev")
    assert not isinstance(info.value, tv.TorchVJPError)


def _cdist_f():
    y = torch.randn(4, 3, dtype=D, generator=torch.Generator().manual_seed(3))
    return lambda x: torch.cdist(x, y)


def test_named_rev_through_cdist_computes_rows_without_vmap():
    f = _cdist_f()
    x = torch.randn(5, 3, dtype=D, generator=torch.Generator().manual_seed(4))
    J, said = _caught(lambda: tv.jacobian(f, x, strategy="rev"))
    torch.testing.assert_close(J, _grad_rows(f, x))
    assert len(said) == 1
    msg = said[0]
    assert "strategy='rev'" in msg and "batching rule" in msg and "torch.cdist" in msg
    assert "one reverse product at a time" in msg and "Pass strategy='rev-loop'" in msg
    J2, said2 = _caught(lambda: tv.jacobian(f, x, strategy="rev"))
    torch.testing.assert_close(J2, _grad_rows(f, x))
    assert said2 == []


def test_named_rev_through_cdist_with_chunk_size_one_says_nothing():
    f = _cdist_f()
    x = torch.randn(5, 3, dtype=D)
    J, said = _caught(lambda: tv.jacobian(f, x, strategy="rev", chunk_size=1))
    torch.testing.assert_close(J, _grad_rows(f, x))
    assert said == []


def test_named_rev_batch_jacobian_through_cdist():
    f = _cdist_f()

    def g(x):
        return f(x).sum(-1)

    xb = torch.randn(6, 5, 3, dtype=D, generator=torch.Generator().manual_seed(5))
    J, _ = _caught(lambda: tv.batch_jacobian(g, xb, strategy="rev"))
    torch.testing.assert_close(J, torch.stack([_grad_rows(g, r) for r in xb]))
