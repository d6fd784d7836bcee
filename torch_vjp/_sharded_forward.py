"""The reverse product of a sharded ``"auto"``'s check, checked against one forward product
on every rank (NOTE [a sharded reverse product checked forward]), and the graph of its call
of f read for the operators torch differentiates wrongly (NOTE [sharded auto reads the graph
for known wrong operators]).

NOTE [a sharded reverse product checked forward]
A sharded ``"auto"`` checks each rank's products against one reverse product (NOTE [sharded
auto, checked] in ``torch_vjp._sharded_check``). Where torch's backward formula is itself
wrong (torch 2.13's ``torch.as_strided_scatter``: NOTE [a reverse product checked forward]
in ``torch_vjp._engine.revcheck``), reverse mode under vmap agrees with it, and every rank
returned a wrong Jacobian without a word (and where forward mode was checked, its right
columns were replaced by the wrong rows). So, as on one process, where the route is a
reverse one, or forward mode's disagreed, every rank takes one reverse product with the
whole cotangent ``u`` (not its rank's share: every rank then holds the same ``u``, the same
``x`` and the same ``f``, checked before any product, so every rank computes the same
comparison and calls ``f`` as many times, which an ``f`` running a collective needs) and
compares ``u^T J v`` with one forward product (``reverse_wrong``). Each step of that check
that decides whether f is called again is agreed between the ranks (one ``all_reduce`` each:
NOTE [a reverse product checked forward, on every rank alike] in
``torch_vjp._engine.revcheck``), so the ranks call f as many times, and reach one verdict
(a rank whose own graph held a wrong backward formula, a path of f taken on that rank only,
called f four times more than the others, and an f that ran a collective waited for ever).
The reverse product is wrong where some rank found its own wrong (that rank's
rows by reverse mode would be wrong in the gathered Jacobian), and every rank takes the
numbers of the first rank that did (one ``all_gather_object``), for the comparison that
follows and the warning's words; where some rank's check raised an error no check may hide,
every rank raises (that rank its own error, the others one naming it). Then forward mode's
products (the ones computed, where forward mode was the route; else forward mode's,
computed now on every rank) are compared with the forward
product: each rank's columns ``[start, stop)`` give its part of ``u^T J v``, an
``all_reduce`` (SUM) adds them, and every rank compares the sum, and one more ``all_reduce``
(MAX) of the disagreement keeps the verdict common. Where they agree, every rank returns
forward mode's products, remembers ``"fwd"`` for the key, and warns once; else the check
goes on as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from torch_vjp._engine.autoknown import known_wrong_route, unchecked_route
from torch_vjp._engine.fwdcheck import (
    all_finite,
    least_precise,
    one_reverse_product,
    remember,
    tolerance,
)
from torch_vjp._engine.fwdnoise import reverse_noise, rounding_scale
from torch_vjp._engine.fwdwords import wrong_reverse_message
from torch_vjp._engine.jacobian import function_key, function_name
from torch_vjp._engine.nearcheck import wrong_batching_message
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.revcheck import Agree, ReverseWrong, reverse_wrong
from torch_vjp._errors import JacobianWarning, warn_once

__all__ = ["agreeing", "forward_instead", "gathered_ops", "known_route"]


def agreeing(group: Any, device: torch.device, fail: Callable[[BaseException | None], None]
           ) -> Agree:
    """``reverse_wrong``'s ``agree`` hook for ``group`` (NOTE [a reverse product checked
    forward, on every rank alike] in ``torch_vjp._engine.revcheck``): one ``all_reduce``
    (MAX) of the flag and of whether this rank's step raised; ``fail(err)`` raises on every
    rank where some rank's did."""
    import torch.distributed as dist

    def agree(flag: bool, err: BaseException | None = None) -> bool:
        t = torch.tensor([int(bool(flag)), int(err is not None)], dtype=torch.int64,
                         device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        some, failed = t.tolist()
        if failed:
            fail(err)
        return bool(some)

    return agree


def _found(prob: Problem, redraw: Callable[[], None], agree: Agree
           ) -> tuple[ReverseWrong, list[Tensor], float] | None:
    """``(wrong, u, rtol)`` on every rank where some rank's reverse product of the whole
    ``u`` is wrong (``reverse_wrong``, every step agreed), else None on every rank."""
    got, stop = None, None
    try:
        redraw()
        got = one_reverse_product(prob)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it before raising
        stop = exc
    if agree(got is None or not all_finite(got[2]), stop):  # (checked only where every
        return None  # rank holds its reverse product)
    assert got is not None
    dtype = least_precise(got[0], prob.leaves)
    rtol = tolerance(dtype)
    floor: list[float] = []

    def noise() -> float:  # NOTE [the scale of what is compared]
        if not floor:
            floor.append(rounding_scale(reverse_noise(prob, agree), dtype))
        return floor[0]

    wrong = reverse_wrong(prob, got, redraw, rtol, noise, agree)
    return None if wrong is None else (wrong, got[1], rtol)


def _finder(found: tuple[ReverseWrong, list[Tensor], float], group: Any
            ) -> tuple[ReverseWrong, list[Tensor], float]:
    """``found`` with the numbers of the first rank whose own check found the reverse
    product wrong (``ReverseWrong.mine``): every rank compares forward mode's products, and
    warns, alike. (``vs`` and ``u`` are drawn from generators of their own, alike on every
    rank.)"""
    import torch.distributed as dist

    wrong, us, rtol = found
    mine = (wrong.mine, wrong.forward, wrong.reverse, wrong.difference, wrong.scale,
            wrong.op, wrong.near, wrong.batching, rtol)
    said: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, mine, group=group)
    first = next(s for s in said if s[0])
    (_, wrong.forward, wrong.reverse, wrong.difference, wrong.scale, wrong.op, wrong.near,
     wrong.batching, rtol) = first
    return wrong, us, rtol


def _partial(stacked: Sequence[Tensor], us: Sequence[Tensor], vs: Sequence[Tensor],
             start: int, stop: int, batch: int | None) -> tuple[float, float]:
    """``(u^T J[:, start:stop] v[start:stop], the sum of its terms' magnitudes)`` from this
    rank's forward-mode products ``stacked`` (columns ``[start, stop)``); ``(inf, 0)`` where
    they are not one per output."""
    if len(stacked) != len(us):
        return math.inf, 0.0
    k = stop - start
    if k == 0:
        return 0.0, 0.0
    with torch.no_grad():
        if batch is None:
            v = torch.cat([x.detach().double().reshape(-1).cpu() for x in vs])[start:stop]
        else:
            v = torch.cat([x.detach().double().reshape(batch, -1).cpu() for x in vs],
                          1)[:, start:stop].T  # (k, B)
        value = size = 0.0
        for t, u in zip(stacked, us):
            t = t.detach().double().cpu()
            u = u.detach().double().cpu()
            if batch is None:
                tu, ta = t.reshape(k, -1) @ u.reshape(-1), t.reshape(k, -1).abs() @ u.reshape(
                    -1).abs()
            else:
                tu = (t.reshape(k, batch, -1) * u.reshape(1, batch, -1)).sum(-1)
                ta = (t.reshape(k, batch, -1).abs() * u.reshape(1, batch, -1).abs()).sum(-1)
            value += float((tu * v).sum())
            size += float((ta * v.abs()).sum())
    return value, size


def _agrees(part: tuple[Any, ...] | None, found: tuple[ReverseWrong, list[Tensor], float],
            batch: int | None, group: Any, device: torch.device) -> bool:
    """Whether every rank's forward-mode products ``part`` give, summed over the ranks, the
    forward product's ``u^T J v`` (the same verdict on every rank)."""
    import torch.distributed as dist

    wrong, us, rtol = found
    value, size = (math.inf, 0.0) if part is None else _partial(
        part[0], us, wrong.vs, part[4], part[5], batch)
    if not math.isfinite(value):
        value = math.inf  # (a NaN: a disagreement on every rank, after the sum)
    t = torch.tensor([value, size], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    total, size = t.tolist()
    ok = math.isfinite(total) and abs(total - wrong.forward) <= rtol * max(size, wrong.scale)
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return not int(flag.item())


def forward_instead(
    prob: Problem, part: tuple[Any, ...], mode: str, batch: int | None, key: Hashable,
    group: Any, device: torch.device, redraw: Callable[[], None],
    forward: Callable[[], tuple[tuple[Any, ...] | None, bool]],
    fail: Callable[[BaseException | None], None],
    loop: Callable[[], tuple[Any, ...] | None],
) -> tuple[tuple[Any, ...], str] | None:
    """``(products, mode)``: forward mode's on every rank where some rank's reverse product
    is wrong and they agree with the forward product (NOTE [a sharded reverse product
    checked forward]): ``part`` where ``mode`` is ``"fwd"``, else ``forward()``'s (this
    rank's products, or None where some rank could not compute them; and whether this rank
    ran a loop); or, where only the reverse products under vmap are wrong (near x:
    ``ReverseWrong.batching``) and ``mode`` is ``"rev"``, ``loop()``'s (the rows one reverse
    product at a time, None where some rank could not compute them), with the one-process
    warning; None where the check goes on as before. ``redraw`` puts the generators where
    the products started; ``fail(err)`` raises on every rank where some rank's check
    raised."""
    # (every step agreed: None on every rank, or a ReverseWrong on every rank; an error no
    # check may hide raised on every rank)
    found = _found(prob, redraw, agreeing(group, device, fail))
    if found is None:
        return None
    found = _finder(found, group)
    wrong = found[0]
    if wrong.batching is not None:  # (NOTE [auto, checked near the point]: the rows under
        # vmap are wrong, the reverse product without it right, as the forward product is)
        alt = loop() if mode == "rev" else None
        if alt is None:
            return None
        remember(key, "rev-loop")
        warn_once((prob.call, function_key(prob.f), mode, "batched wrongly near x"),
                  wrong_batching_message(prob.call, function_name(prob.f), *wrong.batching),
                  JacobianWarning)
        return alt, "rev"
    if mode == "fwd":
        if _agrees(part, found, batch, group, device):
            remember(key, "fwd")
            return part, "fwd"
        return None
    redraw()
    alt, looped = forward()
    if not _agrees(alt, found, batch, group, device):
        return None
    remember(key, "fwd")
    route = "fwd-loop" if looped else "fwd"
    # (where the modes agreed at x and disagreed near it, the numbers near it)
    reverse, forward_, difference = wrong.near or (wrong.reverse, wrong.forward,
                                                   wrong.difference)
    words = wrong_reverse_message(prob.call, function_name(prob.f), "rev", route, reverse,
                                  forward_, difference, op=wrong.op)
    if wrong.near is not None:
        words += (" (The numbers are at a point near x: at x itself the two modes agreed, a "
                  "coincidence of that point.)")
    warn_once((prob.call, function_key(prob.f), mode, "reverse wrong"), words,
              JacobianWarning)
    return alt, "fwd"


# NOTE [sharded auto reads the graph for known wrong operators]
# On one process, "auto"'s check reads the graph its reverse product's call of f built for
# the operators torch differentiates wrongly, and takes the route the named strategies'
# refusals name whatever the values say (NOTE [auto reads the graph for known wrong
# operators] in ``torch_vjp._engine.autoknown``): values alone agree by chance at a point
# such as zeros. A sharded "auto" compared values only: at ``x = 0`` through
# ``torch.as_strided_scatter`` it remembered reverse mode, and every later call returned a
# Jacobian wrong by several units, without a word. So each rank's first reverse product of the
# check reads its graph too (no call of f more), the ranks gather what they found (one
# ``all_gather_object``: an operator on some rank's graph is on every rank's verdict, so every
# rank takes the same route), and the route is decided as on one process, each route computed
# on every rank (its failure agreed: NOTE [the ranks agree on their fallbacks] in
# ``torch_vjp._sharded_work``), with the one-process warning. And where "auto" takes a
# remembered reverse route, its products read their graph (``Work.read``), and where some
# rank's met such an operator (f's graph changed since: a flag it reads), every rank forgets
# the route and computes the call again as a first call (NOTE [a remembered route through a
# known wrong operator], as on one process).


# NOTE [sharded auto at a point it cannot check]
# At a point holding a NaN or an infinity, in x or in a reverse product, one process
# compares no values, reads the graph of its check's reverse product all the same, and takes
# the route the graph names without remembering it (NOTE [auto at a point it cannot check]
# in ``torch_vjp._engine.autoknown``). A sharded "auto" did not read the graph where x was
# not finite (the reverse product was not taken there), and returned the rows under vmap
# through ``torch.cdist``'s wrong batching rule, off by a relative error near 1, without a
# word; where a reverse product was not finite it remembered the route it took, and read the
# route it remembered on each rank for itself (one rank remembering one from a call in
# another group returned its rows under vmap while the other computed them again, their
# collectives mis-paired). So each rank's reverse product is taken at such a point too
# (``own_gap``: f is called alike on every rank, x being the same), and says so by an
# infinite scale, which the verdict's ``all_reduce`` (MAX) carries to every rank: where some
# rank's reverse product is not finite (only that rank's, where f reads a number bound per
# rank), every rank compares nothing, checks no reverse product against a forward one, and
# takes the route the gathered graph names (:func:`known_route`, ``unchecked``), the same on
# every rank, none remembered, with the one-process warning and its sentence saying why the
# values went unchecked. Where the values were compared, the route remembered is read
# through one ``all_reduce`` of every rank's (``taken``): a route no rank holds alike counts
# as none.

Ops = tuple[str | None, str | None]

#: Why the values went unchecked (NOTE [sharded auto at a point it cannot check]): the
#: point x, or a reverse product, holds a NaN or an infinity (the one-process words).
_NOT_FINITE_X = "the point x holds a NaN or an infinity"
_NOT_FINITE_PRODUCT = ("a reverse product holds a NaN or an infinity (from a tensor f reads "
                       "but does not differentiate: an argument, or a weight it captured)")


class _NotRun(Exception):
    """A route that did not run on every rank (each rank raises it alike)."""


def gathered_ops(mine: list[Ops], group: Any) -> Ops:
    """``(batched wrongly, wrong alone)``: the first such operator any rank's graph holds
    (``mine``: this rank's :func:`~torch_vjp._engine.wrongops.wrong_ops`, empty where its
    reverse product could not be taken), the same on every rank."""
    import torch.distributed as dist

    said: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, mine[0] if mine else (None, None), group=group)
    batching = next((s[0] for s in said if s[0] is not None), None)
    alone = next((s[1] for s in said if s[1] is not None), None)
    return batching, alone


def known_route(prob: Problem, part: Any, mode: str, found: Ops, key: Hashable,
                attempt: Callable[[str], Any], unchecked: bool = False,
                taken: Callable[[], str | None] = lambda: None) -> tuple[Any, str]:
    """``(part, mode)``: the values check's, where its route is right for the operators
    ``found``; else the products of the route NOTE [sharded auto reads the graph for known
    wrong operators] names, remembered for ``key``, with the one-process warning; where
    ``unchecked`` (NOTE [sharded auto at a point it cannot check]: x or some rank's reverse
    product not finite), the route named for ``mode``'s products, none remembered, the
    warning saying why the values went unchecked. ``attempt(name)``: every
    rank's products by that route, or None on every rank where it did not run on some;
    ``taken()``: the route every rank remembers for ``key`` (None: none alike), read only
    where an operator was found (every rank alike)."""
    if found == (None, None):
        return part, mode
    ran: list[str] = []

    def route(name: str) -> Any:
        alt = attempt(name)
        if alt is None:
            raise _NotRun(name)
        ran.append(name)
        return alt

    named: tuple[Hashable, str] = (function_key(prob.f), function_name(prob.f))
    try:
        if unchecked:  # (x is the same on every rank: so are the words)
            why = _NOT_FINITE_PRODUCT if all_finite(prob.leaves) else _NOT_FINITE_X
            res = unchecked_route(prob.call, mode, part, found, route, named, why)
        else:
            res = known_wrong_route(prob.call, mode, part, found, taken(), route,
                                    lambda name: remember(key, name), named)
    except _NotRun:  # (the loop of reverse products did not run: the values' route stands)
        return part, mode
    if res is part or not ran:
        return part, mode
    return res, "fwd" if ran[-1].startswith("fwd") else "rev"
