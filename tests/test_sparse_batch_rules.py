"""Sparsity rules of F.grid_sample, fractional max pooling and batched torch.linalg
(in torch_vjp._sparse.local_rules): block structure over the batch (and channel) dimensions
where the rules were missing and the pattern was dense."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv

_F64 = torch.float64


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _spd(batch, n, seed=0):
    a = torch.randn(*batch, n, n, dtype=_F64, generator=_gen(seed))
    return a @ a.mT + n * torch.eye(n, dtype=_F64)


# ---- grid_sample -------------------------------------------------------------------------

_GRID = torch.rand(2, 4, 3, 2, dtype=_F64, generator=_gen(1)) * 2.2 - 1.1


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
def test_grid_sample_of_the_input(mode, padding_mode, ruled_pattern):
    x = torch.randn(2, 3, 5, 4, dtype=_F64, generator=_gen())
    ruled_pattern(lambda u: F.grid_sample(u, _GRID, mode=mode, padding_mode=padding_mode,
                                          align_corners=False), x, exact=False)


def test_grid_sample_of_the_grid_is_exact(ruled_pattern):
    inp = torch.randn(2, 3, 5, 4, dtype=_F64, generator=_gen())
    ruled_pattern(lambda g: F.grid_sample(inp, g, align_corners=True), _GRID.clone())


def test_grid_sample_of_a_grid_computed_from_the_input(ruled_pattern):
    x = torch.randn(2, 3, 5, 5, dtype=_F64, generator=_gen(2))

    def f(u):
        grid = u[:, :2].permute(0, 2, 3, 1).tanh()
        return F.grid_sample(u, grid, padding_mode="border", align_corners=False)

    ruled_pattern(f, x, exact=False)


def test_grid_sample_3d(ruled_pattern):
    grid = torch.rand(2, 2, 3, 2, 3, dtype=_F64, generator=_gen(3)) * 2 - 1
    x = torch.randn(2, 2, 3, 4, 3, dtype=_F64, generator=_gen())
    ruled_pattern(lambda u: F.grid_sample(u, grid, align_corners=False), x, exact=False)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border"])
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grid_sample_of_a_constant_grid_reads_the_taps_around_each_point(
        mode, padding_mode, align_corners, dtype):
    # (the whole plane per point before: 240 of 1440 entries per example and channel)
    grid = (torch.rand(2, 6, 5, 2, dtype=_F64, generator=_gen(8)) * 2.4 - 1.2).to(dtype)
    x = torch.randn(2, 3, 8, 7, dtype=_F64, generator=_gen()).to(dtype)

    def f(u):
        return F.grid_sample(u, grid, mode=mode, padding_mode=padding_mode,
                             align_corners=align_corners)

    pattern = tv.jacobian_sparsity(f, x).to_dense()
    want = torch.autograd.functional.jacobian(f, x).reshape(pattern.shape)
    assert not bool((want.ne(0) & ~pattern).any())
    per_point = pattern.sum(1).max()
    assert per_point <= (36 if mode == "bicubic" else 16) < 8 * 7
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.sparse_jacobian(f, x, layout=torch.strided)
    torch.testing.assert_close(got, want)


def test_grid_sample_3d_of_a_constant_grid_reads_the_taps(ruled_pattern):
    grid = torch.rand(1, 3, 2, 4, 3, dtype=_F64, generator=_gen(9)) * 2 - 1
    x = torch.randn(1, 2, 6, 5, 7, dtype=_F64, generator=_gen())
    f = lambda u: F.grid_sample(u, grid, align_corners=True)  # noqa: E731
    ruled_pattern(f, x, exact=False)
    assert tv.jacobian_sparsity(f, x).to_dense().sum(1).max() <= 64


def test_a_grid_written_in_place_is_detected_again():
    # (the taps are read off the grid's values: the grid guards the cached pattern)
    grid = torch.full((1, 2, 2, 2), -0.9, dtype=_F64)
    x = torch.randn(1, 1, 6, 6, dtype=_F64)

    def f(u):
        return F.grid_sample(u, grid, align_corners=False)

    first = tv.sparse_jacobian(f, x, layout=torch.strided)
    grid.fill_(0.8)  # (to the far corner)
    want = torch.autograd.functional.jacobian(f, x).reshape(4, 36)
    assert not torch.allclose(first, want)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(tv.sparse_jacobian(f, x, layout=torch.strided), want)
    # (detected again before any product, not found stale by the probe afterwards)
    assert not [w for w in caught if "has entries outside the sparsity pattern" in str(w.message)]


def test_grid_sample_pattern_is_block_diagonal_over_examples_and_channels():
    x = torch.randn(2, 3, 5, 4, dtype=_F64)
    p = tv.jacobian_sparsity(lambda u: F.grid_sample(u, _GRID, padding_mode="reflection",
                                                     align_corners=False), x)
    p = p.to_dense().view(2, 3, 4 * 3, 2, 3, 5 * 4)
    for n in range(2):
        for c in range(3):
            block = p[n, c, :, n, c]
            assert bool(block.all())
            p[n, c, :, n, c] = False
    assert not bool(p.any())


# ---- fractional max pooling --------------------------------------------------------------


@pytest.mark.parametrize("size, kernel, out", [((9, 9), 2, (4, 4)), ((10, 7), 3, (5, 3)),
                                               ((6, 6), 2, (5, 5)), ((5, 8), (2, 3), (1, 4))])
def test_fractional_max_pool2d_with_fixed_samples(size, kernel, out, ruled_pattern):
    samples = torch.rand(2, 3, 2, dtype=_F64, generator=_gen(4))
    x = torch.randn(2, 3, *size, dtype=_F64, generator=_gen())
    ruled_pattern(lambda u: F.fractional_max_pool2d(u, kernel, output_size=out,
                                                    _random_samples=samples), x, exact=False)


def test_fractional_max_pool3d_with_fixed_samples(ruled_pattern):
    samples = torch.rand(1, 2, 3, dtype=_F64, generator=_gen(5))
    x = torch.randn(1, 2, 7, 6, 5, dtype=_F64, generator=_gen())
    ruled_pattern(lambda u: F.fractional_max_pool3d(u, 2, output_size=(3, 3, 2),
                                                    _random_samples=samples), x, exact=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fractional_max_pool_pattern_holds_for_every_draw(dtype):
    # (f draws its samples: detection's draw is not the next call's, so the pattern must
    # cover the windows of every draw)
    def f(u):
        return F.fractional_max_pool2d(u, 3, output_ratio=(0.5, 0.5))

    x = torch.randn(2, 3, 12, 11, dtype=_F64, generator=_gen()).to(dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pattern = tv.jacobian_sparsity(f, x).to_dense()
    assert not [w for w in caught if "no sparsity rule" in str(w.message)]
    assert pattern.sum() < pattern.numel() / 10
    for seed in range(40):
        torch.manual_seed(seed)
        j = torch.autograd.functional.jacobian(f, x).reshape(pattern.shape)
        assert not bool((j.ne(0) & ~pattern).any()), seed


def test_fractional_max_pool_values_of_the_draw_of_the_call():
    def f(u):
        return F.fractional_max_pool2d(u, 2, output_size=(4, 4))

    x = torch.randn(2, 2, 9, 9, dtype=_F64, generator=_gen())
    for seed in range(3):
        torch.manual_seed(seed)
        want = torch.autograd.functional.jacobian(f, x).reshape(64, -1)
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = tv.sparse_jacobian(f, x, layout=torch.strided)
        torch.testing.assert_close(got, want)


# ---- batched linear algebra --------------------------------------------------------------

_A = _spd((3,), 4)
_B = torch.randn(3, 4, 2, dtype=_F64, generator=_gen(6))
_LINALG = {
    "solve A": (lambda a: torch.linalg.solve(a, _B), _A, True),
    "solve B": (lambda b: torch.linalg.solve(_A, b), _B.clone(), True),
    "solve vector B": (lambda b: torch.linalg.solve(_A, b), _B[..., 0].clone(), True),
    "solve left=False": (lambda b: torch.linalg.solve(_A, b, left=False), _B.mT.clone(), True),
    "solve both": (lambda a: torch.linalg.solve(a, a[..., :2].sin()), _A, False),
    "solve broadcast": (lambda a: torch.linalg.solve(a, _B[:1]), _A, True),
    "inv": (torch.linalg.inv, _A, True),
    "inverse": (torch.inverse, _A, True),
    "det": (torch.linalg.det, _A, True),
    "slogdet": (lambda a: torch.linalg.slogdet(a)[1], _A, True),
    "logdet": (torch.logdet, _A, True),
    "cholesky": (torch.linalg.cholesky, _A, False),
    "cholesky_ex": (lambda a: torch.linalg.cholesky_ex(a)[0], _A, False),
    "eigh": (lambda a: torch.linalg.eigh(a)[0], _A, True),
    "eigvalsh": (torch.linalg.eigvalsh, _A, True),
    "qr": (lambda a: torch.linalg.qr(a)[1], _A, False),
    "svdvals": (torch.linalg.svdvals, _A, True),
    "pinv": (torch.linalg.pinv, _A, True),
    "matrix_exp": (torch.linalg.matrix_exp, _A * 0.1, True),
    "solve_triangular": (lambda b: torch.linalg.solve_triangular(
        _A.tril(), b, upper=False), _B.clone(), False),
    "cholesky_solve": (lambda b: torch.cholesky_solve(b, torch.linalg.cholesky(_A)),
                       _B.clone(), True),
    "lu_factor": (lambda a: torch.linalg.lu_factor(a)[0], _A, False),
    "lu_solve": (lambda b: torch.linalg.lu_solve(*torch.linalg.lu_factor(_A), b),
                 _B.clone(), True),
    "lstsq": (lambda a: torch.linalg.lstsq(a, _B).solution, _A, True),
    "two batch dims": (torch.linalg.inv, _spd((2, 3), 3), True),
    "eigvals": (lambda a: torch.view_as_real(torch.linalg.eigvals(a)), _A + _A.mT.sin(), False),
    "lu": (lambda a: torch.linalg.lu(a)[2], _A, False),
    "lu_unpack": (lambda a: torch.lu_unpack(*torch.linalg.lu_factor(a))[1], _A, False),
}


@pytest.mark.parametrize("name", list(_LINALG))
def test_batched_linalg(name, ruled_pattern):
    f, x, exact = _LINALG[name]
    ruled_pattern(f, x.clone(), exact=exact)


def test_batched_inverse_pattern_is_block_diagonal_by_batch():
    p = tv.jacobian_sparsity(torch.linalg.inv, _A).to_dense().view(3, 16, 3, 16)
    for b in range(3):
        assert bool(p[b, :, b].all())
        p[b, :, b] = False
    assert not bool(p.any())
