"""The check of a sharded ``"auto"`` (NOTE [sharded auto, checked] in
``torch_vjp._sharded_check``) compares its routes at the scale of the numbers the products
are computed from, as one process does (NOTE [the scale of what is compared] in
``torch_vjp._engine.fwdnoise``), every rank measuring it, so that an ``f`` that runs
collectives pairs its calls. Two ranks, gloo on CPU."""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _cancelling():
    """A float32 f whose Jacobian entries are differences of products near 1e6 (rounded at
    about 0.1), about 1 in size, in the output rows of rank 0's share only: its reverse
    products under vmap and one at a time differ by that rounding, far above sqrt(eps) of
    the Jacobian, and agree to the rounding of the numbers they combine."""
    g = torch.Generator().manual_seed(0)
    A = 1000 + torch.rand(4, 8, generator=g)
    C = torch.sqrt(A * A - 1 - torch.rand(4, 8, generator=g))
    A[2:], C[2:] = 1.0, 0.5  # (rank 1's rows: no cancellation, its own check agrees)
    x = torch.randn(4, generator=g)

    def f(x):
        y = x[:, None]
        return (y * A) * A - (y * C) * C

    return f, x


def _scale_worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        torch.set_num_threads(1)
        group = dist.group.WORLD
        f, x = _cancelling()
        want = torch.func.jacrev(f)(x)
        calls = []

        def with_collective(x):
            # (a collective in every call of f: a call on some ranks only waits for ever)
            s = torch.ones(())
            dist.all_reduce(s, group=group)
            calls.append(1)
            return f(x) * (s / world)

        for fn in (f, with_collective):
            with warnings.catch_warnings():
                warnings.simplefilter("error", tv.JacobianWarning)  # (refused: a warning)
                got = tv.jacobian(fn, x, process_group=group)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
        # every rank called f as many times
        counts = [None] * world
        dist.all_gather_object(counts, len(calls), group=group)
        assert len(set(counts)) == 1, counts
        # a scalar f: its one product is rank 1's, and rank 0, with nothing to compare,
        # still calls f in the check (it skipped that call, and rank 1's collective in f
        # waited for ever)
        def scalar(x):
            s = torch.ones((), dtype=x.dtype)
            dist.all_reduce(s, group=group)
            return (x.sin() * s).sum()

        xd = x.double()
        torch.testing.assert_close(tv.jacobian(scalar, xd, process_group=group),
                                   world * xd.cos(), rtol=1e-12, atol=0)
        # a wrong formula still disagrees at that scale (rounding is not an excuse)
        bad = lambda x: torch.cdist(x.reshape(2, 2), x.reshape(2, 2) ** 2)  # noqa: E731
        with pytest.warns(tv.JacobianWarning, match=r"disagrees with a reverse product"):
            tv.jacobian(bad, x.double(), process_group=group)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_sharded_auto_compares_at_the_rounding_scale_on_every_rank(spawn_within):
    spawn_within(_scale_worker, 2, 180)
