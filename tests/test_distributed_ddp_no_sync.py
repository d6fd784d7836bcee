"""The clipped step on a model wrapped in DistributedDataParallel under ``ddp.no_sync()``
(NOTE [DDP] in ``torch_vjp._per_sample.distributed``): the reducer stays out, but the
synchronising pass's DDP forward still broadcasts rank 0's buffers where DDP's next forward
would (the first no_sync step after a synchronised one), so an error on one rank reaches
every rank there too. Two ranks, gloo on CPU."""

from __future__ import annotations

import datetime
import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torch_vjp as tv

DT = torch.float64
MAX_NORM = 0.5

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _model():
    # (a BatchNorm in eval mode: buffers that DDP broadcasts before its forward)
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(),
                         nn.Linear(8, 3)).to(DT).eval()


def _clipped_sum(model, x, y):
    """The definition on one process: sum_i min(1, C / ||g_i||) g_i over the examples."""
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(x.shape[0]):
        gs = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]),
                                 list(model.parameters()))
        c = min(1.0, MAX_NORM / float(torch.sqrt(sum(g.pow(2).sum() for g in gs))))
        for (n, _), g in zip(model.named_parameters(), gs):
            total[n] += c * g
    return total


def _no_sync_worker(rank, world, init_file):
    # (a short timeout: a rank left waiting in the broadcast ends in seconds)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=20))
    ddp = None
    try:
        torch.set_num_threads(1)
        ddp = nn.parallel.DistributedDataParallel(_model())
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(12, 5, dtype=DT, generator=g), torch.randint(0, 3, (12,), generator=g)
        xs, ys = x[rank * 6:(rank + 1) * 6], y[rank * 6:(rank + 1) * 6]
        loss = nn.CrossEntropyLoss(reduction="sum")
        bad = ys.clone()
        if rank == 1:
            bad[2] = 7  # a target out of range in this rank's own examples only
        # the first no_sync step (no step before it): its pass broadcasts the buffers
        with ddp.no_sync():
            if rank == 1:  # the user's own error, untouched
                with pytest.raises(IndexError, match="Target 7 is out of bounds"):
                    tv.accumulate_clipped_grads(ddp, loss, xs, bad, max_norm=MAX_NORM)
            else:
                with pytest.raises(tv.PerSampleError, match=(
                        r"(?s)^torch_vjp\.accumulate_clipped_grads: rank 1 of the "
                        r"DistributedDataParallel process group failed while computing its "
                        r"clipped sums, so no rank adds its sums to \.grad \(DDP's collectives "
                        r"in that pass, the reducer's all-reduce or the broadcast of the "
                        r"buffers, would wait for rank 1 for ever\)\. Rank 1 said: "
                        r"IndexError: Target 7 is out of bounds.*in rank 1's traceback")):
                    tv.accumulate_clipped_grads(ddp, loss, xs, bad, max_norm=MAX_NORM)
        assert all(p.grad is None for p in ddp.parameters()), f"rank {rank}: .grad changed"
        # the group still works: accumulation under no_sync, then a synchronised step
        with ddp.no_sync():
            tv.accumulate_clipped_grads(ddp, loss, xs[:3], ys[:3], max_norm=MAX_NORM)
        tv.accumulate_clipped_grads(ddp, loss, xs[3:], ys[3:], max_norm=MAX_NORM)
        want = _clipped_sum(_model(), x, y)
        for name, p in ddp.module.named_parameters():
            torch.testing.assert_close(p.grad, want[name] / world, rtol=1e-10, atol=1e-12,
                                       msg=f"rank {rank}: {name}")
        # after that synchronised step, the first no_sync step broadcasts again: the same
        for p in ddp.parameters():
            p.grad = None
        with ddp.no_sync():
            if rank == 1:
                with pytest.raises(IndexError, match="Target 7 is out of bounds"):
                    tv.accumulate_clipped_grads(ddp, loss, xs, bad, max_norm=MAX_NORM)
            else:
                with pytest.raises(tv.PerSampleError, match=r"rank 1 of the "
                                   r"DistributedDataParallel process group failed"):
                    tv.accumulate_clipped_grads(ddp, loss, xs, bad, max_norm=MAX_NORM)
        dist.barrier()
    finally:
        ddp = None
        gc.collect()  # (the wrapper holds the group: gone before it is destroyed)
        dist.destroy_process_group()


def test_ddp_no_sync_clipped_step_error_on_one_rank_reaches_every_rank(spawn_within):
    # rank 1's loss raised on a target of its own examples; rank 0 went on into the
    # synchronising pass's buffer broadcast and waited there for rank 1
    spawn_within(_no_sync_worker, 2, 120, forkserver=True)
