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


def _exp_and_sin(x):
    h = x.exp()
    return h.sin(), h  # (the output, and h as aux: the graph of the output saved h)


@pytest.mark.parametrize("batched", [False, True])
def test_vjp_fn_refuses_an_aux_written_in_place_since(batched):
    x = torch.randn(3, dtype=D)
    _, vjp_fn, aux = tv.vjp(_exp_and_sin, x, has_aux=True)
    u = torch.randn((2, 3) if batched else (3,), dtype=D)
    (before,) = vjp_fn(u, batched=batched)
    torch.testing.assert_close(before, u * (x.exp().cos() * x.exp()))
    aux.mul_(0)  # (torch.func.vjp's vjp_fn then returns zeros, silently)
    with pytest.raises(tv.JacobianCallError) as info:
        vjp_fn(u, batched=batched)
    msg = str(info.value)
    assert msg.startswith("torch_vjp.vjp: vjp_fn: the aux was written in place after "
                          "torch_vjp.vjp computed the output.")
    assert "Fix: call torch_vjp.vjp again after the change" in msg


def test_vjp_fn_names_the_aux_tensor_written():
    x = torch.randn(3, dtype=D)
    _, vjp_fn, aux = tv.vjp(lambda x: (x.exp().sin(), {"a": x.cos(), "h": x.exp()}), x,
                            has_aux=True)
    aux["h"].add_(1)
    with pytest.raises(tv.JacobianCallError, match=r"vjp_fn: the aux's tensor 1 was written"):
        vjp_fn(torch.ones(3, dtype=D))


def test_vjp_fn_with_aux_untouched_still_works_twice():
    x = torch.randn(3, dtype=D)
    _, vjp_fn, aux = tv.vjp(_exp_and_sin, x, has_aux=True)
    aux_copy = aux.clone()
    aux_copy.mul_(0)  # (a write into a copy is no write into the point)
    for _ in range(2):
        (g,) = vjp_fn(torch.ones(3, dtype=D))
        torch.testing.assert_close(g, x.exp().cos() * x.exp())


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
@pytest.mark.parametrize("mode", ["no_grad", "set_grad_enabled_false"])
def test_jacobian_of_create_graph_is_differentiable_under_no_grad(chunk_size, mode):
    # torch.autograd.grad(create_graph=True) builds its graph whatever the grad mode
    x = torch.randn(4, dtype=D, requires_grad=True)
    y = torch.outer(x, x.exp())
    z = x.sin()
    ctx = torch.no_grad() if mode == "no_grad" else torch.set_grad_enabled(False)
    with ctx:
        Jy, Jz = tv.jacobian_of((y, z), x, create_graph=True, chunk_size=chunk_size)
    assert Jy.requires_grad and Jz.requires_grad
    f = lambda x: torch.outer(x, x.exp())  # noqa: E731
    torch.testing.assert_close(Jy.detach(), torch.func.jacrev(f)(x.detach()))
    (g,) = torch.autograd.grad(Jy.sum() + Jz.sum(), x)
    want = (torch.func.jacrev(torch.func.jacrev(f))(x.detach()).sum((0, 1, 2))
            + torch.func.jacrev(torch.func.jacrev(torch.sin))(x.detach()).sum((0, 1)))
    torch.testing.assert_close(g, want)


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_batched_vjp_fn_create_graph_is_differentiable_under_no_grad(chunk_size):
    # (as the unbatched vjp_fn, and torch.autograd.grad(create_graph=True), whatever the mode)
    x = torch.randn(3, dtype=D, requires_grad=True)
    f = lambda a: a.sin() * a.prod()  # noqa: E731
    _, vjp_fn = tv.vjp(f, x)
    U = torch.randn(3, 3, dtype=D)
    with torch.no_grad():
        (G,) = vjp_fn(U, batched=True, chunk_size=chunk_size, create_graph=True)
    assert G.requires_grad
    J = torch.func.jacrev(f)(x.detach())
    torch.testing.assert_close(G.detach(), U @ J)
    (g,) = torch.autograd.grad(G.sum(), x)
    H = torch.func.jacrev(torch.func.jacrev(f))(x.detach())  # (out, in, in)
    torch.testing.assert_close(g, torch.einsum("ko,oij->j", U, H))
