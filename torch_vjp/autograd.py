"""Checked autograd: drop-in ``grad`` and ``backward`` whose errors explain ``grad_outputs``.

``grad_outputs[i]`` (``grad_tensors[i]`` for ``backward``, ``gradient`` for
``Tensor.backward``) is dL/d ``outputs[i]``: the vector in the vector-Jacobian product
``v^T J``, one number per element of ``outputs[i]``, so it has ``outputs[i]``'s shape. Every
function here validates that before running torch's engine, and explains a mismatch: which
output, both shapes, what the shape must be and why, and a fix when the mistake is
recognisable.

A call torch accepts behaves exactly as torch's own (NOTE [transparent checks] in
:mod:`torch_vjp._drop_ins`). ``checked()`` and ``TORCH_VJP_CHECKED=1`` install the same
checks into torch's own entry points and into custom backwards (:mod:`torch_vjp._checked_mode`;
the scope of a block: NOTE [checked scope] in :mod:`torch_vjp._checked_scope`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from torch_vjp._checked_scope import _GENUINE_BACKWARD, _GENUINE_GRAD
from torch_vjp._check_labels import BACKWARD, CHECK, GRAD
from torch_vjp._checks import normalize_grad_outputs
from torch_vjp._drop_ins import _backward, _check_outputs, _grad, _outputs_tuple

__all__ = ["grad", "backward", "check_grad_outputs", "checked", "is_checked"]


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
        outputs: a tensor or a sequence of tensors that require grad (or GradientEdges of
            them, as ``torch.autograd.graph.get_gradient_edge`` gives, read as torch reads
            them: the shape, dtype and device of the edge).
        grad_outputs: ``None``, a tensor, or an iterable with one entry per output.
        is_grads_batched: whether each entry stacks K vectors along a leading dimension.

    Returns:
        The normalised tuple, one entry per output: the given tensor, or
        ``torch.ones_like(output)`` where torch would create it for a scalar output.

    Raises:
        GradOutputsError: what torch would reject: torch's sentence, then the reason and a
            fix. :class:`GradOutputsTypeError` (a ``TypeError``) for an output that is not a
            tensor or GradientEdge (a number, None).

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
    outs = _check_outputs(_outputs_tuple(outputs, CHECK), CHECK, outputs)
    return normalize_grad_outputs(outs, grad_outputs, CHECK, is_grads_batched=is_grads_batched)


# Checked mode (after grad and backward, which TorchScript's table maps to its built-ins).
from torch_vjp._checked_mode import (  # noqa: E402
    _register_jit_builtins,
    checked,
    install_from_environment,  # noqa: F401 - as before the split
)
from torch_vjp._checked_scope import is_checked  # noqa: E402
# The error classes this module's functions raise, importable from it as before the split.
from torch_vjp._errors import (  # noqa: E402, F401
    FunctionCheckError,
    FunctionCheckWarning,
    GradOutputsError,
    GradOutputsIndexError,
    GradOutputsTypeError,
    GradOutputsValueError,
    GradOutputsWarning,
)

_register_jit_builtins(grad, backward)
