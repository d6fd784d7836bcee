"""Sparse Jacobians: a pattern that holds every entry is not refused where f's own rounding
in low precision makes the routes disagree, and detection keeps a superset of the
Jacobian's non-zeros (checked against torch.func.jacrev in float64)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import torch_vjp as tv


def _reference(f, x):
    return torch.func.jacrev(f)(x.double()).reshape(f(x).numel(), x.numel())


def _covers(pattern, reference):
    """Every non-zero of the reference is in the pattern."""
    return not bool((reference.ne(0) & ~pattern.to_dense().bool()).any())


@pytest.mark.parametrize("fn", [torch.softmax, torch.log_softmax])
def test_a_bfloat16_softmax_nearly_one_hot_with_its_own_pattern_is_not_refused(fn):
    # u^T J from the values and f's reverse product differ by the whole of their tiny
    # scale (the reverse product of softmax rounds y (u - sum(u y)) to 0 where y rounds to
    # 1): "auto"'s check took that for entries the pattern leaves out, and raised, though
    # the column's line is exactly zero outside the pattern
    def f(x):
        return fn(8 * x, 0)

    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        x = (torch.randn(4, 16, generator=gen, dtype=torch.float64) * 20).bfloat16()
        pattern = tv.jacobian_sparsity(f, x)
        assert _covers(pattern, _reference(f, x))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = tv.sparse_jacobian(f, x, pattern=pattern)
        assert got.shape == (64, 64)


def _packed(shapes, g):
    """f of one flat vector: its slices shaped as ``shapes`` passed to ``g`` (a complex
    result as its real view)."""
    sizes = [math.prod(s) for s in shapes]

    def f(v):
        out = g(*[p.reshape(s) for p, s in zip(v.split(sizes), shapes)])
        return torch.view_as_real(out) if out.is_complex() else out

    return f, sum(sizes)


_LOCAL = [
    ("prelu", [(2, 3, 4), (3,)], lambda x, w: torch.nn.functional.prelu(x, w)),
    ("prelu one weight", [(3, 2), (1,)], lambda x, w: torch.nn.functional.prelu(x, w)),
    ("cross", [(4, 3), (4, 3)], lambda a, b: torch.linalg.cross(a, b)),
    ("cross dim 0, broadcast", [(3, 1, 2), (3, 4, 2)],
     lambda a, b: torch.linalg.cross(a, b, dim=0)),
    ("cross dim -2", [(2, 3, 4), (1, 3, 4)], lambda a, b: torch.linalg.cross(a, b, dim=-2)),
    ("renorm dim 0", [(3, 4)], lambda x: x.renorm(2, 0, 0.1)),
    ("renorm dim 1", [(2, 3, 4)], lambda x: x.renorm(1, 1, 0.5)),
    ("renorm dim -1, inf", [(3, 5)], lambda x: x.renorm(float("inf"), -1, 0.2)),
    ("cdist", [(3, 4), (5, 4)], lambda a, b: torch.cdist(a, b)),
    ("cdist p=1, batch", [(2, 1, 3, 2), (3, 4, 2)], lambda a, b: torch.cdist(a, b, p=1.0)),
    ("cdist mm", [(30, 3), (27, 3)],
     lambda a, b: torch.cdist(a, b, compute_mode="use_mm_for_euclid_dist")),
]


@pytest.mark.parametrize("name, shapes, g", _LOCAL, ids=[c[0] for c in _LOCAL])
def test_ops_local_in_their_inputs_get_a_pattern_that_holds_the_jacobian_and_is_not_dense(
        name, shapes, g):
    # prelu, linalg.cross, renorm and cdist had no rule: every output element was
    # taken to depend on every input element (a dense pattern, with a warning)
    f, n = _packed(shapes, g)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(n, generator=gen, dtype=torch.float64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pattern = tv.jacobian_sparsity(f, x)
        assert not [w for w in caught if "no sparsity rule" in str(w.message)]
        # (a naive loop: torch.func.jacrev is wrong on cdist, whose backward's batching
        # rule is wrong)
        reference = torch.autograd.functional.jacobian(f, x).reshape(-1, n)
        assert _covers(pattern, reference)
        assert pattern.to_dense().bool().sum() < pattern.numel()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = tv.sparse_jacobian(f, x)
        torch.testing.assert_close(got.to_dense().reshape(-1, n), reference)


_BILINEAR = [
    ((1, 1, 3, 4), dict(size=(5, 7))),
    ((2, 3, 5, 2), dict(size=(2, 3))),
    ((1, 2, 4, 6), dict(scale_factor=2.0)),
    ((1, 1, 7, 7), dict(scale_factor=0.5)),
    ((1, 1, 5, 6), dict(scale_factor=(0.6, 2.3), recompute_scale_factor=True)),
    ((1, 1, 5, 6), dict(scale_factor=(1.3, 0.7))),
    ((1, 1, 37, 3), dict(size=(101, 3))),
    ((1, 1, 29, 2), dict(scale_factor=(2.9, 1.0))),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("shape, options", _BILINEAR)
def test_a_bilinear_resize_gets_a_pattern_that_holds_the_jacobian_and_is_not_dense(
        shape, options, align_corners, dtype):
    # upsample_bilinear2d had no rule: every output pixel was taken to depend on every
    # input pixel (a dense pattern, with a warning); each reads 2 x 2 pixels of its channel
    n = math.prod(shape)

    def f(v):
        return torch.nn.functional.interpolate(
            v.reshape(shape), mode="bilinear", align_corners=align_corners, **options
        ).flatten()

    x = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pattern = tv.jacobian_sparsity(f, x.to(dtype))
    assert not [w for w in caught if "no sparsity rule" in str(w.message)]
    # (the entries of the resize in x's own dtype too: its source rows round otherwise)
    own = torch.autograd.functional.jacobian(f, x.to(dtype)).reshape(-1, n)
    assert _covers(pattern, _reference(f, x)) and _covers(pattern, own)
    assert pattern.to_dense().bool().sum() < pattern.numel()
    if dtype == torch.float64:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = tv.sparse_jacobian(f, x)
        torch.testing.assert_close(got.to_dense(), _reference(f, x))
