"""The check of reverse mode's products on a plan's first use.

NOTE [reverse products, checked on first use]
Reverse mode's compressed products are VJPs vmapped over the colours' cotangents. An op
whose batching rule torch computes wrongly (torch.cdist's backward) makes them wrong, and
one whose backward is wrong even alone (as_strided_scatter's) makes every VJP wrong: the
ops known to be so are listed by hand (NOTE [wrong batching rules] in
:mod:`torch_vjp._sparse.probe`), and one not yet listed was silently wrong on its first
call (the probe of later calls compares the vectorised products with a product of the same
vectorised call, so a rule wrong by a factor, linear in the cotangent, agrees with itself).
So the first use of a plan for a function (its detection's call; a user's pattern, per
function) with reverse mode's colouring checks one product three ways, for ``u`` a fixed
combination of the colours' cotangents (each colour weighted by the probe's levels) and
``v`` a fixed tangent (:func:`~torch_vjp._sparse.probe.probe_row`'s numbers):
``u^T J`` from the vectorised products, the same product by one ``torch.autograd.grad``
without vmap, both element by element, and ``u^T J v`` from the latter against ``u^T (J v)``
from one forward-mode product (a jvp along ``v``), within ``sqrt(eps)`` of the least
precise dtype of f's graph, at the scale of the sum of the products' absolute terms.
Where forward and reverse disagree a float64 central difference of ``u^T f(x + h v)``
decides which is right. The products are then computed by the route that agrees: one
colour at a time without vmap where only the batching is wrong, forward mode where the
reverse product is wrong alone and f's graph holds a custom autograd.Function (or custom
op) to blame, with a one-time warning naming the op; the plan keeps the route for its later
calls. Where the graph holds torch's own ops only, a disagreement of the modes is one of
convention (a tie of max, a write at a repeated index: torch's backward sends the gradient
to every writer), and reverse mode's products stand, as torch.func.jacrev gives them.
It costs two products (one reverse, one forward) on the first use per plan and function,
one (the forward product) under ``"auto"``, whose own check computes the reverse one
(NOTE [auto, checked once]); the difference and a call of f with autograd only where they
disagree. Not in inference mode (no graph to read a reverse product from).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from torch_vjp._engine.context import buffers_kept, func_jvp
from torch_vjp._engine.fwdcheck import all_finite, gap, least_precise, one_reverse_product, tolerance
from torch_vjp._engine.graph import graph_nodes
from torch_vjp._engine.jacobian import function_key, function_name
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.revcheck import central_difference
from torch_vjp._engine.rows import SameDraws
from torch_vjp._errors import JacobianWarning, passes_through, warn_once
from torch_vjp._sparse.probe import probe_row

__all__ = ["first_use_route", "warn_forward"]


def first_use_route(prob: Problem, plan: Any, coloring: Any, comp: Tensor,
                    before: SameDraws, plain: bool = True) -> tuple[str | None, str]:
    """``(route, op)``: ``None`` where the vectorised reverse products ``comp`` agree with a
    product without vmap and with a forward product (or nothing could be checked),
    ``"rev-loop"`` where only their batching is wrong, ``"fwd"`` where reverse mode's product
    is wrong alone; ``op``, what f's graph names as the likely cause. ``before``: the global
    generators' state before the products (f's calls here draw what the products drew);
    they end as they were. Without ``plain`` (``"auto"``, whose own check computes a reverse
    product without vmap), the vectorised products stand for it. See NOTE [reverse
    products, checked on first use]."""
    leaves = list(prob.leaves)
    if (coloring.mode != "rev" or comp.shape[0] == 0 or not comp.is_floating_point()
            or any(x.is_complex() or not x.is_floating_point() for x in leaves)
            or not all_finite(leaves) or not all_finite(comp)
            or torch.is_inference_mode_enabled()):  # (no graph: no reverse product to read)
        return None, ""
    after = SameDraws()
    after()
    try:
        return _route(prob, coloring, comp, leaves, before, plain)
    finally:
        after()


def _route(prob: Problem, coloring: Any, comp: Tensor, leaves: list[Tensor],
           before: SameDraws, plain: bool) -> tuple[str | None, str]:
    device = comp.device
    w = probe_row(torch.zeros(coloring.count, dtype=torch.long), torch.float64, device)
    u_flat = w[coloring.colors.to(device)]  # u[i] = w[colour(i)]: sum_c w[c] seed_c
    r_vmap = (w.to(comp.dtype) @ comp).double()
    n = r_vmap.numel()
    v = probe_row(torch.zeros(n, dtype=torch.long), torch.float64, device, 1)
    before()
    forward = _forward(prob, leaves, v)
    r_plain = r_vmap
    if plain:
        def keep(outs: list[Tensor]) -> list[Tensor]:
            parts = u_flat.split([o.numel() for o in outs])
            return [t.reshape(o.shape).to(o.dtype) for t, o in zip(parts, outs)]

        before()
        with buffers_kept(prob.f):
            res = one_reverse_product(prob, keep=keep)
        if res is None or sum(o.numel() for o in res[0]) != u_flat.numel():
            return None, ""
        r_plain = torch.cat([t.reshape(-1) for t in res[2]]).to(comp.dtype).double()
        if r_plain.numel() != n:
            return None, ""
        outs = res[0]
    elif forward is not None:
        outs = forward[0]
    else:
        return None, ""
    rtol = tolerance(least_precise(outs, [comp, *leaves]))
    diff, scale = gap(r_vmap, r_plain)
    batched_ok = diff <= rtol * scale
    if forward is not None:
        jv = forward[1]
        u64 = u_flat.double()
        if jv.numel() == u64.numel() and bool(jv.isfinite().all()):
            s_rev, s_fwd = float(r_plain @ v), float(u64 @ jv)
            size = max(float(r_plain.abs() @ v.abs()), float(u64.abs() @ jv.abs()))
            if abs(s_rev - s_fwd) > rtol * size:
                with buffers_kept(prob.f):
                    fd = central_difference(prob, _like(u64, outs), _like(v, leaves), before)
                fd = fd if fd is not None and math.isfinite(fd) else None
                if fd is not None and abs(fd - s_fwd) < abs(fd - s_rev):
                    # (only where f's graph holds an op of the user's: torch's own ops differ
                    # between the modes by convention at a tie or a repeated index, where
                    # reverse mode's is the one torch.func.jacrev gives)
                    op, custom = _suspects(prob, leaves, before)
                    if custom:
                        return "fwd", op
    if batched_ok:
        return None, ""
    return "rev-loop", _suspects(prob, leaves, before)[0]


def _forward(prob: Problem, leaves: list[Tensor], v: Tensor
             ) -> tuple[list[Tensor], Tensor] | None:
    """f's flat outputs and ``J v`` (flat, float64) by one forward-mode product; None where
    forward mode fails."""
    tangents = tuple(t.reshape(x.shape).to(x.dtype) for t, x
                     in zip(v.split([x.numel() for x in leaves]), leaves))
    try:
        with buffers_kept(prob.f), torch.no_grad():
            prob.reset_primals()
            out, tan = func_jvp(prob.g, tuple(leaves), tangents)
        return ([o.detach() for o in tree_leaves(out)],
                torch.cat([t.detach().reshape(-1).double() for t in tree_leaves(tan)]))
    except Exception as err:  # noqa: BLE001 - no forward formula: nothing to compare with
        if passes_through(err):
            raise
        return None


def _like(flat: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    """``flat`` cut into pieces shaped like ``tensors``."""
    parts = flat.split([t.numel() for t in tensors])
    return [p.reshape(t.shape) for p, t in zip(parts, tensors)]


def _suspects(prob: Problem, leaves: list[Tensor], before: SameDraws) -> tuple[str, bool]:
    """The ops of f's graph (one call of f with autograd) whose backward torch_vjp cannot
    vouch for, custom autograd.Functions and custom ops, by name; and whether there are
    any."""
    names: list[str] = []
    before()
    try:
        with torch.enable_grad(), buffers_kept(prob.f):
            xs = [x.detach().requires_grad_(True).clone() for x in leaves]
            outs = [o for o in tree_leaves(prob.g(*xs)) if isinstance(o, Tensor)]
    except Exception as err:  # noqa: BLE001 - no graph: nothing to name
        if passes_through(err):
            raise
        outs = []
    for node in graph_nodes(outs):
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            name = type(node).__name__.removesuffix("Backward")
            if name not in names:
                names.append(name)
    if not names:
        return "an operator (not in the lists of ops known to be so)", False
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"an operator (f's graph holds the custom autograd.Function {shown})", True


def warn_forward(prob: Problem, op: str, count: int) -> None:
    """The one-time warning that reverse mode's products were computed in forward mode."""
    warn_once(
        ("sparse-first-use-fwd", function_key(prob.f)),
        f"{prob.call}: reverse mode's products of {function_name(prob.f)} disagree with a "
        f"forward-mode product and a central difference, which agree: {op} has a backward "
        f"that computes a wrong gradient. The Jacobian was computed in forward mode "
        f"({count} products) instead, and will be for this function from now on.\n"
        f"  Fix: correct that op's backward (or pass mode='fwd' to ask for forward mode "
        f"directly). This warning is shown once per function.",
        JacobianWarning,
    )
