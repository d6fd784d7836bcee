"""A sharded Jacobian whose gather of the ranks' shards fails on one rank (out of memory
while allocating the pieces): every rank says, before each ``all_gather``, whether it
failed, so rank 1 raises its own error and rank 0 an error naming rank 1 and quoting it,
instead of waiting in the gather; the group stays usable, and the next call's Jacobian
equals ``torch.func.jacrev``'s in float64. Two ranks, gloo on CPU, one spawned group; a rank
left waiting fails the test at its deadline (and gloo's own 30 s timeout ends a
mis-paired collective sooner)."""

from __future__ import annotations

import contextlib

import sys

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import torch_vjp as tv

from _references import in_gloo_group, one_rank_failed

DT = torch.float64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _in_gather():
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "gather" and frame.f_code.co_filename.endswith(
                "_sharded_work.py"):
            return True
        frame = frame.f_back
    return False


class _NoRoomToGather(TorchFunctionMode):
    """Out of memory where the gather allocates its pieces (``Tensor.new_empty``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.new_empty and _in_gather():
            raise MemoryError("rank 1 ran out of memory gathering")
        return func(*args, **(kwargs or {}))


def _f(x):
    return (x[:3] * x[3:]).sin()


def _one_rank_cannot_gather(rank, world, group):
    x = torch.tensor([0.31, -0.72, 0.45, 0.93, -0.27, 0.58], dtype=DT)
    def call():
        with _NoRoomToGather() if rank == 1 else contextlib.nullcontext():
            tv.jacobian(_f, x, process_group=group)

    said = one_rank_failed(rank, call, "rank 1 ran out of memory gathering")
    assert rank == 1 or ("this rank (0)" in said and "rank 1's traceback" in said), said
    # (the ranks' collectives still pair: the next call gathers the whole Jacobian)
    got = tv.jacobian(_f, x, process_group=group)
    torch.testing.assert_close(got, torch.func.jacrev(_f)(x), rtol=1e-12, atol=0)


def _two_ranks(rank, world, init_file):
    in_gloo_group(rank, world, init_file, (_one_rank_cannot_gather,))


def test_a_failed_gather_raises_on_every_rank(spawn_within):
    spawn_within(_two_ranks, 2, 180, forkserver=True)
