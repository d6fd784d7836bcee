"""The per-sample norms of a float32 model on the CPU: taken in float32 as before, the total
read once, and taken again in float64 only where it holds an inf or a NaN (NOTE [one check
on the CPU] in torch_vjp/_per_sample/norms_wide.py). The result is the sync-free float64
path's, which devices take, where any example's squares overflow float32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv
from torch_vjp._per_sample import norms_wide, run

from _references import float64_per_example

STRATEGIES = ("auto", "hooks")


def _mse(out, t):
    return (out - t).pow(2).sum()


class _Seq(nn.Module):
    def __init__(self, p, q):
        super().__init__()
        self.lin = nn.Linear(p, q)

    def forward(self, x):
        return self.lin(x).sum(1)


def _cases():
    """(name, model maker, x, t): overflowing and ordinary batches, each kind of factor."""
    torch.manual_seed(0)
    out = []
    x = torch.randn(4, 4)
    t = torch.randn(4, 3)
    out.append(("linear", lambda: nn.Linear(4, 3), x, t))
    big = t.clone()
    big[1] = 1e19
    out.append(("linear_big", lambda: nn.Linear(4, 3), x, big))
    # each parameter's squared norm fits float32 (2e38), their total does not (4e38)
    one = torch.ones(2, 1)
    out.append(("total_big", lambda: nn.Linear(1, 1, bias=True), one,
                torch.tensor([[-7.1e18], [0.5]])))
    xs = torch.randn(3, 4, 16)
    ts = torch.randn(3, 16)
    out.append(("ghost", lambda: _Seq(16, 16), xs, ts))
    tb = ts.clone()
    tb[2] = 1e19
    out.append(("ghost_big", lambda: _Seq(16, 16), xs, tb))
    xd = torch.randn(3, 40, 4)
    td = torch.randn(3, 4)
    td[0] = 1e19
    out.append(("direct_big", lambda: _Seq(4, 4), xd, td))
    return out


CASES = {c[0]: c[1:] for c in _cases()}


def _run(make, x, t, strategy, force, monkeypatch):
    """Norms and clipped gradients, with the sync-free path forced or not."""
    monkeypatch.setattr(norms_wide, "FORCE_SYNC_FREE", force)
    torch.manual_seed(1)
    model = make()
    norms = tv.per_sample_grad_norms(model, _mse, x, t, strategy=strategy)
    tv.accumulate_clipped_grads(model, _mse, x, t, max_norm=1.0, strategy=strategy)
    return norms, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_checked_path_against_forced_sync_free_and_float64_loop(name, strategy, monkeypatch):
    make, x, t = CASES[name]
    norms, grads = _run(make, x, t, strategy, False, monkeypatch)
    free_norms, free_grads = _run(make, x, t, strategy, True, monkeypatch)
    torch.manual_seed(1)
    ref, want = float64_per_example(make(), _mse, x, t)
    assert torch.isfinite(want).all()
    for got in (norms, free_norms):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0.0)
    c = (1.0 / want).clamp(max=1.0)
    for n in grads:
        expected = torch.einsum("b,b...->...", c, ref[n])
        torch.testing.assert_close(grads[n].double(), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(free_grads[n].double(), expected, rtol=1e-5, atol=1e-6)
    if name.endswith("_big"):  # (taken again, sync-free: the same numbers)
        assert torch.equal(norms, free_norms)
        for n in grads:
            assert torch.equal(grads[n], free_grads[n])


def _spy(monkeypatch):
    """Records what each check of the total read, and whether the norms were taken again."""
    seen = []
    real = run.overflowed

    def overflowed(total):
        seen.append((total.dtype, real(total)))
        return seen[-1][1]

    monkeypatch.setattr(run, "overflowed", overflowed)
    return seen


def test_one_check_in_float32_and_float64_only_on_overflow(monkeypatch):
    seen = _spy(monkeypatch)
    make, x, t = CASES["linear"]
    tv.per_sample_grad_norms(make(), _mse, x, t, strategy="hooks")
    assert seen == [(torch.float32, False)]
    make, x, t = CASES["total_big"]
    got = tv.per_sample_grad_norms(make(), _mse, x, t, strategy="hooks")
    assert seen[1:] == [(torch.float32, True)]
    torch.testing.assert_close(got[0].double(), torch.tensor(2 * 7.1e18 * 2 ** 0.5,
                                                             dtype=torch.float64),
                               rtol=1e-4, atol=0.0)


def test_no_check_where_it_would_read_a_device_or_a_trace(monkeypatch):
    seen = _spy(monkeypatch)
    make, x, t = CASES["linear"]
    monkeypatch.setattr(norms_wide, "FORCE_SYNC_FREE", True)
    tv.per_sample_grad_norms(make(), _mse, x, t, strategy="hooks")
    monkeypatch.setattr(norms_wide, "FORCE_SYNC_FREE", False)
    tv.per_sample_grad_norms(make().double(), _mse, x.double(), t.double(), strategy="hooks")
    assert seen == []
    assert not norms_wide.checks_once(torch.ones(2, device="meta"))
    assert norms_wide.checks_once(torch.ones(2))


def test_inf_and_nan_rows_keep_their_norms_either_way():
    """A row with an inf has squared norm inf, one with a NaN NaN, in float32 as in
    float64: the check reads them and the norms taken again keep them."""
    v = torch.ones(3, 5)
    v[0, 1], v[1, 2] = float("inf"), float("nan")
    with norms_wide.narrow_norms():
        narrow = norms_wide.wide_sq_rows(v)
        assert norms_wide.overflowed(narrow)
    wide = norms_wide.wide_sq_rows(v)
    assert (narrow.dtype, wide.dtype) == (torch.float32, torch.float64)
    for sq in (narrow, wide):
        assert sq[0].isinf() and sq[1].isnan() and abs(sq[2].item() - 5) < 1e-5
    assert not norms_wide.overflowed(torch.full((4,), 3e38)[:1])
