""""auto"'s vectorised Jacobian checked against one reverse product, once per function and
input signature.

NOTE [auto, checked once]
``strategy="auto"`` computes a Jacobian with vectorised products: forward mode for a tall one
(more output than input elements), which runs the forward-mode formulas of f's operators,
and reverse mode under ``torch.vmap`` otherwise, which runs the batching rules of the
backward formulas. A few of either are wrong in torch (``torch.triangular_solve``'s
forward-mode formula for the matrix: a relative error near 1; the batching rule of
``torch.cdist``'s backward: the same), and torch.func's ``jacfwd``/``jacrev`` return such
a Jacobian silently. One reverse product without vmap runs the backward formulas that
every gradient uses. So the first time "auto" computes a function's Jacobian for an input
signature, it also takes one reverse product with a random cotangent ``u`` and compares
``u^T J`` (read from the blocks) with it, within rounding (``sqrt(eps)`` of their scale,
for the least precise dtype f's graph computes in: a float32 step in a float64 f, as the
RMSNorm of Llama and T5, rounds every route at float32's; where the products are small
beside the numbers they were computed from, the scale of those, measured: NOTE [the scale of
what is compared] in :mod:`torch_vjp._engine.fwdnoise`): one more call of f and one pass
over J. Where they disagree, it computes the Jacobian again
by reverse mode under vmap (after forward mode), then one reverse product at a time
(``"rev-loop"``), and returns the first that agrees with the reverse product, with a
one-time warning; later calls of that function and signature take that route directly.
Where none agrees (f is random, or not smooth at the
point), the first result stands, with a one-time warning that says so (for batch_jacobian,
where a reverse product shows a gradient flowing across rows, f mixes the rows of its
batch, and an error says so: NOTE [a batch that mixes rows]). Not checked in inference mode, where
plain autograd records nothing (nor remembered there). Later calls that agreed are not checked again (the key: NOTE [what a route key
covers] in :mod:`torch_vjp._engine.context`; a function
that branches to another operator on other values is checked only where it first ran; a
bool, str or None among its plain arguments, or whether a number among them is zero, is
part of the signature).
Explicit strategies are not checked: "fwd" and "rev" are what was asked (named reverse
strategies read f's graph for the operators torch is known to differentiate wrongly: NOTE
[named reverse strategies and wrong formulas] in :mod:`torch_vjp._engine.wrongops`). The
cotangent comes from a generator of its own. f's call for the check (and any route it tries) starts
from the global generators' state the products started from, and the generators are then
put where the products left them (NOTE [auto's extra calls draw what the products draw] in
:mod:`torch_vjp._engine.jacobian`): a random f (dropout) is checked against its products'
own draw, and agrees. (Another thread drawing meanwhile from the global generators may see
numbers drawn again, as in the loops' SameDraws.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_leaves

from torch_vjp._engine.autoknown import (known_wrong_route, unchecked_route,
                                        unchecked_words)
from torch_vjp._engine.blocks import Blocks, cotangent_products
from torch_vjp._engine.context import flag_of, identity, module_key, route_key
from torch_vjp._engine.fwd_wrong import auto_forward_message, wrong_forward
from torch_vjp._engine.fwdnoise import reverse_noise, rounding_scale
from torch_vjp._engine.fwdwords import no_route_message, wrong_route_message
from torch_vjp._engine.graph import graph_nodes
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.revcheck import forward_route, reverse_wrong
from torch_vjp._engine.rows import passes_through
from torch_vjp._engine.wrongops import wrong_ops
from torch_vjp._errors import JacobianCallError, JacobianWarning, warn_once

__all__ = [
    "CHECKED", "PIECE", "agreeing_route", "checked_route", "cotangent", "all_finite", "gap",
    "identity",
    "route_key", "module_key",
    "largest_difference", "least_of", "least_precise", "cast_dtype",
    "max_abs_difference", "no_route_message", "one_reverse_product", "remember",
    "reverse_gap", "signature", "stacked_gap",
    "tolerance", "wrong_route_message",
]

class _Routes(dict):  # type: ignore[type-arg]
    """A dict whose ``get`` marks an entry as used: :func:`remember` drops the one used
    longest ago when full, so that a function that makes a new key on every call (one over
    an object made anew each step) cannot push out the routes of those in use (clearing
    the whole cache when full did, every 512 calls of such a function)."""

    def get(self, key: Hashable, default: object = None) -> object:
        value = dict.get(self, key, _MISSING)
        if value is _MISSING:
            return default
        del self[key]  # (moved to the end: used last)
        self[key] = value
        return value


_MISSING = object()

#: (function key, input signature) -> the route "auto" takes after its check: "fwd" or "rev"
#: (vectorised), or "rev-loop". Bounded: the entry used longest ago goes when full.
CHECKED: dict[Hashable, str] = _Routes()
_MAX_ENTRIES = 512


#: Elements compared at once: the check's extra memory is a few tensors of this many.
PIECE = 1 << 20


def max_abs_difference(a: Tensor, b: Tensor) -> Tensor:
    """``max |a - b|`` over ``(m, r, c)`` tensors (one kernel for up to :data:`PIECE`
    elements, else a slice of rows at a time, to bound the temporary difference)."""
    m, r, c = a.shape
    if a.numel() <= PIECE:
        return (a - b).abs().amax()
    rows = max(1, PIECE // max(1, m * c))
    diff = a.new_zeros(())
    for start in range(0, r, rows):
        piece = a[:, start:start + rows] - b[:, start:start + rows]
        diff = torch.maximum(diff, piece.abs_().amax())
    return diff


def largest_difference(
    first: Sequence[Sequence[Tensor]], second: Sequence[Sequence[Tensor]]
) -> Tensor:
    """``max |first - second|`` over two grids of blocks of the same shapes (a 0-d tensor).

    Example:
        >>> float(largest_difference([[torch.ones(2)]], [[torch.tensor([1.0, 3.0])]]))
        2.0
    """
    diff: Tensor | None = None
    with torch.no_grad():
        for row_a, row_b in zip(first, second):
            for a, b in zip(row_a, row_b):
                if a.numel() == 0:
                    continue
                d = max_abs_difference(
                    a.detach().reshape(1, -1, 1), b.detach().reshape(1, -1, 1)
                )
                diff = d if diff is None else torch.maximum(diff, d)
    return torch.zeros(()) if diff is None else diff


def remember(key: Hashable, verdict: str) -> None:
    CHECKED.pop(key, None)
    while len(CHECKED) >= _MAX_ENTRIES:
        del CHECKED[next(iter(CHECKED))]  # (the one used longest ago)
    CHECKED[key] = verdict


def signature(function: Hashable, leaves: Sequence[Tensor], batch: int | None,
              primals: Sequence[object] = ()) -> Hashable:
    """The key of one function and input signature: the leaves' shapes, dtypes, devices,
    and the flags of the primals that are not tensors (:func:`flag_of`: ``mode="lower"``
    or ``upper=True`` may choose another operator, checked again there; any other value
    by its type)."""
    flags = ((f if (f := flag_of(p)) is not NotImplemented else type(p))
             for p in primals if not isinstance(p, Tensor))
    return (function, batch, tuple((tuple(x.shape), x.dtype, x.device) for x in leaves),
            tuple(flags))


def cotangent(like: Tensor, gen: torch.Generator) -> Tensor:
    """A random cotangent shaped like ``like``, drawn in float64 from ``gen`` (a generator of
    the check's own: the global ones are never touched)."""
    u = torch.randn(like.shape, generator=gen, dtype=torch.float64)
    return u.to(dtype=like.dtype, device=like.device)


def one_reverse_product(
    prob: Problem, keep: Callable[[list[Tensor]], list[Tensor]] | None = None, *,
    anywhere: bool = False, ops: list[tuple[str | None, str | None]] | None = None,
    forward: list[str | None] | None = None,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]] | None:
    """f's flat outputs, random cotangents ``u`` (one per output, from a generator of its
    own, then rewritten by ``keep`` where given: a rank's share, NOTE [sharded auto,
    checked]) and ``u^T J`` per leaf (zeros where unused): one more call of f. None where
    the check does not apply (a complex tensor or one on the meta device, a function plain
    autograd cannot differentiate), and at a NaN or infinite point unless ``anywhere``
    (where only the product's finite entries are read: :func:`cross_row_flow`)."""
    leaves = prob.leaves
    if any(x.is_complex() or x.device.type == "meta" for x in leaves):
        return None  # (a tensor on the meta device holds no numbers to compare)
    if not anywhere and not all_finite(prob.leaves):
        return None  # (NaN and infinities land in the products by each route its own way)
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.enable_grad():
            prob.reset_primals()  # (the products' last call of f may have changed them)
            xs = [x.detach().requires_grad_(True) for x in leaves]
            # (copies that are not leaves: f may write into its input, as the products
            # allowed it to)
            res_f = prob.g(*[x.clone() for x in xs])
            out = res_f[0] if prob.has_aux else res_f
            flat, _ = tree_flatten(out)
            if any(o.is_complex() for o in flat):
                return None
            us = [cotangent(o, gen) for o in flat]
            if keep is not None:
                us = keep(us)
            live = [(o, u) for o, u in zip(flat, us) if o.requires_grad]
            if ops is not None:  # (the operators of NOTE [auto reads the graph for ...])
                ops.append(wrong_ops([o for o, _ in live]))
            if forward is not None:  # (NOTE [forward mode through a wrong formula])
                forward.append(wrong_forward([o for o, _ in live]))
            grads: Sequence[Tensor | None] = (
                torch.autograd.grad([o for o, _ in live], xs, [u for _, u in live],
                                    allow_unused=True)
                if live else (None,) * len(xs)
            )
    except Exception as err:  # noqa: BLE001 - what plain autograd cannot run goes unchecked
        if passes_through(err):
            raise
        return None
    return (flat, us, [torch.zeros_like(x) if g is None else g.detach()
                       for x, g in zip(xs, grads)])


def all_finite(tree: Any) -> bool:
    """Whether every floating-point or complex tensor in ``tree`` (a tensor or a pytree) is
    finite, read with one synchronisation; one on the meta device holds no numbers and
    counts as finite. At a point holding a NaN or an infinity, the products of two routes
    hold NaN and infinities in entries of their own (``0 * inf``, sums of opposite
    infinities), so a check there compares nothing, and no route is remembered from it (a
    later call at a finite point checks); a reverse product holding one (from a tensor f
    reads but does not differentiate) is read the same way."""
    flags = [t.isfinite().all() for t in tree_leaves(tree)
             if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())
             and t.numel() and t.device.type != "meta"]
    return not flags or bool(torch.stack([f.cpu() for f in flags]).all())


def gap(a: Tensor, b: Tensor) -> tuple[float, float]:
    """``(max |a - b|, max(|a|, |b|))`` of two flat tensors, read with one synchronisation.

    Entries equal (an infinity of one sign in both) or NaN in both agree, and the scale is
    that of the entries finite in both: a NaN in ``x`` (or an overflow) gives NaN in the
    same entries by every route, which is no sign of a wrong formula; a NaN or an infinity
    in one of them only is a disagreement (NaN or infinite difference).

    Example:
        >>> gap(torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([1.5, float("nan"), 3.0]))
        (0.5, 3.0)
    """
    if a.numel() == 0:
        return 0.0, 0.0
    agree = (a == b) | (a.isnan() & b.isnan())
    finite = a.isfinite() & b.isfinite()
    d, s = torch.stack((torch.where(agree, 0.0, a - b),
                        torch.where(finite, torch.maximum(a.abs(), b.abs()), 0.0))
                       ).abs().amax(1).tolist()
    return d, s


def stacked_gap(u: Tensor, stacked: Sequence[Tensor], grads: Sequence[Tensor | None],
                batch: int | None = None) -> tuple[float, float]:
    """``(difference, scale)`` between ``u^T J`` read from reverse-mode products
    (``stacked[i]``: ``(k, [B,] *in_i)``, one row per cotangent element; ``u``: ``(k,)``, or
    ``(B, k)`` per row of a batch) and reverse products ``grads`` (None: zeros), over
    every input.

    Example:
        >>> stacked_gap(torch.tensor([1.0, 2.0]), [torch.eye(2)], [torch.tensor([1.0, 2.5])])
        (0.5, 2.5)
    """
    diff = scale = 0.0
    with torch.no_grad():
        for t, g in zip(stacked, grads):
            t = t.detach()
            k = t.shape[0]
            if batch is None:
                mine = u.to(t.dtype) @ t.reshape(k, -1)
            else:
                mine = (u.T.to(t.dtype).reshape(k, batch, 1) * t.reshape(k, batch, -1)).sum(0)
            want = torch.zeros_like(mine) if g is None else g.to(t.dtype)
            d, s = gap(mine.reshape(-1), want.reshape(-1))
            if math.isnan(d) or d > diff:  # (a NaN stays: it is a disagreement)
                diff = d
            scale = max(scale, s)
    return diff, scale


def reverse_gap(prob: Problem, res: Blocks, batch: int | None,
                got: tuple[list[Tensor], list[Tensor], list[Tensor]]) -> tuple[float, float]:
    """``(difference, scale)``: the largest difference between ``u^T J`` from the blocks and
    the reverse product ``got`` (:func:`one_reverse_product`) with the same ``u``, and the
    largest entry of either; ``(inf, 0)`` where f's outputs are not the blocks' rows."""
    flat, us, grads = got
    products = cotangent_products(prob.leaves, res, batch, us)
    if products is None:
        return math.inf, 0.0
    diff = scale = 0.0
    with torch.no_grad():
        for total, g in zip(products, grads):
            d, s = gap(total.to(g.dtype), g.reshape(-1))
            if math.isnan(d) or d > diff:  # (a NaN stays: it is a disagreement)
                diff = d
            scale = max(scale, s)
    return diff, scale


def checked_route(
    prob: Problem, res: Blocks, batch: int | None, key: Hashable,
    route: Callable[[str], Blocks], named: tuple[Hashable, str],
    redraw: Callable[[], None] = lambda: None,
) -> Blocks:
    """``res``, the vectorised blocks "auto" computed, if one reverse product without vmap
    agrees with them; else the first of the routes ``route("rev")`` (after forward mode) and
    ``route("rev-loop")`` that agrees with it (:func:`agreeing_route`), with a one-time
    warning naming f (``named``: its key and name); the forward mode of ``route("fwd")``
    and ``route("fwd-loop")`` where the reverse product is itself wrong (NOTE [a reverse
    product checked forward] in :mod:`torch_vjp._engine.revcheck`; ``redraw`` puts the
    generators where the products started). See NOTE [auto, checked once]."""
    if torch.is_inference_mode_enabled():
        # (plain autograd records nothing there: no reverse product to compare with; the
        # route is not remembered, so that a call outside inference mode checks it)
        return res
    # (NOTE [a batch that mixes rows] is in mixing.py, which imports this module)
    from torch_vjp._engine.mixing import cross_row_flow, mixing_message

    # (blocks the loop computed because vmap could not run f: the route is the loop, which
    # the check names and tries no other route after; the route remembered stays "rev", as
    # vmap may run f at another call: the loop then stands on its own fallback)
    if res.forward_instead:
        # (plain forward mode, taken because the reverse products, the check's among them,
        # run a wrong backward formula: NOTE [a plain loop through a wrong backward])
        remember(key, "fwd-loop")
        return res
    first = "rev-loop" if res.looped and res.mode == "rev" else res.mode
    keep = res.mode if first == "rev-loop" else None
    known: list[str | None] = []
    got = one_reverse_product(prob, ops=(ops := []), forward=known if first == "fwd" else None)
    # (a NaN or an infinity in the reverse product, from a tensor f reads that is not
    # differentiated, an argument or one it captured, lands in the products by each route
    # its own way too: a false 'wrong formula' warning, and the loop remembered for good)
    finite = got is None or all_finite(got[2])
    if got is None or not finite:
        if finite and all_finite(prob.leaves):
            remember(key, keep or first)
            return res
        if batch is not None:
            # (no route is compared at a NaN or an infinity, but a flow across rows shows
            # there too, in finite entries: a mixing f returned sums of cross-example
            # blocks, all zeros for x - x.mean(0), without a word)
            flow = cross_row_flow(prob, batch)
            if flow is not None:
                raise JacobianCallError(mixing_message(prob.call, named[1], None, None, *flow))
        return _unchecked(prob, first, res, got, ops, route, named)

    def mixing(tried: Sequence[str], diff: float, scale: float) -> None:
        # NOTE [a batch that mixes rows]
        flow = cross_row_flow(prob, batch) if batch is not None else None
        if flow is not None:
            raise JacobianCallError(mixing_message(prob.call, named[1], diff, scale, *flow))

    dtype = least_precise(got[0], prob.leaves)
    rtol = tolerance(dtype)
    floor: list[float] = []

    first_gap: list[tuple[float, float]] = []  # (res's, read once)

    def noise() -> float:  # NOTE [the scale of what is compared]
        if not floor:
            floor.append(rounding_scale(reverse_noise(prob), dtype))
        return floor[0]

    def gap_of(blocks: Blocks) -> tuple[float, float]:
        if blocks is res and first_gap:
            return first_gap[0]
        diff, scale = reverse_gap(prob, blocks, batch, got)
        if not diff <= rtol * scale:
            scale = max(scale, noise())
        if blocks is res:
            first_gap.append((diff, scale))
        return diff, scale

    def disagrees(blocks: Blocks) -> bool:
        diff, scale = gap_of(blocks)
        return not diff <= rtol * scale

    if known and known[0] is not None and not disagrees(res):  # NOTE [forward mode
        try:  # through a wrong formula]: reverse mode, checked as a first reverse route is
            rev = route("rev")
        except Exception as err:  # noqa: BLE001 - no reverse route: forward's check below
            if passes_through(err):
                raise
        else:
            warn_once((prob.call, named[0], "fwd", "known"),
                      auto_forward_message(prob.call, named[1], known[0]), JacobianWarning)
            first, res = "rev", rev

    # NOTE [a reverse product checked forward]: on a reverse route, and where forward
    # mode's disagrees, the reverse product itself is checked
    if first != "fwd" or disagrees(res):
        wrong = reverse_wrong(prob, got, redraw, rtol, noise)
        if wrong is not None:
            alt = forward_route(prob, first, res, batch, got[1], wrong, route,
                                lambda name: remember(key, name), named, rtol)
            if alt is not None:
                return alt

    out = agreeing_route(
        prob, first, res, gap_of, route, lambda name: remember(key, keep or name), named,
        "strategy", rtol, on_none=None if batch is None else mixing,
    )  # NOTE [auto reads the graph for known wrong operators] in autoknown.py:
    return known_wrong_route(prob.call, first, out, ops[0], CHECKED.get(key), route,
                             lambda name: remember(key, name), named) if ops else out


def _unchecked(prob: Problem, first: str, res: Blocks,
               got: tuple[list[Tensor], list[Tensor], list[Tensor]] | None,
               ops: list[tuple[str | None, str | None]], route: Callable[[str], Blocks],
               named: tuple[Hashable, str]) -> Blocks:
    """NOTE [auto at a point it cannot check] in autoknown.py: the route f's graph names
    at a point holding a NaN or an infinity (x's, or the reverse product's: ``got``), none
    remembered; the graph read from the check's reverse product, taken here where x is not
    finite (its values are not compared)."""
    known: list[str | None] = []
    if got is None:
        one_reverse_product(prob, anywhere=True, ops=ops,
                            forward=known if first == "fwd" else None)
        why = "the point x holds a NaN or an infinity"
    else:
        known = [wrong_forward([o for o in got[0] if o.requires_grad])] if first == "fwd" else []
        why = ("a reverse product holds a NaN or an infinity (from a tensor f reads but "
               "does not differentiate: an argument, or a weight it captured)")
    if known and known[0] is not None:  # (NOTE [forward mode through a wrong formula])
        try:
            rev = route("rev")
        except Exception as err:  # noqa: BLE001 - no reverse route: forward's result
            if passes_through(err):
                raise
        else:
            warn_once((prob.call, named[0], "fwd", "known"),
                      auto_forward_message(prob.call, named[1], known[0])
                      + unchecked_words(why), JacobianWarning)
            first, res = ("rev-loop" if rev.looped else "rev"), rev
    return unchecked_route(prob.call, first, res, ops[0] if ops else None, route, named, why)


R = TypeVar("R")


def agreeing_route(
    prob: Problem, first: str, result: R, gap_of: Callable[[R], tuple[float, float]],
    route: Callable[[str], R], keep: Callable[[str], None], named: tuple[Hashable, str],
    option: str, rtol: float,
    on_none: Callable[[Sequence[str], float, float], None] | None = None,
) -> R:
    """The route decision of NOTE [auto, checked once], for dense and sparse Jacobians
    alike: ``result`` (of route ``first``) where ``gap_of`` finds it agrees with the
    reverse product within ``rtol``; else the first of ``route("rev")`` (after forward
    mode) and ``route("rev-loop")`` that agrees, with a one-time warning naming f
    (``named``: its key and name; ``option``: the argument the warning names); ``result``
    where none agrees (f is random, or not smooth here), after ``on_none`` (given the
    routes computed, the difference and the scale), which may raise instead. ``keep``
    remembers the route taken."""
    diff, scale = gap_of(result)
    if diff <= rtol * scale:  # the common case
        keep(first)
        return result
    tried = []
    # (after the loop, "rev-loop", no other route is left: f changes on each call)
    for name in {"fwd": ("rev", "rev-loop"), "rev": ("rev-loop",)}.get(first, ()):
        try:
            alt = route(name)
        except Exception as err:  # noqa: BLE001 - no safer route: the next one, or result
            if passes_through(err):
                raise
            continue
        tried.append(name)
        alt_diff, alt_scale = gap_of(alt)
        if alt_diff > rtol * alt_scale:
            continue
        keep(name)
        warn_once(
            (prob.call, named[0], first, name),
            wrong_route_message(prob.call, named[1], first, name, diff, scale, option),
            JacobianWarning,
        )
        return alt
    if on_none is not None:
        on_none(tried, diff, scale)
    keep(first)
    warn_once((prob.call, named[0], first, "none"),
              no_route_message(prob.call, named[1], first, diff, scale, option),
              JacobianWarning)
    return result


#: Backward nodes of ops that can change a dtype: casts, and copies into a buffer of
#: another dtype (``buf.copy_(x)``, ``buf[:] = x``).
_CASTS = frozenset({"ToCopyBackward0", "CopyBackwards", "CopySlices"})


def least_of(dtypes: Iterable[torch.dtype], default: torch.dtype | None = torch.float64
             ) -> torch.dtype | None:
    """The least precise floating dtype among ``dtypes`` (largest ``eps``), else ``default``.

    Example:
        >>> least_of([torch.int64, torch.float64, torch.float32])
        torch.float32
    """
    return min((d for d in dtypes if d.is_floating_point),
               key=lambda d: -torch.finfo(d).eps, default=default)


def cast_dtype(node: Any, least: torch.dtype) -> torch.dtype:
    """``least``, or the floating dtype a cast node of a graph (:data:`_CASTS`) computes in
    where that one is less precise."""
    if type(node).__name__ in _CASTS:
        try:
            least = least_of((least, *(m.dtype for m in node._input_metadata)))
        except (AttributeError, RuntimeError, TypeError):
            pass
    return least


def least_precise(outs: Sequence[Tensor], ins: Sequence[Tensor]) -> torch.dtype:
    """The least precise floating dtype the graph from ``ins`` to ``outs`` computes in: a
    float32 step inside a float64 function (the RMSNorm of Llama and T5 casts to float32)
    rounds at float32's, so routes that sum in another order differ at float32's rounding,
    and the comparison of routes must allow that."""
    least = least_of(t.dtype for t in (*outs, *ins))
    for node in graph_nodes(outs):
        least = cast_dtype(node, least)
    return least


def tolerance(dtype: torch.dtype) -> float:
    """The relative difference taken for rounding: ``sqrt(eps)`` of ``dtype`` (here, and
    for a Hessian's symmetry).

    Example:
        >>> tolerance(torch.float64) < 1e-7 < tolerance(torch.float32) < 1e-3
        True
    """
    return math.sqrt(torch.finfo(dtype).eps)
