"""Checked mode: the wrappers installed into torch's autograd entry points (and into the node
that runs a custom Function's backward), their installation, and ``checked()``; the scope
they consult is in :mod:`torch_vjp._checked_scope` (NOTE [checked scope]).

NOTE [checked custom backwards]
Checked mode also checks what the backward of every custom ``torch.autograd.Function``
returns, on every call. torch's engine runs such a backward by calling the method ``apply``
(``apply_boxed`` for ``boxed_grads_call`` Functions) of the Function's graph node, a
``BackwardCFunction`` (also the ``ctx`` that forward saw), looked up by name on each call; so
from the first checked block on, ``BackwardCFunction.apply`` is a wrapper, which stays after
the last exit (NOTE [wrappers of class attributes stay]). The wrapper runs the user's
backward (its errors pass through untouched), then, in a checked scope, compares the raw
return value with what the engine expects at the node's inputs: the count (one value per
forward input), and for each input that needs a gradient the dtype, device and shape that
torch's engine will check the gradient against (the metadata of the node's next edge).
That fast path is a few attribute reads per gradient (``_backward_checked.backward_return_ok``).
A gradient of the shape of one of forward's outputs, for an input that forward broadcast to
it, is torch's idiom, summed down by torch as the adjoint of broadcasting: accepted; so is a
gradient torch sums over dimensions of size 1 only (exact), and a floating-point gradient in
the precision the Function computes in (an output's dtype, or autocast's under
``torch.amp.custom_fwd``), which torch casts back as it does for its own ``.to()``.
Only when the fast path objects does the slow path run: check_function's diagnosis
(``_backward_checked.backward_problems``) and torch's own verdict, from replaying the value
through torch's engine on a stand-in node with the same inputs (``torch_verdict``). Where
torch raises, the error is a ``FunctionCheckError`` whose message is torch's sentence, with
the explanation (what was returned, what was expected and why, the fix, naming the Function
and the input) as a note. Where torch takes the value after all (it sums a Jacobian-shaped
or batched gradient down to its input's shape, casts a float64 gradient to float32), the
call goes on with torch's result and a ``FunctionCheckWarning`` says what torch repaired:
checked mode changes nothing but warnings for what torch accepts. Anything the node does not
tell is left to torch: a tensor subclass, a nested tensor, which of several inputs that need
no gradient are tensors, and their shapes (so ``None`` for one input next to a tensor of its
shape for an input that needs no gradient is no evidence of gradients in the wrong
positions: a backward may give the first a zero gradient on purpose).
Inside torch.func transforms the fast path and the diagnosis run too (shapes and metadata
are per example there, as torch's own validation sees them), but nothing is replayed: what
torch rejects there raises torch's own error.
The scope is the thread or task, as for the other checks, with one widening: torch's engine
runs the nodes of CUDA (and other accelerator) tensors on its own worker threads, which no
checked block can enter; while a checked backward pass is in flight anywhere, custom
backwards that run on those threads are checked too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.overrides import handle_torch_function, has_torch_function

from torch_vjp._backward_checked import backward_return_ok
from torch_vjp._checked_judge import _engine_errors_explained, _judge_backward
from torch_vjp._checked_scope import (
    _GENUINE,
    _GENUINE_BACKWARD,
    _GENUINE_FUNC_VJP,
    _GENUINE_GRAD,
    _GENUINE_NODE_APPLY,
    _GENUINE_NODE_APPLY_BOXED,
    _GENUINE_TENSOR_BACKWARD,
    _HAS_APPLY_BOXED,
    _SCOPE,
    _WRAPPER_FLAG,
    _active,
    _arbitrate,
    _checks_backwards,
    _Guarded,
    _in_flight_pass,
    _process_wide,
    _Scope,
    _set_process_wide_flag,
    _suppressed,
)
from torch_vjp._check_labels import BACKWARD, GRAD, PULLBACK, TENSOR_BACKWARD
from torch_vjp._checks import check_cotangents
from torch_vjp._drop_ins import _backward, _grad
from torch_vjp._engine.compile_key import tracing
from torch_vjp._transform_support import recording_connected
from torch_vjp._errors import GradOutputsError, env_flag


__all__ = ["checked", "install_from_environment"]

# ---------------------------------------------------------------------------------------
# The wrappers installed into torch
# ---------------------------------------------------------------------------------------

_TORCH_GRAD = GRAD.replace(call="torch.autograd.grad")
_TORCH_BACKWARD = BACKWARD.replace(call="torch.autograd.backward")
# What each wrapper calls: what it replaced when it was installed (torch's own function by
# default), guarded where that is another library's patch (NOTE [patches of other libraries],
# in _checked_scope.py).
_PREVIOUS: dict[str, Callable[..., Any]] = dict(_GENUINE)


def _wrapper(genuine: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Marks a checking wrapper: ``functools.wraps`` of torch's function (so ``inspect``
    shows torch's signature and docs), flagged so that :func:`_genuine` can see through it."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        wrapped = functools.wraps(genuine)(fn)
        setattr(wrapped, _WRAPPER_FLAG, True)
        return wrapped

    return mark


def _passes(previous: Any, genuine: Callable[..., Any]) -> bool:
    """Whether the call came back round from a patch beneath the wrapper (``_Guarded``)."""
    return previous is not genuine and previous.round_again()


def _compiling() -> bool:
    """Whether dynamo is tracing the call: it knows torch's autograd entry points by
    identity, so the wrappers hand it torch's function untouched (the same graph as
    without checks; the compiled program's backward is torch's)."""
    return tracing()  # (this thread's: another thread's compile sets is_compiling())


@_wrapper(_GENUINE_GRAD)
def _checked_grad(
    outputs: Any,
    inputs: Any,
    grad_outputs: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    only_inputs: bool = True,
    allow_unused: bool | None = None,
    is_grads_batched: bool = False,
    materialize_grads: bool = False,
) -> Any:
    """``torch.autograd.grad``, checked in a checked scope."""
    previous = _PREVIOUS["grad"]
    if _compiling() or not _active() or _passes(previous, _GENUINE_GRAD):
        return previous(outputs, inputs, grad_outputs, retain_graph, create_graph,
                        only_inputs, allow_unused, is_grads_batched, materialize_grads)
    with _in_flight_pass(), _engine_errors_explained():
        return _grad(_TORCH_GRAD, previous, outputs, inputs, grad_outputs, retain_graph,
                     create_graph, only_inputs, allow_unused, is_grads_batched,
                     materialize_grads)


@_wrapper(_GENUINE["backward"])
def _checked_backward(
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    grad_variables: Any = None,
    inputs: Any = None,
) -> None:
    """``torch.autograd.backward``, checked in a checked scope."""
    previous = _PREVIOUS["backward"]
    if _compiling() or not _active() or _passes(previous, _GENUINE_BACKWARD):
        return previous(tensors, grad_tensors, retain_graph, create_graph, grad_variables,
                        inputs=inputs)
    with _in_flight_pass(), _engine_errors_explained():
        return _backward(_TORCH_BACKWARD, previous, tensors, grad_tensors, retain_graph,
                         create_graph, grad_variables, inputs)


@_wrapper(_GENUINE["tensor_backward"])
def _checked_tensor_backward(
    self: Tensor,
    gradient: Tensor | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Any = None,
) -> None:
    """``Tensor.backward``, checked in a checked scope."""
    previous = _PREVIOUS["tensor_backward"]
    if _compiling() or not _active() or (previous is not _GENUINE_TENSOR_BACKWARD
                                         and not previous.reaches_torch()):
        return previous(self, gradient, retain_graph, create_graph, inputs=inputs)
    if has_torch_function((self,)):  # as torch's: overrides get what Tensor.backward names
        return handle_torch_function(
            Tensor.backward, (self,), self, gradient=gradient,
            retain_graph=retain_graph, create_graph=create_graph, inputs=inputs,
        )
    # What Tensor.backward does next: torch.autograd.backward with itself as the tensors,
    # looked up now, as torch's does (a patch made over the checking wrapper is called).
    current = torch.autograd.backward
    if current is not _checked_backward:
        return current(self, gradient, retain_graph, create_graph, inputs=inputs)
    with _in_flight_pass(), _engine_errors_explained():
        return _backward(TENSOR_BACKWARD, _PREVIOUS["backward"], self, gradient, retain_graph,
                         create_graph, None, inputs)


@_wrapper(_GENUINE["func_vjp"])
def _checked_func_vjp(func: Callable[..., Any], *primals: Any, has_aux: bool = False) -> Any:
    """``torch.func.vjp``, whose pullback checks its cotangents in a checked scope."""
    previous = _PREVIOUS["func_vjp"]
    if _compiling() or not _active() or _passes(previous, _GENUINE_FUNC_VJP):
        return previous(func, *primals, has_aux=has_aux)
    recorded, connected = recording_connected(func, has_aux)
    result = previous(recorded, *primals, has_aux=has_aux)
    out, pullback = result[0], result[1]

    # The pullback of a checked vjp stays checked wherever it is called.
    @functools.wraps(pullback)
    def checked_pullback(
        cotangents: Any, retain_graph: bool = True, create_graph: bool | None = None
    ) -> Any:
        if _compiling() or _SCOPE.get().suppressed:
            return pullback(cotangents, retain_graph=retain_graph, create_graph=create_graph)
        try:
            check_cotangents(out, cotangents, PULLBACK, primals=primals,
                             connected=connected or None, ignores_unconnected=True)
        except GradOutputsError as err:
            return _arbitrate(err, PULLBACK, lambda: pullback(
                cotangents, retain_graph=retain_graph, create_graph=create_graph))
        with _in_flight_pass():
            with _suppressed():  # the pullback's own torch.autograd.grad call is checked already
                return pullback(cotangents, retain_graph=retain_graph,
                                create_graph=create_graph)

    return (out, checked_pullback) + tuple(result[2:])


@_wrapper(_GENUINE["node_apply"])
def _checked_node_apply(self: Any, *args: Any) -> Any:
    """``BackwardCFunction.apply``: runs a custom Function's backward, then, in a checked
    scope, checks what it returned (NOTE [checked custom backwards])."""
    previous = _PREVIOUS["node_apply"]
    if previous is not _GENUINE_NODE_APPLY and previous.round_again():  # (_passes)
        return previous(self, *args)
    # the user's backward: its errors pass through
    return _checked_return(self, previous(self, *args))


@_wrapper(_GENUINE["node_apply_boxed"])
def _checked_node_apply_boxed(self: Any, *args: Any) -> Any:
    """``BackwardCFunction.apply_boxed`` (grads in one list that backward may empty), checked
    as ``apply`` is."""
    previous = _PREVIOUS["node_apply_boxed"]
    if previous is not _GENUINE_NODE_APPLY_BOXED and previous.round_again():  # (_passes)
        return previous(self, *args)
    return _checked_return(self, previous(self, *args))


def _checked_return(node: Any, returned: Any) -> Any:
    """``returned``, what the backward of ``node``'s Function returned, after checked mode's
    check of it, in a checked scope: the fast path, then the slow one if it objects."""
    if _checks_backwards() and not backward_return_ok(node, returned):
        _judge_backward(node, returned)
    return returned


_TARGETS: tuple[tuple[str, Any, str, Callable[..., Any]], ...] = (
    ("grad", torch.autograd, "grad", _checked_grad),
    ("backward", torch.autograd, "backward", _checked_backward),
    ("tensor_backward", torch.Tensor, "backward", _checked_tensor_backward),
    ("func_vjp", torch.func, "vjp", _checked_func_vjp),
    ("node_apply", BackwardCFunction, "apply", _checked_node_apply),
) + ((("node_apply_boxed", BackwardCFunction, "apply_boxed", _checked_node_apply_boxed),)
     if _HAS_APPLY_BOXED else ())
_patch_lock = threading.Lock()
_open_blocks = 0

# NOTE [wrappers of class attributes stay]
# torch.autograd.grad, torch.autograd.backward and torch.func.vjp are module attributes: their
# wrappers are put back on the last exit, so that outside checked mode they are torch's own
# functions again (TorchScript, for one, maps them to built-ins by identity). Tensor.backward
# and BackwardCFunction.apply are class attributes: assigning one invalidates the attribute
# caches of the class and of all its subclasses (every tensor subclass; every custom
# Function's node class), so putting them back and forth at every ``with tv.checked():``
# made a training step with a custom Function about 10% slower (benchmarks/bench_checks.py).
# Once installed they stay; outside a checked scope each calls the method it replaced,
# unchanged, and checks nothing (one Python call more). Only where one went over another
# library's patch is the patch put back on top on the last exit, as for the others.
_KEPT_OWNERS = (torch.Tensor, BackwardCFunction)


# What ours replaced when it was last installed, as it was found there (put back on exit),
# and what ours called before it went over that (what it calls again after the exit):
_REPLACED: dict[str, Callable[..., Any]] = dict(_GENUINE)
_BENEATH: dict[str, Callable[..., Any]] = dict(_GENUINE)


def _install() -> None:
    """Puts the checking wrappers on top of torch's entry points, over any patch found there
    (NOTE [patches of other libraries])."""
    for key, owner, attr, wrapper in _TARGETS:
        current = getattr(owner, attr)
        if current is wrapper:
            continue
        if current is _GENUINE[key]:
            _PREVIOUS[key] = _BENEATH[key] = current
        else:  # what ours replaced, put back (on exit), or a patch made since
            beneath = _BENEATH[key] if current is _REPLACED[key] else _PREVIOUS[key]
            _PREVIOUS[key], _BENEATH[key] = _Guarded(current, beneath), beneath
        _REPLACED[key] = current
        setattr(owner, attr, wrapper)


def _uninstall(kept: bool = False) -> None:
    """Puts back what each wrapper on top replaced; those of class attributes (NOTE [wrappers
    of class attributes stay]), and all where ``kept``, stay over torch's own function."""
    for key, owner, attr, wrapper in _TARGETS:
        if getattr(owner, attr) is not wrapper:
            continue  # a patch made over ours: it stays
        if (kept or owner in _KEPT_OWNERS) and _REPLACED[key] is _GENUINE[key]:
            continue
        setattr(owner, attr, _REPLACED[key])
        _PREVIOUS[key] = _BENEATH[key]


def _acquire() -> None:
    global _open_blocks
    with _patch_lock:
        _open_blocks += 1
        if _open_blocks == 1:  # (also with TORCH_VJP_CHECKED=1: over a patch made since)
            _install()


def _release() -> None:
    global _open_blocks
    with _patch_lock:
        _open_blocks -= 1
        if _open_blocks == 0:
            _uninstall(kept=_process_wide())


def _set_process_wide(on: bool) -> None:
    """Checks every thread, for good (``TORCH_VJP_CHECKED=1``), or stops doing so."""
    with _patch_lock:
        _set_process_wide_flag(on)
        if on:
            _install()
        elif _open_blocks == 0:
            _uninstall()


def install_from_environment() -> None:
    """Turns checking on for the whole process when ``TORCH_VJP_CHECKED`` is set (to anything
    but an empty string, ``0``, ``false``, ``no`` or ``off``)."""
    if env_flag("TORCH_VJP_CHECKED"):
        _set_process_wide(True)


class _FollowingBuiltins(dict):  # type: ignore[type-arg]
    """TorchScript's table of built-in functions (keyed by function id), which also maps the
    function installed as ``torch.autograd.grad`` / ``torch.autograd.backward`` right now to
    torch's built-in, as it maps torch's own function there.

    TorchScript recognises ``torch.autograd.grad`` inside a scripted function by the identity
    of the function object; a checking wrapper (or any other replacement) would otherwise be
    compiled as Python code, which fails. With this table a scripted call compiles exactly as
    it does without torch_vjp.
    """

    def get(self, key: Any, default: Any = None) -> Any:
        hit = dict.get(self, key)
        if hit is not None:
            return hit
        if key == id(torch.autograd.grad):
            return "aten::grad"
        if key == id(torch.autograd.backward):
            return "aten::backward"
        return default


def _register_jit_builtins(grad: Callable[..., Any], backward: Callable[..., Any]) -> None:
    """Lets TorchScript compile calls of tv.grad / tv.backward, and of whatever function is
    installed as torch.autograd.grad / backward, to torch's built-ins (see
    :class:`_FollowingBuiltins`)."""
    try:
        import torch.jit._builtins as builtins

        table = builtins._get_builtin_table()
        if not isinstance(table, _FollowingBuiltins):
            table = builtins._builtin_table = _FollowingBuiltins(table)
        table[id(grad)] = "aten::grad"
        table[id(backward)] = "aten::backward"
    except Exception:  # noqa: BLE001 - an optional courtesy to TorchScript; never fatal
        pass



# ---------------------------------------------------------------------------------------
# checked()
# ---------------------------------------------------------------------------------------

_ids = itertools.count(1)


class checked(contextlib.ContextDecorator):
    """Checks every ``grad_outputs`` given to torch's own autograd entry points.

    Inside ``with tv.checked():`` (or a function decorated with ``@tv.checked()`` or
    ``@tv.checked``: plain, generator or ``async``), plain ``torch.autograd.grad``,
    ``torch.autograd.backward``, ``Tensor.backward`` and the pullbacks returned by
    ``torch.func.vjp`` validate their vectors as :func:`grad` does and raise
    :class:`GradOutputsError` with the same explanations, after torch's own sentence. Setting
    the environment variable ``TORCH_VJP_CHECKED=1`` turns this on for a whole process (every
    thread), with no code change (with torch_vjp installed, ``import torch`` is enough).

    The scope is the current thread (and asyncio task), as for ``torch.no_grad``; blocks nest,
    and calls torch accepts behave exactly as without checks (NOTE [transparent checks]).

    Example:
        >>> import torch, torch_vjp as tv
        >>> x = torch.ones(4, requires_grad=True)
        >>> with tv.checked():
        ...     (x * 2).backward(torch.ones(3))
        Traceback (most recent call last):
        ...
        torch_vjp.GradOutputsError: Mismatch in shape: grad_output[0] has a shape of torch.Size([3]) and output[0] has a shape of torch.Size([4]).
        y.backward(gradient): gradient has shape (3,), but y has shape (4,).
        ...
    """

    def __new__(cls, fn: Callable[..., Any] | None = None) -> Any:
        # ``@tv.checked`` without parentheses, as ``@torch.no_grad``: the decorated function
        if fn is None:
            return super().__new__(cls)
        if not callable(fn):
            raise TypeError(
                f"torch_vjp.checked takes no arguments, but was given {type(fn).__name__} "
                f"{fn!r:.40}: use it as `with tv.checked():` or as a decorator, `@tv.checked` "
                f"or `@tv.checked()`."
            )
        return cls()(fn)

    def __init__(self, fn: Callable[..., Any] | None = None) -> None:
        self._id = next(_ids)

    def __enter__(self) -> checked:
        scope = _SCOPE.get()
        _SCOPE.set(_Scope(scope.blocks + (self._id,), scope.suppressed))
        _acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        scope = _SCOPE.get()
        blocks = scope.blocks
        for k in range(len(blocks) - 1, -1, -1):
            if blocks[k] == self._id:
                break
        else:  # not open here: a second __exit__, or one from another thread, changes nothing
            return None
        _SCOPE.set(_Scope(blocks[:k] + blocks[k + 1:], scope.suppressed))
        _release()
        return None

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:  # type: ignore[override]
        if inspect.isasyncgenfunction(fn):
            return self._async_generator(fn)
        if inspect.iscoroutinefunction(fn):
            return self._coroutine(fn)
        if inspect.isgeneratorfunction(fn):
            return self._generator(fn)
        return super().__call__(fn)

    def _coroutine(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def run(*args: Any, **kwargs: Any) -> Any:
            with self:
                return await fn(*args, **kwargs)

        return run

    def _generator(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        # Checked while the generator's own code runs, not while it is suspended (the
        # caller's code between two items is not inside the block).
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            gen = fn(*args, **kwargs)
            try:
                with self:
                    response = gen.send(None)
                while True:
                    try:
                        request = yield response
                    except GeneratorExit:
                        with self:
                            gen.close()
                        raise
                    except BaseException:
                        with self:
                            response = gen.throw(sys.exc_info()[1])
                    else:
                        with self:
                            response = gen.send(request)
            except StopIteration as stop:
                return stop.value

        return run

    def _async_generator(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def run(*args: Any, **kwargs: Any) -> Any:
            agen = fn(*args, **kwargs)
            try:
                with self:
                    response = await agen.asend(None)
                while True:
                    try:
                        request = yield response
                    except GeneratorExit:
                        with self:
                            await agen.aclose()
                        raise
                    except BaseException:
                        with self:
                            response = await agen.athrow(sys.exc_info()[1])
                    else:
                        with self:
                            response = await agen.asend(request)
            except StopAsyncIteration:
                return

        return run

