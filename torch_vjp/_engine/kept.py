"""What a call puts back: copies of the buffers and captured tensors it may change in place
(NOTE [what a call puts back]), compared bit for bit after it; and the module trees a call
walked, read again by its route key (NOTE [one walk per call]).

NOTE [what a call puts back]
SPEC: no user tensor or buffer is changed by a call. A module's buffers are saved where a
module f reaches is in training mode (BatchNorm's running statistics move on every call of
f), and put back where their values changed. A tensor f captures (a closure cell, a
default, a global it names, a partial's argument, as context.reached finds them) may be
updated by f just as well: F.batch_norm(t, running_mean, running_var, training=True)
updates its statistics in a kernel, without a version bump, so no version counter tells.
So the captured tensors that do not require grad (a parameter is a weight, not a state)
are copied before the call and compared after it, bit for bit (NOTE [unchanged, bit for
bit]), and put back where they changed; at most KEPT_ELEMENTS elements each and
KEPT_TOTAL in all (running statistics and counters are small; a weight matrix or a dataset
would cost a copy per call): a larger one is not put back, and jacobian_blocks' warning (by
version counter) is all there is. Measured: 9 us per call for a function over one 8x8
tensor (2.6 us before).

NOTE [one walk per call]
A route key (context.module_key) and the buffers a call keeps both need every module f
reaches (context.module_tree): a walk of 0.3 us to 1.7 us per module, so a function over a
model of 501 modules paid for two walks of it per call. buffers_kept walks each module f
reaches once, and its context (Walked) holds the trees while the call runs, for
module_key to read (walked_tree): the tree as the call found it on entry.

NOTE [unchanged, bit for bit]
A tensor is put back only where its values changed, and "changed" is read bit for bit: a
NaN equals itself (``torch.equal`` says a tensor holding a NaN differs from its own copy, so
a captured mask or padding value with a NaN was written back on every call, bumping its
version, and a graph of the user's that saved it could no longer run backward), and -0.0
differs from 0.0 (the copy puts the sign back). A tensor whose bits are unchanged is never
written: its version stays.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["KEPT_ELEMENTS", "KEPT_TOTAL", "Walked", "Watched", "captured_kept", "module_buffers",
           "same_bits", "walked_tree"]

#: Elements of one captured tensor put back, at most (NOTE [what a call puts back]).
KEPT_ELEMENTS = 1 << 16
#: Elements of the captured tensors put back, at most, in all.
KEPT_TOTAL = 1 << 20

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


def captured_kept(tensors: Sequence[Tensor], known: set[int]) -> list[tuple[str, Tensor]]:
    """The captured ``tensors`` a call keeps (NOTE [what a call puts back]), but those in
    ``known`` (kept already, as buffers)."""
    kept: list[tuple[str, Tensor]] = []
    total = 0
    for t in tensors:
        n = t.numel()
        if (id(t) in known or t.requires_grad or n > KEPT_ELEMENTS or total + n > KEPT_TOTAL
                or t.is_inference() or t.layout != torch.strided or t.device.type == "meta"
                or torch._C._functorch.is_functorch_wrapped_tensor(t)):
            continue
        total += n
        kept.append(("", t))
    return kept


def module_buffers(trees: Iterable[list[torch.nn.Module]]) -> list[tuple[str, Tensor]]:
    """The buffers of the modules of ``trees`` (context.module_tree's), each once, where one
    of them is in training mode (else none: a module in eval mode moves no buffer)."""
    tree = [m for t in trees for m in t]
    if not any(m.training for m in tree):
        return []
    seen: set[int] = set()
    buffers = []
    for m in tree:
        for b in m._buffers.values():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                buffers.append(("", b))
    return buffers


#: The module trees of the running :class:`Walked` contexts, by root id, per thread.
_WALKS = threading.local()


def walked_tree(module: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The tree of ``module`` the running call walked (NOTE [one walk per call]), or None."""
    trees = getattr(_WALKS, "trees", None)
    tree = trees.get(id(module)) if trees else None
    return tree if tree is not None and tree[0] is module else None


class Walked:
    """context.buffers_kept's context where ``f`` reaches modules: while the call runs, the
    trees walked for its buffers are read by context.module_key (NOTE [one walk per call]);
    on exit, what the call changed is put back."""

    __slots__ = ("trees", "watched", "prev")

    def __init__(self, trees: dict[int, list[torch.nn.Module]], watched: Watched | None):
        self.trees, self.watched, self.prev = trees, watched, None

    def __enter__(self) -> None:
        self.prev = getattr(_WALKS, "trees", None)
        _WALKS.trees = self.trees

    def __exit__(self, *exc: Any) -> None:
        _WALKS.trees = self.prev
        if self.watched is not None:
            self.watched.restore()
