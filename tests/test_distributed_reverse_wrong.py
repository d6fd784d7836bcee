"""A sharded ``"auto"`` through a backward formula torch computes wrongly (torch 2.13:
``torch.as_strided_scatter``'s): every rank checks the reverse product against a forward
product and returns forward mode's Jacobian (NOTE [a sharded reverse product checked
forward] in ``torch_vjp._sharded_forward``), as one process does. Two ranks, gloo on CPU,
one spawned group for every case; float64, against torch.func.jvp columns and finite
differences."""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv
from torch_vjp._sharded_work import shard_range

D = torch.float64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _scatter_f(n_out=None, collective=False):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, dtype=D, generator=g)
    W = None if n_out is None else torch.randn(n_out, 4, dtype=D, generator=g)

    def f(x):
        y = torch.as_strided_scatter(x * 1.0, s * x[:2], (2,), (1,), 0) * x.sum()
        if collective:  # (sums equal values: the mean is the rank's own, no derivative)
            z = y.detach().clone()
            dist.all_reduce(z)
            y = y + (z / dist.get_world_size() - y.detach())
        return y if W is None else W @ y.tanh()

    return f


def _jvp_columns(f, x):
    eye = torch.eye(x.numel(), dtype=x.dtype).reshape(x.numel(), *x.shape)
    cols = [torch.func.jvp(f, (x,), (e,))[1].reshape(-1) for e in eye]
    return torch.stack(cols, 1).reshape(*f(x).shape, *x.shape)


def _fd(f, x, h=1e-6):
    eye = torch.eye(x.numel(), dtype=x.dtype).reshape(x.numel(), *x.shape)
    cols = [((f(x + h * e) - f(x - h * e)) / (2 * h)).reshape(-1) for e in eye]
    return torch.stack(cols, 1).reshape(*f(x).shape, *x.shape)


def _caught(fn):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", tv.JacobianWarning)
        res = fn()
    return res, [str(w.message) for w in got if issubclass(w.category, tv.JacobianWarning)]


def _worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        group = dist.group.WORLD
        x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))

        # reverse mode chosen by size (4 by 4): the wrong backward agreed with itself
        f = _scatter_f()
        want = _jvp_columns(f, x)
        torch.testing.assert_close(want, _fd(f, x))
        J, said = _caught(lambda: tv.jacobian(f, x, process_group=group))
        torch.testing.assert_close(J, want, msg=lambda m: f"rank {rank}, square: {m}")
        told = [m for m in said if "disagrees with a forward product" in m]
        assert len(told) == 1, said
        assert "wrong backward formula" in told[0] and "as_strided_scatter" in told[0]
        assert "central difference" in told[0] and "Pass strategy='fwd-loop'" in told[0]
        # later calls take the route every rank remembers, silently, and stay right,
        # shard=True too (forward mode's columns)
        J2, said2 = _caught(lambda: tv.jacobian(f, x, process_group=group))
        torch.testing.assert_close(J2, want)
        assert not [m for m in said2 if "forward product" in m], said2
        sh = tv.jacobian(f, x, process_group=group, shard=True)
        assert sh.mode == "fwd" and (sh.start, sh.stop) == shard_range(4, rank, world)
        torch.testing.assert_close(sh.values, want.T[sh.start:sh.stop])

        # forward mode chosen by size (400 by 4): its right columns were replaced by the
        # wrong reverse mode, with a warning naming forward mode wrong
        f = _scatter_f(n_out=400)
        J, said = _caught(lambda: tv.jacobian(f, x, process_group=group))
        torch.testing.assert_close(J, _jvp_columns(f, x))
        torch.testing.assert_close(J, _fd(f, x))
        assert not [m for m in said if "wrong forward-mode derivative" in m], said
        sh = tv.jacobian(f, x, process_group=group, shard=True)
        assert sh.mode == "fwd"

        # batch_jacobian: one row's products for every row
        f1 = _scatter_f()
        xb = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(2))
        J, _ = _caught(lambda: tv.batch_jacobian(
            lambda xb: torch.stack([f1(r) for r in xb]), xb, process_group=group))
        torch.testing.assert_close(J, torch.stack([_jvp_columns(f1, r) for r in xb]))

        # an f that runs a collective: every rank calls it as many times in the check
        fc = _scatter_f(collective=True)
        J, _ = _caught(lambda: tv.jacobian(fc, x, process_group=group))
        torch.testing.assert_close(J, want)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_sharded_auto_through_a_wrong_backward_takes_forward_mode(spawn_within):
    spawn_within(_worker, 2, 300)
