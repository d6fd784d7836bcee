"""The point of a VJP: what ``vjp_fn``'s graph may read from the caller's tensors, and
whether it changed since (NOTE [the vjp point, kept]); the state a compiled ``vjp_fn``
compares (NOTE [a compiled vjp_fn's point] in :mod:`torch_vjp.transforms`)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from torch_vjp._engine.context import captured_values, modules_reached
from torch_vjp._errors import JacobianCallError

__all__ = ["Point", "reads", "read_state", "versions_of"]


# NOTE [the vjp point, kept]
# vjp_fn differentiates at the point of the vjp call: torch.func's graph holds what f saved
# there, and reads the caller's tensors themselves where it saved them (the primals, and
# the tensors f captures, which torch.func does not copy). A write into one of them between
# the vjp call and a vjp_fn call (``x.mul_(3)``, an optimizer step on a parameter f uses,
# ``W.add_(1)`` on a captured weight) made the products mix old and new values, silently:
# torch.func's wrappers have version counters of their own, so its check of saved tensors
# never fires (plain autograd raises "modified by an inplace operation" there). So vjp
# records the version counters of the primals, of the tensors f's closure cells and named
# globals hold, and of the parameters and buffers of the modules f reaches, right after f
# ran (f's own writes are part of the point). Where one moved when vjp_fn runs, the graph
# may or may not read it (``x.exp()`` saves its output, not x; ``t * S.sum()`` saves the
# sum, not S), so vjp_fn finds out: it computes the products, then again with the moved
# tensors' values changed for a moment (through ``.data``, so that no version counter, of
# the caller's other graphs either, moves), and puts them back. Equal products do not read
# them (they are the vjp point's, for this cotangent): returned. Others: a JacobianCallError.
# Only a moved point pays for it: one copy of the moved tensors and one more product.
class Point:
    """The version counters of what a vjp point's graph may read (NOTE [the vjp point,
    kept])."""

    def __init__(self, f: Callable[..., Any], leaves: list[Tensor]) -> None:
        self.tensors = tuple(leaves) + tuple(
            v for v in read_state(f) if isinstance(v, Tensor))
        self.n_primals = len(leaves)
        self.versions = versions_of(self.tensors)

    def settled(self, products: Callable[[], Any], call: str) -> Any:
        """``products()``, where it does not read a tensor of the point written since."""
        res = products()
        now = versions_of(self.tensors)
        if now == self.versions:
            return res
        moved = [i for i, (a, b) in enumerate(zip(now, self.versions)) if a != b]
        if reads(products, res, [self.tensors[i] for i in moved]):
            self._refuse(moved[0], call)
        self.versions = now  # (unread: later calls need not find out again)
        return res

    def _refuse(self, i: int, call: str) -> None:
        what = (f"primals[{i}]" if i < self.n_primals else
                f"a tensor f captures (of shape {tuple(self.tensors[i].shape)}: a closure "
                f"variable, a global, or a parameter or buffer of a module f uses)")
        raise JacobianCallError(
            f"{call}: {what} was written in place after torch_vjp.vjp computed the output, "
            f"and the graph of the vjp point reads it. vjp_fn differentiates at the point "
            f"of the vjp call, with the values f saved there: the products would mix the old "
            f"and the new values (torch.func.vjp returns them silently).\n"
            f"  Fix: call torch_vjp.vjp again after the change, for the new point; or write "
            f"into a copy (x = x.clone()) and keep the tensors of the vjp point as they were."
        )


def reads(products: Callable[[], Any], res: Any, tensors: list[Tensor]) -> bool:
    """Whether ``products()`` changes (from ``res``) while ``tensors`` hold other values for
    a moment (NOTE [the vjp point, kept])."""
    kept = [t.detach().clone() for t in tensors]
    try:
        with torch.no_grad():
            for t in tensors:
                d = t.data
                if d.is_floating_point() or d.is_complex():
                    d.mul_(1.5).add_(0.25)
                else:
                    d.add_(1)
            again = products()
        return not all(torch.equal(a.detach(), b.detach())
                       for a, b in zip(tree_leaves(res), tree_leaves(again)))
    except Exception:  # noqa: BLE001 - a product that fails on other values reads them
        return True
    finally:
        with torch.no_grad():
            for t, k in zip(tensors, kept):
                t.data.copy_(k)


def versions_of(values: tuple[object, ...]) -> tuple[int | None, ...]:
    """The version counters of the tensors among ``values`` (in-place writes move them)."""
    return tuple(v._version if isinstance(v, Tensor) and not v.is_inference() else None
                 for v in values)


def read_state(f: object) -> tuple[object, ...]:
    """What NOTE [a compiled vjp_fn's point] compares, in a fixed order."""
    func = f.__func__ if isinstance(f, types.MethodType) else f
    values = list(captured_values(func)) if isinstance(func, types.FunctionType) else []
    for module in modules_reached(f):
        for sub in module.modules():
            values.extend(sub._parameters.values())
            values.extend(sub._buffers.values())
    return tuple(values)
