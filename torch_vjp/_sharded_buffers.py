"""A sharded Jacobian of a model wrapped in ``DistributedDataParallel``: rank 0's buffers, as
DDP's own forward would use them.

NOTE [DDP's buffers in a sharded Jacobian]
DDP broadcasts its parameters once, when it wraps the model, but its buffers (BatchNorm's
running statistics) before each forward, from rank 0 of its group (``broadcast_buffers=True``,
the default): between two forwards each rank holds the statistics its own batches left, and
what the model computes on every rank is rank 0's. A sharded Jacobian compares the tensors
``f`` reads on every rank (NOTE [sharded Jacobian]), and refused such a model, after any
training step, as "the function differs between ranks". So where tensors differ and some are
buffers DDP broadcasts, of a wrapper passed as ``f`` (``tv.jacobian(ddp, x, ...)``: its
module is computed, :func:`plain_module`), reached by ``f`` (a closure holding it), or
wrapping a module ``f`` reaches (``tv.jacobian(ddp.module, x, ...)``: found among the live
wrappers once, then remembered), every rank of the group takes rank 0's, as DDP's forward
would: each buffer is replaced in its module by a tensor of rank 0's values (one broadcast per
dtype) for the check and the products, and the rank's own tensor is put back afterwards
(swapped, not written: the user's tensors keep their values and versions, and a graph that
saved them still runs backward). The ranks first agree on what they broadcast (one
``all_gather_object``, on this path only): where they differ, nothing is broadcast, and the
check's error stands. The source is the rank DDP broadcasts from (rank 0 of DDP's group),
where it belongs to the Jacobian's group. With ``broadcast_buffers=False`` (or a buffer DDP
ignores) DDP keeps each rank's own buffers, and the error says so.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from torch_vjp._engine.context import modules_reached, reached
from torch_vjp._engine.kept import rebind_in_call
from torch_vjp._engine.problem import Problem
from torch_vjp._errors import JacobianCallError

__all__ = ["plain_module", "rank0_buffers", "unsynced_buffer"]

# The wrapper of each module that was passed wrapped (plain_module) or found wrapped (the
# values are weak: the wrapper holds its module, which would keep the entry alive).
_WRAPPER: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _ddp_type() -> Any:
    return torch.nn.parallel.DistributedDataParallel


def plain_module(f: Any) -> Any:
    """``f.module`` where ``f`` is a module wrapped in ``DistributedDataParallel`` (without
    forward hooks of the wrapper's own), else ``f``. The wrapper's forward is its module's,
    with DDP's book-keeping around it: a broadcast of the buffers from rank 0 at every call,
    which the Jacobian's calls of ``f`` would repeat a different number of times on each rank
    (a loop over a rank's own share of the columns) and wait for ever, or run on one rank
    alone; and an in-place copy into the buffers, which torch.func refuses in forward mode.
    The Jacobian needs none of it (no gradient reaches ``.grad``); a sharded Jacobian takes
    rank 0's buffers once instead (NOTE [DDP's buffers in a sharded Jacobian])."""
    if not isinstance(f, torch.nn.Module) or "torch.nn.parallel" not in type(f).__module__:
        return f
    ddp = _ddp_type()
    while isinstance(f, ddp) and not (f._forward_hooks or f._forward_pre_hooks):
        _WRAPPER[f.module] = weakref.ref(f)
        f = f.module
    return f


def _known(module: Any) -> Any:
    ref = _WRAPPER.get(module)
    return ref() if ref is not None else None


def _wrappers(prob: Problem, differ: set[int]) -> list[Any]:
    """The DDP wrappers of what ``f`` reaches: wrappers among its modules (or inside them),
    and the wrapper of each module it reaches, remembered or found among the live objects
    (once: a scan of the garbage collector's objects, where a buffer of the module is among
    the tensors that differ, ``differ``: ids)."""
    ddp = _ddp_type()
    modules, _ = reached(prob.f)
    known = {id(m) for m in modules}
    modules += [m for m in modules_reached(prob.primals) if id(m) not in known]
    found: dict[int, Any] = {}
    missing = []
    for root in modules:
        for m in root.modules():
            if isinstance(m, ddp):
                found[id(m)] = m
        w = _known(root)
        if w is not None:
            found[id(w)] = w
        elif not isinstance(root, ddp) and any(id(b) in differ for b in root.buffers()):
            missing.append(root)
    if missing:
        ids = {id(m): m for m in missing}
        for obj in gc.get_objects():
            if issubclass(type(obj), ddp):
                inner = obj.__dict__.get("_modules", {}).get("module")
                if id(inner) in ids:
                    _WRAPPER[inner] = weakref.ref(obj)
                    found[id(obj)] = obj
    return list(found.values())


def _synced(w: Any) -> list[tuple[str, Tensor]]:
    """The buffers wrapper ``w`` broadcasts before its forward (DDP's own list: those it
    does not ignore), by name; none where it broadcasts none."""
    if not getattr(w, "broadcast_buffers", False):
        return []
    ignored = getattr(w, "parameters_to_ignore", set())
    return [(n, b) for n, b in w.module.named_buffers() if n not in ignored]


def _source(w: Any, group: Any) -> int | None:
    """The rank of ``group`` that DDP broadcasts ``w``'s buffers from (rank 0 of its own
    group), or None where that rank is not in ``group``."""
    import torch.distributed as dist

    try:
        src = dist.get_global_rank(w.process_group, 0)
        dist.get_group_rank(group, src)
    except (RuntimeError, ValueError):
        return None
    return src


def rank0_buffers(prob: Problem, group: Any, device: torch.device, differ: dict[int, str],
                  objects: Sequence[Tensor], kept: contextlib.ExitStack
                  ) -> tuple[dict[int, str], dict[int, Any]]:
    """Takes rank 0's buffers on every rank where tensors of ``objects`` (what ``f`` uses)
    differ between ranks (``differ``, the same on every rank) and some are buffers DDP
    broadcasts (NOTE [DDP's buffers in a sharded Jacobian]); ``kept`` puts each rank's own
    back. Returns the tensors that still differ, and of those the DDP wrapper of each that
    DDP does not broadcast. Every rank of ``group`` must call it."""
    import torch.distributed as dist

    wrappers = _wrappers(prob, {id(objects[i]) for i in differ})
    owner: dict[int, Any] = {}
    for w in wrappers:
        for _, b in w.module.named_buffers():
            owner.setdefault(id(b), w)
    involved, unsynced = [], {}
    for i in differ:
        w = owner.get(id(objects[i]))
        if w is None:
            continue
        if any(b is objects[i] for _, b in _synced(w)) and _source(w, group) is not None:
            if all(v is not w for v in involved):
                involved.append(w)
        else:
            unsynced[i] = w
    bufs = [(b, _source(w, group)) for w in involved for _, b in _synced(w)]
    plan = [(src, tuple(b.shape), str(b.dtype), b.device.type) for b, src in bufs]
    said: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, plan, group=group)
    if not plan or any(p != plan for p in said):
        return differ, unsynced
    fixed = {id(b) for b, _ in bufs}
    taken = _broadcast(bufs, group, device)
    _swap(involved, taken, kept)
    return {i: how for i, how in differ.items() if id(objects[i]) not in fixed}, unsynced


def _broadcast(bufs: list[tuple[Tensor, int | None]], group: Any, device: torch.device
               ) -> dict[int, Tensor]:
    """Rank 0's values of each buffer (new tensors; the buffers themselves are not written),
    by the buffer's id: one broadcast per source and dtype."""
    import torch.distributed as dist

    taken: dict[int, Tensor] = {}
    batches: dict[Any, list[Tensor]] = {}
    for b, src in bufs:
        batches.setdefault((src, b.dtype), []).append(b)
    with torch.no_grad():
        for (src, _), group_bufs in batches.items():
            flat = torch.cat([b.detach().reshape(-1).to(device) for b in group_bufs])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for b in group_bufs:
                n = b.numel()
                taken[id(b)] = flat[offset:offset + n].reshape(b.shape).to(b.device).clone()
                offset += n
    return taken


def _swap(wrappers: list[Any], taken: dict[int, Tensor], kept: contextlib.ExitStack) -> None:
    """Puts rank 0's tensors in the modules' buffers; ``kept`` puts the rank's own back."""
    put: list[Any] = []
    done: set[tuple[int, str]] = set()
    for w in wrappers:
        for m in w.module.modules():
            for name, b in list(m._buffers.items()):
                if b is not None and id(b) in taken and (id(m), name) not in done:
                    done.add((id(m), name))
                    # (the calls of f inside this call start from rank 0's buffers)
                    put.append(rebind_in_call(m, name, taken[id(b)]))

    def back() -> None:
        for undo in reversed(put):
            undo()

    kept.callback(back)


def unsynced_buffer(prob: Problem, how: str, w: Any, group: Any) -> None:
    """Raises: a buffer ``f`` reads differs between ranks, and the DDP wrapper ``w`` of its
    module does not broadcast it, or not from a rank of ``group`` (NOTE [DDP's buffers in a
    sharded Jacobian])."""
    import torch.distributed as dist

    if not getattr(w, "broadcast_buffers", False):
        why = ("it was built with broadcast_buffers=False, so DDP does not broadcast the "
               "buffers from rank 0 before its forward: each rank keeps its own (the "
               "statistics its own batches left)")
    elif _source(w, group) is None:
        why = (f"DDP broadcasts its buffers from rank 0 of its own process group (global "
               f"rank {dist.get_global_rank(w.process_group, 0)}), which is not a member of "
               f"process_group, so this call cannot take the buffers DDP's forward would use")
    else:
        why = ("DDP ignores this buffer (it is in the module's "
               "_ddp_params_and_buffers_to_ignore), so each rank keeps its own")
    raise JacobianCallError(
        f"{prob.call}: the function differs between ranks: {how}. The model is wrapped in "
        f"DistributedDataParallel, but {why}. With a process_group every rank computes a "
        f"share of the Jacobian of one function; the gathered Jacobian would mix them.\n"
        f"  Fix: broadcast the buffers from rank 0 before the call (for b in "
        f"model.buffers(): torch.distributed.broadcast(b, 0)), or wrap the model with "
        f"broadcast_buffers=True (then the Jacobian uses rank 0's buffers, as DDP's forward "
        f"does), or pass process_group=None to compute each rank's own Jacobian."
    )
