"""The messages of the ``grad_outputs`` checker (:mod:`torch_vjp._checks`).

Each says: the call; what was got (index, concrete shapes); what was expected and why; one
fix when the mistake is recognisable. They are built only once a mistake is found (NOTE
[fast path, slow message]), so they may take their time: guess the mistake, walk the
graph for the shapes of leaf tensors.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from torch_vjp._errors import GradOutputsWarning, a_type, shape_str, user_stacklevel

if TYPE_CHECKING:
    from torch_vjp._checks import Labels

__all__ = [
    "describe_tree",
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
STAND_IN_NODE = "_torch_vjp_edge_node"


def leaf_shapes(outputs: Sequence[Tensor], limit: int = 2000) -> list[torch.Size]:
    """Shapes of the leaf tensors (those that accumulate ``.grad``) behind ``outputs``.

    Walks the autograd graph breadth-first, visiting at most ``limit`` nodes. Used only to
    word messages: "(4,) is the shape of a leaf tensor that outputs[0] was computed from".
    """
    shapes: list[torch.Size] = []
    seen: set[int] = set()
    # (the stand-in of a GradientEdge output is walked from the edge's node)
    nodes = [getattr(o, STAND_IN_NODE, None) or o.grad_fn if isinstance(o, Tensor) else None
             for o in outputs]
    frontier = [node for node in nodes if node is not None]
    for o, node in zip(outputs, nodes):
        if isinstance(o, Tensor) and node is None and o.requires_grad:
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


def shape_message(
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


def _count_fix(
    labels: Labels, i: int, out: Tensor, go: Tensor, outputs: Sequence[Tensor],
    gos: Sequence[Any],
) -> str:
    """The shape mismatch that a wrong number of entries explains: one tensor stacking the
    vectors of several outputs, or several entries that are the rows of one vector."""
    n, m = len(outputs), len(gos)
    g, o = labels.go(i), labels.out(i)
    rest = outputs[i:]
    k = go.shape[0] if go.dim() == out.dim() + 1 else 0
    if m < n and 1 < k <= len(rest) and all(r.shape == out.shape for r in rest[:k]) and (
            go.shape[1:] == out.shape):
        return (
            f"{labels.outputs} has {_entries(n)} but {labels.grad_outputs} has {m}: {g} stacks {k} "
            f"vectors, for {labels.out(i)} to {labels.out(i + k - 1)}, along a leading "
            f"dimension. {labels.grad_outputs} takes one entry per output, so pass them "
            f"apart: list({g}) or {g}.unbind(0) in its place."
        )
    rows = out.shape[0] if out.dim() >= 1 else 0
    if (m > n and out.dim() == go.dim() + 1 and out.shape[1:] == go.shape and rows > 1
            and m - i >= rows
            and all(isinstance(v, Tensor) and v.shape == go.shape for v in gos[i:i + rows])):
        return (
            f"{labels.outputs} has {_entries(n)} but {labels.grad_outputs} has {m}: "
            f"{labels.go(i)} to {labels.go(i + rows - 1)} look like the {rows} rows of one "
            f"vector for {o}, which has shape {shape_str(out.shape)}. {labels.grad_outputs} "
            f"takes one entry per output, shaped like it: pass torch.stack of those {rows} "
            f"as one entry (torch would ignore the extra ones)."
        )
    return ""


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


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
    count_fix = _count_fix(labels, i, out, go, outputs, gos)
    if count_fix:
        return count_fix
    if out.dim() == 0 and go.numel() == 1:
        return (
            f"{o} is a 0-d scalar (shape ()), and {shape_str(gshape)} is not (): "
            f"torch.Size({list(gshape)}) and torch.Size([]) differ. Pass {g}.reshape(()), or "
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
        if k == 1:
            return (
                f"{g} has an extra leading dimension of size 1 (an unsqueeze, a [None] or a "
                f"keepdim=True too many?): pass {g}.squeeze(0). (If it stacks one vector for "
                f"one {labels.product}, {labels.batch_hint}.)"
            )
        return (
            f"{g} has an extra leading dimension of size {k}. If it holds {k} "
            f"vector{'s' if k != 1 else ''}, one per {labels.product}, "
            f"{labels.batch_hint}; {labels.whole_jacobian} computes the whole Jacobian."
        )
    if out.numel() == 1 and go.dim() == 0:
        return (
            f"{o} has one element but shape {shape_str(oshape)}, not (): pass "
            f"{g}.reshape({shape_str(oshape)}), or leave it None: for a one-element output "
            f"torch uses 1."
        )
    if _matches_input(gshape, inputs, outputs):
        return _input_fix(labels, i, gshape, inputs, outputs, batched=False)
    # a vector of the shape of the output's leading dimensions: one weight per row (per-example
    # weights (B,) for a (B, k) output), which torch's broadcasting would not align; where it
    # matches the last dimensions too (a (B, B) output), both readings are told
    per_row = ""
    if (labels.role != "tangents" and 1 <= go.dim() < out.dim()
            and tuple(oshape[:go.dim()]) == tuple(gshape)):
        ones = shape_str(tuple(gshape) + (1,) * (out.dim() - go.dim()))
        per_row = (
            f"If it holds one weight per {'row' if go.dim() == 1 else 'slice'} of {o}, "
            f"pass {g}.reshape({ones}).expand_as({o})."
        )
    if out.dim() == go.dim() + 1 and oshape[1:] == gshape:
        if oshape[0] == 1:
            return (
                f"{g} lacks the leading dimension of size 1 that {o} has: pass "
                f"{g}.unsqueeze(0)."
            )
        return (
            f"{g} lacks the leading dimension of size {oshape[0]} that {o} has. To use the "
            f"same vector for every row of {o}, pass {g}.expand_as({o})."
            + (f" {per_row}" if per_row else "")
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
            + (f" {per_row}" if per_row else "")
        )
    if per_row:
        lead = shape_str(oshape[:go.dim()])
        return (
            f"{shape_str(gshape)} is the shape of {o}'s leading dimension"
            f"{'s' if go.dim() > 1 else ''} {lead}, and torch does not broadcast "
            f"{labels.grad_outputs} (broadcasting would align the last dimensions, not the "
            f"first). {per_row}"
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


def missing_message(
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
        + (f"torch_vjp.jacobian_of({o}, {target})." if labels.whole_jacobian ==
           "torch_vjp.jacobian_of" else f"{labels.whole_jacobian}.")
    )


def batched_none_message(
    labels: Labels, i: int, out: Tensor, gos: Sequence[Any], outputs: Sequence[Tensor]
) -> str:
    o, g = labels.out(i), labels.go(i)
    k = _known_batch_size(gos, outputs)
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


def output_type_message(labels: Labels, i: int, out: Any) -> str:
    o = labels.out(i)
    return (
        f"{labels.call}: {o} is {a_type(out)}, but "
        f"each entry of {labels.outputs} must be a tensor (or a GradientEdge of one).\n"
        f"  {labels.outputs} are the outputs y whose vector-Jacobian product is taken, "
        f"tensors computed from ones that require grad. Fix: pass the tensor itself (.item() "
        f"gives a number, which holds no graph)."
    )


def no_grad_message(labels: Labels, i: int, out: Tensor,
                    inputs: Sequence[Tensor] | None = None) -> str:
    o = labels.out(i)
    if inputs and all(isinstance(t, Tensor) and t.requires_grad for t in inputs):
        # the inputs are not what is missing: the graph from them to the output is
        one = len(inputs) == 1
        which = f"{labels.inputs}[0]" if one else f"every tensor of {labels.inputs}"
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
        names = ", ".join(f"{labels.inputs}[{k}]" for k in frozen[:4])
        names += ", ..." if len(frozen) > 4 else ""
        fix = (
            f"  {names} {'does' if len(frozen) == 1 else 'do'} not require grad, but the "
            f"other {labels.inputs} do: if {o} was computed from those, the graph was cut on "
            f"the way (torch.no_grad(), torch.inference_mode(), a .detach()ed, .item() or "
            f"copied value). Fix: compute {o} with grad mode on from {labels.inputs} that "
            f"require grad (call .requires_grad_() on {names} first if {o} is computed from "
            f"{'it' if len(frozen) == 1 else 'them'})"
        )
    else:
        fix = (f"  Fix: create the inputs with requires_grad=True (or call .requires_grad_() "
               f"on them) before computing {o}")
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


def not_a_sequence_message(labels: Labels, go: Any, outputs: Sequence[Tensor]) -> str:
    return (
        f"{labels.call}: {labels.grad_outputs} is {a_type(go)}, but it must be a "
        f"Tensor, a list or tuple of Tensors (None for scalar outputs), or None.\n"
        f"  It holds one vector dL/d output per entry of {labels.outputs}, each with that "
        f"output's shape. Fix: pass a tensor, e.g. torch.full_like(output, value) for a "
        f"constant."
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


def cast_message(labels: Labels, i: int, out: Tensor, go: Tensor) -> str:
    o, g = labels.out(i), labels.go(i)
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
    else:
        msg = (
            f"{labels.call}: {g} has dtype {go.dtype} but {o} has dtype {out.dtype}; torch "
            f"casts the {what} {labels.grad_outputs} to {out.dtype} silently. Pass "
            f"{g}.to({out.dtype}) to make the cast explicit"
        )
    if go.dtype.is_floating_point and go.dtype.itemsize > out.dtype.itemsize:
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
