"""Sharded Jacobians whose ranks plan their chunks differently (a chunk_size or max_memory
of each rank's own): every rank runs as many products in as many chunks, so an ``f`` that
runs a collective is called as many times on every rank; and a rank whose ``f`` fails
before its chunks are planned, or whose planning fails, makes every rank raise (NOTE [the
ranks agree on their chunks] in ``torch_vjp._sharded_work``). Two ranks, gloo on CPU; a
rank left waiting fails the test at the deadline instead of blocking the suite."""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv

DT = torch.float64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


class _Mine(Exception):
    pass


def _worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=20))
    try:
        torch.set_num_threads(1)
        group = dist.group.WORLD
        w = torch.tensor([2.0, 3.0, 0.5, -1.5, 0.25, 1.25], dtype=DT)
        calls = []

        def f(x):
            calls.append(1)
            y = x.sin() * w[: x.numel()]
            dist.all_reduce(y, group=group)  # (equal values: no derivative, hence / world)
            return y / world

        def single(x):
            return x.sin() * w[: x.numel()] / world

        x = torch.linspace(0.1, 0.9, 6, dtype=DT)
        want = torch.func.jacfwd(single)(x)
        # chunks of each rank's own: 3 products in chunks of 1 on rank 0, all at once on
        # rank 1 (forward mode calls f once per chunk: 3 calls against 1 waited for ever)
        mine = [{"chunk_size": 1}, {}][rank]
        budget = [{"max_memory": 1100}, {}][rank]
        for strategy in ("fwd", "rev", "auto"):
            for kwargs in (mine, budget):
                what = f"rank {rank}, {strategy}, {kwargs}"
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = tv.jacobian(f, x, strategy=strategy, process_group=group,
                                      **kwargs)
                    torch.testing.assert_close(got, want, rtol=1e-12, atol=0,
                                               msg=lambda m: f"{what}: {m}")
                    sh = tv.jacobian(f, x, strategy=strategy, process_group=group,
                                     shard=True, **kwargs)
                cols = want if sh.mode == "rev" else want.T
                torch.testing.assert_close(sh.values, cols[sh.start:sh.stop], rtol=1e-12,
                                           atol=0, msg=lambda m: f"{what} shard: {m}")

        # f fails on rank 1 before any chunk is planned, while rank 0 plans chunks of one:
        # every rank raises, rank 1 its own error, rank 0 one naming rank 1
        def fails_on_1(x):
            if rank == 1:
                raise _Mine("rank 1's own error")
            return x.sin()

        for strategy in ("fwd", "rev"):
            calls.clear()
            if rank == 1:
                with pytest.raises(_Mine, match="rank 1's own error"):
                    tv.jacobian(fails_on_1, x, strategy=strategy, process_group=group)
            else:
                with pytest.raises(tv.JacobianCallError, match=(
                        r"(?s)rank 1 of the process_group failed while computing its share "
                        r"of the Jacobian.*Rank 1 said: .*rank 1's own error")):
                    tv.jacobian(fails_on_1, x, strategy=strategy, process_group=group,
                                chunk_size=1)

        # planning fails on rank 1 alone (a budget too small there): every rank raises
        if rank == 1:
            with pytest.raises(tv.JacobianMemoryError):
                tv.jacobian(f, x, strategy="fwd", process_group=group, max_memory=10)
        else:
            with pytest.raises(tv.JacobianCallError, match=(
                    r"(?s)rank 1 of the process_group failed.*Rank 1 said: "
                    r".*JacobianMemoryError")):
                tv.jacobian(f, x, strategy="fwd", process_group=group, chunk_size=1)

        # the group still works
        got = tv.jacobian(f, x, strategy="fwd", process_group=group)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ranks_with_chunks_of_their_own_call_f_as_many_times(spawn_within):
    spawn_within(_worker, 2, 240)
