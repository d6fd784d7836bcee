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
by one backward pass with a zero cotangent and no vmap, :func:`retained_in_graph`:

1. on each node of the graph (each of its outputs), a tensor pre-hook: these run before the
   node's ``retain_grad`` hook, and this one hands that hook, in place of the gradient, a
   tensor that refuses every operation (:class:`_Refusing`); a node pre-hook, which runs
   after the ``retain_grad`` hooks, gives the node its gradient back. A ``retain_grad`` hook
   that meets the refusing tensor raises before it writes anything (the clone or the sum it
   would store is the first operation), and the pass stops there: nothing was written;
2. where the pass raised so, the graph's retaining tensors are looked up among the live
   Python objects (``gc``; a tensor whose Python object is gone is kept alive with it by
   PyTorch, so none is missed): costly, and only where one exists. Where the pass raised an
   error of the user's own (a backward of theirs that fails), they are looked up all the
   same, and the error comes from the products, which meet it again.

The tensor pre-hooks stay on the nodes, as those of ``Tensor.register_hook`` do after their
handle's ``remove()`` (autograd offers no way to take one off): each is registered once per
node output, with a dictionary of hooks of its own, kept in the node's ``metadata`` under
:data:`_KEY` and empty outside this pass, so a node passed again (a later call of
``jacobian_of`` on the same graph) is hooked no more. The node pre-hooks are removed.
"""

from __future__ import annotations

import gc
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from torch_vjp._engine.copies import below_transforms
from torch_vjp._engine.graph import graph_nodes

__all__ = ["retained_in_graph"]

#: Where a node's ``metadata`` keeps the hook dictionaries of NOTE [retain_grad inside the
#: graph], one per output of the node.
_KEY = "torch_vjp.retain_grad_probe"


class _Met(Exception):
    """A ``retain_grad`` hook met the refusing tensor."""


class _Refusing(Tensor):
    """A tensor with a gradient's shape, dtype and device that refuses every operation
    (step 1 of NOTE [retain_grad inside the graph])."""

    @staticmethod
    def __new__(cls, like: Tensor) -> _Refusing:
        return Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype,
                                             device=like.device)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        raise _Met(str(func))

    __torch_function__ = torch._C._disabled_torch_function_impl


def retained_in_graph(outs: Sequence[Tensor], ins: Sequence[Tensor], kept: Sequence[Tensor],
                      grads_kept) -> list[Tensor]:
    """The tensors of the graph from ``ins`` to ``outs`` (other than ``kept``, the retaining
    outputs and inputs) that retain their gradient (NOTE [retain_grad inside the graph]),
    their ``.grad`` untouched: none, at the cost of one backward pass, in the common case.

    ``grads_kept(tensors)`` is the context that clears and restores the ``.grad`` of
    ``tensors`` around a pass (here ``kept``'s, whose hooks this pass runs)."""
    skip = {(id(t.grad_fn), t.output_nr) for t in kept if t.grad_fn is not None}
    nodes = graph_nodes(outs)
    held: dict[tuple[int, int], Tensor] = {}
    met: list[bool] = []
    filled: list[OrderedDict] = []
    handles = []

    def refuse(grad: Tensor | None, at: tuple[int, int]) -> Tensor | None:
        if grad is None:  # (no gradient: no retain_grad hook writes either)
            return None
        if grad.layout != torch.strided:  # (a sparse gradient: no stand-in of its layout;
            raise _Met("a gradient of layout " + str(grad.layout))  # the pass stops here,
            # before a retain_grad hook writes, and the retaining tensors are looked up)
        held[at] = grad
        return _Refusing(grad)

    def give_back(node: Any, grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        return tuple(held.pop((id(node), i), g) for i, g in enumerate(grads))

    try:
        for node in nodes:
            n_out = len(node._input_metadata)
            if type(node).__name__ == "AccumulateGrad" or n_out == 0:
                continue  # (a leaf: retain_grad is no hook there)
            hooks = _hook_dicts(node, n_out)
            for i, d in enumerate(hooks):
                if (id(node), i) not in skip:
                    d[0] = lambda g, at=(id(node), i): refuse(g, at)
                    filled.append(d)
            handles.append(node.register_prehook(lambda grads, node=node: give_back(node, grads)))
        zeros = [torch.zeros_like(o, memory_format=torch.contiguous_format) for o in outs]
        try:
            with grads_kept(kept), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the products say them again)
                torch.autograd.grad(outs, ins, zeros, retain_graph=True, allow_unused=True)
        except _Met:
            met.append(True)
        except Exception:  # noqa: BLE001 - the products meet it again, and handle it there
            met.append(True)  # (the pass stopped before reaching every node: look them up)
    finally:
        for d in filled:
            d.clear()
        for h in handles:
            h.remove()
        held.clear()
    return _in_graph(nodes, kept) if met else []


def _hook_dicts(node: Any, n_out: int) -> list[OrderedDict]:
    """The hook dictionaries of ``node``'s outputs, registered as its tensor pre-hooks on the
    first call (NOTE [retain_grad inside the graph])."""
    hooks = node.metadata.get(_KEY)
    if hooks is None:
        hooks = []
        for i in range(n_out):
            stand_in = _stand_in(i)  # (registration reads its output_nr and hook dictionary)
            d: OrderedDict = OrderedDict()
            stand_in._backward_hooks = d
            node._register_hook_dict(stand_in)
            stand_in._backward_hooks = None
            hooks.append(d)
        node.metadata[_KEY] = hooks
    return hooks


#: Tensors whose ``output_nr`` is their index, made once (:func:`_stand_in`).
_STAND_INS: list[Tensor] = []


def _stand_in(i: int) -> Tensor:
    """A tensor of ``output_nr`` ``i``, for ``_register_hook_dict``, which takes the output a
    hook is for from a tensor."""
    while len(_STAND_INS) <= i:
        n = len(_STAND_INS) + 1
        with below_transforms(), torch.enable_grad(), torch.inference_mode(False):
            _STAND_INS.append(torch.zeros(n, requires_grad=True).unbind()[n - 1])
    return _STAND_INS[i]


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
