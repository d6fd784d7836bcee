"""Checked autograd: drop-in ``grad`` and ``backward`` whose errors explain ``grad_outputs``.

``grad_outputs[i]`` (``grad_tensors[i]`` for ``backward``, ``gradient`` for
``Tensor.backward``) is dL/d ``outputs[i]``: the vector in the vector-Jacobian product
``v^T J``, one number per element of ``outputs[i]``, so it has ``outputs[i]``'s shape. Every
function here validates that before running torch's engine, and explains a mismatch: which
output, both shapes, what the shape must be and why, and a fix when the mistake is
recognisable.

Results are torch's own: the same engine runs on the same arguments.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from torch_vjp._checks import check_cotangents, normalize_grad_outputs

__all__ = ["grad", "backward", "check_grad_outputs", "checked"]

# The originals, captured before checked() may replace them.
_ORIG_GRAD = torch.autograd.grad
_ORIG_BACKWARD = torch.autograd.backward
_ORIG_TENSOR_BACKWARD = torch.Tensor.backward
_ORIG_FUNC_VJP = torch.func.vjp

try:  # torch >= 2.4: the engine entry that torch.autograd.grad itself calls.
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - older torch: always go through torch.autograd.grad
    _engine_run_backward = None

from torch.overrides import has_torch_function


def _as_tuple(x: Any) -> tuple[Any, ...]:
    if isinstance(x, Tensor):
        return (x,)
    return tuple(x)


def _plain_tensors(items: tuple[Any, ...]) -> bool:
    """True when every item is a Tensor we can validate directly (no GradientEdge, no
    nested tensor); anything else goes to torch unchanged."""
    for t in items:
        if not isinstance(t, Tensor) or t.is_nested:
            return False
    return True


def grad(
    outputs: Tensor | Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor],
    grad_outputs: Tensor | Sequence[Tensor | None] | None = None,
    *,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool | None = None,
    is_grads_batched: bool = False,
    materialize_grads: bool = False,
) -> tuple[Tensor | None, ...]:
    """Computes ``grad_outputs^T J``, one vector-Jacobian product per input, checking first.

    A drop-in for :func:`torch.autograd.grad`, with the same arguments and identical results
    whenever torch accepts the call. ``grad_outputs`` are validated before the backward pass
    runs; the validation replaces torch's own Python-level checks, so the call costs no more
    than torch's.

    Args:
        outputs: the tensors ``y`` to differentiate.
        inputs: the tensors ``x`` to differentiate against (a dict gives a dict back, as in
            torch).
        grad_outputs: ``grad_outputs[i]`` is dL/d ``outputs[i]``, with ``outputs[i]``'s
            shape; ``None`` for a scalar output means 1.
        retain_graph: keep the graph for another backward pass (default: ``create_graph``).
        create_graph: record the backward pass for higher-order derivatives.
        allow_unused: return ``None`` for inputs the outputs do not depend on.
        is_grads_batched: each ``grad_outputs[i]`` stacks K vectors along a leading
            dimension; K products are computed at once (vectorised with vmap).
        materialize_grads: zeros instead of ``None`` for unused inputs.

    Returns:
        ``dL/d inputs[j] = sum_i grad_outputs[i]^T d outputs[i] / d inputs[j]``, one tensor per
        input with that input's shape (with a leading K when ``is_grads_batched``).

    Raises:
        GradOutputsError: ``grad_outputs`` does not fit ``outputs`` (see
            :func:`check_grad_outputs`).

    Example:
        >>> import torch, torch_vjp as tv
        >>> x = torch.tensor([1., 2., 3., 4.], requires_grad=True)
        >>> y = torch.outer(x, x)
        >>> tv.grad(y, x, torch.ones_like(y))
        (tensor([20., 20., 20., 20.]),)
        >>> tv.grad(y, x, torch.ones_like(x))
        Traceback (most recent call last):
        ...
        torch_vjp.GradOutputsError: torch_vjp.grad: grad_outputs[0] has shape (4,), but outputs[0] has shape (4, 4).
        ...
    """
    return _checked_grad(
        outputs,
        inputs,
        grad_outputs,
        retain_graph=retain_graph,
        create_graph=create_graph,
        allow_unused=allow_unused,
        is_grads_batched=is_grads_batched,
        materialize_grads=materialize_grads,
        _call="torch_vjp.grad",
    )


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
    *,
    _call: str = "torch.autograd.grad",
) -> Any:
    """``torch.autograd.grad``'s signature, validated; what ``checked()`` installs."""
    outs = _as_tuple(outputs)
    if not _plain_tensors(outs):
        return _ORIG_GRAD(
            outputs, inputs, grad_outputs, retain_graph, create_graph, only_inputs,
            allow_unused, is_grads_batched, materialize_grads,
        )
    inputs_tuple = tuple(inputs.values()) if type(inputs) is dict else _as_tuple(inputs)
    gos = normalize_grad_outputs(
        outs, grad_outputs, is_grads_batched=is_grads_batched, call=_call, inputs=inputs_tuple
    )
    if (
        _engine_run_backward is None
        or is_grads_batched
        or materialize_grads
        or not only_inputs
        or type(inputs) is dict
        or not inputs_tuple
        or not _plain_tensors(inputs_tuple)
        or has_torch_function(outs + inputs_tuple)
    ):
        return _ORIG_GRAD(
            outs, inputs, gos, retain_graph, create_graph, only_inputs, allow_unused,
            is_grads_batched, materialize_grads,
        )
    return _run_grad(outs, inputs_tuple, gos, retain_graph, create_graph, allow_unused)


def _run_grad(
    outputs: tuple[Tensor, ...],
    inputs: tuple[Tensor, ...],
    grad_outputs: tuple[Tensor | None, ...],
    retain_graph: bool | None,
    create_graph: bool,
    allow_unused: bool | None,
) -> tuple[Tensor | None, ...]:
    """The engine call of ``torch.autograd.grad`` for plain tensors, after validation.

    NOTE [skipping torch's _make_grads]
    torch.autograd.grad validates grad_outputs in Python (``_make_grads``) and then runs the
    C++ engine. ``normalize_grad_outputs`` has already done that validation, more cheaply
    and with better messages, and produced the same normalised grad_outputs (``ones_like``
    for scalar outputs), so we call the engine entry torch itself calls, with the same
    arguments. Anything unusual (batched, materialize_grads, dict inputs, tensor subclasses
    with __torch_function__, GradientEdge) goes through torch.autograd.grad unchanged.
    """
    if allow_unused is None:
        allow_unused = False
    if retain_graph is None:
        retain_graph = create_graph
    return _engine_run_backward(
        outputs,
        grad_outputs,
        retain_graph,
        create_graph,
        inputs,
        allow_unused,
        accumulate_grad=False,
    )


def backward(
    tensors: Tensor | Sequence[Tensor],
    grad_tensors: Tensor | Sequence[Tensor | None] | None = None,
    *,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Tensor | Sequence[Tensor] | None = None,
) -> None:
    """Accumulates ``grad_tensors^T J`` into the leaves' ``.grad``, checking first.

    A drop-in for :func:`torch.autograd.backward` and ``Tensor.backward``: the same
    arguments and the same effect whenever torch accepts the call.

    Args:
        tensors: the tensors ``y`` to differentiate.
        grad_tensors: ``grad_tensors[i]`` is dL/d ``tensors[i]``, with ``tensors[i]``'s
            shape; ``None`` for a scalar means 1.
        retain_graph: keep the graph for another backward pass (default: ``create_graph``).
        create_graph: record the backward pass for higher-order derivatives.
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
    _checked_backward(
        tensors, grad_tensors, retain_graph, create_graph, inputs=inputs,
        _call="torch_vjp.backward",
    )


def _checked_backward(
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    grad_variables: Any = None,
    inputs: Any = None,
    *,
    _call: str = "torch.autograd.backward",
) -> None:
    """``torch.autograd.backward``'s signature, validated; what ``checked()`` installs."""
    if grad_variables is not None and grad_tensors is None:
        grad_tensors = grad_variables
    outs = _as_tuple(tensors)
    if _plain_tensors(outs):
        inputs_tuple = None if inputs is None else _as_tuple(inputs)
        if inputs_tuple is not None and type(inputs) is dict:
            inputs_tuple = tuple(inputs.values())
        grad_tensors = normalize_grad_outputs(
            outs,
            grad_tensors,
            call=_call,
            outputs_name="tensors",
            grad_outputs_name="grad_tensors",
            inputs=inputs_tuple,
            batch_hint="use torch_vjp.grad(..., is_grads_batched=True): backward has no "
            "batched form",
        )
        if inputs is None and _run_backward(outs, grad_tensors, retain_graph, create_graph):
            return
        tensors = outs
    _ORIG_BACKWARD(tensors, grad_tensors, retain_graph, create_graph, inputs=inputs)


def _run_backward(
    tensors: tuple[Tensor, ...],
    grad_tensors: tuple[Tensor | None, ...],
    retain_graph: bool | None,
    create_graph: bool,
) -> bool:
    """The engine call of ``torch.autograd.backward`` for plain tensors and no ``inputs``,
    after validation; False when the call must go through torch instead.

    See NOTE [skipping torch's _make_grads]: the same shortcut as ``_run_grad``, with
    torch.autograd.backward's own engine arguments (accumulate into ``.grad``).
    """
    if (
        _engine_run_backward is None
        or has_torch_function(tensors)
        or torch._C._are_functorch_transforms_active()
    ):
        return False
    if retain_graph is None:
        retain_graph = create_graph
    _engine_run_backward(
        tensors,
        grad_tensors,
        retain_graph,
        create_graph,
        (),
        allow_unreachable=True,
        accumulate_grad=True,
    )
    return True


def _checked_tensor_backward(
    self: Tensor,
    gradient: Tensor | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Any = None,
) -> None:
    """``Tensor.backward``, validated; what ``checked()`` installs."""
    if has_torch_function((self,)) or self.is_nested:
        return _ORIG_TENSOR_BACKWARD(self, gradient, retain_graph, create_graph, inputs=inputs)
    gos = normalize_grad_outputs(
        (self,),
        None if gradient is None else (gradient,),
        call="y.backward(gradient)",
        outputs_name="y",
        grad_outputs_name="gradient",
        indexed=False,
        inputs=None if inputs is None else _as_tuple(inputs),
        batch_hint="use torch_vjp.grad(y, x, gradient, is_grads_batched=True): backward has "
        "no batched form",
    )
    if inputs is None and _run_backward((self,), gos, retain_graph, create_graph):
        return None
    _ORIG_BACKWARD((self,), gos, retain_graph, create_graph, inputs=inputs)


def _checked_func_vjp(func: Callable[..., Any], *primals: Any, has_aux: bool = False) -> Any:
    """``torch.func.vjp`` whose pullback validates its cotangents; what ``checked()`` installs."""
    result = _ORIG_FUNC_VJP(func, *primals, has_aux=has_aux)
    out, pullback = result[0], result[1]

    def checked_pullback(cotangents: Any, retain_graph: bool = True, create_graph: Any = None):
        check_cotangents(
            out, cotangents, call="torch.func.vjp: vjp_fn(cotangents)", primals=primals
        )
        return pullback(cotangents, retain_graph=retain_graph, create_graph=create_graph)

    return (out, checked_pullback) + tuple(result[2:])


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
        grad_outputs: ``None``, a tensor, or a sequence with one entry per output.
        is_grads_batched: whether each entry stacks K vectors along a leading dimension.

    Returns:
        The normalised tuple, one entry per output: the given tensor, or
        ``torch.ones_like(output)`` where torch would create it for a scalar output.

    Raises:
        GradOutputsError: what torch would reject, with the reason and a fix.

    Example:
        >>> import torch, torch_vjp as tv
        >>> x = torch.ones(3, requires_grad=True)
        >>> loss = (x * x).sum()
        >>> tv.check_grad_outputs(loss, None)
        (tensor(1.),)
        >>> tv.check_grad_outputs(loss, torch.ones(1))
        Traceback (most recent call last):
        ...
        torch_vjp.GradOutputsError: torch_vjp.check_grad_outputs: grad_outputs[0] has shape (1,), but outputs[0] has shape ().
        ...
    """
    outs = _as_tuple(outputs)
    return normalize_grad_outputs(
        outs, grad_outputs, is_grads_batched=is_grads_batched,
        call="torch_vjp.check_grad_outputs",
    )


# ---------------------------------------------------------------------------------------
# checked(): install the validated versions into torch for a while.
# ---------------------------------------------------------------------------------------

_install_lock = threading.Lock()
_install_depth = 0


def _install() -> None:
    global _install_depth
    with _install_lock:
        _install_depth += 1
        if _install_depth == 1:
            torch.autograd.grad = _checked_grad
            torch.autograd.backward = _checked_backward
            torch.Tensor.backward = _checked_tensor_backward
            torch.func.vjp = _checked_func_vjp


def _uninstall() -> None:
    global _install_depth
    with _install_lock:
        if _install_depth == 0:
            return
        _install_depth -= 1
        if _install_depth == 0:
            torch.autograd.grad = _ORIG_GRAD
            torch.autograd.backward = _ORIG_BACKWARD
            torch.Tensor.backward = _ORIG_TENSOR_BACKWARD
            torch.func.vjp = _ORIG_FUNC_VJP


def is_checked() -> bool:
    """Whether torch's autograd entry points are currently checked."""
    return _install_depth > 0


class checked(contextlib.ContextDecorator):
    """Checks every ``grad_outputs`` given to torch's own autograd entry points.

    Inside ``with tv.checked():`` (or a function decorated with ``@tv.checked()``), plain
    ``torch.autograd.grad``, ``torch.autograd.backward``, ``Tensor.backward`` and the
    pullbacks returned by ``torch.func.vjp`` validate their vectors as :func:`grad` does
    and raise :class:`GradOutputsError` with the same messages. Setting the environment
    variable ``TORCH_VJP_CHECKED=1`` turns this on for a whole process, with no code change
    (with torch_vjp installed, ``import torch`` is enough).

    The switch is process-wide (torch's functions are replaced while any ``checked()``
    block is open, in any thread) and re-entrant. Results are unchanged.

    Example:
        >>> import torch, torch_vjp as tv
        >>> x = torch.ones(4, requires_grad=True)
        >>> with tv.checked():
        ...     (x * 2).backward(torch.ones(3))
        Traceback (most recent call last):
        ...
        torch_vjp.GradOutputsError: y.backward(gradient): gradient has shape (3,), but y has shape (4,).
        ...
    """

    def __enter__(self) -> checked:
        _install()
        return self

    def __exit__(self, *exc: object) -> None:
        _uninstall()


def _install_from_environment() -> None:
    """Turns checking on for the whole process when ``TORCH_VJP_CHECKED=1``."""
    if os.environ.get("TORCH_VJP_CHECKED", "0") == "1" and not is_checked():
        _install()
