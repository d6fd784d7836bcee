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


def _buffer_written_through_real_view(v):
    buf = torch.zeros(4, dtype=torch.complex128)
    torch.view_as_real(buf)[:, 0] = v[:4]
    torch.view_as_real(buf)[:, 1] = 2 * v[4:]
    return torch.view_as_real(buf * buf)


def _half_written_through_real_view(v):
    z = torch.polar(v[:4], v[4:]).clone()
    torch.view_as_real(z)[1:, 1] = v[:3]
    return torch.view_as_real(z)


def _buffer_written_through_complex_view(v):
    buf = torch.zeros(8, dtype=torch.float64)
    torch.view_as_complex(buf.view(4, 2)).copy_(torch.polar(v[:4], v[4:]))
    return buf


_VIEWS = [
    ("view_as_real of polar", lambda v: torch.view_as_real(torch.polar(v[:4], v[4:]))),
    ("real of polar", lambda v: torch.polar(v[:4], v[4:]).real),
    ("imag of complex", lambda v: (torch.complex(v[:4], v[4:]) ** 2).imag),
    ("view_as_complex, square", lambda v: torch.view_as_real(
        torch.view_as_complex(v.reshape(4, 2)) ** 2)),
    ("view_as_complex, slice", lambda v: torch.view_as_real(
        torch.view_as_complex(v.reshape(4, 2))[1:]).sum(-1)),
    ("times a complex constant", lambda v: torch.view_as_real(
        torch.complex(v[:4], v[4:]) * torch.tensor([1j, 2, 3 - 1j, 0.5]))),
    ("buffer written through real view", _buffer_written_through_real_view),
    ("half written through real view", _half_written_through_real_view),
    ("buffer written through complex view", _buffer_written_through_complex_view),
]


@pytest.mark.parametrize("name, f", _VIEWS, ids=[c[0] for c in _VIEWS])
def test_a_real_view_of_a_complex_tensor_keeps_each_elements_set(name, f):
    # a view whose elements are of another size than its storage's shadow (view_as_real of
    # a complex tensor) gave every element the union of the whole storage: a dense pattern
    # for every f that returns a complex result as its real view
    x = torch.randn(8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _check(f, x.abs() + 0.5)
