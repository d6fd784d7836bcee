"""Sharded Jacobians of a model wrapped in DistributedDataParallel after a training step
(NOTE [DDP's buffers in a sharded Jacobian] in ``torch_vjp._sharded_buffers``): each rank
holds the running statistics of its own batches, and the Jacobian is rank 0's, as DDP's
forward would compute it; each rank's own buffers are left as they were. Three ranks, gloo
on CPU, in one spawned run."""

from __future__ import annotations

import copy
import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torch_vjp as tv

DT = torch.float64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _trained(rank, **ddp_kwargs):
    """A BatchNorm model wrapped in DDP after one training step on each rank's own batch."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    ddp = nn.parallel.DistributedDataParallel(m, **ddp_kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    xb = torch.randn(6, 3, dtype=DT, generator=torch.Generator().manual_seed(10 + rank))
    ddp(xb).square().sum().backward()
    opt.step()
    return m.eval(), ddp


def _buffers_checks(rank, world, group):
    """Rank 0's buffers, on every rank, for the module, its DDP wrapper and a closure, and
    each rank's own left as they were; the errors where DDP does not broadcast them."""
    m, ddp = _trained(rank)
    # rank 0's model, on one process: the reference
    ref = copy.deepcopy(m)
    for b in ref.buffers():
        dist.broadcast(b, 0)
    assert rank == 0 or not torch.equal(ref[1].running_mean, m[1].running_mean)
    x = torch.linspace(-1.0, 1.0, 6, dtype=DT).reshape(2, 3)
    want = torch.func.jacrev(ref)(x)
    own = [(b, b.clone(), b._version) for b in m.buffers()]
    # a graph that saved the buffers (BatchNorm in eval mode): still runs backward after
    xg = x.clone().requires_grad_()
    pending = m(xg).sum()
    # (the module alone first: its wrapper is found among the live objects)
    fs = [("module", m), ("wrapper", ddp), ("closure", lambda x: ddp.module(x))]
    for name, f in fs:
        for strategy in ("auto", "fwd", "rev", "rev-loop"):
            got = tv.jacobian(f, x, strategy=strategy, process_group=group)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14,
                                       msg=lambda s: f"rank {rank}, {name}, {strategy}: {s}")
    sh = tv.jacobian(ddp, x, strategy="rev", process_group=group, shard=True)
    torch.testing.assert_close(sh.values, want.reshape(4, 2, 3)[sh.start:sh.stop],
                               rtol=1e-12, atol=1e-14)
    bj = tv.batch_jacobian(ddp, x, strategy="fwd", process_group=group)
    torch.testing.assert_close(bj, torch.stack([want[i, :, i] for i in range(2)]),
                               rtol=1e-12, atol=1e-14)
    # each rank's own buffers: the same tensors, values and versions
    assert all(a is b for (a, _, _), b in zip(own, m.buffers()))
    assert all(torch.equal(b, v) and b._version == k for b, v, k in own)
    pending.backward()
    # broadcast_buffers=False: DDP keeps each rank's own, and the error says so
    m2, ddp2 = _trained(rank, broadcast_buffers=False)
    for f in (ddp2, m2):
        with pytest.raises(tv.JacobianCallError, match=(
                r"(?s)^torch_vjp\.jacobian: the function differs between ranks: the "
                r"'1\.running_mean' of the Sequential f uses holds different values on "
                r"rank 1 than on rank 0 \(their checksums differ\)\. The model is wrapped "
                r"in DistributedDataParallel, but it was built with "
                r"broadcast_buffers=False, so DDP does not broadcast the buffers from rank "
                r"0 before its forward: each rank keeps its own.*Fix: broadcast the "
                r"buffers from rank 0 before the call.*or wrap the model with "
                r"broadcast_buffers=True.*process_group=None")):
            tv.jacobian(f, x, process_group=group)
    # a model no DDP wraps, whose buffers differ: the fix does not claim DDP's forward
    plain = copy.deepcopy(m2)
    with pytest.raises(tv.JacobianCallError, match=(
            r"(?s)the function differs between ranks: the '1\.running_mean' of the "
            r"Sequential f uses holds different values.*DistributedDataParallel "
            r"broadcasts a model's parameters when it wraps it, and with "
            r"broadcast_buffers=True rank 0's buffers before each forward")):
        tv.jacobian(plain, x, process_group=group)


def _subgroup_checks(rank):
    """A group without DDP's rank 0: the buffers DDP's forward would use cannot be taken."""
    m, ddp = _trained(rank)
    x = torch.linspace(-1.0, 1.0, 6, dtype=DT).reshape(2, 3)
    sub = dist.new_group([1, 2])
    if rank > 0:
        # DDP broadcasts from global rank 0, which is not in the group: this call cannot
        # take the buffers DDP's forward would use, and says so
        with pytest.raises(tv.JacobianCallError, match=(
                r"(?s)the function differs between ranks: the '1\.running_mean' of the "
                r"Sequential f uses holds different values on rank 1 than on rank 0.*"
                r"DDP broadcasts its buffers from rank 0 of its own process group \(global "
                r"rank 0\), which is not a member of process_group")):
            tv.jacobian(ddp, x, process_group=sub)


def _ddp_worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        torch.set_num_threads(1)
        _buffers_checks(rank, world, dist.group.WORLD)
        _subgroup_checks(rank)
        dist.barrier()
    finally:
        import gc
        gc.collect()  # (the wrappers hold the group: gone before it is destroyed)
        dist.destroy_process_group()


def test_sharded_jacobian_of_a_ddp_model_uses_rank_0s_buffers_and_says_where_it_cannot(
        spawn_within):
    # (three ranks, one spawned run: a group of ranks 1 and 2 leaves DDP's rank 0 out)
    spawn_within(_ddp_worker, 3, 300, forkserver=True)
