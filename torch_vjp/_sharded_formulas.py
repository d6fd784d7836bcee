"""A sharded Jacobian through an operator whose forward-mode formula torch has wrong (NOTE
[sharded forward mode through a wrong formula]).

NOTE [sharded forward mode through a wrong formula]
On one process, f's graph is read for the operators whose forward-mode formula torch (2.13)
has wrong (NOTE [forward mode through a wrong formula] in ``torch_vjp._engine.fwd_wrong``:
``torch.scatter_reduce(reduce='prod')``, ``torch.triangular_solve``'s matrix,
``torch.linalg.det`` at singular matrices): a named ``"fwd"`` or ``"fwd-loop"`` refuses,
and ``"auto"``, whose forward products agreed with its reverse product by a coincidence of
the point (or were not compared, at a point holding a NaN or an infinity), takes reverse
mode with a one-time warning. A sharded Jacobian read none of it: every rank returned a
Jacobian wrong by the size of the entries (6.1 through ``scatter_reduce`` at a random
point under a named ``"fwd"``, 0 at zeros under ``"auto"`` and 6.1 at the next point it
remembered forward mode for) without a word.

So, with a group, each rank reads what one process reads, and the ranks agree on it by one
``all_reduce`` (MAX) of a flag naming the operator (0 for none, else its place in
:data:`_OPS`): an operator some rank's graph holds (an f that takes another path on one
rank) sets every rank's route, so the ranks call f as often and their shards fit together.

* A named forward strategy: the products' calls of f run under ``named_reading``'s mode
  (no call of f more), and every rank raises ``named_forward``'s error where some rank's
  ran such an operator on a tangent. What each rank remembers for its function and input
  signature is agreed before any product too (one ``all_reduce`` more): a rank that
  remembers the operator would refuse before calling f while another ran its products.
* ``"auto"`` in forward mode: the check's reverse product reads its graph
  (``own_gap``'s ``forward``), and where some rank's holds such an operator and the values
  agreed (on every rank, through the verdict), or were not compared, every rank computes
  its share of reverse-mode rows instead, with ``auto_forward_message``'s warning (and,
  unchecked, the sentence saying why); the reverse rows are then checked as a reverse
  route is. Where the values disagreed, the check's own route and warning stand.

NOTE [sharded reverse mode through a wrong formula]
On one process, a named ``"rev"`` or ``"rev-loop"`` reads the graph of its own call of f for
the operators whose backward formula torch has wrong alone (NOTE [named reverse strategies
and wrong formulas] in ``torch_vjp._engine.wrongops``: ``F.max_unpool2d`` with a repeated
index, ``torch.as_strided_scatter``, the antialiased resize) and refuses. A sharded Jacobian
read the graph only for a remembered route of ``"auto"``'s, and every rank returned a
Jacobian wrong by 1.0 (``max_unpool2d``) without a word. So each rank keeps what its
products' call of f read (``Work.met``: torch.func's call, or plain autograd's), and, after
the products, one ``all_reduce`` (MAX) of a flag tells every rank whether some rank's graph
holds such an operator (an f that takes another path on one rank): then every rank raises
:func:`named_reverse`'s error, naming the operator of the lowest rank that found one (one
``all_gather_object`` more, on that path only). Nothing is remembered for a named reverse
strategy, on one process as here: each call reads its own graph.

The same flag carries a second value: a named ``"rev"`` whose products ran under vmap (a
chunk other than 1) through an operator whose batching rule is wrong (``torch.cdist``: a
Jacobian wrong by 1.48 on every rank). One process computes its rows one reverse product at
a time there, with :func:`named_reverse`'s one-time warning; so, where some rank's graph
holds one, every rank gives that warning and computes its share again without vmap, from
the pullback of its products' call of f (``Work.looped_again``): f is not called again, as
on one process (a second call drew other random numbers, a dropout mask of its own, and
the Jacobian was that of another draw than one process's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from types import SimpleNamespace
from typing import Any

import torch

from torch_vjp._engine.autoknown import unchecked_words
from torch_vjp._engine.context import route_key
from torch_vjp._engine.fwd_wrong import (
    auto_forward_message,
    forward_checked,
    forward_read,
    named_forward,
    named_reading,
)
from torch_vjp._engine.fwdcheck import all_finite, signature
from torch_vjp._engine.jacobian import function_key, function_name
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.wrongops import WRONG_FORWARD, named_reverse
from torch_vjp._errors import JacobianWarning, StrategyError, warn_once
from torch_vjp._sharded_forward import _NOT_FINITE_PRODUCT, _NOT_FINITE_X
from torch_vjp._sharded_work import all_max
from torch_vjp._strategies import Strategy

__all__ = ["NamedForward", "forward_formula_route"]

#: The operators of :data:`WRONG_FORWARD`, in an order alike on every rank: a flag's value
#: ``k`` names ``_OPS[k - 1]``.
_OPS = tuple(sorted(set(WRONG_FORWARD.values())))


def agreed_op(op: str | None, group: Any, device: torch.device) -> str | None:
    """The operator some rank found (``op``: this rank's, or None), the same on every rank
    (one ``all_reduce``); None where no rank found one."""
    code = all_max(0 if op is None else 1 + _OPS.index(op), group, device)
    return None if code == 0 else _OPS[code - 1]


class NamedForward:
    """A named ``"fwd"`` or ``"fwd-loop"`` with a group (NOTE [sharded forward mode through a
    wrong formula]): made before the products (it refuses on every rank where some rank
    remembers such an operator for this call), entered around them (their calls of f are
    read, where this rank has not read them before), and :meth:`done` after them, on every
    rank (it refuses on every rank where some rank's calls ran one). A named ``"rev"`` or
    ``"rev-loop"``: :meth:`done` refuses on every rank where some rank's products' graph
    (``work.met``) holds an operator whose backward formula is wrong alone (NOTE [sharded
    reverse mode through a wrong formula]). Does nothing for any other strategy."""

    def __init__(self, prob: Problem, strat: Strategy, batch: int | None, group: Any,
                 device: torch.device, work: Any = None) -> None:
        self.on = strat.mode == "fwd"
        self.prob, self.strategy, self.group, self.device = prob, strat.name, group, device
        self.reverse = strat.mode == "rev" and work is not None
        self.work, self.vectorized = work, strat.vectorized
        self.reading: Any = None
        if not self.on:
            return
        opts = SimpleNamespace(named=(function_name(prob.f), function_key(prob.f)),
                               batch=batch)
        known: str | None = None
        try:
            self.reading = named_reading(prob, opts, self.strategy)
        except StrategyError:  # (this rank remembers one: every rank is told first)
            known = forward_checked(_forward_key(prob, batch)) or _OPS[0]
        self._refuse(agreed_op(known, group, device))

    def _refuse(self, op: str | None) -> None:
        if op is not None:
            raise named_forward(self.prob.call, op, function_name(self.prob.f), self.strategy)

    def __enter__(self) -> NamedForward:
        if self.reading is not None:
            self.reading[1].__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.reading is not None:
            self.reading[1].__exit__(*exc)

    def done(self, ok: bool, tried: tuple[Any, int, Any], attempt: Callable[..., Any]
             ) -> tuple[Any, int, Any]:
        """After the products (``ok``: every rank computed its share, the same on every
        rank; ``tried``: ``(part, code, err)`` of them): raises on every rank where some
        rank's calls of f ran such an operator. A named ``"rev"``: every rank's products
        again, one at a time (by ``attempt``, ``_sharded``'s), where some rank's ran under
        vmap through an operator whose batching rule is wrong; else ``tried``."""
        if self.reverse:
            try:
                if ok:
                    tried = self._reverse_done(tried, attempt)
            finally:
                self.work.pulled = None  # (the first call's graph, not kept past here)
        if not self.on or not ok:
            return tried
        op = None
        if self.reading is not None:
            op = forward_read(self.reading[0], self.reading[1].found)
        self._refuse(agreed_op(op, self.group, self.device))
        return tried

    def _reverse_done(self, tried: tuple[Any, int, Any], attempt: Callable[..., Any]
                      ) -> tuple[Any, int, Any]:
        """A named reverse strategy's refusal, or its products again without vmap, agreed
        by every rank (NOTE [sharded reverse mode through a wrong formula])."""
        met, work = self.work.met, self.work
        alone = next((a for _, a in met if a is not None), None)
        batching = (next((b for b, _ in met if b is not None), None)
                    if self.vectorized and work.chunk != 1 else None)
        code = all_max(2 if alone is not None else int(batching is not None), self.group,
                       self.device)
        if not code:
            return tried
        import torch.distributed as dist

        said: list[tuple[str | None, str | None]] = [(None, None)] * dist.get_world_size(
            self.group)
        dist.all_gather_object(said, (batching, alone), group=self.group)
        found = next(s for s in said if s[code - 1] is not None)
        f = self.prob.f
        # (raises where the backward is wrong alone; else the one-process warning)
        named_reverse(self.prob.call, found if code == 2 else (found[0], None),
                      self.vectorized, None, (function_name(f), function_key(f)))
        # (from the pullback of the products' call of f: f is not called again, as on one
        # process, and a function that draws, or counts its calls, is not called twice)
        return attempt(work.looped_again if work.pulled is not None
                       else lambda: work._products("rev", None, False), work, self.prob.call)


def forward_formula_route(
    prob: Problem, part: Any, mode: str, checked: tuple[bool, float, float],
    ops: list[Any], group: Any, device: torch.device, reverse: Callable[[], Any],
    agrees: Callable[[Any, str], tuple[bool, float, float]],
) -> tuple[Any, str, bool, float, float]:
    """``(part, mode, ok, difference, scale)`` of a sharded ``"auto"``'s check, where its
    forward-mode products ``part`` were compared (``checked``: the verdict, the same on
    every rank; an infinite scale where nothing was compared): every rank's reverse-mode
    rows (``reverse()``: None on every rank where some rank could not compute them), and
    their verdict by ``agrees``, where some rank's graph (``ops[0][2]``, read by
    ``own_gap``) holds an operator whose forward-mode formula torch has wrong and the values
    agreed or were not compared (NOTE [sharded forward mode through a wrong formula]); else
    what was given. Called on every rank alike."""
    ok, diff, scale = checked
    if mode != "fwd":
        return part, mode, ok, diff, scale
    mine = ops[0][2] if ops and len(ops[0]) > 2 else None
    op = agreed_op(mine, group, device)
    unchecked = not math.isfinite(scale)
    if op is None or not (ok or unchecked):
        return part, mode, ok, diff, scale
    alt = reverse()
    if alt is None:  # (no reverse route on some rank: forward mode's check goes on)
        return part, mode, ok, diff, scale
    words = auto_forward_message(prob.call, function_name(prob.f), op)
    if unchecked:  # (x is the same on every rank: so are the words)
        words += unchecked_words(_NOT_FINITE_PRODUCT if all_finite(prob.leaves)
                                 else _NOT_FINITE_X)
    warn_once((prob.call, function_key(prob.f), "fwd", "known"), words, JacobianWarning)
    if unchecked:
        return alt, "rev", ok, diff, scale
    return (alt, "rev", *agrees(alt, "rev"))


def _forward_key(prob: Problem, batch: int | None) -> Hashable:
    """``named_reading``'s key for ``prob`` (its function and input signature)."""
    return ("jacobian: forward formulas",
            signature(route_key(prob.f), prob.leaves, batch, prob.primals), prob.argnums)
