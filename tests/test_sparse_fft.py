"""Sparse Jacobians through torch.fft: each output element depends on the input's line
(plane, ...) along the transformed dimensions only; every pattern holds the Jacobian's
non-zeros (against a naive loop in float64) and is not dense where some dimension is not
transformed."""

from __future__ import annotations


import pytest
import torch


_R = torch.view_as_real

_FFT = [
    ("ifft dim 0", (4, 3), lambda x: _R(torch.fft.ifft(x, dim=0).resolve_conj())),
    ("rfft", (3, 6), lambda x: _R(torch.fft.rfft(x))),
    ("rfft padded", (3, 6), lambda x: _R(torch.fft.rfft(x, n=9))),
    ("irfft of rfft dim 0", (3, 4), lambda x: torch.fft.irfft(torch.fft.rfft(x, dim=0), dim=0)),
    ("irfft n", (2, 5), lambda x: torch.fft.irfft(torch.complex(x, x.roll(1, 1)), n=7)),
    ("fft2", (2, 3, 4), lambda x: _R(torch.fft.fft2(x))),
    ("rfftn dims 0 and 2", (2, 3, 4), lambda x: _R(torch.fft.rfftn(x, dim=(0, 2)))),
    ("irfftn", (2, 3, 4), lambda x: torch.fft.irfftn(torch.complex(x, 2 * x), dim=(0, 1))),
    ("hfft", (3, 4), lambda x: torch.fft.hfft(torch.complex(x, x * x))),
    ("stft", (16,), lambda x: torch.stft(x, 4, hop_length=2, return_complex=True,
                                         window=torch.hann_window(4, dtype=x.dtype)).abs()),
]


@pytest.mark.parametrize("name, shape, f", _FFT, ids=[c[0] for c in _FFT])
def test_an_fft_depends_on_the_transformed_lines_only(name, shape, f, ruled_pattern):
    # _fft_r2c, _fft_c2c and _fft_c2r had no rule: every output element was taken to depend
    # on every input element (a dense pattern, with a warning)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ruled_pattern(f, x, exact=False)
