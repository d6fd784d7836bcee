"""The sparsity rule of torch.sparse.mm / torch.sparse.addmm with a constant sparse matrix
(aten._sparse_addmm): a graph Laplacian or stencil held as a sparse tensor gives the
pattern of its stored entries, not a dense one."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

_F64 = torch.float64


def _matrix(n, layout):
    src = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 1, 3, 5])
    dst = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 2])
    vals = torch.randn(12, dtype=_F64, generator=torch.Generator().manual_seed(0))
    a = torch.sparse_coo_tensor(torch.stack([dst, src]), vals, (n, n)).coalesce()
    return a if layout is torch.sparse_coo else a.to_sparse_csr(), a.to_dense()


def _jac(f, x):
    return torch.autograd.functional.jacobian(f, x).reshape(-1, x.numel())


@pytest.mark.parametrize("mode", ["rev", "auto"])
def test_sparse_mm_with_a_constant_matrix_has_its_pattern(mode):
    n = 10
    a, dense = _matrix(n, torch.sparse_coo)

    def f(u):
        return torch.sparse.mm(a, u.unsqueeze(1)).squeeze(1).tanh()

    x = torch.randn(n, dtype=_F64, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pattern = tv.jacobian_sparsity(f, x).to_dense()
        got = tv.sparse_jacobian(f, x, mode=mode, layout=torch.strided)
    assert not [w for w in caught if "no sparsity rule" in str(w.message)]
    assert torch.equal(pattern, dense != 0)
    torch.testing.assert_close(got, _jac(f, x))


def test_sparse_addmm_with_a_bias_from_x_and_several_columns():
    n = 10
    a, dense = _matrix(n, torch.sparse_coo)

    def f(u):
        b = u.view(5, 2).repeat(2, 1)  # (10, 2): row r is u[2 (r % 5)], u[2 (r % 5) + 1]
        return torch.sparse.addmm(u.view(n, 1).expand(n, 2) * 2, a, b.sin()).reshape(-1)

    x = torch.randn(n, dtype=_F64, generator=torch.Generator().manual_seed(2))
    pattern = tv.jacobian_sparsity(f, x).to_dense()
    want = _jac(f, x)
    assert not bool(((want != 0) & ~pattern).any())
    assert pattern.sum() < pattern.numel() / 2
    torch.testing.assert_close(tv.sparse_jacobian(f, x, mode="rev", layout=torch.strided), want)


def test_a_sparse_matrix_whose_entries_follow_x_counts_every_entry():
    # (its stored entries at one x are not those at another: none of its zeros is
    # structural)
    n = 6

    def f(u):
        keep = (u > 0).nonzero().squeeze(1)
        idx = torch.stack([keep, (keep + 1) % n])
        a = torch.sparse_coo_tensor(idx, torch.ones(keep.numel(), dtype=_F64), (n, n))
        return torch.sparse.mm(a, u.unsqueeze(1)).squeeze(1)

    x0 = torch.tensor([1.0, -1, 1, -1, 1, -1], dtype=_F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pattern = tv.jacobian_sparsity(f, x0).to_dense()
    assert not bool(((_jac(f, -x0) != 0) & ~pattern).any())
