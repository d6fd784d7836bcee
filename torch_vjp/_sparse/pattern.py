"""Sparsity patterns: the structural non-zeros of an ``(m, n)`` Jacobian as sorted index
arrays on the CPU, built from detection or from a pattern the user passes (checked here).

The Jacobian of ``f`` at ``x`` is taken for the flattened output and input: row ``i`` is
output element ``i`` (output leaves concatenated in pytree order, each flattened), column
``j`` is input element ``j`` (likewise for the leaves of ``x``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from torch_vjp._engine.kept import same_bits
from torch_vjp._errors import JacobianCallTypeError, JacobianOptionError, a_type, shape_str

__all__ = ["Pattern", "pattern_from_user", "LAYOUTS"]

_LONG = torch.long

#: The layouts a user's pattern may have, and those a sparse Jacobian can be returned in.
LAYOUTS = (torch.strided, torch.sparse_coo, torch.sparse_csr, torch.sparse_csc)


class Pattern:
    """The entries ``(rows[k], cols[k])`` of an ``(m, n)`` pattern, unique and sorted by row,
    then column (the order of CSR and of a coalesced COO tensor).

    Example:
        >>> p = Pattern(2, 3, torch.tensor([1, 0, 1]), torch.tensor([2, 0, 0]))
        >>> p.rows.tolist(), p.cols.tolist(), p.crow().tolist()
        ([0, 1, 1], [0, 0, 2], [0, 1, 3])
    """

    __slots__ = ("m", "n", "rows", "cols", "_crow", "_csc", "by_value", "guards", "homes",
                 "wrong_batching", "wrong_reverse")

    def __init__(self, m: int, n: int, rows: Tensor, cols: Tensor, *, ordered: bool = False):
        self.m, self.n = int(m), int(n)
        rows, cols = rows.to(_LONG).reshape(-1), cols.to(_LONG).reshape(-1)
        if not ordered and rows.numel():
            key = torch.unique(rows * max(1, self.n) + cols)
            rows = torch.div(key, max(1, self.n), rounding_mode="floor")
            cols = key - rows * max(1, self.n)
        self.rows, self.cols = rows, cols
        self._crow: Tensor | None = None
        self._csc: tuple[Tensor, Tensor] | None = None
        #: where detection found the pattern shaped by the input's values, the op that did
        #: (it holds at that input only: NOTE [a pattern shaped by values]); else None
        self.by_value: str | None = None
        #: where detection saw an op whose backward torch batches wrongly, that op (NOTE
        #: [wrong batching rules] in :mod:`~torch_vjp._sparse.probe`): reverse mode's
        #: products are then computed without vmap; else None
        self.wrong_batching: str | None = None
        #: where detection saw an op whose backward is wrong without vmap too, that op:
        #: the products are then computed in forward mode only
        self.wrong_reverse: str | None = None
        #: the tensors whose zeros detection took as structural, as (weak reference, a
        #: copy of its values) when detected (NOTE [structural zeros that move])
        self.guards: tuple[tuple[Any, Tensor], ...] = ()
        #: where guards live, as (weak reference to the module or object holding one,
        #: "_buffers" or "__dict__", name, weak reference to the guard): one rebound is a
        #: guard that changed
        self.homes: tuple[tuple[Any, str, str, Any], ...] = ()

    def same_entries(self, other: "Pattern") -> bool:
        """Whether ``other`` has the same shape and entries."""
        return (self.m == other.m and self.n == other.n
                and self.rows.numel() == other.rows.numel()
                and torch.equal(self.rows, other.rows) and torch.equal(self.cols, other.cols))

    def guard(self, tensors: Any) -> None:
        """Keeps ``tensors`` (from before detection's run) as the pattern's guards, with a
        copy of their values: a write through ``.data`` (``target.data.copy_(source)``,
        ``w.data.normal_()``) or NumPy leaves ``_version`` as it was, and a tensor made in
        ``torch.inference_mode`` has none."""
        with torch.no_grad():
            self.guards = tuple((weakref.ref(t), t.detach().clone()) for t in tensors)

    def house(self, holders: Any) -> None:
        """Records where the guards live among ``holders``: a module's buffer or plain
        tensor attribute (``self.W = w``, not registered), a plain object's attribute. One
        rebound (``module.mask = new``) lets the old one die, and a dead guard changes
        nothing (a constant made at each call): its holder says whether it was replaced."""
        ids = {id(ref()) for ref, _ in self.guards}
        homes = []
        for h in holders:
            places = ((("_buffers", h._buffers),) if isinstance(h, torch.nn.Module) else ())
            places += (("__dict__", getattr(h, "__dict__", None) or {}),)
            for where, held in places:
                for name, t in list(held.items()):
                    if isinstance(t, Tensor) and id(t) in ids:
                        try:
                            homes.append((weakref.ref(h), where, name, weakref.ref(t)))
                        except TypeError:  # (an object that takes no weak reference)
                            break
        self.homes = tuple(homes)

    def holds(self) -> bool:
        """Whether no guard's values changed since detection (a dead one changes nothing:
        NOTE [structural zeros that move] in :mod:`~torch_vjp._sparse.tracer`), and none
        of them was rebound where it lives (:meth:`house`)."""
        for holder, where, name, tensor in self.homes:
            h = holder()
            if h is not None and getattr(h, where).get(name) is not tensor():
                return False
        for ref, copy in self.guards:
            t = ref()
            # (bit for bit, NaN where NaN was: such a weight is not detected again at
            # every call; kept.same_bits)
            if t is not None and not (t.device == copy.device and same_bits(t.detach(), copy)):
                return False
        return True

    @property
    def nnz(self) -> int:
        """The number of structural non-zeros."""
        return self.rows.numel()

    def crow(self) -> Tensor:
        """CSR row offsets (``m + 1`` entries)."""
        if self._crow is None:
            counts = torch.bincount(self.rows, minlength=self.m)
            self._crow = torch.cat([torch.zeros(1, dtype=_LONG), torch.cumsum(counts, 0)])
        return self._crow

    def csc(self) -> tuple[Tensor, Tensor]:
        """CSC column offsets (``n + 1`` entries), and the permutation that puts the entries
        in column order (column, then row)."""
        if self._csc is None:
            order = torch.argsort(self.cols * max(1, self.m) + self.rows)
            counts = torch.bincount(self.cols, minlength=self.n)
            ccol = torch.cat([torch.zeros(1, dtype=_LONG), torch.cumsum(counts, 0)])
            self._csc = (ccol, order)
        return self._csc

    def to_tensor(self, device: torch.device | str = "cpu") -> Tensor:
        """The pattern as a coalesced boolean ``torch.sparse_coo`` tensor on ``device``."""
        indices = torch.stack([self.rows, self.cols]).to(device)
        values = torch.ones(self.nnz, dtype=torch.bool, device=device)
        return torch.sparse_coo_tensor(
            indices, values, (self.m, self.n), is_coalesced=True, check_invariants=False
        )


def _entries(p: Tensor) -> tuple[Tensor, Tensor]:
    """The rows and columns of the non-zero entries of a 2-D tensor of any layout."""
    layout = p.layout
    if layout in (torch.sparse_bsr, torch.sparse_bsc):
        p = p.to_dense()
        layout = torch.strided
    if layout is torch.strided:
        r, c = torch.nonzero(p.detach().cpu() != 0, as_tuple=True)
        return r, c
    if layout is torch.sparse_coo:
        q = p.detach().cpu().coalesce()
        if q.dense_dim():  # (hybrid, x.to_sparse(1): rows sparse, each a dense row of values)
            k, c = torch.nonzero(q.values() != 0, as_tuple=True)
            return q.indices()[0][k], c
        keep = q.values() != 0
        return q.indices()[0][keep], q.indices()[1][keep]
    q = p.detach().cpu()
    if layout is torch.sparse_csr:
        ptr, idx, vals = q.crow_indices(), q.col_indices(), q.values()
        outer = torch.repeat_interleave(torch.arange(q.shape[0]), ptr[1:] - ptr[:-1])
        keep = vals != 0
        return outer[keep], idx[keep]
    ptr, idx, vals = q.ccol_indices(), q.row_indices(), q.values()  # sparse_csc
    outer = torch.repeat_interleave(torch.arange(q.shape[1]), ptr[1:] - ptr[:-1])
    keep = vals != 0
    return idx[keep], outer[keep]


def pattern_from_user(pattern: object, n: int, *, call: str) -> Pattern:
    """Checks a user's ``pattern`` against ``n`` input elements and converts it.

    Raises:
        JacobianCallTypeError: ``pattern`` is not a tensor.
        JacobianOptionError: it is not 2-D, has the wrong number of columns, or a layout
            or device that has no entries to read (nested tensors, the meta device).
    """
    what = (
        "a boolean tensor of shape (m, n), m the number of output elements and n the number "
        "of input elements (both flattened), True where the Jacobian may be non-zero"
    )
    fix = (
        "pass torch_vjp.jacobian_sparsity(f, x), or build one with "
        "torch.sparse_coo_tensor(indices, torch.ones(nnz, dtype=torch.bool), (m, n))"
    )
    if not isinstance(pattern, Tensor):
        raise JacobianCallTypeError(
            f"{call}: pattern is {a_type(pattern)}, but it must be {what}. Fix: {fix}."
        )
    if pattern.is_nested:
        raise JacobianOptionError(
            f"{call}: pattern is a nested tensor, but it must be {what} (dense, or in a "
            f"sparse layout: torch.sparse_coo, torch.sparse_csr, torch.sparse_csc). Fix: {fix}."
        )
    if pattern.dim() != 2:
        raise JacobianOptionError(
            f"{call}: pattern has shape {shape_str(pattern.shape)}, but it must be 2-D: "
            f"{what}; here n = {n}. The pattern describes the Jacobian of the flattened "
            f"function, one row per output element and one column per input element. Fix: "
            f"{fix}."
        )
    if pattern.shape[1] != n:
        raise JacobianOptionError(
            f"{call}: pattern has shape {shape_str(pattern.shape)}, so {pattern.shape[1]} "
            f"columns, but x has {n} elements: column j is element j of x flattened (of the "
            f"leaves of x concatenated, for a tuple, list or dict). Fix: {fix}, at an x of "
            f"this shape."
        )
    if pattern.is_meta:
        raise JacobianOptionError(
            f"{call}: pattern is on the meta device, so it has no values to read which "
            f"entries may be non-zero, but it must be {what}, with its values. Fix: {fix} (on "
            f"the CPU or x's device)."
        )
    rows, cols = _entries(pattern)
    return Pattern(pattern.shape[0], n, rows, cols)
