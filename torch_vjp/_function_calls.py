"""How :func:`torch_vjp.check_function` calls the user's forward: every call with the same
random draws, and nothing of the caller's changed afterwards.

NOTE [check_function's draws]
check_function calls forward many times at nearby points (one forward and backward for the
structure, one for the probes, two per probe and input for the central differences) and
compares them. A forward that draws from torch's global generator (a dropout-like mask, a
random projection) draws differently on every call, so the finite differences would mix
masks and blame a correct backward by orders of magnitude. Each call therefore starts from
the generator state the caller had (:class:`SameDraws`): every forward sees the same draws,
the ones a plain call would have seen, and the finite differences are those of one fixed
function. The caller's state is put back at the end, so the global RNG is untouched whether
or not forward draws. CUDA generators are treated alike for the CUDA devices the inputs
live on, and so are the ``torch.Generator`` objects forward reaches (:func:`generators`: in
its closure, defaults or globals, a ``partial``'s arguments, an attribute of a module or
object it uses, among the inputs): a dropout drawing from ``generator=g`` of its closure drew
other masks on every call, and the check refused the point as a kink (slopes of +-7e5) and
moved ``g``.

Module buffers that a forward in training mode updates (BatchNorm's running statistics)
are put back by :func:`torch_vjp._engine.context.buffers_kept`, as the Jacobian functions do;
and before every call too, in eval mode as well (:class:`SameDraws`' ``buffers``): a buffer
that a call updates and the next reads (spectral norm's power-iteration vectors, which
normalise the weight) made every call a different function, and a correct backward was
blamed (<J t, c> = -51 against 1.5). A buffer that forward replaces (``self.scale =
self.scale * 1.1``) gets its own tensor back, so the module is left as it was (it was left
with the last call's); one it makes a Parameter (``self.scale = nn.Parameter(...)``) is the
buffer again, not both, and a buffer forward registers is dropped again.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from torch_vjp._engine.context import (
    buffers_kept,
    captured_values,
    module_tree,
    modules_reached,
    reached,
)
from torch_vjp._engine.kept import bound_buffers, rebind_buffers

__all__ = ["SameDraws", "generators", "kept", "buffers_used"]


class SameDraws:
    """Gives every call of forward the random draws of the first (NOTE [check_function's
    draws]); use as a context manager around the whole check, and call :meth:`reset`
    before each call of forward."""

    def __init__(self, inputs: tuple[Any, ...], own: list[torch.Generator] = (),
                 buffers: tuple[list[torch.nn.Module], list[tuple[torch.nn.Module, str, Tensor]]]
                 = ((), ())) -> None:
        self._own = list(own)  # (the generators forward reaches: generators(fn, inputs))
        modules, kept_buffers = buffers  # (of the modules it uses: buffers_used(fn, inputs))
        self._buffers = list(kept_buffers)
        # (which tensor each buffer of each module is: one forward rebinds, makes a
        # Parameter or registers is put back by name, kept.rebind_buffers)
        self._bound = bound_buffers(modules)
        self._buffer_values: list[Tensor] = []
        self._own_states: list[Tensor] = []
        self._cuda = sorted({
            t.device.index if t.device.index is not None else torch.cuda.current_device()
            for t in pytree.tree_leaves(inputs)
            if isinstance(t, Tensor) and t.device.type == "cuda"
        })
        self._cpu: Tensor | None = None
        self._gpu: list[Tensor] = []

    def __enter__(self) -> SameDraws:
        self._cpu = torch.get_rng_state()
        self._gpu = [torch.cuda.get_rng_state(d) for d in self._cuda]
        self._own_states = [g.get_state() for g in self._own]
        self._buffer_values = [b.detach().clone() for _, _, b in self._buffers]
        return self

    def reset(self) -> None:
        assert self._cpu is not None
        torch.set_rng_state(self._cpu)
        for d, state in zip(self._cuda, self._gpu):
            torch.cuda.set_rng_state(state, d)
        for g, state in zip(self._own, self._own_states):
            g.set_state(state)
        rebind_buffers(self._bound)
        with torch.no_grad():
            for (_, _, b), value in zip(self._buffers, self._buffer_values):
                if not torch.equal(b, value):
                    # (through .data, as BatchNorm's kernel writes its running statistics:
                    # no version bump, which would fail the backward of a graph that saved
                    # the buffer, taken after this call)
                    b.data.copy_(value)

    def __exit__(self, *exc: Any) -> None:
        self.reset()


@contextlib.contextmanager
def kept(fn: Any, is_function: bool, inputs: tuple[Any, ...]) -> Iterator[SameDraws]:
    """The whole check's calls: the same draws on every call of forward, the caller's RNG
    state and the buffers of the modules forward uses put back afterwards."""
    target = fn.forward if is_function else fn
    with buffers_kept(target, primals=inputs), SameDraws(
            inputs, generators(target, inputs), buffers_used(target, inputs)) as draws:
        yield draws


def buffers_used(fn: Any, inputs: tuple[Any, ...]) -> tuple[
        list[torch.nn.Module], list[tuple[torch.nn.Module, str, Tensor]]]:
    """The modules ``fn`` uses (:func:`reached`, and those among the inputs), and their
    buffers, each with its module and name (NOTE [check_function's draws]), in eval mode
    too: a forward that replaces its buffer (``self.scale = self.scale * 1.1``) in eval
    mode made every call another function, and a correct backward was blamed."""
    roots, _ = reached(fn)
    known = {id(m) for m in roots}
    roots += [m for m in modules_reached(inputs) if id(m) not in known]
    modules = module_tree(roots)
    return modules, [(m, name, b) for m in modules for name, b in m._buffers.items()
                     if isinstance(b, Tensor) and b.layout == torch.strided]


#: Objects :func:`generators` looks at in all, and items of one list or dict.
_SEARCHED, _ITEMS = 512, 64
_SKIPPED = (Tensor, str, bytes, int, float, complex, bool, type, types.ModuleType, type(None))


def generators(fn: Any, inputs: tuple[Any, ...], depth: int = 6) -> list[torch.Generator]:
    """The ``torch.Generator`` objects ``fn`` reaches (NOTE [check_function's draws]): in
    its closure cells, defaults and the globals its code names, a ``partial``'s function and
    arguments, a bound method's object, the attributes of a plain object or of any module it
    holds, the items of a list, tuple or dict, and the inputs; ``depth`` levels, at most
    :data:`_SEARCHED` objects."""
    found: dict[int, torch.Generator] = {}
    seen: set[int] = set()

    def visit(obj: Any, level: int) -> None:
        if isinstance(obj, torch.Generator):
            found[id(obj)] = obj
            return
        if isinstance(obj, _SKIPPED) or id(obj) in seen or len(seen) >= _SEARCHED or level <= 0:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            for m in module_tree((obj,)):
                seen.add(id(m))
                for value in itertools.islice(vars(m).values(), _ITEMS):
                    if not isinstance(value, torch.nn.Module):
                        visit(value, level - 1)
            return
        if isinstance(obj, types.FunctionType):
            items = [*captured_values(obj), *(obj.__defaults__ or ()),
                     *(obj.__kwdefaults__ or {}).values()]
        elif isinstance(obj, types.MethodType):
            items = [obj.__self__, obj.__func__]
        elif isinstance(obj, functools.partial):
            items = [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = list(itertools.islice(obj, _ITEMS))
        elif isinstance(obj, dict):
            items = list(itertools.islice(obj.values(), _ITEMS))
        else:
            try:  # (not getattr: an object without one runs its __getattr__, user code)
                attrs = object.__getattribute__(obj, "__dict__")
            except AttributeError:
                attrs = None
            items = list(itertools.islice(attrs.values(), _ITEMS)) if isinstance(
                attrs, dict) else []
        for item in items:
            visit(item, level - 1)

    visit(fn, depth)
    for a in inputs:
        visit(a, depth)
    return list(found.values())
