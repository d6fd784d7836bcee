"""Sparsity rules and probes of sparse Jacobians, against torch.func in float64."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv

X = torch.randn(2, 3, 7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

POOLS = {
    "max2d": lambda u: F.max_pool2d(u, 2),
    "max2d_pad_dilated_ceil": lambda u: F.max_pool2d(u, 3, 2, 1, dilation=2, ceil_mode=True),
    "max2d_indices": lambda u: F.max_pool2d(u, (2, 3), (1, 2), return_indices=True)[0],
    "avg2d_ceil": lambda u: F.avg_pool2d(u, 3, 2, 1, ceil_mode=True, count_include_pad=False),
    "avg2d_unbatched": lambda u: F.avg_pool2d(u[0], 2),
    "max1d": lambda u: F.max_pool1d(u.reshape(6, 7, 8), 3, 2, 1, ceil_mode=True),
    "max1d_dilated": lambda u: F.max_pool1d(u.reshape(6, 7, 8), 2, dilation=3),
    "avg1d_ceil": lambda u: F.avg_pool1d(u.reshape(6, 7, 8), 3, 2, ceil_mode=True),
    "max3d_ceil": lambda u: F.max_pool3d(u, 2, (1, 2, 3), ceil_mode=True),
    "avg3d_pad": lambda u: F.avg_pool3d(u, (1, 2, 2), padding=(0, 1, 1)),
}
# the windows of each max pooling, as an average pooling of the same geometry reads them
WINDOWS = {
    "max2d": lambda u: F.avg_pool2d(u, 2),
    "max2d_pad_dilated_ceil": lambda u: F.conv2d(
        F.pad(u.reshape(6, 1, 7, 8), (1, 3, 1, 3)), torch.ones(1, 1, 3, 3, dtype=u.dtype),
        stride=2, dilation=2)[:, :, :3, :4],
    "max2d_indices": lambda u: F.avg_pool2d(u, (2, 3), (1, 2)),
    "max1d": lambda u: F.avg_pool1d(u.reshape(6, 7, 8), 3, 2, 1, ceil_mode=True),
    "max1d_dilated": lambda u: F.conv1d(u.reshape(42, 1, 8), torch.ones(1, 1, 2, dtype=u.dtype),
                                        stride=2, dilation=3),
    "max3d_ceil": lambda u: F.avg_pool3d(u, 2, (1, 2, 3), ceil_mode=True),
}


@pytest.mark.parametrize("name", sorted(POOLS))
def test_pooling_is_ruled_window_by_window(name):
    # pooling had no sparsity rule: every output element was taken to depend on every input
    # element (a dense pattern, one product per output or input element, and a warning)
    f = POOLS[name]
    ref = torch.func.jacrev(f)(X).reshape(-1, X.numel())
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        pattern = tv.jacobian_sparsity(f, X).to_dense()
        got = tv.sparse_jacobian(f, X, layout=torch.strided)
    assert not (ref.ne(0) & ~pattern).any()
    if name.startswith("avg"):
        assert torch.equal(pattern, ref.ne(0))
    else:  # every element of a window: the one the max picks moves with x
        assert torch.equal(pattern, torch.func.jacrev(WINDOWS[name])(X).reshape(
            -1, X.numel()).ne(0))
    torch.testing.assert_close(got, ref)


ADAPTIVE = {
    "avg1d": (lambda u: F.adaptive_avg_pool1d(u.reshape(6, 7, 8), 3),
              lambda u: F.adaptive_avg_pool1d(u.reshape(6, 7, 8), 3)),
    "max1d": (lambda u: F.adaptive_max_pool1d(u.reshape(6, 7, 8), 5),
              lambda u: F.adaptive_avg_pool1d(u.reshape(6, 7, 8), 5)),
    "avg2d": (lambda u: F.adaptive_avg_pool2d(u, (3, 5)),
              lambda u: F.adaptive_avg_pool2d(u, (3, 5))),
    "avg2d_larger": (lambda u: F.adaptive_avg_pool2d(u[0], (9, 10)),
                     lambda u: F.adaptive_avg_pool2d(u[0], (9, 10))),
    "max2d": (lambda u: F.adaptive_max_pool2d(u, (3, 5)),
              lambda u: F.adaptive_avg_pool2d(u, (3, 5))),
    "avg3d": (lambda u: F.adaptive_avg_pool3d(u, (2, 3, 5)),
              lambda u: F.adaptive_avg_pool3d(u, (2, 3, 5))),
    "max3d": (lambda u: F.adaptive_max_pool3d(u, (2, 3, 5)),
              lambda u: F.adaptive_avg_pool3d(u, (2, 3, 5))),
}


@pytest.mark.parametrize("name", sorted(ADAPTIVE))
def test_adaptive_pooling_is_ruled_window_by_window(name):
    # adaptive pooling had no sparsity rule either: a dense pattern and a warning
    f, windows = ADAPTIVE[name]
    ref = torch.func.jacrev(f)(X).reshape(-1, X.numel())
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        pattern = tv.jacobian_sparsity(f, X).to_dense()
        got = tv.sparse_jacobian(f, X, layout=torch.strided)
    assert torch.equal(pattern, torch.func.jacrev(windows)(X).reshape(-1, X.numel()).ne(0))
    assert not (ref.ne(0) & ~pattern).any()
    torch.testing.assert_close(got, ref)
