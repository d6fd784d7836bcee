"""Sparse Jacobians of F.interpolate's resizes that weigh a window of pixels (linear,
bilinear, trilinear, bicubic, antialiased): the detected pattern holds every non-zero of the
Jacobian (against a naive loop in float64, and in the input's own dtype) and is not dense
(NOTE [a resize's reach] in torch_vjp._sparse.local_rules)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv


def _jacobian(f, x):
    # (a naive loop of backward passes: what reverse mode computes)
    return torch.autograd.functional.jacobian(f, x).reshape(-1, x.numel())


def _covers(pattern, reference):
    return not bool((reference.ne(0) & ~pattern).any())


_CASES = [
    # (shape, options)
    ((1, 2, 5), dict(mode="linear", size=9)),
    ((2, 1, 7), dict(mode="linear", size=3)),
    ((1, 1, 6), dict(mode="linear", scale_factor=1.7)),
    ((1, 1, 9), dict(mode="linear", scale_factor=0.45, recompute_scale_factor=True)),
    ((1, 2, 3, 4, 2), dict(mode="trilinear", size=(5, 3, 4))),
    ((1, 1, 2, 3, 5), dict(mode="trilinear", scale_factor=(2.0, 0.7, 1.3))),
    ((1, 1, 4, 2, 3), dict(mode="trilinear", scale_factor=1.6, recompute_scale_factor=True)),
    ((1, 2, 4, 6), dict(mode="bicubic", size=(7, 3))),
    ((2, 1, 5, 3), dict(mode="bicubic", scale_factor=(2.2, 1.5))),
    ((1, 1, 8, 9), dict(mode="bicubic", scale_factor=0.5)),
    ((1, 1, 5, 7), dict(mode="bilinear", antialias=True, size=(2, 3))),
    ((1, 2, 9, 4), dict(mode="bilinear", antialias=True, scale_factor=(0.4, 1.6))),
    ((1, 1, 6, 1), dict(mode="bilinear", antialias=True, scale_factor=(1.95, 1.27))),
    ((1, 1, 9, 6), dict(mode="bicubic", antialias=True, size=(4, 13))),
    ((1, 1, 9, 2), dict(mode="bicubic", antialias=True, scale_factor=(1.97, 1.43))),
    ((2, 1, 7, 5), dict(mode="bicubic", antialias=True, scale_factor=0.35)),
]


def _ids(case):
    shape, options = case
    return f"{options['mode']}{'-aa' if options.get('antialias') else ''}-{shape}-" + "-".join(
        f"{k}={v}" for k, v in options.items() if k not in ("mode", "antialias"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("shape, options", _CASES, ids=[_ids(c) for c in _CASES])
def test_a_resize_gets_a_pattern_that_holds_the_jacobian_and_is_not_dense(
        shape, options, align_corners, dtype):
    # upsample_linear1d, upsample_trilinear3d, upsample_bicubic2d and the antialiased
    # resizes had no rule: every output pixel was taken to depend on every input pixel (a
    # dense pattern, with a warning)
    n = math.prod(shape)

    def f(v):
        return F.interpolate(v.reshape(shape), align_corners=align_corners,
                             **options).flatten()

    x = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pattern = tv.jacobian_sparsity(f, x.to(dtype)).to_dense().bool()
    assert not [w for w in caught if "no sparsity rule" in str(w.message)]
    assert _covers(pattern, _jacobian(f, x))
    assert _covers(pattern, _jacobian(f, x.to(dtype)))
    assert pattern.sum() < pattern.numel()
    if dtype == torch.float64:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = tv.sparse_jacobian(f, x, layout=torch.strided)
        # (forward mode's, which central differences agree with: torch 2.13's backward of
        # an antialiased resize given a scale_factor is wrong, by up to 1)
        torch.testing.assert_close(got, torch.func.jacfwd(f)(x))


_LOW = [  # (rows in, rows out, align_corners, antialias)
    (7, 13, False, False), (8, 24, True, False), (4, 28, False, False),
    (7, 13, False, True), (8, 14, True, True), (4, 22, True, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_in, n_out, align_corners, antialias", _LOW)
def test_a_bicubic_resize_in_low_precision_is_covered_where_float64_weighs_one_tap(
        n_in, n_out, align_corners, antialias, dtype):
    # where an output row's source index is an integer in float64, bicubic weighs one
    # tap; in float32 it falls just beside it and all four taps weigh, the outer one two
    # rows past the float64 tap: a reach widened by one row left it out
    if antialias and dtype == torch.float16:
        pytest.skip("torch has no float16 antialiased resize on the CPU")

    def f(v):
        return F.interpolate(v, size=(n_out, 2), mode="bicubic",
                             align_corners=align_corners, antialias=antialias).flatten()

    x = torch.randn(1, 1, n_in, 2, generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64).to(dtype)
    pattern = tv.jacobian_sparsity(f, x).to_dense().bool()
    assert _covers(pattern, _jacobian(f, x))
