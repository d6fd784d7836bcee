"""What a function reaches: the modules and tensors found from its closure, defaults,
globals, bound object and the containers they hold (:func:`reached`), walked once per
function and then read again along the same path (NOTE [a walk read again]).

NOTE [a walk read again]
Every Jacobian call walks what ``f`` reaches (the buffers it may move, the tensors it
captures: NOTE [what a call puts back] in kept.py). The walk is a depth-first search in
which each object's children (a function's closure contents, the globals its code names
and its defaults; a list's or dict's first items; a plain object's attributes) are read
by one reader chosen by the object's type, every child one level down; which children are
searched further, skipped (seen before, past the limit, a number) or collected (a tensor,
a module) depends on nothing but their types, their identities and their depth. So the
walk is recorded, per function object: each expanded object, the reader that read it and
the identities and types of the children it gave. A later call with the same function
object (same identity and type) reads every recorded object's children again, with the
same reader, and where each gives the same identities and types, the walk would take the
very same path: its modules and tensors are the ones at the recorded places. Any
difference (a global rebound, a dict item added or replaced, a closure cell set, an
attribute rebound) makes a full walk, recorded anew. Exactly the walk's answer; it
measured 39 -> 14 us for the suite's MLP function (a closure over a dict of weights and
a dataclass of functions), at every call of every Jacobian.
"""

from __future__ import annotations

import functools
import itertools
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["ITEMS_SEARCHED", "OBJECTS_SEARCHED", "captured_values", "named_globals",
           "own_attr", "reached"]

#: Items of one container (or attributes of one object) :func:`reached` searches.
ITEMS_SEARCHED = 32
#: Objects :func:`reached` looks at in all, whatever the depth.
OBJECTS_SEARCHED = 256
_NOT_SEARCHED = (Tensor, str, bytes, int, float, complex, bool, type, types.ModuleType,
                 type(None))


def captured_values(func: types.FunctionType) -> Iterator[object]:
    """What a function reads besides its arguments: the contents of its closure cells (empty
    ones skipped) and the values of the globals its code names (those that exist)."""
    for cell in func.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
    for _, value in named_globals(func):
        yield value


def named_globals(func: types.FunctionType) -> Iterator[tuple[str, object]]:
    """The globals a function's code names that exist, each with its name (a name its code
    reads as an attribute, ``torch.sin``'s ``sin``, is skipped where no global has it)."""
    glob = func.__globals__
    for name in func.__code__.co_names:
        value = glob.get(name)
        if value is not None:
            yield name, value


def own_attr(obj: object, name: str, default: object) -> object:
    """``obj.name`` as the object itself holds it, or ``default``: read past a class's own
    ``__getattr__`` and ``__getattribute__``, so that walking what ``f`` reaches runs no
    user code of a proxy (whose ``__getattr__`` forwards, or raises what it likes)."""
    try:
        return object.__getattribute__(obj, name)
    except Exception:  # noqa: BLE001 - (AttributeError, or a property's own error)
        return default


# The readers: one object's children, in the order the walk visits them (each one level
# down). Chosen by the object's type alone (:func:`_reader`).

def _function_children(func: types.FunctionType) -> list[object]:
    kids: list[object] = []
    wrapped = func.__dict__.get("__wrapped__")
    if wrapped is not None:
        kids.append(wrapped)
    kids.extend(captured_values(func))
    kids.extend(func.__defaults__ or ())
    if func.__kwdefaults__:
        kids.extend(func.__kwdefaults__.values())
    return kids


def _method_children(obj: types.MethodType) -> list[object]:
    kids: list[object] = [obj.__self__]
    if type(obj.__func__) is types.FunctionType:
        kids += _function_children(obj.__func__)
    return kids


def _sequence_children(obj: list | tuple) -> list[object]:  # type: ignore[type-arg]
    return list(obj[:ITEMS_SEARCHED])


def _dict_children(obj: dict) -> list[object]:  # type: ignore[type-arg]
    return list(itertools.islice(obj.values(), ITEMS_SEARCHED))


def _partial_children(obj: functools.partial) -> list[object]:  # type: ignore[type-arg]
    return [obj.func, *obj.args, *obj.keywords.values()]


def _object_children(obj: object) -> list[object]:
    kids: list[object] = []
    owner = own_attr(obj, "__self__", None)
    if owner is not None:
        kids.append(owner)
    wrapped = own_attr(obj, "__wrapped__", None)
    if wrapped is not None:
        kids.append(wrapped)
    func = own_attr(obj, "__func__", obj)
    if type(func) is types.FunctionType:
        return kids + _function_children(func)
    attrs = own_attr(obj, "__dict__", None)  # a plain object: its attributes
    if isinstance(attrs, dict):
        kids += itertools.islice(attrs.values(), ITEMS_SEARCHED)
    return kids


def _reader(obj: object) -> Any:
    kind = type(obj)
    if kind is types.FunctionType:
        return _function_children
    if kind is types.MethodType:
        return _method_children
    if isinstance(obj, (list, tuple)):
        return _sequence_children
    if isinstance(obj, dict):
        return _dict_children
    if isinstance(obj, functools.partial):
        return _partial_children
    return _object_children


class _Walk:
    """One recorded walk (NOTE [a walk read again]): the root's identity and type; each
    expanded object as ``(parent, position, reader)`` (the root's parent is -1), with the
    identities and types of the children its reader gave; where the tensors and modules
    found are, as ``(expanded object, position)``."""

    __slots__ = ("root", "expanded", "ids", "types", "tensors", "modules")

    def __init__(self, root: object) -> None:
        self.root = (id(root), type(root))
        self.expanded: list[tuple[int, int, Any]] = []
        self.ids: list[tuple[int, ...]] = []
        self.types: list[tuple[type, ...]] = []
        self.tensors: list[tuple[int, int]] = []
        self.modules: list[tuple[int, int]] = []

    def again(self, f: object) -> tuple[list[torch.nn.Module], list[Tensor]] | None:
        """The walk's answer for ``f``, read along the recorded path, or None where any
        object on it now gives other children."""
        if (id(f), type(f)) != self.root:
            return None
        kids_of: list[list[object]] = []
        for (parent, pos, reader), ids, kinds in zip(self.expanded, self.ids, self.types):
            kids = reader(f if parent < 0 else kids_of[parent][pos])
            if tuple(map(id, kids)) != ids or tuple(map(type, kids)) != kinds:
                return None
            kids_of.append(kids)
        return ([kids_of[e][j] for e, j in self.modules],  # type: ignore[misc]
                [kids_of[e][j] for e, j in self.tensors])  # type: ignore[misc]


#: (id of f, depth) -> its recorded walk; at most WALKS_KEPT, the oldest dropped first.
_WALKS: dict[tuple[int, int], _Walk] = {}
WALKS_KEPT = 256


def reached(f: object, depth: int = 6) -> tuple[list[torch.nn.Module], list[Tensor]]:
    """The ``nn.Module`` objects a callable ``f`` can reach directly: itself, its bound
    ``__self__``, the function and arguments of a ``functools.partial``, ``__wrapped__``, the
    values a function's closure cells, defaults and the globals its code names hold, the
    attributes of a plain object (``lambda x: self.model(x)``, a callable wrapper object)
    and the items of a list, tuple or dict (the first :data:`ITEMS_SEARCHED`), recursively,
    ``depth`` levels, and at most :data:`OBJECTS_SEARCHED` objects in all; and the tensors
    ``f`` reaches the same way (a tensor in a closure cell, a default, a global, a
    ``partial``'s arguments, a dict of parameters ``f`` hands to ``functional_call``; not
    those inside the modules). A module reached deeper, or only through a module it does
    not own, is not found. The walk runs on every call: read again along its recorded path
    where nothing on it changed (NOTE [a walk read again])."""
    key = (id(f), depth)
    walk = _WALKS.get(key)
    if walk is not None:
        found = walk.again(f)
        if found is not None:
            return found
    found, walk = _walk(f, depth)
    if walk is not None:
        if len(_WALKS) >= WALKS_KEPT and key not in _WALKS:
            _WALKS.pop(next(iter(_WALKS)))
        _WALKS[key] = walk
    return found


def _walk(f: object, depth: int
          ) -> tuple[tuple[list[torch.nn.Module], list[Tensor]], _Walk | None]:
    """:func:`reached`'s full walk, and its record (None where ``f`` itself is not searched
    further: a tensor, a module, a number)."""
    found: dict[int, torch.nn.Module] = {}
    tensors: dict[int, Tensor] = {}
    seen: set[int] = set()
    record = _Walk(f)

    def visit(obj: object, level: int, parent: int, pos: int) -> None:
        if isinstance(obj, Tensor):
            if id(obj) not in tensors:
                tensors[id(obj)] = obj
                record.tensors.append((parent, pos))
            return
        if isinstance(obj, _NOT_SEARCHED) or id(obj) in seen or len(seen) >= OBJECTS_SEARCHED:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            found[id(obj)] = obj
            record.modules.append((parent, pos))
            return
        if level <= 0:
            return
        reader = _reader(obj)
        kids = reader(obj)
        here = len(record.expanded)
        record.expanded.append((parent, pos, reader))
        record.ids.append(tuple(map(id, kids)))
        record.types.append(tuple(map(type, kids)))
        for j, kid in enumerate(kids):
            visit(kid, level - 1, here, j)

    visit(f, depth, -1, 0)
    answer = (list(found.values()), list(tensors.values()))
    return answer, (record if record.expanded else None)
