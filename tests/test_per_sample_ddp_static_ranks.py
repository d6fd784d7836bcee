"""The clipped step on a model wrapped in DistributedDataParallel with ``static_graph=True``
whose forward reaches a parameter on some ranks only (NOTE [DDP with static_graph] in
``torch_vjp._per_sample.distributed``): DDP's reducer records per rank which parameters the
first step used, so the pass that adds the sums gives a gradient to those the rank's own
examples reach. Two ranks, gloo on CPU, one spawned run; ``.grad`` against a per-example
loop in float64, over the union of the ranks' examples, divided by the world size."""

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


class _Branch(nn.Module):
    """``a(x)``, plus ``b(x)`` where ``use_b`` (a branch taken on some ranks only)."""

    def __init__(self, use_b):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(5, 3)
        self.use_b = use_b

    def forward(self, x):
        out = self.a(x)
        return out + self.b(x) if self.use_b else out


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 5, dtype=DT, generator=g), torch.randint(0, 3, (8,), generator=g)


def _references(x, y, world):
    """The clipped per-example sum and the summed loss's gradient over every rank's examples
    (rank r's four through the model as rank r runs it), by a per-example loop."""
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    names = [n for n, _ in _Branch(True).named_parameters()]
    clipped = {n: 0 for n in names}
    plain = {n: 0 for n in names}
    for r in range(world):
        model = _Branch(r == 0).to(DT)
        params = list(model.parameters())
        for i in range(4 * r, 4 * r + 4):
            gs = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), params,
                                     allow_unused=True)
            gs = [torch.zeros_like(p) if g is None else g for p, g in zip(params, gs)]
            c = min(1.0, MAX_NORM / float(torch.sqrt(sum(g.pow(2).sum() for g in gs))))
            for n, g in zip(names, gs):
                clipped[n] = clipped[n] + c * g
                plain[n] = plain[n] + g
    return clipped, plain


def _worker(rank, world, init_file):
    # (a short timeout: a rank left waiting in the reducer's all-reduce ends in seconds)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=20))
    ddp = None
    try:
        torch.set_num_threads(1)
        x, y = _data()
        loss = nn.CrossEntropyLoss(reduction="sum")
        mine = slice(rank * 4, (rank + 1) * 4)
        clipped, plain = _references(x, y, world)

        def check(model, want, what):
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, want[n] / world, rtol=1e-10, atol=1e-12,
                                           msg=f"rank {rank}, {what}: {n}")

        def clipped_step(what):
            for p in ddp.parameters():
                p.grad = None
            tv.accumulate_clipped_grads(ddp, loss, x[mine], y[mine], max_norm=MAX_NORM)
            check(ddp.module, clipped, what)

        def ordinary_step(what):
            for p in ddp.parameters():
                p.grad = None
            loss(ddp(x[mine]), y[mine]).backward()
            check(ddp.module, plain, what)

        # an ordinary first step (rank 1 never reaches b), then clipped steps: rank 1 raised
        # that the graph changed, rank 0 waited in the all-reduce until the timeout
        ddp = nn.parallel.DistributedDataParallel(_Branch(rank == 0).to(DT),
                                                  static_graph=True)
        ordinary_step("ordinary first step")
        clipped_step("clipped after an ordinary first step")
        clipped_step("clipped again")
        ordinary_step("ordinary after clipped steps")
        # the clipped step first: it recorded b as used on rank 1, and the next ordinary
        # step parted the ranks
        ddp = nn.parallel.DistributedDataParallel(_Branch(rank == 0).to(DT),
                                                  static_graph=True)
        clipped_step("clipped first step")
        clipped_step("clipped second step")
        ordinary_step("ordinary after a clipped first step")
        dist.barrier()
    finally:
        ddp = None
        gc.collect()  # (the wrapper holds the group: gone before it is destroyed)
        dist.destroy_process_group()


def test_ddp_static_graph_clipped_step_with_a_branch_on_one_rank(spawn_within):
    spawn_within(_worker, 2, 120, forkserver=True)
