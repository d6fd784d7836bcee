"""The word of a tensor transposed (NOTE [orders that depend on the data] in ``order``): a
step names the dimension it ran along by which of the tensor's dimensions of size B it is
(the first, the second), so where ``t``, ``transpose`` or ``permute`` (``.T``, ``.mT``,
``movedim``) moves the dimensions of a tensor that holds two of size B, each step follows
its dimension to its new place. Rows written at a sort's indices along the first dimension
of a ``(B, B)`` table, transposed, and read back at them along the first dimension again are
not in place: the read runs along the dimension the write's columns were."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

__all__ = ["moved_word"]

_MOVES = frozenset({"t", "transpose", "permute"})


def _order(name: str, args: tuple[Any, ...], rank: int) -> list[int] | None:
    """Which dimension of the input each dimension of ``name``'s output is."""
    order = list(range(rank))
    if name == "t":
        return order[::-1] if rank == 2 else order
    if name == "transpose":
        a, b = args[1] % max(rank, 1), args[2] % max(rank, 1)
        order[a], order[b] = order[b], order[a]
        return order
    if name == "permute":
        return [d % rank for d in args[1]]
    return None


def _sized(shape: Sequence[int], batch: int) -> list[int]:
    return [d for d, s in enumerate(shape) if s == batch]


def moved_word(func: Any, args: tuple[Any, ...], out: Any, word: tuple[Any, ...],
               batch: int) -> tuple[Any, ...] | None:
    """``word``, the word of ``args[0]``, with each step's dimension moved where ``func``
    (a transpose) puts it; None where ``func`` moves no dimension of size ``batch``."""
    name = func._overloadpacket.__name__
    if name not in _MOVES or not word or not isinstance(out, Tensor):
        return None
    src = args[0]
    before = _sized(src.shape, batch)
    if len(before) < 2:
        return None  # (one dimension of size B: it is the first of them wherever it goes)
    order = _order(name, args, src.dim())
    if order is None:
        return None
    after = _sized(out.shape, batch)
    moved = []
    for step in word:
        if len(step) == 3 and isinstance(step[2], int) and 0 <= step[2] < len(before):
            at = order.index(before[step[2]])  # (where the step's dimension went)
            step = (step[0], step[1], after.index(at))
        moved.append(step)
    return tuple(moved)
