"""Hessians through layer_norm and batch_norm with a weight that is differentiated: the
gradient's single product under vmap is differentiated wrongly there by torch (2.13), so it
runs without vmap (NOTE [a single product batched wrongly] in
torch_vjp/_engine/hessian.py). Checked in float64 against a loop of torch.autograd.grad
rows of the gradient (create_graph=True) and against central differences of
torch.func.grad: torch.func.hessian is wrong here."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv

D = torch.float64
X = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(0))
P = torch.randn(8, dtype=D, generator=torch.Generator().manual_seed(1))


def layer_norm_weight_bias(p):
    return (F.layer_norm(X * p[:4], (4,), p[4:]) ** 3).sum()


def layer_norm_weight_fixed_bias(p):
    return (F.layer_norm(X * p[:4], (4,), p[4:], torch.ones(4, dtype=D)) ** 3).sum()


def batch_norm_weight(p):
    return (F.batch_norm(X * p[:4], None, None, p[4:], None, training=True) ** 3).sum()


def instance_norm_weight(p):  # (batch_norm's kernel)
    return (F.instance_norm(X.reshape(1, 4, 3) * p[:4, None], weight=p[4:]) ** 3).sum()


def layer_norm_fixed_weight(p):  # right before: unchanged
    return (F.layer_norm(X * p[:4] * p[4:], (4,), torch.linspace(0.5, 2.0, 4, dtype=D))
            ** 3).sum()


def mlp(p):  # right before: unchanged
    return torch.tanh(torch.tanh(X @ p[:4]).unsqueeze(-1) * p[4:]).pow(2).sum()


def autograd_rows(f, p):
    """The Hessian as a loop of torch.autograd.grad rows of the gradient."""
    p = p.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(p), p, create_graph=True)
    return torch.stack([torch.autograd.grad(g[i], p, retain_graph=True)[0]
                        for i in range(p.numel())])


def central_differences(f, p, h=1e-5):
    grad = torch.func.grad(f)
    cols = []
    for i in range(p.numel()):
        e = torch.zeros_like(p)
        e[i] = h
        cols.append((grad(p + e) - grad(p - e)) / (2 * h))
    return torch.stack(cols, 1)


CASES = [layer_norm_weight_bias, layer_norm_weight_fixed_bias, batch_norm_weight,
         instance_norm_weight, layer_norm_fixed_weight, mlp]


@pytest.mark.parametrize("strategy", ["auto", "fwd", "rev", "fwd-loop", "rev-loop"])
@pytest.mark.parametrize("f", CASES, ids=lambda f: f.__name__)
def test_every_strategy_matches_autograd_rows_and_differences_without_a_warning(
        f, strategy, fresh_route_checks):
    expected = autograd_rows(f, P)
    torch.testing.assert_close(central_differences(f, P), expected, rtol=1e-6, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        H = tv.hessian(f, P, strategy=strategy)
    torch.testing.assert_close(H, expected)


@pytest.mark.parametrize("strategy", ["fwd", "rev"])
def test_a_tuple_argnums_and_a_weight_of_its_own(strategy):
    # the weight a primal of its own, the input another: the cross blocks too
    def f(a, w):
        return (F.layer_norm(X * a, (4,), w) ** 3).sum()

    a, w = P[:4].clone(), P[4:].clone()
    H = tv.hessian(f, a, w, argnums=(0, 1), strategy=strategy)
    full = autograd_rows(lambda p: f(p[:4], p[4:]), P)
    got = torch.cat([torch.cat([H[0][0], H[0][1]], 1), torch.cat([H[1][0], H[1][1]], 1)])
    torch.testing.assert_close(got, full)
