"""A sharded ``"auto"`` whose check near x (NOTE [auto, checked near the point] in
``torch_vjp._engine.nearcheck``) fails on one rank only: each step of ``near_sides`` (the
forward product near x, the call of f for the reverse product, its backward, the product
under vmap) is agreed between the ranks, so an ``f`` (or a backward) that runs a collective
is called as many times on every rank, the Jacobian equals ``torch.func.jacrev``'s in
float64 (x's check stands), and out of memory on one rank is raised on every rank, the
others naming it. Two ranks, gloo on CPU, one spawned group; a rank left waiting fails the
test at its deadline (and gloo's own 30 s timeout ends a mis-paired collective sooner)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv

from _references import in_gloo_group, meet, one_rank_failed, twice_with

DT = torch.float64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _true(x):
    return (x[:3] * x[3:]).sin()


def _point(shift):
    # (a zero: "auto" checks its reverse product once more near x, where there is none)
    return torch.tensor([0.0, -0.72, 0.45, 0.93, -0.27, 0.58], dtype=DT) + torch.tensor(
        [0.0, shift, 0.0, 0.0, 0.0, 0.0], dtype=DT)


def _same_counts(calls, group, world):
    counts = [None] * world
    dist.all_gather_object(counts, calls, group=group)
    assert counts[0] == counts[1], counts


def _at_x_only(rank, x):
    """Whether this rank's f (or backward) fails at ``x``: rank 1's, away from the zeros of
    the caller's points (near x, where the check runs)."""
    return rank == 1 and bool((x != 0).all())


def _forward_fails_near_x(rank, world, group):
    """Rank 1's f returns NaN near x (its forward product there fails, rank 0's does not):
    rank 0 had gone on to call f for the reverse product, alone."""
    calls = [0]

    def f(x):
        calls[0] += 1
        meet(group, world)
        y = _true(x)
        return y * float("nan") if _at_x_only(rank, x) else y

    x = _point(0.0)
    got = tv.jacobian(f, x, process_group=group)
    torch.testing.assert_close(got, torch.func.jacrev(_true)(x), rtol=1e-12, atol=0)
    _same_counts(calls[0], group, world)


def _backward_fails_near_x(rank, world, group):
    """Rank 1's backward returns NaN near x (its reverse product there fails, rank 0's does
    not), and the backward runs a collective: rank 0 had gone on to the product under vmap,
    calling f and its backward alone."""
    calls = [0, 0]

    def backward(ctx, g):
        calls[1] += 1
        meet(group, world)
        (x,) = ctx.saved_tensors
        return g * float("nan") if _at_x_only(rank, x) else g * 2

    Twice = twice_with(backward, save_input=True)

    def f(x):
        calls[0] += 1
        meet(group, world)
        return (Twice.apply(x)[:3] * x[3:]).sin()

    x = _point(0.01)
    got = tv.jacobian(f, x, process_group=group)
    want = torch.func.jacrev(lambda y: ((2 * y)[:3] * y[3:]).sin())(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    _same_counts(calls, group, world)


def _out_of_memory_near_x(rank, world, group):
    """Rank 1's f runs out of memory near x: rank 1 raises its own error, rank 0 an error
    naming rank 1 and quoting it, and neither waits for the other."""

    def f(x):
        meet(group, world)
        if _at_x_only(rank, x):
            raise MemoryError("rank 1 ran out of memory near x")
        return _true(x)

    x = _point(0.02)
    one_rank_failed(rank, lambda: tv.jacobian(f, x, process_group=group),
                    "rank 1 ran out of memory near x")


def _two_ranks(rank, world, init_file):
    in_gloo_group(rank, world, init_file, (_forward_fails_near_x, _backward_fails_near_x,
                                           _out_of_memory_near_x))


def test_the_check_near_x_goes_one_way_on_every_rank(spawn_within):
    spawn_within(_two_ranks, 2, 180, forkserver=True)
