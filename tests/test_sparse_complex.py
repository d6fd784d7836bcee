"""Sparse Jacobians through complex intermediates: torch.polar and torch.complex are ruled
elementwise, and a complex tensor's real view (and a real tensor's complex view) keeps each
element's set (NOTE [views of another element size] in torch_vjp._sparse.tracer); every
pattern holds the Jacobian's non-zeros (against torch.func.jacrev in float64) and is not
dense."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv


def _check(f, x, exact=False):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pattern = tv.jacobian_sparsity(f, x).to_dense().bool()
    assert not [w for w in caught if "no sparsity rule" in str(w.message)]
    reference = torch.func.jacrev(f)(x).reshape(pattern.shape)
    assert not bool((reference.ne(0) & ~pattern).any())
    assert pattern.sum() < pattern.numel()
    if exact:
        assert torch.equal(pattern, reference.ne(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.sparse_jacobian(f, x, layout=torch.strided)
    torch.testing.assert_close(got, reference)


_POLAR = [
    ("polar abs", lambda v: torch.polar(v[:4].abs() + 1, v[4:]).abs(), False),
    ("polar angle", lambda v: (torch.polar(v[:4], v[4:]) * (1 + 2j)).angle(), False),
    ("polar broadcast", lambda v: torch.polar(v[:4].reshape(4, 1), v[4:].reshape(1, 4))
     .add(1).abs().flatten(), True),
    ("complex", lambda v: (torch.complex(v[:4], v[4:]) ** 2 + 1).abs(), True),
]


@pytest.mark.parametrize("name, f, exact", _POLAR, ids=[c[0] for c in _POLAR])
def test_polar_and_complex_are_elementwise(name, f, exact):
    # torch.polar and torch.complex had no rule: every output element was taken to depend
    # on every input element (a dense pattern, with a warning)
    x = torch.randn(8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    _check(f, x.abs() + 0.5, exact)

