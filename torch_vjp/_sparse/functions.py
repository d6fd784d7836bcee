"""Custom ``torch.autograd.Function``\\ s under sparsity detection.

NOTE [custom Functions]
The tracer sees the aten ops a custom Function's ``forward`` runs, but automatic
differentiation does not differentiate them: it calls the Function's own ``backward`` (and
``jvp``), whose structure the forward need not have. A forward that computes with NumPy or
SciPy (``torch.from_numpy(scipy...(x.numpy()))``) runs no op on x at all, so its outputs
would carry no set and the pattern would miss every entry of the Function (the sparse
Jacobian silently zero there); a straight-through estimator (``x.round()`` forward, any
backward) shows the forward's structure, not the backward's. So while a detection runs,
the forward runs (and is traced, so that the shadows stay consistent), and then every
floating output of the Function is taken to depend on every input element the Function
received (as an op without a rule is, :func:`~torch_vjp._sparse.rules.conservative`; the
Function is named in the one-time warning, which suggests ``pattern=``). What the forward
read of x's values for Python (``x.numpy()``) shapes none of that, so it does not mark the
pattern as shaped by values; the Function's outputs are values computed from x (an integer
output indexes by them). A profile function of the detecting thread sees each call of
``Function.apply`` return (``sys.setprofile``: a Function bound long before,
``my_op = Fn.apply``, runs the same code), so other threads are not touched. torch's
reentrant checkpoint (``CheckpointFunction``) is left to the trace: its backward runs the
block again under autograd, so the forward's ops are its derivative's structure.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from torch_vjp._errors import JacobianWarning, warn_once
from torch_vjp._sparse.tracer import Tracer, carries_sets

__all__ = ["functions_ruled"]

_LONG = torch.long
#: The code of ``torch.autograd.Function.apply``: every call of a custom Function runs it,
#: ``Fn.apply`` looked up at the call or bound long before (``my_op = Fn.apply``).
_APPLY = torch.autograd.Function.__dict__["apply"].__func__.__code__


def _differentiates_its_forward() -> frozenset[type]:
    """torch's own Functions whose backward is autograd's derivative of their forward's ops:
    the forward's trace is their structure. ``torch.utils.checkpoint`` with
    ``use_reentrant=True`` runs the block in a ``CheckpointFunction`` whose backward runs
    the block again under autograd (ruled as a custom Function, a checkpointed block was
    dense)."""
    import torch.utils.checkpoint as checkpoint

    got = getattr(checkpoint, "CheckpointFunction", None)
    return frozenset([got] if isinstance(got, type) else [])


_TRACED = _differentiates_its_forward()


def _base(t: Tensor) -> Tensor:
    """``t`` without torch.func's wrappers (f may call a Function inside torch.func.grad):
    the tensor the tracer sees in dispatch."""
    ft = torch._C._functorch
    while ft.is_functorch_wrapped_tensor(t) or ft.is_batchedtensor(t):
        t = ft.get_unwrapped(t)
    return t


def _rule(tracer: Tracer, cls: type, inputs: Any, out: Any) -> None:
    """Every floating output of the Function depends on every element of its inputs."""
    ins = [_base(t) for t in tree_leaves(inputs) if isinstance(t, Tensor)]
    outs = [_base(t) for t in tree_leaves(out) if isinstance(t, Tensor)]
    parts = [ids.reshape(-1) for t in ins if (ids := tracer.ids(t)) is not None]
    sid = tracer.table.union_all(torch.cat(parts)) if parts else 0
    if sid:
        tracer.conservative_ops.add(f"{cls.__qualname__} (a custom autograd.Function)")
    for o in outs:
        if carries_sets(o):
            tracer.write(o, torch.full(o.shape, sid, dtype=_LONG) if sid else None)
    if sid or any(tracer.from_values(t) for t in ins):
        tracer.mark_from_values(outs)


def _everything(tracer: Tracer, cls: type, out: Any) -> None:
    """Every floating output of the Function depends on every input element of ``f``."""
    n = tracer.table.n
    sid = tracer.table.union_all(torch.arange(1, n + 1, dtype=_LONG)) if n else 0
    tracer.conservative_ops.add(f"{cls.__qualname__} (a custom autograd.Function)")
    for o in tree_leaves(out):
        if isinstance(o, Tensor) and carries_sets(o := _base(o)):
            tracer.write(o, torch.full(o.shape, sid, dtype=_LONG) if sid else None)


@contextlib.contextmanager
def functions_ruled(tracer: Tracer) -> Iterator[None]:
    """While a detection runs: custom Functions ruled as NOTE [custom Functions] says, by a
    profile function of this thread that sees each return of ``Function.apply`` (its
    frame's ``cls``, ``args`` and ``kwargs``, and the value it returns). The thread's own
    profile function, if any, still sees every event meanwhile (one set from Python), and
    is put back afterwards (cProfile's too: :func:`_restore`)."""

    entered: list[str | None] = []  # tracer.by_value as each running apply found it
    before = sys.getprofile()
    # (a profile function set from Python, profile.Profile's, keeps seeing every event;
    # a C one, cProfile's before Python 3.12, is an object that cannot be called)
    chained = before if callable(before) else None

    def profile(frame: Any, event: str, arg: Any) -> None:
        if chained is not None:
            chained(frame, event, arg)
        if frame.f_code is not _APPLY:
            return
        if event == "call":
            entered.append(tracer.by_value)
        elif event == "return" and entered:
            # (what the forward read of x's values for Python shapes nothing here)
            tracer.by_value = entered.pop()
            loc = frame.f_locals
            cls, inputs = loc.get("cls"), (loc.get("args"), loc.get("kwargs"))
            if arg is None or not isinstance(cls, type):  # (an error: it passes through)
                return
            if cls in _TRACED:  # (its ops were traced, and are what its backward runs)
                return
            # (the tracer's own work, outside f's modes and torch.func transforms: a
            # Function called inside torch.func.grad in f)
            with _disable_current_modes(), torch._C.DisableTorchFunction(), \
                    torch._C._DisableFuncTorch():
                try:
                    _rule(tracer, cls, inputs, arg)
                except Exception:  # noqa: BLE001 - (an error here would end the profile
                    _everything(tracer, cls, arg)  # function and reach f): the widest sets

    sys.setprofile(profile)
    try:
        yield
    finally:
        _restore(before)


def _restore(before: Any) -> None:
    """Puts the thread's profile function back. ``sys.setprofile(before)`` would make a C
    profiler's object (cProfile's ``Profile``, which ``sys.getprofile()`` returns before
    Python 3.12) a Python profile function: the next event calls it, a ``TypeError`` (not
    callable) that ends the profiler and reaches the caller. Such a profiler is put back by
    its own ``enable()``."""
    if before is None or callable(before):
        sys.setprofile(before)
        return
    sys.setprofile(None)
    enable = getattr(before, "enable", None)
    if callable(enable):
        enable()
    else:
        warn_once(
            ("profile-function", type(before)),
            f"sparsity detection replaced this thread's profile function (a "
            f"{type(before).__qualname__}, set by a C extension, as "
            f"torch.profiler.profile(with_stack=True) does) to see custom "
            f"autograd.Functions, and cannot put it back from Python: this thread's Python "
            f"calls are no longer profiled.\n  Fix: detect outside the profiler (a call of "
            f"sparse_jacobian before it starts caches the pattern), or pass pattern=. This "
            f"warning is shown once.",
            JacobianWarning,
        )
