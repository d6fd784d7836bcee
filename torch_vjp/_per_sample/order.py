"""Layers whose rows are ordered by the data: a batch sorted, gathered or indexed by an
index computed from the inputs (NOTE [orders that depend on the data]).

NOTE [orders that depend on the data]
The plan's data-flow tests (``flow``) see which example each row of a layer's input
belongs to on the batch they probe, once per model structure. A model that reorders the
examples by an index it computes from them (``order = x[:, 0].argsort(); fc(h[order])
[order.argsort()]``, as code that packs sequences by length does) puts example ``i`` in
row ``i`` on a batch whose order is the identity and in another row on the next batch:
rules trusted on the first batch would hand one example's gradient to another (for
DP-SGD, a clipped sum whose bound no longer holds). So the recorded planning forward
(``probe``) follows, under a dispatch mode (:class:`OrderWatch`), the order of the rows of
every tensor computed from the inputs, as a word of steps:

- an index read along a dimension of size B of such a tensor (``h[i]``, ``index_select``,
  ``gather``, ``take``), by an integer index computed from the inputs, appends the
  index's step; a write of its rows at such an index (``out[i] = h``, ``index_copy``,
  ``scatter``, ``index_put``, ``index_add``) appends the inverse step. Sorting along a
  dimension of size B (``sort``, ``argsort``) gives its indices a step of their own,
  ``P``; sorting those indices again gives ``P``'s inverse, as does scattering
  ``arange`` at them (``invert_permutation``, which ``pack_padded_sequence`` runs); any
  other index (``topk``, an input, a group id) is a step without inverse. A step followed
  by its inverse along the same dimension cancels: the rows are back in place
  (``h[order][order.argsort()]``), whatever the data, by construction rather than by what
  one batch shows. A step's dimension is which of the tensor's dimensions of size B it
  runs along (the first, the second): a ``(B, B)`` tensor written at ``order`` along its
  rows and read at ``order`` along its columns has both steps, and a step follows its
  dimension through a transpose (``transposed``);
- any other operator gives its result the word of the inputs it reads, and a word of its
  own, without inverse, where those words differ (rows of two orders combined).

A boolean mask computed from the inputs along the examples' dimension alone selects
examples by the data (``fc(h[keep])``): a step, undone by a write at the same mask
(``out[keep] = y``). ``masked_select`` and ``masked_scatter`` at a mask computed from the
inputs that spans the examples' dimension pack or unpack rows by how many rows before each
are set: a step without inverse. A mask over several dimensions (an EmbeddingBag's flattened batch,
``idx[mask]`` of a ``(B, L)`` mask, whose offsets say which rows are whose on every call)
and an index that is not computed from the inputs (``torch.arange``, a buffer,
``x[:, -1]``), the same on every batch, do not change the word: the layers after them keep
their rules. A rule call whose input or output has a non-empty
word (between an order and its restore, or after an order never restored) has its
parameters computed by vmap (or the loop), which run each example alone, and the plan
says why; a model whose output has one (its rows are ordered by the data) has all of its
rule parameters so computed, as the loss's split into the examples' losses then follows
the data too. A dimension of size B that does not hold the examples (a feature dimension
of that size) is taken for theirs: the fallback is right whatever the order. A plan that
finds a module mixing examples is left as it is (that refusal comes first). An order
computed in Python from the inputs' values (``.tolist()``, ``.item()``) and made a tensor
again is not seen: the plan's checks against the loop (``verify``) remain for it.

NOTE [writes at an index of the data]
Rows written at an index computed from the inputs (``total.index_add(0, gid, h)``,
``scatter_add``/``scatter_reduce`` along the examples' dimension, ``out[i] = h``, ``x[i] +=
y``, ``index_reduce``, ``segment_reduce`` of lengths from the data) land in one row where
the index repeats, and counts of the data's values (``bincount``, ``unique``) add up the
examples that share a value: a group mean over a group id in the input mixes the examples
of a group (so does a product by a table of the data: NOTE [tables of the data in a
product] in ``products``). On a batch whose ids are all distinct, no two examples meet, and the plan's
data-flow tests rightly find each example alone (a write at an index read back at it
cancels: the rows are back in place); on the next batch, two ids can be equal. What one
batch shows cannot be trusted on another: the watch names such operators
(``data_writes``), and a plan that found one is made for the batch it was probed on only
(``Plan.data_bound``): each call plans again, so its data-flow tests and its check against
the loop see that call's own ids (a model that mixes them is refused, under 'auto' and
'hooks', naming the module, as on a first call). An index that provably holds each row
once, a sort's indices or their inverse (``P``, ``I`` above), is exempt: a write at it
mixes no rows whatever the data. A scatter along a dimension the index does not hold
``B`` in (a one-hot ``zeros(B, C).scatter_(1, y, 1)``) writes within each example's row
and is exempt too, as is an ``index_put`` over several indices one of which, not computed
from the inputs (``torch.arange(B)``) or a sort's indices, holds values at each example that
no other example's entries hold (a one-hot target ``out[torch.arange(B), y] = 1``): no two
examples' entries meet whatever the others hold. Where such a write adds up (``index_add``, ``scatter_add``,
``scatter_reduce``, ``index_reduce``, ``index_put`` with ``accumulate=True``) or counts
(``bincount``, ``unique``) with one index entry per example, two equal entries on the batch
planned mean examples met: counts carry no gradient from one example to another, so the
data-flow tests cannot see it, and the plan refuses the module running the operator as
mixing examples (``mixing``), under 'auto' and 'hooks'.

The counts themselves (``bincount``'s, ``unique``'s, and what is computed from them alone)
hold one row per value of the data, not rows of the examples: a read of them at an index
(``torch.bincount(g)[g]``) looks up each example's own value and leaves the rows in place,
even where B distinct values give them B rows; counts do not depend on the order of the
rows they count, so a table combined with rows gives them no word of its own. A weighted
``bincount`` (``torch.bincount(g, weights=w)``) is no table: it adds ``w`` up at ``g``, as
``w.new_zeros(n).index_add(0, g, w)`` does, its rows in the order of the data's values
(``fc(torch.bincount(g, weights=w)[:, None])`` leaves the rules). Rows written at an index and read back at it
along the first dimension cancel whatever the size of the tensor written (``total[g]``
after ``total.index_add(0, g, h)`` over fewer groups than examples), and an index
unsqueezed or expanded with its entries still one per row (``g[:, None].expand(B, F)``, a
``scatter``'s index) is the same step as the index itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from torch_vjp._per_sample.products import by_table, note_tables
from torch_vjp._per_sample.transposed import moved_word

__all__ = ["OrderWatch", "route_data_orders", "DATA_ORDER", "OUTPUT_ORDER", "DATA_WRITE"]

_aten = torch.ops.aten

#: operators that read rows at an index: the index's position and the dimension's (None:
#: a list of indices, one per dimension)
_READS = {
    _aten.index.Tensor: (1, None),
    _aten._unsafe_index.Tensor: (1, None),
    _aten.index_select.default: (2, 1),
    _aten.gather.default: (2, 1),
    _aten.take.default: (1, "flat"),
}
#: operators that write rows at an index: the index's position, the dimension's (None: a
#: list of indices), the written values' position
_WRITES = {
    _aten.index_put.default: (1, None, 2),
    _aten.index_put_.default: (1, None, 2),
    _aten._index_put_impl_.default: (1, None, 2),
    _aten._unsafe_index_put.default: (1, None, 2),
    _aten.index_copy.default: (2, 1, 3),
    _aten.index_copy_.default: (2, 1, 3),
    _aten.index_add.default: (2, 1, 3),
    _aten.index_add_.default: (2, 1, 3),
    _aten.scatter.src: (2, 1, 3),
    _aten.scatter_.src: (2, 1, 3),
    _aten.scatter_add.default: (2, 1, 3),
    _aten.scatter_add_.default: (2, 1, 3),
    _aten.scatter_reduce.two: (2, 1, 3),
    _aten.scatter_reduce_.two: (2, 1, 3),
    _aten.index_reduce.default: (2, 1, 3),
    _aten.index_reduce_.default: (2, 1, 3),
}
#: writes whose index addresses one dimension per entry of the index (``dim``): rows of
#: different examples meet only where the index holds B entries along ``dim``
_SCATTERS = frozenset({"scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
                       "scatter_reduce_"})
#: operators that pack a tensor's elements at a mask (``masked_select``), or write a source's
#: elements, in order, at a mask (``masked_scatter``): row ``k`` of the result is another
#: row's, by how many of the mask's rows before ``k`` are set
_MASKED = frozenset({"masked_scatter", "masked_scatter_", "masked_select"})
#: operators that add up (or count) the rows that share a value of the data
_COUNTS = frozenset({"bincount", "_unique2", "unique_dim", "unique_consecutive",
                     "_unique", "histc", "segment_reduce"})
#: sorts: the dimension's position and default; whether its indices can be inverted
_SORTS = {
    _aten.sort.default: (1, -1, True),
    _aten.sort.stable: (2, -1, True),
    _aten.topk.default: (2, -1, False),
}
#: operators that keep an index's values as they are (its step goes with them)
_SAME_INDEX = frozenset({"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand",
                         "clone", "_to_copy", "contiguous", "alias", "detach", "lift_fresh",
                         "flatten"})

#: operators whose values do not depend on their inputs' values (only on their shapes)
#: counts of the data's values, and the outputs of each that hold one row per value (a table
#: of the values, not rows of the examples: a read of it at an index is a look-up)
_TABLES = {"bincount": (None,), "histc": (None,), "_unique2": (0, 2), "unique_dim": (0, 2),
           "unique_consecutive": (0, 2), "_unique": (0,)}
#: operators whose result holds an index's values at the positions they held (``g[:, None]
#: .expand(B, F)``): a step the index is given before is theirs too
_SHARED = frozenset({"unsqueeze", "expand", "clone", "contiguous", "detach", "alias"})

_FRESH = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "new_empty",
                    "new_zeros", "new_ones", "new_full", "empty_strided", "new_empty_strided"})

_MIXED = ("X", -1)  # (rows of two orders combined: no step undoes it)

DATA_ORDER = ("in '{path}', the rows of the layer's input are ordered by the model's own "
              "data ({ops}), so which row belongs to which example changes from one batch "
              "to the next and a plan probed on one batch cannot be trusted on another: "
              "each example is computed alone")
DATA_WRITE = ("the model writes rows at an index computed from its own data ({ops}): examples "
              "that share an index value meet in one row, so a plan probed on one batch "
              "cannot be trusted on the next, whose values may repeat where these did not; "
              "each call is planned and checked on its own batch")
OUTPUT_ORDER = ("the rows of the model's output are ordered by its own data ({ops}), so the "
                "split of the loss into the examples' losses changes from one batch to the "
                "next and a plan probed on one batch cannot be trusted on another: each "
                "example is computed alone")


def _inverse(step: tuple[str, int]) -> tuple[str, int]:
    kind, k = step
    return ({"P": "I", "I": "P", "G": "H", "H": "G"}.get(kind, "N"), k)


def _along(shape: Sequence[int], dim: int, batch: int) -> int:
    """Which of the dimensions of size ``batch`` of ``shape`` ``dim`` is (0 for the first):
    the same on a tensor whose one such dimension moves (``h.transpose(0, 1)``)."""
    return sum(1 for s in tuple(shape)[:dim] if s == batch)


def _then(word: tuple[Any, ...], step: tuple[str, int], dim: Any) -> tuple[Any, ...]:
    """``word`` followed by ``step`` along the dimension ``dim`` (``_along``'s): a step after
    its inverse along the same dimension cancels (rows written at ``g`` along the first
    dimension of a ``(B, B)`` tensor are not put back by a read at ``g`` along its second)."""
    if word and word[-1] == (*_inverse(step), dim) and step[0] in "PIGH":
        return word[:-1]
    return word + ((*step, dim),)


def _weights(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The weights of a weighted ``bincount`` (a write that adds them up at the data's values,
    not a table of counts: NOTE [writes at an index of the data]), None for any other."""
    if func._overloadpacket.__name__ != "bincount":
        return None
    w = args[1] if len(args) > 1 else kwargs.get("weights")
    return w if isinstance(w, Tensor) else None


class OrderWatch(TorchDispatchMode):
    """Within a forward, the word of every tensor computed from the inputs (NOTE [orders
    that depend on the data]): ``words`` holds it (a tensor absent is not computed from
    them), ``steps`` the index of a sort's or an inverse's indices; ``ops`` names the
    operators that changed a word along a dimension of size ``batch``."""

    def __init__(self, xs: Sequence[Any], batch: int, model: Any = None) -> None:
        super().__init__()
        self.batch = batch
        #: where the first write found to mix examples on this batch runs, None for none
        self.mixing: str | None = None
        self._names = {} if model is None else {id(m): p for p, m in model.named_modules()}
        self._stack: list[Any] = []
        self._handles: list[Any] = []
        self.words = WeakIdKeyDictionary()
        self.steps = WeakIdKeyDictionary()
        #: tensors of one row per value of the data (counts): NOTE [writes at an index of
        #: the data]
        self.tables = WeakIdKeyDictionary()
        self.ops: set[str] = set()
        #: the operators that wrote rows at an index of the data (NOTE [writes at an index
        #: of the data])
        self.data_writes: set[str] = set()
        #: floating tensors computed from the data's integers or booleans alone (NOTE
        #: [tables of the data in a product] in ``products``)
        self.discrete = WeakIdKeyDictionary()
        self._count = itertools.count()
        for t in tree_leaves(list(xs)):
            if isinstance(t, Tensor):
                self.words[t] = ()

    def __enter__(self) -> Any:
        if self._names:  # (the modules running, to name the one whose write mixes)
            names, stack = self._names, self._stack

            def enter(m: Any, args: Any) -> None:
                if id(m) in names:
                    stack.append(m)

            def leave(m: Any, args: Any, out: Any) -> None:  # (returns None: output kept)
                if stack and stack[-1] is m:
                    stack.pop()

            self._handles = [
                torch.nn.modules.module.register_module_forward_pre_hook(enter),
                torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        for h in self._handles:
            h.remove()
        self._handles, self._stack[:] = [], []
        return super().__exit__(*exc)

    def _mixes(self, func: Any, ix: Tensor, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> None:
        """Notes where ``func``, adding up or counting at ``ix``, mixes examples on this
        batch: one entry per example along the examples' dimension, two of them equal."""
        name = func._overloadpacket.__name__
        if "index_put" in name:  # (one index, added up at: accumulate=True)
            if not (args[3] if len(args) > 3 else kwargs.get("accumulate", False)) or sum(
                    isinstance(t, Tensor) for t in args[1]) != 1:
                return
        elif name in ("index_copy", "index_copy_", "scatter", "scatter_"):
            return  # (written over, not added up)
        if name in _SCATTERS:
            dim = args[1] % ix.dim()
            s = ix.sort(dim).values
            met = bool((s.narrow(dim, 1, self.batch - 1) == s.narrow(dim, 0, self.batch - 1))
                       .any())
        elif ix.dim() == 1 and ix.numel() == self.batch:
            met = ix.unique().numel() < self.batch
        else:
            return  # (entries not one per example: the data-flow tests look)
        if met and self.mixing is None:
            m = self._stack[-1] if self._stack else None
            path = self._names.get(id(m), "")
            self.mixing = (f"module '{path}' ({type(m).__name__})" if path else
                           f"the model's own forward ({type(m).__name__})")

    def word_of(self, value: Any) -> tuple[Any, ...]:
        """The word of the tensors in ``value`` computed from the inputs (``()`` for none,
        ``(_MIXED,)`` where they differ)."""
        words = {self.words[t] for t in tree_leaves(value)  # (counts: in no order of rows)
                 if isinstance(t, Tensor) and t in self.words and t not in self.tables}
        if len(words) > 1:
            return (_MIXED,)
        return words.pop() if words else ()

    def _step_of(self, index: Tensor) -> tuple[str, int]:
        step = self.steps.get(index)
        if step is None:  # (an index of its own: a write at it undoes a read at it)
            step = self.steps[index] = ("G", next(self._count))
        return step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # (the model's own errors pass through untouched)
        try:
            self._note(func, args, kwargs, out)
        except Exception:  # noqa: BLE001 - arguments not as expected: an order (safe)
            self.ops.add(str(func))
            for t in tree_leaves(out):
                if isinstance(t, Tensor):
                    self.words[t] = (_MIXED,)
        return out

    def _note(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              out: Any) -> None:
        if func._overloadpacket.__name__ in _FRESH or not any(
                isinstance(t, Tensor) and t in self.words for t in tree_leaves((args, kwargs))):
            return
        self._data_write(func, args, kwargs)
        product = by_table(func, args, self.words, self.discrete, self.batch)
        if product is not None:  # (rows added up by a table of the data)
            self.data_writes.add(product)
        # (before the words: an in-place write's output is its first argument)
        note_tables(self.words, self.discrete, (args, kwargs), out)
        word, step = self._follow(func, args, kwargs, out)
        sorted_ = func in _SORTS and step is not None
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self.words[t] = word
                if step is not None and not sorted_:
                    self.steps[t] = step
        self._tabled(func, args, kwargs, out)
        if sorted_:  # (the values are the rows reordered; the indices are in no order)
            self.words[out[1]], self.steps[out[1]] = (), step
        if func._schema.is_mutable and args and isinstance(args[0], Tensor):
            self._written(args[0]._base, word)  # (rows written through a view of it)

    def _tabled(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                out: Any) -> None:
        """Notes the tables among ``func``'s outputs: the counts of a ``bincount`` or
        ``unique``, and what is computed from tables alone (``1 / counts.double()``)."""
        name = func._overloadpacket.__name__
        if _weights(func, args, kwargs) is not None:
            return  # (a weighted bincount: rows added up at the data, not counts)
        if name in _TABLES:
            outs = (out,) if isinstance(out, Tensor) else tuple(out)
            for k in _TABLES[name]:
                t = outs[0 if k is None else k]
                if isinstance(t, Tensor):
                    self.tables[t] = True
            return
        read = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor) and t in self.words]
        if read and all(t in self.tables for t in read):
            for t in tree_leaves(out):
                if isinstance(t, Tensor):
                    self.tables[t] = True

    def _data_write(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Notes ``func`` where it writes rows at an index computed from the inputs that may
        repeat (NOTE [writes at an index of the data])."""
        name = func._overloadpacket.__name__
        if name in _COUNTS:  # (segment_reduce: of the segments' lengths, offsets, indices)
            read = (args[2:], kwargs) if name == "segment_reduce" else (args, kwargs)
            for t in tree_leaves(read):
                if isinstance(t, Tensor) and t in self.words and t.dtype != torch.bool:
                    self.data_writes.add(name)
                    if name in ("bincount", "_unique2", "unique_dim", "_unique"):
                        self._mixes(func, t, args, kwargs)
                    return
            return
        if func not in _WRITES:
            return
        at, dim_at, _ = _WRITES[func]
        index = args[at] if len(args) > at else kwargs.get("index", kwargs.get("indices"))
        if dim_at is None and self._own_rows(index, args[0]):
            return  # (each example's entries where no other example's go)
        ixs = list(index) if dim_at is None else [index]
        for ix in ixs:
            if not isinstance(ix, Tensor) or ix not in self.words or ix.dtype in (
                    torch.bool, torch.uint8):
                continue
            if self.steps.get(ix, ("G",))[0] in "PI":
                continue  # (a sort's indices, or their inverse: each row once)
            if name in _SCATTERS:
                dim = args[dim_at]
                if ix.dim() == 0 or ix.shape[dim % ix.dim()] != self.batch:
                    continue  # (within each example's row)
            self.data_writes.add(name)
            self._mixes(func, ix, args, kwargs)

    def _own_rows(self, index: Any, dest: Tensor) -> bool:
        """Whether a write at the list of indices ``index`` (one per dimension of ``dest``,
        None for a slice) puts no two examples' entries in one place, whatever the data: one
        index not computed from the data (``torch.arange(B)``, the same on every batch), or a
        sort's indices, holds values at one example that no other example's entries hold
        (NOTE [writes at an index of the data])."""
        if any(isinstance(ix, Tensor) and ix.dtype in (torch.bool, torch.uint8)
               for ix in index):
            return False  # (a mask spans several dimensions: its entries are not placed)
        at = [(d, ix) for d, ix in enumerate(index) if isinstance(ix, Tensor)]
        if not at or len(index) > dest.dim():
            return False
        shape = torch.broadcast_shapes(*(ix.shape for _, ix in at))
        dims = [k for k, s in enumerate(shape) if s == self.batch]
        if len(dims) != 1:  # (entries not one per example: an index of several of them)
            return False
        for d, ix in at:
            if ix in self.words and self.steps.get(ix, ("G",))[0] not in "PI":
                continue  # (values of the data: they may meet on the next batch)
            size = dest.shape[d]
            if size == 0:
                continue
            v = (ix.expand(shape).movedim(dims[0], 0).reshape(self.batch, -1) % size)
            rows = torch.arange(self.batch, device=v.device).unsqueeze(1).expand_as(v)
            pairs = torch.stack([v.reshape(-1), rows.reshape(-1)]).unique(dim=1)
            if pairs[0].unique().numel() == pairs.shape[1]:
                return True  # (each value met at one example alone)
        return False

    def _written(self, base: Tensor | None, word: tuple[Any, ...]) -> None:
        if base is not None:
            old = self.words.get(base)
            self.words[base] = word if old is None or old == word else (_MIXED,)

    def _follow(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                out: Any) -> tuple[tuple[Any, ...], tuple[str, int] | None]:
        """The word of ``func``'s output, and the step of its values as an index."""
        if func in _SORTS:
            at, default, invertible = _SORTS[func]
            src = args[0]
            dim = args[at] if len(args) > at else kwargs.get("dim", default)
            if src.dim() == 0 or src.shape[dim] != self.batch:
                return self.word_of((args, kwargs)), None
            mine = self.steps.get(src)
            step = (_inverse(mine) if mine is not None and mine[0] in "PI" and invertible
                    else ("P" if invertible else "N", next(self._count)))
            self.ops.add(func._overloadpacket.__name__)
            return _then(self.words.get(src, ()), step,
                         _along(src.shape, dim % src.dim(), self.batch)), step
        weights = _weights(func, args, kwargs)
        if weights is not None and args[0].dim() == 1 and args[0].shape[0] == self.batch:
            # (the weights added up at the data's values: index_add(0, g, weights))
            self.ops.add("bincount")
            return _then(self.words.get(weights, ()), _inverse(self._step_of(args[0])), 0), None
        if func in _READS:
            at, dim_at = _READS[func]
            src = args[0]
            if src in self.tables:  # (a look-up of each example's value: rows in place)
                return self.word_of((args, kwargs)), None
            found = self._indexed(src, args[at], dim_at if dim_at in (None, "flat")
                                  else args[dim_at], src.shape)
            if found is None and (dim_at is None or dim_at != "flat" and src.dim() and (
                    args[dim_at] % src.dim() == 0)):
                found = self._read_back(src, args[at])
            if found is None:
                return self.word_of((args, kwargs)), None
            self.ops.add(func._overloadpacket.__name__)
            return _then(self.words.get(src, ()), *found), None
        if func in _WRITES:
            at, dim_at, src_at = _WRITES[func]
            src = args[src_at] if len(args) > src_at else kwargs.get("values", kwargs.get(
                "source", kwargs.get("src")))
            if not isinstance(src, Tensor):
                return self.word_of((args, kwargs)), None
            found = self._indexed(src, args[at], args[dim_at] if dim_at is not None else None,
                                  src.shape if dim_at is not None else args[0].shape)
            if found is None:
                return self.word_of((args, kwargs)), None
            self.ops.add(func._overloadpacket.__name__)
            # (rows written at an index: the rows read at it, inversely; a constant, arange
            # scattered at a sort's indices, is their inverse as an index too)
            (found, dim) = found
            word = _then(self.words.get(src, ()), _inverse(found), dim)
            step = _inverse(found) if src not in self.words and found[0] in "PI" else None
            if args[0] in self.words and self.words[args[0]] != word:
                if src not in self.words:
                    return self.words[args[0]], step  # (h[i] = 0: the rows stay in place)
                return (_MIXED,), None  # (rows written into rows of another order)
            return word, step
        if func._overloadpacket.__name__ in _MASKED:
            mask = args[1] if len(args) > 1 else kwargs.get("mask")
            if isinstance(mask, Tensor) and mask in self.words and self.batch in tuple(
                    mask.shape):  # (rows packed or unpacked at a mask of the data)
                self.ops.add(func._overloadpacket.__name__)
                return _then(self.word_of((args, kwargs)), ("N", next(self._count)), None), None
        name = func._overloadpacket.__name__
        moved = (moved_word(func, args, out, self.words.get(args[0], ()), self.batch)
                 if args and isinstance(args[0], Tensor) else None)
        if moved is not None:  # (a (B, B) tensor transposed: its steps' dimensions move)
            return moved, None
        if name in _SHARED and args and isinstance(args[0], Tensor) and (
                args[0] in self.words and args[0].dim() == 1 and not args[0].is_floating_point()
                and isinstance(out, Tensor) and self._rows_first(out)):
            return self.words.get(args[0], ()), self._step_of(args[0])  # (g[:, None])
        if name in _SAME_INDEX and args and isinstance(
                args[0], Tensor) and args[0] in self.steps:
            step = self.steps[args[0]]
            if step[0] == "G" and not (isinstance(out, Tensor) and self._rows_first(out)):
                return self.words.get(args[0], ()), None  # (its entries moved off the rows)
            return self.words.get(args[0], ()), step
        return self.word_of((args, kwargs)), None

    def _read_back(self, src: Tensor, index: Any) -> tuple[tuple[str, int], int] | None:
        """The step of an index ``src``'s rows were last written at (``total[g]`` after
        ``total.index_add(0, g, h)``, whatever ``total``'s size), along the first dimension:
        the read undoes it."""
        word = self.words.get(src, ())
        if isinstance(index, (list, tuple)):  # (total[g]: one index, at the first dimension)
            if not index or any(ix is not None for ix in index[1:]):
                return None
            index = index[0]
        if isinstance(index, Tensor) and index in self.steps and word and (
                word[-1] == (*_inverse(self.steps[index]), 0) and self.steps[index][0] in "GH"):
            return self.steps[index], 0
        return None

    def _rows_first(self, t: Tensor) -> bool:
        """Whether ``t``'s one dimension of size B is its first."""
        return t.dim() > 0 and t.shape[0] == self.batch and self.batch not in tuple(t.shape[1:])

    def _indexed(self, src: Tensor, index: Any, dim: int | str | None,
                 shape: Sequence[int]) -> tuple[tuple[str, int], Any] | None:
        """The step of an index computed from the inputs along a dimension of size B (of
        ``shape``) and that dimension, None for none."""
        if dim is None:  # (one index per dimension, None for a slice; a mask spans its dims)
            found, d = None, 0
            for ix in index:
                if ix is not None and ix.dtype in (torch.bool, torch.uint8):
                    if ix.dim() == 1 and ix in self.words and d < len(shape) and (
                            shape[d] == self.batch):  # (examples selected by the data)
                        found = ((self._step_of(ix), _along(shape, d, self.batch))
                                 if found is None else
                                 ((_MIXED[0], -2), None))
                    d += ix.dim()  # (a mask over several dimensions: NOTE)
                    continue
                if ix is not None and ix in self.words and d < len(shape) and (
                        shape[d] == self.batch):
                    found = ((self._step_of(ix), _along(shape, d, self.batch))
                             if found is None else
                             ((_MIXED[0], -2), None))
                d += 1
            return found
        if not isinstance(index, Tensor) or index not in self.words or index.dtype in (
                torch.bool, torch.uint8):
            return None
        if dim == "flat":  # (take: a flat index into every dimension)
            return (self._step_of(index), "flat") if self.batch in tuple(shape) else None
        if not len(shape) or shape[dim % len(shape)] != self.batch:
            return None
        along = _along(shape, dim % len(shape), self.batch)
        if index.dim() > 1 and index.shape[dim % index.dim()] != self.batch:
            return ("G", next(self._count)), along  # (not each row's entry: its own index)
        return self._step_of(index), along


def route_data_orders(plan: Any, calls: Sequence[Any], tracked: dict[int, str],
                      watch: OrderWatch | None, out: Any) -> None:
    """Moves off the rules the parameters of the rule calls whose rows are ordered by the
    data (NOTE [orders that depend on the data]), all of them where the model's output is."""
    if watch is None or not watch.ops or plan.mixing is not None:
        return
    ops = ", ".join(sorted(watch.ops))
    rule = set(plan.rule_params)
    if watch.word_of(out):
        plan.route(sorted(rule), OUTPUT_ORDER.format(ops=ops))
        return
    for c in calls:
        if not watch.word_of((c.args, c.kwargs, c.outputs)):
            continue
        names = [n for n in (tracked.get(id(t)) for t, _ in c.params.values())
                 if n is not None and n in rule]
        if names:
            plan.route(names, DATA_ORDER.format(path=c.path, ops=ops))
            rule.difference_update(names)
