"""The clipped step on a model wrapped in DistributedDataParallel (NOTE [DDP] in
``torch_vjp._per_sample.distributed``): ``.grad`` equals the clipped per-example sum over the
global batch divided by the world size, on every rank, against a per-example loop in
float64. Two ranks, gloo on CPU, each with its own half of one global batch."""

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



def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 5, dtype=DT, generator=g), torch.randint(0, 3, (8,), generator=g)


def _clipped_sum(model, x, y):
    """The definition: sum_i min(1, C / ||g_i||) g_i, g_i the gradient example i gives
    alone (through the parameters' gradient hooks, as any backward)."""
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        gs = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), params)
        c = min(1.0, MAX_NORM / float(torch.sqrt(sum(g.pow(2).sum() for g in gs))))
        for t, g in zip(total, gs):
            t += c * g
    return total


def _hooked_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    handle = model[2].weight.register_hook(lambda g: g * 3)
    return model, handle


def _grad_hooks_worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    ddp = None
    try:
        torch.set_num_threads(1)
        x, y = _data()
        want = _clipped_sum(_hooked_model()[0], x, y)
        loss = nn.CrossEntropyLoss(reduction="sum")
        model, handle = _hooked_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        mine = slice(rank * 4, (rank + 1) * 4)
        tv.accumulate_clipped_grads(ddp, loss, x[mine], y[mine], max_norm=MAX_NORM)
        # the hook tripled each example's gradient, then tripled the clipped sum once more
        for (name, p), w in zip(model.named_parameters(), want):
            torch.testing.assert_close(p.grad, w / world, rtol=1e-10, atol=1e-12,
                                       msg=f"rank {rank}: {name}")
        # the same as without DDP, on the whole batch
        alone, _ = _hooked_model()
        tv.accumulate_clipped_grads(alone, loss, x, y, max_norm=MAX_NORM)
        for p, q in zip(model.parameters(), alone.parameters()):
            torch.testing.assert_close(p.grad, q.grad / world, rtol=1e-10, atol=1e-12)
        # the hook is still the model's: it acts in an ordinary step, and its handle
        # removes it
        for p in model.parameters():
            p.grad = None
        loss(ddp(x[mine]), y[mine]).backward()
        hooked = model[2].weight.grad.clone()
        handle.remove()
        model[2].weight.grad = None
        loss(ddp(x[mine]), y[mine]).backward()
        torch.testing.assert_close(hooked, 3 * model[2].weight.grad, rtol=1e-12, atol=1e-14)
        dist.barrier()
    finally:
        ddp = None
        gc.collect()  # (the wrapper holds the group: gone before it is destroyed)
        dist.destroy_process_group()


def test_ddp_clipped_step_applies_a_parameter_gradient_hook_once(spawn_within):
    # the per-example gradients go through a parameter's hook (Tensor.register_hook); the
    # pass that adds the clipped sums through DDP's backward ran it again on the sum, so
    # .grad was 3 times the unwrapped model's, silently
    spawn_within(_grad_hooks_worker, 2, 120, forkserver=True)


def _plain_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)


def _static_graph_worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    first = after = None
    try:
        torch.set_num_threads(1)
        x, y = _data()
        loss = nn.CrossEntropyLoss(reduction="sum")
        mine = slice(rank * 4, (rank + 1) * 4)
        sub = ["module.2.weight", "module.2.bias"]
        ref = _plain_model()
        tv.accumulate_clipped_grads(ref, loss, x, y, max_norm=MAX_NORM,
                                    params=["2.weight", "2.bias"])
        full = _plain_model()
        tv.accumulate_clipped_grads(full, loss, x, y, max_norm=MAX_NORM)

        def check(model, want, what):
            for (name, p), q in zip(model.named_parameters(), want.parameters()):
                if q.grad is None:
                    assert p.grad is None, f"rank {rank}, {what}: {name} got a gradient"
                else:
                    torch.testing.assert_close(p.grad, q.grad / world, rtol=1e-10,
                                               atol=1e-12, msg=f"rank {rank}, {what}: {name}")

        # the clipped step is DDP's first step: its selection is that of every step (it was
        # refused, as if DDP had to find unused parameters)
        first = nn.parallel.DistributedDataParallel(_plain_model(), static_graph=True)
        for step in range(2):
            for p in first.parameters():
                p.grad = None
            tv.accumulate_clipped_grads(first, loss, x[mine], y[mine], max_norm=MAX_NORM,
                                        params=sub)
            check(first.module, ref, f"first step a subset, step {step}")
        # an ordinary step first, every parameter: a subset after it left .grad each rank's
        # own unreduced sums, silently (find_unused_parameters=True did not help)
        for find_unused in (True, False):
            after = nn.parallel.DistributedDataParallel(
                _plain_model(), static_graph=True, find_unused_parameters=find_unused)
            loss(after(x[mine]), y[mine]).backward()
            for p in after.parameters():
                p.grad = None
            with pytest.raises(tv.PerSampleValueError, match=(
                    r"(?s)^torch_vjp\.accumulate_clipped_grads: DDP was built with "
                    r"static_graph=True, so its first step fixed the parameters.*params "
                    r"leaves out 2 of them \(first: '0\.weight'\).*each rank's own sums in "
                    r"\.grad.*Fix: select the parameters of the first step in every step "
                    r"\(params=None.*without static_graph=True and with "
                    r"find_unused_parameters=True")):
                tv.accumulate_clipped_grads(after, loss, x[mine], y[mine], max_norm=MAX_NORM,
                                            params=sub)
            assert all(p.grad is None for p in after.parameters()), f"rank {rank}: .grad"
            # every parameter, as in the first step: the clipped sum, reduced
            tv.accumulate_clipped_grads(after, loss, x[mine], y[mine], max_norm=MAX_NORM)
            check(after.module, full, f"after an ordinary step, {find_unused}")
        dist.barrier()
    finally:
        first = after = None
        gc.collect()  # (the wrappers hold the group: gone before it is destroyed)
        dist.destroy_process_group()


def test_ddp_static_graph_clipped_step_selects_the_first_steps_parameters(spawn_within):
    spawn_within(_static_graph_worker, 2, 150, forkserver=True)


class _WithHead(nn.Module):
    """A model with a head its forward never uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.body(x)


def _static_unused_worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    ddp = None
    try:
        torch.set_num_threads(1)
        x, y = _data()
        loss = nn.CrossEntropyLoss(reduction="sum")
        mine = slice(rank * 4, (rank + 1) * 4)
        want = _clipped_sum(_WithHead().to(DT).body, x, y)
        ddp = nn.parallel.DistributedDataParallel(_WithHead().to(DT), static_graph=True)
        loss(ddp(x[mine]), y[mine]).backward()  # (an ordinary first step: head unused)
        for p in ddp.parameters():
            p.grad = None
        # every trainable parameter, the head too: DDP's own error said only that "the
        # training graph has changed", after its backward had run
        with pytest.raises(tv.PerSampleValueError, match=(
                r"(?s)^torch_vjp\.accumulate_clipped_grads: DDP was built with "
                r"static_graph=True, and its first step, an ordinary one, never used 2 "
                r"trainable parameter\(s\) of the module \(first: 'head\.weight'\), so its "
                r"reducer takes them to get no gradient in any step.*Fix: select only the "
                r"parameters the forward uses.*requires_grad=False.*without "
                r"static_graph=True")):
            tv.accumulate_clipped_grads(ddp, loss, x[mine], y[mine], max_norm=MAX_NORM)
        assert all(p.grad is None for p in ddp.parameters()), f"rank {rank}: .grad"
        # the parameters the forward uses: the clipped sum, reduced, and the head untouched
        used = [n for n, _ in ddp.named_parameters() if ".head." not in n]
        tv.accumulate_clipped_grads(ddp, loss, x[mine], y[mine], max_norm=MAX_NORM,
                                    params=used)
        for p, q in zip(ddp.module.body.parameters(), want):
            torch.testing.assert_close(p.grad, q / world, rtol=1e-10, atol=1e-12)
        assert ddp.module.head.weight.grad is None
        loss(ddp(x[mine]), y[mine]).backward()  # (DDP's next ordinary step still runs)
        dist.barrier()
    finally:
        ddp = None
        gc.collect()  # (the wrapper holds the group: gone before it is destroyed)
        dist.destroy_process_group()


def test_ddp_static_graph_clipped_step_names_a_parameter_the_forward_never_uses(
        spawn_within):
    spawn_within(_static_unused_worker, 2, 150, forkserver=True)
