"""A sharded ``"auto"`` whose route decisions could differ between ranks: at a point its
values check cannot compare at (NOTE [sharded auto at a point it cannot check] in
``torch_vjp._sharded_forward``), whose graph still names the route, as on one process, none
remembered; where one rank's reverse product is not finite and the other's is; where one
rank's f gives the reverse check's test of linearity nothing to differentiate (NOTE [a
reverse product checked forward, on every rank alike] in ``torch_vjp._engine.revcheck``);
in inference mode, where nothing is checked, as on one process; and where one rank
remembers a route the other does not. Every rank calls f as often and
returns the same Jacobian, in float64 equal to reverse rows one at a time where f is alike
on every rank (``torch.cdist``'s batching rule is wrong). Two ranks, gloo on CPU, one
spawned group; a rank left waiting fails the test at its deadline (gloo's 30 s timeout ends
a mis-paired collective sooner)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv
from torch_vjp._engine import fwdcheck

from _references import alike, caught, in_gloo_group, meet, reverse_rows, twice_with

D = torch.float64
INF = float("inf")

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _same(got, want):
    """Equal where ``want`` is finite, and finite in the same entries."""
    assert torch.equal(got.isfinite(), want.isfinite()), (got, want)
    keep = want.isfinite()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-10, atol=1e-10)


_Y = torch.randn(3, 2, dtype=D, generator=torch.Generator().manual_seed(1))


def _keys_of(f):
    return [k for k in fwdcheck.CHECKED if f in repr(k)]


def _point_not_finite(rank, world, group):
    """x holds an infinity in an entry f never reads: the graph of the check's reverse
    product names torch.cdist, every rank computes its rows one at a time, warns that the
    values went unchecked, and remembers nothing (it had returned the rows under vmap, off
    by a relative error near 1, without a word)."""
    calls = [0]

    def cdist_unread_entry(x):
        calls[0] += 1
        meet(group, world)
        return torch.cdist(x[:4].reshape(2, 2), _Y)

    x = torch.randn(5, dtype=D, generator=torch.Generator().manual_seed(0))
    x[-1] = INF
    got, said = caught(lambda: tv.jacobian(cdist_unread_entry, x, process_group=group))
    _same(got, reverse_rows(lambda z: torch.cdist(z[:4].reshape(2, 2), _Y), x))
    assert any("batching rule for the backward of torch.cdist" in w
               and "Here the point x holds a NaN or an infinity" in w for w in said), said
    assert not _keys_of("cdist_unread_entry")
    alike(calls[0], group, world)


def _reverse_product_not_finite(rank, world, group):
    """A captured weight with an infinity: every rank's reverse product holds one; the
    graph names torch.cdist, the warning says why the values went unchecked, and no route
    is remembered, as on one process (a later call at a finite point checks by values)."""
    w = torch.ones(2, 3, dtype=D)
    w[1, 2] = INF
    calls = [0]

    def cdist_inf_weight(x):
        calls[0] += 1
        meet(group, world)
        return torch.cdist(x.reshape(2, 2), _Y) * w

    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(2))
    got, said = caught(lambda: tv.jacobian(cdist_inf_weight, x, process_group=group))
    _same(got, reverse_rows(lambda z: torch.cdist(z.reshape(2, 2), _Y) * w, x))
    assert any("torch.cdist" in m and "Here a reverse product holds a NaN or an infinity" in m
               for m in said), said
    assert not _keys_of("cdist_inf_weight")
    alike(calls[0], group, world)


def _one_rank_not_finite(rank, world, group):
    """Only rank 1's f scales its output by an infinity (a number bound per rank): only
    rank 1's reverse product is not finite. Every rank takes the route of a point it
    cannot check, calls f as often, returns the same Jacobian, and remembers nothing."""
    scale = INF if rank == 1 else 1.0
    calls = [0]

    def cdist_scaled_per_rank(x):
        calls[0] += 1
        meet(group, world)
        return torch.cdist(x.reshape(2, 2), _Y) * scale

    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(3))
    got, said = caught(lambda: tv.jacobian(cdist_scaled_per_rank, x, process_group=group))
    alike(got, group, world)
    assert any("torch.cdist" in m and "the values were not compared" in m for m in said), said
    assert not _keys_of("cdist_scaled_per_rank")
    alike(calls[0], group, world)


def _one_rank_nothing_to_differentiate(rank, world, group):
    """Every rank's backward formula is wrong (3 for 2); rank 1's f returns its output
    detached where the check tests its reverse products' linearity (a call with a graph
    right after the central difference's calls without one): every rank gives the test up
    alike, and returns the same Jacobian, calling f as often (rank 1 stopped alone, and
    the others waited in the test's collectives, or paired them with the next exchange)."""
    wrong = twice_with(lambda ctx, g: g * 3)
    calls, graphless = [0], [False]

    def wrong_twice(x):
        calls[0] += 1
        meet(group, world)
        y = wrong.apply(x[:3] * x[3:]).sin()
        after_difference = graphless[0] and torch.is_grad_enabled() and x.requires_grad
        graphless[0] = not torch.is_grad_enabled()
        return y.detach() if rank == 1 and after_difference else y

    x = torch.tensor([0.31, -0.72, 0.45, 0.93, -0.27, 0.58], dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.jacobian(wrong_twice, x, process_group=group)
    alike(got, group, world)
    alike(calls[0], group, world)


def _in_inference_mode(rank, world, group):
    """In inference mode autograd records no graph: as on one process, nothing is checked
    and nothing remembered, on every rank (the check compared the products with zeros,
    warned that no route agreed, and remembered the route from it)."""
    a = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(5))
    calls = [0]

    def sin_in_inference(x):
        calls[0] += 1
        meet(group, world)
        return (a @ x).sin()

    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        got, said = caught(lambda: tv.jacobian(sin_in_inference, x, process_group=group))
    assert not said, said
    assert not _keys_of("sin_in_inference")
    torch.testing.assert_close(got, torch.func.jacrev(lambda z: (a @ z).sin())(x),
                               rtol=1e-12, atol=1e-12)
    alike(calls[0], group, world)


def _one_rank_remembers(rank, world, group):
    """Rank 1 alone computed a sharded Jacobian of f at a finite point first, in a group of
    its own (and remembers "rev-loop" for it); rank 0 remembers nothing. At a point whose
    reverse product holds an infinity, no route is agreed, and every rank takes the same
    one (rank 1 had returned its rows under vmap while rank 0 computed its rows again one
    at a time, their collectives mis-paired)."""
    w = torch.ones(2, 3, dtype=D)

    def cdist_remembered_on_one(x):
        return torch.cdist(x.reshape(2, 2), _Y) * w

    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(4))
    solo = dist.new_group([1])
    if rank == 1:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tv.jacobian(cdist_remembered_on_one, x, process_group=solo)
        assert [fwdcheck.CHECKED[k] for k in _keys_of("cdist_remembered_on_one")] == [
            "rev-loop"]
    w[1, 2] = INF
    got, _ = caught(lambda: tv.jacobian(cdist_remembered_on_one, x, process_group=group))
    _same(got, reverse_rows(lambda z: torch.cdist(z.reshape(2, 2), _Y) * w, x))
    alike(got, group, world)


def _two_ranks(rank, world, init_file):
    in_gloo_group(rank, world, init_file, (
        _point_not_finite, _reverse_product_not_finite, _one_rank_not_finite,
        _one_rank_nothing_to_differentiate, _in_inference_mode, _one_rank_remembers))


def test_route_decisions_are_taken_alike_on_every_rank(spawn_within):
    spawn_within(_two_ranks, 2, 150, forkserver=True)
