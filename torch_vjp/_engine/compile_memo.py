"""The key of a ``compile=True`` call found again without walking ``f`` (NOTE [a function
called again] below), for :func:`~torch_vjp._engine.compiled.compiled_call`.

NOTE [a function called again]
A steady-state ``compile=True`` call spent most of its own time on its key: the walk of what
``f`` reaches (the modules whose training flags the key holds, :func:`~torch_vjp._engine.
context.reached`), the module trees, and ``f``'s closure keyed value by value
(:func:`~torch_vjp._engine.compile_key.program_key`): 40-45 us of the 65-70 us a call of the
suite's MLPs and module_params paid around a compiled program of 80-120 us, with ``f`` the
same object on every call. So a call whose entry ran its compiled program (a call after the
first) notes, per call name, ``f``, options and argument signature, the key it found and
the modules whose flags that key holds; the next call of the same ``f`` object (a weak
reference, never the function kept alive; a bound method, ``model.forward``, a new object
on each access, by its object and its function, as the full key holds it) takes that key
where

* the argument signature (:func:`~torch_vjp._engine.compile_key.call_signature`, grad mode,
  autocast and the global module hooks included) is the same, computed on every call;
* ``f``'s own code, and each value its closure cells, defaults, (for a ``partial``)
  arguments and the globals its code reads hold, are the same objects (numbers and
  strings by value; a tensor with its ``requires_grad``, which the key holds: NOTE [the
  globals a program reads] in :mod:`torch_vjp._engine.compile_key`), so that a function
  whose closure or global was rebound (``nonlocal x``) walks again (``f`` a module: the
  globals its forward reads);
* every noted module is alive, with its training flag as noted (NOTE [train and eval
  entries] in :mod:`torch_vjp._engine.compile_key`: a model switched to eval finds its own
  entry, never the training one's; up to :data:`NOTES_PER_CALL` notes are kept, one per
  entry, so that modes that alternate each find theirs), and what the entry's program read
  beyond its key is as when it was built (NOTE [what a program read beyond its key] in
  :mod:`torch_vjp._engine.compile_key`: a ``self.w`` whose ``requires_grad`` alternates);
  and
* the entry is still cached, compiled, and writes nothing (NOTE [a program that writes
  nothing]): a program that may change a buffer of the user's runs on the full path, under
  ``buffers_kept`` and its walk, on every call. A note holds its entry weakly: an entry
  the cache let go is not kept alive by its note.

What the shallow comparison does not see (an attribute of an object ``f`` reaches set anew,
a tensor in the closure resized in place, a submodule replaced) the compiled program's own
guards see: dynamo recompiles the entry's code object, the call counts that, and the entry
is rebuilt as on any recompile (NOTE [a recompiled entry]), after the full key is computed
again; that is the same safety net the key already relies on for what it does not hold (a
global flag, a module attribute). Functions made anew for each call (a lambda inside the
training loop) are never found here, and take the full path as before.
"""

# NOTE [a program that writes nothing]
# A call puts back what it changes of the user's (NOTE [what a call puts back], kept.py):
# buffers_kept copies the small tensors f captures and the buffers of modules in training
# mode before the call and compares them after it, about 45 us of a 200 us compiled call
# of the suite's MLP (its biases copied and compared on every call). A compiled program's
# writes are fixed when it is traced (dynamo specialises f's branches and guards them; a
# recompile is a first call again, NOTE [a recompiled entry]), and every write into a
# tensor it reads moves that tensor's version, F.batch_norm's statistics included (which
# eagerly do not). So the first compiled run notes the versions of the tensors f reaches
# and of the buffers and parameters of the modules f and the arguments reach, and which
# tensor each buffer is (kept.Footprint); where it moved none, the entry's later calls run
# without buffers_kept.

from __future__ import annotations

import functools
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torch_vjp._engine.compile_key import globals_read, module_flags, number_key

__all__ = ["MEMO_MAX", "NOTES_PER_CALL", "called_again", "note_call", "forget_calls"]

#: Calls noted at most (the oldest first out).
MEMO_MAX = 64
#: Notes kept per call of one function, options and signature, the newest first: one per
#: entry (the training flags of its modules, or what it read beyond its key, alternate).
NOTES_PER_CALL = 4

_VALUES = (int, float, bool, complex, str, bytes, type(None))

_MEMO: dict[Any, tuple[_Noted, ...]] = {}
_LOCK = threading.RLock()  # (a dying function's callback may run under it)


class _Noted:
    __slots__ = ("f", "held", "key", "entry", "modules", "flags")

    def __init__(self, f: weakref.ref[Any], held: tuple[Any, ...], key: Any, entry: object,
                 modules: list[torch.nn.Module]) -> None:
        self.f = f
        self.held = held
        self.key = key
        # (weakly: a note that held its entry kept the compiled program alive after the
        # cache let it go, up to NOTES_PER_CALL of them for each of MEMO_MAX calls)
        self.entry = weakref.ref(entry)
        self.modules = tuple(weakref.ref(m) for m in modules)
        self.flags = tuple(module_flags(m) for m in modules)


def _values_of(f: object) -> tuple[Any, ...] | None:
    """The objects whose identity the note compares: ``f``'s code and what its closure
    cells, defaults and keyword defaults hold (a ``partial``: its function, arguments and
    keywords); nothing for a module (its tree's training flags are compared, and what its
    forward reads dynamo guards); a bound method's function (its object is the note's
    own, :func:`_identity`); None for a callable of another kind, which is not noted."""
    if isinstance(f, torch.nn.Module):  # (and the globals its forward reads)
        return tuple(v for _, v in globals_read(getattr(type(f), "forward", None)))
    if type(f) is types.MethodType:  # (as the full key holds it: its function, its object)
        return (f.__func__, *(v for _, v in globals_read(f.__func__)))
    if type(f) is types.FunctionType:
        cells = []
        for c in f.__closure__ or ():
            try:
                cells.append(c.cell_contents)
            except ValueError:  # (an empty cell)
                cells.append(_EMPTY)
        # (and the globals its code reads: one rebound walks again, NOTE [the globals a
        # program reads] in compile_key.py)
        return (f.__code__, *cells, f.__defaults__, f.__kwdefaults__,
                *(v for _, v in globals_read(f)))
    if type(f) is functools.partial:
        inner = _values_of(f.func)
        if inner is None:
            return None
        # (each keyword's name and value apart: an item pair is a new tuple on each call,
        # which no identity matches, so a partial with keywords was never found again)
        return (*inner, f.func, *f.args,
                *(x for item in sorted(f.keywords.items()) for x in item))
    return None


_EMPTY = object()


def _identity(f: object) -> tuple[object, Any]:
    """What a note is for: ``f``, or a bound method's object and function (``model.forward``
    is a new method object on each access, so its own id and weak reference never found a
    note again), with the id the memo is keyed by."""
    if type(f) is types.MethodType:
        return f.__self__, (id(f.__self__), id(f.__func__))
    return f, id(f)


def _held(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """``values`` as the note keeps them: numbers and strings by value (a float by its
    bits, :func:`~torch_vjp._engine.compile_key.number_key`: ``-0.0`` is not ``0.0``),
    a tensor by a weak reference and its ``requires_grad`` (switched in place, it is another
    key, and the note's entry recompiled, refused, on every call that alternated it), other
    objects by a weak reference where they take one, else as they are (a tuple of defaults,
    a small dict: the function holds them too)."""
    out: list[Any] = []
    for v in values:
        if isinstance(v, _VALUES) or v is _EMPTY:
            out.append((True, number_key(v)))
            continue
        if isinstance(v, torch.Tensor):  # (and its requires_grad, which the key holds)
            out.append(("tensor", (weakref.ref(v), v.requires_grad)))
            continue
        try:
            out.append((False, weakref.ref(v)))
        except TypeError:
            out.append((None, v))
    return tuple(out)


def _same(held: tuple[Any, ...], values: tuple[Any, ...]) -> bool:
    if len(held) != len(values):
        return False
    for (kind, h), v in zip(held, values):
        if kind is True:
            if not isinstance(v, _VALUES) and v is not _EMPTY or number_key(v) != h:
                return False
        elif kind is False:
            if h() is not v:
                return False
        elif kind == "tensor":
            if h[0]() is not v or v.requires_grad is not h[1]:
                return False
        elif h is not v:
            return False
    return True


def called_again(call: str, f: object, options: tuple[Any, ...], args: tuple[Any, ...],
                 signature: object) -> tuple[Any, Any] | None:
    """The key and entry noted for this call of ``f`` (NOTE [a function called again]), or
    None where the full key must be computed; ``signature``: ``call_signature(args)``, which
    the full key holds too."""
    owner, ident = _identity(f)
    try:
        notes = _MEMO.get((call, ident, options, signature))
    except TypeError:  # (an unhashable option or argument: the full path says what)
        return None
    if notes is None or notes[0].f() is not owner:
        return None
    values = _values_of(f)
    if values is None:
        return None
    for noted in notes:  # (one per training mode of the modules: train and eval alternate)
        if _same(noted.held, values) and _flags_as_noted(noted):
            entry = noted.entry()  # (and what its program read beyond its key: NOTE [what
            if entry is not None and entry.read_as_built(f, args):  # a program read
                return noted.key, entry  # beyond its key] in compile_key.py)
    return None


def _flags_as_noted(noted: _Noted) -> bool:
    for ref, flag in zip(noted.modules, noted.flags):
        m = ref()
        if m is None or module_flags(m) != flag:
            return False
    return True


def note_call(call: str, f: object, options: tuple[Any, ...], args: tuple[Any, ...],
              key: Any, entry: object, modules: list[torch.nn.Module]) -> None:
    """Notes the key ``f``'s call found, for :func:`called_again`; ``modules`` are those whose
    training flags the key holds."""
    values = _values_of(f)
    if values is None:
        return
    owner, ident = _identity(f)
    try:
        ref = weakref.ref(owner, _dropper((call, ident)))
        memo_key = (call, ident, options, key[3])
        noted = _Noted(ref, _held(values), key, entry, modules)
        hash(memo_key)
    except TypeError:
        return
    with _LOCK:
        older = _MEMO.pop(memo_key, ())
        _MEMO[memo_key] = (noted, *[n for n in older
                                    if n.f() is owner and (n.flags != noted.flags
                                                           or n.entry() is not entry)
                                    ][:NOTES_PER_CALL - 1])
        while len(_MEMO) > MEMO_MAX:
            del _MEMO[next(iter(_MEMO))]


def _dropper(prefix: tuple[str, Any]) -> Callable[[object], None]:
    """A weak reference's callback that forgets the notes of a function that died (its id
    may be a new function's next)."""

    def drop(_: object) -> None:
        with _LOCK:
            for k in [k for k in _MEMO if k[:2] == prefix]:
                del _MEMO[k]

    return drop


def forget_calls() -> None:
    """Forgets every note (with the compiled entries they point to)."""
    with _LOCK:
        _MEMO.clear()
