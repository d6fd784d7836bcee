"""Sparsity rules of scatters: writes of values at positions (``index_put``, ``scatter``,
``index_copy``, ``put``) that overwrite (a move, or a union where a position is written
more than once) or accumulate (a union), registered with the rules of
:mod:`~torch_vjp._sparse.rules`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torch_vjp._sparse.rules import combine, for_outputs, move, register
from torch_vjp._sparse.tracer import Call, Tracer, carries_sets

__all__ = ["index_put", "scatter", "index_copy", "index_add", "put"]

_LONG = torch.long
aten = torch.ops.aten


def _positions(x: Tensor) -> Tensor:
    return torch.arange(x.numel(), dtype=_LONG).view(x.shape)


def _accumulate(
    tr: Tracer, call: Call, target: Tensor, pos: Tensor, src: Any, sliced: bool = False
) -> list[Tensor | None]:
    """``target``'s elements united with ``src``'s at flat positions ``pos`` (``src``
    broadcast to ``pos``'s shape, or with ``sliced`` its leading block of that shape, as
    ``scatter`` reads it)."""
    numel = target.numel()
    rows = [torch.arange(numel, dtype=_LONG)]
    ids = [tr.ids_or_empty(target).reshape(-1)]
    if isinstance(src, Tensor) and carries_sets(src):
        src_ids = tr.ids(src)
        if src_ids is not None:
            if sliced:
                src_ids = src_ids[tuple(slice(0, s) for s in pos.shape)]
            src_ids = src_ids.expand(pos.shape)
            rows.append(pos.reshape(-1))
            ids.append(src_ids.reshape(-1))
    res = tr.table.union(torch.cat(rows), torch.cat(ids), numel).view(target.shape)
    return for_outputs(call, res)


def _overwrite(
    tr: Tracer, call: Call, target: Tensor, pos: Tensor, src: Any, sliced: bool = False
) -> list[Tensor | None]:
    """An overwriting scatter of ``src`` into ``target`` at flat positions ``pos``: a move,
    unless some position is written more than once. Then the value is the last writer's,
    but autograd's backward sends that element's gradient to every writer (and forward
    mode takes the last one), so the element depends on all of them: united, as
    :func:`_accumulate` does (a superset: the target's own set is kept too)."""
    flat = pos.reshape(-1)
    if isinstance(src, Tensor) and flat.numel() > 1 and flat.unique().numel() < flat.numel():
        return _accumulate(tr, call, target, pos, src, sliced)
    return move(tr, call)


@register("index_put", "_unsafe_index_put", "index_put_impl", "_index_put_impl")
def index_put(tr: Tracer, call: Call) -> list[Tensor | None]:
    """``self[indices] = values`` overwrites (a move); with ``accumulate=True`` it adds. By
    indices or a mask computed from x (``y[x < 0] = 0``), the values may land anywhere:
    every element unites its own set with all of the values' (a superset that holds at
    every x, as :func:`where`'s)."""
    x = call.bound["self"]
    if any(isinstance(i, Tensor) and tr.from_values(i) for i in call.bound["indices"]):
        vals = call.bound.get("values")
        v = tr.ids(vals) if isinstance(vals, Tensor) else None
        sid = tr.table.union_all(v.reshape(-1)) if v is not None and v.numel() else 0
        spread = torch.full(x.shape, sid, dtype=_LONG) if sid else None
        return for_outputs(call, combine(tr, x.shape, [tr.ids(x), spread]))
    indices = [None if i is None else i.cpu() for i in call.bound["indices"]]
    pos = aten.index.Tensor(_positions(x), indices)
    if not call.bound.get("accumulate"):
        return _overwrite(tr, call, x, pos, call.bound["values"])
    return _accumulate(tr, call, x, pos, call.bound["values"])


@register("scatter", "scatter_add", "scatter_reduce")
def scatter(tr: Tracer, call: Call) -> list[Tensor | None]:
    """``scatter`` without ``reduce`` overwrites (a move); ``scatter_add``,
    ``scatter_reduce`` and ``scatter(reduce=...)`` unite."""
    x = call.bound["self"]
    pos = torch.gather(_positions(x), call.bound["dim"], call.bound["index"].cpu())
    if call.name == "scatter" and call.bound.get("reduce") is None:
        return _overwrite(tr, call, x, pos, call.bound.get("src"), sliced=True)
    return _accumulate(tr, call, x, pos, call.bound.get("src"), sliced=True)


@register("index_copy")
def index_copy(tr: Tracer, call: Call) -> list[Tensor | None]:
    """``index_copy`` overwrites the selected slices with ``source`` (a move; united where
    an index repeats, :func:`_overwrite`)."""
    x = call.bound["self"]
    pos = torch.index_select(_positions(x), call.bound["dim"], call.bound["index"].cpu())
    return _overwrite(tr, call, x, pos, call.bound["source"])


@register("index_add", "index_reduce")
def index_add(tr: Tracer, call: Call) -> list[Tensor | None]:
    """``index_add``/``index_reduce`` unite ``source`` into the selected slices."""
    x = call.bound["self"]
    pos = torch.index_select(_positions(x), call.bound["dim"], call.bound["index"].cpu())
    return _accumulate(tr, call, x, pos, call.bound["source"])


@register("put")
def put(tr: Tracer, call: Call) -> list[Tensor | None]:
    """``put`` overwrites, or with ``accumulate=True`` adds, at flat indices."""
    x = call.bound["self"]
    pos = call.bound["index"].cpu().reshape(-1) % max(1, x.numel())
    if not call.bound.get("accumulate"):
        return _overwrite(tr, call, x, pos, call.bound["source"])
    return _accumulate(tr, call, x, pos, call.bound["source"])
