"""A sharded Jacobian under a named ``"rev"`` through an operator whose batching rule torch
has wrong (``torch.cdist``'s backward under ``torch.vmap``: NOTE [named reverse strategies
and wrong formulas] in ``torch_vjp._engine.wrongops``): every rank computes its rows again,
one reverse product at a time, with one process's warning, also where only one rank's f
runs the operator. It had returned a Jacobian wrong by 1.48 on every rank without a word.
With ``chunk_size=1`` (no vmap) and through no such operator, nothing is said and the
Jacobian is right. float64, against ``torch.autograd.functional.jacobian``. Two ranks, gloo
on CPU, one spawned group; a rank left waiting fails the test at its deadline."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv

from _references import alike, in_gloo_group, meet

D = torch.float64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _unnamed(msg):
    """``msg`` without the name of f."""
    return re.sub(r"in f \(.*?\) is wrong", "in f is wrong", msg)


def _recorded(call):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = call()
    return res, [str(w.message) for w in seen if issubclass(w.category, tv.JacobianWarning)]


def _batched_wrongly(rank, world, group):
    """A named "rev" through cdist is right on every rank, and warns once per function with
    one process's words; where only rank 1's f runs cdist too (rank 0 computes the same
    distances by hand). f is called as often on every rank."""
    y = torch.randn(3, 2, dtype=D, generator=torch.Generator().manual_seed(1))
    x = torch.randn(4, 2, dtype=D, generator=torch.Generator().manual_seed(2))
    calls = [0]

    def f(a):
        return torch.cdist(a, y)

    def by_hand(a):
        return ((a[:, None] - y[None]) ** 2).sum(-1).sqrt()

    def one_rank_cdist(a):
        calls[0] += 1
        meet(group, world)
        return (f if rank == 1 else by_hand)(a)

    want = torch.autograd.functional.jacobian(f, x)
    torch.testing.assert_close(torch.autograd.functional.jacobian(by_hand, x), want,
                               rtol=1e-12, atol=1e-12)
    # (the premise: cdist's rows under vmap are wrong)
    assert (torch.func.jacrev(f)(x) - want).abs().max() > 0.5
    _, one = _recorded(lambda: tv.jacobian(lambda a: f(a), x, strategy="rev"))
    assert len(one) == 1, one
    for fn in (f, one_rank_cdist):
        for time in range(2):
            got, said = _recorded(lambda: tv.jacobian(fn, x, strategy="rev",
                                                       process_group=group))
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            assert len(said) == (1 if time == 0 else 0), said
            if said:
                assert said[0].startswith(
                    "torch_vjp.jacobian: strategy='rev' computes its rows under torch.vmap, "
                    "whose batching rule for the backward of torch.cdist"), said[0]
                assert _unnamed(said[0]) == _unnamed(one[0]), said[0]
                assert f"in f ({fn.__qualname__}) is wrong" in said[0], said[0]
                assert "Pass strategy='rev-loop' (or chunk_size=1)" in said[0], said[0]
    alike(calls[0], group, world)
    # (chunk_size=1: no vmap, nothing said)
    got, said = _recorded(lambda: tv.jacobian(lambda a: f(a), x, strategy="rev",
                                              chunk_size=1, process_group=group))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert said == [], said


def _valid(rank, world, group):
    """Through no such operator, a named "rev" is right and says nothing."""
    y = torch.randn(3, 2, dtype=D, generator=torch.Generator().manual_seed(1))
    x = torch.randn(4, 2, dtype=D, generator=torch.Generator().manual_seed(2))

    def g(a):
        return ((a[:, None] - y[None]) ** 2).sum(-1).sqrt()

    got, said = _recorded(lambda: tv.jacobian(g, x, strategy="rev", process_group=group))
    torch.testing.assert_close(got, torch.autograd.functional.jacobian(g, x), rtol=1e-12,
                               atol=1e-12)
    assert said == [], said


def _two_ranks(rank, world, init_file):
    in_gloo_group(rank, world, init_file, (_batched_wrongly, _valid))


def test_a_wrong_batching_rule_computes_named_rev_one_product_at_a_time(spawn_within):
    spawn_within(_two_ranks, 2, 240, forkserver=True)
