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
would cost a copy per call): such a one is not put back. The weight of an Embedding (or
EmbeddingBag) with ``max_norm`` is kept too, in either mode: its forward renormalises the
rows it looks up in place (a copy of the table per call, for the few models that set
max_norm). jacobian_blocks warns of any
tensor f reaches whose version counter a call moved, reading the same collection
(context.captured_tensors: the tensors buffers_kept found, those inside a global list
included), so that none is left moved unsaid; a change without a version bump (a kernel's)
to a tensor not put back is not seen. Measured: 9 us per call for a function over one 8x8
tensor (2.6 us before).

NOTE [captured tensors, learned once]
Copying and comparing every captured tensor on every call cost a function over a few
weight tensors (the suite's MLPs, their weights captured in a dict) 90 us of a 370 us
compiled call. So for the larger ones (LEARNED_FROM elements or more: weights, which a
function reads and does not update) whether a call moves them is learned once per
function, by its route key (context.route_key: its code, what its closure and defaults
hold, the flags and truths of the globals it names): where the first successful call moved
none of them, later calls with that key copy none. The small ones (running statistics,
counters: where a state lives) are copied on every call, so that a function that updates
one only on some calls, on a condition the key does not see (``training=cfg.train`` with
``cfg`` an object, ``training=x.shape[0] > 1``), still has it put back. A tensor of
LEARNED_FROM elements or more that such a function moves only after its first call is left
moved; jacobian_blocks' version warning still names a change that bumps the version.

NOTE [every call from the caller's state]
A module whose training forward reads the state it updates (spectral_norm's u and v, moved
by a power iteration on every call) computes another function on each call. The Jacobian
functions call f more than once within one call (a probe of the output's size, auto's
checks, a loop's one call per column, jvp's chunks, the Hessian's forward paths): were the
state put back only on exit, each call would start from the state the one before left, and
the columns of one Jacobian would come from different functions (off by 1e-4 to 3e-3 for a
spectral_norm(Linear(4, 4))). So every call of f after the first inside one
:class:`Walked` context (Problem.g and g_inner call :func:`fresh_state`) first puts back
what the calls before changed, as the exit does: the buffers' bindings, then their values
where their bits differ (:meth:`Watched.restore`, which writes only what changed). Every
call then computes the one function f computes from the caller's state, the one a single
call of f, or torch.func.jacrev of it, differentiates. Inside torch.func's transforms the
write is made with functorch's dispatch off (it refuses a write into a captured tensor;
these are the caller's own tensors, written as outside). The first call costs nothing more;
each later one a comparison of the watched tensors (the exit's), and a function that
watches none, or is called once (the vectorised strategies after their first call, the
reverse strategies), pays nothing. Where the first call moved none of the watched tensors
(the common case: a function over weights and inputs, or a module in eval mode), later calls
read only their version counters, and compare their bits again only where one moved: a
function that updates a tensor in a kernel without a version bump (F.batch_norm's
statistics) on its later calls only, not on its first, is put back on exit alone.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["CAPTURED", "KEPT_ELEMENTS", "KEPT_TOTAL", "LEARNED_FROM", "Footprint", "Walked",
           "Watched", "bound_buffers", "captured_kept", "fresh_state", "module_buffers",
           "moved_message", "put_back", "rebind_buffers", "rebind_in_call", "renormed_weights",
           "same_bits", "walked_tensors", "walked_tree"]

#: Elements of one captured tensor put back, at most (NOTE [what a call puts back]).
KEPT_ELEMENTS = 1 << 16
#: Elements of the captured tensors put back, at most, in all.
KEPT_TOTAL = 1 << 20

#: The name a captured tensor is watched under (its module buffers have "").
CAPTURED = "<captured>"
#: Route key -> whether a call moved a tensor it captures (NOTE [captured tensors, learned
#: once]); at most MOVES_KEPT keys, the oldest dropped first.
MOVES: dict[Any, bool] = {}
MOVES_KEPT = 512
#: Captured tensors of at least this many elements are kept only while a function's calls
#: are seen to move one (NOTE [captured tensors, learned once]); smaller ones on every call.
LEARNED_FROM = 1 << 12

#: The integer dtype of each element size: a float tensor's bits, read as integers.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Each real floating dtype's integer dtype of its size (:func:`same_bits`, per call).
_FLOAT_BITS = {d: _BITS[d.itemsize] for d in vars(torch).values()
               if isinstance(d, torch.dtype) and d.is_floating_point and d.itemsize in _BITS}


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` (of one shape and dtype) hold the same values bit for bit.

    NOTE [unchanged, bit for bit]
    A saved copy is compared with the tensor after a call through the bits of each real
    floating entry (read as integers of its size), not with ``==``: a NaN equals no value,
    not even itself, and ``-0.0 == 0.0``, so a comparison of values would count an unchanged
    NaN as changed and miss a sign flipped on a zero. A complex tensor is compared through
    the bits of its real and imaginary parts; a layout that cannot be viewed so, by value
    with NaNs matched to NaNs.

    Example:
        >>> t = torch.tensor([1.0, float("nan"), -0.0])
        >>> same_bits(t, t.clone()), same_bits(t, torch.tensor([1.0, float("nan"), 0.0]))
        (True, False)
    """
    dtype = a.dtype
    bits = _FLOAT_BITS.get(dtype)
    if bits is not None and b.dtype == dtype:  # (the common case: four calls fewer)
        if a.shape != b.shape:
            return False
        try:
            return torch.equal(a.view(bits), b.view(bits))
        except RuntimeError:  # (a layout that cannot be viewed so: NaN-equal values)
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
    if a.shape != b.shape or dtype != b.dtype:
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
    does). Also a context manager that puts them back on exit.

    NOTE [one copy of the watched buffers]
    The buffers of one dtype on one device, GROUPED_FROM or more of them (a model's
    BatchNorm statistics and counters, watched on every call in training mode), are copied
    into one flat tensor per dtype, and compared after the call as one: a second flat copy
    against the first, bit for bit (a floating dtype through its integer view; an integer or
    bool dtype as it is). Equal bits of the whole are equal bits of every part, so the
    answer is the per-buffer one; where they differ, each buffer of the group is compared
    and put back from its part of the copy, as one at a time, in the same order. Measured
    (timeit, the least of 60 runs, one thread): the 60 buffers of 20 BatchNorm2d(64) cost
    290 -> 200 us per call; 8 float32 tensors of 256 elements 43 -> 38 us; below about 6 a
    flat copy costs more than it saves (4: 22 -> 24 us), so fewer are read one at a time.
    Other dtypes (complex, float8), sparse, meta and wrapped tensors, tensor subclasses and
    tensors that require grad are read one at a time too."""

    __slots__ = ("entries", "_groups", "_parts")

    def __init__(
        self,
        buffers: Iterable[tuple[str, Tensor]] = (),
        params: Iterable[tuple[str, Tensor]] = (),
    ) -> None:
        buffers = list(buffers)
        # (each group: its flat copy, its key, its members' indices; each buffer's part:
        # (group, start, shape), or None where it is read one at a time)
        self._groups: list[tuple[Tensor, Any, list[int]]] = []
        self._parts: list[tuple[int, int, torch.Size] | None] = []
        members: dict[Any, list[int]] = {}
        if len(buffers) >= GROUPED_FROM:
            for k, (_, t) in enumerate(buffers):
                key = _group_key(t)
                if key is not None:
                    members.setdefault(key, []).append(k)
        parts: list[tuple[int, int, torch.Size] | None] = [None] * len(buffers)
        for key, ks in members.items():
            if len(ks) < GROUPED_FROM:
                continue
            tensors = [buffers[k][1] for k in ks]
            start = 0
            for k, t in zip(ks, tensors):
                parts[k] = (len(self._groups), start, t.shape)
                start += t.numel()
            self._groups.append((_flatten(tensors), key, ks))
        if self._groups:
            self._parts = parts
        self.entries = [(n, True, t, None if part is not None else t.detach().clone(),
                         t._version) for (n, t), part in zip(buffers, parts)]
        self.entries += [(n, False, t, t.detach().clone(), t._version) for n, t in params]

    def restore(self) -> dict[str, bool]:
        """Puts back what changed; the names of those that had, each with whether it is a
        buffer (a parameter once changed is reported on every later call). A tensor whose
        bits are unchanged is not written."""
        changed: dict[str, bool] = {}
        grad = torch.is_grad_enabled()  # (torch.no_grad(), without its decorator machinery)
        torch._C._set_grad_enabled(False)
        try:
            groups, parts = self._groups, self._parts
            same = [self._unchanged(group) for group in groups]
            for k, (n, is_buffer, t, copy, version) in enumerate(self.entries):
                if is_buffer:
                    part = parts[k] if parts else None
                    if part is not None:  # NOTE [one copy of the watched buffers]
                        g, start, shape = part
                        if same[g]:
                            continue
                        copy = groups[g][0][start:start + shape.numel()].view(shape)
                    if not same_bits(t, copy):
                        t.copy_(copy)
                        changed[n] = True
                elif t._version != version:
                    if not same_bits(t, copy):
                        t.copy_(copy)
                    changed[n] = False
        finally:
            torch._C._set_grad_enabled(grad)
        return changed

    def _unchanged(self, group: tuple[Tensor, Any, list[int]]) -> bool:
        """Whether every buffer of ``group`` holds the bits it was copied with, each still
        of its dtype and device (NOTE [one copy of the watched buffers])."""
        flat, (dtype, device), ks = group
        entries = self.entries
        now = [entries[k][2] for k in ks]
        for t in now:  # (a buffer given another tensor's data, of another dtype or device)
            if t.dtype != dtype or t.device != device or t.layout != torch.strided:
                return False
        now_flat = _flatten(now)
        if now_flat.shape != flat.shape:  # (a buffer resized in place)
            return False
        bits = _FLOAT_BITS.get(dtype)
        if bits is None:
            return torch.equal(now_flat, flat)
        return torch.equal(now_flat.view(bits), flat.view(bits))

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        self.restore()


#: Buffers of one dtype and device copied as one, from this many on (NOTE [one copy of the
#: watched buffers]).
GROUPED_FROM = 6
#: Tensor types whose buffers are copied as one (NOTE [one copy of the watched buffers]).
_PLAIN = (Tensor, torch.nn.Parameter)
_flatten = torch._C._nn.flatten_dense_tensors


#: The dtypes whose buffers are copied as one (real floating ones compared through their
#: bits, NOTE [unchanged, bit for bit]; integer and bool ones as they are).
_GROUPED = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
                      torch.int8, torch.int16, torch.int32, torch.int64, torch.bool})


def _group_key(t: Tensor) -> tuple[torch.dtype, torch.device] | None:
    """The group a buffer is copied in with the others of its dtype and device (NOTE [one
    copy of the watched buffers]), or None where it is read one at a time: a tensor
    subclass, another dtype (complex, float8, quantized), a sparse, meta or
    torch.func-wrapped tensor, or one that requires grad."""
    if (type(t) not in _PLAIN or t.dtype not in _GROUPED or t.layout != torch.strided
            or t.requires_grad or t.is_meta or _is_wrapped(t)):
        return None
    return (t.dtype, t.device)


_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def captured_kept(tensors: Sequence[Tensor], known: set[int]) -> list[tuple[str, Tensor]]:
    """The captured ``tensors`` a call keeps (NOTE [what a call puts back]), but those in
    ``known`` (kept already, as buffers)."""
    kept: list[tuple[str, Tensor]] = []
    total = 0
    strided, wrapped = torch.strided, _is_wrapped
    for t in tensors:
        if t.requires_grad or id(t) in known:
            continue
        n = t.numel()
        if (n > KEPT_ELEMENTS or total + n > KEPT_TOTAL or t.is_inference()
                or t.layout != strided or t.is_meta or wrapped(t)):
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


def renormed_weights(trees: Iterable[list[torch.nn.Module]]) -> list[tuple[str, Tensor]]:
    """The weights of the ``Embedding`` and ``EmbeddingBag`` modules of ``trees`` with a
    ``max_norm``: their forward renormalises the rows it looks up in place, in eval mode
    too (NOTE [what a call puts back])."""
    seen: set[int] = set()
    weights = []
    for tree in trees:
        for m in tree:
            if (isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                    and m.max_norm is not None and isinstance(m.weight, Tensor)
                    and id(m.weight) not in seen):
                seen.add(id(m.weight))
                weights.append(("", m.weight))
    return weights


#: The running :class:`Walked` context, per thread.
_WALKS = threading.local()


def walked_tree(module: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The tree of ``module`` the running call walked (NOTE [one walk per call]), or None."""
    walked = getattr(_WALKS, "now", None)
    tree = walked.trees.get(id(module)) if walked is not None else None
    return tree if tree is not None and tree[0] is module else None


def walked_tensors(f: object) -> list[Tensor] | None:
    """The tensors ``f`` reaches, as the running call for ``f`` found them, or None."""
    walked = getattr(_WALKS, "now", None)
    return walked.tensors if walked is not None and walked.f is f else None


#: (Walked's record of a module without buffers; read only)
_NO_BUFFERS: dict[str, Any] = {}


class Walked:
    """context.buffers_kept's context: while the call runs, the module trees walked for its
    buffers are read by context.module_key, and the tensors ``f`` reaches by
    context.captured_tensors (NOTE [one walk per call]); on exit, what the call changed is
    put back: the buffers' values, and which tensor each buffer of a module with buffers
    is (a forward that rebinds one, ``self.scale = self.scale * 1.1``, left the module
    holding what its last call under a torch.func transform made)."""

    __slots__ = ("f", "trees", "tensors", "watched", "prev", "key", "bound", "calls",
                 "captured_moved", "versions")

    def __init__(self, f: object, trees: dict[int, list[torch.nn.Module]],
                 tensors: list[Tensor] | None, watched: Watched | None,
                 key: Any = None) -> None:
        self.f, self.trees, self.tensors, self.watched = f, trees, tensors, watched
        self.prev: Walked | None = None
        self.key = key  # (a route key whose captured tensors are being learned, or None)
        # (every module of the trees: one without buffers may register one lazily in f,
        # from a tensor of the call, a torch.func wrapper under a transform)
        self.bound = bound_buffers(m for tree in trees.values() for m in tree)
        self.calls = 0  # (calls of f begun inside this context, :meth:`fresh`)
        self.captured_moved = False  # (whether a call before the last moved a captured one)
        self.versions: list[int] | None = None  # (the watched tensors' versions, once the
        # first call was seen to move none of them)

    def fresh(self) -> None:
        """Before a call of ``f`` inside this context: every call after the first starts
        from the caller's state, as the first does (NOTE [every call from the caller's
        state]): what an earlier call changed is put back, as on exit."""
        if self.calls:
            rebind_buffers(self.bound)
            watched, versions = self.watched, self.versions
            if watched is not None and (versions is None or any(
                    e[2]._version != v for e, v in zip(watched.entries, versions))):
                # (inside torch.func's transforms the caller's tensors are written as
                # outside them: functorch refuses a write into a captured tensor)
                with _DisableFuncTorch() if _level() is not None else _NOTHING:
                    changed = watched.restore()
                if CAPTURED in changed:
                    self.captured_moved = True
                if not changed and self.calls == 1:  # (the first call moved nothing:
                    # later calls are compared by their versions, NOTE [every call from
                    # the caller's state])
                    self.versions = [e[2]._version for e in watched.entries]
        self.calls += 1

    def __enter__(self) -> None:
        self.prev = getattr(_WALKS, "now", None)
        _WALKS.now = self

    def __exit__(self, *exc: Any) -> None:
        _WALKS.now = self.prev
        rebind_buffers(self.bound)
        changed = self.watched.restore() if self.watched is not None else {}
        moved = self.captured_moved or CAPTURED in changed
        if self.key is not None and (exc[0] is None or moved):
            if len(MOVES) >= MOVES_KEPT and self.key not in MOVES:
                MOVES.pop(next(iter(MOVES)))
            MOVES[self.key] = MOVES.get(self.key, False) or moved


_DisableFuncTorch = torch._C._DisableFuncTorch
_level = torch._C._functorch.maybe_current_level
_NOTHING = contextlib.nullcontext()
_compiling = torch.compiler.is_compiling


def fresh_state(f: object) -> None:
    """Before a call of ``f``: where a running :class:`Walked` context keeps what ``f``
    changes, what an earlier call of ``f`` in it changed is put back first (NOTE [every
    call from the caller's state])."""
    if _compiling():  # (a program being traced: it runs inside the eager call's context,
        return  # which puts back what the program wrote)
    walked = getattr(_WALKS, "now", None)
    while walked is not None:
        if walked.f is f:
            walked.fresh()
            return
        walked = walked.prev


def rebind_in_call(m: torch.nn.Module, name: str, tensor: Tensor) -> Any:
    """Binds ``tensor`` as ``m``'s buffer ``name`` on purpose for the rest of a running call
    (rank 0's buffers in a sharded Jacobian of a DDP model): the running :class:`Walked`
    contexts take it for the caller's, so that every call of f starts from it (NOTE [every
    call from the caller's state]) rather than from the buffer it replaced. Returns the
    function that puts back the buffer and their records."""
    old = m._buffers[name]
    m._buffers[name] = tensor
    records = []
    walked = getattr(_WALKS, "now", None)
    while walked is not None:
        for mod, saved in walked.bound:
            if mod is m and saved is not _NO_BUFFERS and saved.get(name) is old:
                saved[name] = tensor
                records.append(saved)
        walked = walked.prev

    def back() -> None:
        for saved in records:
            saved[name] = old
        m._buffers[name] = old

    return back


def bound_buffers(modules: Iterable[torch.nn.Module]
                  ) -> list[tuple[torch.nn.Module, dict[str, Any]]]:
    """Which tensor each buffer of each of ``modules`` is, for :func:`rebind_buffers` (a
    module without buffers shares one empty dict: no copy)."""
    return [(m, dict(b) if b else _NO_BUFFERS) for m in modules for b in (m._buffers,)]


def rebind_buffers(bound: list[tuple[torch.nn.Module, dict[str, Any]]]) -> None:
    """Puts back the buffers :func:`bound_buffers` saw, by name: a buffer a forward rebound
    (``self.scale = self.scale * 1.1``), made a Parameter or registered anew leaves each
    module holding its own buffers again, and only them."""
    for m, saved in bound:
        now = m._buffers
        if len(now) != len(saved) or any(now.get(k) is not v for k, v in saved.items()):
            now.clear()
            now.update(saved)
            for k in saved:  # (one f made a Parameter or a plain attribute: its name
                m._parameters.pop(k, None)  # is the buffer's again, as nn.Module's
                m.__dict__.pop(k, None)  # names are each in one place)


class Footprint:
    """The version of each tensor of ``tensors`` and of each buffer and parameter of
    ``modules``, and which tensor each buffer is: :meth:`moved` says whether anything
    since wrote one of them or rebound a buffer. A compiled program's writes into its
    inputs move their versions, F.batch_norm's statistics included (NOTE [a program that
    writes nothing] in compiled.py). Inference tensors, which have no version and are not
    put back, are left out."""

    __slots__ = ("versions", "bound")

    def __init__(self, tensors: Iterable[Tensor], modules: Sequence[torch.nn.Module]) -> None:
        seen: set[int] = set()
        self.versions = []
        for t in itertools.chain(tensors, (b for m in modules for b in m._buffers.values()),
                                 (p for m in modules for p in m._parameters.values())):
            if t is not None and id(t) not in seen and not t.is_inference():
                seen.add(id(t))
                self.versions.append((t, t._version))
        self.bound = bound_buffers(modules)

    def moved(self) -> bool:
        return any(t._version != v for t, v in self.versions) or any(
            len(m._buffers) != len(saved) or any(m._buffers.get(k) is not v
                                                 for k, v in saved.items())
            for m, saved in self.bound)


def put_back(t: Tensor) -> bool:
    """Whether the running call (its :class:`Walked` context) puts ``t`` back."""
    walked = getattr(_WALKS, "now", None)
    watched = walked.watched if walked is not None else None
    return watched is not None and any(e[2] is t for e in watched.entries)


def moved_message(call: str, name: str, several: bool) -> str:
    """jacobian_blocks' warning that ``f`` moved a tensor it captures: over ``several``
    calls of f (each started from the caller's state, NOTE [every call from the caller's
    state], but for a tensor not put back), or in one call, of a tensor not put back (NOTE
    [what a call puts back])."""
    not_kept = (f"one of over {KEPT_ELEMENTS} elements, one past {KEPT_TOTAL} elements of "
                f"such tensors in all, or one requiring grad")
    if several:
        what = (f"The Jacobian calls f more than once (a probe of its output shapes, then "
                f"the products; the loop strategies once per product), and every call starts "
                f"from the tensor as the caller holds it: it is put back before each call and "
                f"after the last, so the result is the Jacobian of the one call f makes from "
                f"the caller's state. A tensor "
                f"{not_kept}, is not put back: each call saw it as the one before left it, "
                f"and it has moved once per call.")
    else:
        what = (f"It is not put back after the call ({not_kept} is not): it has moved as a "
                f"call of f moves it.")
    return (f"{call}: f ({name}) changes a tensor it captures in place. {what}\n"
            f"  Fix: keep f free of side effects (update the tensor outside the Jacobian "
            f"call, or clone it inside f); strategy='rev-loop' calls f once.")
