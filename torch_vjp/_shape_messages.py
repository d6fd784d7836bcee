"""The ``grad_outputs`` checker's messages for an entry of the wrong shape, and for one
missing (part of :mod:`torch_vjp._check_messages`): what the shape is, what it should be,
and the fix for the mistakes that can be recognised from shapes alone (a batch where none
was asked for, one vector per row, an input's shape, the Jacobian's), with the shapes of
the graph's leaf tensors to tell them apart; and for an input torch cannot differentiate
against (one that does not require grad, one the outputs do not depend on).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from torch_vjp._errors import a_type, joined, shape_str

if TYPE_CHECKING:
    from torch_vjp._check_labels import Labels

__all__ = ["STAND_IN_NODE", "count_hint", "frozen_message", "input_name", "inputs_message",
           "known_batch_size", "leaf_shapes", "missing_message", "shape_message",
           "unused_message"]

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
        k = known_batch_size(gos, outputs)
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
    fix = (_shape_fix(labels, i, out, go, outputs, gos, batched, inputs)
           or _plain_fix(labels, i, out, batched))
    return head + ("\n  " + fix if fix else "")


def _plain_fix(labels: Labels, i: int, out: Tensor, batched: bool) -> str:
    """The fix where no recognisable mistake explains the shape: what to pass."""
    o, g = labels.out(i), labels.go(i)
    if batched:
        return (f"Fix: make {g} torch.stack([v1, v2, ...]) of K vectors, each of {o}'s shape "
                f"{shape_str(out.shape)}.")
    if labels.role == "tangents":  # (jvp adds its own: a tangent or a cotangent)
        return ""
    return (f"Fix: pass a tensor of {o}'s shape {shape_str(out.shape)} as {g}, e.g. "
            f"torch.ones_like({o}) to differentiate the sum of {o}'s elements.")


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


def count_hint(labels: Labels, outputs: Sequence[Tensor], gos: Sequence[Any],
               batched: bool) -> str:
    """For fewer vectors than outputs, what the shapes of those given tell, as a line to add
    to the count's explanation: one vector stacking those of several outputs, or vectors
    that fit later outputs (the first ones left out); "" where they tell nothing."""
    n, m = len(outputs), len(gos)
    if not m or not all(g is None or isinstance(g, Tensor) for g in gos):
        return ""
    if not batched:
        i = next((j for j, g in enumerate(gos)
                  if g is not None and g.shape != outputs[j].shape), None)
        stacked = "" if i is None else _count_fix(labels, i, outputs[i], gos[i], outputs, gos)
        if stacked:
            return "\n  " + stacked

    def shape(g: Tensor) -> Sequence[int]:
        return g.shape[1:] if batched else g.shape

    for shift in range(1, n - m + 1):
        if all(g is None or shape(g) == outputs[j + shift].shape for j, g in enumerate(gos)) \
                and any(g is not None and shape(g) != outputs[j].shape
                        for j, g in enumerate(gos)):
            j = next(j for j, g in enumerate(gos) if g is not None)
            missing = ", ".join(labels.out(k) for k in range(shift))
            one = shift == 1
            return (f"\n  {labels.go(j)} has the shape of {labels.out(j + shift)}, "
                    f"{shape_str(outputs[j + shift].shape)}: the vector{'' if one else 's'} of "
                    f"{missing} {'is' if one else 'are'} missing at the start. Fix: give "
                    f"{'it' if one else 'them'} first (torch.zeros_like of the output for one "
                    f"that should not count), or leave {'it' if one else 'them'} out of "
                    f"{labels.outputs}.")
    return ""


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def known_batch_size(gos: Sequence[Any], outputs: Sequence[Tensor]) -> int | None:
    """The batch size K implied by the grad_outputs that do carry a batch dimension."""
    for go, out in zip(gos, outputs):
        if isinstance(go, Tensor) and go.dim() == out.dim() + 1 and go.shape[1:] == out.shape:
            return int(go.shape[0])
    return None


def _basis_fix(labels: Labels, i: int, gshape: Sequence[int], batched: bool) -> str:
    """``gshape`` is the output's shape twice: ``torch.eye(n).reshape(*shape, *shape)``, one
    basis vector per element, for the Jacobian; the batched call needs them along one
    leading dimension."""
    o, g = labels.out(i), labels.go(i)
    how = (f", keeping {labels.batch_flag}=True: the K vectors go along one leading "
           f"dimension" if batched else f" and {labels.batch_hint.removeprefix('pass ')}")
    return (
        f"{shape_str(gshape)} is {o}'s shape twice, the shape of the Jacobian of {o} with "
        f"respect to itself (an identity basis, one vector per element of {o}?). For the "
        f"Jacobian, {labels.whole_jacobian} computes it; to use these vectors, one "
        f"{labels.product} each, pass {g}.reshape(-1, *{o}.shape){how}."
    )


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
            k = known_batch_size(gos, outputs)
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
        if out.dim() >= 2 and tuple(gshape) == tuple(oshape) * 2:  # (1-d: K = n, valid)
            return _basis_fix(labels, i, gshape, batched=True)
        if go.dim() >= 1:
            return _order_reading(labels, i, gshape[1:], oshape, batched=True)
        return ""
    counted = _count_fix(labels, i, out, go, outputs, gos)
    if counted:
        return counted
    reading = _form_reading(labels, i, out, go)
    # a vector of an input's shape (torch.ones_like(x) for dL/dy) is the commonest confusion:
    # named first, also where its shape has a reading of its own as well (an extra leading
    # dimension, K elements for a one-element output), which is then told as the other one
    if _matches_input(gshape, inputs, outputs):
        named = _input_fix(labels, i, gshape, inputs, outputs, batched=False)
        if named:
            return named + (f"\n  Or: {reading}" if reading else "")
    return reading or _shape_reading(labels, i, out, go)


def _form_reading(labels: Labels, i: int, out: Tensor, go: Tensor) -> str:
    """What the shape of ``go`` says of itself, beside the output's: a number of elements
    for a one-element output, or the output's shape with an extra leading dimension; and
    the fix. Or an empty string."""
    o, g = labels.out(i), labels.go(i)
    gshape, oshape = go.shape, out.shape
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
    return ""


def _shape_reading(labels: Labels, i: int, out: Tensor, go: Tensor) -> str:
    """What the shape of ``go`` suggests otherwise (the output's shape twice, reversed, in
    another arrangement, or only part of it), and the fix; or an empty string."""
    o, g = labels.out(i), labels.go(i)
    gshape, oshape = go.shape, out.shape
    if out.dim() >= 1 and tuple(gshape) == tuple(oshape) * 2:
        return _basis_fix(labels, i, gshape, batched=False)
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
    order = _order_reading(labels, i, gshape, oshape, batched=False)
    if order:
        return order
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


def _order_reading(labels: Labels, i: int, gshape: Sequence[int], oshape: Sequence[int],
                   batched: bool) -> str:
    """The fix for a vector holding the output's dimensions in another order (not all of
    them reversed, told before): the last two swapped (a batch of transposed matrices), or
    another order that the sizes tell (each size once); or an empty string. A reshape would
    keep such a vector's elements in the wrong order."""
    o, g = labels.out(i), labels.go(i)
    gshape, oshape = tuple(gshape), tuple(oshape)
    n = len(oshape)
    if n < 2 or len(gshape) != n or gshape == oshape or sorted(gshape) != sorted(oshape):
        return ""
    swapped = gshape[:-2] + (gshape[-1], gshape[-2])
    if swapped == oshape:
        what, fix = f"{o}'s shape with its last two dimensions swapped", f"{g}.mT"
    elif len(set(oshape)) == n:
        order = [gshape.index(d) for d in oshape]
        if batched:
            order = [0] + [d + 1 for d in order]
        what = f"{o}'s dimensions in another order"
        fix = f"{g}.permute({', '.join(str(d) for d in order)})"
    else:
        return ""
    shown = shape_str(gshape)
    return (
        f"{shown} is {what}{' (after the batch dimension)' if batched else ''}: did you mean "
        f"{fix}? (A .reshape would keep the elements in {shown}'s order, the wrong one for "
        f"{o}, and give a wrong result without an error.)"
    )


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
        whose = labels.inp(j)
        what = f"{shape_str(shape)} is the shape of {whose}"
    else:
        what = f"{shape_str(shape)} is the shape of a leaf tensor that {o} was computed from"
    ones = f"torch.ones_like({o})"
    if batched:
        ones = f"torch.ones_like({o}).expand(K, *{o}.shape)"
    elif outputs[i].numel() == 1:
        ones += " (or leave it None: torch uses 1)"
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


def frozen_message(labels: Labels, inputs: Any, ins: tuple[Any, ...],
                   frozen: list[int]) -> str:
    """The explanation of torch's "One of the differentiated Tensors does not require grad":
    which of ``ins`` (``inputs`` as given: a dict names them by key) do not, and the fixes."""
    keys = list(inputs) if type(inputs) is dict else None
    names = [input_name(labels, keys, j) for j in frozen]
    said = [f"{name} (shape {shape_str(ins[j].shape)})" for name, j in zip(names, frozen)]
    if len(said) > 4:
        said = said[:3] + [f"{len(said) - 3} more"]
    one = len(frozen) == 1
    listed = joined(said)
    it, o, i = ("it" if one else "them"), labels.outputs, labels.inputs
    keep = (f"{{k: t for k, t in {i}.items() if t.requires_grad}}" if keys
            else f"[t for t in {i} if t.requires_grad]")
    unused = ("" if labels.grad_outputs != "grad_outputs" else
              f" (allow_unused=True does not help: it returns None for {i} that require grad "
              f"but that {o} do not depend on.)")
    return (
        f"{labels.call}: {listed} {'does' if one else 'do'} not require grad, so there is "
        f"no gradient of {o} to compute for {it}: autograd differentiates only with respect "
        f"to tensors that require grad (created with requires_grad=True, or computed with "
        f"grad mode on from one that is).\n"
        f"  Fix: for {'its' if one else 'their'} gradient, call {names[0]}.requires_grad_() "
        f"(or create {it} with requires_grad=True) before computing {o} from {it}, not under "
        f"torch.no_grad() and not from a .detach()ed value; if you do not want "
        f"{'its' if one else 'their'} gradient (a frozen parameter, a constant), leave {it} "
        f"out of {i}: pass {keep}.{unused}"
    )


def input_name(labels: Labels, keys: list[Any] | None, j: int) -> str:
    """Input ``j`` as the call names it: by its key where ``inputs`` was a dict."""
    return f"{labels.inputs}[{keys[j]!r}]" if keys else f"{labels.inputs}[{j}]"


def _none_on_the_way(outs: Sequence[Any], target: Any) -> list[str] | None:
    """The custom Functions on the autograd graph's paths from ``outs`` back to ``target``
    (a tensor or GradientEdge), by name, the nearest to ``target`` first; None where no path
    leads there. Runs only on the way to an error."""
    try:
        node = get_gradient_edge(target).node if isinstance(target, Tensor) else target.node
        stack = [o.grad_fn if isinstance(o, Tensor) else o.node for o in outs]
    except (AttributeError, RuntimeError, TypeError):
        return None
    seen: dict[int, Any] = {}  # (iteratively: a graph may be deeper than Python's stack)
    parents: dict[int, list[Any]] = {}
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen[id(fn)] = fn
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                parents.setdefault(id(nxt), []).append(fn)
                stack.append(nxt)
    if id(node) not in seen:
        return None
    names: list[str] = []
    on_path, queue = {id(node)}, [node]
    for fn in queue:  # (breadth first from the target: the nearest Functions first)
        cls = getattr(fn, "_forward_cls", None)
        if cls is not None and cls.__name__ not in names:
            names.append(cls.__name__)
        for parent in parents.get(id(fn), []):
            if id(parent) not in on_path:
                on_path.add(id(parent))
                queue.append(parent)
    return names


def unused_message(labels: Labels, inputs: Any, ins: tuple[Any, ...], j: int,
                   outs: Sequence[Any] = ()) -> str:
    """The explanation of torch's "The differentiated Tensor at index j appears to not have
    been used in the graph": ``ins[j]`` requires grad, but no output depends on it, or no
    gradient reached it where one does (a custom backward returned None for it)."""
    name = input_name(labels, list(inputs) if type(inputs) is dict else None, j)
    shape = getattr(ins[j], "shape", None)
    said = f"{name} (shape {shape_str(shape)})" if shape is not None else name
    o = labels.outputs
    custom = _none_on_the_way(outs, ins[j])
    if custom is not None:
        who = (f"{custom[0]}.backward returned None" if len(custom) == 1 else
               f"one of {joined([f'{c}.backward' for c in custom])} returned None" if custom
               else "every backward on the way returned no gradient")
        fix = (f"return dL/d(input) from {custom[0]}.backward for the input that leads to "
               f"{name} (None means zero)" if custom else "find the operation on the way that has no gradient (its backward gives none)")
        return (
            f"{labels.call}: {said} requires grad, and {o} do depend on it: the autograd "
            f"graph leads from {o} back to it, but no gradient reached it: {who} for the "
            f"input on that way (torch reads None as zero, and an input that gets none at "
            f"all as not used).\n"
            f"  Fix: {fix}; if zero is its true gradient, pass materialize_grads=True to get "
            f"zeros, or allow_unused=True to get None for it."
        )
    return (
        f"{labels.call}: {said} requires grad, but {o} do not depend on it: no path of the "
        f"autograd graph leads from {o} back to it, so there is no gradient to compute.\n"
        f"  The usual causes: {o} were computed from a .detach()ed copy of it (or its .data), "
        f"under torch.no_grad(), or through values taken out of torch (.item(), .tolist(), "
        f".numpy(), torch.tensor(...) of them), or from another tensor than the {name} "
        f"passed here (one replaced since). Fix: compute {o} from {name} itself, with grad "
        f"mode on; if {o} really do not depend on it (a layer unused in this step), pass "
        f"allow_unused=True to get None for it, or materialize_grads=True to get zeros."
    )


def inputs_message(labels: Labels, inputs: Any, ins: tuple[Any, ...] | None, j: int) -> str:
    """The explanation of torch's refusal of ``inputs`` (``j`` < 0) or of its entry ``j``
    (``ins[j]``) that is not a tensor, with the fix for the usual mistakes."""
    i, params = labels.inputs, "list(model.parameters())"
    e = inputs if j < 0 or ins is None else ins[j]
    name = i if j < 0 else f"{i}[{j}]"
    if isinstance(e, torch.nn.Module):
        said = f"{i} is {a_type(e)}, a module, not its tensors"
        fix = f"pass {params}, or dict(model.named_parameters()) for gradients by name"
    elif j < 0 and callable(e) and hasattr(e, "__name__"):
        said = f"{i} is the method {e.__name__} itself, not what it returns"
        fix = f"call it: model.{e.__name__}()"
    elif j < 0 and isinstance(e, dict):
        said = (f"{i} is {a_type(e)}, not a dict" + ("; and a state_dict() holds detached "
                "tensors, which no output depends on" if hasattr(e, "_metadata") else ""))
        fix = "pass dict(model.named_parameters()) (or a dict of the tensors themselves)"
    elif isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str):
        said = (f"{name} is a tuple ({e[0]!r}, tensor): named_parameters() gives (name, "
                f"tensor) pairs")
        fix = f"pass dict(model.named_parameters()) for gradients by name, or {params}"
    elif j >= 0 and isinstance(e, (list, tuple)):
        said = f"{name} is {a_type(e)}, but {i} must be a flat sequence of tensors"
        fix = f"flatten it: [t for group in {i} for t in group]"
    else:
        said = (f"{name} is {a_type(e)}, but each entry of {i} must be a tensor" if j >= 0
                else f"{i} is {a_type(e)}, not a tensor or a sequence of tensors")
        fix = "pass the tensors themselves; leave constants out"
    return (f"{labels.call}: {said}.\n  {i} are the tensors x to differentiate against, each "
            f"one that requires grad (or its GradientEdge), in a list, a tuple or a dict by "
            f"name. Fix: {fix}.")
