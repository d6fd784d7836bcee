"""Rows of the examples added up by a table of the data: a matrix product whose one factor
is computed from the inputs' integers or booleans alone (NOTE [tables of the data in a
product]), for the order watch (``order.OrderWatch``).

NOTE [tables of the data in a product]
A table built from the data's integers or booleans (a one-hot table of group ids
``F.one_hot(g, C).double()``, a same-group table ``(g[:, None] == g).double()``) and
multiplied with rows of the examples along a dimension of size B (``G.T @ h``, ``A @ h``,
``G.transpose(0, 1) @ h``, ``G.mT @ h``, an ``einsum`` over the examples) adds up the rows
its entries pick: a group sum, a permutation. On a batch whose ids are all distinct and in
order, the table is the identity and the plan's data-flow tests rightly find each example
alone; on the next batch it can exchange rows or add several together, and the table
carries no gradient from one example to another that a plan made on the first batch could
have seen. As for a write at an index of the data (NOTE [writes at an index of the data] in
``order``), the watch names such a product (``data_writes``: ``"mm by a table of the
data"``) and the plan is made for the batch it was probed on only: each call plans again,
and its data-flow tests see that call's own table (rows exchanged: the layers after leave
the rules; rows added up: the module is refused as mixing examples).

The same holds where broadcasting pairs every row of the examples with a table's entries
(``(A[:, :, None] * h[None]).sum(1)``, ``h[None].expand(B, B, F).masked_fill(...)``): an
elementwise ``mul``, ``div``, ``where`` or ``masked_fill`` whose factor computed from the
examples' rows is broadcast (or expanded) along a dimension of size B of a table is named
too; one whose table spans the dimensions the rows hold (a padding mask, ``h *
mask[..., None]``, even where the sequence's length is B) pairs each row with its own
entries and is not.

A factor is a table when every tensor computed from the inputs that it is computed from is
an integer or boolean or a table itself (a weight that is a parameter, ``A * w``, keeps it
one; one computed from the examples' rows, ``A * h``, does not). A product of two tables is
a table (counts of pairs), and one of two factors that are computed from the examples' rows
(attention, ``h @ h.T``) carries their gradients, so the data-flow tests see what it mixes:
neither is named. A product by a factor that is not computed from the inputs (a layer's
weight, ``one_hot(g, C) @ W`` as an embedding is) adds up no rows of the examples. A
dimension of size B that does not hold the examples (a feature dimension of that size) is
taken for theirs: the plan made at every call is right, only slower. A table built by
writing at a sort's indices (a permutation matrix ``zeros(B, B).index_copy(0, order, eye)``)
has a word of its own, which routes the layers after it off the rules on every batch (NOTE
[orders that depend on the data] in ``order``): it is not named.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

__all__ = ["BY_TABLE", "is_table", "note_tables", "by_table"]

_aten = torch.ops.aten

#: matrix products: the positions of their two factors, and the dimensions of the first that
#: they contract (``addbmm`` adds up its batch of products too: dimension 0)
_PRODUCTS = {
    _aten.mm.default: (0, 1, (1,)), _aten.bmm.default: (0, 1, (2,)),
    _aten.addmm.default: (1, 2, (1,)), _aten.baddbmm.default: (1, 2, (2,)),
    _aten.addbmm.default: (1, 2, (0, 2)), _aten.mv.default: (0, 1, (1,)),
    _aten.addmv.default: (1, 2, (1,)), _aten.dot.default: (0, 1, (0,)),
    _aten.vdot.default: (0, 1, (0,)),
}
#: elementwise operators that can pair rows of the examples with a table of the data's
#: entries by broadcasting (``(A[:, :, None] * h[None]).sum(1)``)
_PAIRS = frozenset({"mul", "mul_", "div", "div_", "where", "masked_fill", "masked_fill_"})
#: how a product by a table of the data is named among the watch's ``data_writes``
BY_TABLE = "{} by a table of the data"


def is_table(t: Tensor, tables: Any) -> bool:
    """Whether ``t``, computed from the inputs, holds values of their integers or booleans
    alone (``tables``: the floating tensors so noted)."""
    return t in tables or not (t.is_floating_point() or t.is_complex())


def note_tables(words: Any, tables: Any, args: Any, out: Any) -> None:
    """Notes in ``tables`` the floating outputs computed from integers, booleans or tables of
    the data alone (``words``: the tensors computed from the inputs, before ``out`` is among
    them: an in-place write into a tensor of zeros, ``zeros(B, C).scatter_(1, g[:, None],
    1.0)``, is a table)."""
    read = [t for t in tree_leaves(args) if isinstance(t, Tensor) and t in words]
    table = bool(read) and all(is_table(t, tables) for t in read)
    for t in tree_leaves(out):
        if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex()):
            if table:
                tables[t] = True
            elif t in tables:  # (a table written over in place by rows: a table no more)
                del tables[t]


def by_table(func: Any, args: tuple[Any, ...], words: Any, tables: Any,
             batch: int) -> str | None:
    """The name of ``func`` where it is a matrix product that adds up the rows of a factor
    computed from the inputs along a dimension of size ``batch`` by a table of the data,
    None for any other operator."""
    if func._overloadpacket.__name__ in _PAIRS:
        return _paired(func, args, words, tables, batch)
    if func not in _PRODUCTS:
        return None
    i, j, dims = _PRODUCTS[func]
    a, b = args[i], args[j]
    if not (isinstance(a, Tensor) and isinstance(b, Tensor) and a in words and b in words):
        return None
    if is_table(a, tables) == is_table(b, tables):
        return None  # (rows by rows: their gradients show it; a table by a table: a table)
    if words[a if is_table(a, tables) else b]:
        return None  # (a table whose rows the watch follows: its word routes the layers)
    if any(d < a.dim() and a.shape[d] == batch for d in dims):
        return BY_TABLE.format(func._overloadpacket.__name__)
    return None


def _paired(func: Any, args: tuple[Any, ...], words: Any, tables: Any, batch: int) -> str | None:
    """The name of ``func`` where, broadcasting, it spreads the rows of the examples (a factor
    computed from the inputs that holds a dimension of size ``batch``) along a dimension of
    size ``batch`` of a table of the data: every row paired with every entry of the table, a
    product by it once added up (NOTE [tables of the data in a product])."""
    ts = [t for t in args if isinstance(t, Tensor) and t in words and t.dim()]
    if not ts or any(words[t] for t in ts if is_table(t, tables)):
        return None  # (a table whose rows the watch follows: its word routes the layers)
    n = max(t.dim() for t in ts)

    def size(t: Tensor, d: int) -> int:  # (an expanded dimension counts as broadcast)
        k = d - (n - t.dim())
        return 1 if k < 0 or t.stride(k) == 0 else t.shape[k]

    for r in (t for t in ts if not is_table(t, tables)):
        rows = [d for d in range(n) if size(r, d) == batch]
        for a in (t for t in ts if is_table(t, tables)):
            spread = [d for d in range(n) if size(a, d) == batch and size(r, d) == 1]
            if rows and spread:
                return BY_TABLE.format(func._overloadpacket.__name__)
    return None
