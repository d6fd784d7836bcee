"""Rows whose example depends on the data: a batch sorted, gathered or indexed by an index
computed from the inputs (NOTE [orders that depend on the data]).

NOTE [orders that depend on the data]
The plan's data-flow tests (``flow``) see which example each row belongs to on the batch
they probe, once per model structure. A model that reorders the examples by an index it
computes from them (``order = x[:, 0].argsort(); fc(h[order])[order.argsort()]``, as code
that packs sequences by length does) puts example ``i`` in row ``i`` on a batch whose order
is the identity and in another row on the next batch: rules trusted on the first batch
would hand one example's gradient to another (for DP-SGD, a clipped sum whose bound no
longer holds). So the planning forwards (``probe._shape_run``) watch every operator that
selects, reorders or writes rows by an index (indexing with tensors, ``index_select``,
``gather``, ``take``, ``index_put``, ``scatter``, ``index_add``, ``index_copy``, and
``sort``/``topk`` themselves): where the index depends on the model's inputs (it is computed
from them, by any chain of operators) and the tensor indexed carries them too, and the
dimension indexed holds the examples, the order of the rows is the data's. The examples'
dimension is the one whose size is the batch's in the run on the whole batch and the other
run's size in the run on fewer examples (the operators of the two runs matched one by one);
where the runs cannot be matched, any dimension of the batch's size is taken for it (safe:
the fallback is right whatever the order). Such a plan computes every parameter the rules
would by vmap (or the loop), which run each example alone, and says why.

An index built from a constant (a permutation buffer, ``torch.arange``, ``x[:, -1]``) does
not depend on the inputs and leaves the rules in place. An order computed in Python from
the inputs' values (``.tolist()``, ``.item()``) and made a tensor again is not seen: the
plan's checks against the loop (``verify``) remain for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["OrderWatch", "route_data_orders", "DATA_ORDER"]

_aten = torch.ops.aten

#: the operators that select or place rows by an index: (the tensor indexed, the dimension
#: argument's position or None for a list of indices per dimension, the index's position)
_BY_INDEX = {
    _aten.index.Tensor: (0, None, 1),
    _aten._unsafe_index.Tensor: (0, None, 1),
    _aten.index_put.default: (0, None, 1),
    _aten.index_put_.default: (0, None, 1),
    _aten._index_put_impl_.default: (0, None, 1),
    _aten._unsafe_index_put.default: (0, None, 1),
    _aten.index_select.default: (0, 1, 2),
    _aten.gather.default: (0, 1, 2),
    _aten.index_add.default: (0, 1, 2),
    _aten.index_add_.default: (0, 1, 2),
    _aten.index_copy.default: (0, 1, 2),
    _aten.index_copy_.default: (0, 1, 2),
    _aten.index_fill.int_Scalar: (0, 1, 2),
    _aten.index_fill_.int_Scalar: (0, 1, 2),
    _aten.scatter.src: (0, 1, 2),
    _aten.scatter.value: (0, 1, 2),
    _aten.scatter_.src: (0, 1, 2),
    _aten.scatter_.value: (0, 1, 2),
    _aten.scatter_add.default: (0, 1, 2),
    _aten.scatter_add_.default: (0, 1, 2),
    _aten.scatter_reduce.two: (0, 1, 2),
    _aten.scatter_reduce_.two: (0, 1, 2),
    _aten.take.default: (0, -1, 1),
}
#: the operators that reorder their input's rows by its values: (dimension's position, its
#: default)
_SORTS = {
    _aten.sort.default: (1, -1),
    _aten.sort.stable: (2, -1),
    _aten.topk.default: (2, -1),
}

DATA_ORDER = ("the model reorders or selects the examples' rows by an index it computes "
              "from the inputs ({ops}), so which row belongs to which example changes with "
              "the data and a plan probed on one batch cannot be trusted on the next: each "
              "example is computed alone")


class OrderWatch(TorchDispatchMode):
    """Within a forward, finds the operators that index a tensor carrying the inputs by an
    index computed from them: ``found`` lists ``(operator, shape indexed, dims indexed)``."""

    def __init__(self, xs: Sequence[Any]) -> None:
        super().__init__()
        self.found: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self._data = WeakIdKeyDictionary()
        for t in tree_leaves(list(xs)):
            if isinstance(t, Tensor):
                self._data[t] = True

    def _carries(self, v: Any) -> bool:
        return any(isinstance(t, Tensor) and t in self._data for t in tree_leaves(v))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # (the model's own errors pass through untouched)
        try:
            if self._carries((args, kwargs)):
                self._note(func, args, kwargs)
                for t in tree_leaves(out):
                    if isinstance(t, Tensor):
                        self._data[t] = True
        except Exception:  # noqa: BLE001 - arguments not as expected: taken for an order (safe)
            self.found.append((str(func), (), (-1,)))
        return out

    def _note(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if func in _SORTS:
            pos, default = _SORTS[func]
            src, dim = args[0], args[pos] if len(args) > pos else kwargs.get("dim", default)
            if src.dim():
                self.found.append((str(func), tuple(src.shape), (dim % src.dim(),)))
            return
        if func not in _BY_INDEX:
            return
        at, dim_at, index_at = _BY_INDEX[func]
        src, index = args[at], args[index_at] if len(args) > index_at else None
        rest = [a for i, a in enumerate(args) if i != index_at]
        if not self._carries(index) or not self._carries(rest):
            return
        shape = tuple(src.shape)
        if dim_at == -1:
            dims = tuple(range(len(shape)))
        elif dim_at is not None:
            dims = (args[dim_at] % max(len(shape), 1),)
        else:  # (one index per dimension, None for a slice; a mask spans its dimensions)
            dims, d = [], 0
            for ix in index:
                span = ix.dim() if ix is not None and ix.dtype in (torch.bool, torch.uint8) \
                    else 1
                if ix is not None and ix in self._data:
                    dims.extend(range(d, d + span))
                d += span
            dims = tuple(dims)
        if dims:
            self.found.append((str(func), shape, dims))


def _orders_on_examples(full: list, small: list | None, batch: int, other: int) -> list[str]:
    """The operators of ``full`` whose dimension indexed holds the examples."""
    matched = small is not None and len(small) == len(full) and all(
        a[0] == b[0] and len(a[1]) == len(b[1]) for a, b in zip(full, small))
    hits = []
    for i, (op, shape, dims) in enumerate(full):
        if dims == (-1,) or not shape:
            hits.append(op)  # (not understood: safe)
            continue
        if matched:
            theirs = small[i][1]
            on = any(shape[d] == batch and theirs[d] == other for d in dims)
        else:
            on = any(shape[d] == batch for d in dims)
        if on:
            hits.append(op)
    return sorted({op.split(".")[1] for op in hits})


def route_data_orders(plan: Any, full: Any, small: Any, batch: int) -> Any:
    """Moves the plan's rule parameters to the fallback where the planning forward reorders
    the examples' rows by an index computed from the inputs (NOTE [orders that depend on the
    data]); returns the plan."""
    found = getattr(full, "orders", None)
    if batch < 2 or not found or plan.mixing is not None:
        return plan
    ops = _orders_on_examples(found, getattr(small, "orders", None), batch,
                              getattr(small, "batch", 0))
    names = list(plan.rule_params)
    if ops and names:
        plan.route(names, DATA_ORDER.format(ops=", ".join(ops)))
    return plan
