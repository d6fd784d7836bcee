"""Jacobian entry points under hostile but valid input: results against torch.func or a
closed form in float64, and no caller's tensor written or aliased."""

from __future__ import annotations

import pytest
import torch

import torch_vjp as tv

D = torch.float64


@pytest.mark.parametrize("f", [lambda a: a.mul_(2).sin(), lambda a: a.sin_()],
                         ids=["mul_", "sin_"])
def test_jvp_leaves_the_callers_tangent_unwritten_when_f_writes_its_primal(f):
    x = torch.randn(3, dtype=D)
    t = torch.randn(3, dtype=D)
    x0, t0 = x.clone(), t.clone()
    # (the reference: the same product on copies of both)
    _, want = torch.func.jvp(f, (x0.clone(),), (t0.clone(),))
    _, jt = tv.jvp(f, (x,), (t,))
    torch.testing.assert_close(t, t0)
    torch.testing.assert_close(jt, want)


@pytest.mark.parametrize("f", [lambda a: a, lambda a: a.view(-1), lambda a: a.t()],
                         ids=["identity", "view", "t"])
def test_jvp_output_tangent_is_not_the_callers_tangent(f):
    x = torch.randn(3, 3, dtype=D)
    t = torch.randn(3, 3, dtype=D)
    t0 = t.clone()
    _, jt = tv.jvp(f, (x,), (t,))
    torch.testing.assert_close(jt, f(t0))
    jt.add_(1)
    torch.testing.assert_close(t, t0)


@pytest.mark.parametrize("f", [lambda a: a, lambda a: a.view(-1), lambda a: a.t()],
                         ids=["identity", "view", "t"])
@pytest.mark.parametrize("batched", [False, True])
def test_vjp_result_is_not_the_callers_cotangent(f, batched):
    x = torch.randn(3, 3, dtype=D)
    out, vjp_fn = tv.vjp(f, x)
    u = torch.randn((2, *out.shape) if batched else out.shape, dtype=D)
    u0 = u.clone()
    (g,) = vjp_fn(u, batched=batched)
    # (the reference: torch.func.vjp's product, on a copy of the cotangent)
    if batched:
        want = torch.stack([torch.func.vjp(f, x)[1](v.clone())[0] for v in u0])
    else:
        want = torch.func.vjp(f, x)[1](u0.clone())[0]
    torch.testing.assert_close(g, want)
    g.add_(1)
    torch.testing.assert_close(u, u0)


def test_vjp_results_of_a_shared_cotangent_are_separate():
    x, y = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    _, vjp_fn = tv.vjp(lambda a, b: a + b, x, y)
    u = torch.randn(3, dtype=D)
    ga, gb = vjp_fn(u.clone())
    torch.testing.assert_close(ga, u)
    torch.testing.assert_close(gb, u)
    ga.add_(1)
    torch.testing.assert_close(gb, u)
