"""strategy='auto' reads f's graph for the operators torch differentiates wrongly (NOTE [auto
reads the graph for known wrong operators]): a degenerate first point, where the wrong
products agree with the right ones, does not decide the route of later calls."""

import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64


def _forward_loop(f, x):
    """The Jacobian by one forward product per column, without vmap."""
    cols = [torch.func.jvp(f, (x,), (e,))[1] for e in torch.eye(x.numel(), dtype=D)]
    return torch.stack(cols, -1)


def _reverse_rows(f, x):
    """The Jacobian by one plain backward pass per output element, without vmap."""
    xx = x.clone().requires_grad_()
    out = f(xx).reshape(-1)
    rows = [torch.autograd.grad(out[i], xx, retain_graph=True)[0] for i in range(out.numel())]
    return torch.stack(rows).reshape(*f(x).shape, *x.shape)


def test_auto_as_strided_scatter_after_a_zero_first_point():
    s = torch.tensor(0.7, dtype=D)

    def f(x):
        return torch.as_strided_scatter(x * x, s * x[:2], (2,), (1,), 0).sin()

    with pytest.warns(tv.JacobianWarning, match="backward formula of it is wrong"):
        first = tv.jacobian(f, torch.zeros(4, dtype=D))
    torch.testing.assert_close(first, _forward_loop(f, torch.zeros(4, dtype=D)))
    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = tv.jacobian(f, x)
    torch.testing.assert_close(got, _forward_loop(f, x), rtol=1e-10, atol=1e-10)


def test_auto_cdist_after_a_first_point_where_the_factor_is_zero():
    gen = torch.Generator().manual_seed(3)
    y = torch.randn(5, 3, dtype=D, generator=gen)

    def g(x):
        return torch.cdist(x.reshape(4, 3), y) * x.sum()

    x0 = torch.randn(12, dtype=D, generator=gen)
    x0 = x0 - x0.mean()
    with pytest.warns(tv.JacobianWarning, match="batching rule for the backward of torch.cdist"):
        tv.jacobian(g, x0)
    x = torch.randn(12, dtype=D, generator=gen)
    got = tv.jacobian(g, x)
    torch.testing.assert_close(got, _reverse_rows(g, x), rtol=1e-10, atol=1e-10)


def test_auto_batch_jacobian_cdist_after_a_degenerate_first_point():
    gen = torch.Generator().manual_seed(4)
    y = torch.randn(5, 3, dtype=D, generator=gen)

    def g(x):  # (B, 6) -> (B, 2, 5)
        return torch.cdist(x.reshape(-1, 2, 3), y.expand(x.shape[0], 5, 3)) \
            * x.sum(-1)[:, None, None]

    x0 = torch.randn(3, 6, dtype=D, generator=gen)
    x0 = x0 - x0.mean(-1, keepdim=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tv.batch_jacobian(g, x0)
    x = torch.randn(3, 6, dtype=D, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.batch_jacobian(g, x)
    want = torch.stack([_reverse_rows(lambda r: g(r[None])[0], r) for r in x])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_route_remembered_before_f_took_cdist_is_not_reused():
    # (the same function and signature, f's graph changed by a flag it reads: NOTE [a
    # remembered route through a known wrong operator])
    gen = torch.Generator().manual_seed(6)
    y = torch.randn(5, 3, dtype=D, generator=gen)
    W = torch.randn(20, 12, dtype=D, generator=gen)
    flags = {"cdist": False}

    def g(x):
        if flags["cdist"]:
            return (torch.cdist(x.reshape(4, 3), y) * x.sum()).reshape(-1)
        return W @ x

    x = torch.randn(12, dtype=D, generator=gen)
    torch.testing.assert_close(tv.jacobian(g, x), W)
    flags["cdist"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        for _ in range(2):
            got = tv.jacobian(g, x)
            torch.testing.assert_close(got, _reverse_rows(g, x), rtol=1e-10, atol=1e-10)


def test_a_route_remembered_before_f_took_as_strided_scatter_is_not_reused():
    s = torch.tensor(0.7, dtype=D)
    flags = {"scatter": False}

    def f(x):
        if flags["scatter"]:
            return torch.as_strided_scatter(x * x, s * x[:2], (2,), (1,), 0).sin()
        return (x * x).sin()

    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(9))
    tv.jacobian(f, x)
    flags["scatter"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        got = tv.jacobian(f, x)
    torch.testing.assert_close(got, _forward_loop(f, x), rtol=1e-10, atol=1e-10)
