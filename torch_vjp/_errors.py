"""Exception and warning classes, and the small formatting helpers their messages share.

Every class derives from :class:`TorchVJPError` *and* from the builtin that torch itself
would raise for the same mistake, so ``except RuntimeError:`` around existing code keeps
working after switching to torch_vjp.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any


__all__ = [
    "full_message",
    "TorchVJPError",
    "GradOutputsError",
    "GradOutputsTypeError",
    "GradOutputsValueError",
    "GradOutputsIndexError",
    "FunctionCheckError",
    "FunctionCheckTypeError",
    "FunctionCheckValueError",
    "StrategyError",
    "StrategyTypeError",
    "StrategyNotImplementedError",
    "JacobianOptionError",
    "JacobianCallError",
    "JacobianCallTypeError",
    "JacobianNotImplementedError",
    "JacobianMemoryError",
    "PerSampleError",
    "PerSampleValueError",
    "PerSampleTypeError",
    "TorchVJPWarning",
    "GradOutputsWarning",
    "FunctionCheckWarning",
    "JacobianWarning",
    "shape_str",
    "a_type",
    "with_article",
    "joined",
    "format_bytes",
    "torch_first",
    "env_flag",
    "user_stacklevel",
    "first_time",
    "warn_once",
    "every_time",
    "quote_error",
    "passes_through",
    "chained",
]


class TorchVJPError(Exception):
    """Base class of every error torch_vjp raises for a mistake it can foresee."""


class GradOutputsError(TorchVJPError, RuntimeError):
    """``grad_outputs`` (or ``gradient``, ``grad_tensors``, cotangents) do not fit the outputs.

    Raised for shape, structure, dtype (complex vs real), device, batch-dimension and count
    mismatches, for non-scalar outputs given no ``grad_outputs``, and for outputs that do
    not require grad.
    """


class GradOutputsTypeError(GradOutputsError, TypeError):
    """A :class:`GradOutputsError` for an argument of the wrong type (torch raises TypeError)."""


class GradOutputsValueError(GradOutputsError, ValueError):
    """A :class:`GradOutputsError` where torch raises ValueError (batch sizes that differ)."""


class GradOutputsIndexError(GradOutputsError, IndexError):
    """A :class:`GradOutputsError` where torch raises IndexError (``is_grads_batched=True``
    with a 0-d ``grad_outputs`` entry, or an empty batch)."""


class FunctionCheckError(TorchVJPError, RuntimeError):
    """A custom ``torch.autograd.Function``'s backward returned something wrong."""


class FunctionCheckTypeError(FunctionCheckError, TypeError):
    """A :class:`FunctionCheckError` for an argument of ``check_function`` of the wrong type
    (``fn`` neither a Function subclass nor a callable)."""


class FunctionCheckValueError(FunctionCheckError, ValueError):
    """A :class:`FunctionCheckError` for an argument of ``check_function`` with an invalid
    value (a tolerance, ``eps``, or inputs none of which can be differentiated)."""


class StrategyError(TorchVJPError, ValueError):
    """An unknown strategy name, or a strategy that cannot serve this call."""


class JacobianOptionError(TorchVJPError, ValueError):
    """An option of a Jacobian, VJP or JVP call (or of a comparison or benchmark run) has an
    invalid value (``chunk_size``, ``max_memory``, ``min_run_time``, tolerances)."""


class JacobianCallError(TorchVJPError, RuntimeError):
    """``f``, its primals or ``argnums`` do not fit the call: a non-tensor or integer output,
    ``has_aux`` without an ``(output, aux)`` pair or with an aux that is not tensors, an
    ``argnums`` out of range, a primal that cannot be differentiated (integer, sparse,
    nested), a batch dimension missing from ``batch_jacobian``'s output."""


class JacobianCallTypeError(JacobianCallError, TypeError):
    """A :class:`JacobianCallError` for an argument of the wrong type (``f`` not callable),
    where torch raises TypeError."""


class JacobianNotImplementedError(JacobianCallError, NotImplementedError):
    """A :class:`JacobianCallError` where torch raises NotImplementedError: ``tv.jvp`` of a
    function with an operator, or a custom Function, without a forward-mode formula (so that
    ``except NotImplementedError:`` around ``torch.func.jvp`` keeps working)."""


class JacobianMemoryError(TorchVJPError, MemoryError):
    """The requested Jacobian cannot fit the memory budget; raised before allocating."""


class StrategyTypeError(StrategyError, TypeError):
    """A ``strategies=`` argument of the wrong type (not a name or a sequence of names)."""


class StrategyNotImplementedError(StrategyError, NotImplementedError):
    """A :class:`StrategyError` where torch raises NotImplementedError: a forward-mode
    strategy (``"fwd"``, ``"fwd-loop"``) for a function with an operator, or a custom
    Function, without a forward-mode formula."""


class PerSampleError(TorchVJPError, RuntimeError):
    """Per-sample gradients are not defined for this model (a layer mixes examples)."""


class PerSampleValueError(PerSampleError, ValueError):
    """A per-sample call got an argument of the right type but a wrong value or shape."""


class PerSampleTypeError(PerSampleError, TypeError):
    """A per-sample call got an argument of the wrong type, or a per-layer rule is malformed
    (a user's rule with the wrong signature or a result of the wrong shape)."""


class TorchVJPWarning(UserWarning):
    """Base class of torch_vjp's warnings."""


class GradOutputsWarning(TorchVJPWarning):
    """torch accepted ``grad_outputs`` but did something the caller may not expect.

    For example it silently cast a float64 or integer ``grad_outputs`` to a float32 output's
    dtype, or ignored extra ``grad_outputs``.
    """


class FunctionCheckWarning(TorchVJPWarning):
    """torch accepted what a custom ``autograd.Function``'s backward returned, but changed it
    without a word, or torch_vjp's check doubts it (checked mode).

    For example torch cast a float64 gradient to its float32 input's dtype, or read ``None``
    as zeros for an input that needs a gradient while dropping a tensor returned at the
    position of an input that needs none (gradients in the wrong order).
    """


class JacobianWarning(TorchVJPWarning):
    """A Jacobian computation fell back to a slower strategy, or ``"auto"`` returned another
    route's result than its first, or (in checked mode only) an output does not depend on an
    input through autograd although its value changes with it (its block is zeros)."""


def shape_str(shape: Sequence[int]) -> str:
    """Formats a shape as a plain tuple: ``(4, 4)``, ``(4,)``, ``()``."""
    dims = tuple(int(d) for d in shape)
    if len(dims) == 1:
        return f"({dims[0]},)"
    return "(" + ", ".join(str(d) for d in dims) + ")"


# class names read letter by letter whose first letter sounds like a vowel: "an LSTM",
# "an MSELoss", "an RNN", "an ndarray"
_LETTER_VOWEL = frozenset("FHLMNRSX")


def with_article(name: str) -> str:
    """``name`` after its indefinite article: "an int", "a float", "an Embedding", "an
    LSTM", "a GRU", "an ndarray"."""
    head = name[:1]
    vowel = head.lower() in "aeiou" or name.startswith("nd") or (
        head in _LETTER_VOWEL and name[1:2].isupper())
    return ("an " if vowel else "a ") + name


def joined(items: Sequence[Any]) -> str:
    """``items`` as an English list, for a message: "a", "a and b", "a, b and c"."""
    items = [str(x) for x in items]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def a_type(obj: object) -> str:
    """What ``obj`` is, for a message: "None", or its type's name after its article ("an
    int", "a list", "an OrderedDict")."""
    return "None" if obj is None else with_article(type(obj).__name__)


def format_bytes(n: float | None) -> str:
    """Formats a byte count in decimal units, as ``max_memory="2GB"`` reads them: the one
    byte formatter of messages, reports and tables.

    Example:
        >>> format_bytes(80e9), format_bytes(1536), format_bytes(512), format_bytes(None)
        ('80 GB', '1.54 kB', '512 B', '-')
    """
    if n is None:
        return "-"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}" if n / size < 100 else f"{n / size:.0f} {unit}"
    return f"{int(n)} B"


# NOTE [torch's sentence first]
# For a call that torch itself also rejects, the error's message (``str(err)``) is torch's own
# sentence, so that code matching torch's wording keeps working, and torch_vjp's explanation
# (what was wrong, what was expected and why, the fix) is attached as an exception note
# (PEP 678), which tracebacks, pytest and IPython show under it. Where torch's own sentence
# would be wrong (torch 2.13 names an unrelated broadcasting error for a mismatch in the
# second grad_outputs entry), the sentence is torch's template filled in with the right index
# and shapes. Python 3.10 has no notes: there the explanation follows the sentence in the
# message itself.


def torch_first(cls: type[BaseException], explanation: str, sentence: str | None) -> BaseException:
    """An exception whose message is torch's ``sentence`` with ``explanation`` as a note.

    Without a sentence (torch does not reject the call, or says nothing useful) the message
    is the explanation itself. See NOTE [torch's sentence first].
    """
    if not sentence:
        err = cls(explanation)
    elif hasattr(BaseException, "add_note"):
        err = cls(sentence)
        err.add_note(explanation)
    else:  # pragma: no cover - Python 3.10
        err = cls(f"{sentence}\n{explanation}")
    err.torch_sentence = sentence  # type: ignore[attr-defined]
    err.explanation = explanation  # type: ignore[attr-defined]
    return err


#: torch's error for a backward pass through a freed graph.
FREED_GRAPH = "Trying to backward through the graph a second time"


def note_freed_graph(err: BaseException, note: str) -> None:
    """Adds ``note`` to ``err`` where it is torch's error for a backward pass through a
    freed graph: torch's class and sentence, with what it means to the caller (NOTE
    [torch's sentence first])."""
    if str(err).startswith(FREED_GRAPH) and hasattr(err, "add_note"):
        err.add_note(note)


def full_message(err: BaseException) -> str:
    """``str(err)`` followed by its notes: everything a traceback shows of the message."""
    return "\n".join([str(err), *getattr(err, "__notes__", ())])


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside torch_vjp (and
    outside torch, for calls that came through torch's own functions)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("torch_vjp") or name.startswith("torch.") or name == "torch"):
            return level
        frame = frame.f_back
        level += 1
    return 1


_WARNED: set[Any] = set()
_EVERY_TIME = threading.local()  # within every_time(): once-only warnings are shown anyway


def first_time(key: Any) -> bool:
    """True the first time ``key`` is seen in this process: the one registry behind every
    once-only warning (always True within :func:`every_time`)."""
    if getattr(_EVERY_TIME, "on", False):
        return True
    if key in _WARNED:
        return False
    _WARNED.add(key)
    return True


@contextlib.contextmanager
def every_time() -> Iterator[None]:
    """Within it (this thread), a once-only warning is shown each time its cause recurs: for
    a report that records what each of its runs warned (``compare_strategies``)."""
    before = getattr(_EVERY_TIME, "on", False)
    _EVERY_TIME.on = True
    try:
        yield
    finally:
        _EVERY_TIME.on = before


def warn_once(key: Any, message: str, category: type[Warning]) -> None:
    """Emits ``message`` the first time ``key`` is seen, pointing at the caller's frame."""
    if first_time(key):
        warnings.warn(message, category, stacklevel=user_stacklevel())


def failing_rank(err: BaseException | None, group: Any, world: int) -> tuple[int, str] | None:
    """The first rank of ``group`` that failed and its error, quoted (:func:`quote_error`),
    from every rank's ``err`` (None where it did not fail); None where none failed. Every
    rank of the group must call it (an all-gather)."""
    import torch.distributed as dist

    said: list[Any] = [None] * world
    dist.all_gather_object(said, None if err is None else quote_error(err), group=group)
    return next(((r, s) for r, s in enumerate(said) if s is not None), None)


def quote_error(err: BaseException) -> str:
    """``"ValueError: first line of the message"`` for quoting an error in a warning."""
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 300:
        first = first[:297] + "..."
    return f"{type(err).__name__}: {first}"


def chained(err: BaseException) -> Iterator[BaseException]:
    """``err`` and every exception chained to it (its cause and context, and the
    ``inner_exception`` torch's compiler wraps a backend's error in), each once."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [getattr(e, "inner_exception", None), e.__cause__, e.__context__]


def passes_through(err: BaseException) -> bool:
    """Errors no fallback may hide: out of memory and torch_vjp's own."""
    import torch

    return isinstance(err, (MemoryError, torch.OutOfMemoryError, TorchVJPError))


_OFF = frozenset({"0", "false", "no", "off"})


def env_flag(name: str, default: bool = False) -> bool:
    """Whether the environment variable ``name`` turns its switch on: ``default`` when it is
    unset or empty, off for ``0``, ``false``, ``no`` or ``off``, on for anything else (case
    and surrounding spaces ignored). The one rule by which torch_vjp reads its switches
    (``TORCH_VJP_CHECKED``, ``TORCH_VJP_AUTOLOAD``). The torch plugin hook, which may import
    nothing of torch_vjp, holds the same function (``_autoload.env_flag``); a test checks
    that the two agree."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in _OFF


# Tracebacks name the public path users import from: torch_vjp.GradOutputsError.
for _cls in list(globals().values()):
    if isinstance(_cls, type) and issubclass(_cls, (TorchVJPError, TorchVJPWarning)):
        _cls.__module__ = "torch_vjp"
del _cls
