"""The strategy engine: every block of a Jacobian, by reverse mode (one VJP per output
element) or forward mode (one JVP per input element), vectorised or in a loop, and the
``"auto"`` choice with its fallbacks.

NOTE [auto fallback]
The vectorised strategies run on torch.func (``vjp``/``jvp`` under ``torch.vmap``), as
``torch.func.jacrev``/``jacfwd`` do. The loop strategies compute one product at a time with
torch.func's ``vjp``/``jvp`` without vmap, which avoids vmap's limits (a custom
``autograd.Function`` without vmap support, ``.item()`` or Python control flow on values
inside a custom backward); where torch.func cannot run ``f`` at all (a custom Function
without ``setup_context``, NumPy calls), they use plain autograd (``torch.autograd.grad``,
``torch.autograd.forward_ad``), at top level only, since that does not compose with outer
transforms. ``strategy="auto"`` runs the vectorised strategy; if that raises, it runs the
loop strategy of the same mode, which runs ``f`` without vmap: if the loop raises too, that
error (``f``'s own, or autograd's) propagates untouched; if not, the vectorised failure was a
transform limitation, and a one-time :class:`~torch_vjp.JacobianWarning` quotes it (NOTE
[one fallback policy] in :mod:`torch_vjp._engine.rows`). When forward mode fails even in the
loop (an operator or custom Function without a forward-mode formula), ``"auto"`` switches to
reverse mode, also with a one-time warning. Out-of-memory errors and torch_vjp's own errors
are never caught.

NOTE [a probe f cannot answer]
``"auto"`` chooses the mode by the output size, which it reads from one plain call of ``f``
(the probe: the copies of the primals, no transform around them). Some functions answer only
when differentiated: one that takes the gradient of its own input with plain autograd
(``torch.autograd.grad(u(x), x, create_graph=True)``, as physics-informed losses do) needs
an input that requires grad, which reverse mode gives it and the probe does not. Where the
probe fails, ``"auto"`` takes reverse mode, which needs no sizes in advance; an error of f's
own comes from there again, untouched (one more call of f, on the error path only: reverse
mode's raising the probe's error again, same type and message, is not taken for vmap's, and
the loops, which would call f again each, are not tried).

NOTE [auto's extra calls draw what the products draw]
``"auto"`` calls f more often than the products need: a probe for the output sizes, and,
the first time for a function and input signature, one reverse product without vmap to
check the vectorised result (NOTE [auto, checked once]). For an f that draws random numbers
(dropout in training mode) each call drew new numbers: the products differentiated the
second draw, not the one a plain call of f at the caller's generator state makes (as
torch.func.jacrev's does), the check compared two draws and warned that no route agreed, and
the generators ended two or three calls on. So the probe puts the generators back, and
the check (and any route it tries) starts from the state the products started from; the
generators end as the products left them, one call of f on. Only where f is probed or
checked: the first call of a signature. The torch.Generator objects f reaches (its closure,
globals, modules: :func:`torch_vjp._function_calls.generators`, as check_function finds
them) and NumPy's and Python's global generators are put back alike: an f drawing from them
had the same wrong draw and warning. (A search of f's objects and a copy of NumPy's state:
tens of microseconds, on that first call only; the loops and hessian's probe, which run on
every call, keep torch's global generators alone.)

NOTE [per-call overhead]
torch.func.jacrev and jacfwd cost little more than the vmapped products themselves, so
every microsecond of Python around the products shows in the ratio to them on small and
medium Jacobians. The vectorised strategies therefore take a direct path in the common
case (every product in one chunk): the basis is one ``torch.eye``, the products one
``vmap`` call whose stacked result is used as it is (a view of it per block, no copy), and
nothing is flattened where the structure is a single tensor. With one differentiated
tensor, reverse mode uses torch.func's ``_vjp_with_argnums(argnums=0)``, as jacrev does:
its pullback returns a tensor rather than a 1-tuple, which vmap handles with less pytree
work. For ``batch_jacobian`` the basis vectors repeated over the batch are materialised
rather than broadcast (a stride-0 batch dimension makes the first matmul of every product
run as a loop of small matrix products, each copying its operand; materialised, it is one
matrix product): this is the memory that NOTE [memory model] already counts per product;
benchmarks/bench_jacobian.py times batch_jacobian against vmap(jacrev(f_single)) (B = 64,
32 -> 32 MLP). Several chunks, loops and batched aux values go through :func:`map_rows`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_map_only

from torch_vjp._engine.autoknown import stale
from torch_vjp._engine.blocks import Blocks
from torch_vjp._engine.context import (captured_tensors, forward_level_of_another_thread,
                                      is_nested)
from torch_vjp._engine.kept import moved_message, put_back
from torch_vjp._engine.fwdcheck import (
    CHECKED,
    checked_route,
    route_key,
    signature,
)
from torch_vjp._engine.plain import fwd_plain, rev_plain
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.products import _fwd, _rev
from torch_vjp._engine.rows import (
    SameDraws,
    own_generators,
    passes_through,
    run_with_fallback,
)
from torch_vjp._engine.refusals import (
    VMAP_CAUSES,
    forward_fix,
    forward_refusal,
    refusal_fix,
    refusal_kind,
    unbatched_op,
    vmap_refusal,
    writes_into_input,
)
from torch_vjp._engine.shapes import (
    Opts, Shapes, StaleShapes, chunk_for, in_rows, probe_shapes,
)
from torch_vjp._engine.wrongops import plain_forward_message, wrong_plain
from torch_vjp._errors import (
    JacobianWarning,
    StrategyError,
    StrategyNotImplementedError,
    quote_error, warn_once,
)
from torch_vjp._strategies import choose_mode

__all__ = [
    "func_refusal",
    "JACOBIAN_ALTERNATIVES", "NoForwardMode", "jacobian_blocks", "function_key",
    "function_name", "fallback_message", "no_forward_message",
]

JACOBIAN_ALTERNATIVES = (
    "torch_vjp.vjp / torch_vjp.jvp give products of the Jacobian with vectors without "
    "forming it (batched=True for many at once); torch_vjp.batch_jacobian gives only the "
    "per-example blocks when f maps a batch row by row; a smaller argnums (or fewer "
    "outputs) gives a smaller block; or pass a larger max_memory if the memory is there."
)


def function_key(f: object) -> object:
    """What identifies ``f`` for one-time warnings: its code object (the same for every
    lambda made by one line), or its type; a classmethod by its class too (``Fn.apply`` of
    every custom Function has one code object)."""
    owner = getattr(f, "__self__", None)
    if isinstance(owner, type):
        return (getattr(f, "__code__", None), owner)
    code = getattr(f, "__code__", None)
    if code is None:
        code = getattr(getattr(f, "forward", None), "__code__", None)
    return code if code is not None else type(f)


def function_name(f: object) -> str:
    """``f``'s name for messages: its qualified name (a classmethod's with its class:
    ``Exp.apply``, not ``Function.apply``), or its type's name."""
    owner = getattr(f, "__self__", None)
    if isinstance(owner, type):
        return f"{owner.__qualname__}.{getattr(f, '__name__', 'apply')}"
    name = getattr(f, "__qualname__", None) or getattr(f, "__name__", None)
    return str(name) if name else type(f).__name__


def jacobian_blocks(
    prob: Problem,
    mode: str | None,
    *,
    vectorized: bool,
    fallback: bool,
    chunk_size: int | None,
    max_memory: int | None,
    batch: int | None = None,
    probe: Callable[[], tuple[list[Tensor], TreeSpec]] | None = None,
    alternatives: str = JACOBIAN_ALTERNATIVES,
    functorch_loops: bool = False,
    detached: bool = False,
    vmap_single: bool = False,
    hessian: str | None = None,
) -> Blocks:
    """Computes every block of the Jacobian of ``prob.g``.

    Args:
        prob: the function of the differentiated leaves.
        mode: ``"rev"``, ``"fwd"``, or ``None`` to choose by size (``"auto"``).
        vectorized: products under ``torch.vmap`` (else a Python loop).
        fallback: on a failure of the vectorised products, fall back as NOTE [auto
            fallback] says (``"auto"``).
        chunk_size: products at once (checked), or None.
        max_memory: the budget in bytes, or None for the free memory.
        batch: for ``batch_jacobian``: the batch size B; basis vectors are broadcast over
            the batch and blocks are ``(B, *out_row, *in_row)``.
        probe: returns the flat outputs (tensors or meta tensors of the right shapes) and
            their structure without computing derivatives; ``prob.probe`` by default.
            Forward mode needs the output sizes before it runs, for the memory plan.
        alternatives: the alternatives named by a :class:`JacobianMemoryError`.
        functorch_loops: loops use torch.func's vjp/jvp (composable with outer transforms,
            as the inner Jacobian of a Hessian needs) rather than plain autograd.
        detached: the result needs no autograd graph (NOTE [no graph outlives its chunk]).
        vmap_single: in reverse mode, run even a single product under vmap, as
            torch.func.jacrev does (NOTE [the gradient inside a Hessian] in :mod:`torch_vjp._engine.hessian`).
        hessian: for the gradient inside a Hessian, the strategy the Hessian was asked for
            (NOTE [a Hessian through a wrong backward] in :mod:`torch_vjp._engine.wrongops`).

    Returns:
        The blocks, the output structure, the aux value and the mode used.
    """
    opts = Opts(batch, chunk_size, max_memory, alternatives, probe, detached, vmap_single)
    if hessian is not None:
        opts.hessian = (function_name(prob.f), hessian)
    if mode is not None and not fallback and not functorch_loops:
        # NOTE [named reverse strategies and wrong formulas]
        opts.named = (function_name(prob.f), function_key(prob.f))
    watched = () if is_nested() else captured_tensors(prob.f)  # (buffers_kept's)
    versions = [t._version for t in watched]
    calls = prob.calls
    try:
        try:
            blocks = _blocks(prob, mode, vectorized, fallback, opts, functorch_loops)
        except StaleShapes:  # remembered output sizes were wrong: they are gone now
            blocks = _blocks(prob, mode, vectorized, fallback, opts, functorch_loops)
    except RuntimeError as err:
        # NOTE [f writes into its input]: reverse mode differentiates against the input
        # tensor itself, and autograd refuses an in-place write into a tensor that requires
        # grad and has no history; forward mode and f's own semantics allow it. The
        # products are taken again with f given a copy of each differentiated input (the
        # write lands in the copy, and the derivative flows through the copy). "auto" and
        # every strategy that torch.func.jacfwd or a plain backward would run do this.
        if not writes_into_input(err) or prob.writes_inputs:
            raise
        prob.writes_inputs = True
        blocks = _blocks(prob, mode, vectorized, fallback, opts, functorch_loops)
    if detached and blocks.aux is not None:
        # (as reverse mode's: no graph outlives the call, aux's included; forward mode's
        # aux kept one, through a chunk's batched copy of the forward pass)
        blocks.aux = tree_map_only(Tensor, lambda t: t.detach(), blocks.aux)
    moved = [t for t, v in zip(watched, versions) if t._version != v]
    several = prob.calls - calls > 1  # (NOTE [what a call puts back], in kept.py)
    if moved and (several or not all(put_back(t) for t in moved)):
        warn_once(("captured-changed", function_key(prob.f)),
                  moved_message(prob.call, function_name(prob.f), several), JacobianWarning)
    return blocks


def _blocks(
    prob: Problem,
    mode: str | None,
    vectorized: bool,
    fallback: bool,
    opts: Opts,
    functorch_loops: bool,
) -> Blocks:
    read: list[Shapes] = []
    opts.remembered = None
    res = _blocks_of(prob, mode, vectorized, fallback, opts, functorch_loops, read)
    if opts.remembered is not None and stale(opts.remembered[1]):
        CHECKED.pop(opts.remembered[0], None)  # NOTE [a remembered route through a known
        opts.remembered, read = None, []  # wrong operator]: checked again
        res = _blocks_of(prob, mode, vectorized, fallback, opts, functorch_loops, read)
    if read and res.mode == "rev":
        # reverse mode does not check remembered output sizes (NOTE [output sizes]) as it
        # goes: sizes it found changed are forgotten, and the next call's mode is chosen on
        # the real ones (f's output grew past its input, a global rebound, say)
        per_row = math.prod(in_rows(prob, opts.batch)[0]) if prob.leaves else 0
        if per_row:
            read[0].forget_unless([row[0].numel() // per_row for row in res.blocks])
    return res


def _blocks_of(prob: Problem, mode: str | None, vectorized: bool, fallback: bool, opts: Opts,
               functorch_loops: bool, read: list[Shapes]) -> Blocks:
    """:func:`_blocks`' work; the output sizes it read (remembered or probed) go in ``read``."""
    shapes: Shapes | None = None
    check: Any = None  # NOTE [auto, checked once]: the key, if this call checks
    if mode != "rev":
        try:
            shapes = probe_shapes(prob, opts)
        except Exception as err:  # noqa: BLE001 - NOTE [a probe f cannot answer]
            if mode is not None or not fallback or passes_through(err):
                why = (None if passes_through(err) or fallback or not vectorized
                       else vmap_refusal(err))
                if why is not None:  # (a probe under torch.func: hessian's gradient)
                    raise func_refusal(prob, mode or "fwd", why, err) from None
                raise
            probe_error: Exception | None = err
        else:
            probe_error = None
        if probe_error is not None:  # (outside the except: f's error, raised again by
            # reverse mode, comes without the probe's chained to it)
            if not vectorized:
                return _blocks_of(prob, "rev", vectorized, fallback, opts, functorch_loops,
                                  read)
            return _auto(prob, "rev", None, opts, functorch_loops, probe_error=probe_error)
        read.append(shapes)
        if mode is None:
            n_in = sum(math.prod(s) for s in in_rows(prob, opts.batch))
            mode = choose_mode(n_in, sum(math.prod(s) for s in shapes.rows))
            if fallback and vectorized and not is_nested():
                # (with the mode the sizes chose: a route remembered for a wide Jacobian is
                # not one for a tall Jacobian of the same function and input shapes, whose
                # output size changed; and with argnums: a route checked against one primal
                # ran the backward formulas of that primal's path through f only, and the
                # primals' shapes alone do not tell which primal was differentiated)
                check = (signature(route_key(prob.f), prob.leaves, opts.batch,
                                   prob.primals), mode, prob.argnums)
                if _one_at_a_time(prob, mode, shapes, opts):
                    check += ("one at a time",)  # NOTE [a chunk of one checks no vmap]
                route = CHECKED.get(check)
                if route is not None:
                    opts.remembered = (check, [])
                    if route.endswith("-loop"):  # ("rev-loop", or "fwd-loop": NOTE [a
                        # reverse product checked forward] in revcheck.py)
                        return _loop(prob, route[:3], shapes, opts, functorch_loops)
                    mode, check = route, None
    if check is not None and torch.is_inference_mode_enabled():
        # (no reverse product to check against there, and the route is not remembered:
        # checked_route returns the result as it is, on every call, so nothing is drawn
        # again and nothing is put back)
        return _auto(prob, mode, shapes, opts, functorch_loops)
    if check is not None:
        own = own_generators(prob)  # NOTE [auto's extra calls draw what the products draw]
        first = SameDraws(own, host=True)
        first()
        res = _auto(prob, mode, shapes, opts, functorch_loops)
        after = SameDraws(own, host=True)
        after()
        first()

        def route(name: str) -> Blocks:
            first()
            if name.endswith("-loop"):
                return _loop(prob, name[:3], shapes, opts, functorch_loops)
            if name == "fwd":  # (vectorised only: "fwd-loop" is the next route tried)
                return _vectorized(prob, "fwd", shapes, opts)
            return _auto(prob, "rev", shapes, opts, functorch_loops)

        try:
            return checked_route(prob, res, opts.batch, check, route,
                                 (function_key(prob.f), function_name(prob.f)), first)
        finally:
            after()
    if not vectorized:
        try:
            return _loop(prob, mode, shapes, opts, functorch_loops)
        except NotImplementedError as err:
            refusal = None if mode != "fwd" else fwd_loop_refusal(prob, err)
            if refusal is None:
                raise
            raise refusal from None
    if not fallback:
        try:
            return _vectorized(prob, mode, shapes, opts)
        except Exception as err:  # noqa: BLE001 - torch.func's known refusals are explained
            why = None if passes_through(err) else vmap_refusal(err)
            op = None if passes_through(err) else unbatched_op(err)
            if why is None and op is not None:
                raise no_batching_rule(prob, mode, op, err, opts.hessian) from None
            if why is None and mode == "fwd" and not passes_through(err):
                why = forward_refusal(err)
                if why is not None:
                    raise StrategyNotImplementedError(
                        f"{prob.call}: strategy='fwd' computes with forward-mode AD, and "
                        f"{why}.\n  torch said: {quote_error(err)}\n"
                        f"  Fix: strategy='rev' or 'auto' (reverse mode needs only backward "
                        f"formulas){_or_fix(err)}."
                    ) from None
            if why is None:
                raise
            raise func_refusal(prob, mode, why, err) from None
    return _auto(prob, mode, shapes, opts, functorch_loops)


# NOTE [a chunk of one checks no vmap]
# A chunk of one product is a plain call, with no vmap (as torch.func.jacrev's
# chunk_size=1): its result agrees with the check's reverse product even where a batching
# rule is wrong (torch.cdist's backward), and a route remembered from it told later calls
# with larger chunks (chunk_size=None, a larger max_memory) that vmap had been checked for
# the function and signature: they returned the vmapped Jacobian unchecked, wrong. So calls
# whose products run one at a time are checked and remembered under a key of their own.


def _one_at_a_time(prob: Problem, mode: str, shapes: Shapes, opts: Opts) -> bool:
    """Whether the products of ``mode`` run one at a time, never under vmap: in chunks of
    one (``chunk_size=1``, or all the budget leaves room for). NOTE [a chunk of one checks
    no vmap]. (A small request without options plans nothing, NOTE [memory model]; a large
    one reads the free memory, as its products do.)"""
    records = shapes.records if mode == "fwd" else False
    return chunk_for(prob, mode, shapes.rows, [o.dtype for o in shapes.flat], opts,
                     records) == 1


def fwd_loop_refusal(prob: Problem, err: BaseException) -> Exception | None:
    """The error of strategy "fwd-loop" where forward-mode AD has no formula for an operator
    in f (``err``, what torch raised), or None for any other error."""
    why = None if passes_through(err) else forward_refusal(err)
    if why is None:
        return None
    return StrategyNotImplementedError(
        f"{prob.call}: strategy='fwd-loop' computes with forward-mode AD, and {why}.\n"
        f"  torch said: {quote_error(err)}\n"
        f"  Fix: strategy='rev-loop' or 'auto' (reverse mode needs only backward "
        f"formulas){_or_fix(err)}."
    )


def _or_fix(err: BaseException) -> str:
    """The fix besides reverse mode of forward mode's refusal ``err``, as a clause: a jvp
    staticmethod for a custom Function only (a torch operator has none to give), the math
    kernel for fused attention."""
    fix = forward_fix(err)
    return "" if fix is None else f", or {fix}"


def no_batching_rule(prob: Problem, mode: str, op: str, err: BaseException,
                     hessian: tuple[str, str] | None = None) -> StrategyError:
    """The error of strategy ``mode`` ("fwd" or "rev", vectorised with torch.vmap) where
    vmap has no batching rule for the operator ``op`` in f (or in its backward);
    ``hessian``: f's name and the Hessian's strategy, where this is the gradient inside a
    Hessian (whose message names the strategy the caller passed, not the gradient's)."""
    if hessian is not None:
        name, strategy = hessian
        loop = strategy if strategy.endswith("-loop") else f"{strategy}-loop"
        return StrategyError(
            f"{prob.call}: strategy={strategy!r} computes the Hessian's products with "
            f"torch.vmap (the gradient it differentiates, and the outer Jacobian's rows), "
            f"which has no batching rule for aten::{op}, used in f ({name}), so it cannot "
            f"batch them.\n"
            f"  torch.vmap said: {quote_error(err)}\n"
            f"  Fix: strategy={loop!r} (one product at a time, without vmap)."
        )
    where = "f" if mode == "fwd" else "f's backward"
    return StrategyError(
        f"{prob.call}: strategy='{mode}' computes all {mode}-mode products at once with "
        f"torch.vmap, which has no batching rule for aten::{op}, used in {where} "
        f"({function_name(prob.f)}), so it cannot batch the products.\n"
        f"  torch.vmap said: {quote_error(err)}\n"
        f"  Fix: strategy='{mode}-loop' (one product at a time, without vmap)."
    )


def func_refusal(prob: Problem, mode: str, why: str, err: BaseException,
                 choices: str = "'auto', 'rev-loop' or 'fwd-loop'") -> StrategyError:
    """The error of a vectorised strategy that torch.func refuses to run ``f`` in (``why``:
    :func:`~torch_vjp._engine.refusals.vmap_refusal` of ``err``); ``choices``: the
    strategies that compute such a function there (a sharded call: "auto" and "rev-loop")."""
    return StrategyError(
        f"{prob.call}: the vectorised strategies compute with torch.func, which "
        f"cannot run f ({function_name(prob.f)}) in {mode}-mode products: {why}\n"
        f"  torch.func said: {quote_error(err)}\n"
        f"  Fix: strategy={choices} (they compute such a "
        f"function with plain autograd or one product at a time), or "
        + refusal_fix(err)
    )


def _vectorized(prob: Problem, mode: str, shapes: Shapes | None, opts: Opts) -> Blocks:
    if mode == "rev":
        return _rev(prob, opts, vectorized=True)
    return _fwd(prob, shapes or probe_shapes(prob, opts), opts, vectorized=True)


def _loop(
    prob: Problem, mode: str, shapes: Shapes | None, opts: Opts, functorch: bool
) -> Blocks:
    """One product at a time: with torch.func (composable with outer transforms, like
    ``torch.func.jacrev(chunk_size=1)``), or, at top level where torch.func cannot run ``f``
    at all (an old-style custom Function, NumPy), with plain autograd."""

    def with_func() -> Blocks:
        if mode == "rev":
            return _rev(prob, opts, vectorized=False)
        return _fwd(prob, shapes or probe_shapes(prob, opts), opts, vectorized=False)

    if functorch or is_nested() or _forward_ad_active(prob.leaves):
        return with_func()
    try:
        return with_func()
    except Exception as err:  # noqa: BLE001 - torch.func's refusals go to plain autograd
        # (only those: an error of f's own propagates after one call, untouched)
        if passes_through(err) or (refusal_kind(err) is None and vmap_refusal(err) is None):
            raise
    if mode == "rev":
        if opts.named is not None:  # (a named strategy: NOTE [named reverse strategies
            return rev_plain(prob, opts)  # and wrong formulas])

        def forward_instead(op: str) -> Blocks:  # NOTE [a plain loop through a wrong
            # backward]
            name = function_name(prob.f)
            try:
                res = fwd_plain(prob, shapes or probe_shapes(prob, opts), opts)
            except Exception as err:  # noqa: BLE001 - no forward mode either: refused
                if passes_through(err):
                    raise
                raise wrong_plain(prob.call, op, name, err) from None
            warn_once(("auto plain, wrong backward", function_key(prob.f)),
                      plain_forward_message(prob.call, op, name), JacobianWarning)
            res.forward_instead = True  # (the check compares it with no reverse product)
            return res

        return rev_plain(prob, opts, forward_instead)
    return fwd_plain(prob, shapes or probe_shapes(prob, opts), opts)


def _forward_ad_active(leaves: Sequence[Tensor]) -> bool:
    """Whether plain forward-mode AD is running around us (then plain loops would break
    it: it does not nest); not a level another thread's product opened (NOTE [forward
    mode, one thread at a time])."""
    if getattr(fwAD, "_current_level", -1) >= 0 and not forward_level_of_another_thread():
        return True
    return any(fwAD.unpack_dual(x).tangent is not None for x in leaves)


class NoForwardMode(Exception):
    """Forward mode failed even in the loop: ``"auto"`` switches to reverse mode."""

    def __init__(self, err: Exception) -> None:
        super().__init__(str(err))
        self.err = err


def _auto(
    prob: Problem, mode: str, shapes: Shapes | None, opts: Opts, functorch: bool,
    probe_error: Exception | None = None,
) -> Blocks:
    """The vectorised strategy, then its loop, then (from forward mode) reverse mode.
    See NOTE [auto fallback]. ``probe_error``: the error of the shape probe that sent
    'auto' to reverse mode (NOTE [a probe f cannot answer]); reverse mode raising it again
    is f's own error, and propagates without the loops (each would call f once more)."""
    failed: list[Exception] = []
    taken: list[str] = []  # (the loop's mode: plain forward where reverse meets a wrong formula)

    def vectorized() -> Blocks:
        try:
            return _vectorized(prob, mode, shapes, opts)
        except Exception as err:  # noqa: BLE001 - only noted, re-raised at once
            failed.append(err)
            raise

    def loop() -> Blocks:
        if probe_error is not None and failed and type(failed[0]) is type(probe_error) \
                and str(failed[0]) == str(probe_error):
            raise failed[0]
        try:
            res = _loop(prob, mode, shapes, opts, functorch)
        except Exception as err:  # noqa: BLE001 - forward mode may yield to reverse mode
            if mode == "rev" or passes_through(err):
                raise
            raise NoForwardMode(err) from None
        res.looped = True  # (the route the check names and remembers: vmap did not run)
        taken.append("fwd" if getattr(res, "forward_instead", False) else mode)
        return res

    def warn_vmap_failed(err: Exception) -> None:  # (after the loop: the route it took)
        warn_once(
            ("vmap-fallback", function_key(prob.f), mode, type(err)),
            fallback_message(prob, mode, err, used=taken[-1] if taken else mode),
            JacobianWarning,
        )

    try:
        return run_with_fallback(vectorized, loop, on_fallback=warn_vmap_failed)
    except NoForwardMode as failed:
        loop_failure = failed.err
    warn_once(
        ("fwd-to-rev", function_key(prob.f), type(loop_failure)),
        no_forward_message(prob, loop_failure, "which may be slower for this shape"),
        JacobianWarning,
    )
    return _auto(prob, "rev", shapes, opts, functorch)


def no_forward_message(prob: Problem, err: BaseException, where: str) -> str:
    """The one-time warning that ``"auto"`` switched from forward to reverse mode;
    ``where`` completes the sentence (the cost, or on which ranks)."""
    return (
        f"{prob.call}: forward-mode AD fails on f ({function_name(prob.f)}), so "
        f"strategy='auto' uses reverse mode instead, {where}.\n"
        f"  Forward mode said: {quote_error(err)}\n"
        f"  Pass strategy='rev' to skip the forward-mode attempts. This warning is shown "
        f"once per function."
    )


def fallback_message(prob: Problem, mode: str, err: BaseException, who: str = "it",
                     used: str | None = None) -> str:
    """The one-time warning that ``"auto"`` fell back from vmap to the loop; ``who`` ran
    the loop (``"this rank"`` for a sharded Jacobian); ``used``: the loop's mode, where not
    ``mode`` (plain forward mode, NOTE [a plain loop through a wrong backward])."""
    used = used or mode
    loop = f"{used}-loop"
    unit = "JVP per input element" if used == "fwd" else "VJP per output element"
    why = vmap_refusal(err)  # (a known refusal is named, not among the typical causes)
    causes = f"That is: {why}." if why is not None else f"Typical causes: {VMAP_CAUSES}."
    return (
        f"{prob.call}: strategy='auto' could not vectorise the Jacobian of "
        f"{function_name(prob.f)} (strategy={mode!r}: torch.func transforms under "
        f"torch.vmap), so {who} used strategy={loop!r}"
        + ("" if used == mode else " (reverse mode meets a backward formula torch computes "
           "wrongly, see the other warning)")
        + f": one {unit} at a time in a Python loop, usually many times slower.\n"
        f"  The vectorised attempt said: {quote_error(err)}\n"
        f"  {causes} Pass strategy={loop!r} to skip the vectorised "
        f"attempt. This warning is shown once per function."
    )
