"""Edge cases of the Jacobian and transform API on hostile but valid input."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.func

import torch_vjp as tv

D = torch.float64


def _loop_vjp(f, x, cotangents):
    _, pull = torch.func.vjp(f, x)
    return torch.stack([pull(c)[0] for c in cotangents])


class _NoVmapSquare(torch.autograd.Function):
    """x ** 2 with a backward torch.vmap cannot batch (``.item()`` of the cotangent)."""

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if g.abs().sum().item() == 0.0:
            return torch.zeros_like(g)
        return 2 * x * g


@pytest.mark.parametrize("chunk_size", [1, 2, 3])
def test_batched_vjp_with_retain_graph_false_in_several_chunks(chunk_size):
    x = torch.randn(3, dtype=D)
    f = lambda x: x.sin() * x.exp()  # noqa: E731
    cot = torch.randn(5, 3, dtype=D)
    _, vjp_fn = tv.vjp(f, x)
    (got,) = vjp_fn(cot, batched=True, chunk_size=chunk_size, retain_graph=False)
    torch.testing.assert_close(got, _loop_vjp(f, x, cot))


def test_batched_vjp_with_retain_graph_false_falls_back_to_the_loop():
    # the exp node runs (and, without retain_graph, is freed) before the vectorised
    # attempt fails in the Function's backward; the loop that replaces it needs it
    x = torch.randn(3, dtype=D)
    f = lambda x: _NoVmapSquare.apply(x).exp()  # noqa: E731
    cot = torch.randn(4, 3, dtype=D)
    _, vjp_fn = tv.vjp(f, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        (got,) = vjp_fn(cot, batched=True, retain_graph=False)
    torch.testing.assert_close(got, _loop_vjp(f, x, cot))


@pytest.mark.parametrize("strategy", ["auto", "rev", "fwd", "rev-loop", "fwd-loop"])
@pytest.mark.parametrize("f, name", [
    (lambda x: {"logits": x.sin(), "loss": x.sum()}, r"f\['loss'\]"),
    (lambda x: (x.sin(), [x.cos(), x.sum(0)]), r"f\[1\]\[1\]"),
])
def test_batch_jacobian_names_an_output_without_the_batch_by_its_place(f, name, strategy):
    # (a flat index, "output 2 of f", named no key of a dict nor place in a nested result)
    with pytest.raises(tv.JacobianCallError, match=rf"batch_jacobian: the output of {name} "
                       r"has shape \((3,)?\), but x has shape \(4, 3\)"):
        tv.batch_jacobian(f, torch.randn(4, 3, dtype=D), strategy=strategy)


_STRATEGIES = ["auto", "rev", "fwd", "rev-loop", "fwd-loop"]


@pytest.mark.parametrize("chunk_size", [None, 1])
@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_create_graph_through_an_input_f_writes_into(strategy, chunk_size):
    # f(x) = (2 x)^3 written in place: J = diag(24 x^2), d sum(J) / dx = 48 x
    f = lambda x: x.mul_(2) ** 3  # noqa: E731
    x = torch.randn(3, dtype=D, requires_grad=True)
    J = tv.jacobian(f, x, strategy=strategy, chunk_size=chunk_size, create_graph=True)
    torch.testing.assert_close(J.detach(), torch.diag(24 * x.detach() ** 2))
    (g,) = torch.autograd.grad(J.sum(), x)
    torch.testing.assert_close(g, 48 * x.detach())
    xb = torch.randn(4, 3, dtype=D, requires_grad=True)
    Jb = tv.batch_jacobian(f, xb, strategy=strategy, chunk_size=chunk_size, create_graph=True)
    (gb,) = torch.autograd.grad(Jb.sum(), xb)
    torch.testing.assert_close(gb, 48 * xb.detach())


@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_create_graph_through_a_non_differentiated_primal_f_writes_into(strategy):
    def f(x, w):
        w.mul_(2)
        return x * w

    x = torch.randn(3, dtype=D)
    w = torch.randn(3, dtype=D, requires_grad=True)
    w0 = w.detach().clone()
    J = tv.jacobian(f, x, w, argnums=0, strategy=strategy, create_graph=True)
    torch.testing.assert_close(J.detach(), torch.diag(2 * w0))
    (g,) = torch.autograd.grad(J.sum(), w)
    torch.testing.assert_close(g, torch.full((3,), 2.0, dtype=D))
    torch.testing.assert_close(w.detach(), w0)


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_batched_jvp_differentiable_through_an_input_f_writes_into(chunk_size):
    x = torch.randn(3, dtype=D, requires_grad=True)
    T = torch.randn(4, 3, dtype=D)
    _, jt = tv.jvp(lambda x: x.mul_(2) ** 3, (x,), (T,), batched=True, chunk_size=chunk_size)
    torch.testing.assert_close(jt.detach(), 24 * x.detach() ** 2 * T)
    (g,) = torch.autograd.grad(jt.sum(), x)
    torch.testing.assert_close(g, (48 * x.detach() * T).sum(0))


class _OldStyleCube(torch.autograd.Function):
    """x ** 3 as an old-style Function (no setup_context): torch.func cannot run it, so the
    reverse-mode loops compute with plain autograd."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


@pytest.mark.parametrize("strategy", ["auto", "rev-loop"])
def test_plain_autograd_create_graph_with_a_primal_that_needs_no_grad(strategy):
    f = lambda x, y: _OldStyleCube.apply(x) * y.sum()  # noqa: E731
    x = torch.randn(3, dtype=D, requires_grad=True)
    y = torch.randn(2, dtype=D)  # differentiated, but requires no grad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        jx, jy = tv.jacobian(f, x, y, argnums=(0, 1), strategy=strategy, create_graph=True)
    want = torch.autograd.functional.jacobian(
        lambda x, y: x**3 * y.sum(), (x.detach(), y))
    torch.testing.assert_close(jx.detach(), want[0])
    torch.testing.assert_close(jy.detach(), want[1])
    (g,) = torch.autograd.grad(jx.sum(), x)
    torch.testing.assert_close(g, 6 * x.detach() * y.sum())


@pytest.mark.parametrize("strategy", ["auto", "rev-loop", "fwd-loop"])
def test_hessian_by_plain_autograd_is_differentiable_with_respect_to_the_primal(strategy):
    # torch.func cannot run an old-style Function: the Hessian takes plain autograd
    x = torch.randn(3, dtype=D, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        H = tv.hessian(lambda x: _OldStyleCube.apply(x).sum(), x, strategy=strategy,
                       create_graph=True)
    torch.testing.assert_close(H.detach(), torch.diag(6 * x.detach()))
    (g,) = torch.autograd.grad(H.sum(), x)  # d/dx of sum(diag(6 x))
    torch.testing.assert_close(g, torch.full((3,), 6.0, dtype=D))
    assert x.grad is None


def test_batched_jvp_of_no_tangents_changes_no_buffer_and_keeps_the_graph():
    bn = torch.nn.BatchNorm1d(3).double().train()
    x = torch.randn(5, 3, dtype=D, requires_grad=True)
    kept = {k: v.clone() for k, v in bn.state_dict().items()}
    out, tangents = tv.jvp(bn, (x,), (torch.zeros(0, 5, 3, dtype=D),), batched=True)
    assert tangents.shape == (0, 5, 3)
    for k, v in bn.state_dict().items():  # (running statistics, num_batches_tracked)
        torch.testing.assert_close(v, kept[k])
    with torch.no_grad():
        want = torch.nn.functional.batch_norm(x, None, None, bn.weight, bn.bias, True)
    torch.testing.assert_close(out.detach(), want)
    # differentiable with respect to x, as the output of K >= 1 tangents is
    f = lambda x: x.sin() * x.sum()  # noqa: E731
    for k in (0, 2):
        out, _ = tv.jvp(f, (x,), (torch.randn(k, 5, 3, dtype=D),), batched=True)
        (g,) = torch.autograd.grad(out.sum(), x)
        torch.testing.assert_close(g, torch.func.grad(lambda x: f(x).sum())(x.detach()))


@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_aux_keeps_its_graph_with_create_graph_when_x_has_no_elements(strategy):
    x = torch.randn(0, dtype=D, requires_grad=True)
    y = torch.randn(2, dtype=D, requires_grad=True)
    J, aux = tv.jacobian(lambda x, y: (x.sum() * y, (y**2).sum() + x.sum()), x, y,
                         has_aux=True, strategy=strategy, create_graph=True)
    assert J.shape == (2, 0)
    (g,) = torch.autograd.grad(aux, y)
    torch.testing.assert_close(g, 2 * y.detach())


@pytest.mark.parametrize("batched", [False, True])
def test_vjp_fn_after_its_graph_was_freed_says_what_freed_it(batched):
    x = torch.randn(3, dtype=D)
    _, vjp_fn = tv.vjp(lambda x: x.sin() * x.exp(), x)
    vjp_fn(torch.ones(3, dtype=D), retain_graph=False)
    cot = torch.ones(2, 3, dtype=D) if batched else torch.ones(3, dtype=D)
    with pytest.raises(RuntimeError, match="backward through the graph a second time") as info:
        vjp_fn(cot, batched=batched)
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert "torch_vjp.vjp: vjp_fn: vjp_fn reads the graph that torch_vjp.vjp recorded" in note
    assert "a call of vjp_fn with retain_graph=False" in note
    assert "keep retain_graph=True (vjp_fn's default) on every call but the last" in note


@pytest.mark.parametrize("chunk_size", [None, 1])
@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_inside_grad_through_primals_f_writes_into(strategy, chunk_size):
    # the copies of the primals carry the outer transform's history
    x = torch.randn(3, dtype=D)
    g = torch.func.grad(lambda x: tv.jacobian(lambda y: y.mul_(2) ** 3, x, strategy=strategy,
                                              chunk_size=chunk_size).sum())(x)
    torch.testing.assert_close(g, 48 * x)

    def through_other(x):
        return tv.jacobian(lambda y, w: y * w.mul_(2), torch.ones(3, dtype=D), x, argnums=0,
                           strategy=strategy, chunk_size=chunk_size).sum()

    torch.testing.assert_close(torch.func.grad(through_other)(x),
                               torch.full((3,), 2.0, dtype=D))


@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_create_graph_through_an_in_place_relu_as_first_layer(strategy):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 3)).double()
    x = torch.randn(4, dtype=D, requires_grad=True)
    x0 = x.detach().clone()
    J = tv.jacobian(model, x, strategy=strategy, create_graph=True)
    want = model[1].weight * (x0 > 0)
    torch.testing.assert_close(J.detach(), want.detach())
    (g,) = torch.autograd.grad(J.pow(2).sum(), model[1].weight)
    (g_want,) = torch.autograd.grad(want.pow(2).sum(), model[1].weight)
    torch.testing.assert_close(g, g_want)
    torch.testing.assert_close(x.detach(), x0)
