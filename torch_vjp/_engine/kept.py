"""What a call puts back: copies of the tensors it may change in place, compared bit for bit
after it (NOTE [what a call puts back] in :mod:`torch_vjp._engine.context`).

NOTE [unchanged, bit for bit]
A tensor is put back only where its values changed, and "changed" is read bit for bit: a
NaN equals itself (``torch.equal`` says a tensor holding a NaN differs from its own copy, so
a captured mask or padding value with a NaN was written back on every call, bumping its
version, and a graph of the user's that saved it could no longer run backward), and -0.0
differs from 0.0 (the copy puts the sign back). A tensor whose bits are unchanged is never
written: its version stays.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["Watched", "same_bits"]

#: The integer dtype of each element size: a float tensor's bits, read as integers.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` (of one shape and dtype) hold the same values bit for bit
    (NOTE [unchanged, bit for bit]).

    Example:
        >>> t = torch.tensor([1.0, float("nan"), -0.0])
        >>> same_bits(t, t.clone()), same_bits(t, torch.tensor([1.0, float("nan"), 0.0]))
        (True, False)
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    try:
        if a.is_complex():
            a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
        bits = _BITS[a.element_size()]
        return torch.equal(a.view(bits), b.view(bits))
    except (KeyError, RuntimeError):  # (a layout that cannot be viewed so: NaN-equal values)
        return bool(((a == b) | (a.isnan() & b.isnan())).all())


class Watched:
    """Copies of named buffers and parameters, to put back what a forward changed in place.

    A buffer counts as changed where its values differ, bit for bit (kernels update running
    statistics without a version bump; NOTE [unchanged, bit for bit]); a parameter where its
    version moved, values equal or not (Embedding's max_norm renormalises only the rows a
    batch looks up that are too long, so one batch may change nothing that the next one
    does). Also a context manager that puts them back on exit."""

    __slots__ = ("entries",)

    def __init__(
        self,
        buffers: Iterable[tuple[str, Tensor]] = (),
        params: Iterable[tuple[str, Tensor]] = (),
    ) -> None:
        self.entries = [(n, True, t, t.detach().clone(), t._version) for n, t in buffers]
        self.entries += [(n, False, t, t.detach().clone(), t._version) for n, t in params]

    def restore(self) -> dict[str, bool]:
        """Puts back what changed; the names of those that had, each with whether it is a
        buffer (a parameter once changed is reported on every later call). A tensor whose
        bits are unchanged is not written."""
        changed: dict[str, bool] = {}
        with torch.no_grad():
            for n, is_buffer, t, copy, version in self.entries:
                if is_buffer:
                    if not same_bits(t, copy):
                        t.copy_(copy)
                        changed[n] = True
                elif t._version != version:
                    if not same_bits(t, copy):
                        t.copy_(copy)
                    changed[n] = False
        return changed

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        self.restore()
