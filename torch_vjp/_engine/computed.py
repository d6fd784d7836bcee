"""The Jacobian of tensors already computed (:func:`torch_vjp.jacobian_of`): one backward
pass per output element through their autograd graph, vectorised with ``torch.vmap`` over
``torch.autograd.grad`` and falling back to a loop (NOTE [one fallback policy] in
:mod:`torch_vjp._engine.rows`).

NOTE [jacobian_of, checked once]
The vectorised products run the batching rules of the backward formulas, and a few are wrong
in torch (``torch.cdist``'s: a relative error near 1), as for "auto" in NOTE [auto, checked
once]. So the first vectorised Jacobian of a graph structure (the types of its nodes, in
the order of a walk from the outputs, and the shapes and dtypes of outputs and inputs) is
compared with one backward pass without vmap, with a random cotangent ``u``: ``u^T J`` from
the blocks against the pass. Where they disagree, the Jacobian is computed again one
backward pass per output element (as ``chunk_size=1``), with a one-time warning, and graphs
of that structure take the loop from then on. That first call keeps the graph until the
outputs are released (the loop may need it), as a single vectorised chunk always has.

NOTE [jacobian_of and retain_grad]
``torch.autograd.grad`` runs the hooks of ``Tensor.retain_grad()``: each backward pass adds
its cotangent to the ``.grad`` of a retaining output or input, and under ``torch.vmap`` it
stores a batched tensor there that escapes the vmap (the next pass then fails adding to
it). The ``.grad`` of every retaining output and input is cleared before each pass and put
back after it (the very object), so those tensors come out as they went in; so is that of
every retaining tensor inside the graph, found before the first pass (NOTE [retain_grad
inside the graph] in retained.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import warnings
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from torch_vjp._engine.blocks import owned
from torch_vjp._engine.copies import below_transforms
from torch_vjp._engine.fwdcheck import (
    CHECKED, cast_dtype, cotangent, least_of, remember, stacked_gap, tolerance,
)
from torch_vjp._engine.graph import graph_nodes
from torch_vjp._engine.gradmode import in_grad_mode
from torch_vjp._engine.memory import plan_products
from torch_vjp._engine.retained import retained_in_graph
from torch_vjp._engine.rows import basis_rows, map_rows_with_fallback
from torch_vjp._engine.wrongops import grad_mode_backward, wrong_graph, wrong_towards
from torch_vjp._errors import (
    JacobianCallError, JacobianWarning, quote_error, shape_str,
    user_stacklevel, warn_once,
)

__all__ = ["computed_jacobian", "tensors_of"]

def computed_jacobian(
    outs: Sequence[Tensor], ins: Sequence[Tensor], retain_graph: bool, create_graph: bool,
    chunk: int | None, call: str, single_out: bool, single_in: bool,
) -> Any:
    """The blocks of the Jacobian of ``outs`` (checked tensors) with respect to ``ins``
    (checked to require grad), in :func:`torch_vjp.jacobian_of`'s structure (one tensor per
    pair, unnested where ``single_out``/``single_in``).

    With ``create_graph`` the blocks are differentiable whatever the caller's grad mode, as
    ``torch.autograd.grad(create_graph=True)``'s results are: the products are joined (the
    chunks and the loop's rows stacked) and split into blocks under grad mode too."""
    alone = wrong_towards(outs, ins)  # NOTE [named reverse strategies and wrong formulas]
    if alone is not None:
        raise wrong_graph(call, alone)
    try:
        with torch.enable_grad() if create_graph else contextlib.nullcontext():
            return _blocks(outs, ins, retain_graph, create_graph, chunk, call, single_out,
                           single_in)
    except RuntimeError as err:
        if "reentrant" not in str(err).lower() or not _through_reentrant_checkpoint(outs):
            raise
        raise JacobianCallError(
            f"{call}: the graph of the outputs goes through torch.utils.checkpoint(..., "
            f"use_reentrant=True) (a CheckpointFunctionBackward node), whose backward runs "
            f"only under .backward() without inputs=; it refuses torch.autograd.grad, and "
            f"{call} computes the Jacobian with torch.autograd.grad, one backward pass per "
            f"output element, to the inputs only.\n"
            f"  Fix: checkpoint with torch.utils.checkpoint.checkpoint(..., "
            f"use_reentrant=False), which torch.autograd.grad can run through (and which "
            f"PyTorch recommends); or compute the Jacobian of the function itself with "
            f"torch_vjp.jacobian.\n  torch said: {quote_error(err)}"
        ) from err


def _blocks(
    outs: Sequence[Tensor], ins: Sequence[Tensor], retain_graph: bool, create_graph: bool,
    chunk: int | None, call: str, single_out: bool, single_in: bool,
) -> Any:
    diff = [j for j, o in enumerate(outs) if o.requires_grad]
    d_outs = [outs[j] for j in diff]
    shapes = [o.shape for o in d_outs]
    n = sum(math.prod(s) for s in shapes)
    n_out = sum(o.numel() for o in outs)
    n_in = sum(x.numel() for x in ins)
    itemsize = max([o.dtype.itemsize for o in outs] + [x.dtype.itemsize for x in ins])
    alternatives = (
        "torch_vjp.grad with grad_outputs (is_grads_batched=True for many at once) gives "
        "products of the Jacobian with vectors without forming it; or ask for fewer outputs "
        "or inputs at a time."
    )
    plan = plan_products(
        n, n_out, n_in, itemsize, chunk_size=chunk, max_memory=None, device=ins[0].device,
        call=call, alternatives=alternatives,
    )
    unused: set[int] = set()
    # NOTE [jacobian_of, checked once]: the route remembered for this graph's structure
    key, least = _graph_key(d_outs, ins) if n > 1 and plan != 1 else (None, None)
    route = CHECKED.get(key) if key is not None else None
    if route == "rev-loop":
        plan = 1
    checking = key is not None and route is None and not any(
        t.is_complex() or t.device.type == "meta" for t in (*d_outs, *ins))
    # NOTE [jacobian_of retain_graph]: the graph is kept until the last product, and freed
    # by it (retain_graph=False) only once a vectorised product has succeeded: a failing
    # vectorised attempt must leave the graph whole for the loop that replaces it (and the
    # first call for a graph structure keeps it for the check's loop, if it needs one).
    state: dict[str, Any] = {"stop": 0, "next": 0, "proven": False}
    kept = _retaining((*d_outs, *ins))  # NOTE [jacobian_of and retain_grad]
    if n > 0 and not any(t.device.type == "meta" for t in (*d_outs, *ins)):
        # (NOTE [retain_grad inside the graph] in retained.py: found before any pass)
        kept += retained_in_graph(d_outs, ins, kept)

    # NOTE [a backward right only in grad mode] in wrongops.py: where the graph holds such a
    # node, the backward passes run in grad mode and their results are detached
    in_grad = n > 0 and not create_graph and grad_mode_backward(d_outs) is not None

    def grads(vecs: Sequence[Tensor], vectorized: bool) -> tuple[Tensor, ...]:
        if vectorized:  # runs once per chunk, under torch.vmap
            last = state["stop"] >= n
            retain = retain_graph if (last and state["proven"] and not checking) else True
        else:
            last = state["next"] >= n - 1
            state["next"] += 1
            retain = retain_graph if (last and not checking) else True
        grad = functools.partial(torch.autograd.grad, d_outs, ins, list(vecs),
                                 retain_graph=retain, allow_unused=True)
        with _grads_kept(kept):
            res = (in_grad_mode(grad, create_graph=True) if in_grad
                   else grad(create_graph=create_graph))
        state["proven"] = state["proven"] or vectorized
        out = []
        for i, (g, x) in enumerate(zip(res, ins)):
            if g is None:
                unused.add(i)
                g = torch.zeros_like(x)
            out.append(g)
        return tuple(out)

    blocks_by_input: list[Tensor]
    if n == 0:
        blocks_by_input = [x.new_zeros((0, *x.shape)) for x in ins]
    else:
        basis = basis_rows(shapes, [o.dtype for o in d_outs], [o.device for o in d_outs])

        def rows(start: int, stop: int) -> tuple[Tensor, ...]:
            state["stop"], state["next"] = stop, start
            return basis(start, stop)

        batched = torch.vmap(lambda *v: grads(v, True))

        def products(chunk_size: int | None) -> list[Tensor]:
            return map_rows_with_fallback(
                lambda *v: grads(v, False), rows, n, chunk_size=chunk_size,
                batched_fn=batched,
                on_fallback=lambda err: warn_once(
                    ("jacobian_of", type(err)),
                    f"{call}: the vectorised backward pass (torch.vmap over "
                    f"torch.autograd.grad) failed, so the Jacobian is computed with one "
                    f"backward pass per output element in a Python loop, usually many times "
                    f"slower.\n  It said: {quote_error(err)}\n  This warning is shown once.",
                    JacobianWarning,
                ),
            )[0]

        blocks_by_input = products(plan)
        if checking and state["proven"]:
            rtol = tolerance(least)  # (the graph's least precise dtype: see _graph_key)
            with _grads_kept(kept):
                got = _unbatched_product(d_outs, ins)
            diff, scale = _gap(got, blocks_by_input)
            if diff <= rtol * scale:  # the common case
                remember(key, "rev")
            else:
                checking = False  # (the loop's last product frees the graph, if asked)
                unused.clear()
                blocks_by_input = products(1)
                loop_diff, loop_scale = _gap(got, blocks_by_input)
                # (where the loop disagrees too, NaNs say, no route is shown wrong: the
                # loop's result stands, silently, and later calls stay vectorised)
                wrong = loop_diff <= rtol * loop_scale
                remember(key, "rev-loop" if wrong else "rev")
                if wrong:
                    warn_once(
                        ("jacobian_of route", key),
                        f"{call}: the vectorised backward pass (torch.vmap over "
                        f"torch.autograd.grad) disagrees with one backward pass without it (by "
                        f"up to {diff:.3g}, at a scale of {scale:.3g}): an operator in the "
                        f"graph has a wrong batching rule for its backward (torch.cdist's is "
                        f"one). jacobian_of returned the Jacobian computed one backward pass "
                        f"per output element, and does so for graphs of this structure from "
                        f"now on.\n  Pass chunk_size=1 to compute it that way directly. This "
                        f"warning is shown once per graph structure.",
                        JacobianWarning,
                    )
    # blocks_by_input[i]: (n, *in_i) over the outputs that require grad
    numels = [math.prod(s) for s in shapes]
    result: list[list[Tensor]] = []
    parts_by_input = [b.split(numels) if len(numels) > 1 else (b,) for b in blocks_by_input]
    k = 0
    for j, o in enumerate(outs):
        if o.requires_grad:
            row = [owned(parts[k]).reshape((*o.shape, *x.shape)) for parts, x in zip(parts_by_input, ins)]
            k += 1
        else:
            row = [o.new_zeros((*o.shape, *x.shape), dtype=x.dtype) for x in ins]
        result.append(row)
    for j, o in enumerate(outs):
        out_name = "outputs" if single_out else f"outputs[{j}]"
        if not o.requires_grad:
            _warn(
                f"{call}: {out_name} (shape {shape_str(o.shape)}) does not require grad: it "
                f"was computed from no input through autograd, so its Jacobian is all zeros.\n"
                f"  If it does depend on the inputs, the dependence went through .item(), "
                f".numpy(), torch.tensor(...), .detach() or torch.no_grad(), which autograd "
                f"cannot follow."
            )
            continue
        for i in sorted(unused):
            in_name = "inputs" if single_in else f"inputs[{i}]"
            _warn(
                f"{call}: {out_name} has no autograd path to {in_name}, so that Jacobian "
                f"block is all zeros.\n"
                f"  If {out_name} does depend on {in_name}, the dependence went through "
                f".item(), .numpy(), torch.tensor(...), .detach() or torch.no_grad(), which "
                f"autograd cannot follow."
            )
    rows_out = [r[0] if single_in else tuple(r) for r in result]
    return rows_out[0] if single_out else tuple(rows_out)


def _through_reentrant_checkpoint(outs: Sequence[Tensor]) -> bool:
    """Whether the graph of ``outs`` has a node of ``torch.utils.checkpoint`` with
    ``use_reentrant=True``, which refuses ``torch.autograd.grad``."""
    return any(type(node).__name__ == "CheckpointFunctionBackward"
               for node in graph_nodes(outs))


def _retaining(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The non-leaf tensors among ``tensors`` whose ``.grad`` a backward pass writes, once
    each (NOTE [jacobian_of and retain_grad])."""
    found: dict[int, Tensor] = {}
    for t in tensors:
        if t.retains_grad:
            found.setdefault(id(t), t)
    return list(found.values())


#: Held while a backward pass runs with the caller's retained ``.grad`` put aside
#: (:func:`_grads_kept`): two threads differentiating one graph would otherwise each save
#: what the other's pass wrote there, and one put back the other's (batched) gradient in
#: place of the caller's.
_GRADS_LOCK = threading.RLock()


@contextlib.contextmanager
def _grads_kept(tensors: Sequence[Tensor]):
    """Clears the ``.grad`` of ``tensors`` for a backward pass and puts it back after (one
    thread at a time, where there are any: :data:`_GRADS_LOCK`)."""
    if not tensors:
        yield
        return
    with _GRADS_LOCK:
        saved = [t.grad for t in tensors]
        for t in tensors:
            t.grad = None
        try:
            yield
        finally:
            for t, g in zip(tensors, saved):
                t.grad = g


def _graph_key(outs: Sequence[Tensor], ins: Sequence[Tensor]
               ) -> tuple[Hashable, torch.dtype]:
    """What a remembered route is for (NOTE [jacobian_of, checked once]): the graph's node
    types in the order of a walk from ``outs``, and the shapes, dtypes and devices of both
    ends; and the least precise floating dtype the graph computes in (a float32 step inside
    a float64 graph rounds at float32's)."""
    nodes: list[type] = []
    least = least_of(t.dtype for t in (*outs, *ins))
    for node in graph_nodes(outs, ordered=True):
        nodes.append(type(node))
        least = cast_dtype(node, least)  # (where a dtype can change)
    key = ("jacobian_of", tuple(nodes), tuple((o.shape, o.dtype, o.device) for o in outs),
           tuple((x.shape, x.dtype, x.device) for x in ins))
    return key, least


def _unbatched_product(outs: Sequence[Tensor], ins: Sequence[Tensor]
                       ) -> tuple[Tensor, tuple[Tensor | None, ...]]:
    """A random cotangent ``u`` (flat, from a generator of its own) and ``u^T J`` by one
    backward pass without vmap, which keeps the graph."""
    gen = torch.Generator().manual_seed(0)
    with below_transforms():  # (a draw of numbers of its own: an outer torch.vmap, whose
        # randomness='error' refuses a random operation, has nothing to batch in it)
        us = [cotangent(o, gen) for o in outs]
    got = torch.autograd.grad(outs, ins, us, retain_graph=True, allow_unused=True)
    return torch.cat([v.reshape(-1) for v in us]), got


def _gap(product: tuple[Tensor, tuple[Tensor | None, ...]], blocks: Sequence[Tensor]
         ) -> tuple[float, float]:
    """``(difference, scale)`` between ``u^T J`` read from ``blocks`` (``(n, *in_i)`` per
    input) and the backward pass ``product`` (:func:`_unbatched_product`)."""
    u, got = product
    return stacked_gap(u.reshape(-1), blocks, got)


def _warn(message: str) -> None:
    warnings.warn(message, JacobianWarning, stacklevel=user_stacklevel())


def tensors_of(value: Any, name: str, call: str) -> tuple[Tensor, ...]:
    """``value`` (:func:`torch_vjp.jacobian_of`'s ``outputs`` or ``inputs``: a tensor or a
    non-empty sequence of tensors) as a tuple of tensors; a JacobianCallError otherwise."""
    items = (value,) if isinstance(value, Tensor) else value
    try:
        items = tuple(items)
    except TypeError:
        items = None
    if not items or not all(isinstance(t, Tensor) for t in items):
        raise JacobianCallError(
            f"{call}: {name} must be a tensor or a non-empty sequence of tensors, got "
            f"{type(value).__name__}."
        )
    return items
