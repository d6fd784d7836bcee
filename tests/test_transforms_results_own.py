"""torch_vjp.vjp and torch_vjp.jvp hand back results of their own (NOTE [results of their
own] in torch_vjp/_transform_support.py): an output of f that is a primal, or a view of
one, is a copy, so that a write the caller makes into its input afterwards, or a later
call, never changes a result it was handed. torch.func.vjp and torch.func.jvp alias the
primal there (checked below: this is where torch_vjp differs, on purpose)."""

from __future__ import annotations

import pytest
import torch

import torch_vjp as tv

D = torch.float64

VIEWS = {
    "identity": lambda a: a,
    "view": lambda a: a.view(-1),
    "transpose": lambda a: a.t(),
    "row": lambda a: a[0],
    "pair": lambda a: (a, a.sin()),
    "dict": lambda a: {"x": a, "y": a * 2},
}


def _point():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 3, dtype=D, generator=g), torch.randn(2, 3, dtype=D, generator=g),
            torch.randn(4, 2, 3, dtype=D, generator=g))


def test_torch_func_aliases_the_primal():
    x, t, _ = _point()
    assert torch.func.vjp(lambda a: a, x)[0] is x
    out, jt = torch.func.jvp(lambda a: a, (x,), (t,))
    assert out.data_ptr() == x.data_ptr() and jt is t


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("name", list(VIEWS))
def test_jvp_results_never_change_under_the_caller(name, batched, compile, request):
    if compile:
        request.getfixturevalue("fresh_dynamo")
        request.getfixturevalue("aot_eager_unless_inductor")
    f = VIEWS[name]
    x, t, T = _point()
    tangent = T if batched else t
    for _ in range(2 if compile else 1):  # (compile=True: the eager call, then the program)
        out, jt = tv.jvp(f, (x,), (tangent,), batched=batched, compile=compile)
        expected_out, expected_jt = torch.func.jvp(f, (x.clone(),), (t.clone(),))
        if batched:
            expected_jt = torch.func.vmap(
                lambda s: torch.func.jvp(f, (x.clone(),), (s,))[1])(T.clone())
        flat = torch.utils._pytree.tree_leaves((out, jt))
        kept = [a.clone() for a in flat]
        again = tv.jvp(f, (x,), (tangent,), batched=batched, compile=compile)
        x.add_(1)
        tangent.mul_(3)
        for a in torch.utils._pytree.tree_leaves(again):
            a.add_(5)  # (a later call's results are not these either)
        for a, b in zip(flat, kept):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(out, expected_out)
        torch.testing.assert_close(jt, expected_jt)
        x.sub_(1)
        tangent.div_(3)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("name", list(VIEWS))
def test_vjp_results_never_change_under_the_caller(name, compile, request):
    if compile:
        request.getfixturevalue("fresh_dynamo")
        request.getfixturevalue("aot_eager_unless_inductor")
    f = VIEWS[name]
    x, _, _ = _point()
    out, vjp_fn = tv.vjp(f, x, compile=compile)
    assert all(o is not x for o in torch.utils._pytree.tree_leaves(out))
    cot = torch.utils._pytree.tree_map(torch.ones_like, out)
    first = vjp_fn(cot)[0]
    second = vjp_fn(cot)[0]
    second.add_(7)
    kept = [o.clone() for o in torch.utils._pytree.tree_leaves(out)]
    expected = torch.func.vjp(f, x.clone())[1](cot)[0]
    x.add_(1)
    for a, b in zip(torch.utils._pytree.tree_leaves(out), kept):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(first, expected)


def test_an_aux_that_is_the_primal_is_a_copy_too():
    x, t, _ = _point()
    _, _, aux = tv.vjp(lambda a: (a.sin(), a), x, has_aux=True)
    _, _, aux2 = tv.jvp(lambda a: (a.sin(), a), (x,), (t,), has_aux=True)
    for a in (aux, aux2):
        assert a.data_ptr() != x.data_ptr()
        torch.testing.assert_close(a, x)


def test_the_copy_keeps_the_autograd_history():
    x = torch.randn(3, dtype=D, requires_grad=True)
    out, vjp_fn = tv.vjp(lambda a: a, x)
    assert out is not x and out.requires_grad
    (g,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(g, torch.ones(3, dtype=D))
    out, _ = tv.jvp(lambda a: a.view(3, 1), (x,), (torch.ones(3, dtype=D),))
    (g,) = torch.autograd.grad((out * 2).sum(), x)
    torch.testing.assert_close(g, torch.full((3,), 2.0, dtype=D))

