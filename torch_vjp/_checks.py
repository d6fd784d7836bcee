"""The one checker for ``grad_outputs``, ``grad_tensors``, ``gradient``, cotangents and tangents.

Every public entry point that takes "the vector" of a vector-Jacobian (or Jacobian-vector)
product validates it here: :func:`torch_vjp.grad`, :func:`torch_vjp.backward`,
``Tensor.backward`` and ``torch.func.vjp`` pullbacks inside :func:`torch_vjp.checked`, and the
cotangents and tangents of :func:`torch_vjp.vjp` / :func:`torch_vjp.jvp`.

NOTE [fast path, slow message]
The validation that runs on every call is a tight loop of attribute comparisons (shape,
dtype, device, requires_grad): it must cost less than the Python-level checks torch itself
runs, because ``torch_vjp.grad`` replaces them (see ``autograd._run_grad``). Only once a
mismatch is found do we spend time on the message: guessing the mistake, walking the graph
for leaf shapes, and so on. The rule for what is accepted is torch's own: whatever
``torch.autograd.grad`` accepts we accept (warning where torch silently casts or ignores),
whatever it rejects for a grad_outputs reason we reject with a better message.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from torch_vjp._errors import (
    GradOutputsError,
    GradOutputsTypeError,
    GradOutputsWarning,
    shape_str,
)

__all__ = [
    "normalize_grad_outputs",
    "check_tree_structure",
    "check_cotangents",
    "leaf_shapes",
]


class GradOutputsValueError(GradOutputsError, ValueError):
    """A :class:`GradOutputsError` where torch itself raises ValueError (batch sizes differ)."""


class _Labels:
    """How one call names its arguments in messages.

    ``torch_vjp.grad`` speaks of ``outputs[i]`` and ``grad_outputs[i]``; ``Tensor.backward``
    of ``the tensor`` and ``gradient``; a JVP of ``primals[i]`` and ``tangents[i]``.
    """

    __slots__ = (
        "call", "outputs", "grad_outputs", "indexed", "role", "inputs", "batch_hint", "batch_flag"
    )

    def __init__(
        self,
        call: str,
        outputs: str,
        grad_outputs: str,
        indexed: bool,
        role: str,
        inputs: str = "inputs",
        batch_hint: str = "pass is_grads_batched=True",
        batch_flag: str = "is_grads_batched",
    ):
        self.call = call
        self.outputs = outputs
        self.grad_outputs = grad_outputs
        self.indexed = indexed
        self.role = role
        self.inputs = inputs
        self.batch_hint = batch_hint
        self.batch_flag = batch_flag

    @property
    def product(self) -> str:
        """The product one vector makes: a VJP for cotangents, a JVP for tangents."""
        return "Jacobian-vector product" if self.role == "tangents" else "vector-Jacobian product"

    def out(self, i: int) -> str:
        return f"{self.outputs}[{i}]" if self.indexed else self.outputs

    def go(self, i: int) -> str:
        return f"{self.grad_outputs}[{i}]" if self.indexed else self.grad_outputs

    def meaning(self, i: int) -> str:
        """What the vector is, in words: the reason for every rule."""
        if self.role == "tangents":
            return f"{self.go(i)} is a direction of change dx for {self.out(i)}"
        return f"{self.go(i)} is dL/d {self.out(i)}"


def normalize_grad_outputs(
    outputs: Sequence[Tensor],
    grad_outputs: Any,
    *,
    is_grads_batched: bool = False,
    call: str,
    outputs_name: str = "outputs",
    grad_outputs_name: str = "grad_outputs",
    inputs: Sequence[Tensor] | None = None,
    role: str = "grad_outputs",
    indexed: bool = True,
    require_grad: bool = True,
    allow_none: bool = True,
    inputs_name: str = "inputs",
    batch_hint: str = "pass is_grads_batched=True",
    batch_flag: str = "is_grads_batched",
) -> tuple[Tensor | None, ...]:
    """Validates ``grad_outputs`` against ``outputs`` and returns them normalised.

    The result has one entry per output: the given tensor, ``torch.ones_like(output)`` for a
    ``None`` given for a scalar output that requires grad (as torch creates it), or ``None``.

    Args:
        outputs: the tensors being differentiated (or the primals, for tangents).
        grad_outputs: ``None``, a tensor, or a sequence of tensors and ``None``.
        is_grads_batched: every vector carries one extra leading batch dimension.
        call: the public call named in messages, e.g. ``"torch_vjp.grad"``.
        outputs_name: how the call names its outputs (``"tensors"``, ``"primals"``).
        grad_outputs_name: how it names the vectors (``"grad_tensors"``, ``"cotangents"``).
        inputs: the tensors differentiated against, when known: used to recognise an input's
            shape passed by mistake.
        role: ``"grad_outputs"`` (cotangents, dL/d output) or ``"tangents"`` (JVP directions).
        indexed: whether messages index the arguments (``outputs[0]``) or not (``gradient``).
        require_grad: whether an output that does not require grad is an error (it is for
            ``grad``/``backward``; a pullback of ``torch.func.vjp`` ignores such outputs).
        allow_none: whether ``None`` entries are accepted (they are not for JVP tangents).
        inputs_name: how the call names ``inputs`` (``"primals"`` for a pullback).
        batch_hint: how this call computes K products at once, for the message that spots
            an extra leading dimension.
        batch_flag: the name of this call's batching flag (``batched`` for
            ``torch_vjp.vjp``/``jvp``), as messages quote it.

    Returns:
        The normalised tuple, aligned with ``outputs``.

    Raises:
        GradOutputsError: on a shape, structure, dtype (complex vs real), device,
            batch-dimension or count mismatch, a non-scalar output with no vector, or an
            output that does not require grad.
    """
    labels = _Labels(
        call, outputs_name, grad_outputs_name, indexed, role, inputs_name, batch_hint,
        batch_flag,
    )
    n = len(outputs)
    if grad_outputs is None:
        gos: tuple[Any, ...] = (None,) * n
    elif isinstance(grad_outputs, Tensor):
        gos = (grad_outputs,)
    elif isinstance(grad_outputs, (list, tuple)):
        gos = tuple(grad_outputs)
    else:
        raise GradOutputsTypeError(_not_a_sequence_message(labels, grad_outputs, outputs))

    if len(gos) != n:
        if len(gos) < n:
            raise GradOutputsError(_count_message(labels, outputs, gos, grad_outputs))
        extra = len(gos) - n
        gos = gos[:n]
    else:
        extra = 0

    result: list[Tensor | None] = []
    batch_size = -1
    for i in range(n):
        out = outputs[i]
        go = gos[i]
        if require_grad and not out.requires_grad:
            raise GradOutputsError(_no_grad_message(labels, i, out))
        if go is None:
            if not allow_none:
                raise GradOutputsTypeError(_type_message(labels, i, out, go))
            if out.requires_grad:
                if is_grads_batched:
                    raise GradOutputsError(_batched_none_message(labels, i, out, gos, outputs))
                if out.numel() != 1:
                    raise GradOutputsError(_missing_message(labels, i, out, inputs))
                if not out.dtype.is_floating_point:
                    raise GradOutputsError(_implicit_dtype_message(labels, i, out))
                go = torch.ones_like(out, memory_format=torch.preserve_format)
            result.append(go)
            continue
        if not isinstance(go, Tensor):
            raise GradOutputsTypeError(_type_message(labels, i, out, go))
        if is_grads_batched:
            if go.dim() == 0 or go.shape[1:] != out.shape:
                raise GradOutputsError(
                    _shape_message(labels, i, out, go, outputs, gos, True, inputs)
                )
            if batch_size < 0:
                batch_size = go.shape[0]
            elif go.shape[0] != batch_size:
                raise GradOutputsValueError(_batch_size_message(labels, i, gos))
        elif go.shape != out.shape:
            raise GradOutputsError(_shape_message(labels, i, out, go, outputs, gos, False, inputs))
        if go.dtype != out.dtype:
            if go.dtype.is_complex != out.dtype.is_complex:
                raise GradOutputsError(_complex_message(labels, i, out, go))
            warnings.warn(
                _cast_message(labels, i, out, go), GradOutputsWarning,
                stacklevel=_user_stacklevel(),
            )
        if go.device != out.device and go.dim() != 0:
            raise GradOutputsError(_device_message(labels, i, out, go))
        result.append(go)
    if extra:
        warnings.warn(
            f"{call}: got {n + extra} {grad_outputs_name} for {n} {outputs_name}; torch "
            f"ignores the last {extra}. {grad_outputs_name} holds one vector per entry of "
            f"{outputs_name}, in the same order: check that none is missing from "
            f"{outputs_name}.",
            GradOutputsWarning,
            stacklevel=_user_stacklevel(),
        )
    return tuple(result)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside torch_vjp (and
    outside torch, for calls that came through torch's own functions)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("torch_vjp") or name.startswith("torch.") or name == "torch"):
            return level
        frame = frame.f_back
        level += 1
    return 1


def check_tree_structure(
    expected: Any, got: Any, *, call: str, name: str, against: str = "the function's output"
) -> None:
    """Raises :class:`GradOutputsError` unless ``got`` has the pytree structure of ``expected``.

    Args:
        expected: the function's output (or primals), any pytree of tensors.
        got: the cotangents (or tangents) given for it.
        call: the public call named in the message.
        name: how the call names ``got``.
        against: what ``expected`` is, in words (``"the primals"`` for tangents).

    Raises:
        GradOutputsError: the structures differ.
    """
    from torch.utils._pytree import tree_structure

    want = tree_structure(expected)
    have = tree_structure(got)
    if want == have:
        return
    raise GradOutputsError(
        f"{call}: {name} must have the same structure as {against}, but it does not.\n"
        f"  expected: {_describe_tree(expected)}\n"
        f"  got:      {_describe_tree(got)}\n"
        f"  {name} holds one vector per tensor of {against}, arranged exactly like it (same "
        f"containers, same keys, same order), each with that tensor's shape. Fix: build it "
        f"from {against} itself, e.g. torch.utils._pytree.tree_map(torch.ones_like, ...)."
    )


def check_cotangents(
    out: Any,
    cotangents: Any,
    *,
    call: str,
    batched: bool = False,
    primals: Sequence[Any] | None = None,
    batch_flag: str = "batched",
) -> tuple[Tensor | None, ...]:
    """Validates the cotangents given to a pullback against the function's output pytree.

    Shared by ``torch.func.vjp`` pullbacks inside :func:`checked` and by
    :func:`torch_vjp.vjp`'s ``vjp_fn``. ``primals`` (the pytree of primals) lets a message
    recognise a primal's shape passed by mistake.

    Returns:
        The flat tuple of cotangents, aligned with the output's tensor leaves.

    Raises:
        GradOutputsError: the structure or a leaf does not fit.
    """
    from torch.utils._pytree import tree_leaves

    check_tree_structure(out, cotangents, call=call, name="cotangents")
    flat_out = tuple(tree_leaves(out))
    flat_cot = tuple(tree_leaves(cotangents))
    if not all(isinstance(t, Tensor) and not t.is_nested for t in flat_out):
        return flat_cot
    indexed = not isinstance(out, Tensor)
    return normalize_grad_outputs(
        flat_out,
        flat_cot,
        is_grads_batched=batched,
        call=call,
        outputs_name="outputs" if indexed else "out",
        grad_outputs_name="cotangents",
        indexed=indexed,
        require_grad=False,
        inputs=None if primals is None else tuple(tree_leaves(primals)),
        inputs_name="primals",
        batch_hint="call vjp_fn(cotangents, batched=True) of torch_vjp.vjp",
        batch_flag=batch_flag,
    )


def _describe_tree(tree: Any) -> str:
    """A short structural description of a pytree with tensor shapes at the leaves."""
    if isinstance(tree, Tensor):
        return f"Tensor{shape_str(tree.shape)}"
    if isinstance(tree, tuple):
        inner = ", ".join(_describe_tree(t) for t in tree)
        return f"({inner}{',' if len(tree) == 1 else ''})"
    if isinstance(tree, list):
        return "[" + ", ".join(_describe_tree(t) for t in tree) + "]"
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k!r}: {_describe_tree(v)}" for k, v in tree.items()) + "}"
    if tree is None:
        return "None"
    return type(tree).__name__


def leaf_shapes(outputs: Sequence[Tensor], limit: int = 2000) -> list[torch.Size]:
    """Shapes of the leaf tensors (those that accumulate ``.grad``) behind ``outputs``.

    Walks the autograd graph breadth-first, visiting at most ``limit`` nodes. Used only to
    word messages: "(4,) is the shape of a leaf tensor that outputs[0] was computed from".
    """
    shapes: list[torch.Size] = []
    seen: set[int] = set()
    frontier = [o.grad_fn for o in outputs if isinstance(o, Tensor) and o.grad_fn is not None]
    for o in outputs:
        if isinstance(o, Tensor) and o.grad_fn is None and o.requires_grad:
            shapes.append(o.shape)
    visited = 0
    while frontier and visited < limit:
        node = frontier.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        visited += 1
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor) and variable.shape not in shapes:
            shapes.append(variable.shape)
        frontier.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return shapes


# ---------------------------------------------------------------------------------------
# Messages. Each says: the call; what was got (index, concrete shapes); what was expected
# and why; one fix when the mistake is recognisable.
# ---------------------------------------------------------------------------------------


def _shape_message(
    labels: _Labels,
    i: int,
    out: Tensor,
    go: Tensor,
    outputs: Sequence[Tensor],
    gos: Sequence[Any],
    batched: bool,
    inputs: Sequence[Tensor] | None,
) -> str:
    o, g = labels.out(i), labels.go(i)
    gshape, oshape = tuple(go.shape), tuple(out.shape)
    if batched:
        k = _known_batch_size(gos, outputs) or (gshape[0] if gshape else None)
        want = f"(K, {', '.join(str(d) for d in oshape)})" if oshape else "(K,)"
        if k is not None:
            want += f" with K = {k}"
        head = (
            f"{labels.call}: {g} has shape {shape_str(gshape)}, but {o} has shape "
            f"{shape_str(oshape)} and {labels.batch_flag}=True.\n"
            f"  With {labels.batch_flag}=True, {g} stacks K vectors along a new leading batch "
            f"dimension, one per {labels.product}: {labels.meaning(i)}, so each "
            f"vector has shape {shape_str(oshape)} and {g} must have shape {want}."
        )
    else:
        head = (
            f"{labels.call}: {g} has shape {shape_str(gshape)}, but {o} has shape "
            f"{shape_str(oshape)}.\n"
            f"  {labels.meaning(i)}: one number per element of {o}, so it must have shape "
            f"{shape_str(oshape)}."
        )
    fix = _shape_fix(labels, i, out, go, outputs, gos, batched, inputs)
    return head + ("\n  " + fix if fix else "")


def _known_batch_size(gos: Sequence[Any], outputs: Sequence[Tensor]) -> int | None:
    """The batch size K implied by the grad_outputs that do carry a batch dimension."""
    for go, out in zip(gos, outputs):
        if isinstance(go, Tensor) and go.dim() == out.dim() + 1 and go.shape[1:] == out.shape:
            return int(go.shape[0])
    return None


def _shape_fix(
    labels: _Labels,
    i: int,
    out: Tensor,
    go: Tensor,
    outputs: Sequence[Tensor],
    gos: Sequence[Any],
    batched: bool,
    inputs: Sequence[Tensor] | None,
) -> str:
    """One recognisable mistake and its fix, or an empty string."""
    o, g = labels.out(i), labels.go(i)
    gshape, oshape = go.shape, out.shape
    if batched:
        if gshape == oshape or go.dim() == 0:
            k = _known_batch_size(gos, outputs)
            if k is not None:
                return (
                    f"{g} has no batch dimension, while other {labels.grad_outputs} have one "
                    f"of size {k}: with {labels.batch_flag}=True every one of them must carry "
                    f"it. To use the same vector in all {k} products, pass "
                    f"{g}.expand({k}, *{o}.shape)."
                )
            return (
                f"{g} has no batch dimension. If you meant a single {labels.product.split()[0]} "
                f"product, pass {labels.batch_flag}=False; for K products, stack K vectors: "
                f"torch.stack([v1, v2, ...])."
            )
        if go.dim() >= 1 and gshape[1:] != oshape and _matches_input(gshape[1:], inputs, outputs):
            return _input_fix(labels, i, gshape[1:], inputs, outputs, batched=True)
        return ""
    if out.dim() == 0 and go.numel() == 1:
        return (
            f"{o} is a 0-d scalar (shape ()), and {shape_str(gshape)} is not (): "
            f"torch.Size([1]) and torch.Size([]) differ. Pass {g}.reshape(()), or "
            f"torch.ones_like({o}), or leave it None: for a scalar output torch uses 1."
        )
    if out.dim() == 0:
        return (
            f"{o} is a 0-d scalar (shape ()), so dL/d {o} is a single number, not "
            f"{go.numel()}. Pass a 0-d tensor such as torch.tensor(1.0), or leave it None "
            f"(torch uses 1). If the {go.numel()} numbers are weights for {go.numel()} "
            f"separate outputs, differentiate the vector of those outputs (before any .sum()) "
            f"with this as its {labels.grad_outputs}; if they are {go.numel()} separate "
            f"vectors, {labels.batch_hint}."
        )
    if go.dim() == out.dim() + 1 and gshape[1:] == oshape:
        k = gshape[0]
        return (
            f"{g} has an extra leading dimension of size {k}. If it holds {k} "
            f"vector{'s' if k != 1 else ''}, one per {labels.product}, "
            f"{labels.batch_hint}; torch_vjp.jacobian_of computes the whole Jacobian."
        )
    if out.numel() == 1 and go.dim() == 0:
        return (
            f"{o} has one element but shape {shape_str(oshape)}, not (): pass "
            f"{g}.reshape({shape_str(oshape)}), or leave it None: for a one-element output "
            f"torch uses 1."
        )
    if _matches_input(gshape, inputs, outputs):
        return _input_fix(labels, i, gshape, inputs, outputs, batched=False)
    if out.dim() == go.dim() + 1 and oshape[1:] == gshape:
        return (
            f"{g} lacks the leading dimension of size {oshape[0]} that {o} has. To use the "
            f"same vector for every row of {o}, pass {g}.expand_as({o})."
        )
    if go.dim() >= 2 and tuple(reversed(gshape)) == tuple(oshape):
        perm = "mT" if go.dim() == 2 else f"permute({', '.join(str(d) for d in reversed(range(go.dim())))})"
        return f"{shape_str(gshape)} is {o}'s shape reversed: did you mean {g}.{perm}?"
    if go.numel() == out.numel():
        return (
            f"{g} has the right number of elements ({go.numel()}) in the wrong shape: if its "
            f"elements are in the order of {o}'s, pass {g}.reshape({o}.shape)."
        )
    if _broadcastable(gshape, oshape):
        return (
            f"torch does not broadcast {labels.grad_outputs}: pass {g}.expand_as({o}) to "
            f"repeat it over {o}'s shape."
        )
    return ""


def _matches_input(
    shape: torch.Size, inputs: Sequence[Tensor] | None, outputs: Sequence[Tensor]
) -> bool:
    if inputs is not None:
        return any(isinstance(t, Tensor) and t.shape == shape for t in inputs)
    return shape in leaf_shapes(outputs)


def _input_fix(
    labels: _Labels,
    i: int,
    shape: torch.Size,
    inputs: Sequence[Tensor] | None,
    outputs: Sequence[Tensor],
    batched: bool,
) -> str:
    o = labels.out(i)
    if labels.role == "tangents":
        return ""
    if inputs is not None:
        j = next(j for j, t in enumerate(inputs) if isinstance(t, Tensor) and t.shape == shape)
        whose = f"{labels.inputs}[{j}]"
        what = f"{shape_str(shape)} is the shape of {whose}"
    else:
        what = f"{shape_str(shape)} is the shape of a leaf tensor that {o} was computed from"
    ones = f"torch.ones_like({o})"
    if batched:
        ones = f"torch.ones_like({o}).expand(K, *{o}.shape)"
    return (
        f"{what}; gradients with respect to the inputs are what the call returns, not what "
        f"it takes. To sum the elements of {o}, pass {ones}."
    )


def _broadcastable(a: Sequence[int], b: Sequence[int]) -> bool:
    if len(a) > len(b):
        return False
    return all(x == y or x == 1 for x, y in zip(reversed(a), reversed(b)))


def _missing_message(
    labels: _Labels, i: int, out: Tensor, inputs: Sequence[Tensor] | None
) -> str:
    o, g = labels.out(i), labels.go(i)
    shape = shape_str(out.shape)
    target = "inputs" if inputs is not None else "x"
    return (
        f"{labels.call}: {o} has shape {shape} ({out.numel()} elements), and no {g} was "
        f"given.\n"
        f"  torch can start a backward pass without {labels.grad_outputs} only from a "
        f"scalar output (it uses dL/d output = 1). {labels.meaning(i)}: one number per "
        f"element of {o}, so here it must be a tensor of shape {shape}.\n"
        f"  To differentiate the sum of {o}'s elements, pass torch.ones_like({o}) (or call "
        f".sum() on it first); for the full Jacobian of {o}, use "
        f"torch_vjp.jacobian_of({o}, {target})."
    )


def _batched_none_message(
    labels: _Labels, i: int, out: Tensor, gos: Sequence[Any], outputs: Sequence[Tensor]
) -> str:
    o, g = labels.out(i), labels.go(i)
    k = _known_batch_size(gos, outputs)
    shape = ", ".join(["K"] + [str(d) for d in out.shape])
    expand = f"torch.ones_like({o}).expand({k if k is not None else 'K'}, *{o}.shape)"
    return (
        f"{labels.call}: {g} is None, but {labels.batch_flag}=True.\n"
        f"  With {labels.batch_flag}=True every {labels.grad_outputs} entry stacks K vectors "
        f"dL/d output along a leading batch dimension; for None torch would create a single "
        f"unbatched 1, which has no batch dimension to map over. {g} must be a tensor of "
        f"shape ({shape}). Fix: pass {expand} to use dL/d {o} = 1 in every product."
    )


def _implicit_dtype_message(labels: _Labels, i: int, out: Tensor) -> str:
    o, g = labels.out(i), labels.go(i)
    return (
        f"{labels.call}: {o} is a scalar of dtype {out.dtype}, and no {g} was given.\n"
        f"  torch creates the starting gradient 1 only for real floating-point scalars. Pass "
        f"{g} explicitly, e.g. torch.ones_like({o}), or differentiate a real function of "
        f"{o} (for a complex output, its .abs() or .real)."
    )


def _no_grad_message(labels: _Labels, i: int, out: Tensor) -> str:
    o = labels.out(i)
    return (
        f"{labels.call}: {o} (shape {shape_str(out.shape)}) does not require grad: it has "
        f"no grad_fn, so there is no graph to differentiate back from it.\n"
        f"  Autograd records a graph only for tensors computed from tensors with "
        f"requires_grad=True, with grad mode on; {o} was computed from none, under "
        f"torch.no_grad(), or after .detach()/.item()/.numpy()/torch.tensor(...).\n"
        f"  Fix: create the inputs with requires_grad=True (or call .requires_grad_() on "
        f"them) before computing {o}, or leave {o} out of {labels.outputs}."
    )


def _type_message(labels: _Labels, i: int, out: Tensor, go: Any) -> str:
    g, o = labels.go(i), labels.out(i)
    allowed = "a Tensor" if go is None else "a Tensor or None"
    if go is None and labels.role == "tangents":
        return (
            f"{labels.call}: {g} is None, but each entry of {labels.grad_outputs} must be "
            f"{allowed}.\n  {labels.meaning(i)}, a tensor of {o}'s shape "
            f"{shape_str(out.shape)}. Fix: torch.zeros_like({o}) to hold {o} fixed."
        )
    return (
        f"{labels.call}: {g} is {'None' if go is None else 'a ' + type(go).__name__}, but each "
        f"entry of {labels.grad_outputs} must be {allowed}.\n"
        f"  {labels.meaning(i)}, a tensor of {o}'s shape {shape_str(out.shape)}. Fix: "
        f"torch.full_like({o}, value) for a constant, or torch.as_tensor(...) for data."
    )


def _not_a_sequence_message(labels: _Labels, go: Any, outputs: Sequence[Tensor]) -> str:
    return (
        f"{labels.call}: {labels.grad_outputs} is a {type(go).__name__}, but it must be a "
        f"Tensor, a list or tuple of Tensors (None for scalar outputs), or None.\n"
        f"  It holds one vector dL/d output per entry of {labels.outputs}, each with that "
        f"output's shape. Fix: pass a tensor, e.g. torch.full_like(output, value) for a "
        f"constant."
    )


def _count_message(
    labels: _Labels, outputs: Sequence[Tensor], gos: Sequence[Any], given: Any
) -> str:
    n, m = len(outputs), len(gos)
    shapes = ", ".join(shape_str(o.shape) for o in outputs)
    msg = (
        f"{labels.call}: got {n} {labels.outputs} but {m} {labels.grad_outputs}.\n"
        f"  {labels.grad_outputs} holds one vector per entry of {labels.outputs}, in the "
        f"same order ({labels.grad_outputs}[i] is dL/d {labels.outputs}[i]), so it needs "
        f"{n} entries, with shapes {shapes}; None stands for a scalar output."
    )
    if isinstance(given, Tensor):
        msg += (
            f"\n  A single Tensor counts as one entry. Pass a list of {n}: "
            f"[g0, g1, ...], or stack the outputs into one tensor first."
        )
    return msg


def _batch_size_message(labels: _Labels, i: int, gos: Sequence[Any]) -> str:
    sizes = ", ".join(
        f"{labels.go(j)}: {int(g.shape[0])}"
        for j, g in enumerate(gos[: i + 1])
        if isinstance(g, Tensor) and g.dim() > 0
    )
    return (
        f"{labels.call}: with {labels.batch_flag}=True the {labels.grad_outputs} have "
        f"different batch sizes ({sizes}).\n"
        f"  The leading dimension K is the number of vector-Jacobian products computed at "
        f"once, so it must be the same for every entry of {labels.grad_outputs}. Fix: give "
        f"each the same K, e.g. by .expand(K, ...) of a shared vector."
    )


def _complex_message(labels: _Labels, i: int, out: Tensor, go: Tensor) -> str:
    o, g = labels.out(i), labels.go(i)
    if out.dtype.is_complex:
        fix = f"pass {g}.to({out.dtype}) (a real vector is the complex one with zero imaginary part)"
    else:
        fix = f"pass a real {g} of dtype {out.dtype}, e.g. {g}.real.to({out.dtype})"
    return (
        f"{labels.call}: {g} has dtype {go.dtype}, but {o} has dtype {out.dtype}.\n"
        f"  {labels.meaning(i)}, which lives in the same space as {o}: torch casts between "
        f"real dtypes, but never between complex and real. Fix: {fix}."
    )


def _cast_message(labels: _Labels, i: int, out: Tensor, go: Tensor) -> str:
    o, g = labels.out(i), labels.go(i)
    what = "integer" if not (go.dtype.is_floating_point or go.dtype.is_complex) else str(go.dtype)
    return (
        f"{labels.call}: {g} has dtype {go.dtype} but {o} has dtype {out.dtype}; torch casts "
        f"the {what} {labels.grad_outputs} to {out.dtype} silently. Pass {g}.to({out.dtype}) "
        f"to make the cast explicit, or compute {o} in {go.dtype} if you need that precision."
    )


def _device_message(labels: _Labels, i: int, out: Tensor, go: Tensor) -> str:
    o, g = labels.out(i), labels.go(i)
    return (
        f"{labels.call}: {g} is on device {go.device}, but {o} is on {out.device}.\n"
        f"  {labels.meaning(i)}, consumed where {o}'s graph runs, so it must be on "
        f"{out.device}. Fix: pass {g}.to({o}.device)."
    )
