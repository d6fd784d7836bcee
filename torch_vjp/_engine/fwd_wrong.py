"""Operators whose forward-mode formula torch has wrong, read off f's graph for the
forward-mode products the caller asked for.

NOTE [forward mode through a wrong formula]
Three of torch's (2.13) forward-mode formulas are known wrong (:data:`WRONG_FORWARD` in
:mod:`torch_vjp._engine.wrongops`, the one list of them; each checked in float64 against
reverse mode and central differences):

* ``torch.scatter_reduce(..., reduce='prod')`` for the source (with and without
  ``include_self``), and for the tensor scattered into with ``include_self=True``: errors of
  the size of the entries at random points and at points holding zeros (the other
  reductions are right);
* ``torch.triangular_solve`` for the matrix, under every flag (a relative error near 1; the
  right-hand side's is right, and so is ``torch.linalg.solve_triangular``'s).
* ``torch.linalg.det`` at singular matrices (an exact zero pivot, or one of rounding size:
  errors of the size of the entries); right at the others, but as a property of the point
  it is refused at every point (``torch.det`` and ``Tensor.det`` are read too).

``"auto"`` checks its forward products against a reverse product (NOTE [auto, checked once]
in :mod:`torch_vjp._engine.fwdcheck`), which found them wrong at random points; but at a
first point with zeros, or where f multiplies them by a sum that is 0 there, the wrong
formula agreed, forward mode was remembered, and later calls were wrong by 5-7 without a
word. So the graph of the check's reverse product (no call of f more) is read for the
operators of this list, and where forward mode runs one and agreed all the same, "auto"
computes with reverse mode instead, checked as its reverse route is, with a one-time
warning (:func:`auto_forward_message`); where it disagreed, the check's own route and
warning, with its numbers, stand. ``torch_vjp.jvp``
returned ``J t`` wrong without a word, batched or not, as torch.func.jvp does; it now
computes it by reverse over reverse there (NOTE [J t by reverse over reverse] in
:mod:`torch_vjp._engine.revjvp`), refusing only where that is wrong too. A named ``"fwd"``
or ``"fwd-loop"`` Jacobian, which computes what it names, is refused, naming reverse mode
(:func:`named_forward`), as a named reverse one through a backward torch has wrong is
refused, naming forward mode (NOTE [named reverse strategies and wrong formulas]).

Forward mode records no graph, so on the first call per function and input signature the
products' own call of f runs inside ``torch.func.vjp``, whose level records f's graph
(:func:`reading_forward`: no call of f more; the graph's saved tensors live for that call
only, and its pullback is never run), and the op found is remembered with the routes of
"auto" (:func:`forward_checked`, :func:`forward_read`): later calls go to reverse over
reverse without a forward-mode product, or run as before; the first call, whose
forward-mode product was wrong, calls f once more for it, from the same random generators'
state and on copies of the primals taken before (a write f makes into a primal is not
made twice). A function that branches to another operator on other values is
read where it first ran. Read in inference mode too, where ``torch.func.vjp`` records f's
graph all the same (NOTE [J t by reverse over reverse in inference mode]); where the call inside ``torch.func.vjp`` fails, the products are
computed as before (f called again), and nothing is remembered.

A named ``"fwd"`` or ``"fwd-loop"`` Jacobian (``batch_jacobian``'s too, and the plain
forward loop where torch.func cannot run f) returned the wrong Jacobian without a word
(errors of 0.7-14). Its products' own calls of f run, on the first call per function, input
signature and argnums, under a torch function mode (:func:`named_reading`) that reads each
call f makes for an op of the list and whether its argument carries a tangent (as the
predicates of :data:`WRONG_FORWARD_WHERE` read the node): no call of f more, no graph
recorded, so it reads where reverse mode cannot run f (``F.batch_norm`` differentiated by
its running statistics) and costs a zero block no call. The op found is remembered
(:func:`named_read`) and refused with :func:`named_forward`; later calls look the key up
(15 us) and refuse before calling f, or run as before. As "auto"'s route, the key holds
the flags of the primals that are not tensors, so a flag that switches f to another
operator is read again; a branch on the values of tensors is read where it first ran (the
named reverse strategies read their graph on every call, which they record anyway). Only
calls f makes from Python are read (``torch.scatter_reduce``, ``Tensor.scatter_reduce(_)``,
``torch.triangular_solve``), not one inside another operator's C++ code.

NOTE [named forward in inference mode]
Under ``torch.inference_mode()`` the named forward strategies skipped that reading (as
:func:`forward_checked` does for the readings of f's graph, which record nothing there),
and returned forward mode's Jacobian through det at a singular matrix, zeros, without a
word, where the same call outside the mode was refused. Their reading records no graph (a
torch function mode, and forward-mode tangents, which run in that mode), so it is made, and
remembered, there too.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any
import torch
from torch import Tensor
import torch.autograd.forward_ad as fwAD
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from torch_vjp._engine.graph import graph_nodes
from torch_vjp._engine.rows import passes_through
from torch_vjp._engine.wrongops import GRAD_MODE_BACKWARD, WRONG_FORWARD, WRONG_FORWARD_WHERE
from torch_vjp._errors import StrategyError

__all__ = ["auto_forward_message", "forward_checked", "forward_read", "jvp_read_once",
           "named_forward",
           "named_read", "named_reading", "reading_forward", "traced_name", "wrong_forward"]

_SCATTER = WRONG_FORWARD["ScatterReduceBackward0"]
#: How each op's forward-mode formula is wrong.
_HOW = {_SCATTER: ("for the source, and for the tensor scattered into with "
                   "include_self=True (errors of the size of the entries)"),
        WRONG_FORWARD["TriangularSolveBackward0"]: ("for the matrix A (a relative error "
                                                    "near 1)"),
        WRONG_FORWARD["LinalgDetBackward0"]: (
            "at singular and near-singular matrices (a zero pivot, or one of rounding size: "
            "errors of the size of the entries)")}
_DET = WRONG_FORWARD["LinalgDetBackward0"]
#: Ops whose forward-mode formula is wrong at some points only, which a call cannot tell
#: apart cheaply: refused at every point, and said so.
_AT_SOME_POINTS = {_DET: (" (at singular matrices only, but whether a matrix is singular, "
                          "to rounding, is a property of the point, so forward mode through "
                          "it is refused at every point)")}
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

    def whole(*ys: Tensor) -> Any:
        # (f's whole result as the aux: torch.func.vjp takes only floating outputs, and an
        # integer output of f made the reading fail, and forward mode's wrong J t came back)
        return torch.zeros(()), read(*ys)

    def recorded(*xs: Tensor) -> Any:
        with torch.enable_grad():
            return torch.func.vjp(whole, *xs, has_aux=True)[2]

    return recorded, found


def forward_checked(key: Hashable, in_inference: bool = False) -> str | None:
    """What NOTE [forward mode through a wrong formula] remembered for ``key`` (a function
    and input signature): the op, ``""`` (none), or None where f's graph is to be read
    (not in inference mode, where nothing is recorded, nor remembered, unless
    ``in_inference``: jvp's reading runs f inside ``torch.func.vjp``, which records there)."""
    from torch_vjp._engine.fwdcheck import CHECKED  # (it imports this module)

    hit = CHECKED.get(key)
    if hit is None and not in_inference and torch.is_inference_mode_enabled():
        return ""
    return hit  # type: ignore[return-value]


def forward_read(key: Hashable, found: Sequence[str | None]) -> str | None:
    """Remembers for ``key`` the op a :func:`reading_forward` call ``found`` (none where
    it read nothing) and returns it."""
    from torch_vjp._engine.fwdcheck import remember  # (it imports this module)

    op = found[0] if found else None
    remember(key, op or "")
    return op


def _carries(t: Any) -> bool:
    """Whether ``t`` is a tensor that carries a tangent (of torch.func.jvp's level or of
    plain forward-mode AD)."""
    return isinstance(t, Tensor) and fwAD.unpack_dual(t).tangent is not None


def _arg(args: Sequence[Any], kwargs: dict[str, Any], at: int, name: str,
         default: Any = None) -> Any:
    return args[at] if len(args) > at else kwargs.get(name, default)


def _wrong_call(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """The op of :data:`WRONG_FORWARD` whose wrong forward-mode formula the call
    ``func(*args, **kwargs)`` runs on a tangent (the predicates of
    :data:`WRONG_FORWARD_WHERE`, read off the call's arguments), or None."""
    name = getattr(func, "__name__", None)
    if name in ("scatter_reduce", "scatter_reduce_"):
        if _arg(args, kwargs, 4, "reduce") != "prod":
            return None
        into, src = _carries(_arg(args, kwargs, 0, "input", kwargs.get("self"))), _carries(
            _arg(args, kwargs, 3, "src"))
        if src or (into and bool(kwargs.get("include_self", True))):
            return WRONG_FORWARD["ScatterReduceBackward0"]
    elif name == "triangular_solve" and _carries(_arg(args, kwargs, 1, "A")):
        return WRONG_FORWARD["TriangularSolveBackward0"]
    elif name in ("linalg_det", "det") and _carries(_arg(args, kwargs, 0, "A",
                                                        kwargs.get("input"))):
        return WRONG_FORWARD["LinalgDetBackward0"]
    return None


def _grad_mode_call(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """The op of :data:`GRAD_MODE_BACKWARD` the call ``func(*args, **kwargs)`` runs (its
    backward right only in grad mode: NOTE [a backward right only in grad mode] in
    :mod:`torch_vjp._engine.wrongops`), or None."""
    if getattr(func, "__name__", None) in ("linalg_det", "det"):
        return GRAD_MODE_BACKWARD["LinalgDetBackward0"]
    return None


class _WrongCalls(TorchFunctionMode):
    """Records in ``found`` the first op of :func:`_wrong_call` (or of ``which``) f calls
    (f's results are its own: every call passes on untouched)."""

    def __init__(self, found: list[str | None], which: Callable[..., str | None] | None = None
                 ) -> None:
        super().__init__()
        self.found = found
        self.which = _wrong_call if which is None else which

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not (self.found and self.found[0]):
            op = self.which(func, args, kwargs)
            if op is not None:
                self.found[:] = [op]
        return func(*args, **kwargs)


def named_reading(prob: Any, opts: Any, strategy: str
                  ) -> tuple[Hashable, _WrongCalls] | None:
    """For a named forward ``strategy`` (``opts.named`` set), where f's calls are to be
    read on this call (the first per function, input signature and argnums: NOTE [forward
    mode through a wrong formula]), ``(key, mode)``: the products' calls of f run under
    ``mode``, which records the op of :data:`WRONG_FORWARD` they run on a tangent; None
    where it is not named, or was read before and held none. Raises
    :func:`named_forward` where it was read before and held one, before any call of f."""
    if opts.named is None:
        return None
    from torch_vjp._engine.context import route_key  # (as forward_checked's import)
    from torch_vjp._engine.fwdcheck import signature

    # (the flags of the primals that are not tensors are in the key, as "auto"'s: a flag
    # that chooses another operator is read again there)
    key = ("jacobian: forward formulas",
           signature(route_key(prob.f), prob.leaves, opts.batch, prob.primals), prob.argnums)
    known = forward_checked(key, in_inference=True)  # NOTE [named forward in inference mode]
    if known:
        raise named_forward(prob.call, known, opts.named[0], strategy)
    if known is not None:
        return None
    return key, _WrongCalls([])


def named_read(prob: Any, opts: Any, reading: tuple[Hashable, _WrongCalls],
               strategy: str) -> None:
    """Remembers what the products' calls of f ran (:func:`named_reading`) and raises
    :func:`named_forward` where they ran an op of :data:`WRONG_FORWARD` on a tangent."""
    op = forward_read(reading[0], reading[1].found)
    if op is not None:
        raise named_forward(prob.call, op, opts.named[0], strategy)


def jvp_read_once(key: Hashable, g: Callable[..., Any], has_aux: bool
                  ) -> Callable[..., Any]:
    """torch_vjp.jvp's reading of f's operators (NOTE [forward mode through a wrong
    formula]), once per ``key`` (function and signature of the primals). Returns
    ``read_once(compute, reverse, before)``: where an earlier call found an op,
    ``reverse(op, None)`` (NOTE [J t by reverse over reverse]: no forward-mode product
    runs); else ``compute`` with the function to call in place of ``g`` (``g`` read, on a
    first call, after ``state = before()``), and, where the read found an op,
    ``reverse(op, state)``, whose call of f starts where ``compute``'s did."""
    known = forward_checked(key, in_inference=True)  # NOTE [J t by reverse over reverse
    reading, found = reading_forward(g, has_aux)  # in inference mode]

    def read_once(compute: Callable[[Callable[..., Any]], Any],
                  reverse: Callable[[str, Any], Any], before: Callable[[], Any]) -> Any:
        if known:
            return reverse(known, None)
        if known is not None:  # (read before: "" holds none)
            return compute(g)
        state = before()
        try:
            res = compute(reading)
        except Exception as err:  # noqa: BLE001 - torch.func.vjp cannot run f: as before
            if passes_through(err):
                raise
            return compute(g)
        op = forward_read(key, found)
        if op is not None:
            return reverse(op, state)
        return res

    return read_once


def traced_name(f: Callable[..., Any]) -> str:
    """f's name for a message, read while dynamo traces too (which gave ``getattr(f,
    "__qualname__", None)`` of a plain function as the descriptor of that attribute)."""
    from torch_vjp._engine.jacobian import function_name  # (it imports this module)

    code = getattr(f, "__code__", None)
    return str(code.co_qualname) if code is not None else function_name(f)


def named_forward(call: str, op: str, name: str, strategy: str) -> StrategyError:
    """The error of a named forward strategy (``"fwd"``, ``"fwd-loop"``) through ``op``, an
    operator whose forward-mode formula torch has wrong (NOTE [forward mode through a wrong
    formula]), in f (``name``): reverse mode is the fix, as forward mode is reverse's."""
    return StrategyError(
        f"{call}: strategy={strategy!r} computes with forward-mode AD, and torch's "
        f"forward-mode formula of {op} is wrong {_HOW[op]}, which f ({name}) computes from "
        f"its differentiated inputs, so the Jacobian would be wrong, with or without "
        f"torch.vmap{_AT_SOME_POINTS.get(op, '')}.\n"
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
        + ("they agree at this matrix, and forward mode would be wrong at singular ones. "
           if op == _DET else
           "they agree here only by a coincidence of the point (zeros, or a factor that is "
           "0 here), and forward mode would be wrong at others. ")
        + "strategy='auto' computed the "
        "Jacobian with reverse mode, and does so for this function and input shapes from "
        "now on.\n"
        "  Pass strategy='rev' to compute it that way directly. This warning is shown once "
        "per function."
    )
