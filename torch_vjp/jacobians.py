"""Explicit Jacobians: of a function, of a batch row by row, of a computed graph; Hessians.

Shape convention (torch.func's): for ``y = f(x)``, ``J.shape == y.shape + x.shape`` and
``J[a, b] = dy[a] / dx[b]``. A tuple ``argnums`` gives a tuple of Jacobians, one per selected
primal; an output that is a tuple, list or dict gives the same structure of Jacobians
(exactly as :func:`torch.func.jacrev`).

Cost model: the Jacobian of ``f: R^n -> R^m`` takes either ``m`` vector-Jacobian products
(reverse mode, one per output element: ``strategy="rev"``) or ``n`` Jacobian-vector products
(forward mode, one per input element: ``strategy="fwd"``), vectorised with ``torch.vmap``.
``strategy="auto"`` picks by size and falls back to a Python loop when vmap cannot batch
``f``. See the docs page "Choosing a Jacobian strategy".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from torch_vjp._engine.blocks import Blocks, assemble
from torch_vjp._engine.compiled import (COMPILED_STRATEGIES, Built, check_compilable,
                                        check_compile, compiled_call, tracing, warn_budget)
from torch_vjp._engine.compile_checks import graph_safe_mode
from torch_vjp._engine.compiled_jacobian import compiled_jacobian, wrong_reverse
from torch_vjp._engine.computed import computed_jacobian, tensors_of
from torch_vjp._engine.context import NO_CONTEXT, buffers_kept, func_vjp, graph_mode, is_nested
from torch_vjp._engine.disconnected import warn_disconnected
from torch_vjp._engine.forms import (
    batch_mode,
    forward_mode_agrees,
    in_plain_context,
    plain_batch_jacobian,
    plain_chunk,
    plain_context,
    plain_hessian,
    plain_jacobian,
)
from torch_vjp._engine.hessian import (autograd_hessian, hessian_gradient,
                                      raise_no_double_backward, refused_by_loop)
from torch_vjp._engine.jacobian import function_name, jacobian_blocks
from torch_vjp._engine.memory import check_chunk_size, parse_max_memory
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.rows import passes_through
from torch_vjp._engine.symmetry import forward_over_reverse_checked
from torch_vjp._errors import (JacobianCallError, JacobianOptionError, a_type, note_freed_graph,
                               shape_str)
from torch_vjp._sharded import check_group, plain_module, sharded_jacobian, told_on_failure
from torch_vjp._strategies import StrategyName, get_strategy

__all__ = ["jacobian", "batch_jacobian", "jacobian_of", "hessian"]


@overload
def jacobian(
    f: Callable[..., Any],
    *primals: Any,
    argnums: int | tuple[int, ...] = 0,
    strategy: StrategyName = "auto",
    chunk_size: int | None = None,
    max_memory: int | str | None = None,
    has_aux: Literal[False] = False,
    create_graph: bool = False,
    process_group: Any = None,
    shard: bool = False,
    compile: bool = False,
) -> Any: ...


@overload
def jacobian(
    f: Callable[..., Any],
    *primals: Any,
    argnums: int | tuple[int, ...] = 0,
    strategy: StrategyName = "auto",
    chunk_size: int | None = None,
    max_memory: int | str | None = None,
    has_aux: Literal[True],
    create_graph: bool = False,
    process_group: Any = None,
    shard: bool = False,
    compile: bool = False,
) -> tuple[Any, Any]: ...


def jacobian(
    f: Callable[..., Any],
    *primals: Any,
    argnums: int | tuple[int, ...] = 0,
    strategy: StrategyName = "auto",
    chunk_size: int | None = None,
    max_memory: int | str | None = None,
    has_aux: bool = False,
    create_graph: bool = False,
    process_group: Any = None,
    shard: bool = False,
    compile: bool = False,
) -> Any:
    """The Jacobian of ``f`` at ``primals``: one VJP per output element or one JVP per input
    element, vectorised with vmap, whichever is cheaper.

    Layout as in :func:`torch.func.jacrev`: ``J.shape == y.shape + x.shape``; a tuple
    ``argnums`` gives a tuple, a pytree output the same pytree of Jacobians.

    Args:
        f: a function of tensors returning a tensor or a tuple, list or dict of tensors
            (with ``has_aux``: a pair ``(output, aux)``).
        *primals: the point at which to differentiate, passed as ``f(*primals)``.
        argnums: which primals to differentiate against: an int, or a tuple of ints for
            several (then the result holds one Jacobian per entry).
        strategy: ``"auto"`` (default: ``"rev"`` or ``"fwd"`` by the numbers of output and
            input elements, at the crossover measured by ``benchmarks/crossover.py``; falls
            back to a loop strategy, warning once, when vmap cannot batch ``f``; forward mode
            is checked against one reverse product the first time for each function and
            input signature, and reverse mode taken where an operator's forward-mode formula
            is wrong, such as ``torch.triangular_solve``'s), ``"rev"``
            (one VJP per output element under vmap), ``"fwd"`` (one JVP per input element
            under vmap), ``"rev-loop"``, ``"fwd-loop"`` (the same products in a Python loop,
            for functions vmap cannot batch).
        chunk_size: how many products to compute at once; ``None`` for as many as the
            memory budget allows (usually all). ``1`` computes one at a time without vmap.
        max_memory: bound on the extra memory, the Jacobian included: bytes, or a string
            such as ``"2GB"``, ``"1.5 GB"`` (powers of 1000) or ``"512MiB"`` (powers of
            1024). The chunk size is derived from it. ``None``: the memory free on the
            device.
        has_aux: ``f`` returns ``(output, aux)``; the result is then ``(J, aux)`` (aux, like
            J, carries an autograd graph only with ``create_graph=True``).
        create_graph: make the Jacobian differentiable with respect to the primals and to
            tensors ``f`` closes over that require grad (a module's parameters), as
            ``torch.autograd.functional.jacobian(create_graph=True)`` does. By default (as
            there) the result is detached and no autograd graph outlives its chunk, so that
            ``chunk_size`` and ``max_memory`` bound the memory even for a model whose
            parameters require grad. Inside an outer torch.func transform (``vmap``,
            ``grad``, ``jacrev``) the result always composes with it.
        process_group: ``None`` (default): one process computes every product. A
            ``torch.distributed`` ``ProcessGroup`` (``torch.distributed.group.WORLD`` for the
            default group, after ``init_process_group``): the products are split over its
            ranks, rank ``r`` of ``W`` computing products ``[n * r // W, n * (r + 1) // W)``
            of the ``n`` (output elements in reverse mode, input elements in forward mode;
            ``"auto"`` decides from sizes alone, the same on every rank), each rank with its
            own ``chunk_size``/``max_memory``; the shards are then gathered, and every rank
            returns the whole Jacobian. Every rank of the group must make the same call, at
            the same primals (checked: shapes, dtypes and checksums of the values). Not with
            ``create_graph=True`` or inside an outer torch.func transform. See the docs page
            "Scaling out".
        shard: with a ``process_group``, skip the gather: each rank returns a
            :class:`~torch_vjp.JacobianShard` holding only its own products (rows
            ``[start, stop)`` of the Jacobian with its outputs flattened, in reverse mode;
            columns in forward mode) and the range they cover.
        compile: compile the computation with ``torch.compile`` (``fullgraph=True``), once
            per function, options and input signature, and reuse it (see the docs page
            "Compiling"). The first call of a signature runs eagerly too and returns the
            eager result; where compiling fails, or the two results differ beyond rounding,
            that signature stays eager, with a one-time JacobianWarning saying why. With the
            vectorised strategies only; not with ``process_group``; with ``max_memory`` the
            call runs eagerly (with a warning), since the compiled program computes every
            product at once.

    Returns:
        The Jacobian (``(J, aux)`` with ``has_aux``); with ``shard=True``, this rank's
        :class:`~torch_vjp.JacobianShard` (its ``aux`` holds the aux value). Each block's
        dtype is that of the mode computing it, as in torch.func: the input's in reverse
        mode (``jacrev``), the output's in forward mode (``jacfwd``). Where ``f`` changes
        the dtype (float32 in, float64 out), ``"auto"``'s choice by sizes decides it: name
        the strategy, or cast, to fix it.

    Raises:
        StrategyError: unknown ``strategy``.
        JacobianMemoryError: the Jacobian does not fit ``max_memory`` (or the free memory);
            raised before the products are computed.
        JacobianCallError: ``argnums``, a primal or an output of ``f`` does not fit.
        JacobianOptionError: invalid ``chunk_size`` or ``max_memory``; a
            ``process_group`` that is not a ProcessGroup, not initialised, or combined with
            ``create_graph=True`` or ``compile=True``; ``shard=True`` without a group;
            ``compile`` not a bool, or True with a loop strategy.
        JacobianCallError: with a ``process_group``, the ranks' calls differ (strategy,
            argnums, primal shapes, dtypes or values), ``f`` draws random numbers from
            generators in another state on some rank, or another rank failed (each rank
            raises; the failing rank its own error).

    Warns:
        JacobianWarning: once per function, when ``"auto"`` falls back to a loop, or
            returns reverse mode's Jacobian because forward mode's disagreed with it; and, in
            checked mode (:class:`torch_vjp.checked`), when an output's value depends on an
            input but not through autograd (its block of zeros is not the derivative).

    Example:
        >>> import torch, torch_vjp as tv
        >>> x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
        >>> J = tv.jacobian(lambda x: torch.outer(x, x), x)
        >>> J.shape
        torch.Size([4, 4, 4])
        >>> torch.testing.assert_close(J, torch.func.jacrev(lambda x: torch.outer(x, x))(x))
        >>> Jx, Jw = tv.jacobian(lambda x, w: w @ x, x, torch.ones(2, 4, dtype=torch.float64),
        ...                      argnums=(0, 1))
        >>> Jx.shape, Jw.shape
        (torch.Size([2, 4]), torch.Size([2, 2, 4]))
    """
    call = "torch_vjp.jacobian"
    f = plain_module(f)  # (a module wrapped in DistributedDataParallel: its module)
    if (compile is True and strategy in COMPILED_STRATEGIES and process_group is None
            and max_memory is None and not tracing() and not is_nested()):
        # NOTE [compiled Jacobians]: the options are checked by the eager first call
        return compiled_jacobian(
            f, primals, (argnums, has_aux, strategy, chunk_size, create_graph),
            lambda: jacobian(f, *primals, argnums=argnums, strategy=strategy,
                             chunk_size=chunk_size, has_aux=has_aux,
                             create_graph=create_graph))
    group = check_group(process_group, shard, create_graph, call=call)
    with _told(group):  # the other ranks wait in the first exchange
        do_compile = check_compile(compile, call=call)
        strat = get_strategy(strategy, call=call)
        chunk = check_chunk_size(chunk_size, call=call)
        budget = parse_max_memory(max_memory, call=call)
        context, detached = graph_mode(create_graph, call=call)
        if do_compile:
            check_compilable(strat, group, call)
    if tracing() and group is None:  # NOTE [compiled Jacobians]
        return in_plain_context(context, detached, plain_jacobian, f, primals, argnums,
                                has_aux, strat.mode, plain_chunk(strat, chunk))
    if do_compile and not is_nested() and budget is not None:
        warn_budget(call)
    with context, buffers_kept(f, primals=primals):
        with _told(group):
            prob = Problem(f, primals, argnums, has_aux=has_aux, call=call, detached=detached)
        if group is not None:  # NOTE [sharded Jacobian]
            return sharded_jacobian(prob, strat, group, shard=shard, chunk_size=chunk,
                                    max_memory=budget)
        res = jacobian_blocks(
            prob, strat.mode, vectorized=strat.vectorized, fallback=strat.mode is None,
            chunk_size=chunk, max_memory=budget, detached=detached,
        )
        warn_disconnected(prob, res)
        jac = assemble(prob, res)
    return (jac, res.aux) if has_aux else jac


def _told(group: Any) -> Any:
    """``told_on_failure(group)``; nothing to do without a group (a generator-based context
    manager costs a microsecond or two per entry, twice per call)."""
    return NO_CONTEXT if group is None else told_on_failure(group)


_BATCH_ALTERNATIVES = (
    "torch_vjp.vjp / torch_vjp.jvp give products with the per-example Jacobians without "
    "forming them (batched=True for many at once); or call batch_jacobian on slices of "
    "the batch, x[i:i + k], and use each result before computing the next."
)


def batch_jacobian(
    f: Callable[[Tensor], Any],
    x: Tensor,
    *,
    strategy: StrategyName = "auto",
    chunk_size: int | None = None,
    create_graph: bool = False,
    process_group: Any = None,
    shard: bool = False,
    compile: bool = False,
) -> Any:
    """Per-example Jacobians of a function that maps a batch row by row, without the
    B-times-larger cross-example blocks: one VJP per output element of a row (or one JVP per
    input element of a row), each computed for the whole batch at once.

    ``f`` maps ``(B, *in) -> (B, *out)`` and row ``b`` of its output depends only on row
    ``b`` of ``x`` (a per-example model: no BatchNorm in training mode, no attention across
    the batch). Under that assumption the full Jacobian is zero off the diagonal blocks, and
    ``J[b] = d f(x)[b] / d x[b]`` is found by differentiating the sum over the batch:
    the derivative of ``f(x).sum(0)`` with respect to ``x[b]`` is row ``b``'s own block.
    The result is what ``torch.vmap(torch.func.jacrev(f_single))(x)`` gives, in one vmap
    level instead of two (cf. TensorFlow's ``GradientTape.batch_jacobian``). If rows are not
    independent, the result is not a per-example Jacobian, and the modes disagree: reverse
    mode (``"rev"``, ``"rev-loop"``) gives the sum over ``b'`` of ``d f(x)[b'] / d x[b]``,
    forward mode (``"fwd"``, ``"fwd-loop"``) the sum over ``b'`` of
    ``d f(x)[b] / d x[b']``. Use :func:`jacobian` for such a function. ``"auto"`` checks
    its first result for a function and input signature against a reverse product of the
    whole batch, and raises where ``f`` mixes rows (NOTE [a batch that mixes rows]).

    Args:
        f: maps a batch ``(B, *in)`` to a tensor (or tuple, list or dict of tensors) with the
            same leading dimension B.
        x: the batch, with its batch dimension first.
        strategy: as in :func:`jacobian`; ``"auto"`` compares the per-row output and input
            sizes.
        chunk_size: products at once, as in :func:`jacobian`.
        create_graph: make the result differentiable, as in :func:`jacobian` (by default it
            is detached, and no graph outlives its chunk).
        process_group: as in :func:`jacobian`: the products of one row (its output
            elements in reverse mode, input elements in forward mode), each computed for
            the whole batch, are split over the group's ranks, and every rank gets the
            whole result. (To split the batch instead, give each rank its own rows of ``x``
            without a group: per-example Jacobians need no exchange.)
        shard: as in :func:`jacobian`: each rank returns its
            :class:`~torch_vjp.JacobianShard` only.
        compile: as in :func:`jacobian`: compile once per function and input signature,
            and reuse.

    Returns:
        ``(B, *out, *in)`` per output tensor, in ``f``'s output structure; with
        ``shard=True``, this rank's :class:`~torch_vjp.JacobianShard`.

    Raises:
        JacobianCallError: ``x`` has no batch dimension, or an output of ``f`` lacks the
            leading dimension B; (``"auto"``) ``f`` mixes the rows of its batch (a mean over
            the batch, BatchNorm in training mode).
        JacobianMemoryError: the result does not fit the free memory.
        JacobianOptionError: an invalid ``chunk_size``, ``process_group`` or ``shard``, as in
            :func:`jacobian`.
        StrategyError: unknown ``strategy``.

    Example:
        >>> import torch, torch_vjp as tv
        >>> W = torch.randn(3, 5, dtype=torch.float64)
        >>> f = lambda x: torch.tanh(x @ W.T)            # (B, 5) -> (B, 3)
        >>> x = torch.randn(64, 5, dtype=torch.float64)
        >>> J = tv.batch_jacobian(f, x)
        >>> J.shape
        torch.Size([64, 3, 5])
        >>> ref = torch.vmap(torch.func.jacrev(lambda xi: torch.tanh(W @ xi)))(x)
        >>> torch.testing.assert_close(J, ref)
    """
    call = "torch_vjp.batch_jacobian"
    f = plain_module(f)  # (a module wrapped in DistributedDataParallel: its module)
    group = check_group(process_group, shard, create_graph, call=call)
    # (an argument refused on one rank reaches the others, which wait in the first exchange)
    with _told(group):
        do_compile = check_compile(compile, call=call)
        strat = get_strategy(strategy, call=call)
        chunk = check_chunk_size(chunk_size, call=call)
        if not isinstance(x, Tensor) or x.dim() == 0:
            what = "a 0-d tensor" if isinstance(x, Tensor) else a_type(x)
            raise JacobianCallError(
                f"{call}: x is {what}, but it must be a tensor whose first dimension is the "
                f"batch, (B, *in). For a single example, use torch_vjp.jacobian(f, x), or "
                f"pass x.unsqueeze(0)."
            )
        context, detached = graph_mode(create_graph, call=call)
        if do_compile:
            check_compilable(strat, group, call)
    if tracing() and group is None:  # NOTE [compiled Jacobians]
        return in_plain_context(context, detached, plain_batch_jacobian, f, x, strat.mode,
                                plain_chunk(strat, chunk))
    if do_compile and not is_nested():
        def build() -> Callable[..., Any]:
            mode = strat.mode or batch_mode(f, x)
            if strat.mode is None and mode == "fwd" and not forward_mode_agrees(f, (x,), 0,
                                                                                False):
                mode = "rev"  # (as compiled jacobian's "auto": no or a wrong formula)
            mode = graph_safe_mode(mode, strat.mode is not None, detached)
            if mode == "rev" and (why := wrong_reverse(f, (x,), 0, False)) is not None:
                return Built(None, why=why)  # NOTE [reverse products batched wrongly]

            def program(f: Callable[..., Any], x: Tensor) -> Any:
                with plain_context(context, detached):
                    return plain_batch_jacobian(f, x, mode, chunk)
            return program

        return compiled_call(
            call, f, (strat.name, chunk, create_graph), (x,),
            lambda: batch_jacobian(f, x, strategy=strategy, chunk_size=chunk_size,
                                   create_graph=create_graph),
            build,
        )
    with context, buffers_kept(f):
        with _told(group):  # the other ranks wait in the first exchange
            prob = Problem(f, (x,), 0, has_aux=False, call=call, detached=detached,
                           aux=False, named="x")
        if group is not None:  # NOTE [sharded Jacobian]
            return sharded_jacobian(prob, strat, group, shard=shard, chunk_size=chunk,
                                    max_memory=None, batch=x.shape[0],
                                    alternatives=_BATCH_ALTERNATIVES)
        res = jacobian_blocks(
            prob, strat.mode, vectorized=strat.vectorized, fallback=strat.mode is None,
            chunk_size=chunk, max_memory=None, batch=x.shape[0],
            alternatives=_BATCH_ALTERNATIVES, detached=detached,
        )
        warn_disconnected(prob, res, batch=x.shape[0])
        return assemble(prob, res)


def hessian(
    f: Callable[..., Any],
    *primals: Any,
    argnums: int | tuple[int, ...] = 0,
    strategy: StrategyName = "auto",
    create_graph: bool = False,
    compile: bool = False,
) -> Any:
    """The Hessian of ``f`` at ``primals``: the Jacobian of its gradient, forward-over-reverse
    by default (one JVP of the gradient per input element, vectorised with vmap).

    Layout as in :func:`torch.func.hessian`: for a scalar ``f`` of ``x``,
    ``H.shape == x.shape + x.shape``; in general ``y.shape + x.shape + x.shape``, and a tuple
    ``argnums`` nests a tuple in a tuple.

    ``strategy`` names the outer Jacobian (the inner one, the gradient, is always reverse
    mode, which is what a gradient costs least in):

    * ``"auto"``: forward over reverse, as ``torch.func.hessian``; falls back to loops,
      warning once, when vmap cannot batch ``f``; where reverse over reverse disagrees with
      it, returns reverse over reverse (a wrong forward-mode formula: torch.triangular_solve)
      unless a difference quotient of the gradient sides with forward over reverse (a
      custom Function marked once_differentiable), warning once either way;
    * ``"fwd"``: forward over reverse; ``"rev"``: reverse over reverse;
    * ``"fwd-loop"``, ``"rev-loop"``: the same in Python loops, without vmap.

    Args:
        f: a function of tensors returning a tensor (or a pytree of tensors).
        *primals: the point, passed as ``f(*primals)``.
        argnums: which primals to differentiate against, as in :func:`jacobian`.
        strategy: see above.
        create_graph: make the Hessian differentiable, as in :func:`jacobian` (by default it
            is detached).
        compile: as in :func:`jacobian`: compile once per function and input signature,
            and reuse. The first call compares the compiled Hessian with the eager one
            (which ``"auto"`` checks for wrong forward-mode formulas), so a compiled
            forward-over-reverse that is wrong stays eager, with a warning.

    Returns:
        The Hessian.

    Raises:
        StrategyError: unknown ``strategy``.
        JacobianCallError: ``argnums``, a primal or an output of ``f`` does not fit.
        JacobianMemoryError: the Hessian does not fit the free memory.
        StrategyNotImplementedError: torch has no formula the strategy needs: a
            forward-mode one for ``"fwd"``, or a derivative of an operator's backward
            kernel for reverse over reverse (fused attention on the CPU, ``torch.cdist``),
            with the fix (for attention, the math kernel).

    Warns:
        JacobianWarning: once per function, when ``"auto"`` falls back to a loop, returns
            reverse over reverse because forward over reverse was wrong, or the other way
            round, or a loop's Hessian because both vectorised routes gave one asymmetric
            alike, or returns an asymmetric Hessian (f's backward cannot be differentiated
            right, or f is not twice differentiable at the point), or (``"auto"`` and
            the loop strategies) computes with plain autograd because torch.func's
            transforms cannot run ``f``: it changes a tensor it captured in place (a module
            in training mode updating its running statistics), or calls a custom
            autograd.Function without setup_context.

    Example:
        >>> import torch, torch_vjp as tv
        >>> x = torch.randn(5, dtype=torch.float64)
        >>> H = tv.hessian(lambda x: x.sin().sum(), x)
        >>> torch.testing.assert_close(H, torch.diag(-x.sin()))
    """
    call = "torch_vjp.hessian"
    f = plain_module(f)  # (a module wrapped in DistributedDataParallel: its module)
    do_compile = check_compile(compile, call=call)
    strat = get_strategy(strategy, call=call)
    if do_compile:
        check_compilable(strat, None, call)
    if tracing() or (do_compile and not is_nested()):
        context, detached = graph_mode(create_graph, call=call)

        def program(outer: str | None) -> Callable[..., Any]:
            def run(f: Callable[..., Any], *args: Any) -> Any:
                with plain_context(context, detached):  # (forward over reverse, or
                    return plain_hessian(f, args, argnums, outer)  # reverse over reverse)
            return run

        if tracing():  # NOTE [compiled Jacobians]
            return program(strat.mode)(f, *primals)
        return compiled_call(
            call, f, (argnums, strat.name, create_graph), primals,
            lambda: hessian(f, *primals, argnums=argnums, strategy=strategy,
                            create_graph=create_graph),
            lambda: program(graph_safe_mode(strat.mode or "fwd", strat.mode is not None,
                                            detached)),  # NOTE [forward mode with
        )  # create_graph, eager] in compile_checks.py
    outer_mode = strat.mode or "fwd"
    vectorized = strat.vectorized
    fallback = strat.mode is None
    if not callable(f):  # the outer function below is, so check f itself
        Problem(f, primals, argnums, has_aux=False, call=call, aux=False)
    context, detached = graph_mode(create_graph, call=call)
    with context, buffers_kept(f, primals=primals):
        def gradient(*args: Any) -> Any:
            return hessian_gradient(f, args, argnums, vectorized, fallback, call, strat.name)

        gradient.__qualname__ = function_name(f)  # (messages about the outer Jacobian name f)
        outer = Problem(gradient, primals, argnums, has_aux=False, call=call,
                        detached=detached, aux=False)
        # Shapes of the gradient without computing it: f's outputs and the primals suffice.
        inner = Problem(f, primals, argnums, has_aux=False, call=call, aux=False)

        own: list[Exception] = []  # f's own error, raised by the probe twice

        def probe() -> tuple[list[Tensor], Any]:
            try:
                flat_out, out_spec = inner.probe()
            except Exception as err:  # noqa: BLE001 - NOTE [a probe f cannot answer]
                if passes_through(err):
                    raise
                # (f answers only when differentiated, as the gradient's reverse mode does:
                # its outputs from there; an error of f's own comes from there again, and
                # is not tried a third time in plain autograd below)
                try:
                    with torch.no_grad():
                        flat_out, out_spec = tree_flatten(
                            func_vjp(inner.g, *inner.leaves)[0])
                except Exception as again:
                    if type(again) is type(err) and str(again) == str(err):
                        own.append(again)
                    raise
            blocks = [
                [torch.empty((*o.shape, *x.shape), dtype=x.dtype, device="meta")
                 for x in inner.leaves]
                for o in flat_out
            ]
            return tree_flatten(assemble(inner, Blocks(blocks, out_spec, None, "rev")))

        def outer_blocks(mode: str, loop: bool = False) -> Blocks:
            nonlocal vectorized  # (a loop: the gradient too, NOTE [vectorised, outvoted])
            vectorized = vectorized and not loop
            return jacobian_blocks(
                outer, mode, vectorized=vectorized, fallback=fallback,
                chunk_size=None, max_memory=None, probe=probe, functorch_loops=True,
                detached=detached,
            )

        try:
            res = outer_blocks(outer_mode)
        except Exception as err:  # noqa: BLE001 - plain autograd decides below
            # torch.func cannot run some functions that plain autograd runs: one that changes
            # a captured tensor in place (a module in training mode updating its running
            # statistics), a custom autograd.Function without setup_context, NumPy calls;
            # "auto" and the loop strategies then take plain autograd, as
            # torch.autograd.functional does (an error of f's own comes from there again)
            # (a backward kernel without a derivative formula fails there too: said so)
            raise_no_double_backward(f, strat.name, err, call)
            if strat.vectorized and not fallback:
                def loop() -> Blocks:  # (the loop the refusal's fix names)
                    nonlocal vectorized
                    vectorized = False
                    return outer_blocks(outer_mode)
                refused = refused_by_loop(err, loop)
                if refused is not None:
                    raise refused from None
            if (passes_through(err) or strat.vectorized and not fallback or is_nested()
                    or any(err is e for e in own)):
                raise
            try:
                return autograd_hessian(f, primals, argnums, not detached, call, err,
                                        strat.name)
            except RuntimeError as again:
                raise_no_double_backward(f, strat.name, again, call)
                raise
        if fallback and not is_nested() and not any(
                x.device.type == "meta" for x in outer.leaves):  # (no numbers to compare)
            res = forward_over_reverse_checked(f, outer, res, outer_blocks, call)
        warn_disconnected(outer, res)
        return assemble(outer, res)


def jacobian_of(
    outputs: Tensor | Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor],
    *,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    chunk_size: int | None = None,
    compile: bool = False,
) -> Any:
    """The Jacobian of tensors already computed, from their autograd graph: one backward
    pass per output element, vectorised with ``torch.vmap`` over ``torch.autograd.grad``.

    (Not ``torch.autograd.grad(..., is_grads_batched=True)``: in torch 2.13 that runs on the
    legacy vmap prototype, which lacks batching rules for common backward operators such as
    ``tanh_backward`` and is slower than a Python loop; ``torch.vmap`` over the same call is
    an order of magnitude faster than the loop.)

    Layout as in :func:`jacobian`: ``J.shape == output.shape + input.shape``; a tuple of
    outputs gives a tuple, a tuple of inputs a tuple per output.

    Args:
        outputs: a tensor or a sequence of tensors, computed from ``inputs``.
        inputs: a tensor or a sequence of tensors with ``requires_grad=True``.
        retain_graph: keep the graph for later backward passes (default: ``create_graph``).
            The graph is always kept while the products run; with ``retain_graph=False``
            its buffers are freed by the last one where the products run in several
            vectorised chunks or in the loop, and otherwise when ``outputs`` are released
            (a single vectorised product keeps the graph: were it to fail, the loop that
            replaces it needs the graph whole). Do not rely on ``retain_graph=False`` to
            make a later ``backward`` through ``outputs`` fail.
        create_graph: make the Jacobian differentiable (for higher derivatives).
        chunk_size: output elements per batched backward pass; ``None`` for as many as the
            free memory allows (usually all).
        compile: ``False`` only, taken for a signature like the other Jacobian functions':
            the graph already exists when ``jacobian_of`` is called, so there is no
            function to compile (a JacobianOptionError says so, and names the fix).

    Returns:
        The Jacobian blocks.

    Raises:
        JacobianOptionError: ``compile=True`` (see above), or an invalid ``chunk_size``.
        JacobianCallError: an input does not require grad, an argument is not a tensor,
            a tensor is complex (an output also integer or boolean), or an input is sparse
            or nested; the graph goes, on a path to an input, through an operator whose
            backward formula torch computes wrongly (torch.as_strided_scatter for the
            tensor scattered into, the antialiased ``F.interpolate``'s wrong cases: see
            the docs page "Strategies"): the fix it names is forward mode from the function.
        JacobianMemoryError: the Jacobian does not fit the free memory.

    The first vectorised Jacobian of a graph structure (node types, shapes and dtypes of
    outputs and inputs) is checked against one backward pass without vmap; where a batching
    rule is wrong (torch.cdist's backward) the loop's Jacobian is returned, and graphs of that
    structure take the loop from then on (NOTE [jacobian_of, checked once]).

    Warns:
        JacobianWarning: for an output with no autograd path to an input (its block is
            zeros); once, when the batched backward pass fails and a loop is used; once per
            graph structure, when the batched backward pass disagrees with the loop.

    Example:
        >>> import torch, torch_vjp as tv
        >>> x = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
        >>> y = torch.outer(x, x)
        >>> J = tv.jacobian_of(y, x)
        >>> J.shape
        torch.Size([4, 4, 4])
        >>> J[1, 2].tolist()  # d y[1, 2] / dx = d (x1 x2) / dx
        [0.0, 3.0, 2.0, 0.0]
    """
    call = "torch_vjp.jacobian_of"
    if check_compile(compile, call=call):
        raise JacobianOptionError(
            f"{call}: compile=True, but jacobian_of reads the Jacobian from an autograd "
            f"graph that was built before the call, so there is no function to compile. "
            f"Fix: compute the Jacobian from the function instead, "
            f"torch_vjp.jacobian(f, x, compile=True), or drop compile=True."
        )
    chunk = check_chunk_size(chunk_size, call=call)
    outs = tensors_of(outputs, "outputs", call)
    ins = tensors_of(inputs, "inputs", call)
    for what, given, ts in (("outputs", outputs, outs), ("inputs", inputs, ins)):
        for i, t in enumerate(ts):
            if t.is_complex():  # (autograd.grad would differentiate the real part alone)
                name = what if isinstance(given, Tensor) else f"{what}[{i}]"
                raise JacobianCallError(
                    f"{call}: {name} has dtype {t.dtype}; Jacobians here (as in "
                    f"torch.func.jacrev and torch_vjp.jacobian) are defined for real tensors, "
                    f"and reading one from the graph of a complex tensor would give the "
                    f"derivatives of its real part alone. Fix: compute with "
                    f"torch.view_as_real(...) of it and rebuild the complex number where "
                    f"needed, or use torch_vjp.vjp / torch_vjp.jvp, which take complex "
                    f"tensors.")
            if what == "outputs" and not t.dtype.is_floating_point:
                name = what if isinstance(given, Tensor) else f"outputs[{i}]"
                raise JacobianCallError(
                    f"{call}: {name} has dtype {t.dtype}; only floating-point outputs have a "
                    f"Jacobian here (as in torch.func.jacrev and torch_vjp.jacobian): an "
                    f"integer or boolean tensor (made by .long(), .round().int(), a "
                    f"comparison, argmax) carries no autograd graph, so its block would be "
                    f"zeros that say nothing about how it depends on the inputs. Fix: leave "
                    f"it out of outputs, or compute it in floating point if it is "
                    f"differentiable.")
    for i, x in enumerate(ins):
        name = "inputs" if isinstance(inputs, Tensor) else f"inputs[{i}]"
        if x.layout != torch.strided or x.is_nested:
            kind = ("a nested tensor" if x.is_nested
                    else f"a sparse tensor (layout {x.layout})")
            raise JacobianCallError(
                f"{call}: {name} is {kind}; Jacobians here (as in torch.func and "
                f"torch_vjp.jacobian) are taken with respect to dense (strided) tensors, whose "
                f"elements are the Jacobian's columns.\n"
                f"  Fix: compute the outputs from a dense tensor, d = {name}.to_dense()"
                f".requires_grad_() (calling .to_sparse() on d where a sparse one is needed), "
                f"and pass d; or use torch_vjp.grad, which takes this tensor, for products "
                f"with vectors.")
        if not x.requires_grad:
            raise JacobianCallError(
                f"{call}: {name} (shape {shape_str(x.shape)}) does not require grad, so no "
                f"graph leads to it and its Jacobian cannot be read from one.\n"
                f"  Create it with requires_grad=True (or call .requires_grad_() on it) "
                f"before computing the outputs; or use torch_vjp.jacobian(f, x), which needs "
                f"no graph."
            )
    if retain_graph is None:
        retain_graph = create_graph
    try:
        return computed_jacobian(outs, ins, retain_graph, create_graph, chunk, call,
                                 isinstance(outputs, Tensor), isinstance(inputs, Tensor))
    except RuntimeError as err:
        note_freed_graph(err, (
            f"{call}: the Jacobian is read from the graph that computed outputs, and part "
            f"of it was freed by an earlier backward pass through it: .backward(), "
            f"torch.autograd.grad or jacobian_of, called without retain_graph=True.\n"
            f"  Fix: pass retain_graph=True to that earlier call, or call jacobian_of "
            f"before it, or compute outputs again."))
        raise

