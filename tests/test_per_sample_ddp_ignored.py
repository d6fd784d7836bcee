"""The clipped step on a model wrapped in DistributedDataParallel with parameters DDP was told
to ignore (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``, as
libraries that reduce some parameters themselves do): its reducer never waits for them, so a
``params`` selection that leaves them out is valid, with or without ``static_graph``. Two
ranks, gloo on CPU, one spawned run; ``.grad`` against a per-example loop in float64."""

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
IGNORED = ["0.weight", "0.bias"]
SUBSET = ["module.2.weight", "module.2.bias"]

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, IGNORED)
    return model


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 5, dtype=DT, generator=g), torch.randint(0, 3, (8,), generator=g)


def _clipped_sum(x, y, names):
    """sum_i min(1, C / ||g_i||) g_i over the examples, g_i the gradient of the parameters
    ``names`` (their norm clipped), by a per-example loop."""
    model = _model()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    params = [model.get_parameter(n) for n in names]
    total = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        gs = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), params)
        c = min(1.0, MAX_NORM / float(torch.sqrt(sum(g.pow(2).sum() for g in gs))))
        for t, g in zip(total, gs):
            t += c * g
    return dict(zip(names, total))


def _worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    ddp = None
    try:
        torch.set_num_threads(1)
        x, y = _data()
        loss = nn.CrossEntropyLoss(reduction="sum")
        mine = slice(rank * 4, (rank + 1) * 4)
        names = [n[len("module."):] for n in SUBSET]
        want = _clipped_sum(x, y, names)

        def check(model, what):
            for n in names:
                torch.testing.assert_close(model.get_parameter(n).grad, want[n] / world,
                                           rtol=1e-10, atol=1e-12,
                                           msg=f"rank {rank}, {what}: {n}")
            for n in IGNORED:
                assert model.get_parameter(n).grad is None, f"rank {rank}, {what}: {n}"

        # find_unused_parameters=False: the subset leaves out the ignored parameters only
        # (it was refused, as if the reducer would wait for them)
        ddp = nn.parallel.DistributedDataParallel(_model())
        tv.accumulate_clipped_grads(ddp, loss, x[mine], y[mine], max_norm=MAX_NORM,
                                    params=SUBSET)
        check(ddp.module, "find_unused_parameters=False")
        # static_graph=True after an ordinary step: the same subset is that step's
        # (it was refused as leaving out parameters of the first step)
        ddp = nn.parallel.DistributedDataParallel(_model(), static_graph=True)
        loss(ddp(x[mine]), y[mine]).backward()
        for step in range(2):
            for p in ddp.parameters():
                p.grad = None
            tv.accumulate_clipped_grads(ddp, loss, x[mine], y[mine], max_norm=MAX_NORM,
                                        params=SUBSET)
            check(ddp.module, f"static_graph, step {step}")
        # static_graph=True, the clipped step first with every parameter, then the subset:
        # the ignored parameters are no part of the first step's selection
        ddp = nn.parallel.DistributedDataParallel(_model(), static_graph=True)
        tv.accumulate_clipped_grads(ddp, loss, x[mine], y[mine], max_norm=MAX_NORM)
        local = _clipped_sum(x[mine], y[mine], IGNORED + names)
        for n in IGNORED:  # (DDP's convention: an ignored parameter keeps the rank's own)
            torch.testing.assert_close(ddp.module.get_parameter(n).grad, local[n],
                                       rtol=1e-10, atol=1e-12, msg=f"rank {rank}: {n}")
        for p in ddp.parameters():
            p.grad = None
        tv.accumulate_clipped_grads(ddp, loss, x[mine], y[mine], max_norm=MAX_NORM,
                                    params=SUBSET)
        check(ddp.module, "static_graph, clipped first step")
        dist.barrier()
    finally:
        ddp = None
        gc.collect()  # (the wrapper holds the group: gone before it is destroyed)
        dist.destroy_process_group()


def test_ddp_clipped_step_may_leave_out_the_parameters_ddp_ignores(spawn_within):
    spawn_within(_worker, 2, 120, forkserver=True)
