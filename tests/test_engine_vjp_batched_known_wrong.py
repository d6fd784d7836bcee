"""vjp_fn(v, batched=True) through torch.cdist, whose backward torch batches wrongly under
torch.vmap (NOTE [batched products through a wrong batching rule]): a first vjp point where
the products through cdist vanish does not decide later points' products. float64, against
one plain product per cotangent, without vmap."""

import warnings

import pytest
import torch

import torch_vjp as tv
from torch_vjp._engine.compiled import clear_cache

D = torch.float64


def _f():
    y = torch.randn(5, 3, dtype=D, generator=torch.Generator().manual_seed(7))

    def f(x):
        return torch.cdist(x.reshape(4, 3), y) * x.sum()

    return f


def _per_row(f, x, vs):
    xx = x.clone().requires_grad_()
    out = f(xx)
    return torch.stack([torch.autograd.grad(out, xx, v, retain_graph=True)[0] for v in vs])


def _points():
    g = torch.Generator().manual_seed(8)
    x0 = torch.randn(12, dtype=D, generator=g)
    x0 = x0 - x0.mean()  # (f's products through cdist vanish here)
    x = torch.randn(12, dtype=D, generator=g)
    vs = torch.randn(6, 4, 5, dtype=D, generator=g)
    return x0, x, vs


@pytest.mark.parametrize("compile", [False, True])
def test_batched_vjp_through_cdist_after_a_degenerate_first_point(compile):
    clear_cache()
    f = _f()
    x0, x, vs = _points()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, pull0 = tv.vjp(f, x0, compile=compile)
        (rows0,) = pull0(vs, batched=True)
    torch.testing.assert_close(rows0, _per_row(f, x0, vs))
    said = [str(w.message) for w in caught if "batching rule" in str(w.message)]
    if not compile:  # (compiled: f's code was warned of once already, by the eager case)
        assert len(said) == 1
        assert said[0].startswith(
            "torch_vjp.vjp: vjp_fn: batched=True computes the products under torch.vmap, "
            "whose batching rule for the backward of torch.cdist in f (")
        assert "is wrong (torch's: the rows are off by a relative error near 1, each alone " \
            "is right), so it computed them one product at a time, without vmap" in said[0]
        assert "Pass chunk_size=1 to compute them that way directly." in said[0]
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, pull = tv.vjp(f, x, compile=compile)
            (rows,) = pull(vs, batched=True)
        torch.testing.assert_close(rows, _per_row(f, x, vs), rtol=1e-10, atol=1e-10)
    clear_cache()


def test_batched_vjp_with_chunk_size_one_through_cdist_says_nothing():
    f = _f()
    _, x, vs = _points()
    _, pull = tv.vjp(f, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        (rows,) = pull(vs, batched=True, chunk_size=1)
    torch.testing.assert_close(rows, _per_row(f, x, vs), rtol=1e-10, atol=1e-10)
