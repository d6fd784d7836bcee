"""Sparse Jacobians: detect which entries can be non-zero, colour the columns (or rows) so
that structurally orthogonal ones share a product, and compute the whole Jacobian with one
JVP (or VJP) per colour instead of one per column (row).

Shape convention: both functions treat ``f`` as a map of flat vectors, ``R^n -> R^m``: column
``j`` is element ``j`` of ``x`` flattened (for a tuple, list or dict ``x``, its tensor leaves
flattened and concatenated in pytree order), row ``i`` is element ``i`` of ``f``'s output
flattened the same way. ``J.to_dense().view(*y.shape, *x.shape)`` is ``torch.func``'s layout
for a single tensor in and out.

Cost: detection runs ``f`` once under a dispatch mode that tracks index sets, colouring is a
Python loop over the non-zeros; both are done once per function and input signature and
cached. A call afterwards costs one vectorised batch of ``colours`` JVPs (or VJPs), where
``colours`` is at least the largest number of non-zeros in a row (column): 3 for a
tridiagonal Jacobian, whatever its size. See the docs page "Sparse Jacobians".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from torch_vjp._engine.context import buffers_kept, is_nested
from torch_vjp._engine.memory import check_chunk_size, parse_max_memory
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.fwdcheck import (
    agreeing_route,
    all_finite,
    gap,
    least_precise,
    route_key,
    one_reverse_product,
    tolerance,
)
from torch_vjp._engine.fwdnoise import reverse_noise, rounding_scale
from torch_vjp._engine.revcheck import reverse_wrong
from torch_vjp._engine.jacobian import (
    function_key,
    function_name,
    no_forward_message,
)
from torch_vjp._engine.refusals import vmap_refusal, writes_into_input
from torch_vjp._engine.rows import SameDraws, passes_through
from torch_vjp._errors import (JacobianCallError, JacobianOptionError, JacobianWarning,
                               StrategyError, a_type,
                               quote_error, shape_str, warn_once)
from torch_vjp._sparse.compute import (
    assemble,
    clear_plans,
    compressed,
    compressed_plain,
    lookup_plan,
    user_plan,
)
from torch_vjp._sparse.detect import detect
from torch_vjp._sparse.guard import blamed_op, first_use_route, warn_forward
from torch_vjp._sparse.pattern import LAYOUTS, pattern_from_user
from torch_vjp._sparse.words import explain_refusal, warn_batching, wrong_reverse_words
from torch_vjp._sparse.probe import (
    batching_wrong,
    graph_flags,
    linear,
    misses_message,
    outside_pattern,
    probe_rows,
    stale_rows,
    users_pattern_misses,
    warn_changed,
)

__all__ = ["jacobian_sparsity", "sparse_jacobian", "clear_cache"]

SparseMode = Literal["auto", "fwd", "rev"]
_MODES = {
    "auto": ("the mode with fewer colours (products), reverse mode on a tie or where forward "
             "mode fails or is wrong"),
    "fwd": "colour the columns, one JVP per colour",
    "rev": "colour the rows, one VJP per colour",
}


def _warn_by_value(prob: Problem, op: str) -> None:
    warn_once(
        ("sparse-by-value", function_key(prob.f)),
        f"{prob.call}: the sparsity pattern of {function_name(prob.f)} depends on the values "
        f"of x ({op}): the pattern found at one x need not hold at another, so it is "
        f"detected again on every call (one traced run of f).\n  For speed, pass pattern= a "
        f"pattern that covers every case (the union of the patterns of its branches; "
        f"torch_vjp.jacobian_sparsity(f, x) gives the one at x), or use torch_vjp.jacobian. "
        f"This warning is shown once per function.",
        JacobianWarning,
    )


def _detect(prob: Problem) -> Any:
    """The pattern of ``prob``, with the global random generators put back as detection
    found them: the products that follow draw what detection drew (a pattern shaped by a
    random number read into Python, ``u.roll(int(torch.randint(...)))``, detected at each
    call, is then the pattern of the products' draw). (Where ``mode="auto"`` computes again
    by another route, or checks its result, ``f`` runs more than once and draws more.)"""
    draws = SameDraws()
    draws()  # (keeps the state)
    try:
        return detect(prob)
    finally:
        draws()  # (puts it back)


def _problem(f: Callable[..., Any], x: Any, call: str) -> Problem:
    if is_nested():
        raise JacobianCallError(
            f"{call}: called inside a torch.func transform (vmap, grad, jacrev, ...). Sparse "
            f"tensors cannot be batched or differentiated by those transforms, so {call} "
            f"runs at top level only. Fix: call it outside the transform, or use "
            f"torch_vjp.jacobian inside it."
        )
    if isinstance(x, (tuple, list, dict)) and not tree_leaves(x):
        # (the engine's message speaks of argnums, which these functions do not take)
        what = f"an empty {type(x).__name__}" if not x else f"{a_type(x)} of empty containers"
        raise JacobianCallError(
            f"{call}: x is {what}, so it holds no tensors, but the Jacobian has "
            f"one column per element of x: x must be a floating-point tensor, or a tuple, "
            f"list or dict of them. Fix: pass the tensor(s) to differentiate f with respect "
            f"to as x, and bind the rest inside f (functools.partial or a lambda)."
        )
    return Problem(f, (x,), 0, has_aux=False, call=call, detached=True, aux=False, named="x")


def jacobian_sparsity(f: Callable[..., Any], x: Any) -> Tensor:
    """The sparsity pattern of the Jacobian of ``f`` at ``x``: which output elements can
    depend on which input elements. Runs ``f`` once, under a dispatch mode that propagates
    index sets through every aten op it calls.

    The pattern is conservative: it contains every entry that automatic differentiation
    can make non-zero along the branches ``f`` takes at ``x``; an op without a sparsity
    rule makes its outputs depend on all its inputs (with a one-time
    :class:`~torch_vjp.JacobianWarning` naming it). Constants' zeros (a weight matrix's) are
    structural. Not cached: every call detects.

    Args:
        f: a function of ``x`` returning a tensor, or a tuple, list or dict of tensors.
        x: a floating-point tensor, or a tuple, list or dict of them.

    Returns:
        A coalesced boolean ``torch.sparse_coo`` tensor of shape ``(m, n)`` (``m`` output
        elements, ``n`` input elements, both flattened; see the module docstring), on the
        device of ``x``.

    Raises:
        JacobianCallError: ``x`` holds a tensor that cannot be differentiated, or ``f``
            returns something other than floating-point tensors.

    Example:
        >>> x = torch.randn(5)
        >>> p = tv.jacobian_sparsity(lambda u: u[1:] - u[:-1], x)  # differences
        >>> p.shape, p.to_dense().int().tolist()[0]
        (torch.Size([4, 5]), [1, 1, 0, 0, 0])
        >>> p.values().numel()
        8
    """
    call = "torch_vjp.jacobian_sparsity"
    prob = _problem(f, x, call)
    return detect(prob).to_tensor(prob.leaves[0].device)


def sparse_jacobian(
    f: Callable[..., Any],
    x: Any,
    *,
    pattern: Tensor | None = None,
    mode: SparseMode = "auto",
    layout: torch.layout = torch.sparse_csr,
    chunk_size: int | None = None,
    max_memory: int | str | None = None,
) -> Tensor:
    """The Jacobian of ``f`` at ``x`` as a sparse ``(m, n)`` matrix: one JVP per colour of
    the columns (or one VJP per colour of the rows), vectorised with vmap, instead of one per
    column (row).

    The pattern (detected as :func:`jacobian_sparsity` does, or ``pattern``) is coloured so
    that columns (rows) of one colour share no row (column); the products with the colours'
    seed vectors hold every non-zero, which are then gathered into the result. Pattern and
    colourings are cached per function object and input signature (structure of ``x``, and
    each leaf's shape, strides, dtype and device; and the training flags of the modules
    ``f`` reaches): the first call detects and colours, later calls
    only compute. The tensors whose values shaped the pattern (a weight whose zeros it took
    as structural, an index or mask buffer, a tensor ``f`` reads a number from) are
    watched (a copy of their values is kept): written in place (an optimizer's step,
    ``load_state_dict``, ``w.data.copy_``) or given other ``.data``, the next call
    detects again. Any other change of ``f``'s structure (another branch, on a flag the
    key does not see) is found by one product more that each call with a cached plan
    computes with the others, ``J r`` (``r^T J`` in reverse mode) for a fixed ``r``,
    compared with the same product read from the result: where they disagree, the pattern
    is detected again, with a one-time :class:`~torch_vjp.JacobianWarning`. A ``pattern``
    you pass is probed alike, in every mode: one that leaves out entries is an error.

    Args:
        f: a function of ``x`` returning a tensor, or a tuple, list or dict of tensors.
        x: a floating-point tensor, or a tuple, list or dict of them.
        pattern: the sparsity pattern, skipping detection: a tensor of shape ``(m, n)``,
            dense or in a sparse layout (``torch.sparse_coo``, ``sparse_csr``,
            ``sparse_csc``, ...), non-zero (True) where the Jacobian may be non-zero. It
            must include every non-zero: an entry it leaves out is not computed, and can
            spoil the entries that share its colour. Its colourings are kept with it.
        mode: ``"auto"`` (default: the mode that needs fewer products, reverse on a tie;
            forward mode is checked against one reverse product once per plan, and reverse
            mode taken where they disagree, as :func:`torch_vjp.jacobian`'s ``"auto"``),
            ``"fwd"`` (colour the columns, one JVP per colour) or ``"rev"`` (colour the
            rows, one VJP per colour; one colour at a time, without vmap, where ``f`` calls
            an op whose backward torch batches wrongly, ``torch.cdist``, with a one-time
            warning). Reverse mode's products read the graph of their call of ``f`` for the
            ops whose backward torch computes wrongly (torch 2.13: that of an antialiased
            ``F.interpolate`` in some of its resizes, ``torch.as_strided_scatter``'s): with
            one, ``"auto"`` computes in forward mode, with a one-time warning, and
            ``"rev"`` is refused. They are also checked on a plan's first use against a
            forward-mode product; where a central difference sides with forward mode (an op
            whose backward formula is wrong: a custom Function's, or torch's own), the
            Jacobian is computed in forward mode, with a one-time warning naming the op. A
            write at a repeated index (``out[idx] = v``, ``scatter``, ``index_copy``), where
            the modes differ by convention, keeps each mode's answer, as
            ``torch.func.jacrev`` and ``jacfwd`` give them.
        layout: of the result: ``torch.sparse_csr`` (default), ``torch.sparse_coo``,
            ``torch.sparse_csc``, or ``torch.strided`` (a dense ``(m, n)`` tensor).
        chunk_size: how many products to compute at once; ``None`` for as many as the
            memory budget allows (usually all).
        max_memory: bound on the extra memory: bytes, or a string such as ``"2GB"``. The
            chunk size is derived from it. ``None``: the memory free on the device.

    Returns:
        The ``(m, n)`` Jacobian of the flattened output with respect to the flattened input,
        detached, in the dtype of ``f``'s output (``mode="fwd"``) or of ``x``
        (``mode="rev"``), on ``x``'s device. ``.to_dense().view(*y.shape, *x.shape)`` gives
        ``torch.func.jacrev``'s layout for one tensor in and out.

    Raises:
        StrategyError: unknown ``mode``; with ``mode="fwd"`` or ``"rev"``, torch cannot
            compute those products (an operator without a forward-mode formula, a module
            that updates its running statistics, a sparse CSR constant), which ``"auto"``
            works around; ``mode="rev"`` where ``f`` scatters with
            ``torch.as_strided_scatter`` into a tensor computed from ``x``, or resizes
            it with an antialiased ``F.interpolate`` that torch differentiates wrongly
            (torch's backward of it is wrong: forward mode computes it).
        JacobianOptionError: unknown ``layout``; a ``pattern`` that is not 2-D or whose
            shape does not match ``x`` and ``f``'s output, or that leaves out non-zeros
            (found by the probe of every call, or by ``"auto"``'s check of its first
            call, f's reverse products being linear); a bad ``chunk_size`` or
            ``max_memory``.
        JacobianCallTypeError: ``pattern`` is not a tensor.
        JacobianCallError: ``x`` or ``f``'s output is not floating point; ``x`` holds no
            tensors; called inside a torch.func transform.
        JacobianMemoryError: the non-zeros do not fit ``max_memory`` (or the free memory).

    Example:
        >>> def residual(u):  # 1-d Laplacian plus a nonlinearity: tridiagonal
        ...     lap = torch.nn.functional.pad(u[2:] - 2 * u[1:-1] + u[:-2], (1, 1))
        ...     return lap - u**3
        >>> u = torch.randn(100, dtype=torch.float64)
        >>> J = tv.sparse_jacobian(residual, u)
        >>> J.layout, J.shape, J.values().numel()
        (torch.sparse_csr, torch.Size([100, 100]), 296)
        >>> torch.allclose(J.to_dense(), torch.func.jacfwd(residual)(u))
        True
    """
    call = "torch_vjp.sparse_jacobian"
    if not isinstance(mode, str) or mode not in _MODES:
        valid = "; ".join(f"{k!r}: {v}" for k, v in _MODES.items())
        raise StrategyError(f"{call}: mode={mode!r} is not a mode. Valid modes: {valid}.")
    if layout not in LAYOUTS:
        raise JacobianOptionError(
            f"{call}: layout={layout!r} is not a layout a sparse Jacobian can be returned "
            f"in. Valid layouts: torch.sparse_csr (the default), torch.sparse_coo, "
            f"torch.sparse_csc, or torch.strided for a dense (m, n) tensor."
        )
    chunk = check_chunk_size(chunk_size, call=call, what="products (colours)")
    budget = parse_max_memory(max_memory, call=call)
    prob = _problem(f, x, call)
    # (f runs for real, more than once: products, a fallback, the checks of a first call
    # and their measure of rounding; a module's running statistics are put back once for
    # all of them, as the dense functions do)
    with buffers_kept(f, primals=(x,)):
        return _sparse_jacobian(f, prob, pattern, mode, layout, chunk, budget, call)


def _sparse_jacobian(f: Callable[..., Any], prob: Problem, pattern: Tensor | None, mode: str,
                     layout: torch.layout, chunk: int | None, budget: int | None,
                     call: str) -> Tensor:
    """:func:`sparse_jacobian`'s computation, its options checked."""
    n = sum(leaf.numel() for leaf in prob.leaves)
    built: list[bool] = []
    if pattern is None:
        plan = lookup_plan(prob, lambda: built.append(True) or _detect(prob))
        if plan.pattern.by_value is not None:
            _warn_by_value(prob, plan.pattern.by_value)
    else:
        if not (
            isinstance(pattern, Tensor) and not pattern.is_nested and pattern.dim() == 2
            and pattern.shape[1] == n
        ):
            pattern_from_user(pattern, n, call=call)  # raises, saying what is wrong
        plan = user_plan(pattern, lambda: pattern_from_user(pattern, n, call=call))
    # NOTE [auto, checked once]: the route is remembered per plan and function (a user's
    # pattern serves several functions)
    fkey = route_key(f) if mode == "auto" else None
    route = plan.checked.get(fkey) if fkey is not None else None
    # (plain autograd records nothing in inference mode: no reverse product to check with,
    # and the route is not remembered, so that a call outside it checks)
    check = (mode == "auto" and route is None and not is_nested()
             and not torch.is_inference_mode_enabled())
    colour = None if route in (None, "fwd") else "rev"  # ("auto": its fallbacks stay)
    chunk_now = 1 if route == "rev-loop" else chunk
    # NOTE [a cached plan, probed] in torch_vjp._sparse.probe
    # (not on a detected plan's first call; a user's pattern on every call, "auto"'s first
    # one too: its check reads u^T J with a random u, in reverse mode as the products do,
    # and an entry (i, j) the pattern leaves out changes it by J[i, j] (u[k] - u[i]) only,
    # k the row of i's colour the plan reads in column j: under bfloat16's tolerance where
    # u[k] and u[i] are close, and one call in six returned a wrong Jacobian in bfloat16)
    # (per function for a user's pattern, which serves several: Plan.unprobed)
    pkey = (fkey if fkey is not None else route_key(f)) if plan.user else None
    # (and at a finite point only: at a NaN or an infinity the probe's products hold NaN
    # and infinities of their own, and a disagreement there turned probing off for good, so
    # a user's pattern that leaves out entries went unchecked at every later finite point)
    probe = (probe_rows(prob.leaves) if not built and plan.probes(pkey)
             and plan.pattern.by_value is None and all_finite(prob.leaves) else 0)
    before = SameDraws()  # (the generators' state before the products)
    before()
    try:
        coloring, comp, m, seed = _products(prob, plan, mode, chunk_now, budget, colour, probe)
    except RuntimeError as err:  # NOTE [f writes into its input] in torch_vjp._engine.jacobian
        if not writes_into_input(err):
            raise
        prob.writes_inputs = True
        coloring, comp, m, seed = _products(prob, plan, mode, chunk_now, budget, colour, probe)
    if probe and m == plan.pattern.m:
        comp, extras = comp[:-probe], comp[-probe:]
        # (nor where the products hold a NaN or an infinity from a tensor f captures, x
        # finite: a disagreement there turned probing off for good as much)
        off, diff, scale, worst = (stale_rows(plan, coloring, comp, extras, seed)
                                   if all_finite([comp, extras]) else (False, 0.0, 0.0, -1))
        if (off and chunk_now != 1 and coloring.count > 0
                and batching_wrong(prob, plan, coloring, extras[0], seed)):
            # (NOTE [a cached plan, probed]: the vectorised products are wrong, not the
            # pattern, a user's or a detected one; one colour at a time, and probed again)
            warn_batching(prob, coloring.count)
            if not plan.user and coloring.mode == "rev":  # (its later calls: NOTE [wrong
                plan.pattern.wrong_batching = "an operator"  # batching rules])
            coloring, comp, m, seed = _products(prob, plan, mode, 1, budget,
                                                coloring.mode, probe)
            comp, extras = comp[:-probe], comp[-probe:]
            if mode == "auto" and coloring.mode == "rev":  # (forward mode is still checked)
                plan.remember(fkey, "rev-loop")
                check = False
            off, diff, scale, worst = (stale_rows(plan, coloring, comp, extras, seed)
                                       if all_finite([comp, extras])
                                       else (False, 0.0, 0.0, -1))
        if off and plan.user:
            users_pattern_misses(prob, plan, comp.dtype, diff, scale, pkey,
                                 (coloring, comp, seed, worst))
        elif off:
            again = _detect(prob)
            if again.same_entries(plan.pattern):
                plan.stop_probing(pkey)  # (not a stale plan: the result stands, as it was)
            else:
                warn_changed(prob)
                plan = lookup_plan(prob, lambda: again, fresh=True)
                if plan.pattern.by_value is not None:
                    _warn_by_value(prob, plan.pattern.by_value)
                coloring, comp, m, _ = _products(prob, plan, mode, chunk, budget)
                check = (mode == "auto" and not torch.is_inference_mode_enabled())
    if m != plan.pattern.m:
        check = False  # (checked on the next call)
        if plan.user:
            raise JacobianOptionError(
                f"{call}: pattern has shape {shape_str((plan.pattern.m, n))}, so "
                f"{plan.pattern.m} rows, but f returned {m} output elements: row i is "
                f"element i of f's output flattened (of its tensors concatenated, for a "
                f"tuple, list or dict). Fix: pass the pattern of this f, e.g. "
                f"torch_vjp.jacobian_sparsity(f, x)."
            )
        plan = lookup_plan(prob, lambda: _detect(prob), fresh=True)  # f changed: detect again
        if plan.pattern.by_value is not None:
            _warn_by_value(prob, plan.pattern.by_value)
        coloring, comp, m, _ = _products(prob, plan, mode, chunk, budget)
    # NOTE [reverse products, checked on first use] in torch_vjp._sparse.guard
    gkey = route_key(f) if plan.user else None
    if m == plan.pattern.m and coloring.mode == "rev" and plan.guard(gkey):
        route, op = first_use_route(prob, plan, coloring, comp, before, plain=not check)
        if route is not None:
            before()  # (the products again draw what the first ones drew)
        if route == "rev-loop":
            if plan.user:
                plan.flags[gkey] = (op, _unsafe(prob, plan)[1])
            else:
                plan.pattern.wrong_batching = op
            coloring, comp, m, _ = _products(prob, plan, mode, 1 if chunk == 1 else chunk,
                                             budget, "rev")
            if mode == "auto":
                plan.remember(fkey, "rev-loop")
                check = False
        elif route == "fwd":
            plan.forward_only[gkey] = op
            coloring, comp, m, _ = _products(prob, plan, mode, chunk, budget, "fwd")
            warn_forward(prob, op, coloring.count)
            if mode == "auto":  # (its check reads a reverse product: the wrong one)
                plan.remember(fkey, "fwd")
            check = False
    if check and m == plan.pattern.m:
        coloring, comp = _checked(prob, plan, coloring, comp, chunk, budget, fkey, before)
    index = plan.gather_index(coloring, layout, comp.device)
    values = comp.reshape(-1).index_select(0, index)
    return assemble(values, plan, layout)


def _products(
    prob: Problem, plan: Any, mode: str, chunk: int | None, budget: int | None,
    colour: str | None = None, probe: int = 0,
) -> tuple[Any, Tensor, int, tuple[Any, ...]]:
    """:func:`_computed`'s products; computed again where the graph of reverse mode's
    products held an op torch differentiates wrongly that the plan did not know of (NOTE
    [reverse products read the graph] in :mod:`torch_vjp._sparse.guard`): in forward mode
    (``mode="rev"``: refused), or one colour at a time without vmap."""
    met: list[Any] = []
    got = _computed(prob, plan, mode, chunk, budget, colour, probe, met)
    if got[0].mode == "rev" and _known_wrong(prob, plan, met):
        return _products(prob, plan, mode, chunk, budget, colour, probe)
    return got


def _known_wrong(prob: Problem, plan: Any, met: list[Any]) -> bool:
    """Whether reverse mode's products are to be computed again: their call's graph held
    (``met``: the ops, and whether the products ran under vmap) an op whose backward torch
    computes wrongly, or batches wrongly and they ran under vmap, that the plan did not know
    of. The ops are kept with the plan (per function, for a user's pattern) for its later
    calls."""
    if len(met) != 2:
        return False
    (batching, alone), vectorised = met
    had = _unsafe(prob, plan)
    now = (had[0] or batching, had[1] or alone)
    if now == had:
        return False
    if plan.user:
        plan.flags[route_key(prob.f)] = now
    else:
        plan.pattern.wrong_batching, plan.pattern.wrong_reverse = now
    return (had[1] is None and alone is not None) or (had[0] is None and vectorised)


def _computed(
    prob: Problem, plan: Any, mode: str, chunk: int | None, budget: int | None,
    colour: str | None, probe: int, met: list[Any],
) -> tuple[Any, Tensor, int, tuple[Any, ...]]:
    """The colouring for ``mode`` (``colour`` picks ``"auto"``'s, as its check remembered),
    its compressed products (with ``probe``, that many probe rows' products last: NOTE [a
    cached plan, probed]), the number of output elements and the dtypes of :func:`compressed`.
    Under ``"auto"``, a function forward mode fails on (an operation without a forward-mode
    formula, ``torch.cdist``) gets reverse mode's colouring instead, with the one-time
    warning the dense ``"auto"`` gives (NOTE [auto fallback] in
    :mod:`torch_vjp._engine.jacobian`), and one torch.func cannot run at all plain
    autograd."""
    if _unsafe(prob, plan)[1] is not None:
        colour = _forward_only(prob, plan, mode)
    elif plan.forward_only.get(route_key(prob.f) if plan.user else None) is not None:
        colour = "fwd"  # (NOTE [reverse products, checked on first use])
    coloring = plan.coloring(colour or mode)
    try:
        comp, m, seed = compressed(prob, plan, coloring, max_memory=budget, probe=probe,
                                   chunk_size=_unbatched(prob, plan, coloring, chunk), met=met)
    except Exception as err:  # noqa: BLE001 - forward mode may yield to reverse mode
        if passes_through(err):
            raise
        if mode != "auto":
            explain_refusal(prob, mode, err)  # (raises for torch's known refusals)
            raise
        if coloring.mode == "rev":
            return coloring, *_plain(prob, plan, coloring, err, probe, met)
        if _unsafe(prob, plan)[1] is not None:  # (no mode can compute it)
            _, fix = wrong_reverse_words(function_name(prob.f), _unsafe(prob, plan)[1])
            raise StrategyError(
                f"{prob.call}: {function_name(prob.f)} calls {_unsafe(prob, plan)[1]}, "
                f"whose backward torch computes wrongly, so its Jacobian is computed in "
                f"forward mode only, and forward mode fails on it: {quote_error(err)}.\n"
                f"  Fix: {fix}, or give the failing operator a forward-mode formula."
            ) from None
        warn_once(
            ("sparse-fwd-to-rev", function_key(prob.f), type(err)),
            no_forward_message(prob, err, f"with {plan.coloring('rev').count} products "
                                          f"(colours) against {coloring.count}"),
            JacobianWarning,
        )
        coloring = plan.coloring("rev")
        try:
            comp, m, seed = compressed(prob, plan, coloring, max_memory=budget, probe=probe,
                                       chunk_size=_unbatched(prob, plan, coloring, chunk),
                                       met=met)
        except Exception as rev_err:  # noqa: BLE001 - plain autograd decides
            if passes_through(rev_err):
                raise
            return coloring, *_plain(prob, plan, coloring, rev_err, probe, met)
    if _unsafe(prob, plan)[1] is not None and mode == "auto":
        _forward_only(prob, plan, "done")
    return coloring, comp, m, seed


def _plain(prob: Problem, plan: Any, coloring: Any, err: BaseException,
           probe: int = 0, met: list[Any] | None = None) -> tuple[Tensor, int, tuple[Any, ...]]:
    """Reverse mode's products with plain autograd where torch.func cannot run f (its error
    ``err``), with a one-time warning; an error of f's own comes out of that call."""
    with buffers_kept(prob.f):  # (f runs for real: a module's running statistics move)
        comp, m, seed = compressed_plain(prob, plan, coloring, probe, met)
    warn_once(
        ("sparse-plain", function_key(prob.f)),
        f"{prob.call}: torch.func cannot run f ({function_name(prob.f)}): "
        f"{vmap_refusal(err) or quote_error(err)}. mode='auto' computed the products with "
        f"plain autograd, one backward pass per colour ({coloring.count}), without vmap. "
        f"This warning is shown once per function.",
        JacobianWarning,
    )
    return comp, m, seed


def _unsafe(prob: Problem, plan: Any) -> tuple[str | None, str | None]:
    """``(wrong_batching, wrong_reverse)``: the ops of ``f`` whose backward torch batches
    wrongly, or computes wrongly even alone (NOTE [wrong batching rules] in
    :mod:`torch_vjp._sparse.probe`): as detection saw them, or, for a user's pattern,
    read off the graph of one call of ``f`` the first time the pattern serves ``f``."""
    if not plan.user:
        return plan.pattern.wrong_batching, plan.pattern.wrong_reverse
    key = route_key(prob.f)
    got = plan.flags.get(key)
    if got is None:
        if torch.is_inference_mode_enabled():  # (no graph: read on a call outside it)
            return None, None
        if len(plan.flags) >= 64:
            plan.flags.clear()
        got = plan.flags[key] = graph_flags(prob)
    return got


def _forward_only(prob: Problem, plan: Any, mode: str) -> str:
    """``"fwd"``, for a pattern whose detection (or the graph of its products' call) saw an
    op whose backward torch computes wrongly without vmap too (NOTE [wrong batching rules]
    in :mod:`torch_vjp._sparse.probe`); for ``mode="rev"``, raises; ``mode="done"``: the
    one-time warning of ``"auto"``, once forward mode computed the products."""
    said, fix = wrong_reverse_words(function_name(prob.f), _unsafe(prob, plan)[1] or "")
    if mode == "rev":
        raise StrategyError(
            f"{prob.call}: mode='rev' computes the products with reverse-mode AD, and "
            f"{said}.\n  Fix: mode='fwd' or 'auto' (forward mode), or {fix}."
        )
    if mode == "done":
        warn_once(
            ("sparse-wrong-reverse", function_key(prob.f)),
            f"{prob.call}: {said}. mode='auto' computed them in forward mode. This warning "
            f"is shown once per function.",
            JacobianWarning,
        )
    return "fwd"


def _unbatched(prob: Problem, plan: Any, coloring: Any, chunk: int | None) -> int | None:
    """``chunk``, or 1 (one colour at a time, without vmap, with a one-time warning) for
    reverse mode's products where detection saw an op whose backward torch batches wrongly
    (NOTE [wrong batching rules] in :mod:`torch_vjp._sparse.probe`)."""
    why = _unsafe(prob, plan)[0]
    if why is None or coloring.mode != "rev" or chunk == 1 or coloring.count <= 1:
        return chunk
    warn_once(
        ("sparse-batching", function_key(prob.f)),
        f"{prob.call}: {function_name(prob.f)} calls {why}, whose backward torch computes "
        f"wrongly under torch.vmap (a wrong batching rule): reverse mode's products, "
        f"computed together, would be wrong. They are computed one colour at a time "
        f"({coloring.count} products), without vmap, which is slower.\n  Pass "
        f"chunk_size=1 to compute them that way directly. This warning is shown once per "
        f"function.",
        JacobianWarning,
    )
    return 1


def _checked(
    prob: Problem, plan: Any, coloring: Any, comp: Tensor, chunk: int | None,
    budget: int | None, fkey: Any, before: SameDraws,
) -> tuple[Any, Tensor]:
    """The products "auto" computed if one reverse product without vmap agrees with them;
    else the first of reverse mode (after forward mode) and reverse mode one product at a
    time that agrees with it, with a one-time warning, as :func:`torch_vjp.jacobian`'s
    ``"auto"`` does (NOTE [auto, checked once] in :mod:`torch_vjp._engine.fwdcheck`).
    Forward mode's products that disagree stand where the reverse product is the wrong one
    (NOTE [a reverse product checked forward] in :mod:`torch_vjp._engine.revcheck`: a
    forward product and a central difference agree against it), as the guard of reverse
    mode's products decides (NOTE [reverse products, checked on first use] in
    :mod:`torch_vjp._sparse.guard`); ``before``: the generators' state of the products."""
    if _unsafe(prob, plan)[1] is not None:  # (the reverse product is the wrong one)
        return coloring, comp
    first = coloring.mode
    with buffers_kept(prob.f):  # (f runs for real: a module's running statistics move)
        got = one_reverse_product(prob)
    # (a NaN or an infinity in the reverse product, from a tensor f captured or an argument
    # not differentiated, is no point to check at either: checked_route's rule)
    if got is None or not all_finite(got[2]):
        if got is None and all_finite(prob.leaves):  # (at a NaN or an infinity: a later call)
            plan.remember(fkey, first)
        return coloring, comp
    _, us, grads = got
    p = plan.pattern
    device = comp.device
    u = torch.cat([t.reshape(-1) for t in us]).to(comp.dtype)
    g = torch.cat([t.reshape(-1) for t in grads]).to(comp.dtype)
    rows, cols = p.rows.to(device), p.cols.to(device)
    # (f's least precise step: a float32 one in a float64 f rounds every route at float32's)
    dtype = least_precise(got[0], [comp, *prob.leaves])
    rtol = tolerance(dtype)
    floor: list[float] = []

    def from_values(c: Any, products: Tensor) -> Tensor:
        with torch.no_grad():  # u^T J from the values, in the pattern's (row-major) order
            values = products.reshape(-1).index_select(
                0, plan.gather_index(c, torch.sparse_csr, device))
            return torch.zeros_like(g).index_add_(0, cols, u[rows] * values)

    def gap_of(c: Any, products: Tensor) -> tuple[float, float]:
        diff, scale = gap(from_values(c, products), g)
        if not diff <= rtol * scale:  # NOTE [the scale of what is compared] (fwdnoise.py)
            scale = max(scale, noise())
        return diff, scale

    def noise() -> float:
        if not floor:
            floor.append(rounding_scale(reverse_noise(prob), dtype))
        return floor[0]

    if first == "fwd":
        diff, scale = gap_of(coloring, comp)
        if not diff <= rtol * scale and reverse_wrong(prob, got, before, rtol,
                                                      noise) is not None:
            op = blamed_op(prob, before)
            if op is not None:  # (else a write at a repeated index: forward's convention)
                plan.forward_only[route_key(prob.f) if plan.user else None] = op
                warn_forward(prob, op, coloring.count)
            plan.remember(fkey, "fwd")
            return coloring, comp

    def run(route: str) -> tuple[Any, Tensor]:
        alt, alt_comp, _, _ = _products(prob, plan, "auto", 1 if route == "rev-loop" else chunk,
                                     budget, "rev")
        return alt, alt_comp

    def blame_pattern(tried: Any, diff: float, scale: float) -> None:
        # no route agrees: a random f, a backward that is not linear in its cotangent (a
        # hook that clamps the gradient), or (with a user's pattern, the same in every
        # route) entries the pattern leaves out
        # (and only where the entries outside it can explain the difference: a 16-bit
        # softmax, nearly one-hot, rounds its reverse product to 0 where the values give
        # a number, with a line exactly zero outside the pattern)
        if (plan.user and tried and linear(prob, us, g, comp.dtype)
                and outside_pattern(prob, plan, False, _worst(from_values(coloring, comp), g),
                                    diff, float(u.abs().max()))):
            raise JacobianOptionError(misses_message(
                prob.call, f"disagrees with a reverse product of f by up to {diff:.3g} (at "
                           f"a scale of {scale:.3g}) in every mode"))

    return agreeing_route(
        prob, first, (coloring, comp), lambda pair: gap_of(*pair), run,
        lambda route: plan.remember(fkey, route), (function_key(prob.f), function_name(prob.f)),
        "mode", rtol, on_none=blame_pattern,
    )


def _worst(a: Tensor, b: Tensor) -> int:
    """The element where ``a`` and ``b`` (flat) differ most (NaN where one only is NaN)."""
    with torch.no_grad():
        off = torch.where((a == b) | (a.isnan() & b.isnan()), 0.0, (a - b).abs().double())
        return int(off.nan_to_num(math.inf).argmax())


def clear_cache(f: Callable[..., Any] | None = None) -> None:
    """Forgets the patterns and colourings :func:`sparse_jacobian` keeps for ``f`` (for
    every function, and every user pattern, with ``None``).

    Not needed for correctness: a call with a cached plan checks it with one product more
    and detects again where ``f`` took another branch (NOTE [a cached plan, probed] in
    :mod:`torch_vjp._sparse.probe`); a weight written in place, or given other
    ``.data``, and a module's parameter rebound, are detected again before any product.
    It frees the memory the plans hold, and makes the next call detect from scratch.

    Example:
        >>> f = lambda u: u * u
        >>> _ = tv.sparse_jacobian(f, torch.ones(3))
        >>> tv.sparse.clear_cache(f)
    """
    clear_plans(f)
