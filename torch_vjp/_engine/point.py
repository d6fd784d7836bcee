"""The point of a VJP: what ``vjp_fn``'s graph may read from the caller's tensors, and
whether it changed since (NOTE [the vjp point, kept]); the state a compiled ``vjp_fn``
compares (NOTE [a compiled vjp_fn's point] in :mod:`torch_vjp.transforms`)."""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor
from torch.nn import Module

from torch_vjp._engine.context import captured_values, module_tree, reached
from torch_vjp._errors import JacobianCallError

__all__ = ["Point", "read_state", "versions_of"]


# NOTE [the vjp point, kept]
# vjp_fn differentiates at the point of the vjp call: torch.func's graph holds what f saved
# there, and reads the caller's tensors themselves where it saved them (the primals; the
# output and the aux it returned, which torch.func hands out unwrapped: tensors of f's graph
# themselves; and the tensors f captures, which torch.func does not copy). A write
# into one of them between the vjp call and a vjp_fn call (``x.mul_(3)``, ``out.mul_(0.5)``,
# an optimizer step on a parameter f uses, ``W.add_(1)`` on a captured weight) made the
# products mix old and new values, silently: torch.func's wrappers have version counters of
# their own, so its check of saved tensors never fires (plain autograd raises "modified by
# an inplace operation" there). So vjp records the version counters of the primals, of f's
# output and aux (``aux.mul_(0)`` on an aux the output was computed from), of the tensors
# f reaches (:func:`~torch_vjp._engine.context.reached`: closure
# cells, defaults, named globals, a ``partial``'s arguments, the items of a dict or list
# they hold) and of the parameters and buffers of the modules f reaches, right after f ran,
# and vjp_fn raises a JacobianCallError where one moved. Whether the graph reads the tensor
# written is not known (``x.exp()`` saves its output, not x): a write the graph does not
# read is refused too, as plain autograd refuses a write into any tensor it saved. (Testing
# it by computing again with other values is not a proof: a product that reads only the
# sign of x, ``abs``, agrees for every value of one sign.)
class Point:
    """The version counters of what a vjp point's graph may read (NOTE [the vjp point,
    kept])."""

    def __init__(self, f: Callable[..., Any], leaves: list[Tensor], outputs: list[Tensor],
                 aux: Sequence[Tensor] = ()) -> None:
        self.names = ([f"primals[{i}]" for i in range(len(leaves))]
                      + [f"the output's tensor {i}" if len(outputs) > 1 else "the output"
                         for i in range(len(outputs))]
                      + [f"the aux's tensor {i}" if len(aux) > 1 else "the aux"
                         for i in range(len(aux))])
        self.tensors = tuple(leaves) + tuple(outputs) + tuple(aux) + tuple(
            v for v in read_state(f) if isinstance(v, Tensor))
        self.versions = versions_of(self.tensors)

    def check(self, call: str) -> None:
        """Raises where a tensor of the point was written in place since."""
        now = versions_of(self.tensors)
        if now == self.versions:
            return
        i = next(k for k, (a, b) in enumerate(zip(now, self.versions)) if a != b)
        what = (self.names[i] if i < len(self.names) else
                f"a tensor f captures (of shape {tuple(self.tensors[i].shape)}: a closure "
                f"variable, a default, a global, a tensor in a container f holds, or a "
                f"parameter or buffer of a module f uses)")
        raise JacobianCallError(
            f"{call}: {what} was written in place after torch_vjp.vjp computed the output. "
            f"vjp_fn differentiates at the point of the vjp call, and its graph may read "
            f"the values f saved there from that tensor: the products would mix the old and "
            f"the new values (torch.func.vjp returns them silently; plain autograd refuses "
            f"a write into a tensor it saved).\n"
            f"  Fix: call torch_vjp.vjp again after the change, for the new point; or write "
            f"into a copy (x = x.clone()) and keep the tensors of the vjp point as they were."
        )


def versions_of(values: tuple[object, ...]) -> tuple[int | None, ...]:
    """The version counters of the tensors among ``values`` (in-place writes move them)."""
    return tuple(v._version if isinstance(v, Tensor) and not v.is_inference() else None
                 for v in values)


def read_state(f: object) -> tuple[object, ...]:
    """What NOTE [a compiled vjp_fn's point] compares, in a fixed order: what ``f``'s
    closure cells, named globals and defaults hold, the numbers, flags and strings among
    the attributes of the plain objects they hold (and of a bound method's object) and
    among the values of the dicts they hold, the
    tensors it reaches further (containers, a ``partial``'s arguments), and the parameters,
    buffers and plain attributes (``training``, a scale) of the modules it reaches.

    Numbers, flags and strings are immutable, so the same object is the same value: a
    change (``m.scale = 5.0``, ``cfg.k = 5.0``) shows as another object."""
    func = f.__func__ if isinstance(f, types.MethodType) else f
    values: list[object] = []
    if isinstance(func, types.FunctionType):
        values.extend(captured_values(func))
        values.extend(func.__defaults__ or ())
        values.extend((func.__kwdefaults__ or {}).values())
    holders = list(values)
    if isinstance(f, types.MethodType):
        holders.append(f.__self__)
    for holder in holders:  # (a plain object's attributes or a dict's items, one level)
        if isinstance(holder, dict):
            values.extend(_scalars(holder))
        elif not isinstance(holder, (Module, type, types.ModuleType, types.FunctionType)):
            values.extend(_scalars(getattr(holder, "__dict__", None)))
    modules, tensors = reached(f)
    known = {id(v) for v in values}
    values.extend(t for t in tensors if id(t) not in known)
    for sub in module_tree(modules):  # (not Module.modules(): it hashes each module)
        values.extend(sub._parameters.values())
        values.extend(sub._buffers.values())
        values.extend(_scalars(sub.__dict__))
    return tuple(values)


_SCALARS = (bool, int, float, complex, str, type(None))


def _scalars(attrs: object) -> list[object]:
    """The numbers, flags and strings among an object's attributes, in their order."""
    if not isinstance(attrs, dict):
        return []
    return [v for v in attrs.values() if isinstance(v, _SCALARS)]
