"""Checked autograd: drop-in ``grad`` and ``backward`` whose errors explain ``grad_outputs``.

``grad_outputs[i]`` (``grad_tensors[i]`` for ``backward``, ``gradient`` for
``Tensor.backward``) is dL/d ``outputs[i]``: the vector in the vector-Jacobian product
``v^T J``, one number per element of ``outputs[i]``, so it has ``outputs[i]``'s shape. Every
function here validates that before running torch's engine, and explains a mismatch: which
output, both shapes, what the shape must be and why, and a fix when the mistake is
recognisable.

NOTE [transparent checks]
A checked call behaves exactly as torch's own whenever torch accepts it: the same
signatures (positional arguments, ``only_inputs``, ``grad_variables``), any iterable where
torch takes one, the same results, the same warnings (plus torch_vjp's own about silent
casts), ``__torch_function__`` overrides called with torch's own function, TorchScript
compiling the call to torch's built-in. For a call torch rejects, the error's message is
torch's own sentence, with the explanation attached as a note (NOTE [torch's sentence first]
in ``_errors``). And torch is the final judge: when the checker finds a mistake, torch's own
function is run on the same arguments (nothing runs before torch's own validation fails); if
torch raises, the checker's error is raised; if torch accepts the call after all, its result
is returned, with a :class:`~torch_vjp.GradOutputsWarning` quoting the checker. So a call is
never rejected that torch accepts, and an exception raised by the user's own backward code
passes through untouched.

NOTE [checked scope]
``with tv.checked():`` checks the calls made in its own thread (and asyncio task), like
``torch.no_grad``: the scope lives in a ``contextvars.ContextVar``. torch's entry points are
replaced by checking wrappers while any block is open in any thread (or for good with
``TORCH_VJP_CHECKED=1``, which checks every thread); outside a checked scope the wrappers
hand each call, unchanged, to the function they replaced. On the last exit a wrapper is put
back only if it is still installed: a patch another library made in the meantime stays.

NOTE [checked custom backwards]
Checked mode also checks what the backward of every custom ``torch.autograd.Function``
returns, on every call. torch's engine runs such a backward by calling the method ``apply``
(``apply_boxed`` for ``boxed_grads_call`` Functions) of the Function's graph node, a
``BackwardCFunction`` (also the ``ctx`` that forward saw), looked up by name on each call; so
from the first checked block on, ``BackwardCFunction.apply`` is a wrapper, which stays after
the last exit (NOTE [wrappers of class attributes stay]). The wrapper runs the user's backward (its errors pass
through untouched), then, in a checked scope, compares the raw return value with what the
engine expects at the node's inputs: the count (one value per forward input), and for each
input that needs a gradient the dtype, device and shape that torch's engine will check the
gradient against (the metadata of the node's next edge). That fast path is a few attribute
reads per gradient (``_backward_checked.backward_return_ok``). A gradient of the shape of one
of forward's outputs, for an input that forward broadcast to it, is torch's idiom, summed
down by torch as the adjoint of broadcasting: accepted.
Only when the fast path objects does the slow path run: check_function's diagnosis
(``_backward_checked.backward_problems``) and torch's own verdict, from replaying the value
through torch's engine on a stand-in node with the same inputs (``torch_verdict``). Where
torch raises, the error is a ``FunctionCheckError`` whose message is torch's sentence, with
the explanation (what was returned, what was expected and why, the fix, naming the Function
and the input) as a note. Where torch takes the value after all (it sums a Jacobian-shaped
or batched gradient down to its input's shape, casts a float64 gradient to float32, reads
None as zeros while dropping a misplaced gradient), the call goes on with torch's result
and a ``FunctionCheckWarning`` says what torch repaired: checked mode changes nothing but
warnings for what torch accepts. Anything the node does not tell is left to torch: a tensor
subclass, a nested tensor, which of several inputs that need no gradient are tensors.
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
import contextvars
import functools
import inspect
import itertools
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge
from torch.overrides import handle_torch_function, has_torch_function, is_tensor_like

from torch_vjp._backward_checked import (
    backward_problems,
    backward_return_ok,
    function_name,
    torch_verdict,
)
from torch_vjp._checks import (
    BACKWARD,
    CHECK,
    GRAD,
    PULLBACK,
    TENSOR_BACKWARD,
    Labels,
    as_entries,
    check_cotangents,
    normalize_grad_outputs,
)
from torch_vjp._errors import (
    FunctionCheckError,
    FunctionCheckWarning,
    GradOutputsError,
    GradOutputsIndexError,
    GradOutputsTypeError,
    GradOutputsValueError,
    GradOutputsWarning,
    TorchVJPError,
    env_flag,
    torch_first,
    user_stacklevel,
)

__all__ = ["grad", "backward", "check_grad_outputs", "checked", "is_checked"]

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
_AUTOGRAD = sys.modules["torch.autograd"]
_HAS_ENGINE = hasattr(_AUTOGRAD, "_engine_run_backward")  # torch >= 2.4


def _engine(*args: Any, **kwargs: Any) -> Any:
    """torch's engine entry, looked up on every call as torch.autograd.grad does (so that a
    patch of it, as ``torch.compiler`` makes for tracing, applies here too)."""
    return _AUTOGRAD._engine_run_backward(*args, **kwargs)


def _materialized(inputs: Any, ins: tuple[Any, ...]) -> Any:
    """What to pass on as ``inputs``: a dict as it is (torch returns a dict for it), else the
    tuple read from it (a generator is consumed once)."""
    return inputs if inputs is None or type(inputs) is dict else ins


def _reusable(given: Any, entries: tuple[Any, ...] | None) -> Any:
    """``given`` itself if reading it again is harmless (the checker's messages then see what
    the caller passed, a single tensor say), else the entries already read from it."""
    if given is None or isinstance(given, (Tensor, tuple, list)):
        return given
    return entries


def _plain(items: Iterable[Any]) -> bool:
    """Whether every item is a Tensor we can validate directly (no GradientEdge, no nested
    tensor); anything else goes to torch unchanged."""
    for t in items:
        if not isinstance(t, Tensor) or t.is_nested:
            return False
    return True


def _outputs_tuple(outputs: Any, labels: Labels) -> tuple[Any, ...]:
    """``outputs`` as torch reads it: one tensor (or GradientEdge), or any iterable of them."""
    if isinstance(outputs, (Tensor, GradientEdge)) or is_tensor_like(outputs):
        return (outputs,)
    try:
        return tuple(outputs)
    except TypeError as err:
        raise torch_first(
            GradOutputsTypeError,
            f"{labels.call}: {labels.outputs} is {_a(outputs)}, but it must be a tensor or a "
            f"sequence of tensors: the outputs y whose vector-Jacobian product is taken (for a "
            f"training step, the loss).",
            str(err),
        ) from None


def _a(obj: object) -> str:
    return "None" if obj is None else f"a {type(obj).__name__}"


def _inputs_tuple(inputs: Any) -> tuple[Any, ...] | None:
    """``inputs`` as torch reads it, or None where torch itself must judge it (a Mapping
    that is not a dict, something not iterable)."""
    if isinstance(inputs, (Tensor, GradientEdge)) or is_tensor_like(inputs):
        return (inputs,)
    if type(inputs) is dict:
        return tuple(inputs.values())
    if isinstance(inputs, Mapping):
        return None
    try:
        return tuple(inputs)
    except TypeError:
        return None


# ---------------------------------------------------------------------------------------
# grad
# ---------------------------------------------------------------------------------------


def grad(
    outputs: Tensor | Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor] | dict[str, Tensor],
    grad_outputs: Tensor | Sequence[Tensor | None] | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    only_inputs: bool = True,
    allow_unused: bool | None = None,
    is_grads_batched: bool = False,
    materialize_grads: bool = False,
) -> Any:
    """Computes ``grad_outputs^T J``, one vector-Jacobian product per input, checking first.

    A drop-in for :func:`torch.autograd.grad`: the same signature, and identical results
    and warnings whenever torch accepts the call (see NOTE [transparent checks]).
    ``grad_outputs`` are validated before the backward pass runs; the validation replaces
    torch's own Python-level checks, so the call costs no more than torch's. For a call torch
    rejects, the error's message is torch's own sentence and the explanation follows as a
    note.

    Args:
        outputs: the tensors ``y`` to differentiate.
        inputs: the tensors ``x`` to differentiate against (a dict gives a dict back, as in
            torch).
        grad_outputs: ``grad_outputs[i]`` is dL/d ``outputs[i]``, with ``outputs[i]``'s
            shape; ``None`` for a scalar output means 1. Any iterable, as in torch.
        retain_graph: keep the graph for another backward pass (default: ``create_graph``).
        create_graph: record the backward pass for higher-order derivatives.
        only_inputs: deprecated and ignored, as in torch.
        allow_unused: return ``None`` for inputs the outputs do not depend on.
        is_grads_batched: each ``grad_outputs[i]`` stacks K vectors along a leading
            dimension; K products are computed at once (vectorised with vmap).
        materialize_grads: zeros instead of ``None`` for unused inputs.

    Returns:
        ``dL/d inputs[j] = sum_i grad_outputs[i]^T d outputs[i] / d inputs[j]``, one tensor per
        input with that input's shape (with a leading K when ``is_grads_batched``).

    Raises:
        GradOutputsError: ``grad_outputs`` does not fit ``outputs`` (see
            :func:`check_grad_outputs`); a ``TypeError``, ``ValueError`` or ``IndexError``
            too where torch raises one of those.

    Example:
        >>> import torch, torch_vjp as tv
        >>> x = torch.tensor([1., 2., 3., 4.], requires_grad=True)
        >>> y = torch.outer(x, x)
        >>> tv.grad(y, x, torch.ones_like(y))
        (tensor([20., 20., 20., 20.]),)
        >>> tv.grad(y, x, torch.ones_like(x))
        Traceback (most recent call last):
        ...
        torch_vjp.GradOutputsError: Mismatch in shape: grad_output[0] has a shape of torch.Size([4]) and output[0] has a shape of torch.Size([4, 4]).
        torch_vjp.grad: grad_outputs[0] has shape (4,), but outputs[0] has shape (4, 4).
        ...
    """
    return _grad(
        GRAD, _GENUINE_GRAD, outputs, inputs, grad_outputs, retain_graph, create_graph,
        only_inputs, allow_unused, is_grads_batched, materialize_grads,
    )


def _grad(
    labels: Labels,
    torch_grad: Callable[..., Any],
    outputs: Any,
    inputs: Any,
    grad_outputs: Any,
    retain_graph: bool | None,
    create_graph: bool,
    only_inputs: bool,
    allow_unused: bool | None,
    is_grads_batched: bool,
    materialize_grads: bool,
) -> Any:
    """torch.autograd.grad's steps, with the checker in place of ``_make_grads``.

    ``torch_grad`` is the function this call stands in for (torch's own, or what was
    installed before the checking wrapper): everything unusual is handed to it.
    """
    outs = _outputs_tuple(outputs, labels)
    ins = _inputs_tuple(inputs)
    if ins is None or not ins:  # torch raises its own error for these
        return torch_grad(outs, inputs, grad_outputs, retain_graph, create_graph, only_inputs,
                          allow_unused, is_grads_batched, materialize_grads)
    inputs_arg = _materialized(inputs, ins)
    overridable = tuple(t for t in outs if is_tensor_like(t)) + tuple(
        t for t in ins if is_tensor_like(t)
    )
    if has_torch_function(overridable):
        if torch_grad is not _GENUINE_GRAD:
            return torch_grad(outs, inputs_arg, grad_outputs, retain_graph, create_graph,
                              only_inputs, allow_unused, is_grads_batched, materialize_grads)
        result = handle_torch_function(
            _GENUINE_GRAD, overridable, outs, ins, grad_outputs=grad_outputs,
            retain_graph=retain_graph, create_graph=create_graph, only_inputs=only_inputs,
            allow_unused=allow_unused, is_grads_batched=is_grads_batched,
            materialize_grads=materialize_grads,
        )
        return dict(zip(inputs.keys(), result)) if type(inputs) is dict else result
    if not only_inputs:
        warnings.warn(
            "only_inputs argument is deprecated and is ignored now (defaults to True). To "
            "accumulate gradient for other parts of the graph, please use "
            "torch.autograd.backward.",
            FutureWarning,
            stacklevel=user_stacklevel(),
        )
    if not _plain(outs):
        return torch_grad(outs, inputs_arg, grad_outputs, retain_graph, create_graph, True,
                          allow_unused, is_grads_batched, materialize_grads)
    entries = as_entries(grad_outputs, labels, outs)
    try:
        gos = normalize_grad_outputs(
            outs, _reusable(grad_outputs, entries), labels, is_grads_batched=is_grads_batched,
            inputs=ins,
        )
    except GradOutputsError as err:
        return _arbitrate(err, labels, lambda: torch_grad(
            outs, inputs_arg, entries, retain_graph, create_graph, True, allow_unused,
            is_grads_batched, materialize_grads,
        ))
    if (
        not _HAS_ENGINE
        or torch_grad is not _GENUINE_GRAD
        or is_grads_batched
        or materialize_grads
        or type(inputs) is dict
        or not _plain(ins)
    ):
        return torch_grad(outs, inputs_arg, gos, retain_graph, create_graph, True,
                          allow_unused, is_grads_batched, materialize_grads)
    # NOTE [skipping torch's _make_grads]
    # torch.autograd.grad validates grad_outputs in Python (``_make_grads``) and then runs the
    # C++ engine. ``normalize_grad_outputs`` has already done that validation, more cheaply
    # and with better messages, and produced the same normalised grad_outputs (``ones_like``
    # for scalar outputs), so we call the engine entry torch itself calls, with the same
    # arguments. Anything unusual (batched, materialize_grads, dict inputs, tensor subclasses
    # with __torch_function__, GradientEdge, nested tensors) goes through torch's function.
    if retain_graph is None:
        retain_graph = create_graph
    return _engine(
        outs, gos, retain_graph, create_graph, ins,
        False if allow_unused is None else allow_unused, accumulate_grad=False,
    )


# ---------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------


def backward(
    tensors: Tensor | Sequence[Tensor],
    grad_tensors: Tensor | Sequence[Tensor | None] | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    grad_variables: Tensor | Sequence[Tensor | None] | None = None,
    inputs: Tensor | Sequence[Tensor] | dict[str, Tensor] | None = None,
) -> None:
    """Accumulates ``grad_tensors^T J`` into the leaves' ``.grad``, checking first.

    A drop-in for :func:`torch.autograd.backward` (and, through it, ``Tensor.backward``):
    the same signature and the same effect whenever torch accepts the call (see NOTE
    [transparent checks]).

    Args:
        tensors: the tensors ``y`` to differentiate.
        grad_tensors: ``grad_tensors[i]`` is dL/d ``tensors[i]``, with ``tensors[i]``'s
            shape; ``None`` for a scalar means 1. Any iterable, as in torch.
        retain_graph: keep the graph for another backward pass (default: ``create_graph``).
        create_graph: record the backward pass for higher-order derivatives.
        grad_variables: deprecated name of ``grad_tensors``, as in torch.
        inputs: accumulate only into these tensors' ``.grad`` (default: every leaf).

    Raises:
        GradOutputsError: ``grad_tensors`` does not fit ``tensors``.

    Example:
        >>> import torch, torch_vjp as tv
        >>> x = torch.tensor([[1., 2.]], requires_grad=True)
        >>> y = torch.stack([2 * x[0, 0] + x[0, 1] ** 2, x[0, 0] ** 2 + 2 * x[0, 1] ** 3])[None]
        >>> tv.backward(y, torch.tensor([[1., 2.]]))  # 1 * row 0 of J + 2 * row 1
        >>> x.grad
        tensor([[ 6., 52.]])
    """
    _backward(BACKWARD, _GENUINE_BACKWARD, tensors, grad_tensors, retain_graph, create_graph,
              grad_variables, inputs)


def _backward(
    labels: Labels,
    torch_backward: Callable[..., Any],
    tensors: Any,
    grad_tensors: Any,
    retain_graph: bool | None,
    create_graph: bool,
    grad_variables: Any,
    inputs: Any,
) -> None:
    """torch.autograd.backward's steps, with the checker in place of ``_make_grads``."""
    if torch._C._are_functorch_transforms_active():  # torch raises its own error
        return torch_backward(tensors, grad_tensors, retain_graph, create_graph,
                              grad_variables, inputs=inputs)
    if grad_variables is not None:
        if grad_tensors is not None:
            raise torch_first(
                GradOutputsError,
                f"{labels.call}: both grad_tensors and grad_variables were given; "
                f"grad_variables is the deprecated name of grad_tensors, so only one may be. "
                f"Fix: pass grad_tensors alone.",
                "`grad_tensors` and `grad_variables` (deprecated) arguments both passed to "
                "`backward()`. Please only use `grad_tensors`.",
            )
        warnings.warn("`grad_variables` is deprecated. Use `grad_tensors` instead.",
                      FutureWarning, stacklevel=user_stacklevel())
        grad_tensors = grad_variables
    if inputs is None:
        ins: tuple[Any, ...] | None = ()
    else:
        ins = _inputs_tuple(inputs)
    if ins is None or (inputs is not None and not ins):  # torch raises its own error
        return torch_backward(tensors, grad_tensors, retain_graph, create_graph, inputs=inputs)
    inputs_arg = _materialized(inputs, ins)
    outs = _outputs_tuple(tensors, labels)
    overridable = tuple(t for t in outs if is_tensor_like(t)) + tuple(
        t for t in ins if is_tensor_like(t)
    )
    if has_torch_function(overridable):
        if torch_backward is not _GENUINE_BACKWARD:
            return torch_backward(outs, grad_tensors, retain_graph, create_graph,
                                  inputs=inputs_arg)
        return handle_torch_function(
            _GENUINE_BACKWARD, overridable, outs, grad_tensors=grad_tensors,
            retain_graph=retain_graph, create_graph=create_graph,
            inputs=ins if inputs is not None else None,
        )
    if not _plain(outs):
        return torch_backward(outs, grad_tensors, retain_graph, create_graph, inputs=inputs_arg)
    entries = as_entries(grad_tensors, labels, outs)
    try:
        gts = normalize_grad_outputs(
            outs, _reusable(grad_tensors, entries), labels, inputs=ins or None
        )
    except GradOutputsError as err:
        return _arbitrate(err, labels, lambda: torch_backward(
            outs, entries, retain_graph, create_graph, inputs=inputs_arg))
    if not _HAS_ENGINE or torch_backward is not _GENUINE_BACKWARD or not _plain(ins):
        return torch_backward(outs, gts, retain_graph, create_graph, inputs=inputs_arg)
    # See NOTE [skipping torch's _make_grads]: the engine call of torch.autograd.backward.
    if retain_graph is None:
        retain_graph = create_graph
    _engine(outs, gts, retain_graph, create_graph, ins, allow_unreachable=True,
            accumulate_grad=True)
    return None


# ---------------------------------------------------------------------------------------
# check_grad_outputs
# ---------------------------------------------------------------------------------------


def check_grad_outputs(
    outputs: Tensor | Sequence[Tensor],
    grad_outputs: Tensor | Sequence[Tensor | None] | None,
    *,
    is_grads_batched: bool = False,
) -> tuple[Tensor | None, ...]:
    """Checks ``grad_outputs`` against ``outputs`` without running a backward pass.

    ``grad_outputs[i]`` must be dL/d ``outputs[i]``: a tensor of ``outputs[i]``'s shape (with
    one extra leading dimension K when ``is_grads_batched``), complex exactly when the
    output is, on its device; or ``None`` for a scalar output, which stands for 1.

    Args:
        outputs: a tensor or a sequence of tensors that require grad.
        grad_outputs: ``None``, a tensor, or an iterable with one entry per output.
        is_grads_batched: whether each entry stacks K vectors along a leading dimension.

    Returns:
        The normalised tuple, one entry per output: the given tensor, or
        ``torch.ones_like(output)`` where torch would create it for a scalar output.

    Raises:
        GradOutputsError: what torch would reject: torch's sentence, then the reason and a
            fix.

    Example:
        >>> import torch, torch_vjp as tv
        >>> x = torch.ones(3, requires_grad=True)
        >>> loss = (x * x).sum()
        >>> tv.check_grad_outputs(loss, None)
        (tensor(1.),)
        >>> tv.check_grad_outputs(loss, torch.ones(1))
        Traceback (most recent call last):
        ...
        torch_vjp.GradOutputsError: Mismatch in shape: grad_output[0] has a shape of torch.Size([1]) and output[0] has a shape of torch.Size([]).
        torch_vjp.check_grad_outputs: grad_outputs[0] has shape (1,), but outputs[0] has shape ().
        ...
    """
    outs = _outputs_tuple(outputs, CHECK)
    return normalize_grad_outputs(outs, grad_outputs, CHECK, is_grads_batched=is_grads_batched)


# ---------------------------------------------------------------------------------------
# Torch is the judge (NOTE [transparent checks])
# ---------------------------------------------------------------------------------------

_BUILTIN_CLASSES: tuple[tuple[type[BaseException], type[GradOutputsError]], ...] = (
    (IndexError, GradOutputsIndexError),
    (ValueError, GradOutputsValueError),
    (TypeError, GradOutputsTypeError),
    (RuntimeError, GradOutputsError),
)


def _arbitrate(err: GradOutputsError, labels: Labels, run_torch: Callable[[], Any]) -> Any:
    """Runs torch's own function on a call the checker rejected, and raises the checker's
    error if torch raises too (as the builtin class torch raised); returns torch's result,
    with a warning, if torch accepts the call after all."""
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
        cls = type(err) if isinstance(err, builtin) else ours
        sentence = getattr(err, "torch_sentence", None) or str(torch_err)
        explanation = getattr(err, "explanation", None) or str(err)
        raise torch_first(cls, explanation, sentence if labels.torch_first else None) from None
    explanation = getattr(err, "explanation", None) or str(err)
    warnings.warn(
        f"{labels.call}: torch accepted this call, although torch_vjp's check reports a "
        f"mismatch; the result is torch's. (torch ignores the vector given for an output that "
        f"does not depend on what is differentiated.) The check said:\n{explanation}",
        GradOutputsWarning,
        stacklevel=user_stacklevel(),
    )
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


# ---------------------------------------------------------------------------------------
# The wrappers installed into torch
# ---------------------------------------------------------------------------------------

_TORCH_GRAD = GRAD.replace(call="torch.autograd.grad")
_TORCH_BACKWARD = BACKWARD.replace(call="torch.autograd.backward")
# What each wrapper replaced when it was installed (torch's own function by default).
_PREVIOUS: dict[str, Callable[..., Any]] = {
    "grad": _GENUINE_GRAD,
    "backward": _GENUINE_BACKWARD,
    "tensor_backward": _GENUINE_TENSOR_BACKWARD,
    "func_vjp": _GENUINE_FUNC_VJP,
    "node_apply": _GENUINE_NODE_APPLY,
    "node_apply_boxed": _GENUINE_NODE_APPLY_BOXED,
}


def _wrapper(genuine: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Marks a checking wrapper: ``functools.wraps`` of torch's function (so ``inspect``
    shows torch's signature and docs), flagged so that :func:`_genuine` can see through it."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        wrapped = functools.wraps(genuine)(fn)
        setattr(wrapped, _WRAPPER_FLAG, True)
        return wrapped

    return mark


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
    if not _active():
        return previous(outputs, inputs, grad_outputs, retain_graph, create_graph,
                        only_inputs, allow_unused, is_grads_batched, materialize_grads)
    with _in_flight_pass():
        return _grad(_TORCH_GRAD, previous, outputs, inputs, grad_outputs, retain_graph,
                     create_graph, only_inputs, allow_unused, is_grads_batched,
                     materialize_grads)


@_wrapper(_GENUINE_BACKWARD)
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
    if not _active():
        return previous(tensors, grad_tensors, retain_graph, create_graph, grad_variables,
                        inputs=inputs)
    with _in_flight_pass():
        return _backward(_TORCH_BACKWARD, previous, tensors, grad_tensors, retain_graph,
                         create_graph, grad_variables, inputs)


@_wrapper(_GENUINE_TENSOR_BACKWARD)
def _checked_tensor_backward(
    self: Tensor,
    gradient: Tensor | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Any = None,
) -> None:
    """``Tensor.backward``, checked in a checked scope."""
    previous = _PREVIOUS["tensor_backward"]
    if not _active() or previous is not _GENUINE_TENSOR_BACKWARD:
        return previous(self, gradient, retain_graph, create_graph, inputs=inputs)
    if has_torch_function((self,)):  # overrides see torch's own Tensor.backward
        return handle_torch_function(
            _GENUINE_TENSOR_BACKWARD, (self,), self, gradient=gradient,
            retain_graph=retain_graph, create_graph=create_graph, inputs=inputs,
        )
    # What Tensor.backward does next: torch.autograd.backward with itself as the tensors.
    with _in_flight_pass():
        return _backward(TENSOR_BACKWARD, _PREVIOUS["backward"], self, gradient, retain_graph,
                         create_graph, None, inputs)


@_wrapper(_GENUINE_FUNC_VJP)
def _checked_func_vjp(func: Callable[..., Any], *primals: Any, has_aux: bool = False) -> Any:
    """``torch.func.vjp``, whose pullback checks its cotangents in a checked scope."""
    result = _PREVIOUS["func_vjp"](func, *primals, has_aux=has_aux)
    if not _active():
        return result
    out, pullback = result[0], result[1]

    # The pullback of a checked vjp stays checked wherever it is called.
    @functools.wraps(pullback)
    def checked_pullback(
        cotangents: Any, retain_graph: bool = True, create_graph: bool | None = None
    ) -> Any:
        if _SCOPE.get().suppressed:
            return pullback(cotangents, retain_graph=retain_graph, create_graph=create_graph)
        try:
            check_cotangents(out, cotangents, PULLBACK, primals=primals)
        except GradOutputsError as err:
            return _arbitrate(err, PULLBACK, lambda: pullback(
                cotangents, retain_graph=retain_graph, create_graph=create_graph))
        with _in_flight_pass():
            with _suppressed():  # the pullback's own torch.autograd.grad call is checked already
                return pullback(cotangents, retain_graph=retain_graph,
                                create_graph=create_graph)

    return (out, checked_pullback) + tuple(result[2:])


@_wrapper(_GENUINE_NODE_APPLY)
def _checked_node_apply(self: Any, *args: Any) -> Any:
    """``BackwardCFunction.apply``: runs a custom Function's backward, then, in a checked
    scope, checks what it returned (NOTE [checked custom backwards])."""
    # the user's backward: its errors pass through
    return _checked_return(self, _PREVIOUS["node_apply"](self, *args))


@_wrapper(_GENUINE_NODE_APPLY_BOXED)
def _checked_node_apply_boxed(self: Any, *args: Any) -> Any:
    """``BackwardCFunction.apply_boxed`` (grads in one list that backward may empty), checked
    as ``apply`` is."""
    return _checked_return(self, _PREVIOUS["node_apply_boxed"](self, *args))


def _checked_return(node: Any, returned: Any) -> Any:
    """``returned``, what the backward of ``node``'s Function returned, after checked mode's
    check of it, in a checked scope: the fast path, then the slow one if it objects."""
    if _checks_backwards() and not backward_return_ok(node, returned):
        _judge_backward(node, returned)
    return returned


_CHECKED = "torch_vjp.checked"  # how messages about custom backwards name checked mode


def _judge_backward(node: Any, returned: Any) -> None:
    """The slow path of NOTE [checked custom backwards]: explains what the check objects to,
    with torch as the judge. Where torch's own validation raises, raises with torch's
    sentence first and the explanation as a note; where torch takes the value after all
    (summing a gradient down to its input's shape, casting it, dropping it), warns."""
    problems = backward_problems(_CHECKED, node, returned)
    if not problems:
        return
    rejected = [p for p in problems if p.torch == "rejects"]
    if torch._C._are_functorch_transforms_active():
        judged, error = False, None  # no replay inside a torch.func transform
    else:
        judged, error = torch_verdict(node, returned, _GENUINE_GRAD)
    if error is not None:
        if rejected:
            raise torch_first(FunctionCheckError, rejected[0].message, str(error)) from None
        return  # torch rejects it for a reason the check does not see: torch's error follows
    if rejected and not judged:
        return  # what torch does is not known here: torch judges, its error follows if any
    problem = problems[0]
    message = problem.message
    if problem.torch == "rejects":
        message = (
            f"{_CHECKED}: torch accepted what {function_name(node)}.backward returned, "
            f"although torch_vjp's check reports a mistake; the gradients are torch's. The "
            f"check said:\n{message}"
        )
    warnings.warn(message, FunctionCheckWarning, stacklevel=user_stacklevel())


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
# unchanged, and checks nothing (one Python call more). A patch another library makes over
# them is kept as for the others.
_KEPT_OWNERS = (torch.Tensor, BackwardCFunction)


def _install() -> None:
    """Puts the checking wrappers in place of torch's entry points (remembering what they
    replace), if they are not there already."""
    for key, owner, attr, wrapper in _TARGETS:
        current = getattr(owner, attr)
        if current is not wrapper:
            _PREVIOUS[key] = current
            setattr(owner, attr, wrapper)


def _uninstall() -> None:
    """Puts back what each wrapper replaced, where the wrapper is still installed; the
    wrappers of class attributes (``Tensor.backward``, the custom-backward node's ``apply``)
    stay (NOTE [wrappers of class attributes stay])."""
    for key, owner, attr, wrapper in _TARGETS:
        if owner in _KEPT_OWNERS:
            continue
        if getattr(owner, attr) is wrapper:
            setattr(owner, attr, _PREVIOUS[key])


def _acquire() -> None:
    global _open_blocks
    with _patch_lock:
        _open_blocks += 1
        if _open_blocks == 1 and not _PROCESS_WIDE:
            _install()


def _release() -> None:
    global _open_blocks
    with _patch_lock:
        _open_blocks -= 1
        if _open_blocks == 0 and not _PROCESS_WIDE:
            _uninstall()


def _set_process_wide(on: bool) -> None:
    """Checks every thread, for good (``TORCH_VJP_CHECKED=1``), or stops doing so."""
    global _PROCESS_WIDE
    with _patch_lock:
        _PROCESS_WIDE = on
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


def _register_jit_builtins() -> None:
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


_register_jit_builtins()


# ---------------------------------------------------------------------------------------
# checked()
# ---------------------------------------------------------------------------------------

_ids = itertools.count(1)


class checked(contextlib.ContextDecorator):
    """Checks every ``grad_outputs`` given to torch's own autograd entry points.

    Inside ``with tv.checked():`` (or a function decorated with ``@tv.checked()``: plain,
    generator or ``async``), plain ``torch.autograd.grad``, ``torch.autograd.backward``,
    ``Tensor.backward`` and the pullbacks returned by ``torch.func.vjp`` validate their vectors
    as :func:`grad` does and raise :class:`GradOutputsError` with the same explanations, after
    torch's own sentence. Setting the environment variable ``TORCH_VJP_CHECKED=1`` turns this
    on for a whole process (every thread), with no code change (with torch_vjp installed,
    ``import torch`` is enough).

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

    def __init__(self) -> None:
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
                            response = gen.throw(*sys.exc_info())
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
                            response = await agen.athrow(*sys.exc_info())
                    else:
                        with self:
                            response = await agen.asend(request)
            except StopAsyncIteration:
                return

        return run
