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

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from torch_vjp._errors import (
    GradOutputsError,
    GradOutputsIndexError,
    GradOutputsTypeError,
    GradOutputsValueError,
    GradOutputsWarning,
    shape_str,
    torch_first,
    user_stacklevel,
)

_user_stacklevel = user_stacklevel

__all__ = [
    "Labels",
    "GRAD",
    "BACKWARD",
    "TENSOR_BACKWARD",
    "CHECK",
    "PULLBACK",
    "VJP",
    "TANGENTS",
    "as_entries",
    "normalize_grad_outputs",
    "check_tree_structure",
    "check_cotangents",
    "leaf_shapes",
]


class Labels:
    """How one call names its arguments in messages, and whether it speaks torch's language.

    ``torch_vjp.grad`` speaks of ``outputs[i]`` and ``grad_outputs[i]``; ``Tensor.backward`` of
    ``y`` and ``gradient``; a JVP of ``primals[i]`` and ``tangents[i]``. One instance per call
    site, made once (see the presets at the end of this module), so the checker's fast path
    allocates nothing.

    Attributes:
        call: the public call named at the start of every explanation.
        outputs, grad_outputs, inputs: how the call names its arguments.
        indexed: whether messages index them (``outputs[0]``) or not (``gradient``).
        role: ``"grad_outputs"`` (cotangents, dL/d output) or ``"tangents"`` (JVP directions).
        batch_hint: how this call computes K products at once.
        batch_flag: the name of the call's batching flag.
        require_grad: whether an output that does not require grad is an error (it is for
            ``grad``/``backward``; products of torch.func and torch_vjp ignore such outputs).
        allow_none: whether ``None`` entries are accepted (not for JVP tangents).
        torch_first: whether the call stands in for one of torch's own (``grad``, ``backward``,
            ``Tensor.backward``, a ``torch.func.vjp`` pullback): then an error's message is
            torch's sentence and the explanation a note (NOTE [torch's sentence first]).
        empty_batch_ok: whether a batch of K = 0 vectors is accepted (torch_vjp's own
            batched products return empty results; torch.autograd.grad raises).
    """

    __slots__ = (
        "call", "outputs", "grad_outputs", "indexed", "role", "inputs", "batch_hint",
        "batch_flag", "require_grad", "allow_none", "torch_first", "empty_batch_ok",
    )

    def __init__(
        self,
        call: str,
        outputs: str = "outputs",
        grad_outputs: str = "grad_outputs",
        *,
        indexed: bool = True,
        role: str = "grad_outputs",
        inputs: str = "inputs",
        batch_hint: str = "pass is_grads_batched=True",
        batch_flag: str = "is_grads_batched",
        require_grad: bool = True,
        allow_none: bool = True,
        torch_first: bool = True,
        empty_batch_ok: bool = False,
    ):
        self.call = call
        self.outputs = outputs
        self.grad_outputs = grad_outputs
        self.indexed = indexed
        self.role = role
        self.inputs = inputs
        self.batch_hint = batch_hint
        self.batch_flag = batch_flag
        self.require_grad = require_grad
        self.allow_none = allow_none
        self.torch_first = torch_first
        self.empty_batch_ok = empty_batch_ok

    def replace(self, **changes: Any) -> Labels:
        """A copy with some attributes changed, e.g. ``GRAD.replace(call="torch.autograd.grad")``."""
        other = object.__new__(Labels)
        for slot in self.__slots__:
            setattr(other, slot, changes.pop(slot, getattr(self, slot)))
        if changes:
            raise TypeError(f"Labels has no attribute(s) {sorted(changes)}")
        return other

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


def as_entries(grad_outputs: Any, labels: Labels, outputs: Sequence[Tensor]) -> tuple[Any, ...] | None:
    """``grad_outputs`` as torch reads it: None, a tensor (one entry), or any iterable.

    Returns None for None. A generator or other one-shot iterable is consumed here: callers
    pass the returned tuple on, never the original.

    Raises:
        GradOutputsTypeError: ``grad_outputs`` is not iterable (torch raises TypeError).
    """
    if grad_outputs is None:
        return None
    if isinstance(grad_outputs, Tensor):
        return (grad_outputs,)
    if isinstance(grad_outputs, (tuple, list)):
        return tuple(grad_outputs)
    try:
        return tuple(grad_outputs)
    except TypeError as err:
        raise _error(
            GradOutputsTypeError, labels, _not_a_sequence_message(labels, grad_outputs, outputs),
            str(err),
        ) from None


def normalize_grad_outputs(
    outputs: Sequence[Tensor],
    grad_outputs: Any,
    labels: Labels,
    *,
    is_grads_batched: bool = False,
    inputs: Sequence[Tensor] | None = None,
) -> tuple[Tensor | None, ...]:
    """Validates ``grad_outputs`` against ``outputs`` and returns them normalised.

    Accepts exactly what ``torch.autograd.grad`` accepts (any iterable of tensors and None,
    a single tensor, or None), warning where torch silently casts or ignores; see NOTE [fast
    path, slow message]. The result has one entry per output: the given tensor,
    ``torch.ones_like(output)`` for a ``None`` given for a scalar output that requires grad (as
    torch creates it), or ``None``.

    Args:
        outputs: the tensors being differentiated (or the primals, for tangents).
        grad_outputs: ``None``, a tensor, or an iterable of tensors and ``None``.
        labels: how the call names things, and its rules (see :class:`Labels`).
        is_grads_batched: every vector carries one extra leading batch dimension.
        inputs: the tensors differentiated against, when known: used to recognise an input's
            shape passed by mistake.

    Returns:
        The normalised tuple, aligned with ``outputs``.

    Raises:
        GradOutputsError: on a shape, structure, dtype (complex vs real), device,
            batch-dimension or count mismatch, a non-scalar output with no vector, or an
            output that does not require grad; the first mistake in the order torch finds
            them, with torch's sentence first where the call stands in for torch's.
    """
    n = len(outputs)
    gos = as_entries(grad_outputs, labels, outputs)
    if gos is None:
        gos = (None,) * n
    m = len(gos)
    ok = m >= n
    result: list[Tensor | None] = []
    batch_size = -1
    if ok:
        for i in range(n):
            out = outputs[i]
            go = gos[i]
            if labels.require_grad and not out.requires_grad:
                ok = False
                break
            if go is None:
                if not labels.allow_none:
                    ok = False
                    break
                if out.requires_grad:
                    if is_grads_batched or out.numel() != 1 or not out.dtype.is_floating_point:
                        ok = False
                        break
                    go = torch.ones_like(out, memory_format=torch.preserve_format)
                result.append(go)
                continue
            if not isinstance(go, Tensor):
                ok = False
                break
            if is_grads_batched:
                if go.dim() == 0 or go.shape[1:] != out.shape or (
                    go.shape[0] == 0 and not labels.empty_batch_ok
                ):
                    ok = False
                    break
                if batch_size < 0:
                    batch_size = go.shape[0]
                elif go.shape[0] != batch_size:
                    ok = False
                    break
            elif go.shape != out.shape:
                ok = False
                break
            if go.dtype != out.dtype and (
                go.dtype.is_complex != out.dtype.is_complex
                or (labels.role == "tangents" and not go.dtype.is_floating_point)
            ):
                ok = False
                break
            if (go.device != out.device and go.dim() != 0) or (
                go.layout is not out.layout and not _layout_ok(go, out)
            ):
                ok = False
                break
            result.append(go)
    if not ok:
        raise _diagnose(outputs, gos, labels, is_grads_batched, inputs, grad_outputs)
    for i in range(n):
        go = gos[i]
        if go is not None and go.dtype != outputs[i].dtype:
            warnings.warn(
                _cast_message(labels, i, outputs[i], go), GradOutputsWarning,
                stacklevel=_user_stacklevel(),
            )
    if m > n:
        extra = m - n
        warnings.warn(
            f"{labels.call}: got {m} {labels.grad_outputs} for {n} {labels.outputs}; torch "
            f"ignores the last {extra}. {labels.grad_outputs} holds one vector per entry of "
            f"{labels.outputs}, in the same order: check that none is missing from "
            f"{labels.outputs}.",
            GradOutputsWarning,
            stacklevel=_user_stacklevel(),
        )
    return tuple(result)


def _error(
    cls: type[GradOutputsError], labels: Labels, explanation: str, sentence: str | None
) -> BaseException:
    return torch_first(cls, explanation, sentence if labels.torch_first else None)


def _layout_ok(go: Tensor, out: Tensor) -> bool:
    """torch's engine rule for a gradient whose layout differs from its output's: a sparse
    COO gradient is accepted for any output, a strided one for a sparse output."""
    return go.layout is torch.sparse_coo or (
        go.layout is torch.strided and out.layout is not torch.strided
    )


def _layout_name(layout: torch.layout) -> str:
    """A layout as torch's engine prints it: ``Strided``, ``Sparse``, ``SparseCsr``."""
    names = {torch.strided: "Strided", torch.sparse_coo: "Sparse", torch.sparse_csr: "SparseCsr",
             torch.sparse_csc: "SparseCsc", torch.sparse_bsr: "SparseBsr",
             torch.sparse_bsc: "SparseBsc"}
    return names.get(layout, str(layout))


def _size(shape: Sequence[int]) -> str:
    """A shape as torch prints it in its own messages: ``torch.Size([4, 4])``."""
    return str(torch.Size(shape))


def _diagnose(
    outputs: Sequence[Tensor],
    gos: tuple[Any, ...],
    labels: Labels,
    batched: bool,
    inputs: Sequence[Tensor] | None,
    given: Any,
) -> BaseException:
    """The first mistake, in the order torch finds them, as the exception to raise.

    torch validates each entry (``_make_grads``: its type, its shape, complex against real,
    the implicit 1 for a scalar), then the number of entries, then (with
    ``is_grads_batched``) the batch sizes, then in its engine that every output requires grad
    and the devices. The sentences below are torch's own, filled in with the right index
    and shapes (NOTE [torch's sentence first]).
    """
    n, m = len(outputs), len(gos)
    for i in range(min(n, m)):
        out, go = outputs[i], gos[i]
        if go is None:
            if not labels.allow_none:
                return _error(GradOutputsTypeError, labels, _type_message(labels, i, out, go),
                              None)
            if not out.requires_grad:
                continue
            if batched:
                return _error(GradOutputsError, labels,
                              _batched_none_message(labels, i, out, gos, outputs), None)
            if out.numel() != 1:
                return _error(GradOutputsError, labels,
                              _missing_message(labels, i, out, inputs),
                              "grad can be implicitly created only for scalar outputs")
            if not out.dtype.is_floating_point:
                return _error(GradOutputsError, labels, _implicit_dtype_message(labels, i, out),
                              "grad can be implicitly created only for real scalar outputs "
                              f"but got {out.dtype}")
            continue
        if not isinstance(go, Tensor):
            return _error(GradOutputsTypeError, labels, _type_message(labels, i, out, go),
                          f"gradients can be either Tensors or None, but got "
                          f"{type(go).__name__}")
        if batched:
            if go.dim() == 0:
                return _error(
                    GradOutputsIndexError, labels,
                    _shape_message(labels, i, out, go, outputs, gos, True, inputs),
                    "invalid index of a 0-dim tensor. Use `tensor.item()` in Python or "
                    "`tensor.item<T>()` in C++ to convert a 0-dim tensor to a number",
                )
            if go.shape[0] == 0 and not labels.empty_batch_ok:
                return _error(GradOutputsIndexError, labels, _empty_batch_message(labels, i, go),
                              "index 0 is out of bounds for dimension 0 with size 0")
            if go.shape[1:] != out.shape:
                return _error(
                    GradOutputsError, labels,
                    _shape_message(labels, i, out, go, outputs, gos, True, inputs),
                    "If `is_grads_batched=True`, we interpret the first dimension of each "
                    "grad_output as the batch dimension. The sizes of the remaining dimensions "
                    "are expected to match the shape of corresponding output, but a mismatch "
                    f"was detected: grad_output[{i}] has a shape of {_size(go.shape[1:])} and "
                    f"output[{i}] has a shape of {_size(out.shape)}. If you only want some "
                    f"tensors in `grad_output` to be considered batched, consider using vmap.",
                )
        elif go.shape != out.shape:
            return _error(
                GradOutputsError, labels,
                _shape_message(labels, i, out, go, outputs, gos, False, inputs),
                f"Mismatch in shape: grad_output[{i}] has a shape of {_size(go.shape)} and "
                f"output[{i}] has a shape of {_size(out.shape)}.",
            )
        if labels.role == "tangents" and not (go.dtype.is_floating_point or go.dtype.is_complex):
            return _error(
                GradOutputsValueError, labels, _integer_tangent_message(labels, i, out, go),
                f"Expected tangent to be floating point or complex, but got: {go.dtype}",
            )
        if go.dtype.is_complex != out.dtype.is_complex:
            return _error(
                GradOutputsError, labels, _complex_message(labels, i, out, go),
                "For complex Tensors, both grad_output and output are required to have the "
                f"same dtype. Mismatch in dtype: grad_output[{i}] has a dtype of {go.dtype} "
                f"and output[{i}] has a dtype of {out.dtype}.",
            )
    if m < n:
        return _error(GradOutputsError, labels, _count_message(labels, outputs, gos, given),
                      f"got {n} tensors and {m} gradients")
    if batched:
        sizes = [int(g.shape[0]) for g in gos[:n] if isinstance(g, Tensor)]
        if len(set(sizes)) > 1:
            return _error(
                GradOutputsValueError, labels, _batch_size_message(labels, gos[:n]),
                f"vmap: Expected all tensors to have the same size in the mapped dimension, "
                f"got sizes {sizes} for the mapped dimension",
            )
    if labels.require_grad:
        for i, out in enumerate(outputs):
            if not out.requires_grad:
                return _error(GradOutputsError, labels, _no_grad_message(labels, i, out),
                              f"element {i} of tensors does not require grad and does not "
                              f"have a grad_fn")
    for i in range(n):
        out, go = outputs[i], gos[i]
        if not isinstance(go, Tensor):
            continue
        if go.device != out.device and go.dim() != 0:
            return _error(GradOutputsError, labels, _device_message(labels, i, out, go),
                          f"invalid gradient at index {i} - expected device {out.device} but "
                          f"got {go.device}")
        if go.layout is not out.layout and not _layout_ok(go, out):
            return _error(GradOutputsError, labels, _layout_message(labels, i, out, go),
                          f"invalid gradient at index {i} - expected layout "
                          f"{_layout_name(out.layout)} but got {_layout_name(go.layout)}")
    # Nothing found in torch's order: the fast path saw something this pass does not, which
    # is a bug here; say so rather than reject silently.
    return _error(GradOutputsError, labels,
                  f"{labels.call}: {labels.grad_outputs} does not fit {labels.outputs}.", None)


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
    labels: Labels,
    *,
    batched: bool = False,
    primals: Sequence[Any] | None = None,
) -> tuple[Tensor | None, ...]:
    """Validates the cotangents given to a pullback against the function's output pytree.

    Shared by ``torch.func.vjp`` pullbacks inside :func:`checked` and by
    :func:`torch_vjp.vjp`'s ``vjp_fn``. ``labels`` name the outputs ``outputs[i]``; for an
    output that is a single tensor, it is called ``out``. ``primals`` (the pytree of primals)
    lets a message recognise a primal's shape passed by mistake.

    Returns:
        The flat tuple of cotangents, aligned with the output's tensor leaves.

    Raises:
        GradOutputsError: the structure or a leaf does not fit.
    """
    from torch.utils._pytree import tree_leaves

    check_tree_structure(out, cotangents, call=labels.call, name=labels.grad_outputs)
    flat_out = tuple(tree_leaves(out))
    flat_cot = tuple(tree_leaves(cotangents))
    if not all(isinstance(t, Tensor) and not t.is_nested for t in flat_out):
        return flat_cot
    if isinstance(out, Tensor):
        labels = _single(labels)
    return normalize_grad_outputs(
        flat_out,
        flat_cot,
        labels,
        is_grads_batched=batched,
        inputs=None if primals is None else tuple(tree_leaves(primals)),
    )


_SINGLE: dict[int, tuple[Labels, Labels]] = {}


def _single(labels: Labels) -> Labels:
    """``labels`` for a function whose output is one tensor: ``out``, not indexed."""
    hit = _SINGLE.get(id(labels))
    if hit is None or hit[0] is not labels:
        single = labels.replace(outputs="out", indexed=False)
        hit = _SINGLE[id(labels)] = (labels, single)
    return hit[1]


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
    labels: Labels,
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
        k = _known_batch_size(gos, outputs)
        want = f"(K, {', '.join(str(d) for d in oshape)})" if oshape else "(K,)"
        if k is not None:  # K known from the entries that do carry a batch dimension
            want += f" with K = {k}, as in the other {labels.grad_outputs}"
        else:
            want += ", K being the number of products"
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
    labels: Labels,
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
    extra_leading = go.dim() == out.dim() + 1 and gshape[1:] == oshape
    if out.numel() == 1 and go.numel() > 1 and (out.dim() == 0 or not extra_leading):
        if out.dim() == 0:
            what, one = f"{o} is a 0-d scalar (shape ())", "a 0-d tensor such as torch.tensor(1.0)"
        else:
            what = f"{o} has shape {shape_str(oshape)}: a single element"
            one = f"a tensor of shape {shape_str(oshape)} such as torch.ones_like({o})"
        return (
            f"{what}, so dL/d {o} is a single number, not {go.numel()}. Pass {one}, or leave "
            f"it None (torch uses 1). If the {go.numel()} numbers are weights for "
            f"{go.numel()} separate outputs, differentiate the vector of those outputs (before "
            f"any .sum()) with this as its {labels.grad_outputs}; if they are {go.numel()} "
            f"separate vectors, {labels.batch_hint}."
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
        if oshape[0] == 1:
            return (
                f"{g} lacks the leading dimension of size 1 that {o} has: pass "
                f"{g}.unsqueeze(0)."
            )
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
    labels: Labels,
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
    labels: Labels, i: int, out: Tensor, inputs: Sequence[Tensor] | None
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
    labels: Labels, i: int, out: Tensor, gos: Sequence[Any], outputs: Sequence[Tensor]
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


def _implicit_dtype_message(labels: Labels, i: int, out: Tensor) -> str:
    o, g = labels.out(i), labels.go(i)
    return (
        f"{labels.call}: {o} is a scalar of dtype {out.dtype}, and no {g} was given.\n"
        f"  torch creates the starting gradient 1 only for real floating-point scalars. Pass "
        f"{g} explicitly, e.g. torch.ones_like({o}), or differentiate a real function of "
        f"{o} (for a complex output, its .abs() or .real)."
    )


def _no_grad_message(labels: Labels, i: int, out: Tensor) -> str:
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


def _type_message(labels: Labels, i: int, out: Tensor, go: Any) -> str:
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


def _not_a_sequence_message(labels: Labels, go: Any, outputs: Sequence[Tensor]) -> str:
    return (
        f"{labels.call}: {labels.grad_outputs} is a {type(go).__name__}, but it must be a "
        f"Tensor, a list or tuple of Tensors (None for scalar outputs), or None.\n"
        f"  It holds one vector dL/d output per entry of {labels.outputs}, each with that "
        f"output's shape. Fix: pass a tensor, e.g. torch.full_like(output, value) for a "
        f"constant."
    )


def _count_message(
    labels: Labels, outputs: Sequence[Tensor], gos: Sequence[Any], given: Any
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


def _batch_size_message(labels: Labels, gos: Sequence[Any]) -> str:
    sizes = ", ".join(
        f"{labels.go(j)}: {int(g.shape[0])}"
        for j, g in enumerate(gos)
        if isinstance(g, Tensor) and g.dim() > 0
    )
    return (
        f"{labels.call}: with {labels.batch_flag}=True the {labels.grad_outputs} have "
        f"different batch sizes ({sizes}).\n"
        f"  The leading dimension K is the number of vector-Jacobian products computed at "
        f"once, so it must be the same for every entry of {labels.grad_outputs}. Fix: give "
        f"each the same K, e.g. by .expand(K, ...) of a shared vector."
    )


def _empty_batch_message(labels: Labels, i: int, go: Tensor) -> str:
    g = labels.go(i)
    return (
        f"{labels.call}: {g} has shape {shape_str(go.shape)}: a batch of K = 0 vectors, and "
        f"{labels.batch_flag}=True.\n"
        f"  With {labels.batch_flag}=True, the leading dimension K of every "
        f"{labels.grad_outputs} entry is the number of {labels.product}s computed at once; "
        f"torch needs at least one. Fix: skip the call when there is nothing to compute "
        f"(the result would be empty), or pass K >= 1 vectors."
    )


def _integer_tangent_message(labels: Labels, i: int, out: Tensor, go: Tensor) -> str:
    o, g = labels.out(i), labels.go(i)
    return (
        f"{labels.call}: {g} has dtype {go.dtype}, but {o} has dtype {out.dtype}.\n"
        f"  {labels.meaning(i)}: a small change of a floating-point tensor, so it must be "
        f"floating point too (torch.func refuses integer and boolean tangents). Fix: pass "
        f"{g}.to({out.dtype})."
    )


def _complex_message(labels: Labels, i: int, out: Tensor, go: Tensor) -> str:
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


def _cast_message(labels: Labels, i: int, out: Tensor, go: Tensor) -> str:
    o, g = labels.out(i), labels.go(i)
    if go.dtype == torch.bool:
        what = "boolean"
    elif not (go.dtype.is_floating_point or go.dtype.is_complex):
        what = "integer"
    else:
        what = str(go.dtype)
    msg = (
        f"{labels.call}: {g} has dtype {go.dtype} but {o} has dtype {out.dtype}; torch casts "
        f"the {what} {labels.grad_outputs} to {out.dtype} silently. Pass {g}.to({out.dtype}) "
        f"to make the cast explicit"
    )
    if go.dtype.is_floating_point and go.dtype.itemsize > out.dtype.itemsize:
        # only a wider floating-point dtype is precision the caller may have wanted
        return msg + f", or compute {o} in {go.dtype} if you need that precision."
    return msg + "."


def _layout_message(labels: Labels, i: int, out: Tensor, go: Tensor) -> str:
    o, g = labels.out(i), labels.go(i)
    return (
        f"{labels.call}: {g} has layout {go.layout}, but {o} has layout {out.layout}.\n"
        f"  torch's engine takes a vector of the output's own layout, or a sparse COO one "
        f"(torch.sparse_coo) for any output. Fix: pass {g}.to_dense()"
        + (" or {g}.to_sparse()." if out.layout is torch.strided else ".")
    ).replace("{g}", g)


def _device_message(labels: Labels, i: int, out: Tensor, go: Tensor) -> str:
    o, g = labels.out(i), labels.go(i)
    return (
        f"{labels.call}: {g} is on device {go.device}, but {o} is on {out.device}.\n"
        f"  {labels.meaning(i)}, consumed where {o}'s graph runs, so it must be on "
        f"{out.device}. Fix: pass {g}.to({o}.device)."
    )


# ---------------------------------------------------------------------------------------
# How each call site names things (one object each, made once).
# ---------------------------------------------------------------------------------------

#: ``torch_vjp.grad`` and ``torch.autograd.grad`` (checked).
GRAD = Labels("torch_vjp.grad")
#: ``torch_vjp.backward`` and ``torch.autograd.backward`` (checked).
BACKWARD = Labels(
    "torch_vjp.backward", "tensors", "grad_tensors",
    batch_hint="use torch_vjp.grad(..., is_grads_batched=True): backward has no batched form",
)
#: ``Tensor.backward(gradient)`` (checked).
TENSOR_BACKWARD = Labels(
    "y.backward(gradient)", "y", "gradient", indexed=False,
    batch_hint="use torch_vjp.grad(y, x, gradient, is_grads_batched=True): backward has no "
    "batched form",
)
#: ``torch_vjp.check_grad_outputs``.
CHECK = GRAD.replace(call="torch_vjp.check_grad_outputs")
#: The pullback of ``torch.func.vjp`` (checked): outputs that do not depend on the primals
#: are ignored, as torch.func ignores them.
PULLBACK = Labels(
    "torch.func.vjp: vjp_fn(cotangents)", "outputs", "cotangents", inputs="primals",
    batch_hint="call vjp_fn(cotangents, batched=True) of torch_vjp.vjp", batch_flag="batched",
    require_grad=False,
)
#: ``vjp_fn`` of ``torch_vjp.vjp``: torch_vjp's own wording.
VJP = PULLBACK.replace(call="torch_vjp.vjp: vjp_fn", torch_first=False, empty_batch_ok=True)
#: The tangents of ``torch_vjp.jvp``.
TANGENTS = Labels(
    "torch_vjp.jvp", "primals", "tangents", role="tangents", require_grad=False,
    allow_none=False, batch_hint="pass batched=True", batch_flag="batched", torch_first=False,
    empty_batch_ok=True,
)
