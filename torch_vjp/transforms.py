"""Vector-Jacobian and Jacobian-vector products, one at a time or K at once.

``vjp`` and ``jvp`` are :func:`torch.func.vjp` and :func:`torch.func.jvp` with two additions:
the vectors are checked by the same checker, with the same messages, as
:func:`torch_vjp.grad`'s ``grad_outputs``; and ``batched=True`` takes K vectors stacked along
a new leading dimension and computes the K products in one vectorised call (``torch.vmap``
over the product, ``chunk_size`` at a time), returning them stacked the same way.

For ``y = f(x)`` with Jacobian ``J`` (``J.shape == y.shape + x.shape``), a VJP takes a
cotangent ``v`` shaped like ``y`` (``v`` is dL/dy) and returns ``v^T J``, shaped like ``x``; a
JVP takes a tangent ``t`` shaped like ``x`` (a direction of change) and returns ``J t``,
shaped like ``y``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any, Literal, overload

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from torch_vjp._check_labels import TANGENTS, VJP, keyed
from torch_vjp._checks import (
    check_cotangents,
    check_tree_structure,
    normalize_grad_outputs,
)
from torch_vjp._engine.autoknown import batched_pullback_message
from torch_vjp._engine.compiled import (builds, check_compile, compiled_call, own_builds,
                                        results_agree, tracing)
from torch_vjp._engine.context import buffers_kept, func_jvp, func_vjp, is_nested
from torch_vjp._engine.copies import not_sharing
from torch_vjp._engine.fwd_batch import checked_batch
from torch_vjp._engine.fwdcheck import CHECKED, route_key, signature
from torch_vjp._engine.forms import plain_jvp
from torch_vjp._engine.fwd_wrong import jvp_read_once
from torch_vjp._engine.gradmode import in_grad_mode
from torch_vjp._engine.memory import check_chunk_size
from torch_vjp._engine.nearcheck import pullback_near
from torch_vjp._engine.point import Point, read_state, versions_of
from torch_vjp._engine.problem import Problem
from torch_vjp._sharded import plain_module
from torch_vjp._engine.jacobian import function_key, function_name
from torch_vjp._engine.revjvp import traced_jvp
from torch_vjp._engine.rows import loop_draws, map_rows
from torch_vjp._engine.wrongops import reading_wrong_ops, wrong_pullback
from torch_vjp._errors import (GradOutputsError, JacobianCallError, JacobianWarning,
                               note_freed_graph, warn_once)
from torch_vjp._transform_support import (
    _batch_size,
    _compiled_jvp,
    _explained,
    _flat_vectors,
    _has_internal_overlap,
    _jvp_by_reverse,
    _output_shaped_tangent,
    _vectorised_or_loop,
    _warn_unbatched_chunk,
    probe_cotangents,
    recording_connected,
    results_of_their_own,
)

__all__ = ["vjp", "jvp"]


# NOTE [a traceable pullback]
# make_fx (torch.fx's tracer) reads a function's parameters from its code object and wants
# one concrete argument per parameter, keyword-only ones included, unless the function takes
# a single named parameter followed by *args or **kwargs. So vjp_fn is written as
# ``vjp_fn(cotangents, *args, **options)``, checks its arguments itself, and shows its
# documented signature through __signature__ (inspect.signature, help()):
# ``make_fx(vjp_fn)(v)`` then traces the pullback directly, with no lambda around it, and
# ``make_fx(vjp_fn)(v, True, True)`` too, as for torch.func's vjp_fn, whose
# ``retain_graph`` and ``create_graph`` it takes, by position or by name.
_P = inspect.Parameter
_VJP_FN_SIGNATURE = inspect.Signature([
    _P("cotangents", _P.POSITIONAL_OR_KEYWORD),
    _P("retain_graph", _P.POSITIONAL_OR_KEYWORD, default=True),
    _P("create_graph", _P.POSITIONAL_OR_KEYWORD, default=None),
    _P("batched", _P.KEYWORD_ONLY, default=False),
    _P("chunk_size", _P.KEYWORD_ONLY, default=None),
])
_PULLBACK_DEFAULTS = {"retain_graph": True, "create_graph": None, "batched": False,
                      "chunk_size": None}
_NO_CONTEXT = contextlib.nullcontext()


def _pullback_options(args: tuple[Any, ...], options: dict[str, Any]) -> dict[str, Any]:
    """vjp_fn's arguments after ``cotangents`` (``retain_graph`` and ``create_graph`` by
    position or name, ``batched`` and ``chunk_size`` by name), defaults filled in; anything
    else is a TypeError worded as Python words it for a function of that signature."""
    if len(args) > 2:
        raise TypeError(
            f"vjp_fn() takes from 1 to 3 positional arguments but {len(args) + 1} were given"
        )
    for name in options:
        if name not in _PULLBACK_DEFAULTS:
            raise TypeError(f"vjp_fn() got an unexpected keyword argument {name!r}")
    for name, value in zip(("retain_graph", "create_graph"), args):
        if name in options:
            raise TypeError(f"vjp_fn() got multiple values for argument {name!r}")
        options[name] = value
    return {**_PULLBACK_DEFAULTS, **options}


@overload
def vjp(
    f: Callable[..., Any], *primals: Any, has_aux: Literal[False] = False, compile: bool = False
) -> tuple[Any, Callable[..., Any]]: ...


@overload
def vjp(
    f: Callable[..., Any], *primals: Any, has_aux: Literal[True], compile: bool = False
) -> tuple[Any, Callable[..., Any], Any]: ...


@results_of_their_own("vjp")  # NOTE [results of their own]
def vjp(
    f: Callable[..., Any], *primals: Any, has_aux: bool = False, compile: bool = False
) -> tuple[Any, ...]:
    """``f(*primals)`` and a function computing vector-Jacobian products at ``primals``.

    Args:
        f: a function of tensors returning a tensor or a tuple, list or dict of tensors
            (with ``has_aux``: a pair ``(output, aux)``).
        *primals: the point, passed as ``f(*primals)``; products are taken with respect to
            all of them.
        has_aux: ``f`` returns ``(output, aux)``; the result is then
            ``(output, vjp_fn, aux)``.
        compile: ``vjp_fn`` runs a program compiled with ``torch.compile`` once per
            function and signature of the primals and cotangents, and reused (as
            :func:`torch_vjp.jacobian`'s ``compile``). torch.compile cannot hand back a
            pullback that closes over a forward pass, so the compiled program runs ``f``'s
            forward again with the pullback, and ``f``'s forward also runs eagerly once in
            ``vjp`` itself, for the output (whether that pays is not benchmarked yet: time
            it on your function). Calls of
            ``vjp_fn`` with ``retain_graph`` or ``create_graph`` run eagerly.

    As with torch.func.vjp, ``f`` is called once, on the primals themselves: a write ``f``
    makes into a primal reaches the caller's tensor. Unlike it, an output or aux that is a
    primal, or a view of one (``f = lambda x: x``), is handed back as a copy, so that a
    later write into the primal does not change it (NOTE [results of their own]).

    Returns:
        ``(output, vjp_fn)`` (``(output, vjp_fn, aux)`` with ``has_aux``). ``vjp_fn(
        cotangents, retain_graph=True, create_graph=None, *, batched=False,
        chunk_size=None)`` takes cotangents in the output's structure, each shaped like its
        output (dL/d output; ``None`` stands for 1 for a real scalar output, as in
        torch.func.vjp, but not with ``batched=True``), and returns a tuple with one
        ``v^T J`` per primal, each shaped like its primal. ``retain_graph`` and
        ``create_graph`` are torch.func's (by default the result is differentiable when grad
        mode is on; with ``batched=True``, ``retain_graph=False`` applies to the last
        product, and the graph is kept where the products run in one vectorised chunk, until
        ``vjp_fn`` is released). With ``batched=True`` every cotangent carries an extra
        leading dimension K (the same for all), and every result too: K products in one vectorised call, ``chunk_size`` at a time (the first batched
        call for a function and shapes also takes one product without vmap and, where the two
        disagree, a batching rule of torch's is wrong: the products are computed one at a
        time, with a one-time warning; NOTE [batched products, checked once]). ``vjp_fn``
        can be called any number of times.

    Raises:
        GradOutputsError: (from ``vjp_fn``) cotangents of the wrong structure, shape,
            batch size, dtype or device, with the same messages as :func:`torch_vjp.grad`.
        JacobianCallError: a primal or an output of ``f`` cannot be differentiated; (from
            ``vjp_fn``) a primal, the output, the aux, or a tensor ``f`` captures (a
            module's parameter or buffer too) was written in place since the vjp call (NOTE
            [the vjp point, kept]); (from ``vjp_fn``) f's graph holds an operator whose
            backward formula torch (2.13) has wrong, ``torch.as_strided_scatter`` into a
            tensor computed from the primals (NOTE [named reverse strategies and wrong
            formulas]): forward mode is the fix.

    Example:
        >>> import torch, torch_vjp as tv
        >>> x = torch.randn(3, dtype=torch.float64)
        >>> W = torch.randn(2, 3, dtype=torch.float64)
        >>> out, vjp_fn = tv.vjp(lambda x: W @ x, x)
        >>> (g,) = vjp_fn(torch.tensor([1.0, 0.0], dtype=torch.float64))
        >>> torch.testing.assert_close(g, W[0])
        >>> (rows,) = vjp_fn(torch.eye(2, dtype=torch.float64), batched=True)  # K = 2
        >>> torch.testing.assert_close(rows, W)
    """
    call = "torch_vjp.vjp"
    f = plain_module(f)  # (a module wrapped in DistributedDataParallel: its module)
    do_compile = check_compile(compile, call=call)
    if tracing():  # NOTE [compiled Jacobians]
        return _traced_vjp(f, primals, has_aux)
    if do_compile and not is_nested():
        return _compiled_vjp(f, primals, has_aux)
    # f is called once, on the caller's tensors, as torch.func.vjp calls it
    prob = Problem(f, primals, None, has_aux=has_aux, call=call, complex_ok=True, copies=False)
    # (the graph of f's call read for an operator torch differentiates wrongly: NOTE
    # [named reverse strategies and wrong formulas])
    grad_mode: list[str | None] = []  # (NOTE [a backward right only in grad mode])
    g_read, wrong = reading_wrong_ops(prob.g_inner, has_aux, grad_mode)
    g_inner, connected = recording_connected(g_read, has_aux)
    # (a buffer f rebinds, ``self.scale = self.scale * 1.1``, is the module's own tensor
    # again after the call, not the torch.func wrapper the call made; the graph keeps
    # what f saved)
    with buffers_kept(f, primals=primals), _explained(call, "vjp"):
        res = func_vjp(g_inner, *prob.leaves, has_aux=prob.has_aux)
    out, pullback = res[0], res[1]
    flat_out, out_spec = tree_flatten(out)
    point = Point(f, prob.leaves, [o for o in flat_out if isinstance(o, Tensor)],
                  [a for a in tree_leaves(res[2]) if isinstance(a, Tensor)] if has_aux else [])
    single = isinstance(out, Tensor)
    pull_call = "torch_vjp.vjp: vjp_fn"
    key_box: list[Any] = []  # (the key of NOTE [batched products, checked once], once made)

    def pull(*cot: Tensor, **graph: Any) -> Any:
        cots = cot[0] if single else tree_unflatten(list(cot), out_spec)
        create = graph.get("create_graph")
        if (grad_mode and grad_mode[0] is not None and create is not True
                and not (create is None and torch.is_grad_enabled())):
            # (a backward right only in grad mode, run without a graph to create: run in
            # grad mode and detached, NOTE [a backward right only in grad mode])
            return in_grad_mode(pullback, cots, retain_graph=graph.get("retain_graph", True),
                                create_graph=True)
        return pullback(cots, **graph)

    def pull_checked(*cot: Tensor) -> Any:  # (the products of NOTE [batched products,
        return pull(*cot, retain_graph=True, create_graph=False)  # checked once])

    def vjp_fn(cotangents: Any, *args: Any, **options: Any) -> Any:
        """``v^T J`` for the cotangents ``v`` (K of them with ``batched=True``).

        Signature: ``vjp_fn(cotangents, retain_graph=True, create_graph=None, *,
        batched=False, chunk_size=None)``; the options are taken as ``*args`` and
        ``**options`` so that ``make_fx`` can trace ``vjp_fn`` itself (NOTE [a traceable
        pullback]).
        """
        batched, chunk_size, pull_with = False, None, pull
        opts = _PULLBACK_DEFAULTS
        if args or options:
            opts = _pullback_options(args, options)
            batched, chunk_size = opts["batched"], opts["chunk_size"]
            pull_with = functools.partial(pull, retain_graph=opts["retain_graph"],
                                          create_graph=opts["create_graph"])
        chunk = check_chunk_size(chunk_size, call=pull_call)
        _warn_unbatched_chunk(pull_call, chunk, batched)
        normalized = check_cotangents(
            out, cotangents, VJP, batched=batched, primals=prob.primals,
            connected=connected or None,
        )
        # (cast as torch casts them, and as the check above warned: the pullback's own
        # torch.autograd.grad, checked in checked mode, then has nothing to warn of again)
        vectors = [v if v.dtype == o.dtype or v.is_complex() != o.is_complex() else v.to(o.dtype)
                   for v, o in zip(_flat_vectors(normalized, flat_out, batched), flat_out)]

        def products() -> Any:
            if not batched:
                return pull_with(*vectors)
            k = _batch_size(vectors)
            if k == 0:
                return tuple(x.new_zeros((0, *x.shape)) for x in prob.leaves)
            # (every product but the last keeps the graph: NOTE [batched products keep the
            # graph])
            pull_kept = functools.partial(pull, retain_graph=True,
                                          create_graph=opts["create_graph"])

            def stacked(vec: bool, free: bool = True) -> Any:
                # NOTE [batched products keep the graph]
                state = {"stop": 0, "proven": not vec}

                def rows(s: int, e: int) -> tuple[Tensor, ...]:
                    state["stop"] = e
                    return tuple(v[s:e] for v in vectors)

                def pull_row(*cot: Tensor) -> Any:
                    last = free and state["proven"] and state["stop"] >= k
                    res = pull_with(*cot) if last else pull_kept(*cot)
                    state["proven"] = True
                    return res

                return map_rows(pull_row, rows, k, vectorized=vec, chunk_size=chunk)[0]

            def one_at_a_time(op: str) -> Any:  # NOTE [batched products through a wrong
                if chunk != 1 and k > 1:  # batching rule]
                    warn_once(("vjp_fn batched wrongly", function_key(f)),
                              batched_pullback_message(pull_call, function_name(f), op),
                              JacobianWarning)
                return stacked(False)

            # NOTE [batched products, checked once]
            key = None
            if (k > 1 and chunk != 1 and not is_nested() and opts["retain_graph"] is not False
                    and not any(t.is_complex() for t in (*vectors, *prob.leaves))):
                if not key_box:
                    key_box.append(("vjp_fn batched", signature(
                        route_key(f), prob.leaves, None, prob.primals),
                        tuple(o.shape for o in flat_out)))
                key = key_box[0]
                if CHECKED.get(key) == "rev-loop":
                    return stacked(False)
            checking = key is not None and CHECKED.get(key) is None
            op = wrong[0][0] if wrong else None  # NOTE [batched products through a wrong
            if op is not None and not checking:  # batching rule]
                return one_at_a_time(op)
            res = _vectorised_or_loop(pull_call, f, "cotangents",
                                      lambda vec: stacked(vec, free=not checking),
                                      lambda: pull_kept(*(v[0] for v in vectors)))
            if not checking:
                return res
            res = checked_batch(
                pull_call, key, (function_key(f), function_name(f)), vectors, res,
                lambda: stacked(False, free=False), pull_checked,
                lambda vecs, vec: map_rows(pull_checked, lambda s, e: tuple(v[s:e] for v in vecs),
                                           _batch_size(vecs), vectorized=vec, chunk_size=chunk)[0],
                # (NOTE [batched pullback, checked near the point]; through an op known
                # wrong, NOTE [batched products through a wrong batching rule] speaks)
                None if op is not None else lambda cots: pullback_near(prob, has_aux, cots))
            if op is None or CHECKED.get(key) == "rev-loop":
                return res  # (the check's loop, and its warning with the numbers)
            return one_at_a_time(op)

        point.check(pull_call)  # (NOTE [the vjp point, kept])
        if wrong and wrong[0][1] is not None:
            raise wrong_pullback(pull_call, wrong[0][1], function_name(f))
        try:
            # (create_graph=True builds the graph whatever the caller's grad mode, as
            # torch.autograd.grad does: the batched products are joined under grad mode)
            with torch.enable_grad() if opts["create_graph"] is True else _NO_CONTEXT:
                grads = products()
        except RuntimeError as err:
            note_freed_graph(err, (
                f"{pull_call}: vjp_fn reads the graph that torch_vjp.vjp recorded for the "
                f"output, and part of it was freed by an earlier backward pass through it: "
                f"a call of vjp_fn with retain_graph=False (or with retain_graph=None and no "
                f"graph to create), or a .backward() or torch.autograd.grad through the "
                f"output without retain_graph=True.\n"
                f"  Fix: keep retain_graph=True (vjp_fn's default) on every call but the "
                f"last, or call torch_vjp.vjp again for a new graph."))
            raise
        grads = not_sharing(tuple(grads), [*tree_leaves(cotangents), *vectors])
        return tree_unflatten(list(grads), prob.in_spec)

    vjp_fn.__signature__ = _VJP_FN_SIGNATURE  # type: ignore[attr-defined]
    if wrong and wrong[0][0] is not None:
        _BATCHED_WRONGLY[vjp_fn] = wrong[0][0]
    if has_aux:
        return out, vjp_fn, res[2]
    return out, vjp_fn


# NOTE [batched products through a wrong batching rule]
# vjp_fn(v, batched=True) computes its K products under torch.vmap, whose batching rule for
# torch.cdist's backward is wrong (a relative error near 1). NOTE [batched products, checked
# once] compares them with products without vmap once per function and signature, and at a
# point where the products through cdist vanish (f multiplying them by a sum that is 0
# there) the wrong rows agreed, "rev" was remembered, and later vjp points' batched
# products were wrong by 6-10 without a word. So the graph of torch_vjp.vjp's own call of f
# is read for the operators whose backward torch batches wrongly (no call of f more), and
# where it holds one, the batched products are computed one at a time, without vmap, with
# a one-time warning (none with chunk_size=1, which asks for that, or for K = 1). The
# check's first call still runs where it would (where it finds the rows wrong, its loop
# and its warning with the numbers stand); where it finds them right, they are computed
# again one at a time. vjp(compile=True)'s batched calls return the eager vjp_fn's
# products there.
_BATCHED_WRONGLY: weakref.WeakKeyDictionary[Callable[..., Any], str] = \
    weakref.WeakKeyDictionary()


# NOTE [batched products keep the graph]
# With batched=True, vjp_fn runs the pullback once per chunk of cotangents (or once per
# cotangent in the loop), and the vectorised attempt may be followed by a loop that replaces
# it. So a retain_graph=False (or a None that resolves to False) given to vjp_fn applies to
# the last product alone: every earlier one keeps the graph, or the second chunk would find
# it freed by the first ("Trying to backward through the graph a second time"). The last
# product frees it only where an earlier product of the call succeeded (in the loop, always),
# as in jacobian_of (NOTE [jacobian_of retain_graph]): a single vectorised chunk keeps it,
# since were it to fail half way, the loop that replaces it needs the graph whole; and the
# first call of a signature, which checks its result against products without vmap (NOTE
# [batched products, checked once]), keeps it for those. A kept graph is freed when vjp_fn is
# released.


def _traced_vjp(f: Callable[..., Any], primals: tuple[Any, ...], has_aux: bool) -> Any:
    """``vjp`` inside the user's torch.compile: torch.func's, with ``vjp_fn``'s options."""
    res = torch.func.vjp(f, *primals, has_aux=has_aux)
    pull = res[1]

    def vjp_fn(cotangents: Any, *args: Any, **options: Any) -> Any:
        opts = _pullback_options(args, dict(options))
        graph = {"retain_graph": opts["retain_graph"], "create_graph": opts["create_graph"]}
        if not opts["batched"]:
            return pull(cotangents, **graph)
        return torch.func.vmap(lambda c: pull(c, **graph), chunk_size=opts["chunk_size"])(
            cotangents)

    vjp_fn.__signature__ = _VJP_FN_SIGNATURE  # type: ignore[attr-defined]
    return (res[0], vjp_fn) + tuple(res[2:])


def _compiled_vjp(f: Callable[..., Any], primals: tuple[Any, ...], has_aux: bool) -> Any:
    """``vjp(compile=True)``: the eager output, and a ``vjp_fn`` whose plain calls run
    a compiled program of forward and pullback (NOTE [compiled Jacobians])."""
    state = read_state(f)
    inputs = tuple(t for t in tree_leaves(primals) if isinstance(t, Tensor))
    versions = versions_of(state + inputs)  # (before f runs: f may write into them itself)
    res = vjp(f, *primals, has_aux=has_aux)
    eager_fn = res[1]
    versions = versions_of(state + inputs) if versions == versions_of(state + inputs) else None
    built = [builds()]  # (the programs built so far: NOTE [a compiled vjp_fn's point])

    def vjp_fn(cotangents: Any, *args: Any, **options: Any) -> Any:
        opts = _pullback_options(args, dict(options))
        if args or opts["retain_graph"] is not True or opts["create_graph"] is not None:
            return eager_fn(cotangents, *args, **options)
        now = read_state(f)
        if (versions is None or len(now) != len(state) or builds() != built[0]
                or any(a is not b for a, b in zip(now, state))
                or versions_of(now + inputs) != versions):
            return eager_fn(cotangents, **options)  # (NOTE [a compiled vjp_fn's point])
        batched, chunk_size = opts["batched"], opts["chunk_size"]
        if batched and eager_fn in _BATCHED_WRONGLY:  # NOTE [batched products through a
            return eager_fn(cotangents, **options)  # wrong batching rule]
        chunk = check_chunk_size(chunk_size, call="torch_vjp.vjp: vjp_fn")
        _warn_unbatched_chunk("torch_vjp.vjp: vjp_fn", chunk, batched)

        def program(f: Callable[..., Any], primals: tuple[Any, ...], cotangents: Any) -> Any:
            # (the forward's output too: where it is not the vjp point's, f reads something
            # the checks above do not see, and the graph of the vjp point answers)
            pulled = func_vjp(f, *primals, has_aux=has_aux)
            grads = (pulled[1](cotangents) if not batched
                     else torch.func.vmap(pulled[1], chunk_size=chunk)(cotangents))
            return pulled[0], grads

        def run(cot: Any) -> Any:
            return compiled_call(
                "torch_vjp.vjp", f, (has_aux, batched, chunk, "with output"), (primals, cot),
                lambda: (res[0], eager_fn(cot, **options)), lambda: program,
            )

        mine = own_builds()
        out, grads = run(cotangents)
        made = own_builds() - mine
        if builds() - built[0] != made:  # (another thread built a program since the check
            return eager_fn(cotangents, **options)  # above: this call may have run it)
        if made:  # (NOTE [a compiled vjp_fn's point]: its answer was the eager one)
            probe = probe_cotangents(cotangents)
            before = (builds(), own_builds())
            out_p, grads_p = run(probe)
            if (own_builds() != before[1] or builds() != before[0]
                    or results_agree(res[0], out_p) is not None
                    or results_agree(eager_fn(probe, **options), grads_p) is not None):
                return grads  # (built[0] stays behind: the graph answers from now on)
        built[0] = builds()
        if results_agree(res[0], out) is not None:  # (NOTE [a compiled vjp_fn's point])
            return eager_fn(cotangents, **options)
        return grads

    vjp_fn.__signature__ = _VJP_FN_SIGNATURE  # type: ignore[attr-defined]
    return (res[0], vjp_fn) + tuple(res[2:])


@overload
def jvp(
    f: Callable[..., Any],
    primals: tuple[Any, ...],
    tangents: tuple[Any, ...],
    *,
    batched: bool = False,
    chunk_size: int | None = None,
    strict: bool = False,
    has_aux: Literal[False] = False,
    compile: bool = False,
) -> tuple[Any, Any]: ...


@overload
def jvp(
    f: Callable[..., Any],
    primals: tuple[Any, ...],
    tangents: tuple[Any, ...],
    *,
    batched: bool = False,
    chunk_size: int | None = None,
    strict: bool = False,
    has_aux: Literal[True],
    compile: bool = False,
) -> tuple[Any, Any, Any]: ...


@results_of_their_own("jvp")  # NOTE [results of their own]
def jvp(
    f: Callable[..., Any],
    primals: tuple[Any, ...],
    tangents: tuple[Any, ...],
    *,
    batched: bool = False,
    chunk_size: int | None = None,
    strict: bool = False,
    has_aux: bool = False,
    compile: bool = False,
) -> tuple[Any, ...]:
    """``f(*primals)`` and the Jacobian-vector product ``J t`` for ``tangents`` ``t``.

    Args:
        f: a function of tensors returning a tensor or a tuple, list or dict of tensors
            (with ``has_aux``: a pair ``(output, aux)``).
        primals: the point, a tuple passed as ``f(*primals)``.
        tangents: one direction per primal, in the primals' structure, each shaped like its
            primal. With ``batched=True`` each carries an extra leading dimension K (the same
            for all): K products in one vectorised call, ``chunk_size`` at a time.
        batched: the tangents hold K directions each.
        chunk_size: with ``batched``, directions per vectorised call (``None``: all);
            without it, no effect (a one-time JacobianWarning says so).
        strict: as torch.func.jvp's: raise a RuntimeError when an output does not depend
            on the primals (its tangent would be zeros).
        has_aux: ``f`` returns ``(output, aux)``; the result is then
            ``(output, jvp_out, aux)``.
        compile: compile the product with ``torch.compile`` once per function, options and
            signature of the primals and tangents, and reuse it (as
            :func:`torch_vjp.jacobian`'s ``compile``: the first call also runs eagerly and
            the two are compared). Not with ``strict=True``, which needs the eager check.

    Returns:
        ``(output, jvp_out)``: ``jvp_out`` in the output's structure, each shaped like its
        output (with the leading K when ``batched``). Unlike torch.func.jvp's, an output,
        aux or tangent that is a primal or a tangent given, or a view of one, is a copy
        (NOTE [results of their own]).

    Raises:
        GradOutputsError: tangents of the wrong structure, shape, batch size, dtype or
            device, with the same messages as :func:`torch_vjp.grad`.
        JacobianCallError: ``primals`` is not a tuple, or a primal or an output of ``f``
            cannot be differentiated; a :class:`~torch_vjp.JacobianNotImplementedError`
            (also a NotImplementedError, as torch's) where an operator in ``f`` has no
            forward-mode formula; where f's graph holds an operator whose forward-mode
            formula torch (2.13) has wrong (``torch.scatter_reduce(..., reduce='prod')``,
            ``torch.triangular_solve``'s matrix, ``torch.linalg.det``: NOTE [forward mode
            through a wrong formula]), ``J t`` is computed by reverse over reverse, about
            twice a vjp's cost, with a one-time JacobianWarning (NOTE [J t by reverse over
            reverse]; the graph is read from the products' own call of ``f`` on the first
            call per function and signature of the primals, which calls ``f`` once more
            there), and this error is raised only where that is wrong too: f also runs an
            operator whose backward formula torch has wrong, an output computed from the
            primals does not require grad (a constant's tangent is zeros), or a backward
            cannot be differentiated; inside the user's own
            torch.compile (reverse over reverse is traced there too: NOTE [J t by reverse
            over reverse, traced]), through scatter_reduce(reduce='prod'), whose double
            backward torch cannot compile.

    Example:
        >>> import torch, torch_vjp as tv
        >>> x = torch.randn(3, dtype=torch.float64)
        >>> W = torch.randn(2, 3, dtype=torch.float64)
        >>> e0 = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
        >>> out, jt = tv.jvp(lambda x: W @ x, (x,), (e0,))
        >>> torch.testing.assert_close(jt, W[:, 0])
        >>> eye = torch.eye(3, dtype=torch.float64)
        >>> out, cols = tv.jvp(lambda x: W @ x, (x,), (eye,), batched=True)
        >>> torch.testing.assert_close(cols, W.T)   # K = 3 columns of J, stacked
    """
    call = "torch_vjp.jvp"
    f = plain_module(f)  # (a module wrapped in DistributedDataParallel: its module)
    do_compile = check_compile(compile, call=call)
    chunk = check_chunk_size(chunk_size, call=call)
    _warn_unbatched_chunk(call, chunk, batched)
    if tracing() or (do_compile and not strict and not is_nested()):

        def program(f: Callable[..., Any], primals: tuple[Any, ...],
                    tangents: tuple[Any, ...]) -> Any:
            return plain_jvp(f, primals, tangents, has_aux, batched, chunk, strict)

        if tracing():  # NOTE [compiled Jacobians], NOTE [J t by reverse over reverse, traced]
            return traced_jvp(f, primals, tangents, has_aux, batched, chunk, strict)
        return _compiled_jvp(call, f, (has_aux, batched, chunk), (primals, tangents),
                             lambda: jvp(f, primals, tangents, batched=batched,
                                         chunk_size=chunk_size, has_aux=has_aux), program)
    if not isinstance(primals, tuple):
        raise JacobianCallError(
            f"{call}: primals must be a tuple, the arguments of f, but it is a "
            f"{type(primals).__name__}. Fix: {call}(f, (x,), (t,)) for one argument."
        )
    check_tree_structure(primals, tangents, call=call, name="tangents", against="the primals")
    # unbatched, f is called once, on the caller's tensors, as torch.func.jvp calls it;
    # batched, once per chunk, on copies (NOTE [f's own copies])
    prob = Problem(f, primals, None, has_aux=has_aux, call=call, complex_ok=True,
                   copies=batched, any_outputs=True)
    labels = keyed(TANGENTS, primals)  # (a dict's entries named by key: tangents[0]['w'])
    try:
        normalized = normalize_grad_outputs(
            tuple(prob.leaves), tuple(tree_leaves(tangents)), labels, is_grads_batched=batched
        )
    except GradOutputsError as err:
        hint = _output_shaped_tangent(prob, tuple(tree_leaves(tangents)), batched, labels)
        if hint is None:
            raise
        whole = " torch_vjp.jacobian(f, *primals) gives the whole Jacobian."
        if "torch_vjp.jacobian(f, *primals)" in str(err):
            hint = hint.removesuffix(whole)
        # (the same error, its message longer: its attributes stay)
        err.args = (f"{err}\n  {hint}",) + err.args[1:]
        if isinstance(getattr(err, "explanation", None), str):
            err.explanation = f"{err.explanation}\n  {hint}"
        raise
    # (a tangent lives in its primal's space: cast to its dtype, as the checker warned, or
    # exactly for a real tangent of a complex primal)
    vectors = [v if v.dtype == x.dtype else v.to(x.dtype)
               for v, x in zip(_flat_vectors(normalized, prob.leaves, batched), prob.leaves)]
    # NOTE [forward mode through a wrong formula]: f's graph read on the first call per
    # function and signature, by the products' own call of f
    read_once = jvp_read_once(
        ("jvp: forward formulas", signature(route_key(f), prob.leaves, None, prob.primals)),
        prob.g_inner, has_aux)
    leaves = tuple(prob.leaves)

    before, reverse = _jvp_by_reverse(prob, lambda: leaves, vectors, tangents, has_aux,
                                      batched, chunk, call, f)

    if not batched:  # (buffers_kept: as vjp's call of f)
        copied = [_has_internal_overlap(x) for x in leaves]  # NOTE [an expanded primal]
        if any(copied):
            with torch.enable_grad():
                leaves = tuple(x.contiguous() if c else x for x, c in zip(leaves, copied))
        # NOTE [the caller's tangents, never written], here too: make_dual pairs a primal
        # with the caller's tangent itself, so a write f makes into its primal would write
        # into the tangent, and f = identity would return it as its own output tangent
        with buffers_kept(f, primals=primals), _explained(call, "jvp"):
            return read_once(lambda g: func_jvp(g, leaves, tuple(v.clone() for v in vectors),
                                                strict=strict, has_aux=has_aux),
                             reverse, before)

    g_now = [prob.g_inner]
    spec_box: list[Any] = []
    # one direction at a time (chunks of one, or the loop vmap falls back to), the products
    # are plain calls of f: they draw the same random numbers (one function, as the
    # vectorised call's one call of f is), from f's own generators too where there are
    # several
    k = _batch_size(vectors)
    same_draws = loop_draws(prob, k)

    def push(*tangent: Tensor, plain: bool = False) -> Any:
        if plain:
            same_draws()
        res = func_jvp(g_now[0], leaves, tangent, strict=strict, has_aux=has_aux)
        flat_t, spec = tree_flatten(res[1])
        if not spec_box:
            spec_box.append(spec)
        return tuple(flat_t), (res[0],) + tuple(res[2:])

    if k == 0:
        # (f's one call, as the products' calls are made: under the caller's grad mode, so
        # that the output and aux are differentiable as theirs are, and with the buffers f
        # changes put back, as nothing is changed by a call)
        with buffers_kept(f, primals=primals):
            res = prob.g(*leaves)
        out = res[0] if has_aux else res
        flat_o, spec = tree_flatten(out)
        tan = tree_unflatten([o.new_zeros((0, *o.shape)) for o in flat_o], spec)
        return (out, tan, res[1]) if has_aux else (out, tan)
    # NOTE [the caller's tangents, never written]: forward AD pairs a primal with its
    # tangent itself, so a write f makes into its (copied) primal, ``x.mul_(2)``, also
    # writes into the tangent. So each chunk's directions are copied first (one pass over
    # them, next to a forward pass of f per direction); without the copy the caller's
    # tangents came back doubled, and an expanded one (``t.expand(K, n)``) broke the
    # vectorised call and had the loop's writes compound in its shared memory, into wrong
    # products.
    # (NOTE [forward mode of a function that draws] in _engine/products.py: the directions
    # of one chunk share f's one draw, randomness="same", and every chunk after the first
    # starts from the generators' state before the first, so that all K products are of
    # the function one call of f draws, as the unbatched jvp's are)
    one_call = chunk is None or chunk >= k

    def products(vec: bool) -> Any:
        fn = functools.partial(push, plain=not vec or not one_call)
        return map_rows(fn, lambda s, e: tuple(v[s:e].clone() for v in vectors), k,
                        vectorized=vec, chunk_size=chunk, extras=True,
                        batched_fn=torch.func.vmap(fn, randomness="same"))

    def compute(g: Callable[..., Any]) -> Any:
        g_now[0] = g
        stacked, extra = _vectorised_or_loop(
            call, f, "tangents", products,
            lambda: push(*(v[0].clone() for v in vectors), plain=True))
        return (extra[0], tree_unflatten(stacked, spec_box[0])) + tuple(extra[1:])

    with buffers_kept(f, primals=primals), _explained(call, "jvp"):
        return read_once(compute, reverse, before)
