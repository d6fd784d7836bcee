"""What a custom Function's backward returned, judged: the rules, and their messages.

Shared by :func:`torch_vjp.check_function` (``check_record``, on the value it saw backward
return) and checked mode (:mod:`torch_vjp._backward_checked`, whose ``backward_return_ok``
is the fast path run on every call, ``backward_problems`` the diagnosis behind it and
``torch_verdict`` torch's own verdict from a replay), which words its objections with the
message builders here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from torch_vjp._backward_hints import rearranged_hint
from torch_vjp._errors import shape_str, with_article
from torch_vjp._function_signature import declared_inputs


@dataclass(frozen=True)
class Slot:
    """What autograd expects back at one index of backward's return value.

    Describes one forward input: ``kind`` is ``"tensor"``, ``"other"`` (not a tensor: the
    gradient must be None) or ``"unknown"``; ``shape``/``dtype``/``device`` are ``None``
    where unknown.
    """

    kind: str
    needs_grad: bool
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    type_name: str = "Tensor"
    differentiable: bool = False  # a floating-point or complex tensor
    # a leaf's own dtype, where its grad_dtype (``dtype``, what torch casts to) differs
    leaf_dtype: torch.dtype | None = None



@dataclass(frozen=True)
class Record:
    """One run of a custom Function's backward: its node, grad_outputs and raw return."""

    node: Any
    grad_outputs: tuple[Any, ...]
    returned: Any


def slot_from_arg(a: Any, needs: bool) -> Slot:
    if isinstance(a, Tensor):
        return Slot("tensor", needs, tuple(a.shape), a.dtype, a.device, "Tensor",
                     a.is_floating_point() or a.is_complex())
    return Slot("other", False, type_name=type(a).__name__)


def slots_from_node(node: Any, needs: tuple[bool, ...]) -> list[Slot]:
    """Expected gradients of a custom Function met inside a callable, from its node.

    ``needs_input_grad`` has one entry per forward input; ``next_functions`` one edge per
    *tensor* input (``None`` for a tensor that needs no grad). Edges with a node belong, in
    order, to the inputs that need grad; their metadata gives shape, dtype and device.
    """
    edges = list(node.next_functions)
    n, needed = len(needs), [j for j, b in enumerate(needs) if b]
    live = [e for e in edges if e[0] is not None]
    if len(edges) == n:
        kinds = ["tensor"] * n
    elif len(edges) == len(needed):
        kinds = ["tensor" if b else "other" for b in needs]
    else:
        kinds = ["tensor" if b else "unknown" for b in needs]
    meta: dict[int, tuple[tuple[int, ...], torch.dtype, torch.device] | None] = {}
    next_nodes: dict[int, Any] = {}
    if len(live) == len(needed):
        for j, (next_node, nr) in zip(needed, live):
            meta[j] = _edge_metadata(next_node, nr)
            next_nodes[j] = next_node
    slots = []
    for j in range(n):
        m = meta.get(j)
        if kinds[j] == "other":
            slots.append(Slot("other", False, type_name="non-tensor"))
        elif m is None:
            slots.append(Slot(kinds[j], needs[j], differentiable=needs[j]))
        else:
            slots.append(Slot("tensor", needs[j], m[0], m[1], m[2], "Tensor", True,
                              _own_dtype(next_nodes.get(j), m[1])))
    return slots


def engine_grad_dtype(next_node: Any, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype torch's engine gives a gradient on its way into ``next_node``: ``dtype``, the
    node's metadata, except at a leaf's ``AccumulateGrad``, where the leaf's ``grad_dtype``
    decides (torch casts to it; where it is None, torch casts nothing and ``.grad`` keeps the
    gradient's own dtype). None for "any dtype"."""
    if type(next_node).__name__ != "AccumulateGrad":
        return dtype
    try:
        return next_node.variable.grad_dtype  # (unset, it is the leaf's own dtype)
    except (AttributeError, RuntimeError):  # (a torch without grad_dtype)
        return dtype


def _own_dtype(next_node: Any, expected: torch.dtype | None) -> torch.dtype | None:
    """A leaf's own dtype, where the dtype torch casts its gradient to (``expected``, its
    ``grad_dtype``) is another; else None."""
    if type(next_node).__name__ != "AccumulateGrad" or expected is None:
        return None
    variable = getattr(next_node, "variable", None)
    if isinstance(variable, Tensor) and variable.dtype != expected:
        return variable.dtype
    return None


def _edge_metadata(
    next_node: Any, nr: int
) -> tuple[tuple[int, ...], torch.dtype | None, torch.device] | None:
    try:  # torch >= 2.1 exposes what a node expects at each of its inputs
        m = next_node._input_metadata[nr]
        if getattr(m, "is_nested_tensor", False):
            return None
        return (tuple(int(d) for d in m.shape), engine_grad_dtype(next_node, m.dtype),
                torch.device(m.device))
    except (AttributeError, IndexError, TypeError, RuntimeError):
        pass
    variable = getattr(next_node, "variable", None)  # AccumulateGrad: the leaf itself
    if isinstance(variable, Tensor):
        return tuple(variable.shape), variable.dtype, variable.device
    return None


def summed_idiom(g: tuple[int, ...], s: tuple[int, ...],
                 out_shapes: Callable[[], Sequence[tuple[int, ...] | None]]) -> bool:
    """Whether torch's sum of a gradient of shape ``g`` down to an input of shape ``s`` is
    exact: only dimensions of size 1 are summed, or ``g`` is one of forward's output shapes
    (``out_shapes()``, read only where needed): checked mode's rule and check_function's."""
    return broadcasts_to(s, g) and (math.prod(g) == math.prod(s) or g in out_shapes())


def broadcasts_to(s: tuple[int, ...], g: tuple[int, ...]) -> bool:
    """Whether torch's validation would sum a gradient of shape ``g`` down to ``s``."""
    if len(s) > len(g):
        return False
    for a, b in zip(reversed(s), reversed(g)):
        if a != b and a != 1:
            return False
    return True


def as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def _slot_desc(slot: Slot) -> str:
    if slot.kind == "other":
        return f"a {slot.type_name}: None"
    if slot.shape is not None:
        return f"shape {shape_str(slot.shape)}" + ("" if slot.needs_grad else ", needs no grad")
    return "a tensor" if slot.kind == "tensor" else "an input"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------
# Checking one backward's return value


def check_record(call: str, rec: Record, slots: list[Slot],
                 deferred: dict[int, str] | None = None) -> str | None:
    """``deferred``, where given, takes the shape message of each gradient that torch sums
    down by its broadcast idiom (see ``summed_idiom``) instead of it being returned."""
    fname = rec.node._forward_cls.__name__
    returned = rec.returned
    out_shapes = [tuple(g.shape) if isinstance(g, Tensor) else None for g in rec.grad_outputs]
    n = len(slots)
    if isinstance(returned, list):
        return list_message(call, fname, returned, n_inputs=n)
    values = as_tuple(returned)
    if len(values) != n and not (
        len(values) > n and all(v is None for v in values[n:])
        and len(values) <= declared_inputs(rec.node._forward_cls)
    ):  # (trailing None values for parameters forward declares but was not given are right)
        return count_message(call, fname, values, slots)
    for i, (value, slot) in enumerate(zip(values, slots)):
        problem = _check_one(call, fname, i, value, slot, out_shapes, slots, deferred)
        if problem is not None:
            return problem
    return None


def count_message(call: str, fname: str, values: tuple[Any, ...], slots: list[Slot],
                   torch_line: bool = True) -> str:
    n, got = len(slots), len(values)
    bw = f"{fname}.backward"
    lines = [
        f"{call}: {bw} returned {got} value{'s' if got != 1 else ''}, but {fname}.forward "
        f"takes {n} input{'s' if n != 1 else ''} (not counting ctx), so backward must return "
        f"{n}.",
        "  backward returns one gradient per forward input, in forward's order: dL/d(input) "
        "for each tensor input, None for inputs that are not tensors or need no gradient. "
        "(It takes one grad_output per forward output; the counts of what it takes and what "
        "it returns are unrelated.)",
    ]
    extra_none = got > n and all(v is None for v in values[n:])
    if extra_none:
        lines.append(
            "  torch drops trailing None values without a word, so this runs; but a backward "
            "whose count is off usually has its gradients in the wrong positions too."
        )
    elif torch_line:
        lines.append(
            f"  torch reports this as: function {fname}Backward returned an incorrect number "
            f"of gradients (expected {n}, got {got})."
        )
    if got < n:
        missing = [f"input {j} ({_slot_desc(slots[j])})" for j in range(got, n)]
        names = [f"grad_{j}" if j < got or (slots[j].kind != "other" and slots[j].needs_grad)
                 else "None" for j in range(n)]  # (a None where one is needed zeroes it)
        what = ("None" if set(names[got:]) == {"None"}
                else "its gradient (or None where no gradient is needed)")
        lines.append(f"  Fix: return a value for {', '.join(missing)} as well: {what}, e.g. "
                     f"return {', '.join(names)}.")
    else:
        lines.append(
            f"  Fix: return exactly {n} value{'s' if n != 1 else ''}, one per input of "
            f"forward after ctx; ctx itself gets no gradient."
        )
    return "\n".join(lines)


def _check_one(call: str, fname: str, i: int, value: Any, slot: Slot,
               out_shapes: list[tuple[int, ...] | None], slots: list[Slot],
               deferred: dict[int, str] | None = None) -> str | None:
    if value is not None and not isinstance(value, Tensor):
        return type_message(call, fname, i, value, slot)
    if slot.kind == "other":
        if value is None:
            return None
        return non_tensor_input_message(call, fname, i, slot)
    if value is None:
        if not slot.needs_grad:
            return None
        shape = f" (shape {shape_str(slot.shape)})" if slot.shape is not None else ""
        return (
            f"{call}: {fname}.backward returned None at index {i}, but forward input {i}{shape} "
            f"requires grad.\n"
            f"  None tells autograd that the gradient is zero: torch accepts it without a "
            f"word, so input {i} silently gets no gradient.\n"
            f"  Fix: return dL/d(input {i}), grad_output times the Jacobian d(output)/"
            f"d(input {i}), a tensor of input {i}'s shape; if forward's outputs truly do not "
            f"depend on input {i}, return torch.zeros_like(input) to make the zero explicit. "
            f"Use ctx.needs_input_grad[{i}] to skip work when it is False."
        )
    if not (slot.needs_grad or slot.differentiable) or slot.shape is None:
        return None
    dropped = "" if slot.needs_grad else (
        f"\n  (Input {i} does not require grad in this call, so torch drops this value; it is "
        f"wrong whenever input {i} does.)"
    )
    gshape, ishape = tuple(value.shape), slot.shape
    if gshape != ishape:
        message = shape_message(call, fname, i, gshape, ishape, out_shapes,
                                in_shapes=[t.shape for t in slots]) + dropped
        if not summed_idiom(gshape, ishape, lambda: out_shapes) or deferred is None:
            return message
        deferred[i] = message  # (torch sums it; told only if the summed values are wrong)
    if slot.dtype is not None and value.dtype != slot.dtype:
        return dtype_message(call, fname, i, value, slot) + dropped
    if slot.device is not None and value.device != slot.device:
        return device_message(call, fname, i, value, slot) + dropped
    return None


def list_message(call: str, fname: str, returned: list[Any], torch_line: bool = True,
                 n_inputs: int = 1) -> str:
    count = f"{len(returned)} value{'' if len(returned) == 1 else 's'}"
    # (torch counts the list as one gradient: for one input it rejects the value's type,
    # for several the count)
    said = ("expected Variable or None (got list)" if n_inputs <= 1 else
            f"function {fname}Backward returned an incorrect number of gradients (expected "
            f"{n_inputs}, got 1)")
    return (
        f"{call}: {fname}.backward returned a list of {count}; torch reads a list as one "
        f"single value, which is not a gradient.\n"
        f"  backward returns a tuple: one gradient (or None) per forward input, in forward's "
        f"order.\n"
        + (f"  torch reports this as: {said}.\n" if torch_line else "")
        + "  Fix: return a tuple: return tuple(grads), or return grad_a, grad_b."
    )


def type_message(call: str, fname: str, i: int, value: Any, slot: Slot,
                  torch_line: bool = True) -> str:
    kind = type(value).__name__
    shape = f" {shape_str(slot.shape)}" if slot.shape is not None else ""
    return (
        f"{call}: {fname}.backward returned {with_article(kind)} at index {i}; backward "
        f"returns, at each index, a tensor (dL/d input {i}) or None.\n"
        + (f"  A gradient holds one number per element of input {i}, so it is a tensor of "
           f"input {i}'s shape{shape}; None stands for zero.\n" if slot.kind != "other" else
           f"  Input {i} is not a tensor: it has no gradient, so its value is None.\n")
        + (f"  torch reports this as: expected Variable or None (got {kind}).\n"
           if torch_line else "")
        + "  Fix: return "
        + (f"None at index {i}: input {i} is not a tensor."
           if slot.kind == "other" else
           f"a tensor with input {i}'s shape{shape}, e.g. grad_output * (the derivative as a "
           f"tensor).")
    )


def non_tensor_input_message(call: str, fname: str, i: int, slot: Slot,
                              torch_line: bool = True) -> str:
    what = "" if slot.type_name == "non-tensor" else f" ({slot.type_name})"
    return (
        f"{call}: {fname}.backward returned a tensor at index {i}, but forward input {i} is "
        f"not a tensor{what}.\n"
        f"  A non-tensor input has no gradient, so backward must return None at its "
        f"index.\n"
        + (f"  torch reports this as: function {fname}Backward returned a gradient different "
           f"than None at position {i + 1}, but the corresponding forward input was not a "
           f"Variable.\n" if torch_line else "")
        + f"  Fix: return None at index {i}; gradients go at the indices of the tensor "
        f"inputs, in forward's order."
    )


def device_message(call: str, fname: str, i: int, value: Tensor, slot: Slot,
                    torch_line: bool = True) -> str:
    lines = [
        f"{call}: {fname}.backward returned a gradient on device {value.device} at index {i}, "
        f"but forward input {i} is on {slot.device}.",
        "  A gradient lives on its input's device, like the input's other data.",
    ]
    if value.dim() == 0:
        lines.append(
            f"  torch does not catch this for a 0-d gradient: it moves it to {slot.device} "
            f"without a word."
        )
    elif torch_line:
        lines.append(
            f"  torch reports this as: Function {fname}Backward returned an invalid gradient "
            f"at index {i} - expected device {slot.device} but got {value.device}."
        )
    lines.append(
        "  Fix: create the tensors backward needs on grad_output.device (e.g. "
        "torch.zeros(..., device=grad_output.device)), or return grad.to(input.device)."
    )
    return "\n".join(lines)


def shape_message(call: str, fname: str, i: int, g: tuple[int, ...], s: tuple[int, ...],
                   out_shapes: list[tuple[int, ...] | None], torch_line: bool = True,
                   in_shapes: Sequence[tuple[int, ...] | None] = ()) -> str:
    """``in_shapes``: forward's input shapes, to tell a gradient at another input's index."""
    lines = [
        f"{call}: {fname}.backward returned a gradient of shape {shape_str(g)} at index {i}, "
        f"but forward input {i} has shape {shape_str(s)}.",
        f"  backward returns dL/d(input {i}) = grad_output times the Jacobian d(output)/"
        f"d(input {i}): one number per element of input {i}, so a tensor of exactly input "
        f"{i}'s shape {shape_str(s)}, never the Jacobian itself.",
    ]
    if broadcasts_to(s, g):
        lines.append(
            f"  torch does not catch this: it sums the gradient down to {shape_str(s)} "
            f"(Tensor.sum_to_size) without a word, so input {i} gets whatever that sum is."
        )
    elif torch_line:
        lines.append(
            f"  torch reports this as: Function {fname}Backward returned an invalid gradient "
            f"at index {i} - got {list(g)} but expected shape compatible with {list(s)} "
            f"(compatible: {shape_str(s)} itself, or a shape that {shape_str(s)} broadcasts "
            f"to, which torch then sums down)."
        )
    else:
        lines.append(
            f"  torch's \"shape compatible with {list(s)}\" means {shape_str(s)} itself, or a "
            f"shape that {shape_str(s)} broadcasts to, which torch then sums down; "
            f"{shape_str(g)} is neither."
        )
    j = next((j for j, t in enumerate(in_shapes) if j != i and t == g), None)
    if j is not None and not broadcasts_to(s, g):  # (the commonest: another order)
        lines.append(f"  {shape_str(g)} is the shape of forward input {j}: gradients out of "
                     f"order? backward returns them in forward's order: input {i}'s, of shape "
                     f"{shape_str(s)}, at index {i}. If it is not that:")
    lines.append("  " + _shape_hint(i, g, s, out_shapes))
    return "\n".join(lines)


def _lead_dims(n: int) -> str:
    """The ``dim`` argument of a sum over ``n`` leading dimensions."""
    return "0" if n == 1 else f"dim={tuple(range(n))}"


def _shape_hint(i: int, g: tuple[int, ...], s: tuple[int, ...],
                out_shapes: list[tuple[int, ...] | None]) -> str:
    outs = [(k, o) for k, o in enumerate(out_shapes) if o is not None]
    single = len(out_shapes) == 1
    for k, o in outs:
        out_name = "the output" if single else f"output {k}"
        if g == o + s:
            return (
                f"{shape_str(g)} is {out_name}'s shape {shape_str(o)} followed by input {i}'s "
                f"shape {shape_str(s)}: the shape of the Jacobian d({out_name})/d(input {i}). "
                f"backward receives grad_output = dL/d({out_name}), shape {shape_str(o)}, and "
                f"returns its product with that Jacobian. Fix: return "
                f"torch.tensordot(grad_output, J, dims={len(o)}) (shape {shape_str(s)}), or "
                f"better, compute that product directly without building J: not storing "
                f"Jacobians is why backward works this way. (If it is instead the gradient "
                f"of input {i} broadcast to {shape_str(g)} in forward, as in (x * y).sum(-1), "
                f"its sum over the leading dimensions is input {i}'s gradient: return "
                f"grad.sum({_lead_dims(len(o))}).)"
            )
        if g == s + o:
            return (
                f"{shape_str(g)} is input {i}'s shape {shape_str(s)} followed by {out_name}'s "
                f"shape {shape_str(o)}: the transposed Jacobian d({out_name})/d(input {i}). "
                f"backward returns its product with grad_output = dL/d({out_name}), not the "
                f"Jacobian. Fix: return torch.tensordot(J, grad_output, dims={len(o)}) "
                f"(shape {shape_str(s)}), or compute the product without building J."
            )
    for k, o in outs:
        if g == o and o != s:
            out_name = "the output" if single else f"output {k}"
            if math.prod(g) == math.prod(s):
                return rearranged_hint(i, g, s, out_name)
            return (
                f"{shape_str(g)} is the shape of {out_name} (and of grad_output): backward "
                f"takes gradients with respect to forward's outputs and returns gradients with "
                f"respect to its inputs. Fix: multiply grad_output by the Jacobian d("
                f"{out_name})/d(input {i}), which gives a tensor of shape {shape_str(s)}."
            )
    for k, o in outs:
        out_name = "the output" if single else f"output {k}"
        if s and o and s[0] == o[0] and len(g) > len(s):
            b = s[0]
            if g == (b,) + o[1:] + s[1:] or g == (b,) + s[1:] + o[1:]:
                # (where a row of the input and of the output have one shape, both orders
                # read alike: the usual one, (b, *out, *in), is told, and the other named)
                transposed = g != (b,) + o[1:] + s[1:]
                order = "j, g" if transposed else "g, j"
                rows = (f"of one row of input {i} and of {out_name}: each example's "
                        f"transposed Jacobian" if transposed
                        else f"of one row of {out_name} and of input {i}")
                other = ("" if transposed or s[1:] != o[1:] else
                         " (If J holds them transposed, (b, *in, *out), contract with "
                         "torch.tensordot(j, g, dims=g.dim()) instead.)")
                return (
                    f"{shape_str(g)} holds one Jacobian per example: the batch of {b}, then "
                    f"the shapes {rows}. backward never "
                    f"forms per-example Jacobians: a batch input of shape {shape_str(s)} gets "
                    f"a gradient of shape {shape_str(s)}, row e being dL/d(input {i}[e]). "
                    f"Fix: contract each example's Jacobian with its row of grad_output: "
                    f"torch.vmap(lambda g, j: torch.tensordot({order}, dims=g.dim()))"
                    f"(grad_output, J), or compute that product without building J.{other}"
                )
    for k, o in outs:
        out_name = "the output" if single else f"output {k}"
        if len(s) >= 2 and len(o) >= 2 and s[0] == o[0] == 1 and g in (
                o[1:] + s[1:], s[1:] + o[1:]):
            return (
                f"{shape_str(g)} is the Jacobian of the batch's one example: the shapes of "
                f"one row of {out_name}, {shape_str(o[1:])}, and of input {i}, "
                f"{shape_str(s[1:])}. backward never forms Jacobians: a batch input of "
                f"shape {shape_str(s)} gets a gradient of shape {shape_str(s)}, dL/d(input "
                f"{i}). Fix: contract the Jacobian with grad_output: torch.tensordot("
                + ("grad_output[0], J, dims=" if g == o[1:] + s[1:] else "J, grad_output[0], "
                   "dims=")
                + f"{len(o) - 1}).unsqueeze(0), or compute that product without building J."
            )
    for k, o in outs:
        out_name = "the output" if single else f"output {k}"
        if len(s) >= 2 and len(o) >= 2 and s[0] == o[0] > 1 and g in (
                o[1:] + s[1:], s[1:] + o[1:]):
            b, n = s[0], len(o) - 1
            out_row = f"{out_name}, {shape_str(o[1:])}"
            in_row = f"input {i}, {shape_str(s[1:])}"
            if g == o[1:] + s[1:]:
                what, dims, kind = f"of one row of {out_row}, and of {in_row}", n, ""
            else:
                what, kind = f"of one row of {in_row}, and of {out_row}", " (transposed)"
                dims = (list(range(1, n + 1)), list(range(len(s) - 1, len(s) - 1 + n)))
            return (
                f"{shape_str(g)} has the shapes {what}: one example's Jacobian"
                f"{kind}, not the gradient of the "
                f"batch of {b}. backward never forms Jacobians: a batch input of shape "
                f"{shape_str(s)} gets a gradient of shape {shape_str(s)}, row e being "
                f"grad_output[e] times example e's Jacobian. Fix: if every example has this "
                f"Jacobian J (a linear map, say), return torch.tensordot(grad_output, J, "
                f"dims={dims}) (shape {shape_str(s)}); otherwise compute each row's product "
                f"without building J."
            )
    if len(g) > len(s) and g[len(g) - len(s):] == s:
        lead = g[: len(g) - len(s)]
        dims = "0" if len(lead) == 1 else f"dim={tuple(range(len(lead)))}"
        extra = (f"an extra leading dimension of size {lead[0]}" if len(lead) == 1
                 else f"extra leading dimensions {shape_str(lead)}")
        return (
            f"{shape_str(g)} is input {i}'s shape {shape_str(s)} with {extra}. If "
            f"{'it holds' if len(lead) == 1 else 'they hold'} separate "
            f"contributions (one per example, per output, per term), their sum is the "
            f"gradient: return grad.sum({dims}); if they are a batch, the batch belongs in "
            f"input {i}'s own shape: a (b, n) input gets a (b, n) gradient."
        )
    if len(g) == len(s) and broadcasts_to(s, g):
        dims = tuple(d for d in range(len(s)) if s[d] == 1 and g[d] != 1)
        return (
            f"input {i} has size 1 in dimension{'s' if len(dims) > 1 else ''} "
            f"{', '.join(map(str, dims))}, where the gradient does not: forward broadcast "
            f"input {i}, so its gradient is summed over the broadcast dimensions. Fix: return "
            f"grad.sum(dim={dims if len(dims) > 1 else dims[0]}, keepdim=True)."
        )
    if len(g) < len(s) and s[len(s) - len(g):] == g:
        batch = [(k, o) for k, o in outs if len(s) - len(g) == 1 and o and o[0] == s[0] > 1]
        if batch:
            k, o = batch[0]
            return (
                f"{shape_str(g)} lacks input {i}'s leading dimension of size {s[0]}, the "
                f"batch that {'the output' if single else f'output {k}'} {shape_str(o)} has "
                f"too. backward neither "
                f"sums nor averages over the batch: a batch input of shape {shape_str(s)} "
                f"gets a gradient of shape {shape_str(s)}, row e being dL/d(input {i}[e]), "
                f"and a mean over the batch in the loss already reaches backward as a factor "
                f"1/{s[0]} in grad_output. Fix: if this is the examples' gradients summed or "
                f"averaged over the batch, return them without that reduction (if instead "
                f"every row of input {i} gets this same gradient, return "
                f"grad.expand({shape_str(s)}).clone())."
            )
        return (
            f"{shape_str(g)} lacks input {i}'s leading dimension"
            f"{'s' if len(s) - len(g) > 1 else ''} {shape_str(s[: len(s) - len(g)])}. If every "
            f"slice of input {i} gets this same gradient, return grad.expand({shape_str(s)})"
            f".clone(); otherwise compute the gradient per element of input {i}."
        )
    if len(s) >= 2 and g == s[::-1]:
        perm = "mT" if len(s) == 2 else f"permute({', '.join(map(str, range(len(s) - 1, -1, -1)))})"
        return f"{shape_str(g)} is input {i}'s shape reversed: return grad.{perm}."
    if math.prod(g) == math.prod(s):
        return (
            f"{shape_str(g)} has the right number of elements ({math.prod(s)}) in the wrong "
            f"shape: if they are in input {i}'s order, return grad.reshape(input.shape)."
        )
    return (
        f"Fix: return grad_output times the Jacobian d(output)/d(input {i}), a tensor of "
        f"shape {shape_str(s)}."
    )


def dtype_message(call: str, fname: str, i: int, value: Tensor, slot: Slot,
                   torch_line: bool = True) -> str:
    gd, sd = value.dtype, slot.dtype or value.dtype
    own = slot.leaf_dtype or sd  # (a leaf's grad_dtype, what torch casts to, may differ)
    kept = f" (a leaf whose grad_dtype is {sd})" if slot.leaf_dtype else ""
    takes = (f", or the grad_dtype of a leaf that sets one ({sd}, the dtype its .grad holds: "
             f"torch takes a {sd} or {own} gradient for it)" if slot.leaf_dtype else "")
    lines = [
        f"{call}: {fname}.backward returned a gradient of dtype {gd} at index {i}, but "
        f"forward input {i} has dtype {own}{kept}.",
        f"  dL/d(input {i}) holds one {dtype_name(own)} number per element of input {i}: a "
        f"gradient has its input's dtype (and shape, and device){takes}.",
    ]
    input_complex = sd.is_complex
    fix = ("  Fix: compute in grad_output's dtype: tensors made in backward with torch.tensor"
           "(...), torch.from_numpy(...) or a float64 constant tensor take dtype="
           "grad_output.dtype; or return grad.to(input.dtype).")
    if value.is_floating_point() and input_complex:  # (a real gradient, in a real output's dtype)
        lines.append(
            f"  torch casts it to {sd} with a zero imaginary part without a word: that is right "
            f"only where dL/d(input {i}) is real (forward reads input {i}'s real part alone, as "
            f"z.real * c); a complex input's gradient is complex otherwise (for z.abs(): "
            f"grad_output * z / z.abs())."
        )
        fix = (f"  Fix: return the complex gradient; where it is real, return grad.to({sd}) "
               f"to say so.")
    elif value.is_floating_point() or value.is_complex() == input_complex:
        lines.append(
            f"  torch does not catch this: it casts the gradient to {sd} without a word, so "
            f"the mistake (usually a float64 or integer tensor made inside backward) goes "
            f"unnoticed."
        )
    elif torch_line:
        lines.append(
            "  torch reports this as: Expected isFloatingType(grad.scalar_type()) || "
            "(input_is_complex == grad_is_complex) to be true, but got false."
        )
    else:
        lines.append(
            "  torch casts a floating-point gradient to its input's dtype, but it never turns "
            "a complex gradient into a real one, nor an integer one into a complex one."
        )
    lines.append(fix)
    return "\n".join(lines)
