"""f's own copies of the primals: made once per call, reset before each call of f, and
never written under a graph to the caller's tensors.

NOTE [f's own copies]
A Jacobian, VJP or JVP calls f more than once (a probe for the output sizes, one call per
chunk or per product in a loop, a fallback), and f may modify its arguments in place. So
f never sees the caller's tensors: each tensor primal is copied once per call (under the
caller's grad mode, so a copy stays differentiable with respect to the original when a
graph is wanted), and before each call of f a copy that an earlier call modified in place
(its version counter moved) is reset to the caller's value. The caller's tensors are never
written, and every call of f starts from the same point. The copies cost one pass over the
primals per call, next to products that each cost at least as much. Reverse mode
differentiates against the leaves themselves, and autograd refuses a write into a tensor
that requires grad and has no history: where f makes one (``x[0] = x[1]``), the Jacobian
is taken again with f given a copy of each differentiated leaf on every call
(``writes_inputs``; NOTE [f writes into its input] in :mod:`torch_vjp._engine.jacobian`).

vjp and jvp (unbatched) call f exactly once, as torch.func.vjp and torch.func.jvp do, so
they pass ``copies=False`` and f runs on the caller's tensors, with torch.func's semantics:
a write f makes into a primal reaches the caller's tensor, and a primal's autograd history
is kept whatever the grad mode at the call (a vjp taken under torch.no_grad() whose vjp_fn
runs under grad mode gives results that are differentiable with respect to the primals).

NOTE [a copy with a history]
Where a graph is wanted (``create_graph=True``, a batched jvp) and the caller's tensor
requires grad, its copy is ``t.clone()`` with an autograd history back to ``t``, so that the
result is differentiable with respect to it. A write f makes into such a copy (autograd
takes it: the copy is no leaf) changes that history and bumps the version counter that the
graphs of earlier calls saved, and resetting the values in place undoes neither: a later
backward through the result failed ("modified by an inplace operation"), or, where the
products fell back to another route, silently differentiated the history of the write (a
gradient through a non-differentiated primal ``w`` that f doubles in place came out 2, 4, 8
times too large, once more per call). So f is never given such a copy itself: each call of
f gets a clone of it (where it is wrapped at a transform's level, a clone of the wrapper),
the differentiated leaves as ``writes_inputs`` clones them (NOTE [f writes into its input] in
:mod:`torch_vjp._engine.jacobian`). A write then lands in that call's own clone, the copy
and its history stay as made, and no reset is needed. One more pass over those primals per
call of f, only where a graph to the caller's tensors is kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

__all__ = ["Copy", "below_transforms", "normal_tensors", "fresh_copies", "has_history",
           "not_sharing",
           "given_fresh"]


class Copy(list):  # type: ignore[type-arg]
    """``[copy, original, version]`` of one tensor primal; see NOTE [f's own copies]."""

    __slots__ = ()

    def reset(self) -> None:
        copy, original = self[0], self[1]
        # f runs inside torch.func transforms, which refuse a write to a tensor they captured;
        # this write restores the point f is evaluated at, before f runs, so it is done below
        # them (the transforms' inputs share the copy's storage and see the restored values).
        with below_transforms(), torch.no_grad():
            copy.copy_(original)
        self[2] = copy._version


below_transforms = getattr(torch._C, "_DisableFuncTorch", contextlib.nullcontext)


def normal_tensors() -> Any:
    """Where the copies are made: outside ``torch.inference_mode``, whose tensors have no
    version counter (the guard reads it) and cannot be written where the transforms run
    f, outside that mode (as ``reset`` writes them)."""
    if torch.is_inference_mode_enabled():
        return torch.inference_mode(False)
    return contextlib.nullcontext()


def fresh_copies(
    primals: tuple[Any, ...], detached: bool = False
) -> tuple[tuple[Any, ...], list[Copy]]:
    """The primals with every tensor replaced by a copy (detached from the caller's graph for
    a detached result), and the copies' guards."""
    guard: list[Copy] = []

    def copy(t: Any) -> Any:
        if not isinstance(t, Tensor) or t.is_nested or t.layout is not torch.strided:
            return t  # refused later if differentiated; never written by us
        with normal_tensors():
            c = t.detach().clone() if detached else t.clone()
        guard.append(Copy((c, t, c._version)))
        return c

    if all(isinstance(p, Tensor) for p in primals):
        return tuple(copy(p) for p in primals), guard
    return tuple(tree_map(copy, p) for p in primals), guard


def has_history(c: Tensor) -> bool:
    """Whether the copy ``c`` carries an autograd history to the caller's tensor (a graph is
    wanted, and the caller's tensor requires grad, at top level or at the level of an outer
    torch.func transform): NOTE [a copy with a history]."""
    return c.grad_fn is not None


def given_fresh(f: Callable[..., Any], kept: set[int], idx: tuple[int, ...]
                 ) -> Callable[..., Any]:
    """``f`` called with a clone of each copy in ``kept`` among the primals not at ``idx``
    (the differentiated ones are cloned by :meth:`Problem._reset`): NOTE [a copy with a
    history]."""

    def fresh(t: Any) -> Any:
        return t.clone() if isinstance(t, Tensor) and id(t) in kept else t

    def given_fresh(*args: Any) -> Any:
        return f(*[a if i in idx else fresh(a) if isinstance(a, Tensor) else tree_map(fresh, a)
                   for i, a in enumerate(args)])

    return given_fresh


def not_sharing(results: tuple[Any, ...], given: list[Any]) -> tuple[Any, ...]:
    """``results`` with each tensor that shares memory with a tensor in ``given`` (the
    vectors the caller passed) replaced by a copy. A backward pass hands a cotangent on
    unchanged through the identity or a view (``x.view(-1)``, ``x.t()``), so the product
    would be the caller's own tensor, or a view of it, and a write into the result would
    write into the caller's vector."""
    shared = {p for p in map(_storage, given) if p}
    if not shared:
        return results
    return tuple(r.clone() if isinstance(r, Tensor) and _storage(r) in shared else r
                 for r in results)


def _storage(t: Any) -> int | None:
    """Where a tensor's memory starts (None where there is none to read: not a tensor, a
    torch.func wrapper)."""
    if not isinstance(t, Tensor) or t.layout is not torch.strided:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
