"""Checked mode's slow path for what a custom Function's backward returned (NOTE [checked
custom backwards] in :mod:`torch_vjp._checked_mode`): the explanation, with torch as the
judge (``_judge_backward``), and torch's engine's later refusal of such a value explained
where torch was left to judge it (``_engine_errors_explained``, the objections it kept per
thread).
"""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
from typing import Any

import torch

from torch_vjp._backward_check import Slot, non_tensor_input_message
from torch_vjp._backward_checked import backward_problems, function_name, torch_verdict
from torch_vjp._checked_scope import _GENUINE_GRAD
from torch_vjp._errors import (
    FunctionCheckError,
    FunctionCheckWarning,
    torch_first,
    user_stacklevel,
)

__all__: list[str] = []


_CHECKED = "torch_vjp.checked"  # how messages about custom backwards name checked mode

_NOT_A_VARIABLE = re.compile(
    r"function (\w+)Backward returned a gradient different than None at position (\d+), "
    r"but the corresponding forward input was not a Variable"
)


# torch's sentences for what a custom backward returned, and what each is about (the
# ``kind`` of a BackwardProblem)
_TORCH_SENTENCES = (
    (re.compile(r"Function (\w+)Backward returned an invalid gradient at index (\d+) - got "
                r"\[([\d, ]*)\]"), "shape"),
    (re.compile(r"Function (\w+)Backward returned an invalid gradient at index (\d+) - "
                r"expected device"), "device"),
    (re.compile(r"function (\w+)Backward returned an incorrect number of gradients"), "count"),
    (re.compile(r"^expected Variable or None \(got (?!list\))"), "type"),  # (names no Function)
    (_NOT_A_VARIABLE, "non-tensor"),  # (its position counts from 1)
)
# The objections to a backward's value that torch was left to judge (``_judge_backward``):
# (thread, name of its Function, objections), explained once torch's error comes through.
# Shared by all threads (a CUDA node's backward runs on the engine's device thread, not the
# caller's): a checked call clears only its own thread's, and takes an objection only where
# it is about what torch's sentence names (the Function, the index, the shape returned),
# its own thread's first, so that a concurrent call's objection is neither lost nor told.
_unjudged: list[tuple[int, str, list[Any]]] = []
_unjudged_lock = threading.Lock()


def _matching(rejected: list[Any], sentence: str) -> Any:
    """The objection that torch's ``sentence`` is about (the first where it cannot tell)."""
    for pattern, kind in _TORCH_SENTENCES:
        if pattern.search(sentence) is not None:
            return next((p for p in rejected if p.kind == kind), rejected[0])
    return rejected[0]


def _with_the_rest(node: Any, told: Any, problems: list[Any]) -> str:
    """``told``'s message, followed by the first line of every other objection in
    ``problems``: torch names one mistake at a time, and fixing only that one would run into
    the next."""
    prefix = f"{_CHECKED}: {function_name(node)}.backward "
    rest = [p.message.splitlines()[0].removeprefix(prefix) for p in problems if p is not told]
    if not rest:
        return told.message
    return (f"{told.message}\n  {function_name(node)}.backward has more to fix: it "
            + "; it ".join(rest))


def _forget_unjudged(thread: int) -> None:
    """Drops the objections kept by ``thread`` (a checked call's own, at its start and end)."""
    if not _unjudged:
        return  # (the usual case: nothing kept, no lock taken on a checked call's way)
    with _unjudged_lock:
        _unjudged[:] = [entry for entry in _unjudged if entry[0] != thread]


def _about(found: Any, kind: str, name: str, problem: Any) -> bool:
    """Whether ``problem``, an objection to the backward of Function ``name``, is what
    torch's sentence (``found``, of that ``kind``) is about."""
    if problem.kind != kind or problem.torch != "rejects":
        return False
    groups = found.groups()
    if groups and groups[0] != name:
        return False
    if kind in ("shape", "device") and problem.index != int(groups[1]):
        return False
    if kind == "non-tensor" and problem.index != int(groups[1]) - 1:
        return False
    if kind == "shape":
        got = tuple(int(d) for d in groups[2].split(",") if d.strip())
        return problem.got == got
    return True


@contextlib.contextmanager
def _engine_errors_explained() -> Any:
    """torch's engine's refusal of a value a custom backward returned, explained where the
    check could not tell torch's verdict beforehand: a node does not record which of its
    inputs that need no gradient were tensors, so where some were and some were not, the
    check lets torch judge (NOTE [checked custom backwards]); torch's sentence comes first,
    and the explanation follows it as a note."""
    me = threading.get_ident()
    _forget_unjudged(me)
    try:
        yield
    except RuntimeError as err:
        pending = sorted(list(_unjudged), key=lambda entry: entry[0] != me)  # (own first)
        _forget_unjudged(me)
        if isinstance(err, FunctionCheckError):
            raise
        sentence = str(err)
        for pattern, kind in _TORCH_SENTENCES:
            found = pattern.search(sentence)
            if found is None:
                continue
            problem = next((p for _, name, problems in pending for p in problems
                            if _about(found, kind, name, p)), None)
            if problem is not None:
                raise torch_first(FunctionCheckError, problem.message, sentence) from None
        m = _NOT_A_VARIABLE.search(sentence)
        if m is None:
            raise
        i = int(m.group(2)) - 1
        message = non_tensor_input_message(
            _CHECKED, m.group(1), i, Slot("other", False, type_name="non-tensor"),
            torch_line=False,
        ).replace(f"returned a tensor at index {i}",  # (torch's sentence does not say which)
                  f"returned a value other than None at index {i}", 1)
        raise torch_first(FunctionCheckError, message, str(err)) from None


def _running_node(node: Any) -> Any:
    """The node torch's engine is running now in this thread: ``node`` itself in a backward
    pass, another one that runs it inside (CopySlices), or None where no engine runs it (a
    call of its ``apply`` by hand, whose value torch hands back unchecked)."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return node if current is None else current()


def _judge_backward(node: Any, returned: Any) -> None:
    """The slow path of NOTE [checked custom backwards]: explains what the check objects to,
    with torch as the judge. Where torch's own validation raises, raises with torch's
    sentence first and the explanation as a note; where torch takes the value after all
    (summing a gradient down to its input's shape, casting it, dropping it), warns."""
    running = _running_node(node)
    if running is None:
        return  # (no backward pass: the node's apply called by hand; torch checks nothing)
    problems = backward_problems(_CHECKED, node, returned)
    if not problems:
        return
    rejected = [p for p in problems if p.torch == "rejects"]
    if torch._C._are_functorch_transforms_active():
        judged, error = False, None  # no replay inside a torch.func transform
    elif running is not node and all(p.index == 0 for p in problems):
        # run inside the CopySlices node of a view forward modified in place (mark_dirty):
        # torch copies input 0's gradient into the view's slice, broadcasting it, and checks
        # its shape no further; the replay on a plain node would reject what torch takes
        judged, error = True, None
    else:
        judged, error = torch_verdict(node, returned, _GENUINE_GRAD)
    if error is not None:
        sentence = str(error)
        # (torch's validation raises RuntimeError itself; another class, such as the
        # NotImplementedError of moving a gradient off the meta device, is left to torch)
        plain = type(error) is RuntimeError
        del error  # (only its sentence is needed: the raised error must not hold it)
        if rejected and plain:
            raise torch_first(FunctionCheckError, _with_the_rest(
                node, _matching(rejected, sentence), problems), sentence) from None
        return  # torch rejects it for a reason the check does not see: torch's error follows
    if rejected and not judged:
        # what torch does is not known here: torch judges, and its error, if it follows, is
        # explained (_engine_errors_explained)
        with _unjudged_lock:
            if len(_unjudged) >= 64:
                del _unjudged[0]
            _unjudged.append((threading.get_ident(), node._forward_cls.__name__, rejected))
        return
    problem = problems[0]
    message = problem.message
    if problem.torch == "rejects" and running is not node:  # (CopySlices: see above)
        kept = [line for line in message.splitlines()
                if not line.startswith("  torch's \"shape compatible with")]
        message = (
            f"{_CHECKED}: torch took what {function_name(node)}.backward returned without its "
            f"shape check: forward modified a view in place (mark_dirty), and torch copies the "
            f"gradient of input 0 into that view's slice of its base (Tensor.copy_, which "
            f"broadcasts it). The check said:\n" + "\n".join(kept))
    elif problem.torch == "rejects":
        message = (
            f"{_CHECKED}: torch accepted what {function_name(node)}.backward returned, "
            f"although torch_vjp's check reports a mistake; the gradients are torch's. The "
            f"check said:\n{message}"
        )
    warnings.warn(message, FunctionCheckWarning, stacklevel=user_stacklevel())
