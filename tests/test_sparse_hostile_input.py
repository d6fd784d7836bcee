"""sparse_jacobian and jacobian_sparsity on hostile input: no tensors in x, 0-size inputs
and outputs, non-contiguous and expanded inputs, leaves that alias each other, f returning
a view of its input, in-place ops on a clone; float64 against a per-row loop of
autograd.grad."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

_F64 = torch.float64
_LAYOUTS = [torch.strided, torch.sparse_csr, torch.sparse_coo, torch.sparse_csc]


def _per_row(f, xs):
    """The flattened Jacobian of f at the tuple of leaves xs, one autograd.grad per row."""
    leaves = [t.detach().clone().requires_grad_(True) for t in xs]
    out = f(tuple(leaves)) if len(xs) > 1 else f(leaves[0])
    outs = out if isinstance(out, (list, tuple)) else [out]
    flat = torch.cat([o.reshape(-1) for o in outs])
    n = sum(t.numel() for t in leaves)
    rows = []
    for i in range(flat.numel()):
        grads = torch.autograd.grad(flat[i], leaves, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([torch.zeros(t.numel(), dtype=_F64) if g is None
                               else g.reshape(-1) for g, t in zip(grads, leaves)]))
    return torch.stack(rows) if rows else torch.zeros(0, n, dtype=_F64)


def _all_modes(f, x, want):
    for mode in ("auto", "fwd", "rev"):
        for _ in range(2):  # (the second call uses the cached plan, probed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = tv.sparse_jacobian(f, x, mode=mode, layout=torch.strided)
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("x", [(), [], {}, ((), []), {"a": []}],
                         ids=["tuple", "list", "dict", "nested", "dict of list"])
@pytest.mark.parametrize("call", ["sparse_jacobian", "jacobian_sparsity"])
def test_x_without_tensors_is_named_with_the_fix(x, call):
    # the message said "the primals selected by argnums=0 hold no tensors": neither
    # function takes argnums, and it gave no fix
    with pytest.raises(tv.JacobianCallError) as caught:
        getattr(tv, call)(lambda t: torch.ones(2), x)
    said = str(caught.value)
    assert f"torch_vjp.{call}: x is " in said and "so it holds no tensors" in said
    assert "argnums" not in said
    assert "x must be a floating-point tensor, or a tuple, list or dict of them" in said
    assert "Fix: pass the tensor(s) to differentiate f with respect to as x" in said


@pytest.mark.parametrize("layout", _LAYOUTS)
@pytest.mark.parametrize("mode", ["auto", "fwd", "rev"])
@pytest.mark.parametrize("case", ["empty x", "empty output", "empty leaf"])
def test_zero_size(case, mode, layout):
    x = torch.randn(4, 3, dtype=_F64)
    if case == "empty x":
        f, arg, shape = (lambda u: u.sum(0)), torch.randn(0, 3, dtype=_F64), (3, 0)
    elif case == "empty output":
        f, arg, shape = (lambda u: u[:0] * 2), x, (0, 12)
    else:
        f, arg, shape = (lambda t: t[0] * 2 + t[1].sum()), (x, torch.randn(0, dtype=_F64)), (12, 12)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = tv.sparse_jacobian(f, arg, mode=mode, layout=layout)
        assert got.shape == shape and got.layout == layout
        want = 2 * torch.eye(12, dtype=_F64) if case == "empty leaf" else torch.zeros(shape, dtype=_F64)
        torch.testing.assert_close(got.to_dense(), want)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 4, dtype=_F64).t(),
    lambda: torch.randn(3, 1, dtype=_F64).expand(3, 4),
    lambda: torch.randn(8, 3, dtype=_F64)[::2],
    lambda: torch.randn(4, 3, dtype=_F64).requires_grad_(True),
], ids=["transposed", "expanded", "strided", "requires_grad"])
def test_inputs_of_any_layout(make):
    x = make()

    def f(u):
        v = u.clone()
        v[:, 0] = v[:, 1] * 3  # (in place, on a clone)
        return v.cumsum(0).sin()

    _all_modes(f, x, _per_row(f, (x,)))
    assert not x.requires_grad or x.grad is None


def test_leaves_that_alias_each_other():
    base = torch.randn(6, dtype=_F64)
    x = (base[:4], base[2:], base)
    before = base.clone()

    def f(t):
        a = t[0].clone().mul_(t[1])  # (in place on a clone of one alias)
        return a * t[2][:4].exp(), t[1].cumsum(0)

    _all_modes(f, x, _per_row(f, x))
    assert torch.equal(base, before)


@pytest.mark.parametrize("f", [lambda u: u, lambda u: u[1:], lambda u: u.t(),
                               lambda u: u.view(-1), lambda u: (u, u[0])],
                         ids=["itself", "slice", "transpose", "view", "twice"])
def test_f_returns_a_view_of_its_input(f):
    x = torch.randn(4, 3, dtype=_F64)
    before = x.clone()
    _all_modes(f, x, _per_row(f, (x,)))
    assert torch.equal(x, before)


def test_a_result_does_not_change_under_a_later_call():
    def f(u):
        return u * u

    x = torch.randn(5, dtype=_F64)
    first = tv.sparse_jacobian(f, x)
    kept = first.to_dense().clone()
    tv.sparse_jacobian(f, x * 3)
    torch.testing.assert_close(first.to_dense(), kept)
