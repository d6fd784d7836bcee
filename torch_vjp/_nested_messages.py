"""The notes on torch's refusals of the vectors for a nested output, which the
``grad_outputs`` checker does not read (``torch_vjp._drop_ins._unchecked`` runs torch's own
call and adds them): a vector of another shape (a jagged tensor compares its ragged dimension
by offsets, a strided one tensor by tensor), of another dtype, or none at all.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from torch_vjp._check_messages import complex_message
from torch_vjp._checks import as_entries
from torch_vjp._errors import a_type, shape_str

if TYPE_CHECKING:
    from torch_vjp._check_labels import Labels

__all__ = ["jagged_message", "nested_missing_message", "nested_note", "strided_nested_message"]

#: torch's sentence for a vector whose shape is not its output's (``_make_grads``).
_MISMATCH = re.compile(r"Mismatch in shape: grad_output\[(\d+)\]")
#: torch's sentence for a dense vector of a nested output of the strided layout.
_NOT_NESTED = "Expected both self and other to be nested tensors"
#: torch's sentence for an output of more than one element given no vector.
_IMPLICIT = "grad can be implicitly created only for scalar outputs"
#: torch's sentence for a complex vector of a real output, or a real one of a complex output.
_DTYPE = re.compile(r"^For complex Tensors, .* Mismatch in dtype: grad_output\[(\d+)\]")


def nested_note(err: RuntimeError, labels: Labels, outs: tuple[Any, ...],
                 given: Any) -> str | None:
    """The explanation of torch's refusal ``err`` of the vectors ``given`` for nested
    ``outs`` (``_drop_ins._unchecked``): a vector of another shape or dtype, or none at all; None
    for any other error."""
    # (what torch read, where reading it again is harmless: a generator is spent)
    entries = (as_entries(given, labels, outs) if isinstance(given, (Tensor, tuple, list))
               else (None,) * len(outs) if given is None else None)

    def nested(i: int) -> Tensor | None:
        out = outs[i] if 0 <= i < len(outs) else None
        return out if isinstance(out, Tensor) and out.is_nested else None

    def vector(i: int) -> Any:
        return entries[i] if entries is not None and i < len(entries) else None

    text = str(err)
    if text.startswith(_IMPLICIT):
        i = next((j for j in range(len(outs)) if nested(j) is not None and vector(j) is None),
                 -1)
        out = nested(i)
        return None if out is None else nested_missing_message(labels, i, out)
    said = _DTYPE.search(text)
    if said:
        out, go = nested(int(said.group(1))), vector(int(said.group(1)))
        return (complex_message(labels, int(said.group(1)), out, go)
                if out is not None and isinstance(go, Tensor) else None)
    said = _MISMATCH.match(text)
    i = int(said.group(1)) if said else -1
    if i < 0 and text.startswith(_NOT_NESTED):
        # (torch.is_same_size, for the first nested output whose vector is not nested)
        i = next((j for j in range(len(outs)) if nested(j) is not None
                  and isinstance(vector(j), Tensor) and not vector(j).is_nested), -1)
    out = nested(i)
    if out is None:
        return None
    return (jagged_message(labels, i, out, vector(i)) if out.layout is not torch.strided
            else strided_nested_message(labels, i, out, vector(i)))


def jagged_message(labels: Labels, i: int, out: Tensor, go: Any) -> str:
    """The note on torch's shape refusal of ``go`` for a jagged nested output ``out``: torch
    compares a ragged dimension by the offsets it was made from, not by its lengths."""
    o, g = labels.out(i), labels.go(i)
    jagged = isinstance(go, Tensor) and go.is_nested and go.layout is out.layout
    if jagged and go.dim() == out.dim():
        ragged = getattr(out, "_ragged_idx", 1)
        mine, theirs = _lengths(out), _lengths(go)
        if mine == theirs and all(a == b for d, (a, b) in enumerate(zip(go.shape, out.shape))
                                  if d != ragged):
            what = f"{g} has {o}'s lengths, {mine}, but is not built on {o}'s offsets"
        else:
            what = (f"{g} is a jagged nested tensor of shape {_nested_shape(go, theirs)}, "
                    f"{o} one of shape {_nested_shape(out, mine)}")
    elif isinstance(go, Tensor):
        what = (f"{o} is a jagged nested tensor, and {g} "
                + ("is a nested tensor of another layout" if go.is_nested
                   else f"a dense one of shape {shape_str(go.shape)}"))
    else:
        what = f"{g} does not fit {o}, a jagged nested tensor"
    return (
        f"{labels.call}: {what}. {labels.meaning(i)}: it must have {o}'s shape, and torch "
        f"compares a ragged dimension (j1, j2, ...) by the offsets tensor it was made from, "
        f"not by its lengths, so a nested tensor built anew gets a ragged dimension of its "
        f"own.\n  Fix: build {g} on {o}'s offsets: torch.nested.nested_tensor_from_jagged("
        f"values, {o}.offsets()), values of shape {o}.values().shape; or "
        f"torch.ones_like({o}) for a vector of ones."
    )


def nested_missing_message(labels: Labels, i: int, out: Tensor) -> str:
    """The note on torch's "grad can be implicitly created only for scalar outputs" for a
    nested output ``out`` given no vector: a nested tensor is never a scalar."""
    o, g = labels.out(i), labels.go(i)
    kind = "jagged" if out.layout is not torch.strided else "nested"
    return (
        f"{labels.call}: {o} is a {kind} nested tensor, and no {g} was given. torch can start "
        f"a backward pass without {labels.grad_outputs} only from a scalar output (it uses "
        f"dL/d output = 1), and a nested tensor is never one. {labels.meaning(i)}: one number "
        f"per element of {o}, so a nested tensor of {o}'s structure.\n"
        f"  Fix: to differentiate the sum of {o}'s elements, pass torch.ones_like({o}) as "
        f"{g} (it has {o}'s structure), or reduce {o} to a scalar first "
        f"({o}.values().sum() for a jagged tensor)."
    )


def strided_nested_message(labels: Labels, i: int, out: Tensor, go: Any) -> str:
    """The note on torch's shape refusal of ``go`` for a nested output ``out`` of the strided
    layout: torch compares the shapes of the tensors it holds, one by one."""
    o, g = labels.out(i), labels.go(i)

    def parts(t: Tensor) -> str:
        shapes = [shape_str(s) for s in t._nested_tensor_size().tolist()]
        return (f"a nested tensor of {len(shapes)} tensors of shapes "
                + ", ".join(shapes[:8]) + (", ..." if len(shapes) > 8 else ""))

    if isinstance(go, Tensor) and go.is_nested and go.layout is torch.strided:
        what = parts(go)
    elif isinstance(go, Tensor) and go.is_nested:
        what = "a nested tensor of another layout"
    elif isinstance(go, Tensor):
        what = f"a dense tensor of shape {shape_str(go.shape)}"
    else:
        what = f"{a_type(go)}"
    return (
        f"{labels.call}: {o} is {parts(out)}, and {g} is {what}.\n  {labels.meaning(i)}: a "
        f"nested tensor holding one tensor per tensor of {o}, each of its shape. Fix: "
        f"torch.ones_like({o}) for a vector of ones, or torch.nested.nested_tensor of "
        f"tensors of those shapes, in that order."
    )


def _lengths(t: Tensor) -> str:
    """The lengths of a jagged nested tensor's rows, for a message (the first eight)."""
    n = t.offsets().diff().tolist()
    return "(" + ", ".join(str(k) for k in n[:8]) + (", ...)" if len(n) > 8 else ")")


def _nested_shape(t: Tensor, lengths: str) -> str:
    """A jagged nested tensor's shape with its ragged dimension's lengths in place."""
    ragged = getattr(t, "_ragged_idx", 1)
    return "(" + ", ".join(f"lengths {lengths}" if d == ragged else str(int(k))
                           for d, k in enumerate(t.shape)) + ")"
