"""What :func:`torch_vjp.vjp` and :func:`torch_vjp.jvp` share around their products:
torch.func's refusals explained (``_explained``), the one vectorised-then-loop policy of
``batched=True`` (``_vectorised_or_loop``), zeros for outputs that need no vector, the
sentence that tells a tangent from a cotangent, primals whose elements share memory
(NOTE [an expanded primal]), the random cotangents a compiled ``vjp_fn`` checks its
program at (NOTE [a compiled vjp_fn's point]), and jvp's ``J t`` by reverse over reverse
where f runs a forward-mode formula torch has wrong, compiled or not (NOTE [J t by reverse
over reverse]).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from torch_vjp._check_labels import Labels
from torch_vjp._engine.compiled import Built, compiled_call, tracing
from torch_vjp._engine.copies import not_sharing
from torch_vjp._engine.jacobian import function_key, function_name
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.refusals import (
    RENORM_FIX,
    VMAP_CAUSES,
    forward_fix,
    forward_refusal,
    mutates_captured,
    refusal_kind,
    renorms,
    vmap_refusal,
)
from torch_vjp._engine.revjvp import compiled_forward_why, pushforward_by_reverse
from torch_vjp._engine.rows import loop_draws, map_rows, run_with_fallback
from torch_vjp._errors import (
    JacobianCallError,
    JacobianNotImplementedError,
    JacobianWarning,
    quote_error,
    warn_once,
)

__all__ = ["probe_cotangents", "recording_connected", "results_of_their_own"]


def _warn_unbatched_chunk(call: str, chunk: int | None, batched: object) -> None:
    """Warns once where ``chunk_size`` is given without ``batched=True``: an unbatched call
    computes one product, so the option would be dropped without a word. Not while dynamo
    traces the call (the user's torch.compile): warnings.warn is a graph break there, and
    fullgraph=True refused a call it compiled before."""
    if chunk is not None and batched is False and not tracing():
        warn_once(
            ("chunk-unbatched", call),
            f"{call}: chunk_size={chunk} has no effect without batched=True: an unbatched "
            f"call computes one product. To compute K products chunk_size at a time, stack "
            f"K vectors along a new leading dimension and pass batched=True; otherwise drop "
            f"chunk_size. This warning is shown once.",
            JacobianWarning,
        )


@contextlib.contextmanager
def _explained(call: str, what: str) -> Iterator[None]:
    """torch.func's refusal of a function that changes a tensor it captured in place (a
    module in training mode updating its running statistics), its other known refusals
    (:func:`vmap_refusal`) and, for a jvp, forward mode's (an operator without a forward-mode
    formula: :func:`forward_refusal`, a JacobianNotImplementedError) as a JacobianCallError
    that says so and what to do;
    every other error passes through untouched."""
    try:
        yield
    except NotImplementedError as err:
        why = forward_refusal(err) if what == "jvp" else None
        if why is None:
            raise
        # (a jvp staticmethod for a custom Function only: a torch operator has none to
        # give; the math kernel for fused attention)
        fix = forward_fix(err)
        raise JacobianNotImplementedError(
            f"{call}: a Jacobian-vector product computes with forward-mode AD, and {why}.\n"
            f"  torch said: {quote_error(err)}\n  Fix: compute with reverse mode, which needs "
            f"only backward formulas: torch_vjp.vjp(f, *primals) for v^T J, or "
            f"torch_vjp.jacobian(f, *primals, strategy='rev') times the tangents for J t"
            + ("." if fix is None else f"; or {fix}.")
        ) from None
    except RuntimeError as err:
        if not mutates_captured(err):
            why = vmap_refusal(err)
            if why is None:
                raise
            plain = (f"differentiate with plain autograd: out = f(x) with "
                     f"x.requires_grad_(), then torch_vjp.grad(out, x, v) for a vjp, or "
                     f"torch.autograd.functional.{what}(f, x, v)")
            kind = refusal_kind(err)
            if kind == "setup_context":
                fix = (f"give the Function a setup_context staticmethod (forward without ctx; "
                       f"see torch's 'Extending torch.func with autograd.Function'); or "
                       f"{plain}")
            elif kind == "randomness":
                fix = ("put the module in eval mode (model.eval()) if the draws are dropout's; "
                       "or take the directions one at a time (chunk_size=1: plain calls of "
                       "f, with the same draws for every direction)")
            else:
                fix = plain
            raise JacobianCallError(
                f"{call}: {why}.\n  torch.func said: {quote_error(err)}\n  Fix: {fix}."
            ) from None
        raise JacobianCallError(
            f"{call}: {vmap_refusal(err)}, which torch.func.{what}, on which "
            f"{call} computes, cannot differentiate.\n  torch.func said: {quote_error(err)}\n"
            f"  Fix: {RENORM_FIX if renorms(err) else 'put the module in eval mode (model.eval())'}"
            f"; or differentiate with plain "
            f"autograd: out = f(x) with x.requires_grad_(), then torch_vjp.grad(out, x, v) "
            f"for a vjp, or torch.autograd.functional.{what}(f, x, v)."
        ) from None


def _flat_vectors(
    normalized: tuple[Tensor | None, ...], like: list[Tensor], batched: bool
) -> list[Tensor]:
    """Replaces the checker's ``None`` (no vector for an output that needs none) by zeros."""
    k = None
    if batched:
        k = next((v.shape[0] for v in normalized if v is not None), 0)
    out = []
    for v, t in zip(normalized, like):
        if v is None:
            v = t.new_zeros((k, *t.shape) if batched else t.shape)
        out.append(v)
    return out


def _output_shaped_tangent(prob: Problem, tangents: tuple[Any, ...], batched: bool,
                           labels: Labels) -> str | None:
    """Where a refused tangent's shape is not its primal's, the sentence that tells a
    tangent from a cotangent (a vector shaped like f's output, for a vector-Jacobian
    product, given to a JVP is the common mistake); else None. f is not run for it: a call
    on the error path would be one more call of f, with its effects (a counter it
    increments, a tensor it writes into). ``labels`` name the tangents and primals (a
    dict's entries by key)."""
    for i, (t, x) in enumerate(zip(tangents, prob.leaves)):
        if not isinstance(t, Tensor):
            continue
        shape = t.shape[1:] if batched and t.dim() else t.shape
        if shape == x.shape:
            continue
        return (
            f"If {labels.go(i)} is shaped like f's output, it is a cotangent: a vector shaped "
            f"like the output is for a vector-Jacobian product v^T J "
            f"(torch_vjp.vjp(f, *primals)[1](v)); a tangent is a change of the input, shaped "
            f"like {labels.out(i)}, for J t. torch_vjp.jacobian(f, *primals) gives the whole "
            f"Jacobian."
        )
    return None


def _vectorised_or_loop(call: str, f: object, vectors: str,
                        products: Callable[[bool], Any], first: Callable[[], Any]) -> Any:
    """``products(True)``, the batched products under vmap; where vmap cannot run them and
    one at a time can (``first()``, the first product without vmap, runs), ``products(False)``,
    with a one-time warning (NOTE [one fallback policy]). torch.func's known refusals (a
    Function without setup_context, random draws, a write into a captured tensor) are
    raised before the loop, for :func:`_explained` to explain."""

    def warn(err: Exception) -> None:
        if refusal_kind(err) is not None:
            raise err
        warn_once(
            (call, function_key(f), type(err)),
            f"{call}: batched=True could not vectorise the products of "
            f"{function_name(f)} (torch.func transforms under torch.vmap), so it computed "
            f"them one {vectors[:-1]} at a time in a Python loop, usually many times slower.\n"
            f"  The vectorised attempt said: {quote_error(err)}\n"
            f"  Typical causes: {VMAP_CAUSES}. Pass chunk_size=1 to skip the vectorised "
            f"attempt. This warning is shown once per function.",
            JacobianWarning,
        )

    return run_with_fallback(lambda: products(True), lambda: products(False), on_fallback=warn,
                             check_one=first)


# NOTE [an expanded primal]
# torch.func.jvp pairs each primal with its tangent by forward AD's make_dual, which writes the
# tangent into a tensor of the primal's strides; for a primal whose elements share memory
# (``x.expand(...)``, a stride of 0) that write fails with torch's "more than one element of
# the written-to tensor refers to a single memory location", an error about a write the
# caller never made. f cannot write into such a primal either (torch refuses the same
# write), so the unbatched jvp differentiates a dense copy of it instead (under grad mode, so
# that the copy keeps the primal's autograd history); the batched jvp, like the Jacobians,
# already gives f copies (NOTE [f's own copies]).
# (Inside an outer torch.func transform a primal is its wrapper, which the check cannot
# read: torch.func's own behaviour stays there.)
_overlap_check = getattr(torch, "_debug_has_internal_overlap", lambda x: 0)


def _has_internal_overlap(x: Tensor) -> bool:
    try:
        answer = int(_overlap_check(x))
    except RuntimeError:  # (a torch.func wrapper: "Batching rule not implemented")
        return False
    if answer != 2:
        return bool(answer)
    # ("too hard": strided but not dense, x[::2] as much as an overlapping as_strided. One
    # whose strides, smallest first, each clear the extent of the dimensions below shares
    # no memory, and make_dual pairs it as torch.func does; a copy of it would have f's
    # writes go to the caller's tangent instead of its primal)
    if x.numel() == 0:
        return False
    extent = 0
    for size, stride in sorted(((n, s) for n, s in zip(x.shape, x.stride()) if n > 1),
                               key=lambda d: d[1]):
        if stride <= extent:
            return True
        extent += stride * (size - 1)
    return False


def _batch_size(vectors: list[Tensor]) -> int:
    return int(vectors[0].shape[0])


def recording_connected(f: Callable[..., Any], has_aux: bool
                        ) -> tuple[Callable[..., Any], list[bool]]:
    """``f`` as torch.func.vjp calls it, recording into the list returned with it whether
    each flat output depends on the primals (requires grad at the transform's level), for
    :func:`torch_vjp._checks.check_cotangents`' ``connected``."""
    connected: list[bool] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        res = f(*args, **kwargs)
        out = res[0] if has_aux and isinstance(res, tuple) and len(res) == 2 else res
        connected[:] = [not isinstance(o, Tensor) or o.requires_grad for o in tree_leaves(out)]
        return res

    return recorded, connected


def probe_cotangents(cotangents: Any) -> Any:
    """Cotangents drawn from a generator of their own (the caller's stays where it is), of
    the shapes, dtypes and devices of ``cotangents``: NOTE [a compiled vjp_fn's point]."""
    gen = torch.Generator().manual_seed(20261127)

    def draw(t: Any) -> Any:
        if not isinstance(t, Tensor) or not (t.is_floating_point() or t.is_complex()):
            return t
        wide = torch.complex128 if t.is_complex() else torch.float64
        return torch.randn(t.shape, dtype=wide, generator=gen).to(dtype=t.dtype,
                                                                  device=t.device)
    return tree_map(draw, cotangents)


# NOTE [a compiled vjp_fn's point]
# vjp(compile=True)'s vjp_fn runs a compiled program of forward and pullback, which reads f's
# closure, globals and modules as they are when vjp_fn is called; the eager vjp_fn holds the
# graph of the vjp point. Where f reads something that has been rebound since (a captured
# tensor, ``W = W_next``; a module's parameter replaced, ``lin.weight = Parameter(...)``),
# the compiled program would differentiate another function, so vjp_fn uses the graph of
# the vjp point instead; the same where one of them, or a primal, was written in place since
# (``S.add_(5)``: the graph saved the old values, the program would read the new). What is
# compared, by identity and version counter: the contents of f's closure cells, defaults and
# the globals it names (of a plain function, or of a bound method's function), the numbers,
# flags and strings among the attributes of the objects (and items of the dicts) they hold,
# the parameters, buffers and plain attributes (a scale, the training flag) of the modules
# f reaches, and the primals (:func:`~torch_vjp._engine.point.read_state`). A function f
# that writes into them itself always uses the graph. What these do not see (a tensor in a
# list or a partial, a write through ``.data``, a number two objects deep) the program's own
# forward output may show: where it is not the vjp point's (up to the rounding of a compiled
# program), the graph answers too. Nor does the output show a change that moves only the
# derivative there (``x + cfg.inner.k * (x - c)`` at ``x = c``, ``k`` two objects deep):
# dynamo guards such a value and recompiles, and the rebuilt program (NOTE [a recompiled
# entry]) computes the new function's products. So a vjp_fn also counts the programs built
# in the process (:func:`~torch_vjp._engine.compiled.builds`): where one was built since its
# vjp call, other than in a call of its own, the graph answers. A program built in a call of
# its own was compared with its eager products at that call's cotangents only, which can
# agree by coincidence (``k`` changed after the vjp call, and cotangents orthogonal to the
# directions it moves); so that call also runs the program at cotangents drawn at random and
# compares it with the graph's products there, and where they differ the graph answers from
# then on. Builds are counted per thread too (:func:`~torch_vjp._engine.compiled.own_builds`):
# one another thread made during a call is not the call's own. A training loop that builds
# nothing after its first step keeps the compiled program; a vjp_fn made before another
# point's program was built does not.


#: The ops compile=True's eager call of jvp computed J t by reverse over reverse through,
#: per thread (NOTE [J t by reverse over reverse]).
_BY_REVERSE = threading.local()


def _compiled_jvp(call: str, f: Callable[..., Any], key: Any, args: Any,
                  eager_call: Callable[[], Any], program: Callable[..., Any]) -> Any:
    """``compiled_call`` for ``jvp(compile=True)``: where the eager call computed ``J t`` by
    reverse over reverse, a compiled forward-mode program would be wrong, so the signature
    stays eager (NOTE [J t by reverse over reverse])."""
    reversed_op: list[str] = []

    def eager() -> Any:
        _BY_REVERSE.ops = reversed_op
        try:
            return eager_call()
        finally:
            _BY_REVERSE.ops = None

    def build() -> Any:
        if reversed_op:
            return Built(None, why=compiled_forward_why(reversed_op[0]))
        return program

    return compiled_call(call, f, key, args, eager, build)


def _jvp_by_reverse(prob: Problem, leaves: Callable[[], tuple[Tensor, ...]],
                    vectors: list[Tensor], tangents: Any, has_aux: bool, batched: bool,
                    chunk: int | None, call: str, f: Callable[..., Any]
                    ) -> tuple[Callable[[], Any], Callable[[str, Any], Any]]:
    """``(before, reverse)`` for ``fwd_wrong.jvp_read_once``: ``before()`` the state a first
    call starts from where f is called again; ``reverse(op, state)`` jvp's result with ``J
    t`` by reverse over reverse (NOTE [J t by reverse over reverse]). ``leaves()``: the
    primals the products run at."""

    def before() -> Any:
        draws = loop_draws(prob, 2)
        draws()
        return draws, tuple(x.clone() for x in leaves())

    def reverse(op: str, state: Any) -> Any:
        if not torch.is_inference_mode_enabled():
            return by_reverse(op, state)
        # NOTE [J t by reverse over reverse in inference mode]
        with torch.inference_mode(False), torch.no_grad():
            return by_reverse(op, state, normal=True)

    def by_reverse(op: str, state: Any, normal: bool = False) -> Any:
        if getattr(_BY_REVERSE, "ops", None) is not None:  # (compile=True's eager call)
            _BY_REVERSE.ops.append(op)
        xs = leaves()
        if state is not None:
            state[0]()
            xs = state[1]
        vecs = vectors
        if normal:
            xs = tuple(x.clone() if x.is_inference() else x for x in xs)
            vecs = [v.clone() if v.is_inference() else v for v in vectors]
        res, push, one_by_one, spec = pushforward_by_reverse(
            prob.g_inner, xs, has_aux, call, function_name(f), op, function_key(f),
            state is not None)
        if not batched:
            tan = push(*vecs)
        else:  # (K > 0: K = 0 returned before)
            tan = _vectorised_or_loop(
                call, f, "tangents",
                lambda vec: map_rows(push, lambda s, e: tuple(v[s:e] for v in vecs),
                                     _batch_size(vecs), vectorized=vec and not one_by_one,
                                     chunk_size=chunk)[0],
                lambda: push(*(v[0] for v in vecs)))
        # (a tangent passed through unchanged, f = (det(x), x), is the caller's no more)
        tan = not_sharing(tuple(tan), [*tree_leaves(tangents), *vectors])
        return (res[0], tree_unflatten(list(tan), spec)) + tuple(res[1:])

    return before, reverse


# NOTE [results of their own]
# torch.func.vjp and torch.func.jvp hand back f's output as f returns it: for f = identity,
# torch.func.vjp's output is the primal itself, torch.func.jvp's a tensor on its memory (and
# its tangent the caller's tangent itself), and a view f returns (``x.view(-1)``, ``x.t()``)
# is a view of the caller's tensor. So a write the caller made into its input afterwards
# (``x.add_(1)``) changed the result it had been handed, and torch_vjp.jvp and
# torch_vjp.vjp disagreed on whether the output was the primal itself. Every tensor of the
# output, the aux and jvp's tangents that shares memory with a tensor the caller passed (a
# primal, jvp's tangents) is a copy of it instead (a clone: its autograd history kept), in
# both: one copy of such outputs only, none where an output is f's own new tensor. Not
# inside the user's torch.compile, which traces the plain form (NOTE [compiled Jacobians]).


def results_of_their_own(which: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``vjp`` or ``jvp`` (``which``) with every tensor of its output, aux and (jvp's)
    tangents that shares memory with a tensor the caller passed replaced by a copy (NOTE
    [results of their own])."""

    def own(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            res = fn(*args, **kwargs)
            if tracing() or not isinstance(res, tuple):
                return res
            if which == "jvp":
                given = [*tree_leaves(args[1:3]), *tree_leaves(
                    (kwargs.get("primals"), kwargs.get("tangents")))]
                at = range(len(res))
            else:
                given, at = tree_leaves(args[1:]), [i for i in range(len(res)) if i != 1]
            given = [t for t in given if isinstance(t, Tensor)]
            if not given:
                return res
            res = list(res)
            for i in at:
                flat, spec = tree_flatten(res[i])
                res[i] = tree_unflatten(list(not_sharing(tuple(flat), given)), spec)
            return tuple(res)

        return wrapper

    return own
