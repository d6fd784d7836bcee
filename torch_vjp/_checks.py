"""The one checker for ``grad_outputs``, ``grad_tensors``, ``gradient``, cotangents and tangents.

Every public entry point that takes "the vector" of a vector-Jacobian (or Jacobian-vector)
product validates it here: :func:`torch_vjp.grad`, :func:`torch_vjp.backward`,
``Tensor.backward`` and ``torch.func.vjp`` pullbacks inside :func:`torch_vjp.checked`, and the
cotangents and tangents of :func:`torch_vjp.vjp` / :func:`torch_vjp.jvp`.

NOTE [fast path, slow message]
The validation that runs on every call is a tight loop of attribute comparisons (shape,
dtype, device, requires_grad): it must cost less than the Python-level checks torch itself
runs, because ``torch_vjp.grad`` replaces them (see ``_drop_ins._grad``). Only once a
mismatch is found do we spend time on the message: guessing the mistake, walking the graph
for leaf shapes, and so on. The rule for what is accepted is torch's own: whatever
``torch.autograd.grad`` accepts we accept (warning where torch silently casts or ignores),
whatever it rejects for a grad_outputs reason we reject with a better message.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from torch_vjp._check_messages import (
    batch_size_message,
    batched_none_message,
    cast_message,
    complex_message,
    count_message,
    check_tree_structure,
    device_message,
    empty_batch_message,
    extra_message,
    implicit_dtype_message,
    integer_tangent_message,
    layout_message,
    mapping_message,
    missing_message,
    no_grad_message,
    not_a_sequence_message,
    STAND_IN_NODE,
    shape_message,
    type_message,
    warn_ignored_cotangents,
)
from torch_vjp._check_labels import Labels, keyed, single
from torch_vjp._shape_messages import count_hint
from torch_vjp._errors import (
    GradOutputsError,
    GradOutputsIndexError,
    GradOutputsTypeError,
    GradOutputsValueError,
    GradOutputsWarning,
    torch_first,
    user_stacklevel,
    with_article,
)

__all__ = [
    "as_entries",
    "normalize_grad_outputs",
    "check_tree_structure",
    "check_cotangents",
    "integer_grad_dtype",
]


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
    if isinstance(grad_outputs, Mapping):
        # (torch reads a dict as its keys: a key that is no gradient is named as one)
        keys = tuple(grad_outputs)
        for i, key in enumerate(keys[:len(outputs)]):
            if key is not None and not isinstance(key, Tensor):
                raise _error(GradOutputsTypeError, labels, mapping_message(labels, i, key),
                             f"gradients can be either Tensors or None, but got "
                             f"{type(key).__name__}")
        return keys
    try:
        return tuple(grad_outputs)
    except TypeError as err:
        raise _error(
            GradOutputsTypeError, labels, not_a_sequence_message(labels, grad_outputs, outputs),
            str(err),
        ) from None


def _real_tangent_of_complex(labels: Labels, go: Tensor, out: Tensor) -> bool:
    """A real tangent for a complex primal: the complex direction with zero imaginary part,
    which torch.func.jvp takes (and torch_vjp.jvp casts, exactly)."""
    return labels.role == "tangents" and out.dtype.is_complex and go.dtype.is_floating_point


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
            output that does not require grad; the first mistake in the order of NOTE [the
            order of mistakes], with torch's sentence first where the call stands in for
            torch's.
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
                    go = _implicit_grad(out)
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
                (go.dtype.is_complex != out.dtype.is_complex
                 and not _real_tangent_of_complex(labels, go, out))
                or (labels.role == "tangents" and not go.dtype.is_floating_point)
                or _kept_integer(labels, go, out)
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
        if labels.require_grad and outputs[i].grad_fn is None and integer_grad_dtype(
                outputs[i]):
            raise _kept_integer_error(labels, i, outputs[i], go)
        # (a vector of its output's dtype is cast only where torch's engine starts from a
        # leaf: to its grad_dtype, which may differ)
        if go is None or (go.dtype == outputs[i].dtype
                          and (outputs[i].grad_fn is not None or not labels.require_grad)):
            continue
        if (_real_tangent_of_complex(labels, go, outputs[i])
                and 2 * go.dtype.itemsize <= outputs[i].dtype.itemsize):
            continue  # (a real tangent of a complex primal warns only where the cast rounds
            # it: float64 to complex64)
        to = _cast_target(outputs[i], go)
        if to is not None and to != go.dtype and (labels.role == "tangents"
                                                  or not _exact_cast(go.dtype, to)):
            warnings.warn(
                cast_message(labels, i, outputs[i], go, to),
                GradOutputsWarning,
                stacklevel=user_stacklevel(),
            )
    if m > n:
        warnings.warn(extra_message(labels, m, n), GradOutputsWarning,
                      stacklevel=user_stacklevel())
    return tuple(result)


def _kept_integer(labels: Labels, go: Tensor, out: Tensor) -> bool:
    """Whether ``go`` (of another dtype than ``out``'s) is an integer or boolean vector for a
    leaf whose ``grad_dtype`` is None (or the stand-in of such a leaf's GradientEdge): torch
    keeps that leaf's gradient in the vector's own dtype, casting nothing, and its engine
    then fails on an integer gradient with an internal assert."""
    return (labels.require_grad and out.grad_fn is None and out.requires_grad
            and not (go.dtype.is_floating_point or go.dtype.is_complex)
            and getattr(out, "grad_dtype", out.dtype) is None)


def integer_grad_dtype(out: Tensor) -> bool:
    """Whether ``out`` is a leaf whose ``grad_dtype`` is an integer or boolean dtype (torch
    lets one be set): torch casts every gradient of it to that dtype, and its engine then
    fails with an internal assert, whatever the vector."""
    to = getattr(out, "grad_dtype", None) if out.requires_grad else None
    return to is not None and not (to.is_floating_point or to.is_complex)


def _kept_integer_error(labels: Labels, i: int, out: Tensor, go: Tensor | None) -> BaseException:
    """The error for :func:`_kept_integer` and :func:`integer_grad_dtype`, raised as it is:
    torch's engine meets the call with an internal assert, a bug report, not a verdict
    (``unjudged``)."""
    g, o = labels.go(i), labels.out(i)
    if integer_grad_dtype(out):
        return _unjudged(
            f"{labels.call}: {o} is a leaf whose grad_dtype is {out.grad_dtype}: torch casts "
            f"its gradient to that dtype, and an integer or boolean tensor cannot hold a "
            f"gradient (torch's engine fails on it with an internal assert).\n  Fix: set "
            f"{o}.grad_dtype to a floating-point dtype (its own, {out.dtype}), or to None to "
            f"keep each gradient in the dtype it comes in, before the backward pass.")
    assert go is not None
    kind = with_article("boolean" if go.dtype == torch.bool else "integer")
    return _unjudged(
        f"{labels.call}: {g} has dtype {go.dtype}, but {o} is a leaf whose grad_dtype is "
        f"None, so torch keeps its gradient in the dtype of the vector it receives, without "
        f"a cast; and {kind} tensor cannot hold a gradient (torch's engine fails on it "
        f"with an internal assert).\n  {g} is dL/d {o}: real numbers, like {o} itself. Fix: "
        f"pass {g}.to({out.dtype}) (or to the floating-point dtype the gradient should "
        f"have), or set {o}.grad_dtype back to {out.dtype} to have torch cast it.")


def _unjudged(message: str) -> GradOutputsError:
    """A GradOutputsError raised as it is, not judged by torch first (``_judged`` in
    :mod:`torch_vjp._drop_ins`): torch's engine meets its call with an internal assert."""
    err = GradOutputsError(message)
    err.unjudged = True  # type: ignore[attr-defined]
    return err


def _cast_target(out: Tensor, go: Tensor) -> torch.dtype | None:
    """The dtype torch casts ``go`` (of another dtype than ``out``'s) to: ``out``'s, except
    where ``out`` is a leaf (or the stand-in of a leaf's GradientEdge), whose gradient torch
    casts to its ``grad_dtype``; None where that keeps ``go`` as it is (``go``'s dtype, or
    None: any floating-point dtype)."""
    if out.grad_fn is not None or not out.requires_grad:
        return out.dtype
    target = getattr(out, "grad_dtype", out.dtype)
    if target is None:
        keeps = go.dtype.is_floating_point and out.dtype.is_floating_point
        return None if keeps else out.dtype
    return None if go.dtype == target else target


def _exact_cast(frm: torch.dtype, to: torch.dtype) -> bool:
    """Whether casting a floating-point or complex vector of dtype ``frm`` to ``to`` keeps
    every value (float32 to float64, float16 to float32, a real dtype to a complex one with
    such real parts). See NOTE [which casts are told]."""
    if not (frm.is_floating_point or frm.is_complex) or (frm.is_complex and not to.is_complex):
        return False
    a = torch.finfo(frm.to_real() if frm.is_complex else frm)
    b = torch.finfo(to.to_real() if to.is_complex else to)
    return b.eps <= a.eps and b.max >= a.max and b.smallest_normal <= a.smallest_normal


# NOTE [which casts are told]
# torch casts a vector of another dtype to its output's (or a leaf's grad_dtype) silently.
# Checked mode changes nothing for valid code, so it warns only where the cast can hide a
# mistake: where it rounds (a float64 vector for a float32 output loses the user's precision)
# or where the vector is an integer or boolean one. A cast that keeps every value (a float32
# vector for a float64 output: torch.ones(3)) gives the explicit cast's result: not told.
# torch_vjp.jvp's tangents keep their warning (torch.func.jvp does not cast at all).


def _implicit_grad(out: Tensor) -> Tensor:
    """The gradient torch makes for a scalar output given None: ``ones_like(output)``. For
    the stand-in of a GradientEdge output (the checker's own tensor, which torch's call never
    sees: it makes its own ``torch.ones``), one made with dispatch modes out of the way, so
    that a ``TorchDispatchMode`` of the caller (a logger, ``FakeTensorMode``) sees nothing
    of it."""
    if getattr(out, STAND_IN_NODE, None) is None:
        return torch.ones_like(out, memory_format=torch.preserve_format)
    with torch._C._DisableTorchDispatch():
        return torch.ones_like(out, memory_format=torch.preserve_format)


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
             torch.sparse_bsc: "SparseBsc", torch._mkldnn: "Mkldnn"}  # type: ignore[attr-defined]
    jagged = getattr(torch, "jagged", None)
    if layout is jagged:
        return "Jagged"
    return names.get(layout, str(layout))


def _size(shape: Sequence[int]) -> str:
    """A shape as torch prints it in its own messages: ``torch.Size([4, 4])``."""
    return str(torch.Size(shape))


def _more_to_fix(labels: Labels, i: int, out: Tensor, go: Tensor) -> Any:
    """``more(told)``: the mistakes of ``go`` that come after ``told`` (``"shape"``,
    ``"dtype"``, ``"device"``) in NOTE [the order of mistakes], as a line to add to the
    explanation of the one told ("" where there are none)."""
    g, o = labels.go(i), labels.out(i)
    found: list[tuple[str, str]] = []
    if go.dtype.is_complex != out.dtype.is_complex and not _real_tangent_of_complex(
            labels, go, out):
        fix = ("a real output takes a real vector: .real" if not out.dtype.is_complex else
               f"a complex output takes a complex vector: .to({out.dtype})")
        found.append(("dtype", f"it has dtype {go.dtype}, but {o} has dtype {out.dtype} "
                               f"({fix})"))
    if go.device != out.device and go.dim() != 0:
        found.append(("device", f"it is on {go.device}, but {o} is on {out.device} "
                                f"(.to({o}.device))"))
    if go.layout is not out.layout and not _layout_ok(go, out):
        found.append(("layout", f"it has layout {go.layout}, but {o} has layout {out.layout} "
                                f"(.to_dense())"))
    order = ("shape", "dtype", "device", "layout")

    def more(told: str) -> str:
        rest = [said for kind, said in found if order.index(kind) > order.index(told)]
        return f"\n  {g} has more to fix: {'; '.join(rest)}." if rest else ""

    return more


def _diagnose(
    outputs: Sequence[Tensor],
    gos: tuple[Any, ...],
    labels: Labels,
    batched: bool,
    inputs: Sequence[Tensor] | None,
    given: Any,
) -> BaseException:
    """The mistake to tell, as the exception to raise.

    NOTE [the order of mistakes]
    When a call has several mistakes, the one told is (torch's own order differs: it checks
    every vector's shape and dtype before it counts them, and the devices last):

    1. the number of vectors, where there are fewer than outputs: entry i then need not be
       the vector of outputs[i], and comparing the two misleads (a missing first vector
       reads as every later one having a wrong shape);
    2. the outputs in index order, the first whose vector has any mistake: None where a
       vector is needed, not a tensor, its shape (and batch dimension), its dtype (complex
       against real, an integer tangent), its device, its layout; every other mistake of
       that same vector is told with it (:func:`_more_to_fix`), so that one fix fixes it;
    3. with ``is_grads_batched``, the batch sizes;
    4. the outputs that do not require grad;
    5. an integer vector for a leaf that keeps its gradient's dtype.

    Each is worded with torch's own sentence for it, filled in with the right index and
    shapes (NOTE [torch's sentence first]).
    """
    n, m = len(outputs), len(gos)
    if m < n:
        return _error(GradOutputsError, labels,
                      count_message(labels, outputs, gos, given)
                      + count_hint(labels, outputs, gos, batched),
                      f"got {n} tensors and {m} gradients")
    for i in range(n):
        out, go = outputs[i], gos[i]
        if go is None:
            if not labels.allow_none:
                return _error(GradOutputsTypeError, labels, type_message(labels, i, out, go),
                              None)
            if not out.requires_grad:
                continue
            if batched:
                return _error(GradOutputsError, labels,
                              batched_none_message(labels, i, out, gos, outputs), None)
            if out.numel() != 1:
                return _error(GradOutputsError, labels,
                              missing_message(labels, i, out, inputs),
                              "grad can be implicitly created only for scalar outputs")
            if not out.dtype.is_floating_point:
                return _error(GradOutputsError, labels, implicit_dtype_message(labels, i, out),
                              "grad can be implicitly created only for real scalar outputs "
                              f"but got {out.dtype}")
            continue
        if not isinstance(go, Tensor):
            return _error(GradOutputsTypeError, labels, type_message(labels, i, out, go),
                          f"gradients can be either Tensors or None, but got "
                          f"{type(go).__name__}")
        more = _more_to_fix(labels, i, out, go)
        if batched:
            if go.dim() == 0:
                return _error(
                    GradOutputsIndexError, labels,
                    shape_message(labels, i, out, go, outputs, gos, True, inputs) + more("shape"),
                    "invalid index of a 0-dim tensor. Use `tensor.item()` in Python or "
                    "`tensor.item<T>()` in C++ to convert a 0-dim tensor to a number",
                )
            if go.shape[0] == 0 and not labels.empty_batch_ok:
                return _error(GradOutputsIndexError, labels,
                              empty_batch_message(labels, i, go) + more("shape"),
                              "index 0 is out of bounds for dimension 0 with size 0")
            if go.shape[1:] != out.shape:
                return _error(
                    GradOutputsError, labels,
                    shape_message(labels, i, out, go, outputs, gos, True, inputs) + more("shape"),
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
                shape_message(labels, i, out, go, outputs, gos, False, inputs) + more("shape"),
                f"Mismatch in shape: grad_output[{i}] has a shape of {_size(go.shape)} and "
                f"output[{i}] has a shape of {_size(out.shape)}.",
            )
        if labels.role == "tangents" and not (go.dtype.is_floating_point or go.dtype.is_complex):
            return _error(
                GradOutputsValueError, labels,
                integer_tangent_message(labels, i, out, go) + more("dtype"),
                f"Expected tangent to be floating point or complex, but got: {go.dtype}",
            )
        if go.dtype.is_complex != out.dtype.is_complex and not _real_tangent_of_complex(
                labels, go, out):
            return _error(
                GradOutputsError, labels, complex_message(labels, i, out, go) + more("dtype"),
                "For complex Tensors, both grad_output and output are required to have the "
                f"same dtype. Mismatch in dtype: grad_output[{i}] has a dtype of {go.dtype} "
                f"and output[{i}] has a dtype of {out.dtype}.",
            )
        if go.device != out.device and go.dim() != 0:
            return _error(GradOutputsError, labels,
                          device_message(labels, i, out, go) + more("device"),
                          f"invalid gradient at index {i} - expected device {out.device} but "
                          f"got {go.device}")
        if go.layout is not out.layout and not _layout_ok(go, out):
            return _error(GradOutputsError, labels, layout_message(labels, i, out, go),
                          f"invalid gradient at index {i} - expected layout "
                          f"{_layout_name(out.layout)} but got {_layout_name(go.layout)}")
    if batched:
        sizes = [int(g.shape[0]) for g in gos[:n] if isinstance(g, Tensor)]
        if len(set(sizes)) > 1:
            return _error(
                GradOutputsValueError, labels, batch_size_message(labels, gos[:n]),
                f"vmap: Expected all tensors to have the same size in the mapped dimension, "
                f"got sizes {sizes} for the mapped dimension",
            )
    if labels.require_grad:
        for i, out in enumerate(outputs):
            if not out.requires_grad:
                return _error(GradOutputsError, labels, no_grad_message(labels, i, out, inputs),
                              f"element {i} of tensors does not require grad and does not "
                              f"have a grad_fn")
    for i in range(n):
        out, go = outputs[i], gos[i]
        if isinstance(go, Tensor) and go.dtype != out.dtype and _kept_integer(labels, go, out):
            return _kept_integer_error(labels, i, out, go)
    # Nothing found in torch's order: the fast path saw something this pass does not, which
    # is a bug here; say so rather than reject silently.
    return _error(GradOutputsError, labels,
                  f"{labels.call}: {labels.grad_outputs} does not fit {labels.outputs}.", None)


def check_cotangents(
    out: Any,
    cotangents: Any,
    labels: Labels,
    *,
    batched: bool = False,
    primals: Sequence[Any] | None = None,
    connected: Sequence[bool] | None = None,
    ignores_unconnected: bool = False,
) -> tuple[Tensor | None, ...]:
    """Validates the cotangents given to a pullback against the function's output pytree.

    Shared by ``torch.func.vjp`` pullbacks inside :func:`checked` and by
    :func:`torch_vjp.vjp`'s ``vjp_fn``. ``labels`` name the outputs ``outputs[i]``; for an
    output that is a single tensor, it is called ``out``. ``primals`` (the pytree of primals)
    lets a message recognise a primal's shape passed by mistake. ``connected`` (per flat
    output, where known): whether it depends on the primals; ``None`` is the cotangent of
    one that does not, as torch.func takes it (it is not differentiated).
    ``ignores_unconnected``: as torch.func's pullback, ignore any cotangent of such an output
    (it is not checked; where it does not fit, a :class:`GradOutputsWarning` says so).

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
    # (a dict's entries named by key, nested ones by their place)
    labels = keyed(single(labels) if isinstance(out, Tensor) else labels, out, primals)
    inputs = None if primals is None else tuple(tree_leaves(primals))
    # (the output a pullback is given does not require grad, but the one it differentiates
    # does: None stands for 1, as torch makes it, for a real scalar only, and never for K
    # stacked vectors)
    for i, (o, c) in enumerate(zip(flat_out, flat_cot)):
        if c is not None or (connected is not None and not connected[i]):
            continue
        if batched:
            raise _error(GradOutputsError, labels,
                         batched_none_message(labels, i, o, flat_cot, flat_out), None)
        if o.numel() != 1 or not o.dtype.is_floating_point:
            sentence = ("grad can be implicitly created only for scalar outputs"
                        if o.numel() != 1 else
                        "grad can be implicitly created only for real scalar outputs "
                        f"but got {o.dtype}")
            message = (missing_message(labels, i, o, inputs) if o.numel() != 1
                       else implicit_dtype_message(labels, i, o))
            raise _error(GradOutputsError, labels, message, sentence)
    # (the None of an output that does not depend on the primals stands for no vector, as
    # does anything torch ignores there: the checker is shown zeros of its shape, and the
    # None comes back)
    absent = [connected is not None and not connected[i] and (c is None or ignores_unconnected)
              for i, c in enumerate(flat_cot)]
    shown = flat_cot
    if any(absent):
        warn_ignored_cotangents(labels, flat_out, flat_cot, absent, batched, inputs)
        k = next((c.shape[0] for c, gone in zip(flat_cot, absent)
                  if isinstance(c, Tensor) and c.dim() and not gone), 0)
        shown = tuple(
            (o.new_zeros((k, *o.shape)) if batched else torch.zeros_like(o)) if gone else c
            for o, c, gone in zip(flat_out, flat_cot, absent))
    normalized = normalize_grad_outputs(
        flat_out,
        shown,
        labels,
        is_grads_batched=batched,
        inputs=inputs,
    )
    if any(absent):
        normalized = tuple(None if gone else v for v, gone in zip(normalized, absent))
    if any(c is None for c in flat_cot):
        normalized = tuple(
            torch.ones_like(o) if c is None and (connected is None or connected[i]) else v
            for i, (o, c, v) in enumerate(zip(flat_out, flat_cot, normalized))
        )
    return normalized
