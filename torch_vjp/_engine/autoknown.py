""""auto"'s route where f's graph holds an operator torch differentiates wrongly.

NOTE [auto reads the graph for known wrong operators]
NOTE [auto, checked once] decides "auto"'s route once per function and input signature by
values: the route's products against one reverse product without vmap, and that reverse
product against a forward product (NOTE [a reverse product checked forward]). Values alone
can agree by chance at the first call's point: where f multiplies what passes through
``torch.cdist`` by a factor that is 0 there (``x.sum()`` at a point summing to 0), or feeds
``torch.as_strided_scatter`` with zeros, the wrong products and the right ones coincide,
the route was remembered, and every later call returned a Jacobian wrong by several units
at a scale of one, without a word. So the check's own reverse product also reads the graph
its call of f built (no call of f more) for the operators of NOTE [named reverse strategies
and wrong formulas] (:func:`~torch_vjp._engine.wrongops.wrong_ops`, as the named strategies
read it), and where it holds one, "auto" takes the route the named strategies' refusals
name, whatever the values say: forward mode (vectorised, else one product at a time) where
a backward formula is wrong alone (``torch.as_strided_scatter``, the antialiased resizes
torch gets wrong); the rows one reverse product at a time, without vmap, where a batching
rule is wrong (``torch.cdist``). The values check runs first, as before (where it finds the
route wrong, its warning gives the numbers); where the route it remembered is not the
one named, that one is taken instead, with a one-time warning, and remembered for the
function and signature ("rev-loop" even where vmap failed at this call: a later call's
vmap would run the wrong rule unchecked). Where forward mode cannot run f either, the
values check's result stands. Operators not known keep the values check alone.

NOTE [a remembered route through a known wrong operator]
The route is remembered for a function and its input signature, but f's graph can change
between calls that share them (a flag in a dict or a module's attribute that f reads:
``torch.cdist`` taken at a later call only); the remembered reverse route then ran through
it unchecked, wrong by 1.5-3.4. So where "auto" takes a remembered route, its reverse
products read the graph their own call of f builds (no call of f more), and where it holds
an operator whose backward is wrong alone, or whose batching rule is wrong and the products
ran under vmap, the route is forgotten and the call computed again as a first call, whose
check reads the graph (:func:`stale`).

NOTE [auto at a point it cannot check]
At a point holding a NaN or an infinity (in x, or in a reverse product: from a tensor f
reads but does not differentiate, an argument or a weight it captured) the products of two
routes hold NaN and infinities in entries of their own, so the values check compares
nothing and no route is remembered there. The read of f's graph needs no finite values,
though: where ``torch.cdist`` (its batching rule wrong) took an entry of x that f never
reads, or a weight with one infinite entry, "auto" had returned the rows under vmap, off
by a relative error near 1 in their finite entries, without a word. So the check's reverse
product is taken there too (its values are not compared) and its graph read
(:func:`unchecked_route`): the route the named strategies' refusals name is taken, with
the one-time warning of a known operator, and not remembered (a call at a finite point
checks by values too); the warning ends by saying that the values went unchecked, and why.
Where the graph holds no operator known, the result stands, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from torch_vjp._engine.blocks import Blocks
from torch_vjp._engine.rows import routes_that_run
from torch_vjp._engine.wrongops import _how
from torch_vjp._errors import JacobianWarning, warn_once

__all__ = ["batched_pullback_message", "known_wrong_route", "stale", "unchecked_route",
           "unchecked_words"]


def known_wrong_route(
    call: str, first: str, res: Blocks, found: tuple[str | None, str | None],
    taken: object, route: Callable[[str], Blocks], keep: Callable[[str], None],
    named: tuple[Hashable, str],
) -> Blocks:
    """``res``, the blocks the values check returned (of the route ``first``, or another it
    took, and remembered as ``taken``), where that route is right for the operators
    ``found`` in f's graph (``(batched wrongly, wrong alone)``); else the blocks of the
    route NOTE [auto reads the graph for known wrong operators] names, remembered with
    ``keep``, with a one-time warning (``res`` where forward mode cannot run f)."""
    batching, alone = found
    if alone is not None:
        if taken in ("fwd", "fwd-loop"):
            return res
        for name, alt in routes_that_run(route, ("fwd", "fwd-loop")):
            keep(name)
            warn_once((call, named[0], "auto, wrong alone", alone),
                      _alone_message(call, named[1], alone, name), JacobianWarning)
            return alt
        return res
    if batching is None or taken in ("rev-loop", "fwd", "fwd-loop"):
        return res
    keep("rev-loop")
    if first == "rev-loop":  # (vmap failed at this call: its loop's rows are right)
        return res
    alt = route("rev-loop")
    warn_once((call, named[0], "auto, batched wrongly", batching),
              _batching_message(call, named[1], batching), JacobianWarning)
    return alt


def unchecked_route(
    call: str, first: str, res: Blocks, found: tuple[str | None, str | None] | None,
    route: Callable[[str], Blocks], named: tuple[Hashable, str], why: str,
) -> Blocks:
    """``res`` (of route ``first``) at a point the values check cannot compare at (NOTE
    [auto at a point it cannot check]), where f's graph holds no operator ``found`` makes
    that route wrong; else the blocks of the route that operator's warning names (none
    remembered), the warning saying that the values went unchecked and ``why`` (what is
    not finite)."""
    batching, alone = found if found is not None else (None, None)
    if alone is not None and first not in ("fwd", "fwd-loop"):
        for name, alt in routes_that_run(route, ("fwd", "fwd-loop")):
            warn_once((call, named[0], "auto, wrong alone", alone),
                      _alone_message(call, named[1], alone, name) + unchecked_words(why),
                      JacobianWarning)
            return alt
    elif alone is None and batching is not None and first not in ("rev-loop", "fwd",
                                                                 "fwd-loop"):
        alt = route("rev-loop")
        warn_once((call, named[0], "auto, batched wrongly", batching),
                  _batching_message(call, named[1], batching) + unchecked_words(why),
                  JacobianWarning)
        return alt
    return res


def unchecked_words(why: str) -> str:
    """The sentence a warning given at a point not finite ends with (NOTE [auto at a point
    it cannot check]): the values went unchecked, and ``why``."""
    return (f"\n  Here {why}, so the values were not compared with a reverse product "
            f"(unchecked: each route puts NaN and infinities in entries of its own); the "
            f"route was taken from f's graph alone, and is not remembered.")


def stale(met: list[tuple[str | None, str | None]]) -> bool:
    """Whether the reverse products of a remembered route met an operator that makes it
    wrong (NOTE [a remembered route through a known wrong operator])."""
    return any(batching is not None or alone is not None for batching, alone in met)


def _alone_message(call: str, name: str, op: str, route: str) -> str:
    how = ("one forward product at a time (torch.vmap has no batching rule for it)"
           if route == "fwd-loop" else "vectorised forward-mode AD")
    return (
        f"{call}: f ({name}) goes through {op}, and torch's backward formula of it is wrong "
        f"{_how(op)}, so reverse mode's Jacobian would be wrong, with or without "
        f"torch.vmap: strategy='auto' computed it with {how}, whose formula is right, "
        f"wherever f's graph holds that operator.\n"
        f"  Pass strategy={route!r} to compute it that way directly. This warning is shown "
        f"once per function."
    )


def _batching_message(call: str, name: str, op: str) -> str:
    return (
        f"{call}: strategy='auto' computes its rows under torch.vmap, whose batching rule "
        f"for the backward of {op} in f ({name}) is wrong (torch's: the rows are off by a "
        f"relative error near 1, each alone is right), so it computed the rows one reverse "
        f"product at a time, without vmap, as it does wherever f's graph holds that "
        f"operator.\n"
        f"  Pass strategy='rev-loop' (or chunk_size=1) to compute them that way directly. "
        f"This warning is shown once per function."
    )


def batched_pullback_message(call: str, name: str, op: str) -> str:
    """The one-time warning that ``vjp_fn(v, batched=True)`` computed its products one at
    a time, without vmap, where f's graph holds ``op``, whose backward torch batches wrongly
    (NOTE [batched products through a wrong batching rule] in :mod:`torch_vjp.transforms`)."""
    return (
        f"{call}: batched=True computes the products under torch.vmap, whose batching rule "
        f"for the backward of {op} in f ({name}) is wrong (torch's: the rows are off by a "
        f"relative error near 1, each alone is right), so it computed them one product at a "
        f"time, without vmap, as it does wherever f's graph holds that operator.\n"
        f"  Pass chunk_size=1 to compute them that way directly. This warning is shown once "
        f"per function."
    )
