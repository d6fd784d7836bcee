"""The reverse products through a backward right only in grad mode (torch.linalg.det's at a
singular matrix: NOTE [a backward right only in grad mode]) run it through one helper,
_engine.gradmode.in_grad_mode: the Jacobian's pullback (products.py), vjp_fn's pull
(transforms.py) and jacobian_of's backward passes (computed.py). Each is right in float64
against torch.func.jacrev, detached where no graph is asked for, and differentiable with
create_graph=True."""

from __future__ import annotations

import pytest
import torch

import torch_vjp as tv
from torch_vjp import transforms
from torch_vjp._engine import computed, gradmode, products

D = torch.float64
SINGULAR = torch.tensor([[1., 2, 3], [0, 0, 0], [4, 5, 7]], dtype=D)
W = torch.arange(1.0, 4.0, dtype=D)

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def f(A):
    return torch.linalg.det(A) * W


def _jacobian():
    return tv.jacobian(f, SINGULAR, strategy="rev")


def _vjp_rows():
    out, vjp_fn = tv.vjp(f, SINGULAR)
    with torch.no_grad():
        return vjp_fn(torch.eye(3, dtype=D), batched=True)[0]


def _jacobian_of():
    x = SINGULAR.clone().requires_grad_(True)
    return tv.jacobian_of(f(x), x)


PATHS = [("jacobian", products, _jacobian), ("vjp_fn", transforms, _vjp_rows),
         ("jacobian_of", computed, _jacobian_of)]


@pytest.mark.parametrize("name,module,run", PATHS, ids=[p[0] for p in PATHS])
def test_each_path_runs_the_one_helper_and_is_right_detached(name, module, run, monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return gradmode.in_grad_mode(*args, **kwargs)

    monkeypatch.setattr(module, "in_grad_mode", counted)
    J = run()
    assert calls
    assert not J.requires_grad
    torch.testing.assert_close(J, torch.func.jacrev(f)(SINGULAR))


def test_the_helper_detaches_every_tensor_and_keeps_the_rest():
    x = SINGULAR.clone().requires_grad_(True)
    y = f(x)

    def backward(v, **kwargs):
        assert torch.is_grad_enabled() and kwargs == {"create_graph": True}
        (g,) = torch.autograd.grad(y, x, v, create_graph=True)
        return g, None, 3

    with torch.no_grad():
        g, none, three = gradmode.in_grad_mode(backward, torch.ones(3, dtype=D),
                                               create_graph=True)
    assert not g.requires_grad and none is None and three == 3
    torch.testing.assert_close(g, torch.func.vjp(f, SINGULAR)[1](torch.ones(3, dtype=D))[0])


def test_vjp_fn_with_create_graph_stays_differentiable_outside_the_helper(monkeypatch):
    calls = []
    monkeypatch.setattr(transforms, "in_grad_mode", lambda *a, **k: calls.append(1))
    x = SINGULAR.clone().requires_grad_(True)
    out, vjp_fn = tv.vjp(f, x)
    (g,) = vjp_fn(torch.ones(3, dtype=D), create_graph=True)
    assert g.requires_grad and not calls
