"""The tensors inside a computed graph that retain their gradient (``Tensor.retain_grad()``),
found before :func:`torch_vjp.jacobian_of` runs its products through the graph, without
writing any ``.grad``.

NOTE [retain_grad inside the graph]
``torch.autograd.grad`` runs the hook of every tensor of the graph that called
``retain_grad()``, not only of the outputs and inputs (NOTE [jacobian_of and retain_grad]):
each pass writes its gradient into that tensor's ``.grad``, as a new object
(``.grad + g``; a clone of ``g`` where there was none). Under ``torch.vmap`` it stores a
batched tensor there, which escapes the vmap: the next backward pass through the graph then
fails adding to it, and the user's ``.grad`` holds a dead batched tensor. And any pass
replaces the object: a user or an optimizer that holds the old ``.grad`` sees it cut from the
tensor. So every such tensor has its ``.grad`` cleared before each pass and put back after it
(the very object), as the retaining outputs and inputs have; they must be known before the
first pass.

Such a tensor is reached from no handle autograd offers (a node shows neither its
``retain_grad`` hooks nor the tensors it made), so whether one exists is asked of the graph
by one backward pass with a zero cotangent and no vmap, :func:`retained_in_graph`, watched
by a dispatch mode (:class:`_Watch`) that sees every operation of the pass:

1. each node of the graph gets a node pre-hook and a post hook (removed after the pass), so
   that the mode knows when it is inside a node's backward. Outside one, the engine itself
   computes only two things: the sums of the gradients that reach one tensor by several
   paths (``a + b``, both made in this pass), and, for a tensor that retains its gradient,
   its ``retain_grad`` hook's new ``.grad`` (a clone of the gradient where there was
   none, ``.grad + g`` otherwise, ``.grad`` made before the pass). So an operation outside
   every node that clones, or that reads a tensor the pass did not make, is raised at
   (:class:`_Met`) before the hook writes anything, and the pass stops there: nothing was
   written. (A hook of the user's own on a tensor of the graph runs outside the nodes too;
   where it computes only from the gradient, but clones, it is raised at the same: the
   lookup below is then made for nothing, never wrongly.) The retaining outputs and inputs
   (``kept``) hold a stand-in ``.grad`` of their own during the pass, which their hook may
   read, and their own ``.grad`` back after it;
2. where the pass raised so, the graph's retaining tensors are looked up among the live
   Python objects (``gc``; a tensor whose Python object is gone is kept alive with it by
   PyTorch, so none is missed): costly, and only where one exists. Where the pass raised an
   error of the user's own (a backward of theirs that fails), they are looked up all the
   same, and the error comes from the products, which meet it again.

Nothing is left on the user's graph: no tensor pre-hook (autograd offers no way to take one
off a node) and no entry in a node's ``metadata``; the node hooks are removed by their
handles.
"""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torch_vjp._engine.graph import graph_nodes

__all__ = ["retained_in_graph"]


class _Met(Exception):
    """An operation outside every node that may be a ``retain_grad`` hook's."""


class _Watch(TorchDispatchMode):
    """Step 1 of NOTE [retain_grad inside the graph]: lets every operation of a node's
    backward run, and outside the nodes only those that neither clone nor read a tensor
    the pass did not make; raises :class:`_Met` at any other."""

    def __init__(self, made: Sequence[Tensor]) -> None:
        super().__init__()
        # (TensorImpl addresses: a tensor made before the pass, a user's .grad, is alive
        # throughout it, so no tensor made in the pass shares its address)
        self.made = {t._cdata for t in made}
        self.depth: dict[int, int] = {}  # (per thread: the node hooks run where the node does)

    def enter(self, *args: Any) -> None:
        me = threading.get_ident()
        self.depth[me] = self.depth.get(me, 0) + 1

    def leave(self, *args: Any) -> None:
        me = threading.get_ident()
        self.depth[me] = self.depth.get(me, 0) - 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if self.depth.get(threading.get_ident(), 0) <= 0:
            if func.overloadpacket is torch.ops.aten.clone:
                raise _Met(str(func))
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, Tensor) and t._cdata not in self.made:
                    raise _Met(str(func))
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self.made.add(t._cdata)
        return out


def retained_in_graph(outs: Sequence[Tensor], ins: Sequence[Tensor], kept: Sequence[Tensor]
                      ) -> list[Tensor]:
    """The tensors of the graph from ``ins`` to ``outs`` (other than ``kept``, the retaining
    outputs and inputs) that retain their gradient (NOTE [retain_grad inside the graph]),
    their ``.grad`` untouched, and nothing left on the graph: none, at the cost of one
    watched backward pass, in the common case. ``kept`` hold stand-in ``.grad`` during the
    pass and their own after it."""
    nodes = graph_nodes(outs)
    zeros = [torch.zeros_like(o, memory_format=torch.contiguous_format) for o in outs]
    stand_ins = [torch.zeros_like(t) for t in kept]
    watch = _Watch([*zeros, *stand_ins])
    handles = []
    met = False
    saved = [t.grad for t in kept]
    try:
        for node in nodes:
            if type(node).__name__ == "AccumulateGrad":
                continue  # (a leaf: retain_grad is no hook there, and the node does not run)
            handles.append(node.register_prehook(watch.enter))
            handles.append(node.register_hook(watch.leave))
        for t, s in zip(kept, stand_ins):
            t.grad = s
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the products say them again)
            with watch:
                torch.autograd.grad(outs, ins, zeros, retain_graph=True, allow_unused=True)
    except _Met:
        met = True
    except Exception:  # noqa: BLE001 - the products meet it again, and handle it there
        met = True  # (the pass stopped before reaching every node: look them up)
    finally:
        for h in handles:
            h.remove()
        for t, g in zip(kept, saved):
            t.grad = g
    return _in_graph(nodes, kept) if met else []


def _in_graph(nodes: Sequence[Any], kept: Sequence[Tensor]) -> list[Tensor]:
    """The live tensors made by ``nodes`` that retain their gradient (other than ``kept``)."""
    ids = {id(node) for node in nodes}  # (``nodes`` is held: the ids stay theirs)
    known = {id(t) for t in kept}
    found = []
    for obj in gc.get_objects():  # (type(), not isinstance: no object's __class__ runs)
        if not issubclass(type(obj), Tensor) or id(obj) in known:
            continue
        try:  # (a subclass's __torch_function__ answers these reads; it may refuse them)
            hit = obj.retains_grad and id(obj.grad_fn) in ids
        except Exception:  # noqa: BLE001 - not a tensor of this graph, then
            continue
        if hit:
            found.append(obj)
    return found
