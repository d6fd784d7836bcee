"""Embedding tables a forward renormalises in place (``max_norm``) and then reads otherwise.

NOTE [renormalised tables read again]
An Embedding or EmbeddingBag with ``max_norm`` renormalises, in place, the rows of its table
that a call looks up, then reads them. Over a batch, the rows that every example looks up
are renormalised; for one example alone, only its own. The lookup itself reads the
example's own rows only, and a row's renormalisation depends on that row alone, so each
example gets from it what it gets alone. A forward that then reads the table otherwise (a
tied output layer, ``h @ emb.weight.T``, a lookup without ``max_norm`` through a shared
table) reads, in the batch, rows that other examples renormalised: an example's output is
not the one it has alone, and every pass over the whole batch (the rules', then vmap's
stand-in) gives it another gradient. The examples the plan checks against the loop may look
up the same rows as the others (or no row may be above ``max_norm`` yet, when a table starts
small and grows in training), so the check alone can miss it: such a model is planned for
the per-example loop, which runs each example alone from the caller's table (vmap cannot
run the in-place renormalisation anyway). A plain lookup through the table's own
renormalising call is no other read, nor a view of the table.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["READ_AGAIN", "TableReads", "renormalising_tables"]

READ_AGAIN = (
    "an Embedding with max_norm renormalises rows of its table in place, and the forward "
    "reads the table again afterwards (a tied output layer, a product with the table): in a "
    "batch that read sees rows the other examples renormalised, so no pass over the batch "
    "gives an example its own gradient; the loop runs each example alone "
    "(NOTE [renormalised tables read again])")

_aten = torch.ops.aten
_RENORM = _aten.embedding_renorm_
_LOOKUPS = frozenset({_aten.embedding, _aten._embedding_bag,
                      _aten._embedding_bag_forward_only})


def renormalising_tables(model: nn.Module) -> list[nn.Module]:
    """The Embedding(Bag) layers of ``model`` with ``max_norm``."""
    return [m for m in model.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None]


def _span(t: Tensor) -> tuple[int, int, int] | None:
    """The storage and the byte range a tensor's elements lie in (a view of a larger
    buffer, the flat parameters some wrappers make, is told apart from its neighbours)."""
    try:
        base = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # (sparse, nested: no storage of one piece)
        return None
    size = t.element_size()
    first = t.storage_offset() * size
    extent = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    return base, first, first + extent * size


def _overlaps(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


class TableReads(TorchDispatchMode):
    """Sees whether a forward reads a table after renormalising it in place, other than by
    the lookup that renormalised it (NOTE [renormalised tables read again])."""

    def __init__(self) -> None:
        super().__init__()
        self.renormed: list[tuple[int, int, int]] = []
        self.pending: list[tuple[int, int, int]] = []  # renormalised for the next lookup
        self.read_again = False

    def _renormed(self, t: Tensor) -> bool:
        span = _span(t)
        return span is not None and any(_overlaps(span, r) for r in self.renormed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is _RENORM:
            span = _span(args[0])
            if span is not None:
                self.renormed.append(span)
                self.pending.append(span)
        elif not func.is_view and self.renormed and not self.read_again:
            table = _span(args[0]) if packet in _LOOKUPS and args else None
            if table is not None and table in self.pending:
                self.pending.remove(table)  # (the renormalising call's own lookup)
            else:
                self.read_again = any(self._renormed(t) for t in tree_leaves((args, kwargs))
                                      if isinstance(t, Tensor))
        return func(*args, **kwargs)
