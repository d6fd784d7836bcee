"""Per-sample functions on a model wrapped in DistributedDataParallel (NOTE [DDP] in
``torch_vjp._per_sample.distributed``), with real process groups: gloo on CPU, 2 and 3 ranks
started with torch.multiprocessing, each with its own slice of one global batch.

Every rank checks its own results against the single-process definition computed on the
whole batch, in float64: ``.grad`` equals the clipped per-example sum over the global batch
divided by the world size (DDP's convention), on every rank; norms and per-sample gradients
are those of the rank's own examples.
"""

from __future__ import annotations

import datetime
import gc
import os
import tempfile
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import torch_vjp as tv

from _shared_functions import FORKSERVER_PRELOAD

DT = torch.float64
GLOBAL_BATCH = 12
MAX_NORM = 0.5

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3)).to(DT)


def _data():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(GLOBAL_BATCH, 5, dtype=DT, generator=g),
            torch.randint(0, 3, (GLOBAL_BATCH,), generator=g))


def _clipped_sum(model, x, y, max_norm):
    """The definition on one process: sum_i min(1, C / ||g_i||) g_i over the examples."""
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(x.shape[0]):
        gs = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]),
                                 list(model.parameters()))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in gs))
        c = min(1.0, max_norm / float(norm))
        for (n, _), g in zip(model.named_parameters(), gs):
            total[n] += c * g
    return total


def _worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        wrappers = _check(rank, world)
        # DDP's reducer holds the process group: destroying the group while a wrapper is
        # alive aborts the process at exit now and then (torch itself, without torch_vjp).
        # The wrappers are gone once _check returns, so nothing of torch_vjp keeps them.
        gc.collect()
        assert [w() for w in wrappers] == [None, None], f"rank {rank}: a DDP wrapper is kept"
    finally:
        dist.destroy_process_group()


def _check(rank, world):
    """Every assertion of one rank; returns weak references to the DDP wrappers it made."""
    torch.set_num_threads(1)
    x, y = _data()
    ref_model = _model()
    want = _clipped_sum(ref_model, x, y, MAX_NORM)
    ddp = nn.parallel.DistributedDataParallel(_model())
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    # 2 ranks: 6 examples each; 3 ranks: 6, 6 and none (Poisson sampling draws empty
    # batches: the rank still takes part in the reduction)
    per = 6
    xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]

    # the clipped step: .grad equals the global clipped sum / world size on every rank
    norms = tv.accumulate_clipped_grads(ddp, loss_fn, xs, ys, max_norm=MAX_NORM)
    for name, p in ddp.module.named_parameters():
        torch.testing.assert_close(p.grad, want[name] / world, rtol=1e-10, atol=1e-12,
                                   msg=f"rank {rank}: {name}")
    # norms: the rank's own examples
    ref_g = tv.per_sample_grads(ref_model, loss_fn, xs, ys, strategy="loop")
    ref_norms = (sum(g.flatten(1).pow(2).sum(1) for g in ref_g.values()).sqrt()
                 if xs.shape[0] else torch.zeros(0, dtype=DT))
    torch.testing.assert_close(norms, ref_norms, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tv.per_sample_grad_norms(ddp, loss_fn, xs, ys), ref_norms,
                               rtol=1e-10, atol=1e-12)
    # per-sample gradients: named as the wrapper names its parameters
    got = tv.per_sample_grads(ddp, loss_fn, xs, ys)
    assert list(got) == [n for n, _ in ddp.named_parameters()]
    for name, g in got.items():
        torch.testing.assert_close(g, ref_g[name[len("module."):]], rtol=1e-10,
                                   atol=1e-12)

    # accumulation under no_sync, then one synchronised step: DDP's convention
    for p in ddp.parameters():
        p.grad = None
    half = xs.shape[0] // 2
    with ddp.no_sync():
        tv.accumulate_clipped_grads(ddp, loss_fn, xs[:half], ys[:half], max_norm=MAX_NORM)
    tv.accumulate_clipped_grads(ddp, loss_fn, xs[half:], ys[half:], max_norm=MAX_NORM)
    for name, p in ddp.module.named_parameters():
        torch.testing.assert_close(p.grad, want[name] / world, rtol=1e-10, atol=1e-12,
                                   msg=f"rank {rank}, accumulated: {name}")

    # a subset of the parameters: DDP's reducer would wait for the others ...
    with pytest.raises(tv.PerSampleValueError, match=r"(?s)params leaves out 4 trainable "
                       r"parameter\(s\).*first: '0\.weight'.*find_unused_parameters=True"):
        tv.accumulate_clipped_grads(ddp, loss_fn, xs, ys, max_norm=MAX_NORM,
                                    params=["module.3.weight", "module.3.bias"])
    # ... unless it looks for unused parameters; the norms are then those of the subset
    sub = nn.parallel.DistributedDataParallel(_model(), find_unused_parameters=True)
    tv.accumulate_clipped_grads(sub, loss_fn, xs, ys, max_norm=MAX_NORM,
                                params=["module.3.weight", "module.3.bias"])
    g = tv.per_sample_grads(ref_model, loss_fn, x, y, params=["3.weight", "3.bias"],
                            strategy="loop")
    c = (MAX_NORM / (g["3.weight"].flatten(1).pow(2).sum(1)
                     + g["3.bias"].pow(2).sum(1)).sqrt()).clamp(max=1.0)
    c = c[:world * per]  # the examples some rank holds
    for name in ("3.weight", "3.bias"):
        p = sub.module.get_parameter(name)
        want_sub = torch.einsum("b,b...->...", c, g[name][:world * per]) / world
        torch.testing.assert_close(p.grad, want_sub, rtol=1e-10, atol=1e-12)
    assert sub.module[0].weight.grad is None
    return [weakref.ref(ddp), weakref.ref(sub)]


def _spawn(worker, world, init_file):
    """``worker(rank, world, init_file)`` on ``world`` ranks, as mp.spawn runs it, each rank
    forked from one server process that imported torch, torch_vjp and this module once for
    every run here (mp.spawn's fresh interpreters imported them again in each rank; as
    conftest's spawn_within with ``forkserver=True``)."""
    if "forkserver" not in mp.get_all_start_methods():  # (Windows)
        mp.spawn(worker, args=(world, init_file), nprocs=world, join=True)
        return
    mp.set_forkserver_preload([*FORKSERVER_PRELOAD, __name__])
    mp.start_processes(worker, args=(world, init_file), nprocs=world, join=True,
                       start_method="forkserver")


def _run(world):
    with tempfile.TemporaryDirectory() as d:
        _spawn(_worker, world, os.path.join(d, "init"))


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_clipped_step_norms_and_grads(world):
    _run(world)


def test_unsupported_wrappers_are_named():
    model = _model()
    x, y = torch.randn(2, 5, dtype=DT), torch.randn(2, 3, dtype=DT)
    with pytest.raises(tv.PerSampleTypeError, match=r"(?s)wrapped in nn\.DataParallel.*Fix: "
                       r"pass model\.module .* or train with DistributedDataParallel"):
        tv.per_sample_grads(nn.DataParallel(model), nn.MSELoss(), x, y)
    # torch.distributed.fsdp.fully_shard swaps a module's class for "FSDP" + its name
    sharded = type("FSDPSequential", (nn.Sequential,), {})(*model)
    with pytest.raises(tv.PerSampleTypeError, match=r"(?s)sharded with FSDP \(FSDPSequential\)"
                       r".*Supported: an unwrapped module, or one wrapped in "
                       r"DistributedDataParallel"):
        tv.accumulate_clipped_grads(sharded, nn.MSELoss(), x, y, max_norm=1.0)


def _hooks_worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        torch.set_num_threads(1)
        model = _model()
        # the model's own hooks: a forward hook that rescales the output, and a pre-hook
        # that reads (and casts) the input; both belong to every real forward
        model.register_forward_hook(lambda mod, args, out: out * 2)
        model.register_forward_pre_hook(lambda mod, args: (args[0].to(DT),))
        x, y = _data()
        want = _clipped_sum(model, x, y, 0.5)
        ddp = nn.parallel.DistributedDataParallel(model)
        per = GLOBAL_BATCH // world
        mine = slice(rank * per, (rank + 1) * per)
        tv.accumulate_clipped_grads(ddp, nn.CrossEntropyLoss(reduction="sum"), x[mine],
                                    y[mine], max_norm=0.5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name] / world, rtol=1e-10, atol=1e-12,
                                       msg=name)
    finally:
        ddp = None  # (its reducer holds the group: freed after the group, gloo's teardown hung)
        dist.destroy_process_group()


def test_ddp_clipped_step_with_hooks_on_the_wrapped_module():
    # The clipped sums reach .grad through DDP's forward on a stand-in forward: the model's
    # hooks must not run on it (a forward hook scaled the sums, a pre-hook found no input).
    # One rank, in this process (the 2- and 3-rank runs above cover the exchange).
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as d:
        try:
            _hooks_worker(0, 1, os.path.join(d, "init"))
        finally:
            torch.set_num_threads(threads)


def _buffers_worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    ddp = None
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).to(DT)
        ddp = nn.parallel.DistributedDataParallel(model)  # broadcast_buffers=True
        with torch.no_grad():  # rank-local statistics, as after a training step
            model[1].running_mean.fill_(float(rank))
        model.eval()
        x, y = _data()
        mine = slice(rank * 6, (rank + 1) * 6)
        loss = nn.CrossEntropyLoss(reduction="sum")
        first = tv.per_sample_grad_norms(ddp, loss, x[mine], y[mine])
        # DDP's own forward gives every rank rank 0's buffers first: so must this call
        assert float(model[1].running_mean.abs().max()) == 0.0
        again = tv.per_sample_grad_norms(ddp, loss, x[mine], y[mine])
        torch.testing.assert_close(first, again, rtol=1e-12, atol=1e-14)
        dist.barrier()  # (both ranks done before the group goes)
    except BaseException:
        ddp = None
        dist.destroy_process_group()
        raise
    ddp = None
    dist.destroy_process_group()
    # (gloo's threads of a group that broadcast buffers aborted this process's exit now and
    # then, "terminate called without an active exception", after every check had passed:
    # the worker leaves without running the interpreter's teardown)
    os._exit(0)


def test_ddp_buffers_are_broadcast_before_the_per_example_passes():
    # with broadcast_buffers=True (the default), rank 1 computed its norms with its own
    # stale statistics, and the clipped step's pass through DDP then copied rank 0's over
    # them: the same call twice gave other results
    with tempfile.TemporaryDirectory() as d:
        _spawn(_buffers_worker, 2, os.path.join(d, "init"))


def test_hooks_on_the_ddp_wrapper_itself_are_refused():
    # the computation runs on ddp.module, where the wrapper's hooks never run; the clipped
    # step's pass through the wrapper ran them (a forward hook doubled .grad, silently; a
    # pre-hook raised a raw IndexError)
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'init')}",
                                rank=0, world_size=1)
        ddp = None
        try:
            ddp = nn.parallel.DistributedDataParallel(_model())
            ddp.register_forward_hook(lambda m, a, o: o * 2)
            x, y = _data()
            with pytest.raises(tv.PerSampleTypeError, match=(
                    r"the DistributedDataParallel wrapper itself has forward hooks or "
                    r"pre-hooks(?s:.*)Fix: register them on ddp\.module")):
                tv.accumulate_clipped_grads(ddp, nn.CrossEntropyLoss(reduction="sum"), x, y,
                                            max_norm=0.5)
        finally:
            ddp = None
            dist.destroy_process_group()



def _one_rank_fails_worker(rank, world, init_file):
    # (a short timeout: a rank left waiting in a collective ends in seconds, not never)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=20))
    ddp = None
    try:
        torch.set_num_threads(1)
        ddp = nn.parallel.DistributedDataParallel(_model())
        x, y = _data()
        xs, ys = x[rank * 6:(rank + 1) * 6], y[rank * 6:(rank + 1) * 6].clone()
        if rank == 1:
            ys[2] = 7  # a target out of range in this rank's own examples only
        loss = nn.CrossEntropyLoss(reduction="sum")
        if rank == 1:  # the user's own error, untouched
            with pytest.raises(IndexError, match="Target 7 is out of bounds"):
                tv.accumulate_clipped_grads(ddp, loss, xs, ys, max_norm=MAX_NORM)
        else:
            with pytest.raises(tv.PerSampleError, match=(
                    r"(?s)^torch_vjp\.accumulate_clipped_grads: rank 1 of the "
                    r"DistributedDataParallel process group failed while computing its "
                    r"clipped sums, so no rank adds its sums to \.grad .*Rank 1 said: "
                    r"IndexError: Target 7 is out of bounds.*in rank 1's traceback")):
                tv.accumulate_clipped_grads(ddp, loss, xs, ys, max_norm=MAX_NORM)
        assert all(p.grad is None for p in ddp.parameters()), f"rank {rank}: .grad changed"
        # the group still works, and the next step synchronises as before
        ys[2] = 0
        for p in ddp.parameters():
            p.grad = None
        tv.accumulate_clipped_grads(ddp, loss, xs, ys, max_norm=MAX_NORM)
        grads = [p.grad.clone() for p in ddp.parameters()]
        said = [None] * world
        dist.all_gather_object(said, grads)
        for a, b in zip(*said):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # inside ddp.join() (uneven steps), a rank that has joined shadows DDP's own
        # collectives only: no exchange of the library's there
        steps = [slice(0, 3), slice(3, 6)] if rank == 0 else [slice(0, 3)]
        with ddp.join():
            for s in steps:
                for p in ddp.parameters():
                    p.grad = None
                tv.accumulate_clipped_grads(ddp, loss, xs[s], ys[s], max_norm=MAX_NORM)
        if rank == 0:  # its last step alone, divided by the world size (DDP's convention)
            want = _clipped_sum(_model(), xs[3:6], ys[3:6], MAX_NORM)
            for name, p in ddp.module.named_parameters():
                torch.testing.assert_close(p.grad, want[name] / world, rtol=1e-10,
                                           atol=1e-12, msg=f"join: {name}")
        # the same with a model that has buffers (a BatchNorm in eval mode): the buffers are
        # broadcast in DDP's own forward alone, which a joined rank shadows (one broadcast
        # more of the library's, before it, paired with nothing there and failed)
        torch.manual_seed(0)
        bn = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(),
                           nn.Linear(8, 3)).to(DT).eval()
        ddp = nn.parallel.DistributedDataParallel(bn)
        with ddp.join():
            for s in steps:
                for p in ddp.parameters():
                    p.grad = None
                tv.accumulate_clipped_grads(ddp, loss, xs[s], ys[s], max_norm=MAX_NORM)
        if rank == 0:
            want = _clipped_sum(bn, xs[3:6], ys[3:6], MAX_NORM)
            for name, p in ddp.module.named_parameters():
                torch.testing.assert_close(p.grad, want[name] / world, rtol=1e-10,
                                           atol=1e-12, msg=f"join, buffers: {name}")
        dist.barrier()
    finally:
        ddp = bn = None
        gc.collect()  # (the wrappers hold the group: gone before it is destroyed)
        dist.destroy_process_group()


def test_ddp_clipped_step_error_on_one_rank_reaches_every_rank(spawn_within):
    # rank 1's loss raised on a target of its own examples; rank 0 went on into the reducer's
    # all-reduce and waited there for rank 1 until the group's timeout
    spawn_within(_one_rank_fails_worker, 2, 90, forkserver=True)
