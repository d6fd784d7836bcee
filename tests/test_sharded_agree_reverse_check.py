"""A sharded ``"auto"`` whose check of its reverse product against a forward product
(NOTE [a sharded reverse product checked forward] in ``torch_vjp._sharded_forward``) goes
another way on one rank than on the other: each step of ``reverse_wrong`` is agreed between
the ranks (the ``agree`` hook of ``torch_vjp._engine.revcheck``), so an ``f`` that runs a
collective is called as many times on every rank, the Jacobian equals the single-process
one in float64, and an error no check may hide, raised on one rank, is raised on every
rank, the others naming it. Two ranks, gloo on CPU, one spawned group; a rank left waiting
fails the test at its deadline (and gloo's own 30 s timeout ends a mis-paired collective
sooner)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv

from _references import WrongBackward, in_gloo_group, meet, one_rank_failed

DT = torch.float64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _true(x):
    return (x[:3] * x[3:]).sin()


def _point():
    # (no zero, no value repeated, no sum of 0: no check near x)
    return torch.tensor([0.31, -0.72, 0.45, 0.93, -0.27, 0.58], dtype=DT)


def _one_rank_wrong(rank, world, group):
    """Rank 1's f goes through a backward formula that is wrong (its forward and its
    forward-mode formula are right), rank 0's through none: only rank 1's check finds its
    reverse product wrong, and calls f four times more on its way. Every rank goes the
    same way, and takes forward mode: rank 1's rows by reverse mode would be wrong."""
    calls = [0]

    def f(x):
        calls[0] += 1
        meet(group, world)
        y = x[:3] * x[3:]
        y = WrongBackward.apply(y) / 2 if rank == 1 else y
        return y.sin()

    x = _point()
    want = torch.func.jacrev(_true)(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = tv.jacobian(f, x, process_group=group)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    said = [str(w.message) for w in caught if "u^T J v" in str(w.message)]
    # (every rank warns alike, with the numbers of the rank that found the formula wrong:
    # rank 1's backward is 3/2 of the right one)
    assert len(said) == 1, said
    m = re.search(r"u\^T J v: (\S+) by reverse mode, (\S+) by forward mode", said[0])
    assert m is not None and abs(float(m[1]) / float(m[2]) - 1.5) < 1e-4, said[0]
    assert "returned the Jacobian by forward mode" in said[0], said[0]
    counts = [None] * world
    dist.all_gather_object(counts, calls[0], group=group)
    assert counts[0] == counts[1], counts

    # the shard alike, from the route remembered on every rank
    calls[0] = 0
    sh = tv.jacobian(f, x, process_group=group, shard=True)
    assert sh.mode == "fwd"
    torch.testing.assert_close(sh.values, want.T[sh.start:sh.stop], rtol=1e-12, atol=0)
    dist.all_gather_object(counts, calls[0], group=group)
    assert counts[0] == counts[1], counts


def _one_rank_runs_out_of_memory(rank, world, group):
    """Every rank's backward formula is wrong; rank 1's f runs out of memory where the
    check calls it without a graph (the central difference): rank 1 raises its own error,
    rank 0 an error naming rank 1 and quoting it, and neither waits for the other."""

    def f(x):
        if rank == 1 and not torch.is_grad_enabled() and not x.requires_grad:
            raise MemoryError("rank 1 ran out of memory in f")
        return WrongBackward.apply(x[:3] * x[3:]).sin()

    x = _point() + 0.01  # (another point: "auto" checks again)
    said = one_rank_failed(rank, lambda: tv.jacobian(f, x, process_group=group),
                           "rank 1 ran out of memory in f")
    assert rank == 1 or ("this rank (0)" in said and "rank 1's traceback" in said), said


def _two_ranks(rank, world, init_file):
    in_gloo_group(rank, world, init_file, (_one_rank_wrong, _one_rank_runs_out_of_memory))


def test_the_reverse_check_goes_one_way_on_every_rank(spawn_within):
    spawn_within(_two_ranks, 2, 180, forkserver=True)
