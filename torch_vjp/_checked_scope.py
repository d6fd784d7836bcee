"""Checked mode's state: torch's own functions behind any wrapper, the checked scope of a
thread or task, and torch as the judge of what the checker rejects (used by the drop-ins in
:mod:`torch_vjp._drop_ins` and by the wrappers of :mod:`torch_vjp._checked_mode`).

NOTE [checked scope]
``with tv.checked():`` checks the calls made in its own thread (and asyncio task), like
``torch.no_grad``: the scope lives in a ``contextvars.ContextVar``. torch's entry points are
replaced by checking wrappers while any block is open in any thread (or for good with
``TORCH_VJP_CHECKED=1``, which checks every thread); outside a checked scope the wrappers
hand each call, unchanged, to the function they replaced. The first entry puts each wrapper
on top of whatever is there, another library's patch included, and the last exit puts back
what it replaced where the wrapper is still on top (NOTE [patches of other libraries]).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

from torch_vjp._check_labels import Labels
from torch_vjp._errors import (
    GradOutputsError,
    GradOutputsIndexError,
    GradOutputsTypeError,
    GradOutputsValueError,
    GradOutputsWarning,
    TorchVJPError,
    torch_first,
    user_stacklevel,
)

__all__ = ["is_checked"]

_WRAPPER_FLAG = "__torch_vjp_wrapper__"


def _genuine(fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch's own function behind ``fn`` (``fn`` itself unless it is one of our wrappers)."""
    while getattr(fn, _WRAPPER_FLAG, False):
        fn = fn.__wrapped__  # type: ignore[attr-defined]
    return fn


# torch's own functions, which tv.grad and tv.backward stand in for.
_GENUINE_GRAD = _genuine(torch.autograd.grad)
_GENUINE_BACKWARD = _genuine(torch.autograd.backward)
_GENUINE_TENSOR_BACKWARD = _genuine(torch.Tensor.backward)
_GENUINE_FUNC_VJP = _genuine(torch.func.vjp)
# The engine runs a custom Function's backward through these methods of its graph node.
_GENUINE_NODE_APPLY = _genuine(BackwardCFunction.apply)
_GENUINE_NODE_APPLY_BOXED = _genuine(getattr(BackwardCFunction, "apply_boxed", None) or
                                     BackwardCFunction.apply)
_HAS_APPLY_BOXED = hasattr(BackwardCFunction, "apply_boxed")  # newer torch only
# torch's own function behind each entry point that checked mode wraps.
_GENUINE: dict[str, Callable[..., Any]] = {
    "grad": _GENUINE_GRAD,
    "backward": _GENUINE_BACKWARD,
    "tensor_backward": _GENUINE_TENSOR_BACKWARD,
    "func_vjp": _GENUINE_FUNC_VJP,
    "node_apply": _GENUINE_NODE_APPLY,
    "node_apply_boxed": _GENUINE_NODE_APPLY_BOXED,
}
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_guard = threading.local()


# NOTE [patches of other libraries]
# Another library may patch an entry point too, before or after ours, calling the function it
# found (ours, while ours is in place) or one it took earlier (torch's own, taken at import).
# * Entering a checked block puts ours on top of whatever patch is found there, and ours calls
#   that patch: what it does still happens, and the call is checked even where the patch goes
#   straight to torch's own function (left on top, such a patch turned checks off for good).
#   The last exit puts the patch back on top, where ours still is, and ours calls again what
#   it called before; a patch made over ours during the block stays (ours, beneath it, checks
#   in a checked scope and passes through outside one). With ``TORCH_VJP_CHECKED=1`` the same
#   holds, except that ours stays where it went over torch's own function: between blocks,
#   a patch that goes straight to torch's own function is not checked.
# * Ours calls the patch guarded (``_Guarded``): the patch may call ours back (it took ours
#   in an earlier block, or made itself over ours), and where it does, in the same thread and
#   backward pass, ours hands the call on to what it called before it went over the patch
#   (torch's own function, or a patch found earlier) instead of round again; the check is made
#   once, by ours further out (by ours innermost for Tensor.backward, which hands a patch the
#   call unchecked). A call made from within a backward pass (a custom backward calling
#   torch.autograd.grad) is a new call, not a cycle.
# * Not seen: a patch made over ours that the library takes away again (putting ours back)
#   while ours is on top of it in a block still runs until the exit, which puts it back.


class _Guarded:
    """``patch``, another library's function that a checking wrapper was installed over, as
    that wrapper calls it: a call that comes back round to it (``patch`` calling the wrapper,
    in the same thread and backward pass) goes on to ``beneath`` instead, what the wrapper
    called before it went over ``patch`` (NOTE [patches of other libraries])."""

    __slots__ = ("patch", "beneath")

    def __init__(self, patch: Callable[..., Any], beneath: Callable[..., Any]) -> None:
        self.patch = patch
        self.beneath = beneath

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        active = _guard.__dict__.setdefault("active", set())
        mark = (self, _graph_task_id())
        if mark in active:  # round again: wrapper -> patch -> wrapper -> here
            return self.beneath(*args, **kwargs)
        active.add(mark)
        try:
            return self.patch(*args, **kwargs)
        finally:
            active.discard(mark)

    def round_again(self) -> bool:
        """Whether a call now comes back round from the patch: a wrapper further out, in
        this thread and backward pass, called it, and handles the call."""
        active = _guard.__dict__.get("active")
        return bool(active) and (self, _graph_task_id()) in active

    def reaches_torch(self) -> bool:
        """Whether a call now goes on to torch's own function: every patch beneath the
        wrapper is running already (each came back round to it)."""
        fn: Any = self
        while isinstance(fn, _Guarded):
            if not fn.round_again():
                return False
            fn = fn.beneath
        return True


_AUTOGRAD = sys.modules["torch.autograd"]
_HAS_ENGINE = hasattr(_AUTOGRAD, "_engine_run_backward")  # torch >= 2.4


def _engine(*args: Any, **kwargs: Any) -> Any:
    """torch's engine entry, looked up on every call as torch.autograd.grad does (so that a
    patch of it, as ``torch.compiler`` makes for tracing, applies here too)."""
    return _AUTOGRAD._engine_run_backward(*args, **kwargs)


# ---------------------------------------------------------------------------------------
# Torch is the judge (NOTE [transparent checks])
# ---------------------------------------------------------------------------------------

_BUILTIN_CLASSES: tuple[tuple[type[BaseException], type[GradOutputsError]], ...] = (
    (IndexError, GradOutputsIndexError),
    (ValueError, GradOutputsValueError),
    (TypeError, GradOutputsTypeError),
    (RuntimeError, GradOutputsError),
)


# Where torch validates grad_outputs (cotangents) before a backward pass runs: (the end of the
# file's path, the function), for Python code that raises in the function itself or in what
# it calls (``_make_grads`` indexes, compares and reads the grads).
_VALIDATING = (
    (os.path.join("torch", "autograd", "__init__.py"), ("_make_grads", "_calculate_shape")),
)
# Where torch raises its validation itself, the error's innermost frame: the vmap that stacks
# batched grad_outputs (the batch sizes), functorch's pullback (the pytree structure).
_VALIDATING_LAST = (
    (os.path.join("torch", "_vmap_internals.py"), None),
    (os.path.join("torch", "_functorch", "eager_transforms.py"), ("wrapper",)),
)
# Where torch's engine is entered (torch >= 2.4; before, the body of grad and backward): what
# the engine raises there before any node runs is its validation of the roots, told by the
# sentence; a node's own failure (a missing derivative) raises there too.
_ENGINE_ENTRY = (
    (os.path.join("torch", "autograd", "graph.py"), ("_engine_run_backward",)),
    (os.path.join("torch", "autograd", "__init__.py"), ("grad", "backward")),
)
_ENGINE_VALIDATION = re.compile(
    r"got \d+ tensors and \d+ gradients"
    r"|element \d+ of tensors does not require grad"
    r"|invalid gradient at index \d+ - "
)


def _at(code: Any, places: tuple[tuple[str, tuple[str, ...] | None], ...]) -> bool:
    return any(code.co_filename.endswith(path) and (names is None or code.co_name in names)
               for path, names in places)


def _torch_validation(err: BaseException) -> bool:
    """Whether ``err`` is torch's own validation of the vectors of a backward pass, raised
    before any node of the graph ran: in ``_make_grads`` (and what it calls), the batching
    vmap, functorch's pullback, or the engine's check of its roots. Not an error of
    running the graph (a missing derivative, a custom backward's or a hook's own error,
    anything torch's code raises for them), nor one torch raised about another argument
    first (empty ``inputs``), nor one raised by another library's patch of an entry point.
    The frames are read from the outermost in: the first entry into the engine decides."""
    tb = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if _at(code, _VALIDATING):
            return True
        innermost = tb.tb_next is None
        if innermost and _at(code, _VALIDATING_LAST):
            return True
        if _at(code, _ENGINE_ENTRY) and (innermost or code.co_name == "_engine_run_backward"):
            return innermost and _ENGINE_VALIDATION.match(str(err)) is not None
        tb = tb.tb_next
    return False


def _arbitrate(err: GradOutputsError, labels: Labels, run_torch: Callable[[], Any],
               override: str | None = None) -> Any:
    """Runs torch's own function on a call the checker rejected, and raises the checker's
    error if torch raises too, in its own validation of the vectors (as the builtin class
    torch raised); any other error of torch's, or of code torch runs, is re-raised
    untouched. Returns torch's result, with a warning, if torch accepts the call after all.
    ``override`` names the ``__torch_function__`` override torch hands the call to, where
    it does: that override answered the call, which torch then need not have seen."""
    try:
        with _suppressed():
            result = run_torch()
    except TorchVJPError:
        raise
    except Exception as torch_err:  # noqa: BLE001 - judged below, else re-raised untouched
        for builtin, ours in _BUILTIN_CLASSES:
            if isinstance(torch_err, builtin):
                break
        else:  # not torch's validation: the user's own code raised; pass it through
            raise
        if not _torch_validation(torch_err):
            raise
        cls = type(err) if isinstance(err, builtin) else ours
        sentence = getattr(err, "torch_sentence", None) or str(torch_err)
        explanation = getattr(err, "explanation", None) or str(err)
        raise torch_first(cls, explanation, sentence if labels.torch_first else None) from None
    explanation = getattr(err, "explanation", None) or str(err)
    what = labels.grad_outputs
    if override is None:
        said = (f"{labels.call}: torch_vjp's check rejects the {what} of this call, but torch "
                f"accepted it and ran it; the result is torch's, unchanged.\n  Expected: each "
                f"{what} entry is dL/d(its output), so it has that output's shape, a dtype "
                f"torch casts to the output's, and its device (or is None where the output "
                f"needs no vector). torch lets a vector that does not fit through only where "
                f"it never uses it (its output is not reached by the backward pass), and a "
                f"vector that is never used is most often a mistake in the call.\n  Fix: pass "
                f"the vector the check asks for, or None for an output that needs none. If "
                f"the call is right as it is, the check is wrong: please report it with this "
                f"message.")
    else:  # (an override may answer the call itself: torch never judged the vectors)
        said = (f"{labels.call}: torch handed this call to {override}, which answered it "
                f"without an error, but torch_vjp's check rejects its {what}; the result is "
                f"the override's, unchanged.\n  Expected: each {what} entry is dL/d(its "
                f"output), with that output's shape, dtype and device. The override never "
                f"handed the call on to torch, so torch never judged the vectors (an override "
                f"that hands the call on gets torch's verdict).\n  Fix: pass the vectors the "
                f"check asks for, unless the override's type takes vectors of its own kind on "
                f"purpose (then run the call outside torch_vjp.checked()).")
    warnings.warn(f"{said}\n  The check said:\n{explanation}", GradOutputsWarning,
                  stacklevel=user_stacklevel())
    return result


# ---------------------------------------------------------------------------------------
# Scope: NOTE [checked scope]
# ---------------------------------------------------------------------------------------


class _Scope:
    """The checked state of one thread or task: the open ``checked`` blocks (their ids), and
    whether checks are suppressed (while torch's own function runs for a checked call)."""

    __slots__ = ("blocks", "suppressed")

    def __init__(self, blocks: tuple[int, ...], suppressed: bool) -> None:
        self.blocks = blocks
        self.suppressed = suppressed


_SCOPE: contextvars.ContextVar[_Scope] = contextvars.ContextVar(
    "torch_vjp_checked", default=_Scope((), False)
)
_PROCESS_WIDE = False  # TORCH_VJP_CHECKED=1


def _process_wide() -> bool:
    """Whether every thread is checked, for good (``TORCH_VJP_CHECKED=1``)."""
    return _PROCESS_WIDE


def _set_process_wide_flag(on: bool) -> None:
    """Sets :func:`_process_wide` (under the patch lock of :mod:`torch_vjp._checked_mode`)."""
    global _PROCESS_WIDE
    _PROCESS_WIDE = on


def _active() -> bool:
    scope = _SCOPE.get()
    return (_PROCESS_WIDE or bool(scope.blocks)) and not scope.suppressed


def is_checked() -> bool:
    """Whether torch's autograd entry points are checked in this thread (or task) now.

    Example:
        >>> import torch_vjp as tv
        >>> from torch_vjp.autograd import is_checked
        >>> with tv.checked():
        ...     is_checked()
        True
    """
    return _active()


def _checks_backwards() -> bool:
    """Whether the custom backward running now in this thread is checked (NOTE [checked
    custom backwards]): in a checked thread or task (suppression, which only spares
    grad_outputs a second check, does not count), and in a thread of torch's engine while a
    checked backward pass is in flight."""
    return bool(_PROCESS_WIDE or _SCOPE.get().blocks or (
        _in_flight and isinstance(threading.current_thread(), _FOREIGN_THREAD)))


# Threads that Python's ``threading`` did not start (torch's engine workers among them).
_FOREIGN_THREAD: type = getattr(threading, "_DummyThread", type(None))
_in_flight = 0  # checked backward passes running now, in every thread
_flight_lock = threading.Lock()


@contextlib.contextmanager
def _in_flight_pass() -> Any:
    """Counts a checked backward pass as in flight while the block runs (see
    :func:`_checks_backwards`)."""
    global _in_flight
    with _flight_lock:
        _in_flight += 1
    try:
        yield
    finally:
        with _flight_lock:
            _in_flight -= 1


@contextlib.contextmanager
def _suppressed() -> Any:
    scope = _SCOPE.get()
    token = _SCOPE.set(_Scope(scope.blocks, True))
    try:
        yield
    finally:
        _SCOPE.reset(token)


