"""Sharded Jacobians of an ``f`` that runs a collective itself (``dist.all_reduce`` inside
f): every rank calls f as many times (NOTE [every rank runs as many products] in
``torch_vjp._sharded_work``), with fewer products than ranks and shares of unequal sizes,
in every strategy. Two ranks, gloo on CPU; a rank left waiting fails the test at gloo's
timeout instead of blocking it."""

from __future__ import annotations

import datetime
import functools
import warnings

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv
from torch_vjp._sharded_work import shard_range

DT = torch.float64
STRATEGIES = ("rev", "fwd", "auto", "rev-loop", "fwd-loop")

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _collective_worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=20))
    try:
        torch.set_num_threads(1)
        group = dist.group.WORLD
        w = torch.tensor([2.0, 3.0, 0.5, -1.5, 0.25], dtype=DT)

        def f(x):
            # (the collective sums equal values: the mean is the rank's own value, and the
            # in-place all_reduce carries no derivative, hence the division)
            y = x.sin() * w[: x.numel()]
            dist.all_reduce(y, group=group)
            return y / world

        def single(x):
            return x.sin() * w[: x.numel()] / world

        # fewer columns or rows than ranks (some rank has none), and shares of unequal
        # sizes: 1 and 3 on 2 ranks, 2 and 4 on 3
        for n in (world - 1, world + 1):
            x = torch.linspace(0.1, 0.9, n, dtype=DT)
            want = torch.func.jacfwd(single)(x)
            for strategy in STRATEGIES:
                for kwargs in ({}, {"chunk_size": 1}):
                    what = f"rank {rank}, n={n}, {strategy}, {kwargs}"
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        got = tv.jacobian(f, x, strategy=strategy, process_group=group,
                                          **kwargs)
                        torch.testing.assert_close(got, want, rtol=1e-12, atol=0,
                                                   msg=lambda m: f"{what}: {m}")
                        sh = tv.jacobian(f, x, strategy=strategy, process_group=group,
                                         shard=True, **kwargs)
                    assert (sh.start, sh.stop) == shard_range(n, rank, world), what
                    cols = want if sh.mode == "rev" else want.T
                    torch.testing.assert_close(sh.values, cols[sh.start:sh.stop], rtol=1e-12,
                                               atol=0, msg=lambda m: f"{what} shard: {m}")
        # batch_jacobian: the products of one row, fewer than ranks
        xb = torch.linspace(0.1, 0.9, 3, dtype=DT).reshape(3, 1)
        for strategy in STRATEGIES:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = tv.batch_jacobian(f, xb, strategy=strategy, process_group=group)
            torch.testing.assert_close(got, tv.batch_jacobian(single, xb), rtol=1e-12, atol=0)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_jacobian_of_an_f_that_runs_a_collective(spawn_within, world):
    spawn_within(_collective_worker, world, 300)


def test_padded_count_is_the_largest_share():
    from torch_vjp._sharded_work import padded_count

    for n in range(12):
        for world in (1, 2, 3, 5):
            sizes = [b - a for a, b in (shard_range(n, r, world) for r in range(world))]
            assert padded_count(n, world) == max(sizes)


@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'init')}",
                                rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


class _Mine(Exception):
    pass


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_jacobian_of_an_f_that_raises_calls_it_once(one_rank_group, strategy):
    calls = []

    def f(x):
        calls.append(1)
        raise _Mine("f's own error")

    with pytest.raises(_Mine, match="f's own error") as caught:
        tv.jacobian(f, torch.ones(3, dtype=DT), strategy=strategy,
                    process_group=one_rank_group)
    assert len(calls) == 1
    # (untouched: not raised again while handling a first call's error)
    assert caught.value.__context__ is None and caught.value.__cause__ is None


def test_sharded_rev_loop_still_computes_what_torch_func_refuses(one_rank_group):
    class OldStyle(torch.autograd.Function):  # (forward takes ctx: torch.func refuses it)
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.sin()

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x.cos()

    x = torch.linspace(0.1, 0.9, 4, dtype=DT)
    got = tv.jacobian(OldStyle.apply, x, strategy="rev-loop", process_group=one_rank_group)
    torch.testing.assert_close(got, torch.diag(x.cos()), rtol=1e-12, atol=0)


def _not_a_group_worker(rank, world, init_file, case):
    import os
    import time

    # (a short timeout: the waiting rank raises at it)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=5))
    done = init_file + ".done"
    try:
        torch.set_num_threads(1)
        x = torch.linspace(0.1, 0.9, 3, dtype=DT)
        if rank == 1:
            if case == "none":  # (a call of its own: it computes alone)
                got = tv.jacobian(torch.sin, x, process_group=None)
                torch.testing.assert_close(got, torch.diag(x.cos()))
            else:
                with pytest.raises(tv.JacobianOptionError, match=(
                        r"(?s)process_group is 'WORLD', but it must be a torch.distributed "
                        r"ProcessGroup.*Fix: pass process_group=torch.distributed.group.WORLD"
                        r".*The other ranks cannot be told: if they passed a process group, "
                        r"they wait for this rank in that group's first exchange until the "
                        r"group's timeout.*Pass the same process_group on every rank")):
                    tv.jacobian(torch.sin, x, process_group="WORLD")
            # (kept alive until rank 0 has raised: a rank gone fails its exchange otherwise)
            deadline = time.monotonic() + 60
            while not os.path.exists(done) and time.monotonic() < deadline:
                time.sleep(0.1)
        else:
            try:
                with pytest.raises(tv.JacobianCallError, match=(
                        r"(?s)^torch_vjp\.jacobian: the exchange that opens a sharded Jacobian "
                        r"failed on this rank \(0\) of process_group: .*Some rank of the group "
                        r"did not join it in time: one that passed process_group=None.*an "
                        r"object that is no group.*Fix: pass the same process_group on every "
                        r"rank of the group")) as caught:
                    tv.jacobian(torch.sin, x, process_group=dist.group.WORLD)
                assert isinstance(caught.value.__cause__, RuntimeError)
            finally:
                open(done, "w").close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["none", "not-a-group"])
def test_a_rank_whose_process_group_is_none_or_no_group_leaves_the_others_a_clear_error(
        spawn_within, case):
    spawn_within(functools.partial(_not_a_group_worker, case=case), 2, 120)


def test_a_group_not_initialised_says_the_other_ranks_cannot_be_told(one_rank_group):
    dist.destroy_process_group()
    with pytest.raises(tv.JacobianOptionError, match=(
            r"(?s)torch\.distributed is not initialised.*Fix: call "
            r"torch\.distributed\.init_process_group.*The other ranks cannot be told: if they "
            r"passed a process group, they wait for this rank.*Pass the same process_group "
            r"on every rank")):
        tv.jacobian(torch.sin, torch.ones(2, dtype=DT), process_group=one_rank_group)
