"""The messages of the ``grad_outputs`` checker (:mod:`torch_vjp._checks`).

Each says: the call; what was got (index, concrete shapes); what was expected and why; one
fix when the mistake is recognisable. They are built only once a mistake is found (NOTE
[fast path, slow message]), so they may take their time: guess the mistake, walk the
graph for the shapes of leaf tensors.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from torch_vjp._errors import (
    GradOutputsError,
    GradOutputsWarning,
    a_type,
    shape_str,
    user_stacklevel,
    with_article,
)
from torch_vjp._shape_messages import (
    STAND_IN_NODE,
    known_batch_size,
    leaf_shapes,
    missing_message,
    shape_message,
)

if TYPE_CHECKING:
    from torch_vjp._check_labels import Labels

__all__ = [
    "describe_tree",
    "check_tree_structure",
    "leaf_shapes",
    "STAND_IN_NODE",
    "output_type_message",
    "shape_message",
    "missing_message",
    "batched_none_message",
    "implicit_dtype_message",
    "no_grad_message",
    "type_message",
    "not_a_sequence_message",
    "count_message",
    "extra_message",
    "batch_size_message",
    "empty_batch_message",
    "integer_tangent_message",
    "complex_message",
    "cast_message",
    "layout_message",
    "device_message",
    "warn_ignored_cotangents",
]


def describe_tree(tree: Any) -> str:
    """A short structural description of a pytree with tensor shapes at the leaves; a
    container of another type than tuple, list or dict (a namedtuple, an OrderedDict) by
    its type's name too, since the pytree structure tells them apart."""
    if isinstance(tree, Tensor):
        return f"Tensor{shape_str(tree.shape)}"
    kind = type(tree)
    if isinstance(tree, tuple):
        fields = getattr(kind, "_fields", None)
        if fields is not None:  # a namedtuple
            inner = ", ".join(f"{k}={describe_tree(v)}" for k, v in zip(fields, tree))
            return f"{kind.__name__}({inner})"
        inner = ", ".join(describe_tree(t) for t in tree)
        body = f"({inner}{',' if len(tree) == 1 else ''})"
        return body if kind is tuple else f"{kind.__name__}{body}"
    if isinstance(tree, list):
        body = "[" + ", ".join(describe_tree(t) for t in tree) + "]"
        return body if kind is list else f"{kind.__name__}({body})"
    if isinstance(tree, dict):
        body = "{" + ", ".join(f"{k!r}: {describe_tree(v)}" for k, v in tree.items()) + "}"
        return body if kind is dict else f"{kind.__name__}({body})"
    if tree is None:
        return "None"
    return type(tree).__name__


#: The attribute of a tensor that stands in for a GradientEdge output (its metadata, for the
#: checker) that holds the edge's node.

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
    # how to build a container of ``expected``'s type from ``name``'s items: a tuple or a
    # list takes them as one iterable, a namedtuple as arguments; another tuple subclass
    # gets no such fix (the builder is never called for it here)
    named = isinstance(expected, tuple) and hasattr(type(expected), "_fields")
    plain = type(expected) in (tuple, list)
    if (isinstance(got, Tensor) and (plain or named)
            and len(expected) == 1 and isinstance(expected[0], Tensor)):
        kind = type(expected).__name__
        fix = (f"Fix: like {against}, {name} must be {with_article(kind)} of one tensor: pass "
               + (f"{kind}({name})." if named
                  else f"({name},)." if kind == "tuple" else f"[{name}]."))
    elif (isinstance(expected, Tensor) and isinstance(got, (tuple, list))
            and len(got) == 1 and isinstance(got[0], Tensor)):
        fix = (f"Fix: like {against}, {name} must be a single tensor, not "
               f"{a_type(got)}: pass {name}[0].")
    elif (isinstance(got, (tuple, list)) and (plain or named)
            and len(got) == len(expected)
            and tree_structure(type(expected)(*got) if named else type(expected)(got)) == want):
        kind = type(expected).__name__
        fix = (f"Fix: like {against}, {name} must be {with_article(kind)}, not "
               f"{a_type(got)}: pass {kind}({'*' if named else ''}{name}).")
    else:
        fix = (f"Fix: build it from {against} itself, e.g. "
               f"torch.utils._pytree.tree_map(torch.ones_like, ...).")
    raise GradOutputsError(
        f"{call}: {name} must have the same structure as {against}, but it does not.\n"
        f"  expected: {describe_tree(expected)}\n"
        f"  got:      {describe_tree(got)}\n"
        f"  {name} holds one vector per tensor of {against}, arranged exactly like it (same "
        f"containers, same keys, same order), each with that tensor's shape. {fix}"
    )

def batched_none_message(
    labels: Labels, i: int, out: Tensor, gos: Sequence[Any], outputs: Sequence[Tensor]
) -> str:
    o, g = labels.out(i), labels.go(i)
    k = known_batch_size(gos, outputs)
    dims = [str(k if k is not None else "K")] + [str(d) for d in out.shape]
    shape = f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"
    kk = k if k is not None else "K"
    if out.numel() == 1 and out.dtype.is_floating_point:
        why = ("for None torch would create a single unbatched 1, which has no batch "
               "dimension to map over")
        fix = (f"pass torch.ones_like({o}).expand({kk}, *{o}.shape) to use dL/d {o} = 1 in "
               f"every product")
    else:
        why = (f"None stands for dL/d output = 1 only for a real scalar output, and {o} has "
               f"shape {shape_str(out.shape)}")
        fix = (f"pass the {kk} vectors, one per product, stacked: a tensor of shape {shape} "
               f"(torch.ones_like({o}).expand({kk}, *{o}.shape) for the sum of {o}'s "
               f"elements in every product)")
    return (
        f"{labels.call}: {g} is None, but {labels.batch_flag}=True.\n"
        f"  With {labels.batch_flag}=True every {labels.grad_outputs} entry stacks K vectors "
        f"dL/d output along a leading batch dimension; {why}. {g} must be a tensor of "
        f"shape {shape}. Fix: {fix}."
    )


def implicit_dtype_message(labels: Labels, i: int, out: Tensor) -> str:
    o, g = labels.out(i), labels.go(i)
    return (
        f"{labels.call}: {o} is a scalar of dtype {out.dtype}, and no {g} was given.\n"
        f"  torch creates the starting gradient 1 only for real floating-point scalars. Pass "
        f"{g} explicitly, e.g. torch.ones_like({o}), or differentiate a real function of "
        f"{o} (for a complex output, its .abs() or .real)."
    )


def output_type_message(labels: Labels, i: int, out: Any, outputs: Any = None) -> str:
    """``out``, entry ``i`` of the outputs, is no tensor. ``outputs``: the outputs as the
    caller passed them, where known (a dict of losses is read by its keys)."""
    o = labels.out(i)
    if isinstance(outputs, Mapping):
        # (torch iterates a dict over its keys: the entry is a key, the fix not .item())
        d, gos = labels.outputs, labels.grad_outputs
        return (
            f"{labels.call}: {d} is {a_type(outputs)}, but it must be a tensor or a sequence "
            f"of tensors: a dict is read by its keys, so {o} is its key {out!r}, not one of "
            f"its values.\n"
            f"  {d} are the outputs y whose vector-Jacobian product is taken (for a training "
            f"step, the loss). Fix: pass the total loss, sum({d}.values()), or the losses "
            f"themselves, list({d}.values()) (with {gos} None, the gradient of their sum; "
            f"any {gos} given in the same order)."
        )
    return (
        f"{labels.call}: {o} is {a_type(out)}, but "
        f"each entry of {labels.outputs} must be a tensor (or a GradientEdge of one).\n"
        f"  {labels.outputs} are the outputs y whose vector-Jacobian product is taken, "
        f"tensors computed from ones that require grad. " + _output_type_fix(labels, o, out)
    )


def _output_type_fix(labels: Labels, o: str, out: Any) -> str:
    """The fix for ``out``, entry ``o`` of the outputs, which is no tensor: it depends on
    what it is (a number is a loss's ``.item()``; a dict or a sequence holds tensors)."""
    if out is None:
        return (f"Fix: leave {o} out of {labels.outputs}, and its entry out of "
                f"{labels.grad_outputs}: None holds nothing to differentiate.")
    if isinstance(out, Mapping):
        return (f"Fix: put the tensors it holds, list({o}.values()), in its place: "
                f"{labels.outputs} is one flat sequence of tensors (and {labels.grad_outputs} "
                f"too, in the same order).")
    if isinstance(out, (list, tuple)):
        return (f"Fix: put the tensors it holds in its place: {labels.outputs} is one flat "
                f"sequence of tensors (and {labels.grad_outputs} too, in the same order).")
    if isinstance(out, numbers.Number):  # (a NumPy scalar too)
        return "Fix: pass the tensor itself (.item() gives a number, which holds no graph)."
    return "Fix: pass the tensor itself."


def no_grad_message(labels: Labels, i: int, out: Tensor,
                    inputs: Sequence[Tensor] | None = None) -> str:
    o = labels.out(i)
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        # the block the call runs in is the likely cause: what it computes records nothing
        fix = (
            f"  grad mode is off where this call runs (torch.no_grad() or "
            f"torch.inference_mode() is active here), so if {o} was computed in the same "
            f"block, autograd recorded nothing for it. Fix: compute {o} with grad mode on, "
            f"outside that block or under torch.enable_grad()"
        )
    elif inputs and all(isinstance(t, Tensor) and t.requires_grad for t in inputs):
        # the inputs are not what is missing: the graph from them to the output is
        one = len(inputs) == 1
        which = labels.inp(0) if one else f"every tensor of {labels.inputs}"
        fix = (
            f"  {which} already requires grad, so if {o} was computed from "
            f"{'it' if one else 'them'}, the graph was cut on the way: under torch.no_grad() "
            f"or torch.inference_mode(), or through a .detach()ed, .item() or copied value. "
            f"Fix: compute {o} with grad mode on, from {'it' if one else 'them'} directly"
        )
    elif inputs and any(isinstance(t, Tensor) and t.requires_grad for t in inputs):
        # some inputs require grad: the others may be what is missing, or the graph from
        # those that do was cut; both are told (not only to create what already is)
        frozen = [k for k, t in enumerate(inputs)
                  if not (isinstance(t, Tensor) and t.requires_grad)]
        names = ", ".join(labels.inp(k) for k in frozen[:4])
        names += ", ..." if len(frozen) > 4 else ""
        fix = (
            f"  {names} {'does' if len(frozen) == 1 else 'do'} not require grad, but the "
            f"other {labels.inputs} do: if {o} was computed from those, the graph was cut on "
            f"the way (torch.no_grad(), torch.inference_mode(), a .detach()ed, .item() or "
            f"copied value). Fix: compute {o} with grad mode on from {labels.inputs} that "
            f"require grad (call .requires_grad_() on {names} first if {o} is computed from "
            f"{'it' if len(frozen) == 1 else 'them'})"
        )
    elif inputs:
        fix = (f"  Fix: create the inputs with requires_grad=True (or call .requires_grad_() "
               f"on them) before computing {o}")
    else:
        # (no inputs named: a loss from parameters that already require grad is as likely)
        fix = (
            f"  If {o} was computed from tensors that require grad (a model's parameters), "
            f"the graph was cut on the way: compute it with grad mode on, not under "
            f"torch.no_grad() or torch.inference_mode() and not from a .detach()ed, .item() "
            f"or copied value. If from none, create the inputs with requires_grad=True (or "
            f"call .requires_grad_() on them) before computing {o}"
        )
    return (
        f"{labels.call}: {o} (shape {shape_str(out.shape)}) does not require grad: it has "
        f"no grad_fn, so there is no graph to differentiate back from it.\n"
        f"  Autograd records a graph only for tensors computed from tensors with "
        f"requires_grad=True, with grad mode on; {o} was computed from none, under "
        f"torch.no_grad(), or after .detach()/.item()/.numpy()/torch.tensor(...).\n"
        + fix
        + (f", or leave {o} out of {labels.outputs}." if o != labels.outputs else ".")
    )


def type_message(labels: Labels, i: int, out: Tensor, go: Any) -> str:
    g, o = labels.go(i), labels.out(i)
    allowed = "a Tensor" if go is None else "a Tensor or None"
    if go is None and labels.role == "tangents":
        return (
            f"{labels.call}: {g} is None, but each entry of {labels.grad_outputs} must be "
            f"{allowed}.\n  {labels.meaning(i)}, a tensor of {o}'s shape "
            f"{shape_str(out.shape)}. Fix: torch.zeros_like({o}) to hold {o} fixed."
        )
    return (
        f"{labels.call}: {g} is {a_type(go)}, but each "
        f"entry of {labels.grad_outputs} must be {allowed}.\n"
        f"  {labels.meaning(i)}, a tensor of {o}'s shape {shape_str(out.shape)}. Fix: "
        f"torch.full_like({o}, value) for a constant, or torch.as_tensor(...) for data."
    )


def mapping_message(labels: Labels, i: int, key: Any) -> str:
    """A dict given as ``grad_outputs``: torch iterates it, so its keys are the entries."""
    first = (
        f"{labels.call}: {labels.grad_outputs} is a dict, and torch reads a dict as the "
        f"sequence of its keys: {labels.go(i)} is its key {key!r}, {a_type(key)}, not a "
        f"gradient.\n"
    )
    if not labels.indexed:  # (Tensor.backward: one tensor)
        return first + (
            f"  {labels.grad_outputs} is dL/d{labels.outputs}, one tensor of "
            f"{labels.outputs}'s shape. Fix: pass that tensor itself, not a dict holding it."
        )
    return first + (
        f"  {labels.grad_outputs} holds one entry per entry of {labels.outputs}, in the same "
        f"order: a tensor of that output's shape (None for a scalar output). Fix: pass a "
        f"list, e.g. list({labels.grad_outputs}.values()) if the dict's values are in the "
        f"order of {labels.outputs}."
    )


def not_a_sequence_message(labels: Labels, go: Any, outputs: Sequence[Tensor]) -> str:
    number = isinstance(go, (int, float, complex)) and not isinstance(go, bool)
    if not labels.indexed:  # (Tensor.backward: one tensor, dL/d of the tensor itself)
        y = labels.outputs
        return (
            f"{labels.call}: {labels.grad_outputs} is {a_type(go)}, but it must be a Tensor "
            f"of {y}'s shape, or None for a scalar {y}.\n"
            f"  {labels.grad_outputs} is dL/d{y}: one number per element of {y}. Fix: "
            + (f"torch.full_like({y}, {go!r}) to weight every element by {go!r}."
               if number else f"pass a tensor of {y}'s shape, e.g. torch.ones_like({y}).")
        )
    one = f"{labels.outputs}[0]" if len(outputs) == 1 else "output"
    return (
        f"{labels.call}: {labels.grad_outputs} is {a_type(go)}, but it must be a "
        f"Tensor, a list or tuple of Tensors (None for scalar outputs), or None.\n"
        f"  It holds one vector dL/d output per entry of {labels.outputs}, each with that "
        f"output's shape. Fix: pass a tensor, e.g. torch.full_like({one}, "
        f"{repr(go) if number else 'value'}) for a constant."
    )


def extra_message(labels: Labels, m: int, n: int) -> str:
    """The warning for ``m`` vectors given for ``n < m`` outputs (torch ignores the rest)."""
    if labels.indexed:
        return (
            f"{labels.call}: got {m} {labels.grad_outputs} for {n} {labels.outputs}; torch "
            f"ignores the last {m - n}. {labels.grad_outputs} holds one vector per entry "
            f"of {labels.outputs}, in the same order: check that none is missing from "
            f"{labels.outputs}."
        )
    return (  # one tensor (Tensor.backward): the sequence was not needed at all
        f"{labels.call}: {labels.grad_outputs} is a sequence of {m} tensors for the "
        f"one tensor {labels.outputs}; torch uses the first and ignores the other "
        f"{m - n}. {labels.grad_outputs} is dL/d{labels.outputs}, one tensor of "
        f"{labels.outputs}'s shape: pass that tensor itself (to backpropagate from "
        f"several tensors, torch.autograd.backward([y1, y2], [g1, g2]))."
    )


def count_message(
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


def batch_size_message(labels: Labels, gos: Sequence[Any]) -> str:
    sizes = ", ".join(
        f"{labels.go(j)}: {int(g.shape[0])}"
        for j, g in enumerate(gos)
        if isinstance(g, Tensor) and g.dim() > 0
    )
    return (
        f"{labels.call}: with {labels.batch_flag}=True the {labels.grad_outputs} have "
        f"different batch sizes ({sizes}).\n"
        f"  The leading dimension K is the number of {labels.product}s computed at "
        f"once, so it must be the same for every entry of {labels.grad_outputs}. Fix: give "
        f"each the same K, e.g. by .expand(K, ...) of a shared vector."
    )


def empty_batch_message(labels: Labels, i: int, go: Tensor) -> str:
    g = labels.go(i)
    return (
        f"{labels.call}: {g} has shape {shape_str(go.shape)}: a batch of K = 0 vectors, and "
        f"{labels.batch_flag}=True.\n"
        f"  With {labels.batch_flag}=True, the leading dimension K of every "
        f"{labels.grad_outputs} entry is the number of {labels.product}s computed at once; "
        f"torch needs at least one. Fix: skip the call when there is nothing to compute "
        f"(the result would be empty), or pass K >= 1 vectors."
    )


def integer_tangent_message(labels: Labels, i: int, out: Tensor, go: Tensor) -> str:
    o, g = labels.out(i), labels.go(i)
    return (
        f"{labels.call}: {g} has dtype {go.dtype}, but {o} has dtype {out.dtype}.\n"
        f"  {labels.meaning(i)}: a small change of a floating-point tensor, so it must be "
        f"floating point too (torch.func refuses integer and boolean tangents). Fix: pass "
        f"{g}.to({out.dtype})."
    )


def complex_message(labels: Labels, i: int, out: Tensor, go: Tensor) -> str:
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


def cast_message(labels: Labels, i: int, out: Tensor, go: Tensor,
                 to: torch.dtype | None = None) -> str:
    """The warning that ``go`` is cast silently to ``to``: ``out``'s dtype, or the
    ``grad_dtype`` of a leaf ``out``."""
    o, g = labels.out(i), labels.go(i)
    to = to or out.dtype
    leaf = "" if to == out.dtype else f" (a leaf whose grad_dtype is {to})"
    if go.dtype == torch.bool:
        what = "boolean"
    elif not (go.dtype.is_floating_point or go.dtype.is_complex):
        what = "integer"
    else:
        what = str(go.dtype)
    if labels.role == "tangents":
        # (torch.func.jvp does not cast: J t came back in the tangent's dtype, or an
        # operator of f refused the mix of dtypes)
        msg = (
            f"{labels.call}: {g} has dtype {go.dtype} but {o} has dtype {out.dtype}; "
            f"{labels.call} casts the {what} {labels.grad_outputs} to {out.dtype}, the dtype "
            f"of the space a tangent of {o} lives in (torch.func.jvp does not cast: J t "
            f"would come back in {go.dtype}, or an operator of f would refuse the mix). Pass "
            f"{g}.to({out.dtype}) to make the cast explicit"
        )
    elif go.dtype == out.dtype:
        # (a vector of the dtype of a leaf whose grad_dtype is another: the gradient the
        # leaf receives is cast to its grad_dtype)
        return (
            f"{labels.call}: {g} has dtype {go.dtype}, the dtype of {o}, but {o} is a leaf "
            f"whose grad_dtype is {to}; torch casts the {what} {labels.grad_outputs} to {to} "
            f"silently. Pass {g}.to({to}) to make the cast explicit, or set "
            f"{o}.grad_dtype = None (gradients kept in their own dtype) or to {go.dtype} "
            f"before the backward pass if you need that precision."
        )
    else:
        msg = (
            f"{labels.call}: {g} has dtype {go.dtype} but {o} has dtype {out.dtype}{leaf}; "
            f"torch casts the {what} {labels.grad_outputs} to {to} silently. Pass "
            f"{g}.to({to}) to make the cast explicit"
        )
    if go.dtype.is_floating_point and go.dtype.itemsize > to.itemsize:
        # only a wider floating-point dtype is precision the caller may have wanted
        return msg + f", or compute {o} in {go.dtype} if you need that precision."
    return msg + "."


def layout_message(labels: Labels, i: int, out: Tensor, go: Tensor) -> str:
    o, g = labels.out(i), labels.go(i)
    return (
        f"{labels.call}: {g} has layout {go.layout}, but {o} has layout {out.layout}.\n"
        f"  torch's engine takes a vector of the output's own layout, or a sparse COO one "
        f"(torch.sparse_coo) for any output. Fix: pass {g}.to_dense()"
        + (" or {g}.to_sparse()." if out.layout is torch.strided else ".")
    ).replace("{g}", g)


def device_message(labels: Labels, i: int, out: Tensor, go: Tensor) -> str:
    o, g = labels.out(i), labels.go(i)
    return (
        f"{labels.call}: {g} is on device {go.device}, but {o} is on {out.device}.\n"
        f"  {labels.meaning(i)}, consumed where {o}'s graph runs, so it must be on "
        f"{out.device}. Fix: pass {g}.to({o}.device)."
    )


def warn_ignored_cotangents(labels: Labels, outputs: Sequence[Tensor], cotangents: Sequence[Any],
                            ignored: Sequence[bool], batched: bool,
                            inputs: Sequence[Tensor] | None) -> None:
    """Warns of each cotangent that torch.func's pullback ignores (``ignored[i]``: its output
    does not depend on the primals) and that is not None and does not fit its output: not a
    tensor, or not of its shape."""
    for i, (o, c, gone) in enumerate(zip(outputs, cotangents, ignored)):
        if not gone or c is None:
            continue
        if not isinstance(c, Tensor):
            explanation = type_message(labels, i, o, c)
        elif (c.shape[1:] if batched and c.dim() else c.shape) != o.shape:
            explanation = shape_message(labels, i, o, c, outputs, cotangents, batched, inputs)
        else:
            continue
        warnings.warn(
            f"{labels.call}: {labels.go(i)} does not fit {labels.out(i)}, but torch ignores "
            f"it: {labels.out(i)} does not depend on the primals, so it needs no vector (None "
            f"will do). The check said:\n{explanation}",
            GradOutputsWarning,
            stacklevel=user_stacklevel(),
        )
