"""The tensors inside a computed graph that retain their gradient (``Tensor.retain_grad()``),
found while :func:`torch_vjp.jacobian_of` runs its products through the graph.

NOTE [retain_grad inside the graph]
``torch.autograd.grad`` runs the hook of every tensor of the graph that called
``retain_grad()``, not only of the outputs and inputs (NOTE [jacobian_of and retain_grad]):
each pass writes its gradient into that tensor's ``.grad``. Under ``torch.vmap`` the hook
stores a batched tensor there, which escapes the vmap: the next backward pass through the
graph (the next chunk, the check, the loop, or the user's own ``loss.backward()``) then fails
adding to it, and the user's ``.grad`` holds a dead batched tensor. Such a tensor is reached
from no handle autograd offers (a node does not show its hooks, nor the tensors it made), so
it is found by its effect:

1. one vectorised backward pass whose first row is a zero cotangent: the first chunk of the
   products, with that row put before its rows (:func:`escaped_after`; where the products
   start with the loop instead, or where the memory budget has no room for one product
   more in that chunk, a pass of that one row, :func:`retained_in_graph`). Each
   retaining hook stores a batched tensor whose first row is ``G + g0`` (``G`` its ``.grad``
   before, ``g0`` the zero cotangent's gradient there) or ``g0`` (no ``.grad`` before);
2. one backward pass without vmap and a zero cotangent: where a hook stored a batched
   tensor in 1., it fails adding to it, before writing anything; otherwise no tensor of the
   graph retains its gradient, and this pass wrote nothing either (the common case, at the
   cost of this one pass and a row);
3. on that failure, the tensors whose ``.grad`` is a batched tensor are looked up among the
   live Python objects (``gc``; a tensor whose Python object is gone is kept alive with it
   by PyTorch, so none is missed), ``.grad`` is cleared, and a zero pass writes ``g0``
   alone; the first row of 1. is ``g0`` where there was no ``.grad`` (restored to ``None``),
   and ``G + g0`` otherwise, with ``G + 0 == G`` (restored to that value, as a tensor of its
   own: the hook of 1. replaced the object ``G`` and nothing else holds it; a ``.grad`` that
   was exactly ``g0``, all zeros, cannot be told from none and comes back as ``None``).

Where the vectorised pass of 1. fails part way (an operator vmap cannot batch: the products
fall back to the loop), the retaining tensors past the failure ran no hook and the loop's
passes would add every row into their ``.grad``: then all the graph's retaining tensors are
looked up (``gc``, on that slow path only), and those past the failure keep their ``.grad``,
the very object. Where the zero pass of 3. fails too (a backward of the user's that raises,
with vmap or not), each ``.grad`` is put back all the same (a hook that pass did not reach
taken to have written ``g0 == 0``), and the error comes from the products, which meet it
again.

The tensors found join the outputs and inputs whose ``.grad`` is cleared before each pass and
put back after it, so they come out as they went in.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from torch_vjp._engine.graph import graph_nodes

__all__ = ["retained_in_graph", "escaped_after"]


def retained_in_graph(outs: Sequence[Tensor], ins: Sequence[Tensor], kept: Sequence[Tensor],
                      grads_kept) -> list[Tensor]:
    """The tensors of the graph from ``ins`` to ``outs`` (other than ``kept``) that retain
    their gradient, with their ``.grad`` as before (NOTE [retain_grad inside the graph]), by
    a vectorised pass of its own: for products that start with the loop.

    ``grads_kept(tensors)`` is the context that clears and restores the ``.grad`` of
    ``tensors`` around a pass; ``kept`` are those known already (retaining outputs and
    inputs). Errors of the passes propagate only where no such tensor explains them (they
    come again from the products)."""
    try:
        _zero_pass(outs, ins, kept, grads_kept, batched=True)
    except Exception:  # noqa: BLE001 - the products meet it again, and handle it there
        return escaped_after(outs, ins, kept, grads_kept, failed=True)
    return escaped_after(outs, ins, kept, grads_kept)


def escaped_after(outs: Sequence[Tensor], ins: Sequence[Tensor], kept: Sequence[Tensor],
                  grads_kept, failed: bool = False) -> list[Tensor]:
    """The tensors of the graph from ``ins`` to ``outs`` (other than ``kept``) into whose
    ``.grad`` the vectorised pass just run (whose first row was a zero cotangent) stored a
    batched tensor, with their ``.grad`` as before that pass (steps 2 and 3 of NOTE
    [retain_grad inside the graph]); none, at the cost of one backward pass without vmap, in
    the common case.

    ``failed``: the vectorised pass raised, part way through the graph: the retaining
    tensors past the failure ran no hook, and the loop that replaces the pass would add each
    of its rows into their ``.grad``; so all the graph's retaining tensors are looked up
    (``gc``, on this slow path only), those past the failure with their ``.grad`` untouched."""
    if failed:
        every = _in_graph(outs, kept, escaped_only=False)
        found = [t for t in every if _is_batched(t.grad)]
        if found:
            _restore(found, outs, ins, [*kept, *(t for t in every if not _is_batched(t.grad))],
                     grads_kept)
        return every
    try:
        _zero_pass(outs, ins, kept, grads_kept, batched=False)
    except RuntimeError:
        found = _in_graph(outs, kept, escaped_only=True)
        if not found:
            raise
    else:
        return []
    _restore(found, outs, ins, kept, grads_kept)
    return found


def _restore(found: Sequence[Tensor], outs: Sequence[Tensor], ins: Sequence[Tensor],
             kept: Sequence[Tensor], grads_kept) -> None:
    """Puts back the ``.grad`` of the tensors ``found``, each a batched tensor whose first
    row is ``G + g0`` or ``g0`` (step 3 of NOTE [retain_grad inside the graph])."""
    rows = [_first_row(t.grad) for t in found]
    for t in found:
        t.grad = None
    try:
        _zero_pass(outs, ins, kept, grads_kept, batched=False)  # (writes g0 into each .grad)
    except Exception:  # noqa: BLE001 - the products meet it again, and handle it there
        pass  # (a backward of the user's that fails: each .grad is put back all the same)
    for t, row in zip(found, rows):
        # (a hook the failed pass did not reach left None: g0 taken as zeros, G + 0 == G)
        g0 = torch.zeros_like(row) if t.grad is None else t.grad
        same = torch.equal(row.isnan(), g0.isnan()) and bool(
            (row.nan_to_num() == g0.nan_to_num()).all())
        t.grad = None if same else row


def _is_batched(grad: Tensor | None) -> bool:
    return grad is not None and torch._C._functorch.is_batchedtensor(grad)


def _zero_pass(outs: Sequence[Tensor], ins: Sequence[Tensor], kept: Sequence[Tensor],
               grads_kept, batched: bool) -> None:
    """One backward pass from ``outs`` to ``ins`` with a zero cotangent (a batch of one row
    under ``torch.vmap`` where ``batched``), the ``.grad`` of ``kept`` cleared around it."""
    zeros = [torch.zeros(((1,) if batched else ()) + tuple(o.shape), dtype=o.dtype,
                         device=o.device) for o in outs]

    def run(*vs: Tensor) -> tuple[Tensor | None, ...]:
        return torch.autograd.grad(outs, ins, list(vs), retain_graph=True, allow_unused=True)

    with grads_kept(kept), torch.no_grad(), warnings.catch_warnings():
        # (vmap's warnings about slow batching rules speak of the products, which say them
        # again if they run under vmap; this pass only looks for hooks)
        warnings.simplefilter("ignore")
        (torch.vmap(run) if batched else run)(*zeros)


def _in_graph(outs: Sequence[Tensor], kept: Sequence[Tensor], escaped_only: bool
              ) -> list[Tensor]:
    """The live tensors made by nodes of ``outs``' graph that retain their gradient (other
    than ``kept``); with ``escaped_only``, those whose ``.grad`` is a batched tensor left by
    a vectorised pass."""
    nodes = {id(node): node for node in graph_nodes(outs)}  # (held: their ids stay theirs)
    known = {id(t) for t in kept}
    found = []
    for obj in gc.get_objects():  # (type(), not isinstance: no object's __class__ runs)
        if not issubclass(type(obj), Tensor) or id(obj) in known:
            continue
        try:  # (a subclass's __torch_function__ answers these reads; it may refuse them)
            hit = (obj.retains_grad and id(obj.grad_fn) in nodes
                   and (not escaped_only or _is_batched(obj.grad)))
        except Exception:  # noqa: BLE001 - not a tensor of this graph, then
            continue
        if hit:
            found.append(obj)
    return found


def _first_row(batched: Tensor) -> Tensor:
    """Row 0 of an escaped batched tensor, as a plain tensor of its own."""
    bdim = torch._C._functorch.maybe_get_bdim(batched)
    value = torch._C._functorch.get_unwrapped(batched)
    # (detached: under create_graph the pass that stored it recorded a graph)
    return value.detach().select(bdim, 0).clone(memory_format=torch.contiguous_format)
