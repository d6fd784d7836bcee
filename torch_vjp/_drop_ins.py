"""What ``torch_vjp.grad`` and ``torch_vjp.backward`` do, and what checked mode's wrappers of
``torch.autograd.grad``, ``torch.autograd.backward`` and ``Tensor.backward`` do in a checked
scope: torch's own steps, with the checker in place of torch's validation of
``grad_outputs``.

NOTE [transparent checks]
A checked call behaves exactly as torch's own whenever torch accepts it: the same
signatures (positional arguments, ``only_inputs``, ``grad_variables``), any iterable where
torch takes one, the same results, the same warnings (plus torch_vjp's own about silent
casts), ``__torch_function__`` overrides called with torch's own function, TorchScript
compiling the call to torch's built-in. For a call torch rejects, the error's message is
torch's own sentence, with the explanation attached as a note (NOTE [torch's sentence first]
in ``_errors``). And torch is the final judge: when the checker finds a mistake, torch's own
function is run on the same arguments (nothing runs before torch's own validation fails); if
torch raises in its own validation of the vectors (``_checked_scope._torch_validation``), the
checker's error is raised; any other error passes through untouched: one of running the
graph (a missing derivative, the user's own backward or hook, failing in their code or in
torch's), one torch raises about another argument first, one another library's patch raises.
If torch accepts the call after all, its result is returned, with a
:class:`~torch_vjp.GradOutputsWarning` quoting the checker. So a call is never rejected that
torch accepts, and torch's and the user's own errors stay theirs.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge
from torch.overrides import handle_torch_function, has_torch_function, is_tensor_like

from torch_vjp._checked_scope import (
    _AUTOGRAD,
    _ENGINE_ENTRY,
    _GENUINE_BACKWARD,
    _GENUINE_GRAD,
    _HAS_ENGINE,
    _arbitrate,
    _at,
    _engine,
    _torch_validation,
)
from torch_vjp._check_messages import STAND_IN_NODE, output_type_message
from torch_vjp._nested_messages import nested_note
from torch_vjp._shape_messages import frozen_message, input_name, inputs_message, unused_message
from torch_vjp._check_labels import Labels, keyed
from torch_vjp._checks import as_entries, integer_grad_dtype, normalize_grad_outputs
from torch_vjp._errors import (
    GradOutputsError,
    GradOutputsTypeError,
    a_type,
    shape_str,
    torch_first,
    user_stacklevel,
)

__all__: list[str] = []


def _materialized(inputs: Any, ins: tuple[Any, ...]) -> Any:
    """What to pass on as ``inputs``: a dict as it is (torch returns a dict for it), else the
    tuple read from it (a generator is consumed once)."""
    return inputs if inputs is None or type(inputs) is dict else ins


def _reusable(given: Any, entries: tuple[Any, ...] | None) -> Any:
    """``given`` itself if reading it again is harmless (the checker's messages then see what
    the caller passed, a single tensor say), else the entries already read from it."""
    if given is None or isinstance(given, (Tensor, tuple, list)):
        return given
    return entries


def _plain(items: Iterable[Any]) -> bool:
    """Whether every item is a Tensor we can validate directly (no GradientEdge, no nested
    tensor); anything else goes to torch unchanged."""
    for t in items:
        if not isinstance(t, Tensor) or t.is_nested:
            return False
    return True


def _edge_stand_in(edge: GradientEdge) -> Tensor | None:
    """A tensor with what torch's ``_make_grads`` reads of a GradientEdge output (shape,
    dtype, device: the metadata of the edge's node at its input), for the checker; None
    where that is not known (no metadata in this torch, a nested tensor). Made with torch's
    dispatch modes and subclasses out of the way: it is the checker's own, and a
    ``TorchDispatchMode`` the caller runs (a logger, a FLOP counter) sees only what torch's
    own call does."""
    try:
        meta = edge.node._input_metadata[edge.output_nr]
        if meta.is_nested_tensor or meta.is_cpp_nested_tensor:
            return None
        shape, dtype, device = torch.Size(meta.shape), meta.dtype, meta.device
        if not (dtype.is_floating_point or dtype.is_complex):
            return None
        with torch._C._DisableTorchDispatch():
            stand_in = torch.empty_strided(shape, (0,) * len(shape), dtype=dtype,
                                           device=device)
    except (AttributeError, IndexError, TypeError, RuntimeError):
        return None
    setattr(stand_in.requires_grad_(), STAND_IN_NODE, edge.node)
    if type(edge.node).__name__ == "AccumulateGrad":  # a leaf's edge: its grad_dtype counts
        try:
            stand_in.grad_dtype = edge.node.variable.grad_dtype
        except (AttributeError, RuntimeError, TypeError):  # (a torch without grad_dtype)
            pass
    return stand_in


def _torch_makes_edge_grads(
    outs: tuple[Any, ...], entries: tuple[Any, ...] | None, normalized: tuple[Any, ...]
) -> tuple[Any, ...]:
    """``normalized`` as handed to torch's own function: None again where the caller gave
    None for a GradientEdge output, so that torch's ``_make_grads`` makes its implicit
    gradient (``torch.ones`` of the edge's shape) itself, as without the check, rather than
    the checker's ``ones_like`` of the stand-in (:func:`_edge_stand_in`)."""
    given = entries or ()
    return tuple(
        None if isinstance(o, GradientEdge) and (i >= len(given) or given[i] is None) else g
        for i, (o, g) in enumerate(zip(outs, normalized))
    )


def _checkable(outs: tuple[Any, ...]) -> tuple[Tensor, ...] | None:
    """``outs`` as the checker sees them: the tensors, with a stand-in for each GradientEdge
    (:func:`_edge_stand_in`); None where one is neither (or a nested tensor): torch judges."""
    if _plain(outs):
        return outs
    seen: list[Tensor] = []
    for o in outs:
        if isinstance(o, GradientEdge):
            o = _edge_stand_in(o)
        if not isinstance(o, Tensor) or o.is_nested:
            return None
        seen.append(o)
    return tuple(seen)


def _check_outputs(outs: tuple[Any, ...], labels: Labels,
                   outputs: Any = None) -> tuple[Tensor, ...]:
    """``outs`` as the checker sees them (:func:`_checkable`), for torch_vjp's own
    ``check_grad_outputs``: an output that is neither a tensor nor a GradientEdge raises.
    ``outputs``: the outputs as the caller passed them, where known (for the message)."""
    checked = _checkable(outs)
    if checked is not None:
        return checked
    for i, o in enumerate(outs):
        if isinstance(o, GradientEdge) and _edge_stand_in(o) is None:
            raise GradOutputsTypeError(
                f"{labels.call}: {labels.out(i)} is a GradientEdge whose shape, dtype and "
                f"device this version of torch does not tell; pass the tensor itself."
            )
        if not isinstance(o, (Tensor, GradientEdge)):
            raise GradOutputsTypeError(output_type_message(labels, i, o, outputs))
    return outs  # (nested tensors: the checker reads them as they are)


def _unchecked(labels: Labels, outs: tuple[Any, ...], run_torch: Callable[[], Any],
               given: Any = None, outputs: Any = None) -> Any:
    """torch's own call, for outputs the checker does not read (:func:`_checkable`). An
    output that is neither a tensor nor a GradientEdge (None, a number, ``loss.item()``) is
    refused by torch's ``_make_grads`` with a bare ``AssertionError("Expected output to be a
    torch.Tensor")``, and a vector that does not fit a jagged nested output with "Mismatch
    in shape": those errors, torch's class and sentence, get the explanation as a note
    (NOTE [torch's sentence first]); any other passes through untouched. ``given``: the
    vectors as the caller passed them; ``outputs``: the outputs as the caller passed them
    (a dict, read by its keys, is told as such)."""
    try:
        return run_torch()
    except RuntimeError as err:
        note = nested_note(err, labels, outs, given)
        if note is None or not _torch_validation(err) or not hasattr(err, "add_note"):
            raise
        _explain(err, note)
        raise
    except AssertionError as err:
        bad = [i for i, o in enumerate(outs)
               if not isinstance(o, (Tensor, GradientEdge)) and not is_tensor_like(o)]
        if not bad or not _torch_validation(err):
            raise
        explanation = output_type_message(labels, bad[0], outs[bad[0]], outputs)
        if not hasattr(err, "add_note"):  # pragma: no cover - Python 3.10
            raise torch_first(AssertionError, explanation, str(err)) from None
        _explain(err, explanation)
        raise


def _overridden(labels: Labels, outs: tuple[Any, ...], ins: tuple[Any, ...] | None,
                given: Any, batched: bool, run_torch: Callable[[Any], Any],
                outputs: Any = None) -> Any:
    """A call that goes to torch's ``__torch_function__`` protocol (a subclass that overrides
    it among the outputs or inputs, a ``TorchFunctionMode`` active), checked first as any
    other: torch's own function runs under the override with torch's checks only, which let a
    wrong shape of a later output through as an unrelated broadcasting error and report
    wrong shapes with ``is_grads_batched``. The checker reads the tensors with
    ``__torch_function__`` out of the way, so an override sees only what torch's own call
    shows it; a mistake is judged by torch as for any call (NOTE [transparent checks]).
    ``run_torch(vectors)`` is torch's function (through the override) on those vectors."""
    error = None
    with torch._C.DisableTorchFunction():
        seen = _checkable(outs)
        if seen is not None:
            entries = as_entries(given, labels, outs)
            vectors = _reusable(given, entries)
            try:
                normalize_grad_outputs(seen, vectors, labels, is_grads_batched=batched,
                                       inputs=ins)
            except GradOutputsError as err:
                error = err
    if seen is None:
        return _unchecked(labels, outs, lambda: run_torch(given), given, outputs)
    if error is not None:
        return _judged(error, labels, lambda: run_torch(entries), _override_name(outs, ins))
    return run_torch(vectors)


def _override_name(outs: tuple[Any, ...], ins: tuple[Any, ...] | None) -> str:
    """Whose ``__torch_function__`` torch hands a call on these tensors to, in words: the
    tensor types that override it, else an active ``TorchFunctionMode``."""
    plain = (_function_of(Tensor), torch._C._disabled_torch_function_impl)
    types = []
    for t in (*outs, *(ins or ())):
        kind = type(t)
        if is_tensor_like(t) and kind not in types and _function_of(kind) not in plain:
            types.append(kind)
    if not types:
        return "the active TorchFunctionMode's __torch_function__"
    return " or ".join(f"{kind.__name__}.__torch_function__" for kind in types)


def _function_of(kind: type) -> Any:
    """The function behind ``kind.__torch_function__`` (a classmethod binds anew on each
    access)."""
    method = getattr(kind, "__torch_function__", None)
    return getattr(method, "__func__", method)


#: torch's engine's sentences for an input that does not require grad: ``grad``'s, and
#: ``backward``'s (it retains the gradient of each of its ``inputs``).
_FROZEN_INPUT = ("One of the differentiated Tensors does not require grad",
                 "can't retain_grad on Tensor that has requires_grad=False")
#: torch's engine's sentence for an input no output depends on.
_UNUSED = re.compile(r"The differentiated Tensor at index (\d+) appears to not have been used")


def _frozen_inputs(labels: Labels, outs: tuple[Any, ...], inputs: Any, ins: tuple[Any, ...],
                   run_torch: Callable[[], Any]) -> Any:
    """``run_torch()``, with torch's bare sentence for an input that does not require grad
    (raised by its engine before any node runs) explained: which inputs, and the fixes.
    The same sentence from anywhere else (a backward's or a hook's own) passes through."""
    try:
        return run_torch()
    except RuntimeError as err:
        explained = _frozen_error(err, labels, outs, inputs, ins)
        if explained is None:
            raise
        raise explained from None


def _raised_by_engine(err: BaseException) -> bool:
    """Whether ``err`` was raised by torch's engine entry itself (its innermost frame), not
    by a function of the user's that the backward pass ran."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and _at(tb.tb_frame.f_code, _ENGINE_ENTRY)


def _frozen_error(err: RuntimeError, labels: Labels, outs: tuple[Any, ...], inputs: Any,
                  ins: tuple[Any, ...]) -> BaseException | None:
    """The explained error for torch's ``err`` (:func:`_frozen_inputs`), or None where
    ``err`` is another. (Also for no outputs at all: torch's engine then finds the first
    input unused, and suggests allow_unused=True, which gives None for every input.)"""
    if not _raised_by_engine(err):
        return None
    if str(err).startswith(_INTEGER_GRAD):
        return _integer_leaf_error(labels, outs, inputs, ins)
    unused = _UNUSED.match(str(err))
    if not outs and unused and unused.group(1) == "0":
        return torch_first(GradOutputsError, (
            f"{labels.call}: {labels.outputs} is empty, so there is nothing to differentiate: "
            f"the gradient of nothing with respect to {labels.inputs} is not defined "
            f"(allow_unused=True would give None for each input). Fix: pass the tensors to "
            f"differentiate, e.g. the loss; an empty list of losses often means the loop that "
            f"collects them never ran."), str(err))
    if unused and int(unused.group(1)) < len(ins):
        return torch_first(GradOutputsError, unused_message(
            labels, inputs, ins, int(unused.group(1)), outs), str(err))
    bad = [j for j, t in enumerate(ins) if not isinstance(t, (Tensor, GradientEdge))]
    if bad and str(err).startswith("all inputs have to be Tensors or GradientEdges"):
        return torch_first(GradOutputsError, inputs_message(labels, inputs, ins, bad[0]),
                           str(err))
    if not str(err).startswith(_FROZEN_INPUT):
        return None
    frozen = [j for j, t in enumerate(ins) if isinstance(t, Tensor) and not t.requires_grad]
    if not frozen:
        return None
    return torch_first(GradOutputsError, frozen_message(labels, inputs, ins, frozen),
                       str(err))


#: torch's engine's internal assert for a gradient of an integer dtype (a leaf's grad_dtype).
_INTEGER_GRAD = "isDifferentiableType(grad.scalar_type()) INTERNAL ASSERT"


def _leaf_integer_grad_dtype(t: Tensor) -> bool:
    return t.grad_fn is None and integer_grad_dtype(t)


def _integer_leaf_error(labels: Labels, outs: tuple[Any, ...], inputs: Any,
                        ins: tuple[Any, ...]) -> BaseException | None:
    """The error for torch's internal assert on a leaf, other than an output (the checker
    tells those), whose ``grad_dtype`` is an integer dtype: torch casts the gradient that
    reaches it to that dtype. The leaf is one of ``ins`` (those torch accumulates into or
    returns), else, for ``backward`` without ``inputs``, one of the graph's leaves."""
    leaves = [getattr(getattr(t, "node", None), "variable", t) for t in ins]
    keys = list(inputs) if type(inputs) is dict else None
    bad = [j for j, t in enumerate(leaves) if isinstance(t, Tensor) and _leaf_integer_grad_dtype(t)]
    if bad:
        leaf = leaves[bad[0]]
        name = input_name(labels, keys, bad[0])
        said, its = f"{name} is a leaf whose grad_dtype is {leaf.grad_dtype}", f"{name}."
    else:
        leaf, todo, seen = None, [getattr(o, "grad_fn", getattr(o, "node", None))
                                  for o in outs], set()
        while todo and leaf is None:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            t = getattr(node, "variable", None)
            leaf = t if isinstance(t, Tensor) and _leaf_integer_grad_dtype(t) else None
            todo.extend(f for f, _ in getattr(node, "next_functions", ()))
        if ins or leaf is None:
            return None
        said = (f"a leaf tensor of shape {shape_str(leaf.shape)} that {labels.outputs} "
                f"depend on has grad_dtype {leaf.grad_dtype}")
        its = "that leaf's "
    return GradOutputsError(
        f"{labels.call}: {said}: torch casts its gradient to that dtype, and an integer or "
        f"boolean tensor cannot hold a gradient (torch's engine fails on it with an internal "
        f"assert).\n  Fix: set {its}grad_dtype to a floating-point dtype (its own, "
        f"{leaf.dtype}), or to None to keep each gradient in the dtype it comes in, before "
        f"the backward pass.")


def _not_inputs(labels: Labels, inputs: Any, ins: Any, run_torch: Callable[[], Any]) -> Any:
    """``run_torch()`` for ``inputs`` torch reads no tensors from, its TypeError explained."""
    try:
        return run_torch()
    except TypeError as err:
        if ins is not None or not _raised_by_engine(err):
            raise
        raise torch_first(GradOutputsTypeError, inputs_message(labels, inputs, None, -1),
                          str(err)) from None


def _judged(err: GradOutputsError, labels: Labels, run_torch: Callable[[], Any],
            override: str | None = None) -> Any:
    """Torch judges the checker's ``err`` (``_arbitrate``), except where torch has no verdict
    to give (``unjudged``): its engine meets that call with an internal assert, a bug
    report, so the checker's error is raised as it is. ``override``: as for ``_arbitrate``."""
    if getattr(err, "unjudged", False):
        raise err
    return _arbitrate(err, labels, run_torch, override)


def _explain(err: BaseException, explanation: str) -> None:
    """Adds ``explanation`` to ``err`` as a note, once: in a checked scope, a call whose
    outputs have ``__torch_function__`` (a jagged nested tensor) comes back to the checking
    wrapper through torch's override protocol, and the error passes both."""
    if explanation not in getattr(err, "__notes__", ()):
        err.add_note(explanation)


def _outputs_tuple(outputs: Any, labels: Labels) -> tuple[Any, ...]:
    """``outputs`` as torch reads it: one tensor (or GradientEdge), or any iterable of them."""
    if isinstance(outputs, (Tensor, GradientEdge)) or is_tensor_like(outputs):
        return (outputs,)
    try:
        return tuple(outputs)
    except TypeError as err:
        raise torch_first(
            GradOutputsTypeError,
            f"{labels.call}: {labels.outputs} is {_a(outputs)}, but it must be a tensor or a "
            f"sequence of tensors: the outputs y whose vector-Jacobian product is taken (for a "
            f"training step, the loss).",
            str(err),
        ) from None


def _a(obj: object) -> str:
    return a_type(obj)


def _inputs_tuple(inputs: Any) -> tuple[Any, ...] | None:
    """``inputs`` as torch reads it, or None where torch itself must judge it (a Mapping
    that is not a dict, something not iterable)."""
    if isinstance(inputs, (Tensor, GradientEdge)) or is_tensor_like(inputs):
        return (inputs,)
    if type(inputs) is dict:
        return tuple(inputs.values())
    if isinstance(inputs, Mapping):
        return None
    try:
        return tuple(inputs)
    except TypeError:
        return None


def _grad(
    labels: Labels,
    torch_grad: Callable[..., Any],
    outputs: Any,
    inputs: Any,
    grad_outputs: Any,
    retain_graph: bool | None,
    create_graph: bool,
    only_inputs: bool,
    allow_unused: bool | None,
    is_grads_batched: bool,
    materialize_grads: bool,
) -> Any:
    """torch.autograd.grad's steps, with the checker in place of ``_make_grads``.

    ``torch_grad`` is the function this call stands in for (torch's own, or what was
    installed before the checking wrapper): everything unusual is handed to it.
    """
    outs = _outputs_tuple(outputs, labels)
    ins = _inputs_tuple(inputs)
    if type(inputs) is dict:
        labels = keyed(labels, None, inputs)  # (an input named by its key)
    if ins is None or not ins:  # torch raises its own error for these, explained
        return _not_inputs(labels, inputs, ins, lambda: torch_grad(
            outs, inputs, grad_outputs, retain_graph, create_graph, only_inputs,
            allow_unused, is_grads_batched, materialize_grads))
    inputs_arg = _materialized(inputs, ins)
    overridable = tuple(t for t in outs if is_tensor_like(t)) + tuple(
        t for t in ins if is_tensor_like(t)
    )
    if has_torch_function(overridable):
        if torch_grad is not _GENUINE_GRAD:
            return torch_grad(outs, inputs_arg, grad_outputs, retain_graph, create_graph,
                              only_inputs, allow_unused, is_grads_batched, materialize_grads)
        # (torch passes what torch.autograd.grad names now: its own function looks itself
        # up by name, so a checked block hands overrides the checking wrapper too)
        result = _frozen_inputs(labels, outs, inputs, ins, lambda: _overridden(
            labels, outs, ins, grad_outputs, is_grads_batched,
            lambda vectors: handle_torch_function(
                _AUTOGRAD.grad, overridable, outs, ins, grad_outputs=vectors,
                retain_graph=retain_graph, create_graph=create_graph, only_inputs=only_inputs,
                allow_unused=allow_unused, is_grads_batched=is_grads_batched,
                materialize_grads=materialize_grads,
            ), outputs))
        return dict(zip(inputs.keys(), result)) if type(inputs) is dict else result
    if not only_inputs:
        warnings.warn(
            "only_inputs argument is deprecated and is ignored now (defaults to True). To "
            "accumulate gradient for other parts of the graph, please use "
            "torch.autograd.backward.",
            FutureWarning,
            stacklevel=user_stacklevel(),
        )
    seen = _checkable(outs)
    if seen is None:
        return _unchecked(labels, outs, lambda: torch_grad(
            outs, inputs_arg, grad_outputs, retain_graph, create_graph, True, allow_unused,
            is_grads_batched, materialize_grads), grad_outputs, outputs)
    entries = as_entries(grad_outputs, labels, outs)
    try:
        gos = normalize_grad_outputs(
            seen, _reusable(grad_outputs, entries), labels, is_grads_batched=is_grads_batched,
            inputs=ins,
        )
    except GradOutputsError as err:
        return _judged(err, labels, lambda: torch_grad(
            outs, inputs_arg, entries, retain_graph, create_graph, True, allow_unused,
            is_grads_batched, materialize_grads,
        ))
    if seen is not outs:
        gos = _torch_makes_edge_grads(outs, entries, gos)
    if (
        not _HAS_ENGINE
        or torch_grad is not _GENUINE_GRAD
        or is_grads_batched
        or materialize_grads
        or type(inputs) is dict
        or seen is not outs
        or not _plain(ins)
    ):
        return _frozen_inputs(labels, outs, inputs, ins, lambda: torch_grad(
            outs, inputs_arg, gos, retain_graph, create_graph, True, allow_unused,
            is_grads_batched, materialize_grads))
    # NOTE [skipping torch's _make_grads]
    # torch.autograd.grad validates grad_outputs in Python (``_make_grads``) and then runs the
    # C++ engine. ``normalize_grad_outputs`` has already done that validation, more cheaply
    # and with better messages, and produced the same normalised grad_outputs (``ones_like``
    # for scalar outputs), so we call the engine entry torch itself calls, with the same
    # arguments. Anything unusual (batched, materialize_grads, dict inputs, tensor subclasses
    # with __torch_function__, GradientEdge, nested tensors) goes through torch's function
    # (GradientEdge outputs after the checker has seen their stand-ins: ``_checkable``).
    if retain_graph is None:
        retain_graph = create_graph
    return _frozen_inputs(labels, outs, inputs, ins, lambda: _engine(
        outs, gos, retain_graph, create_graph, ins,
        False if allow_unused is None else allow_unused, accumulate_grad=False,
    ))


def _backward(
    labels: Labels,
    torch_backward: Callable[..., Any],
    tensors: Any,
    grad_tensors: Any,
    retain_graph: bool | None,
    create_graph: bool,
    grad_variables: Any,
    inputs: Any,
) -> None:
    """torch.autograd.backward's steps, with the checker in place of ``_make_grads``."""
    if torch._C._are_functorch_transforms_active():  # torch raises its own error
        return torch_backward(tensors, grad_tensors, retain_graph, create_graph,
                              grad_variables, inputs=inputs)
    if grad_variables is not None:
        # (torch warns of the deprecated name first, whether or not it then raises)
        warnings.warn("`grad_variables` is deprecated. Use `grad_tensors` instead.",
                      FutureWarning, stacklevel=user_stacklevel())
        if grad_tensors is not None:
            raise torch_first(
                GradOutputsError,
                f"{labels.call}: both grad_tensors and grad_variables were given; "
                f"grad_variables is the deprecated name of grad_tensors, so only one may be. "
                f"Fix: pass grad_tensors alone.",
                "`grad_tensors` and `grad_variables` (deprecated) arguments both passed to "
                "`backward()`. Please only use `grad_tensors`.",
            )
        grad_tensors = grad_variables
    if inputs is None:
        ins: tuple[Any, ...] | None = ()
    else:
        ins = _inputs_tuple(inputs)
        if type(inputs) is dict:
            labels = keyed(labels, None, inputs)  # (an input named by its key)
    if ins is None or (inputs is not None and not ins):  # torch raises its own error
        return _not_inputs(labels, inputs, ins, lambda: torch_backward(
            tensors, grad_tensors, retain_graph, create_graph, inputs=inputs))
    inputs_arg = _materialized(inputs, ins)
    outs = _outputs_tuple(tensors, labels)
    overridable = tuple(t for t in outs if is_tensor_like(t)) + tuple(
        t for t in ins if is_tensor_like(t)
    )
    if has_torch_function(overridable):
        if torch_backward is not _GENUINE_BACKWARD:
            return torch_backward(outs, grad_tensors, retain_graph, create_graph,
                                  inputs=inputs_arg)
        return _frozen_inputs(labels, outs, inputs, ins, lambda: _overridden(
            labels, outs, ins or None, grad_tensors, False,
            lambda vectors: handle_torch_function(
                _AUTOGRAD.backward, overridable, outs, grad_tensors=vectors,
                retain_graph=retain_graph, create_graph=create_graph,
                inputs=ins if inputs is not None else None,
            ), tensors))
    seen = _checkable(outs)
    if seen is None:
        return _unchecked(labels, outs, lambda: torch_backward(
            outs, grad_tensors, retain_graph, create_graph, inputs=inputs_arg), grad_tensors,
            tensors)
    entries = as_entries(grad_tensors, labels, outs)
    try:
        gts = normalize_grad_outputs(
            seen, _reusable(grad_tensors, entries), labels, inputs=ins or None
        )
    except GradOutputsError as err:
        return _judged(err, labels, lambda: torch_backward(
            outs, entries, retain_graph, create_graph, inputs=inputs_arg))
    if seen is not outs:
        gts = _torch_makes_edge_grads(outs, entries, gts)
    if (not _HAS_ENGINE or torch_backward is not _GENUINE_BACKWARD or seen is not outs
            or not _plain(ins)):
        return _frozen_inputs(labels, outs, inputs, ins, lambda: torch_backward(
            outs, gts, retain_graph, create_graph, inputs=inputs_arg))
    # See NOTE [skipping torch's _make_grads]: the engine call of torch.autograd.backward.
    if retain_graph is None:
        retain_graph = create_graph
    _frozen_inputs(labels, outs, inputs, ins, lambda: _engine(
        outs, gts, retain_graph, create_graph, ins, allow_unreachable=True,
        accumulate_grad=True))
    return None


