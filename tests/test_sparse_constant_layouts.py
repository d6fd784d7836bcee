"""A constant sparse matrix in f, in any layout torch multiplies with (COO, CSR, CSC): the
pattern is its stored entries, exactly. The rules of mm and mv indexed and reshaped the
operands, which CSR and CSC tensors (without strides) refuse: the op was ruled dense, with a
"no sparsity rule" warning, and A @ u with a 1-D u (aten.mv) was dense for COO too."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

_F64 = torch.float64
_N = 6


def _matrix():
    # upper bidiagonal, with a row of its own and an explicitly stored zero
    d = torch.diag(torch.arange(1.0, _N + 1, dtype=_F64)) + torch.diag(
        torch.ones(_N - 1, dtype=_F64), 1)
    d[_N - 1, 0] = 2.5
    return d


_LAYOUTS = {
    "coo": lambda d: d.to_sparse(),
    "csr": lambda d: d.to_sparse_csr(),
    "csc": lambda d: d.to_sparse_csc(),
}

_PRODUCTS = {
    # (f of the sparse A and u, the dense Jacobian of f in terms of the dense matrix)
    "matmul": (lambda a, u: a @ u, lambda d: d),
    "mv": (lambda a, u: torch.mv(a, u), lambda d: d),
    "mm": (lambda a, u: (a @ u.view(_N, 1)).reshape(-1), lambda d: d),
    "sparse_mm": (lambda a, u: torch.sparse.mm(a, u.view(_N, 1)).reshape(-1), lambda d: d),
    "row_times_matrix": (lambda a, u: (u.view(1, _N) @ a).reshape(-1), lambda d: d.T),
    "two_products": (lambda a, u: a @ (a @ u), lambda d: d @ d),
}


def _per_row(f, x):
    """The Jacobian, one torch.autograd.grad per output element."""
    xx = x.detach().clone().requires_grad_(True)
    out = f(xx).reshape(-1)
    return torch.stack([torch.autograd.grad(out[i], xx, retain_graph=True)[0]
                        for i in range(out.numel())])


@pytest.mark.parametrize("product", sorted(_PRODUCTS))
@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_a_sparse_constant_gives_the_exact_pattern_in_every_layout(layout, product):
    dense = _matrix()
    a = _LAYOUTS[layout](dense)
    op, jac = _PRODUCTS[product]

    def f(u):
        return op(a, u)

    x = torch.randn(_N, dtype=_F64, generator=torch.Generator().manual_seed(0))
    want = jac(dense)
    torch.testing.assert_close(_per_row(f, x), want)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pattern = tv.jacobian_sparsity(f, x)
    assert not [w for w in caught if "no sparsity rule" in str(w.message)]
    assert pattern.shape == (_N, _N)
    assert torch.equal(pattern.to_dense(), want != 0)
    assert pattern._nnz() == int((want != 0).sum())  # (not dense: 36)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.sparse_jacobian(f, x)
    assert got.layout == torch.sparse_csr
    assert got.values().numel() == int((want != 0).sum())
    torch.testing.assert_close(got.to_dense(), want)


def test_an_explicitly_stored_zero_is_in_the_pattern():
    # (a stored entry is structural whatever its value, as for torch.sparse.mm's rule)
    dense = _matrix()
    stored = dense.to_sparse_csr()
    stored.values()[0] = 0.0  # (A[0, 0], still stored)
    x = torch.randn(_N, dtype=_F64, generator=torch.Generator().manual_seed(1))
    pattern = tv.jacobian_sparsity(lambda u: stored @ u, x).to_dense()
    assert torch.equal(pattern, dense != 0)


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_a_sparse_matrix_built_from_a_mask_of_x_is_not_structural(layout):
    # its stored entries move with x: the pattern at x held only the entries of x's mask
    # (the COO one as much: the mv rule read the matrix through a new, unsqueezed tensor,
    # which detection knew nothing of), and a later call at -x found entries outside it
    def f(u):
        return _LAYOUTS[layout](torch.diag((u.detach() > 0).to(u.dtype))) @ u.sin()

    x = torch.tensor([1.0, -1.0, 2.0, -2.0, 3.0, -3.0], dtype=_F64)
    pattern = tv.jacobian_sparsity(f, x).to_dense()
    for at in (x, -x):
        assert not bool(((_per_row(f, at) != 0) & ~pattern).any())
    tv.sparse.clear_cache(f)
    for at in (x, -x, x.abs()):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = tv.sparse_jacobian(f, at, layout=torch.strided)
        assert not [w for w in caught if "outside the sparsity pattern" in str(w.message)]
        torch.testing.assert_close(got, _per_row(f, at))
