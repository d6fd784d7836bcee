"""Sharded Jacobians whose ``"auto"`` falls back from vmap to a loop on some ranks only
(NOTE [the ranks agree on their fallbacks] in ``torch_vjp._sharded_work``): every rank then
loops (and where the loop fails on some rank in reverse mode, every rank computes with plain
autograd), so an ``f`` that runs a collective itself, in its forward or in its backward, is
called as many times on every rank, and the Jacobian equals the single-process one in
float64. Two ranks, gloo on CPU, one spawned group; a rank left waiting fails the test at
its deadline (and gloo's own timeout ends a mis-paired collective sooner)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv

from _references import OldStyleSquare, in_gloo_group

DT = torch.float64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


class _Twice(torch.autograd.Function):
    """``2 x``, with forward-mode and reverse-mode formulas but no vmap support: torch.vmap
    refuses it, a loop of products runs it."""

    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 2

    @staticmethod
    def jvp(ctx, t):
        return t * 2


class _SummedBackward(torch.autograd.Function):
    """The identity, whose backward runs a collective (one per call of the pullback); on
    ``refuse`` ranks it also reads the cotangent's sum as a number, which torch.vmap
    refuses."""

    @staticmethod
    def forward(x, group, refuse, calls):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.refuse, ctx.calls = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, g):
        ctx.calls[0] += 1
        met = torch.ones(1, dtype=torch.int64)
        dist.all_reduce(met, group=ctx.group)  # (every rank's pullback meets the others')
        assert int(met) == dist.get_world_size(ctx.group)
        if ctx.refuse:
            g = g * (1.0 + 0.0 * float(g.sum()))
        return g, None, None, None


def _forward_mode_checks(rank, world, group):
    """Forward mode (many more outputs than inputs): f runs a collective, and on rank 0
    alone an operator torch.vmap refuses; every rank loops, calling f as often."""
    calls = [0]

    def f(x):
        calls[0] += 1
        y = x.sin()
        dist.all_reduce(y, group=group)  # (equal values: no derivative, hence / world)
        y = y / world
        if rank == 0:
            y = _Twice.apply(y) / 2
        return torch.cat([y, 3 * y] * 40)

    def single(x):
        y = x.sin() / world
        return torch.cat([y, 3 * y] * 40)

    x = torch.linspace(0.1, 0.9, 3, dtype=DT)
    want = torch.func.jacfwd(single)(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = tv.jacobian(f, x, process_group=group)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    said = [str(w.message) for w in caught]
    # (the rank whose vmap failed says so; the other loops without a reason of its own)
    assert any("vmap" in s and "this rank" in s for s in said) == (rank == 0), said
    counts = [None] * world
    dist.all_gather_object(counts, calls[0], group=group)
    assert counts[0] == counts[1], counts

    # the shard alike
    calls[0] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sh = tv.jacobian(f, x, process_group=group, shard=True)
    assert sh.mode == "fwd"
    torch.testing.assert_close(sh.values, want.T[sh.start:sh.stop], rtol=1e-12, atol=0)
    dist.all_gather_object(counts, calls[0], group=group)
    assert counts[0] == counts[1], counts


def _reverse_mode_checks(rank, world, group):
    """Reverse mode: the pullback runs a collective, and on rank 1 alone reads a number
    torch.vmap refuses; every rank loops, calling the pullback as often."""
    calls = [0]

    def f(x):
        return _SummedBackward.apply(x, group, rank == 1, calls).tanh() * 3

    def single(x):
        return x.tanh() * 3

    x = torch.linspace(-0.8, 0.7, 5, dtype=DT)
    want = torch.func.jacrev(single)(x)
    for strategy in ("auto", "rev"):
        calls[0] = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if strategy == "rev" and rank == 1:
                # (a named vectorised strategy has no loop to fall back to: rank 1 raises
                # vmap's error, the other rank names rank 1)
                with pytest.raises(RuntimeError, match=r"vmap.*\.item\(\)"):
                    tv.jacobian(f, x, strategy=strategy, process_group=group)
                continue
            if strategy == "rev":
                with pytest.raises(tv.JacobianCallError, match="rank 1 of the process_group"):
                    tv.jacobian(f, x, strategy=strategy, process_group=group)
                continue
            got = tv.jacobian(f, x, strategy=strategy, process_group=group)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
        counts = [None] * world
        dist.all_gather_object(counts, calls[0], group=group)
        assert counts[0] == counts[1], counts


def _plain_checks(rank, world, group):
    """Reverse mode where torch.func cannot run f at all on rank 1 (an old-style custom
    Function on its path): every rank computes with plain autograd, in "auto" and in
    "rev-loop", f running a collective as many times on every rank."""
    calls = [0]

    def f(x):
        calls[0] += 1
        met = torch.ones(1, dtype=torch.int64)
        dist.all_reduce(met, group=group)  # (every rank's f meets the others')
        assert int(met) == world
        y = OldStyleSquare.apply(x) if rank == 1 else x * x
        return y.tanh()

    x = torch.linspace(-0.8, 0.7, 5, dtype=DT)
    want = torch.func.jacrev(lambda x: (x * x).tanh())(x)
    for strategy in ("auto", "rev-loop"):
        calls[0] = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = tv.jacobian(f, x, strategy=strategy, process_group=group)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
        if strategy == "auto":
            said = [str(w.message) for w in caught]
            assert any("plain autograd" in s for s in said) == (rank == 1), said
        counts = [None] * world
        dist.all_gather_object(counts, calls[0], group=group)
        assert counts[0] == counts[1], (strategy, counts)


def _two_ranks(rank, world, init_file):
    in_gloo_group(rank, world, init_file, (_forward_mode_checks, _reverse_mode_checks, _plain_checks))


def test_a_fallback_to_a_loop_on_one_rank_is_taken_on_every_rank(spawn_within):
    spawn_within(_two_ranks, 2, 240, forkserver=True)
