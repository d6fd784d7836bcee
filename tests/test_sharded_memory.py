"""max_memory with a process group bounds each rank's peak as it bounds one process's.
Under strategy='fwd', where f closes over a tensor that requires grad, the products record
graphs that keep every intermediate tangent until their chunk is stored: one process sizes
its chunks by the elements of those intermediate results (``recorded_elements`` in
``torch_vjp._engine.shapes``), the ranks had sized theirs by a flag only, and peaked at 8.7
times the budget where one process kept to 0.72 of it. And the checksums every rank takes
of f's weights before any product (the ranks must hold the same ones) held a dozen float64
temporaries of a whole 256 x 256 weight at once: 11.7 times a max_memory that one process,
and the products, kept to. float64, against one process and
``torch.func.jacrev``; the peak is the live tensor bytes each rank creates
(``torch_vjp._measure.measure_peak``). Two ranks, gloo on CPU, one spawned group; a rank
left waiting fails the test at its deadline."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv
from torch_vjp._measure import measure_peak

from _references import alike, in_gloo_group

D = torch.float64
CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _forward_records(rank, world, group):
    """f closes over a weight of 64 elements that requires grad, its intermediate results
    64 times the input's size: every rank's peak within max_memory, gathered and in shards,
    and the Jacobian one process's."""
    w = torch.linspace(-1, 1, 64, dtype=D).requires_grad_(True)

    def f(x):
        h = torch.tanh(x[:, None] * w)
        return (torch.tanh(h * w + 1) * w).sum(-1)

    n = 64
    x = torch.linspace(-0.5, 0.7, n, dtype=D)
    budget = n * n * 8 + 700_000  # (several chunks of products)
    one = measure_peak(lambda: tv.jacobian(f, x, strategy="fwd", max_memory=budget), CPU)
    assert one <= budget, (one, budget)
    for shard in (False, True):
        peak = measure_peak(lambda: tv.jacobian(f, x, strategy="fwd", max_memory=budget,
                                                process_group=group, shard=shard), CPU)
        assert peak <= budget, (rank, shard, peak / budget)
    got = tv.jacobian(f, x, strategy="fwd", max_memory=budget, process_group=group)
    want = torch.func.jacrev(f)(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    alike(got, group, world)


def _checked_weights(rank, world, group):
    """An MLP 128 -> 256 -> 256 -> 128 whose parameters require grad, under 'fwd' and
    'rev': every rank's peak within max_memory, the opening check of its weights included,
    and the Jacobian one process's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
        torch.nn.Tanh(), torch.nn.Linear(256, 128)).double()
    x = torch.linspace(-1, 1, 128, dtype=D)
    budget = 128 * 128 * 8 + 300_000
    want = torch.func.jacrev(model)(x)
    for strategy in ("fwd", "rev"):
        assert measure_peak(lambda: tv.jacobian(model, x, strategy=strategy,
                                                max_memory=budget), CPU) <= budget
        for shard in (False, True):
            peak = measure_peak(lambda: tv.jacobian(model, x, strategy=strategy,
                                                    max_memory=budget, process_group=group,
                                                    shard=shard), CPU)
            assert peak <= budget, (rank, strategy, shard, peak / budget)
        got = tv.jacobian(model, x, strategy=strategy, max_memory=budget,
                          process_group=group)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _two_ranks(rank, world, init_file):
    in_gloo_group(rank, world, init_file, (_forward_records, _checked_weights))


def test_max_memory_bounds_every_ranks_peak(spawn_within):
    spawn_within(_two_ranks, 2, 240, forkserver=True)
