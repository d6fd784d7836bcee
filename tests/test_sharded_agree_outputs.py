"""A sharded Jacobian of an ``f`` that runs a collective and returns outputs of other sizes
on one rank (NOTE [outputs alike on every rank] in ``torch_vjp._sharded``): ``"auto"``
chose its mode from each rank's own output sizes, and a named reverse strategy counted each
rank's chunks over its own rows, so f, or its backward, was called more often on one rank
and the others waited in its collective. Every rank now raises the error naming the
output, before any product, and the group still works after. Two ranks, gloo on CPU, one
spawned group; a rank left waiting fails the test at its deadline (and gloo's own 30 s
timeout ends a mis-paired collective sooner)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv

from _references import in_gloo_group, meet

DT = torch.float64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


class _MeetingBackward(torch.autograd.Function):
    """The identity, whose backward runs a collective (once per call of the pullback)."""

    @staticmethod
    def forward(x, group, calls):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.calls = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        ctx.calls[0] += 1
        meet(ctx.group, dist.get_world_size(ctx.group))
        return g, None, None


def _checks(rank, world, group):
    calls = [0]
    x = torch.linspace(0.2, 0.9, 4, dtype=DT)

    def by_size(x):
        # (two outputs on rank 0: reverse mode; 400 on rank 1: forward mode)
        calls[0] += 1
        meet(group, world)
        y = x[:2].sin() if rank == 0 else x.sin().repeat(100)
        return y

    def backward_meets(x):
        # (rank 0 numbers 2 rows, one chunk; rank 1 6 rows, three chunks of one)
        y = _MeetingBackward.apply(x, group, calls)
        return y[:2].sin() if rank == 0 else torch.cat([y, y[:2]]).sin()

    says = r"(?s)^torch_vjp\.jacobian: the outputs of f differ between ranks: output is "
    for f, strategy, kw, sizes in ((by_size, "auto", {}, r"\(400,\) on rank 1 but \(2,\)"),
                                   (backward_meets, "rev", {"chunk_size": 1},
                                    r"\(6,\) on rank 1 but \(2,\)"),
                                   (backward_meets, "rev", {"shard": True},
                                    r"\(6,\) on rank 1 but \(2,\)")):
        with pytest.raises(tv.JacobianCallError, match=says + sizes + r" on rank 0.*Fix: "):
            tv.jacobian(f, x, strategy=strategy, process_group=group, **kw)

    # the group still works: outputs alike, f and its backward called as often on every rank
    def alike(x):
        calls[0] += 1
        meet(group, world)
        return _MeetingBackward.apply(x, group, calls)[:3].sin() * x[1:]

    want = torch.func.jacrev(lambda x: x[:3].sin() * x[1:])(x)
    for strategy in ("auto", "rev"):
        calls[0] = 0
        got = tv.jacobian(alike, x, strategy=strategy, process_group=group)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
        counts = [None] * world
        dist.all_gather_object(counts, calls[0], group=group)
        assert counts[0] == counts[1], (strategy, counts)


def _two_ranks(rank, world, init_file):
    in_gloo_group(rank, world, init_file, (_checks,))


def test_outputs_of_other_sizes_on_one_rank_raise_on_every_rank(spawn_within):
    spawn_within(_two_ranks, 2, 180, forkserver=True)
