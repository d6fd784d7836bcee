"""Operators whose forward-mode formula torch has wrong, read off f's graph for the
forward-mode products the caller asked for.

NOTE [forward mode through a wrong formula]
Two of torch's (2.13) forward-mode formulas are known wrong (:data:`WRONG_FORWARD` in
:mod:`torch_vjp._engine.wrongops`, the one list of them; each checked in float64 against
reverse mode and central differences):

* ``torch.scatter_reduce(..., reduce='prod')`` for the source (with and without
  ``include_self``), and for the tensor scattered into with ``include_self=True``: errors of
  the size of the entries at random points and at points holding zeros (the other
  reductions are right);
* ``torch.triangular_solve`` for the matrix, under every flag (a relative error near 1; the
  right-hand side's is right, and so is ``torch.linalg.solve_triangular``'s).

``"auto"`` checks its forward products against a reverse product (NOTE [auto, checked once]
in :mod:`torch_vjp._engine.fwdcheck`), which found them wrong at random points; but at a
first point with zeros, or where f multiplies them by a sum that is 0 there, the wrong
formula agreed, forward mode was remembered, and later calls were wrong by 5-7 without a
word. So the graph of the check's reverse product (no call of f more) is read for the
operators of this list, and where forward mode runs one and agreed all the same, "auto"
computes with reverse mode instead, checked as its reverse route is, with a one-time
warning (:func:`auto_forward_message`); where it disagreed, the check's own route and
warning, with its numbers, stand. ``torch_vjp.jvp``, which
has no other mode to run, returned ``J t`` wrong without a word, batched or not, as
torch.func.jvp does. As reverse mode through a backward torch has wrong is refused, naming
forward mode (NOTE [named reverse strategies and wrong formulas]), forward mode through a
forward formula torch has wrong is refused, naming reverse mode (:func:`wrong_pushforward`;
:func:`named_forward` for a named ``"fwd"`` or ``"fwd-loop"`` Jacobian).

Forward mode records no graph, so on the first call per function and input signature the
products' own call of f runs inside ``torch.func.vjp``, whose level records f's graph
(:func:`reading_forward`: no call of f more; the graph's saved tensors live for that call
only, and its pullback is never run), and the op found is remembered with the routes of
"auto" (:func:`forward_checked`, :func:`forward_read`): later calls refuse before calling
f, or run as before. A function that branches to another operator on other values is
read where it first ran. Not read in inference mode, where nothing is recorded (nor
remembered there); where the call inside ``torch.func.vjp`` fails, the products are
computed as before (f called again), and nothing is remembered.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any
import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from torch_vjp._engine.graph import graph_nodes
from torch_vjp._engine.wrongops import WRONG_FORWARD, WRONG_FORWARD_WHERE
from torch_vjp._errors import JacobianCallError, StrategyError

__all__ = ["auto_forward_message", "forward_checked", "forward_read", "named_forward",
           "reading_forward", "wrong_forward", "wrong_pushforward"]

_SCATTER = WRONG_FORWARD["ScatterReduceBackward0"]
#: How each op's forward-mode formula is wrong.
_HOW = {_SCATTER: ("for the source, and for the tensor scattered into with "
                   "include_self=True (errors of the size of the entries)"),
        WRONG_FORWARD["TriangularSolveBackward0"]: ("for the matrix A (a relative error "
                                                    "near 1)")}
#: What f can use instead, where forward mode is wanted.
_INSTEAD = {WRONG_FORWARD["TriangularSolveBackward0"]: (
    "; or torch.linalg.solve_triangular, whose forward-mode formula is right")}


def wrong_forward(outs: Sequence[Tensor]) -> str | None:
    """The op of :data:`WRONG_FORWARD` (by name) whose forward-mode formula torch has wrong
    for a tensor the graph of ``outs`` differentiates; None where there is none."""
    for node in graph_nodes(outs):
        name = type(node).__name__
        if name in WRONG_FORWARD and WRONG_FORWARD_WHERE[name](node):
            return WRONG_FORWARD[name]
    return None


def reading_forward(g: Callable[..., Any], has_aux: bool
                    ) -> tuple[Callable[..., Any], list[str | None]]:
    """``g`` (f as the forward-mode products call it) run inside ``torch.func.vjp``, whose
    level records f's graph, recording into the list returned with it the op of
    :func:`wrong_forward` that graph holds (NOTE [forward mode through a wrong formula]): no
    call of f more; the pullback is dropped, unused."""
    found: list[str | None] = []

    def read(*ys: Tensor) -> Any:
        res = g(*ys)
        out = res[0] if has_aux else res
        op = wrong_forward([o for o in tree_leaves(out)
                            if isinstance(o, Tensor) and o.grad_fn is not None])
        found[:] = [found[0] if found and found[0] is not None else op]
        return res

    def recorded(*xs: Tensor) -> Any:
        with torch.enable_grad():
            res = torch.func.vjp(read, *xs, has_aux=has_aux)
        return (res[0], res[2]) if has_aux else res[0]

    return recorded, found


def forward_checked(key: Hashable) -> str | None:
    """What NOTE [forward mode through a wrong formula] remembered for ``key`` (a function
    and input signature): the op, ``""`` (none), or None where f's graph is to be read
    (not in inference mode, where nothing is recorded, nor remembered)."""
    from torch_vjp._engine.fwdcheck import CHECKED  # (it imports this module)

    hit = CHECKED.get(key)
    if hit is None and torch.is_inference_mode_enabled():
        return ""
    return hit  # type: ignore[return-value]


def forward_read(key: Hashable, found: Sequence[str | None]) -> str | None:
    """Remembers for ``key`` the op a :func:`reading_forward` call ``found`` (none where
    it read nothing) and returns it."""
    from torch_vjp._engine.fwdcheck import remember  # (it imports this module)

    op = found[0] if found else None
    remember(key, op or "")
    return op


def wrong_pushforward(call: str, op: str, name: str) -> JacobianCallError:
    """The error of ``torch_vjp.jvp`` through ``op``, an operator whose forward-mode
    formula torch has wrong (NOTE [forward mode through a wrong formula]), in f
    (``name``)."""
    return JacobianCallError(
        f"{call}: torch's forward-mode formula of {op} is wrong {_HOW[op]}, which f "
        f"({name}) computes from the primals, so J t would be wrong (torch.func.jvp's "
        f"too), batched or not.\n"
        f"  Fix: compute with reverse mode, whose formula is right: "
        f"torch_vjp.jacobian(f, *primals, strategy='rev') and J t from it, or "
        f"torch_vjp.vjp(f, *primals) for v^T J{_INSTEAD.get(op, '')}."
    )


def named_forward(call: str, op: str, name: str, strategy: str) -> StrategyError:
    """The error of a named forward strategy (``"fwd"``, ``"fwd-loop"``) through ``op``, an
    operator whose forward-mode formula torch has wrong (NOTE [forward mode through a wrong
    formula]), in f (``name``): reverse mode is the fix, as forward mode is reverse's."""
    return StrategyError(
        f"{call}: strategy={strategy!r} computes with forward-mode AD, and torch's "
        f"forward-mode formula of {op} is wrong {_HOW[op]}, which f ({name}) computes from "
        f"its differentiated inputs, so the Jacobian would be wrong, with or without "
        f"torch.vmap.\n"
        f"  Fix: strategy='rev' (reverse mode, whose formula is right), or 'auto', which "
        f"checks its forward products and takes reverse mode there{_INSTEAD.get(op, '')}."
    )


def auto_forward_message(call: str, name: str, op: str) -> str:
    """The one-time warning that "auto" computed with reverse mode where forward mode, its
    first route, agreed with the reverse product but runs ``op``'s wrong forward-mode
    formula (NOTE [forward mode through a wrong formula])."""
    return (
        f"{call}: forward mode (strategy='auto' chooses it for a Jacobian with more output "
        f"than input elements) agrees with a reverse product at this point, but it runs "
        f"torch's forward-mode formula of {op} in f ({name}), which is wrong {_HOW[op]}: "
        f"they agree here only by a coincidence of the point (zeros, or a factor that is 0 "
        f"here), and forward mode would be wrong at others. strategy='auto' computed the "
        f"Jacobian with reverse mode, and does so for this function and input shapes from "
        f"now on.\n"
        f"  Pass strategy='rev' to compute it that way directly. This warning is shown once "
        f"per function."
    )
