"""tv.hessian inside the user's torch.compile (and with compile=True) through a normalisation
whose weight is differentiated: torch's vmap of its double backward is wrong (NOTE [a single
product batched wrongly, traced] in torch_vjp._engine.forms), and the traced Hessian was off
by 3.7 under every strategy, without a word. Float64 against a loop of autograd.grad rows
of the gradient (torch.func.hessian is wrong alike here, so it is no reference)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv

D = torch.float64
_X = torch.linspace(-1.0, 1.3, 4, dtype=D)


def _layer_norm(p):
    return (F.layer_norm(_X * p[:4], (4,), p[4:]) ** 3).sum()


def _batch_norm(p):
    h = _X.reshape(2, 2) * p[:4].reshape(2, 2)
    return (F.batch_norm(h, None, None, p[4:6], None, training=True) ** 3).sum()


def _loop(f, p):
    q = p.clone().requires_grad_()
    g = torch.autograd.grad(f(q), q, create_graph=True)[0]
    return torch.stack([torch.autograd.grad(g[i], q, retain_graph=True)[0]
                        for i in range(p.numel())])


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("f,n,strategy", [(_layer_norm, 8, "auto"), (_layer_norm, 8, "rev"),
                                          (_batch_norm, 6, "auto")],
                         ids=["layer_norm-auto", "layer_norm-rev", "batch_norm-auto"])
def test_inside_the_users_torch_compile(f, n, strategy):
    p = torch.linspace(0.3, 1.7, n, dtype=D).sin() + 0.5
    want = _loop(f, p)
    compiled = torch.compile(lambda p: tv.hessian(f, p, strategy=strategy),
                             backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(p), want)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_true_is_right_without_falling_back():
    p = torch.linspace(0.3, 1.7, 8, dtype=D).sin() + 0.5
    want = _loop(_layer_norm, p)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for _ in range(2):
            torch.testing.assert_close(tv.hessian(_layer_norm, p, compile=True), want)
