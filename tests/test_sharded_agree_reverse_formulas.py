"""A sharded Jacobian under a named reverse strategy through an operator whose backward
formula torch has wrong alone (``F.max_unpool2d`` with a repeated index: NOTE [named reverse
strategies and wrong formulas] in ``torch_vjp._engine.wrongops``): ``"rev"`` and
``"rev-loop"`` refuse on every rank, with one process's words, also where only one rank's f
runs the operator, where plain autograd computes (torch.func cannot run f), and again on a
later call (nothing is remembered for a named reverse strategy: each call reads its own
graph). It had returned a Jacobian wrong by 1.0 on
every rank without a word. A named ``"rev"`` through no such operator costs one small
``all_reduce`` more, and its Jacobian equals torch.func.jacrev's.
float64. Two ranks, gloo on CPU, one spawned group; a rank left waiting fails the test at
its deadline."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_vjp as tv

from _references import OldStyleSquare, alike, in_gloo_group, meet

D = torch.float64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _unpool_case():
    """``(idx, v, size)``: max_pool2d's indices with one repeated, the pooled values."""
    x = torch.randn(2, 2, 4, 4, dtype=D, generator=torch.Generator().manual_seed(2))
    v, idx = F.max_pool2d(x, 2, return_indices=True)
    idx = idx.clone()
    idx.view(-1)[1] = idx.view(-1)[0]  # (two inputs of plane 0 to one output element)
    return idx, v, x.shape[-2:]


def _refused(call, strategy):
    with pytest.raises(tv.StrategyError) as info:
        call()
    msg = str(info.value)
    assert msg.startswith(f"torch_vjp.jacobian: strategy={strategy!r} computes with "
                          f"reverse-mode AD, and torch's backward formula of "
                          f"torch.nn.functional.max_unpool2d"), msg
    assert "is wrong for its input where indices repeat in a plane" in msg, msg
    assert "so the Jacobian would be wrong" in msg, msg
    assert "Fix: strategy='fwd' (forward mode, whose formula is right)" in msg, msg
    return msg


def _unnamed(msg):
    """``msg`` without the name of f."""
    return re.sub(r"which f \(.*?\) computes", "which f computes", msg)


def _named_reverse_refuses(rank, world, group):
    """Every rank refuses, twice each: where every rank's f runs the operator, and where
    only rank 1's does (rank 0 writes the same values by index_put, whose backward is
    right); the words are one process's. f is called as often on every rank."""
    idx, v, size = _unpool_case()
    calls = [0]

    def f(a):
        return F.max_unpool2d(a, idx, 2, output_size=size)

    def by_hand(a):  # (f's values: the last write wins, as max_unpool2d's)
        out = a.new_zeros(*a.shape[:2], size[0] * size[1])
        flat_idx, flat_a = idx.flatten(2), a.flatten(2)
        for j in range(flat_idx.shape[-1]):
            out = out.index_put((torch.arange(2)[:, None], torch.arange(2)[None, :],
                                 flat_idx[..., j]), flat_a[..., j])
        return out.reshape(*a.shape[:2], *size)

    def one_rank_unpools(a):
        calls[0] += 1
        meet(group, world)
        return (f if rank == 1 else by_hand)(a)

    torch.testing.assert_close(by_hand(v), f(v))
    for strategy in ("rev", "rev-loop"):
        with pytest.raises(tv.StrategyError) as one:
            tv.jacobian(f, v, strategy=strategy)
        for fn in (f, one_rank_unpools):
            for _ in range(2):
                msg = _refused(lambda: tv.jacobian(fn, v, strategy=strategy,
                                                   process_group=group), strategy)
                assert _unnamed(msg) == _unnamed(str(one.value)), msg
                assert f"which f ({fn.__qualname__}) computes" in msg, msg
    # (rev-loop where torch.func cannot run f: plain autograd's call of f is read too)
    for fn in (lambda a: f(OldStyleSquare.apply(a)),
               lambda a: one_rank_unpools(OldStyleSquare.apply(a))):
        for _ in range(2):
            msg = _refused(lambda: tv.jacobian(fn, v, strategy="rev-loop",
                                               process_group=group), "rev-loop")
            assert _unnamed(msg) == _unnamed(str(one.value)), msg
    alike(calls[0], group, world)
    # (the premise: reverse mode's Jacobian is wrong by 1.0, forward mode's right)
    rev, fwd = torch.func.jacrev(f)(v), torch.func.jacfwd(f)(v)
    assert (rev - fwd).abs().max() == 1.0
    # (the fix the words name is right, on every rank)
    J = tv.jacobian(f, v, strategy="fwd", process_group=group)
    torch.testing.assert_close(J, torch.func.jacfwd(f)(v), rtol=1e-12, atol=1e-12)


def _collectives(call):
    """``call()``'s result and the collectives it ran, ``(name, elements)`` each (0 elements
    for an object's)."""
    seen, kept = [], {}
    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast",
                 "broadcast_object_list", "all_to_all", "barrier"):
        kept[name] = fn = getattr(dist, name)

        def counted(*args, _name=name, _fn=fn, **kwargs):
            first = args[0] if args else None
            seen.append((_name, first.numel() if isinstance(first, torch.Tensor) else 0))
            return _fn(*args, **kwargs)

        setattr(dist, name, counted)
    try:
        res = call()
    finally:
        for name, fn in kept.items():
            setattr(dist, name, fn)
    return res, seen


#: The collectives of a named reverse call of :func:`_valid_named_reverse`'s f before its
#: refusals were agreed: the opening exchange, the chunks' plan, the status, the gather.
_BEFORE = [("all_gather_object", 0), ("all_reduce", 1), ("all_reduce", 4),
           ("all_reduce", 4), ("all_reduce", 1), ("all_gather", 0), ("all_reduce", 1)]


def _valid_named_reverse(rank, world, group):
    """Without the operator (max_pool's own indices), a named "rev" or "rev-loop" computes
    torch.func.jacrev's Jacobian, with one all_reduce of one element more than the
    collectives it ran before."""
    x = torch.randn(2, 2, 4, 4, dtype=D, generator=torch.Generator().manual_seed(2))
    v, idx = F.max_pool2d(x, 2, return_indices=True)

    def f(a):
        return F.max_unpool2d(a, idx, 2, output_size=x.shape[-2:]).sin()

    want = torch.func.jacrev(f)(v)
    for strategy in ("rev", "rev-loop"):
        for _ in range(2):
            got, seen = _collectives(lambda: tv.jacobian(f, v, strategy=strategy,
                                                          process_group=group))
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            alike(seen, group, world)
            more = list(seen)
            for one in _BEFORE:
                more.remove(one)
            assert more == [("all_reduce", 1)], seen


def _two_ranks(rank, world, init_file):
    in_gloo_group(rank, world, init_file, (_named_reverse_refuses, _valid_named_reverse))


def test_a_wrong_backward_refuses_named_reverse_on_every_rank(spawn_within):
    spawn_within(_two_ranks, 2, 240, forkserver=True)
