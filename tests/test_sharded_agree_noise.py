"""A sharded ``"auto"`` that measures the rounding of its reverse products (NOTE [the scale
of what is compared] in ``torch_vjp._engine.fwdnoise``) where one rank's backward is not
linear in its cotangent: every step of the measure is agreed between the ranks, so a
backward that runs a collective is called as many times on every rank, and the Jacobian
equals ``torch.func.jacrev``'s in float64. Two ranks, gloo on CPU, one spawned group; a
rank left waiting fails the test at its deadline (and gloo's own 30 s timeout ends a
mis-paired collective sooner)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv

from _references import in_gloo_group, meet, one_rank_failed, twice_with

DT = torch.float64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _true(x):
    return ((2 * x)[:3] * x[3:]).sin()


def _one_rank_not_linear(rank, world, group):
    """Rank 1's backward adds a term quadratic in its cotangent, zero for a cotangent with
    one nonzero entry (the Jacobian's rows are right), not for the check's random ones: its
    products do not scale exactly with their cotangent, and rank 1's measure of their
    rounding stopped after two products, while rank 0 called the backward nine times more
    (its collective then waited for ever)."""
    calls = [0, 0]

    def backward(ctx, g):
        calls[1] += 1
        meet(group, world)
        if rank == 0:
            return g * 2
        extra = g.abs().sum() - g.abs().amax()  # (0 for a row of the Jacobian)
        return g * 2 + 1e-3 * extra ** 2

    Twice = twice_with(backward)

    def f(x):
        calls[0] += 1
        meet(group, world)
        return (Twice.apply(x)[:3] * x[3:]).sin()

    # (no zero, no value repeated, no sum of 0: no check near x)
    x = torch.tensor([0.31, -0.72, 0.45, 0.93, -0.27, 0.58], dtype=DT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.jacobian(f, x, process_group=group)
    torch.testing.assert_close(got, torch.func.jacrev(_true)(x), rtol=1e-12, atol=0)
    counts = [None] * world
    dist.all_gather_object(counts, calls, group=group)
    assert counts[0] == counts[1], counts


def _one_rank_runs_out_of_memory(rank, world, group):
    """Rank 0's backward is not linear in its cotangent (the routes disagree, and the
    rounding is measured); rank 1's runs out of memory on its third product with a cotangent
    that is no row of the Jacobian (the second of the measure): rank 1 raises its own
    error, rank 0 an error naming rank 1 and quoting it, and neither waits for the other."""
    seen = [0]

    def backward(ctx, g):
        meet(group, world)
        extra = g.abs().sum() - g.abs().amax()  # (0 for a row of the Jacobian)
        if rank == 0:
            return g * 2 + 1e-3 * extra ** 2
        if not torch._C._functorch.is_batchedtensor(g) and bool(extra != 0):
            seen[0] += 1
            if seen[0] == 3:
                raise MemoryError("rank 1 ran out of memory measuring")
        return g * 2

    Twice = twice_with(backward)

    def f(x):
        meet(group, world)
        return (Twice.apply(x)[:3] * x[3:]).sin()

    x = torch.tensor([0.37, -0.71, 0.44, 0.92, -0.26, 0.57], dtype=DT)
    one_rank_failed(rank, lambda: tv.jacobian(f, x, process_group=group),
                    "rank 1 ran out of memory measuring")


def _two_ranks(rank, world, init_file):
    in_gloo_group(rank, world, init_file, (_one_rank_not_linear, _one_rank_runs_out_of_memory))


def test_the_measure_of_rounding_goes_one_way_on_every_rank(spawn_within):
    spawn_within(_two_ranks, 2, 180, forkserver=True)
