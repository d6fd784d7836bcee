"""Checked mode's judgement of what a custom Function's backward returned, on every call
(NOTE [checked custom backwards] in :mod:`torch_vjp._checked_mode`): ``backward_return_ok``, the
fast path; ``backward_problems``, the diagnosis behind it, worded by the message builders of
:mod:`torch_vjp._backward_check`; ``torch_verdict``, torch's own verdict from a replay.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from torch_vjp._backward_check import (
    Slot,
    as_tuple,
    broadcasts_to,
    count_message,
    device_message,
    dtype_message,
    engine_grad_dtype,
    list_message,
    non_tensor_input_message,
    shape_message,
    slots_from_node,
    summed_idiom,
    type_message,
)
from torch_vjp._errors import chained


def backward_return_ok(node: Any, returned: Any) -> bool:
    """Whether what a custom Function's backward returned passes checked mode at a glance:
    the fast path, run on every call (NOTE [fast path, slow message] in ``_checks``).

    ``node`` is the Function's graph node (its ``ctx``), ``returned`` backward's raw return
    value. The rules: one value per forward input (extra trailing ``None`` values are fine:
    torch drops them), each ``None`` or a tensor, and a tensor for an input that needs a
    gradient has the dtype and device torch's engine expects there (the metadata of the
    node's next edge) and its shape, or the shape of one of forward's outputs that the
    input's shape broadcasts to (see :func:`_summed_broadcast`). ``False`` sends the value to
    :func:`backward_problems`; what this loop cannot tell counts as fine, and torch judges
    it: a tensor subclass, metadata torch does not expose (a nested tensor). The cost is a
    few attribute reads per gradient.
    """
    values = returned if type(returned) is tuple else (returned,)
    needs = node.needs_input_grad
    n = len(needs)
    m = len(values)
    if m != n:
        if m < n:
            return False
        for value in values[n:]:
            if value is not None:
                return False
    edges: list[Any] | None = None
    k = 0  # the next edges with a node belong, in order, to the inputs that need grad
    loose = False
    for i in range(n):
        value = values[i]
        if needs[i]:
            if type(value) is Tensor:
                if edges is None:
                    edges = [e for e in node.next_functions if e[0] is not None]
                    if len(edges) != sum(needs):  # pragma: no cover - torch keeps them aligned
                        return True
                fn, nr = edges[k]
                try:
                    meta = fn._input_metadata[nr]
                    if value.device != meta.device or (
                            value.dtype is not meta.dtype
                            and not precision_cast(node, value.dtype, meta.dtype)
                            and not _leaf_takes(fn, value.dtype, meta.dtype)):
                        return False
                    shape = tuple(meta.shape)
                    if value.shape != shape and not _summed_broadcast(node, value.shape, shape):
                        return False
                except (AttributeError, IndexError, RuntimeError, TypeError):
                    pass  # metadata torch does not expose: torch judges
            elif value is not None and not isinstance(value, Tensor):
                return False
            k += 1
        elif value is not None:
            loose = True
    if loose:
        # A value for an input that needs no gradient: torch drops a tensor given for a
        # tensor input, but raises for anything else (the slow path explains). Where some of
        # those inputs are tensors and some are not, the node does not say which: torch
        # judges. (Next to None for an input that needs a gradient, such a tensor is no
        # evidence of misplaced gradients: see backward_problems.)
        if len(node.next_functions) == k:
            return False
        for i in range(n):
            if not needs[i] and values[i] is not None and not isinstance(values[i], Tensor):
                return False
    return True


def _leaf_takes(fn: Any, g: torch.dtype, s: torch.dtype) -> bool:
    """Whether ``fn``, the node a gradient of dtype ``g`` flows into, is the AccumulateGrad
    of a leaf whose ``grad_dtype`` takes ``g`` as it is: ``g`` itself, or None (any dtype of
    the same kind as the leaf's own ``s``)."""
    target = engine_grad_dtype(fn, s)
    if target is None:
        return g.is_floating_point == s.is_floating_point and g.is_complex == s.is_complex
    return target is not s and g is target


def precision_cast(node: Any, g: torch.dtype, s: torch.dtype) -> bool:
    """Whether a gradient of dtype ``g`` for an input of dtype ``s`` is in a precision the
    Function computes in, which torch's engine casts back to ``s`` by design (as it does for
    its own ``.to()``): both floating point, and either ``g`` is the dtype of one of
    forward's outputs (the dtype backward's grad_outputs have: a Function that computes in
    float64, or whose matmul autocast ran in bfloat16, returns gradients in that precision),
    or forward ran under autocast as ``torch.amp.custom_fwd`` records it on the node
    (``_fwd_used_autocast``: ``custom_bwd``'s backward then runs under autocast too, and
    gives a float32 weight a bfloat16 gradient: autocast's dtype, ``_dtype`` on the node, or
    float32; with ``cast_inputs=torch.float32``, forward's outputs are float32, and so is the
    gradient of a bfloat16 activation).
    Valid code, not a mistake to warn of on every step; a gradient of another dtype (a
    float64 tensor made inside the backward of a float32 Function) still is, and so is a
    narrower one where one of forward's outputs has the input's own dtype (a float16 gradient
    for a float32 input of a Function that returns a float32 and a float16 output)."""
    if not ((g.is_floating_point and s.is_floating_point)
            or (g.is_complex and s.is_complex)):  # (complex128 for complex64 as float64 for
        return False                              # float32)
    if getattr(node, "_fwd_used_autocast", False) is True and s is not torch.float64 and (
            g is torch.float32 or g is getattr(node, "_dtype", None)):
        # (autocast computes in its own dtype, or in float32 for the ops it runs there; a
        # float64 tensor made in backward is no precision of autocast's, and autocast casts
        # no float64 tensor: a float64 input's narrower gradient is precision lost)
        return True
    try:
        outs = [m.dtype for m in node._input_metadata]
    except (AttributeError, RuntimeError, TypeError):
        return False
    if g not in outs:
        return False
    # a narrower gradient where forward also returned the input's own dtype is precision
    # lost in backward (a float16 copy among the outputs does not make float16 the
    # precision a float32 input's gradient is computed in), unless it is the dtype of
    # forward's first output, its result (a bfloat16 result that autocast computed, beside
    # a float32 statistic)
    return s not in outs or torch.finfo(g).bits > torch.finfo(s).bits or outs[0] is g


def _summed_broadcast(node: Any, g: Sequence[int], s: Sequence[int]) -> bool:
    """Whether a gradient of shape ``g`` for an input of shape ``s`` is exact once torch
    sums it down to ``s``: ``s`` broadcasts to ``g`` with the same number of elements (the
    sum runs over dimensions of size 1 only), or ``g`` follows torch's idiom
    for an input that forward broadcast: ``g`` is the shape of one of forward's outputs and
    ``s`` broadcasts to it, so the gradient was computed per output element and torch's sum
    over the broadcast dimensions (``sum_to_size``) is exactly the adjoint of broadcasting.
    torch's own reference Functions do this (``NumpyMul`` in
    ``torch.testing._internal.autograd_function_db``)."""
    # (only dimensions of size 1 to sum over: a bias gradient summed with keepdim=True, a
    # (1,) gradient of a 0-d input; torch's sum is then a reshape, the gradient is exact)
    return summed_idiom(tuple(g), tuple(s), lambda: _received_shapes(node))


@dataclass(frozen=True)
class BackwardProblem:
    """One objection of checked mode to what a custom backward returned.

    Attributes:
        index: The position in backward's return value, or ``None`` for the count.
        torch: What torch's own validation does with it, as far as the check can tell:
            ``"rejects"`` (raises), ``"sums"`` (sums a gradient whose shape the input's shape
            broadcasts to down to the input's shape, without a word) or ``"accepts"`` (takes
            it, casting or moving it, or dropping it, without a word).
        message: The explanation: what was returned, what was expected and why, the fix.
        kind: What it is about: ``"list"``, ``"count"``, ``"type"``, ``"non-tensor"``,
            ``"shape"``, ``"dtype"`` or ``"device"`` (to match it with
            torch's sentence where torch's verdict is not known beforehand).
        got: For ``"shape"``, the shape of the returned gradient (torch's sentence names it).
    """

    index: int | None
    torch: str
    message: str
    kind: str = ""
    got: tuple[int, ...] | None = None


def backward_problems(call: str, node: Any, returned: Any) -> list[BackwardProblem]:
    """What checked mode objects to in ``returned``, the raw return value of the backward of
    the custom Function whose graph node (its ``ctx``) is ``node``; the slow path behind
    ``backward_return_ok``, with check_function's messages.

    The rules are check_function's, less what torch allows on purpose: ``None`` for any
    input (torch reads it as zeros), extra trailing ``None`` values (torch drops them), a
    gradient for a tensor input that needs none (torch drops it). Such a tensor next to
    ``None`` for an input of its shape that needs a gradient is not reported as misplaced
    gradients either: the node does not record the shape of an input that needs no
    gradient, so it cannot tell them from a backward that gives one input a zero gradient
    (``None``) and computes the other's without testing ``ctx.needs_input_grad``. What the
    node does not tell is not judged: the shape of an input that needs no gradient, a
    tensor subclass, a nested tensor.
    """
    fname = function_name(node)
    needs = tuple(bool(b) for b in node.needs_input_grad)
    slots = slots_from_node(node, needs)
    n = len(slots)
    if isinstance(returned, list):
        return [BackwardProblem(None, "rejects", list_message(call, fname, returned, False),
                                "list")]
    values = as_tuple(returned)
    if len(values) < n or any(v is not None for v in values[n:]):
        return [BackwardProblem(None, "rejects",
                                count_message(call, fname, values, slots, False), "count")]
    out_shapes = _received_shapes(node)
    in_shapes = [slot.shape for slot in slots]
    problems = []
    for i, slot in enumerate(slots):
        value = values[i]
        if value is None:
            continue
        if not isinstance(value, Tensor):
            problems.append(BackwardProblem(
                i, "rejects", type_message(call, fname, i, value, slot, False), "type"))
        elif slot.kind == "other":
            problems.append(BackwardProblem(
                i, "rejects", non_tensor_input_message(call, fname, i, slot, False),
                "non-tensor"))
        elif (not slot.needs_grad or slot.shape is None or type(value) is not Tensor
              or value.is_nested):
            continue
        else:
            g = tuple(value.shape)
            if g != slot.shape:
                if not broadcasts_to(slot.shape, g):
                    problems.append(BackwardProblem(
                        i, "rejects",
                        shape_message(call, fname, i, g, slot.shape, out_shapes, False, in_shapes),
                        "shape", g))
                    continue
                if not _summed_broadcast(node, g, slot.shape):  # (torch's idiom is fine)
                    problems.append(BackwardProblem(
                        i, "sums",
                        shape_message(call, fname, i, g, slot.shape, out_shapes, False, in_shapes),
                        "shape", g))
            # torch sums a gradient down to its input's shape, casts it to its input's dtype,
            # and then checks its device: a shape it sums or a dtype it casts does not hide a
            # device it rejects (a tensor made in backward without dtype= and device=), so
            # each is told, in torch's order
            if (slot.dtype is not None and value.dtype != slot.dtype
                    and not precision_cast(node, value.dtype, slot.dtype)):
                # (the Function's own precision is cast back by torch by design)
                cast = value.is_floating_point() or value.is_complex() == slot.dtype.is_complex
                problems.append(BackwardProblem(
                    i, "accepts" if cast else "rejects",
                    dtype_message(call, fname, i, value, slot, False), "dtype"))
            if slot.device is not None and value.device != slot.device:
                # (torch moves a gradient that is 0-d once summed down to its input's shape)
                problems.append(BackwardProblem(
                    i, "accepts" if len(slot.shape) == 0 else "rejects",
                    device_message(call, fname, i, value, slot, False), "device"))
    return problems


def function_name(node: Any) -> str:
    """The name of the custom Function whose graph node is ``node``, as its author wrote it
    (torch.func transforms run a Function through a generated one, ``<Name>Generated``)."""
    cls = node._forward_cls
    name = cls.__name__
    if name.endswith("Generated") and torch.autograd.Function not in cls.__mro__:
        return name[: -len("Generated")]
    return name


def _received_shapes(node: Any) -> list[tuple[int, ...] | None]:
    """The shapes of the grad_outputs a node receives (those of forward's outputs), for
    messages; None where torch does not say."""
    try:
        metadata = list(node._input_metadata)
    except (AttributeError, RuntimeError, TypeError):
        return []
    shapes: list[tuple[int, ...] | None] = []
    for m in metadata:
        try:
            shapes.append(None if m.is_nested_tensor else tuple(int(d) for d in m.shape))
        except (AttributeError, RuntimeError, TypeError):
            shapes.append(None)
    return shapes


# At most this many ways of telling which inputs of an ambiguous node are tensors are replayed.
_MAX_REPLAYS = 16


def torch_verdict(node: Any, returned: Any,
                  grad: Callable[..., Any]) -> tuple[bool, BaseException | None]:
    """torch's own verdict on ``returned``, the raw return value of ``node``'s backward.

    Replays it through torch's engine (``grad``, torch's own ``torch.autograd.grad``): a
    stand-in custom Function of the same name, with inputs of the metadata torch expects at
    the node's inputs (one element of storage each), whose backward returns ``returned``.
    torch's validation of the stand-in is the validation of the node: the same count, the
    same tensor and non-tensor positions, the same shapes, dtypes and devices, so the same
    error and sentence. Costs a small backward pass; runs only when the check objects.

    Returns:
        ``(judged, error)``: ``error`` is what torch raises (``None`` when it accepts);
        ``judged`` is False where the node does not tell enough to replay it (the metadata
        of an input that needs a gradient is unknown, or which inputs are tensors is
        ambiguous and the possible answers disagree).
    """
    needs = tuple(bool(b) for b in node.needs_input_grad)
    slots = slots_from_node(node, needs)
    if any(s.needs_grad and (s.shape is None or s.dtype is None or s.device is None)
           for s in slots):
        return False, None
    unknown = [j for j, s in enumerate(slots) if s.kind == "unknown"]
    tensors = len(node.next_functions) - sum(needs)  # inputs that are tensors needing no grad
    known = sum(1 for s in slots if s.kind == "tensor" and not s.needs_grad)
    ways = list(itertools.combinations(unknown, tensors - known)) if unknown else [()]
    if not ways or len(ways) > _MAX_REPLAYS:
        return False, None
    verdicts = []
    for way in ways:
        kinds = ["tensor" if j in way else "other" for j in range(len(slots))]
        for j, s in enumerate(slots):
            if s.kind != "unknown":
                kinds[j] = s.kind
        # (the replay is ours: dispatch modes around the user's backward, an op logger or
        # a FLOP counter, must not see it)
        with _disable_current_modes():
            verdicts.append(_replay(node._forward_cls.__name__, slots, kinds, returned, grad))
    first = verdicts[0]
    if all(type(v) is type(first) and str(v) == str(first) for v in verdicts):
        return True, first
    return False, None


def _replay(name: str, slots: list[Slot], kinds: list[str], returned: Any,
            grad: Callable[..., Any]) -> BaseException | None:
    args: list[Any] = []
    leaves: list[Tensor] = []
    for slot, kind in zip(slots, kinds):
        if kind == "other":
            args.append(None)
        elif slot.needs_grad:  # torch_verdict made sure that shape, dtype, device are known
            shape = slot.shape or ()
            leaf = torch.empty_strided(shape, (0,) * len(shape), dtype=slot.dtype,
                                       device=slot.device).requires_grad_()
            args.append(leaf)
            leaves.append(leaf)
        else:
            args.append(torch.empty(0))
    stand_in = _stand_in(name)
    with torch.enable_grad():
        out = stand_in.apply(*args)
    out.grad_fn._torch_vjp_returned = returned
    try:
        with warnings.catch_warnings():  # anomaly mode's traceback of our stand-in, say
            warnings.simplefilter("ignore")
            grad(out, leaves, allow_unused=True)
    except Exception as err:  # noqa: BLE001 - torch's verdict, returned to the caller
        return _detached(err)
    return None


def _detached(err: BaseException) -> BaseException:
    """``err`` (and the exceptions chained to it) without tracebacks: only its type and
    message are read. A traceback's frames lead back, through ``f_back``, to the frames that
    hold ``err``, and on to the user's step that ran the backward pass: a reference cycle
    that kept the user's activations alive until the cyclic collector ran."""
    for e in chained(err):
        e.__traceback__ = None
    return err


_STAND_INS: dict[str, type[torch.autograd.Function]] = {}


def _stand_in(name: str) -> type[torch.autograd.Function]:
    """A custom Function named ``name`` (so its node is named as the user's in torch's
    sentences) whose node returns what it is given, unchecked."""
    cls = _STAND_INS.get(name)
    if cls is None:
        cls = type(name, (torch.autograd.Function,), {
            "__module__": __name__,
            "forward": staticmethod(_stand_in_forward),
            "backward": staticmethod(_stand_in_backward),
        })
        # Class attributes of the node class: they take precedence over BackwardCFunction's
        # (checked mode's wrappers there never see the stand-in).
        cls._backward_cls.apply = _stand_in_backward  # type: ignore[attr-defined]
        cls._backward_cls.apply_boxed = _stand_in_backward  # type: ignore[attr-defined]
        _STAND_INS[name] = cls
    return cls


def _stand_in_forward(ctx: Any, *args: Any) -> Tensor:
    return torch.zeros(())


def _stand_in_backward(ctx: Any, *grads: Any) -> Any:
    return ctx._torch_vjp_returned
