"""Sparsity detection: ``f`` runs once, for real, under a ``TorchDispatchMode`` that gives
every element of every tensor derived from the input the set of input elements it can
depend on (NOTE [index sets] in :mod:`~torch_vjp._sparse.sets`), by a rule per aten op.

NOTE [shadow storage]
The sets live beside the values, like a sanitizer's shadow memory: each storage that holds
tracked values has a shadow, an int64 tensor of set ids with one entry per element of the
storage, and a tensor's ids are that shadow seen through the tensor's own size, strides and
offset (``as_strided``). So views need no rule at all (a view shares its base's storage,
hence its shadow), and an in-place op, a write into a slice, or a ``copy_`` into a buffer
created inside ``f`` updates the shadow of the storage it writes, which every view of that
storage sees. Storages without a shadow (constants: weights ``f`` closes over, tensors it
creates) hold the empty set. Each shadow keeps a tensor of its storage alive until the run
ends, so that no storage address is reused while it is a key. Tensors without storage
(sparse, nested) carry one set for all their elements, kept by object: an op that reads one
is ruled conservatively (a rule would look up the ids of a reshaped or indexed copy, a new
object without any), and a view of one with storage of its own (``values()``) gets its set.

NOTE [views of another element size]
A complex tensor and its real view (``view_as_real``, ``view_as_complex``) share a storage,
whose shadow has one entry per element of the tensor that first wrote it. Seen through a
view of smaller elements, each real element carries the set of the complex element it is
part of; through a view of larger ones, each complex element the union of the real elements
it is made of. A write through a real view of a complex shadow unites the written sets
with what the complex elements held (the other half of each keeps its set: a superset
where both halves are written); through a complex view of a real shadow it writes both
halves. Element sizes that are not multiples of each other give every element the union
of the whole storage.

NOTE [what the pattern means]
The pattern is the structure of the derivative automatic differentiation computes at the
point ``f`` was run at: an output element is marked as depending on an input element when
some chain of ops connects them, whatever the values. It is conservative in three ways: an
op without a rule makes every output element depend on every input element it reads
(:func:`~torch_vjp._sparse.rules.conservative`); a product whose value happens to be zero
at this point (``relu`` of a negative number) is still marked; and only constants (values
that do not depend on the input) count as structural zeros, for example the zeros of a
weight matrix. It follows the branches ``f`` takes at this point: Python control flow on
values, and the values of integer tensors (indices, masks, comparisons), are taken as they
are here. Integer and boolean results carry no sets (no derivative flows through them), as
in autograd.

NOTE [a pattern shaped by values]
So the pattern holds at every x only where no value of x chose where ids go. The tracer
marks the tensors computed from x that carry no sets (comparisons, argmax, sort's indices,
a 0/1 float mask). Where such a tensor is a condition or mask of ``where`` or
``masked_fill``, the rule takes the union of both branches, and ops that pick values by
their order (``max(dim)``, ``sort``, ``topk``, ``cummax``) take their whole line: supersets
that hold at every x. What the tracer cannot make hold at every x it records
(:attr:`Tracer.by_value`, the first such op): tracked data placed by such a tensor (an
index, a mask: :data:`rules.PLACING_ARGS`), an output whose shape is read off values from x
(:data:`rules.DATA_SHAPED`), a value handed to Python (``.item()``, ``bool(t)``: a branch
on x; ``.tolist()`` and ``.numpy()``, which bypass torch's dispatch, by :class:`ValueReads`
beside it). Such a pattern is not cached (``sparse_jacobian`` detects again at each call,
and warns once). A mask that only multiplies, or a constant one, changes nothing.
The zeros of a tensor some of whose values were computed from x's values (a 0/1 mask, a
weight picked by ``where`` on x, a mask written into a buffer) are not structural: the
tracer keeps their storages (:meth:`Tracer.value_dependent`), and the contraction rules
take such an operand as non-zero everywhere. A random draw made inside ``f`` (``rand``,
``randperm``, dropout's mask: :data:`rules.RANDOM`) is such a value too, since detection,
the products and every later call draw different ones; tracked data placed by an index or
mask derived from a draw is ruled conservatively (every output element of the op depends
on every input element it reads), which holds for every draw, where re-detection would
not (it draws again).

NOTE [structural zeros that move]
The zeros of a constant operand of a contraction are structural (a banded weight gives a
banded pattern), but a weight ``f`` reads can change between calls while ``f`` stays the
same object: a module's parameters, zero-initialised (a zero-initialised last layer) and then
trained, or loaded (``load_state_dict``), change in place. A cached pattern then misses the
entries of the zeros that moved, and ``sparse_jacobian`` would be silently wrong. So the
tracer records, for each storage made during the run, which tensors from before the run
(weights, buffers, tensors ``f`` closes over) its values came from, and where a rule takes
zeros of an operand as structural, those tensors become the pattern's guards: a cached plan
is used only while each living guard has the values it had (the pattern keeps a copy: a
write through ``.data`` or NumPy, ``target.data.copy_(source)``, bumps no version, and an
inference tensor has none: :meth:`~torch_vjp._sparse.pattern.Pattern.holds`); else
detection runs again. A weight without zeros guards nothing (the densest pattern holds whatever its
values), and a tensor that dies (a constant made at each call) guards nothing. The values
of such tensors shape the pattern in two more ways, which guard too: an integer or boolean
tensor that an op on tracked data reads (an index buffer ``u[perm]``, a boundary mask in
``torch.where``: it places the data; reshuffled in place, the pattern moves), and a value
read for Python (``.item()``, ``bool(t)``: ``f`` may branch on it, ``if self.step >
warmup``), as on x's values (NOTE [a pattern shaped by values]). A module's parameter
rebound to another tensor changes the plan's key (``_branch_state`` in
:mod:`~torch_vjp._sparse.compute`), and a guard that is a buffer or a plain tensor
attribute of a module ``f`` reaches (one in a plain list attribute too), or an attribute of
a callable object ``f``, is watched where it lives
(:meth:`~torch_vjp._sparse.pattern.Pattern.house`: rebound, the old one dies); a tensor
rebound in a closure (``W = new``) is not seen: ``torch_vjp.sparse.clear_cache(f)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torch_vjp._sparse.sets import SetTable

__all__ = ["Call", "Tracer", "ValueReads", "carries_sets", "one_thread", "bind"]

_LONG = torch.long


def carries_sets(t: object) -> bool:
    """Whether ``t`` is a tensor whose elements can depend on the input: floating point or
    complex (integer and boolean tensors carry no derivative)."""
    return isinstance(t, Tensor) and (t.dtype.is_floating_point or t.dtype.is_complex)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Runs the index work on one thread: its sorts are small, and torch's parallel sort
    is several times slower than a serial one when the other cores are busy."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def bind(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of an aten op call by their schema names, defaults filled in."""
    bound: dict[str, Any] = {}
    positional = len(args)
    for i, arg in enumerate(func._schema.arguments):
        if i < positional and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            bound[arg.name] = None
    return bound


@dataclass
class Call:
    """One aten op call as the rules see it.

    Attributes:
        func: the op whose rule applies: the functional form of an in-place op
            (``aten.add.Tensor`` for ``aten.add_.Tensor``).
        called: the op that ran.
        args, kwargs: its arguments.
        bound: its arguments by schema name.
        outs: its tensor results, flattened, in order.
        name: the base name of ``func`` (``"add"``).
    """

    func: Any
    called: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    bound: dict[str, Any]
    outs: list[Tensor]
    name: str


class _Shadow:
    __slots__ = ("ids", "itemsize", "keep")

    def __init__(self, ids: Tensor, itemsize: int, keep: Tensor) -> None:
        self.ids = ids
        self.itemsize = itemsize
        self.keep = keep


def _storage_key(t: Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class Tracer(TorchDispatchMode):
    """The dispatch mode of one detection run. See NOTE [shadow storage].

    Args:
        n: the number of input elements (columns of the pattern).

    Attributes:
        table: the run's :class:`~torch_vjp._sparse.sets.SetTable`.
        conservative_ops: names of the ops that had no rule and made outputs depend on
            every input element they read (for the one-time warning).
        by_value: the first op whose use of the input's values shaped the pattern (NOTE
            [a pattern shaped by values]), as ``"aten.where (reading a mask computed from
            x)"``; None where the pattern holds at every x.
        wrong_batching: the first op on tracked data whose backward torch batches wrongly
            (NOTE [wrong batching rules] in :mod:`~torch_vjp._sparse.probe`), or None;
            wrong_reverse: one whose backward is wrong without vmap too.
    """

    def __init__(self, n: int) -> None:
        super().__init__()
        self.table = SetTable(n)
        self._shadows: dict[int, _Shadow] = {}
        self._opaque: dict[int, tuple[Tensor, int]] = {}
        self.conservative_ops: set[str] = set()
        self._next = 1
        # tensors computed from the input's values that carry no sets, by storage (kept
        # alive while the run lasts, as shadows keep theirs: no address is reused as a key)
        self._from_values: dict[int, Tensor] = {}
        # storages whose values (some of them) were computed from the input's values or
        # drawn at random, tracked or not: their zeros are not structural (NOTE [a pattern
        # shaped by values]); and, among them, those drawn at random
        self._valued: dict[int, Tensor] = {}
        self._random: dict[int, Tensor] = {}
        # the same for tensors without storage (a sparse matrix built from a mask of x's
        # values: its stored entries move with x), by object (kept alive: no id reused)
        self._valued_opaque: dict[int, Tensor] = {}
        self.by_value: str | None = None
        # the first op on tracked data whose backward torch batches wrongly (NOTE [wrong
        # batching rules] in torch_vjp._sparse.probe), as the warning names it
        self.wrong_batching: str | None = None
        self.wrong_reverse: str | None = None  # (one whose backward is wrong even alone)
        # NOTE [structural zeros that move]: the tensors from before the run (weights f
        # reads) whose values reached each storage made during the run, by storage; those
        # tensors by id; and those whose zeros some rule took as structural
        self._sources: dict[int, set[int]] = {}
        self._external: dict[int, Tensor] = {}
        self.guards: dict[int, Tensor] = {}

    def from_values(self, t: Tensor) -> bool:
        """Whether ``t`` was computed from the input's values and carries no sets (a
        comparison, an argmax, sort's indices, a 0/1 mask)."""
        return not self.tracked(t) and _storage_key(t) in self._from_values

    def value_dependent(self, t: Tensor) -> bool:
        """Whether some of ``t``'s values were computed from the input's values or drawn at
        random (tracked or not): its zeros may move at another input or another draw, so
        none of them is structural."""
        key = _storage_key(t)
        if key is None:
            return id(t) in self._valued_opaque
        return key in self._valued or key in self._from_values

    def random(self, t: Tensor) -> bool:
        """Whether ``t``'s values derive from a random draw made inside ``f``."""
        key = _storage_key(t)
        return key is not None and key in self._random

    def _mark(self, outs: Sequence[Tensor], random: bool) -> None:
        for t in outs:
            key = _storage_key(t)
            if key is None:
                self._valued_opaque[id(t)] = t
                continue
            self._valued[key] = t
            if random:
                self._random[key] = t
            if not self.tracked(t):  # (a random draw acts as a value from x: a mask,
                self._from_values[key] = t  # an index, a weight that moves between calls)

    def mark_from_values(self, outs: Sequence[Tensor]) -> None:
        """Records ``outs`` as values computed from the input's (their zeros are not
        structural; those without sets place or select by values)."""
        self._mark(outs, False)

    # ---- NOTE [structural zeros that move] ------------------------------------------------

    def _sources_of(self, t: Tensor) -> set[int]:
        key = _storage_key(t)
        if key is None:
            return set()
        got = self._sources.get(key)
        if got is None:  # (a view of a weight: the weight, as an op's argument shows it;
            base = t if t._base is None else t._base  # a rule's own views have no base)
            self._external[id(base)] = base
            got = self._sources[key] = {id(base)}
        return got

    def _flow(self, inputs: Sequence[Tensor], outs: Sequence[Tensor], mutating: bool) -> None:
        """Records which tensors from before the run reached ``outs`` (written by an op
        that read ``inputs``; ``mutating``: written in place, so what they held stays)."""
        src: set[int] = set()
        for t in inputs:
            src |= self._sources_of(t)
        for t in outs:
            key = _storage_key(t)
            if key is None:
                continue
            if mutating:  # (a weight written in place: its own source too)
                self._sources[key] = self._sources_of(t) | src
            else:
                self._sources[key] = set(src)

    def guarded_by(self, t: Tensor) -> None:
        """Records that the pattern owes something to ``t``'s values: a rule took zeros of
        ``t`` as structural, ``t`` placed tracked data (an index, a mask), or Python read a
        value of ``t`` to branch on. The tensors from before the run whose values reached
        ``t`` become guards of the pattern (NOTE [structural zeros that move])."""
        for s in self._sources_of(t):
            self.guards[s] = self._external[s]

    def shaped_by_value(self, why: str) -> None:
        """Records (the first) op whose use of the input's values shaped the pattern."""
        if self.by_value is None:
            self.by_value = why

    # ---- the shadow --------------------------------------------------------------------

    def register_input(self, leaf: Tensor) -> None:
        """Gives the elements of ``leaf`` the next singletons, in flattened order."""
        k = leaf.numel()
        ids = torch.arange(self._next, self._next + k, dtype=_LONG).view(leaf.shape)
        self._next += k
        self.write(leaf, ids)
        key = _storage_key(leaf)
        if key is not None:  # (x is no weight: NOTE [structural zeros that move])
            self._sources[key] = set()

    def ids(self, t: object) -> Tensor | None:
        """The set ids of ``t``'s elements (a CPU int64 tensor of its shape, a view of its
        storage's shadow), or None when ``t`` carries no sets (a constant)."""
        if not carries_sets(t):
            return None
        key = _storage_key(t)  # type: ignore[arg-type]
        if key is None:
            entry = self._opaque.get(id(t))
            if entry is None or entry[1] == 0:
                return None
            return torch.full(t.shape, entry[1], dtype=_LONG)  # type: ignore[union-attr]
        shadow = self._shadows.get(key)
        if shadow is None:
            return None
        if shadow.itemsize != t.element_size():  # NOTE [views of another element size]
            seen = self._resized(shadow, t.element_size())
            if seen is None:
                return torch.full(t.shape, self.table.union_all(shadow.ids), dtype=_LONG)
            return seen.as_strided(t.shape, t.stride(), t.storage_offset())
        return shadow.ids.as_strided(t.shape, t.stride(), t.storage_offset())

    def _resized(self, shadow: _Shadow, size: int) -> Tensor | None:
        """The shadow's ids seen by elements of ``size`` bytes (NOTE [views of another
        element size]), or None where the sizes are not multiples of each other."""
        if shadow.itemsize % size == 0:  # (a real view of a complex storage)
            return shadow.ids.repeat_interleave(shadow.itemsize // size)
        if size % shadow.itemsize == 0:  # (a complex view of a real storage)
            k = size // shadow.itemsize
            count = shadow.ids.numel() // k
            rows = torch.arange(count, dtype=_LONG).repeat_interleave(k)
            return self.table.union(rows, shadow.ids[: count * k], count)
        return None

    def tracked(self, t: object) -> bool:
        """Whether ``t`` may carry non-empty sets."""
        if not carries_sets(t):
            return False
        key = _storage_key(t)  # type: ignore[arg-type]
        if key is None:
            return id(t) in self._opaque
        return key in self._shadows

    def write(self, t: Tensor, ids: Tensor | None) -> None:
        """Sets the ids of ``t``'s elements (``ids`` broadcast to its shape; None: empty)."""
        if not carries_sets(t):
            return
        key = _storage_key(t)
        if key is None:
            sid = 0 if ids is None else self.table.union_all(ids)
            if sid or id(t) in self._opaque:
                self._opaque[id(t)] = (t, sid)
            return
        shadow = self._shadows.get(key)
        if shadow is None:
            if ids is None:
                return
            size = t.untyped_storage().nbytes() // max(1, t.element_size())
            flat = torch.zeros(size, dtype=_LONG)
            shadow = self._shadows[key] = _Shadow(flat, t.element_size(), t)
        if shadow.itemsize != t.element_size():  # NOTE [views of another element size]
            if not self._write_resized(shadow, t, ids):
                sid = self.table.union_all(shadow.ids) if ids is None else (
                    self.table.union_all(torch.cat([shadow.ids, ids.reshape(-1)])))
                shadow.ids.fill_(sid)
            return
        view = shadow.ids.as_strided(t.shape, t.stride(), t.storage_offset())
        if ids is None:
            view.zero_()
            return
        if ids.untyped_storage()._cdata == shadow.ids.untyped_storage()._cdata:
            ids = ids.clone()  # read from the shadow it is written to (an in-place op)
        view.copy_(ids.expand(t.shape) if ids.shape != t.shape else ids)

    def _write_resized(self, shadow: _Shadow, t: Tensor, ids: Tensor | None) -> bool:
        """Writes ``ids`` through ``t``, whose elements are of another size than the
        shadow's (NOTE [views of another element size]); False where the sizes are not
        multiples of each other."""
        size = t.element_size()
        new = (torch.zeros(t.shape, dtype=_LONG) if ids is None
               else ids.expand(t.shape)).reshape(-1)
        if shadow.itemsize % size == 0:  # (through a real view of a complex storage)
            k = shadow.itemsize // size
            pos = torch.arange(shadow.ids.numel() * k, dtype=_LONG).as_strided(
                t.shape, t.stride(), t.storage_offset()).reshape(-1)
            touched, inverse = torch.unique(pos // k, return_inverse=True)
            rows = torch.cat([torch.arange(touched.numel(), dtype=_LONG), inverse])
            shadow.ids[touched] = self.table.union(
                rows, torch.cat([shadow.ids[touched], new]), touched.numel())
            return True
        if size % shadow.itemsize == 0:  # (through a complex view of a real storage)
            k = size // shadow.itemsize
            pos = torch.arange(shadow.ids.numel() // k, dtype=_LONG).as_strided(
                t.shape, t.stride(), t.storage_offset()).reshape(-1)
            for part in range(k):
                shadow.ids[pos * k + part] = new
            return True
        return False

    def ids_or_empty(self, t: Tensor) -> Tensor:
        """:meth:`ids`, with zeros (empty sets) for a constant."""
        ids = self.ids(t)
        return torch.zeros(t.shape, dtype=_LONG) if ids is None else ids

    # ---- dispatch ------------------------------------------------------------------------

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable unless this says
        # False, and that wrapper imports torch._dynamo on the first op: seconds, once per
        # process, for nothing (detection never compiles).
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # the user's computation: its errors pass through
        with one_thread():
            self._propagate(func, args, kwargs, out)
        return out

    def _propagate(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        from torch_vjp._sparse import rules

        schema = func._schema
        mutating = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        if torch.Tag.inplace_view in func.tags and not schema.name.startswith("aten::resize"):
            # (squeeze_, unsqueeze_, t_, transpose_, as_strided_, detach_, set_: they change
            # a tensor's size, strides or storage, not its storage's values: its ids are
            # its new view of a shadow, as a view's. F.linear on a vector calls squeeze_;
            # ruled as a write of the op's result, every element got the union of all)
            return
        if func.is_view and not mutating:
            # shares its input's storage, hence its shadow; but a view of a tensor without
            # storage (a sparse tensor's values()) has storage of its own, without a shadow
            if any(_storage_key(t) is None and self.tracked(t) for t in inputs):
                outs = [t for t in tree_leaves(out) if isinstance(t, Tensor)
                        and _storage_key(t) is not None and not self.tracked(t)]
                call = rules.make_call(func, args, kwargs, outs)
                for t, ids in zip(outs, rules.conservative(self, call)):
                    self.write(t, ids)
            return
        outs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        # (an in-place op by its functional name: index_put_ as index_put)
        name = func._schema.name.removeprefix("aten::").removesuffix("_")
        # a random draw made inside f (dropout's mask, randperm) differs between the
        # detection run and the products, and between calls: its values, and whatever is
        # computed from them, are not constants (their zeros are not structural)
        random_in = name in rules.RANDOM or any(self.random(t) for t in inputs)
        valued_in = any(self.value_dependent(t) for t in inputs)
        read_values = any(self.from_values(t) for t in inputs)
        tracked_in = any(self.tracked(t) for t in inputs)
        if tracked_in and self.wrong_batching is None and name in rules.WRONG_BATCHING:
            self.wrong_batching = rules.WRONG_BATCHING[name]
        if name in rules.WRONG_REVERSE and self.wrong_reverse is None:
            arg, why = rules.WRONG_REVERSE[name]
            if self.tracked(rules.bind(func, args, kwargs).get(arg)):
                self.wrong_reverse = why
        if mutating and not outs:
            written = [a.name for a in schema.arguments
                       if a.alias_info is not None and a.alias_info.is_write]
            marked = [v for a in written
                      if isinstance(v := rules.bind(func, args, kwargs).get(a), Tensor)]
        else:
            marked = outs
        self._flow(inputs, marked, mutating)
        if name in rules.SCALAR_READS:  # (a branch on a weight's value: it guards too)
            for t in inputs:
                self.guarded_by(t)
        elif tracked_in:  # (an index or mask that places tracked data guards too)
            for t in inputs:
                if not carries_sets(t):
                    self.guarded_by(t)
        if not read_values and not tracked_in:
            if random_in or valued_in:
                self._mark(marked, random_in)
            return  # constants in, constants out
        # NOTE [a pattern shaped by values]
        made = name in rules.SHAPE_ONLY and not random_in  # (zeros_like(x): not from values)
        place_anywhere = False
        for t in outs:
            if not made and not carries_sets(t) and (key := _storage_key(t)) is not None:
                self._from_values[key] = t
        if name in rules.SCALAR_READS:
            self.shaped_by_value(f"aten.{name} (a number read from x, for Python to use)")
        elif name in rules.DATA_SHAPED:
            bound = rules.bind(func, args, kwargs)
            shaping = [bound.get(a) for a in rules.DATA_SHAPED[name] or ("self", "input")]
            if any(isinstance(t, Tensor) and (self.tracked(t) or self.from_values(t))
                   for t in shaping):
                self.shaped_by_value(f"aten.{name} (a shape read off values computed from x)")
        elif read_values and tracked_in and name not in rules.UNITED_BY_VALUE:
            bound = rules.bind(func, args, kwargs)
            placing = [t for a in rules.PLACING_ARGS if (v := bound.get(a)) is not None
                       for t in tree_leaves(v) if isinstance(t, Tensor)]
            if any(self.random(t) for t in placing):
                # placed by a random draw: detection's draw is not the products' one, so
                # no pattern of this draw holds; every output element may read any input
                # element of the op (a superset that holds for every draw)
                place_anywhere = True
            elif any(self.from_values(t) for t in placing):
                self.shaped_by_value(
                    f"aten.{name} (placing x's elements by indices or a mask computed from x)")
        if (read_values or random_in or valued_in) and not made:
            self._mark(marked, random_in)
        aliased: set[int | None] = set()
        if not mutating:  # outputs that share an input's storage are views: nothing to write
            aliased = {_storage_key(t) for t in inputs} - {None}
            if not any(carries_sets(t) and _storage_key(t) not in aliased for t in outs):
                return
        call = rules.make_call(func, args, kwargs, outs)
        targets = outs
        if mutating and not outs:  # an op that mutates and returns nothing: its arguments
            targets = [
                call.bound[a.name] for a in schema.arguments
                if a.alias_info is not None and a.alias_info.is_write
                and isinstance(call.bound.get(a.name), Tensor)
            ]
            results = rules.conservative(self, call, targets)
        elif place_anywhere or any(_storage_key(t) is None and self.tracked(t) for t in inputs):
            # (a tensor without storage, sparse or nested, carries one set kept by object:
            # a rule that indexes or reshapes it would look up a new object and find none,
            # and succeed with nothing; such an op is ruled conservatively, which its one
            # set makes nearly exact)
            results = rules.conservative(self, call)
        else:
            try:
                results = rules.apply(self, call)
                results = [
                    None if ids is None else ids.expand(t.shape)
                    for t, ids in zip(targets, results, strict=True)
                ]
            except Exception:  # noqa: BLE001 - a rule's own failure: be conservative instead
                results = rules.conservative(self, call)
        for t, ids in zip(targets, results):
            if carries_sets(t) and _storage_key(t) not in aliased:
                self.write(t, ids)
        for t in outs:  # (a float computed from x's values that carries no set: a 0/1 mask)
            if not made and not self.tracked(t) and (key := _storage_key(t)) is not None:
                self._from_values[key] = t


#: Tensor methods that hand values to Python or NumPy without reaching torch's dispatch.
_PYTHON_READS = frozenset({"tolist", "numpy", "__array__", "__float__", "__int__", "__index__",
                           "__complex__"})


class ValueReads(TorchFunctionMode):
    """Beside the :class:`Tracer` of a run: records (NOTE [a pattern shaped by values]) a
    read of x's values that bypasses torch's dispatch, ``.tolist()`` or ``.numpy()`` (a
    branch on ``x.tolist()[0] > 0``), which the tracer cannot see."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        name = getattr(func, "__name__", "")
        if name in _PYTHON_READS and args and isinstance(args[0], Tensor):
            t = args[0]
            self.tracer.guarded_by(t)  # (a branch on a weight's value)
            if self.tracer.tracked(t) or self.tracer.from_values(t):
                self.tracer.shaped_by_value(
                    f"Tensor.{name} (a value read from x, for Python to use)")
        return func(*args, **(kwargs or {}))
