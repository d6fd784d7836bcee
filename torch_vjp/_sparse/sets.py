"""Index sets: the table of the sets of input elements that tensor elements depend on, and
its one operation, the union of many sets at once.

NOTE [index sets]
Sparsity detection gives every element of every tensor derived from the input an index set:
the input elements (flattened columns of the Jacobian) it can depend on. Elements do not hold
their sets; they hold a set id, an int64 into one :class:`SetTable` per detection run, so an
id tensor of a tensor's shape stands for all its sets, and the ops that move data (views,
slicing, indexing, concatenation, padding) move the ids as they move the values. Id 0 is the
empty set (a constant); ids ``1..n`` are the singletons of the ``n`` input elements.

Everything else is a union: an output element depends on the union of the sets of the input
elements it reads (an elementwise op, a reduction, a matrix product). :meth:`SetTable.union`
takes all such references of an op at once, as ``(output row, set id)`` pairs, vectorised:

1. duplicate references are dropped; a row that references one set gets that set's id (no
   new set: the common case for elementwise ops with one tracked operand);
2. rows that reference the same list of ids get one new set (hash-consing, checked exactly:
   a hash collision only costs a missed merge). This is what keeps a dense layer cheap: all
   256 units of a hidden layer of one example depend on the same set, so the next layer
   references one id per example, not 256 copies of it;
3. a union as large as the largest set it unites is that set (no new id).

The table only grows during one detection run and is dropped with it.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["SetTable"]

_LONG = torch.long
#: Hash values per set id are drawn below this bound, so sums of up to 2**23 of them fit in
#: an int64 without overflow.
_HASH_BOUND = 2**40


class SetTable:
    """Sets of input elements (columns), stored as compressed rows: set ``s`` holds
    ``members[ptr[s]:ptr[s + 1]]``, sorted. See NOTE [index sets].

    Args:
        n: the number of input elements; ids ``1..n`` are the singletons ``{0}..{n-1}``.

    Example:
        >>> table = SetTable(3)
        >>> ids = table.union(torch.tensor([0, 0, 1]), torch.tensor([1, 2, 3]), 2)
        >>> [table.members_of(int(s)) for s in ids]
        [[0, 1], [2]]
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.count = n + 1  # sets stored, the empty set (id 0) included
        cap = max(16, 2 * (n + 1))
        self._ptr = torch.zeros(cap + 1, dtype=_LONG)
        self._ptr[1 : n + 2] = torch.arange(n + 1, dtype=_LONG)
        self._members = torch.zeros(max(16, 2 * n), dtype=_LONG)
        self._members[:n] = torch.arange(n, dtype=_LONG)
        self._gen = torch.Generator().manual_seed(0x5EED)
        self._hash = torch.randint(1, _HASH_BOUND, (cap,), generator=self._gen, dtype=_LONG)

    # ---- storage ---------------------------------------------------------------------

    @property
    def ptr(self) -> Tensor:
        """Offsets of the sets in :attr:`members` (``count + 1`` entries)."""
        return self._ptr[: self.count + 1]

    @property
    def members(self) -> Tensor:
        """The members of every set, concatenated."""
        return self._members[: int(self._ptr[self.count])]

    def sizes(self, ids: Tensor) -> Tensor:
        """The number of members of each set in ``ids``."""
        return self._ptr[ids + 1] - self._ptr[ids]

    def members_of(self, sid: int) -> list[int]:
        """The members of one set, as a list (for tests and messages)."""
        return self._members[int(self._ptr[sid]) : int(self._ptr[sid + 1])].tolist()

    def _append(self, sizes: Tensor, cols: Tensor) -> Tensor:
        """Stores new sets (``sizes[k]`` members each, ``cols`` concatenated); their ids."""
        k = sizes.numel()
        first = self.count
        end = int(self._ptr[first])
        total = cols.numel()
        if first + k + 1 >= self._ptr.numel():
            cap = 2 * (first + k + 1)
            ptr = torch.zeros(cap + 1, dtype=_LONG)
            ptr[: first + 1] = self._ptr[: first + 1]
            self._ptr = ptr
            extra = torch.randint(1, _HASH_BOUND, (cap - self._hash.numel(),),
                                  generator=self._gen, dtype=_LONG)
            self._hash = torch.cat([self._hash, extra])
        if end + total > self._members.numel():
            members = torch.zeros(2 * (end + total), dtype=_LONG)
            members[:end] = self._members[:end]
            self._members = members
        self._members[end : end + total] = cols
        self._ptr[first + 1 : first + k + 1] = end + torch.cumsum(sizes, 0)
        self.count = first + k
        return torch.arange(first, first + k, dtype=_LONG)

    # ---- unions ----------------------------------------------------------------------

    def expand(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The members of the sets ``ids``: pairs ``(k, column)``, one per member of
        ``ids[k]``, sorted by ``k`` (members sorted within each ``k``)."""
        lens = self.sizes(ids)
        total = int(lens.sum())
        k = torch.repeat_interleave(torch.arange(ids.numel(), dtype=_LONG), lens)
        if total == 0:
            return k, k
        starts = self._ptr[ids]
        shift = starts - (torch.cumsum(lens, 0) - lens)
        pos = torch.arange(total, dtype=_LONG) + torch.repeat_interleave(shift, lens)
        return k, self._members[pos]

    def union(self, rows: Tensor, ids: Tensor, n_rows: int) -> Tensor:
        """For each of ``n_rows`` output elements, the id of the union of the sets it
        references: ``(rows[k], ids[k])`` says that element ``rows[k]`` reads set
        ``ids[k]``. See NOTE [index sets].

        Args:
            rows: int64 row of each reference, in ``0..n_rows-1``.
            ids: int64 set id of each reference (0, the empty set, may appear).
            n_rows: the number of output elements.

        Returns:
            An int64 tensor of ``n_rows`` set ids.
        """
        out = torch.zeros(n_rows, dtype=_LONG)
        keep = ids != 0
        rows, ids = rows[keep], ids[keep]
        if ids.numel() == 0:
            return out
        s = self.count
        key = torch.unique(rows * s + ids)
        rows = torch.div(key, s, rounding_mode="floor")
        ids = key - rows * s
        counts = torch.bincount(rows, minlength=n_rows)
        per_ref = counts[rows]
        single = per_ref == 1
        out[rows[single]] = ids[single]
        if bool(single.all()):
            return out
        multi = ~single
        rows, ids = rows[multi], ids[multi]
        # compact numbering of the rows that reference several sets
        urows, inv = torch.unique_consecutive(rows, return_inverse=True)
        k = urows.numel()
        cnt = counts[urows]
        start = torch.cumsum(cnt, 0) - cnt
        rep = self._same_lists(ids, inv, cnt, start)
        is_rep = rep == torch.arange(k, dtype=_LONG)
        reps = torch.nonzero(is_rep).flatten()
        sel = is_rep[inv]
        e_row, e_id = inv[sel], ids[sel]
        # members of every referenced set, per representative row (compact numbering)
        local = torch.full((k,), -1, dtype=_LONG)
        local[reps] = torch.arange(reps.numel(), dtype=_LONG)
        e_loc = local[e_row]
        which, cols = self.expand(e_id)
        m_rows = e_loc[which]
        n = max(1, self.n)
        key = torch.unique(m_rows * n + cols)
        r2 = torch.div(key, n, rounding_mode="floor")
        c2 = key - r2 * n
        new_sizes = torch.bincount(r2, minlength=reps.numel())
        # a union as large as its largest operand is that operand
        lens = self.sizes(e_id)
        best = torch.zeros(reps.numel(), dtype=_LONG).scatter_reduce_(
            0, e_loc, lens * s + e_id, reduce="amax", include_self=False
        )
        best_size = torch.div(best, s, rounding_mode="floor")
        best_id = best - best_size * s
        reuse = new_sizes == best_size
        set_id = best_id.clone()
        fresh = ~reuse
        if bool(fresh.any()):
            keep_cols = fresh[r2]
            set_id[fresh] = self._append(new_sizes[fresh], c2[keep_cols])
        out[urows] = set_id[local[rep]]
        return out

    def _same_lists(self, ids: Tensor, inv: Tensor, cnt: Tensor, start: Tensor) -> Tensor:
        """For each compact row, the first compact row with the same sorted list of set ids
        (itself if none comes earlier): hashed, then checked element by element."""
        k = cnt.numel()
        h = torch.zeros(k, dtype=_LONG).index_add_(0, inv, self._hash[ids])
        _, group = torch.unique(h, return_inverse=True)
        first = torch.full((int(group.max()) + 1,), k, dtype=_LONG).scatter_reduce_(
            0, group, torch.arange(k, dtype=_LONG), reduce="amin", include_self=True
        )
        rep = first[group]
        if bool((rep == torch.arange(k, dtype=_LONG)).all()):
            return rep
        # exact check: same length and the same id at every position
        pos = torch.arange(ids.numel(), dtype=_LONG) - start[inv]
        rep_e = rep[inv]
        same_len = cnt[rep_e] == cnt[inv]
        idx = torch.where(same_len, start[rep_e] + pos, torch.zeros_like(pos))
        equal = same_len & (ids[idx] == ids)
        bad = torch.zeros(k, dtype=torch.bool)
        bad[inv[~equal]] = True
        return torch.where(bad, torch.arange(k, dtype=_LONG), rep)

    def union_all(self, ids: Tensor) -> int:
        """The id of the union of every set in ``ids`` (any shape)."""
        flat = ids.reshape(-1)
        return int(self.union(torch.zeros_like(flat), flat, 1)[0])
