"""A sharded ``"auto"`` through an operator torch differentiates wrongly (NOTE [sharded auto
reads the graph for known wrong operators] in ``torch_vjp._sharded_forward``): at a first point
where the values agree by chance, the check reads the graph, as on one process, and every
rank takes the route named for the operator, also where only one rank's graph holds it; a
later call at another point is right, and so is one whose graph took the operator after its
route was remembered. float64, against forward-mode columns (for
``torch.as_strided_scatter``, whose backward is wrong) or reverse rows one at a time (for
``torch.cdist``, whose batching rule is wrong). Two ranks, gloo on CPU, one spawned group; a
rank left waiting fails the test at its deadline."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv

from _references import caught, in_gloo_group, jvp_columns, meet

D = torch.float64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _reverse_rows(f, x):
    xx = x.clone().requires_grad_(True)
    out = f(xx).reshape(-1)
    rows = [torch.autograd.grad(out[i], xx, retain_graph=True)[0] for i in range(out.numel())]
    return torch.stack(rows).reshape(*f(x).shape, *x.shape)


def _scatter_checks(rank, world, group):
    """torch.as_strided_scatter's backward is wrong; at zeros the values agree."""
    s = torch.tensor(0.7, dtype=D)

    def f(x):
        return torch.as_strided_scatter(x * x, s * x[:2], (2,), (1,), 0).sin()

    zero = torch.zeros(4, dtype=D)
    first, said = caught(lambda: tv.jacobian(f, zero, process_group=group))
    assert any("backward formula of it is wrong" in w for w in said), said
    torch.testing.assert_close(first, jvp_columns(f, zero), rtol=1e-12, atol=1e-12)
    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))
    got = tv.jacobian(f, x, process_group=group)
    torch.testing.assert_close(got, jvp_columns(f, x), rtol=1e-10, atol=1e-10)


def _cdist_on_one_rank_checks(rank, world, group):
    """Only rank 1's f goes through torch.cdist (rank 0's computes the same distances
    itself), times a factor that is 0 at the first point: every rank computes its rows one
    at a time, calling f and its backward as often."""
    gen = torch.Generator().manual_seed(3)
    y = torch.randn(5, 3, dtype=D, generator=gen)
    calls = [0]

    def dists(a):
        if rank == 1:
            return torch.cdist(a, y)
        return ((a[:, None, :] - y[None]) ** 2).sum(-1).sqrt()

    def g(x):
        calls[0] += 1
        meet(group, world)
        return dists(x.reshape(4, 3)) * x.sum()

    def single(x):
        return ((x.reshape(4, 3)[:, None, :] - y[None]) ** 2).sum(-1).sqrt() * x.sum()

    x0 = torch.randn(12, dtype=D, generator=gen)
    x0 = x0 - x0.mean()
    first, said = caught(lambda: tv.jacobian(g, x0, process_group=group))
    assert any("batching rule for the backward of torch.cdist" in w for w in said), said
    torch.testing.assert_close(first, _reverse_rows(single, x0), rtol=1e-10, atol=1e-10)
    x = torch.randn(12, dtype=D, generator=gen)
    calls[0] = 0
    got = tv.jacobian(g, x, process_group=group)
    torch.testing.assert_close(got, _reverse_rows(single, x), rtol=1e-10, atol=1e-10)
    counts = [None] * world
    dist.all_gather_object(counts, calls[0], group=group)
    assert counts[0] == counts[1], counts


def _stale_route_checks(rank, world, group):
    """A route remembered before f's graph took torch.cdist, on rank 1 only (a flag f
    reads): every rank forgets it and checks the call again, computing its rows one at a
    time (NOTE [a remembered route through a known wrong operator])."""
    gen = torch.Generator().manual_seed(6)
    y = torch.randn(5, 3, dtype=D, generator=gen)
    W = torch.randn(20, 12, dtype=D, generator=gen)
    flags = {"cdist": False}
    calls = [0]

    def g(x):
        calls[0] += 1
        meet(group, world)
        if not flags["cdist"]:
            return W @ x
        a = x.reshape(4, 3)
        d = (torch.cdist(a, y) if rank == 1
             else ((a[:, None, :] - y[None]) ** 2).sum(-1).sqrt())
        return (d * x.sum()).reshape(-1)

    def single(x):
        a = x.reshape(4, 3)
        return (((a[:, None, :] - y[None]) ** 2).sum(-1).sqrt() * x.sum()).reshape(-1)

    x = torch.randn(12, dtype=D, generator=gen)
    torch.testing.assert_close(tv.jacobian(g, x, process_group=group), W)
    flags["cdist"] = True
    for _ in range(2):
        calls[0] = 0
        got, _ = caught(lambda: tv.jacobian(g, x, process_group=group))
        torch.testing.assert_close(got, _reverse_rows(single, x), rtol=1e-10, atol=1e-10)
        counts = [None] * world
        dist.all_gather_object(counts, calls[0], group=group)
        assert counts[0] == counts[1], counts


def _two_ranks(rank, world, init_file):
    in_gloo_group(rank, world, init_file, (_scatter_checks, _cdist_on_one_rank_checks,
                                           _stale_route_checks))


def test_a_known_wrong_operator_sets_the_route_on_every_rank(spawn_within):
    spawn_within(_two_ranks, 2, 180, forkserver=True)
