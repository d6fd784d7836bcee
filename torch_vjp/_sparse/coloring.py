"""Colourings of a sparsity pattern: columns (forward mode) or rows (reverse mode) that share
no row (column) get one colour, so that one JVP (VJP) per colour computes them all.

NOTE [colouring]
Two columns of a Jacobian are structurally orthogonal when no row has a non-zero in both:
then ``J @ (e_j + e_k)`` holds column ``j`` in the rows of ``j`` and column ``k`` in the
rows of ``k``, untangled by the pattern. A colouring in which every colour is a set of
mutually orthogonal columns is a partial distance-2 colouring of the bipartite graph of
rows and columns (Gebremedhin, Manne and Pothen, "What colour is your Jacobian?", 2005;
ColPack; SparseMatrixColorings.jl), and ``J @ S``, ``S`` the ``n x colours`` seed matrix
with ``S[j, colour(j)] = 1``, is the compressed Jacobian, one JVP per colour. Rows work the
same way with VJPs, ``S.T @ J``.

:func:`greedy` colours the vertices one by one, each with the smallest colour no
neighbour at distance 2 has. It finds those colours through the rows: each row keeps the
set of colours its columns have taken (a Python int as a bit set), so a column's forbidden
colours are the union of its rows' sets, and colouring costs one bit operation per
non-zero. The vertex order decides how many colours greedy needs; two are tried and the
smaller colouring is kept: largest first (by an upper bound of the distance-2 degree: the
sum of the lengths of a column's rows, as ColPack's and SparseMatrixColorings' largest-first
orders sort by degree) and the natural order (which is optimal for banded patterns whose
bands are in order). A column with no non-zero needs no product and gets no colour (-1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from operator import or_

import torch
from torch import Tensor

from torch_vjp._sparse.pattern import Pattern

__all__ = ["Coloring", "greedy", "color_columns", "color_rows", "is_valid"]

_LONG = torch.long


@dataclass(frozen=True)
class Coloring:
    """A colouring of the columns (``mode="fwd"``) or rows (``mode="rev"``) of a pattern.

    Attributes:
        mode: ``"fwd"`` (columns, one JVP per colour) or ``"rev"`` (rows, one VJP each).
        colors: the colour of each column (row), ``-1`` for one with no non-zero.
        count: the number of colours, hence of products.
        order: the vertex order that gave it (``"largest_first"`` or ``"natural"``).
    """

    mode: str
    colors: Tensor
    count: int
    order: str


def greedy(ptr: list[int], nets: list[int], n_nets: int, order: list[int]) -> list[int]:
    """Greedy distance-2 colouring of vertices ``order`` (each vertex ``v`` belongs to the
    nets ``nets[ptr[v]:ptr[v+1]]``; vertices that share a net must differ). See NOTE
    [colouring].

    Example:
        >>> greedy([0, 1, 3, 4], [0, 0, 1, 1], 2, [0, 1, 2])  # a path: 0 - 1 - 2
        [0, 1, 0]
    """
    used = [0] * n_nets
    colors = [-1] * (len(ptr) - 1)
    get = used.__getitem__
    for v in order:
        members = nets[ptr[v] : ptr[v + 1]]
        if not members:
            continue
        mask = reduce(or_, map(get, members), 0)
        c = (~mask & (mask + 1)).bit_length() - 1
        colors[v] = c
        bit = 1 << c
        for i in members:
            used[i] |= bit
    return colors


def _color(ptr: Tensor, nets: Tensor, n_nets: int, net_len: Tensor, mode: str) -> Coloring:
    n_vertices = ptr.numel() - 1
    owner = torch.repeat_interleave(torch.arange(n_vertices, dtype=_LONG), ptr[1:] - ptr[:-1])
    degree = torch.zeros(n_vertices, dtype=_LONG).index_add_(0, owner, net_len[nets])
    orders = {
        "largest_first": torch.argsort(-degree, stable=True).tolist(),
        "natural": list(range(n_vertices)),
    }
    ptr_l, nets_l = ptr.tolist(), nets.tolist()
    lower = int(net_len.max()) if net_len.numel() else 0  # a net needs this many colours
    best: Coloring | None = None
    for name, order in orders.items():
        colors = greedy(ptr_l, nets_l, n_nets, order)
        count = max(colors, default=-1) + 1
        if best is None or count < best.count:
            best = Coloring(mode, torch.tensor(colors, dtype=_LONG), count, name)
        if count <= lower:
            break  # optimal
    assert best is not None
    return best


def color_columns(p: Pattern) -> Coloring:
    """A colouring of the columns of ``p`` for forward mode. See NOTE [colouring]."""
    ccol, order = p.csc()
    row_len = torch.bincount(p.rows, minlength=p.m)
    return _color(ccol, p.rows[order], p.m, row_len, "fwd")


def color_rows(p: Pattern) -> Coloring:
    """A colouring of the rows of ``p`` for reverse mode. See NOTE [colouring]."""
    col_len = torch.bincount(p.cols, minlength=p.n)
    return _color(p.crow(), p.cols, p.n, col_len, "rev")


def is_valid(p: Pattern, coloring: Coloring) -> bool:
    """Whether no two columns (rows) of one colour share a row (column), and every column
    (row) with a non-zero has a colour."""
    if coloring.mode == "fwd":
        net, vertex = p.rows, p.cols
    else:
        net, vertex = p.cols, p.rows
    colors = coloring.colors[vertex]
    if bool((colors < 0).any()):
        return False
    pairs = net * max(1, coloring.count) + colors
    return torch.unique(pairs).numel() == pairs.numel()
