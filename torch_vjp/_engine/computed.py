"""The Jacobian of tensors already computed (:func:`torch_vjp.jacobian_of`): one backward
pass per output element through their autograd graph, vectorised with ``torch.vmap`` over
``torch.autograd.grad`` and falling back to a loop (NOTE [one fallback policy] in
:mod:`torch_vjp._engine.rows`)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from torch_vjp._engine.memory import plan_products
from torch_vjp._engine.rows import basis_rows, map_rows_with_fallback
from torch_vjp._errors import JacobianWarning, quote_error, shape_str, user_stacklevel, warn_once

__all__ = ["computed_jacobian"]


def computed_jacobian(
    outs: Sequence[Tensor], ins: Sequence[Tensor], retain_graph: bool, create_graph: bool,
    chunk: int | None, call: str, single_out: bool, single_in: bool,
) -> Any:
    """The blocks of the Jacobian of ``outs`` (checked tensors) with respect to ``ins``
    (checked to require grad), in :func:`torch_vjp.jacobian_of`'s structure (one tensor per
    pair, unnested where ``single_out``/``single_in``)."""
    diff = [j for j, o in enumerate(outs) if o.requires_grad]
    d_outs = [outs[j] for j in diff]
    shapes = [o.shape for o in d_outs]
    n = sum(math.prod(s) for s in shapes)
    n_out = sum(o.numel() for o in outs)
    n_in = sum(x.numel() for x in ins)
    itemsize = max([o.dtype.itemsize for o in outs] + [x.dtype.itemsize for x in ins])
    plan = plan_products(
        n, n_out, n_in, itemsize, chunk_size=chunk, max_memory=None, device=ins[0].device,
        call=call,
        alternatives=(
            "torch_vjp.grad with grad_outputs (is_grads_batched=True for many at once) "
            "gives products of the Jacobian with vectors without forming it; or ask for "
            "fewer outputs or inputs at a time."
        ),
    )
    unused: set[int] = set()
    # NOTE [jacobian_of retain_graph]: the graph is kept until the last product, and freed
    # by it (retain_graph=False) only once a vectorised product has succeeded: a failing
    # vectorised attempt must leave the graph whole for the loop that replaces it.
    state = {"stop": 0, "next": 0, "proven": False}

    def grads(vecs: Sequence[Tensor], vectorized: bool) -> tuple[Tensor, ...]:
        if vectorized:  # runs once per chunk, under torch.vmap
            last = state["stop"] >= n
            retain = retain_graph if (last and state["proven"]) else True
        else:
            last = state["next"] >= n - 1
            state["next"] += 1
            retain = retain_graph if last else True
        res = torch.autograd.grad(
            d_outs, ins, list(vecs), retain_graph=retain, create_graph=create_graph,
            allow_unused=True,
        )
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

        blocks_by_input, _ = map_rows_with_fallback(
            lambda *v: grads(v, False), rows, n, chunk_size=plan,
            batched_fn=torch.vmap(lambda *v: grads(v, True)),
            on_fallback=lambda err: warn_once(
                ("jacobian_of", type(err)),
                f"{call}: the vectorised backward pass (torch.vmap over torch.autograd.grad) "
                f"failed, so the Jacobian is computed with one backward pass per output "
                f"element in a Python loop, usually many times slower.\n  It said: "
                f"{quote_error(err)}\n  This warning is shown once.",
                JacobianWarning,
            ),
        )
    # blocks_by_input[i]: (n, *in_i) over the outputs that require grad
    numels = [math.prod(s) for s in shapes]
    result: list[list[Tensor]] = []
    parts_by_input = [b.split(numels) if len(numels) > 1 else (b,) for b in blocks_by_input]
    k = 0
    for j, o in enumerate(outs):
        if o.requires_grad:
            row = [parts[k].reshape((*o.shape, *x.shape)) for parts, x in zip(parts_by_input, ins)]
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




def _warn(message: str) -> None:
    warnings.warn(message, JacobianWarning, stacklevel=user_stacklevel())


