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
reverse product is wrong alone (the difference within a tenth of the modes' disagreement of
forward mode's value), with a one-time warning naming the op: a custom autograd.Function
(or custom op) of f's graph where it holds one, else torch's ops of the graph; the plan
keeps the route for its later calls. Where the graph holds an op whose modes differ by
convention (a write that does not accumulate, at a repeated index: torch's backward sends
the gradient to every writer, forward mode to the one written last; a tie of max or of a
sort), the disagreement is that convention's, and reverse mode's products stand, as
torch.func.jacrev gives them (the docs page "Strategies"). Any other disagreement is an op
of torch's whose backward is wrong (as ``torch.as_strided_scatter``'s is in torch 2.13) and
which the lists of NOTE [wrong batching rules] do not hold yet: reverse mode and "auto"
returned its wrong Jacobian without a word.
It costs two products (one reverse, one forward) on the first use per plan and function
(three more near x: NOTE [checked near the point]),
one (the forward product) under ``"auto"``, whose own check computes the reverse one
(NOTE [auto, checked once]); the difference and a call of f with autograd only where they
disagree. Not in inference mode (no graph to read a reverse product from).

NOTE [checked near the point]
The check compares values at one point, and a wrong backward can agree with the right one
there: a custom autograd.Function whose backward is wrong, fed ``u[1:] * u[:-1]`` at zeros
(every product is 0), or multiplied by ``x.sum()`` at a point summing to 0; the check passed,
the plan kept reverse mode, and every later call was wrong by 1.7-2.8 at a scale of one,
without a word. So where the modes agree at x, the same comparison (one reverse product
without vmap, one forward product, the central difference where they disagree) runs once
more at a point near x, ``x + t w`` (``w`` fixed normal draws of a generator of its own,
``t`` an eighth of x's largest magnitude, at least an eighth), which a coincidence at x
does not follow; a disagreement there that the difference sides with forward mode takes
forward mode, as at x. A custom op whose batching rule is wrong by a factor agreed at x
alike (and the probe of later calls, which computes its row in the same vectorised call,
agrees with it): where the batching agreed at x, the reverse product near x is computed
once more under torch.vmap, beside another cotangent, and compared with the one without
vmap; where they disagree, the products are computed one colour at a time, as at x. Where
f cannot be computed there (outside its domain: NaN, infinities, an error), x's check
stands. Three products more (one of them vectorised over two cotangents), on the first
use only.

NOTE [reverse products read the graph]
The check above compares values at the first call's point only, and values can agree there
by chance: where f squares what it resizes (``F.interpolate(x * x, ...,
antialias=True)``) at zeros, or multiplies it by ``x.sum()`` at a point summing to 0, the
wrong reverse products and the right ones coincide, the route was kept, and every later
call returned a Jacobian wrong by up to 3.5 at a scale of one, without a word; a user's
pattern serving a function whose graph took such an op at a later call only (a flag in a
dict) was wrong by 0.77 (the probe of later calls compares products of one vectorised
call, which a formula wrong alone makes agree). So reverse mode's products read the graph
their own call of f builds (no call of f more; the plain-autograd products' call too) for
the operators torch differentiates wrongly, by the one list of them
(:func:`~torch_vjp._engine.wrongops.wrong_ops`: ``torch.as_strided_scatter``'s backward
and the antialiased resizes' in the cases its predicate of the node's saved sizes names,
wrong alone; ``torch.cdist``'s batching rule), on every call: where it holds one the plan
did not know of, the plan keeps it (per function, for a user's pattern) and the products
are computed again as a plan that knew it from the start computes them (NOTE [wrong
batching rules] in :mod:`torch_vjp._sparse.probe`): in forward mode under ``"auto"``, with
a one-time warning naming the op, refused under ``mode="rev"`` (forward mode is the fix),
one colour at a time without vmap for a batching rule, with a one-time warning. Where the
first-use check finds a backward wrong and the graph holds one of these ops, the warning
names it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.func import vmap
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from torch_vjp._engine.context import buffers_kept, func_jvp, func_vjp
from torch_vjp._engine.fwdcheck import all_finite, gap, least_precise, one_reverse_product, tolerance
from torch_vjp._engine.graph import graph_nodes
from torch_vjp._engine.jacobian import function_key, function_name
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.revcheck import central_difference
from torch_vjp._engine.rows import SameDraws
from torch_vjp._errors import JacobianWarning, passes_through, warn_once
from torch_vjp._sparse.probe import known_wrong, probe_row
from torch_vjp._sparse.words import wrong_reverse_words

__all__ = ["blamed_op", "first_use_route", "warn_forward"]


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
    u64 = u_flat.double()
    op = (None if forward is None else
          _wrong_alone(prob, leaves, outs, (r_plain, forward[1]), (u64, v), rtol, before))
    # (NOTE [checked near the point]: where the modes, or the batching, agreed at x)
    if (op is None and forward is not None) or (batched_ok and not op):
        try:
            op, batched_ok = _checked_near(prob, leaves, (u64, v), rtol, before,
                                           (op, forward is not None, batched_ok))
        except Exception as err:  # noqa: BLE001 - at a point the caller did not pass: x's
            if isinstance(err, (MemoryError, torch.OutOfMemoryError)):  # check stands
                raise
    if op:
        return "fwd", op
    if batched_ok:
        return None, ""
    op, _ = _suspects(prob, leaves, before)
    return "rev-loop", op if "custom" in op else _UNLISTED


def _checked_near(prob: Problem, leaves: list[Tensor], directions: tuple[Tensor, Tensor],
                  rtol: float, before: SameDraws, at_x: tuple[str | None, bool, bool]
                  ) -> tuple[str | None, bool]:
    """``(op, batched_ok)`` of NOTE [checked near the point]: x's (``at_x``: the op blamed
    there, whether forward mode ran, whether the batching agreed), with the checks that
    agreed at x run again near x."""
    op, forward, batched_ok = at_x
    u64, v = directions
    near = _near(prob, leaves)
    got = None if near is None else _sides(near, u64, v, before)
    if near is None or got is None:
        return op, batched_ok
    if op is None and forward and got[2] is not None:
        op = _wrong_alone(near, list(near.leaves), got[0], got[1:], directions, rtol, before)
    if batched_ok and not op:
        batched_ok = _batched_agrees(near, u64, got[1], rtol, before)
    return op, batched_ok


def _wrong_alone(prob: Problem, leaves: list[Tensor], outs: list[Tensor],
                 products: tuple[Tensor, Tensor], directions: tuple[Tensor, Tensor],
                 rtol: float, before: SameDraws) -> str | None:
    """The op f's graph blames where the reverse product ``u^T J`` and the forward product
    ``J v`` (``products``, flat, float64, at ``prob``'s point) disagree on ``u^T J v``
    beyond ``rtol`` and a central difference sides with forward mode; None where they agree
    or nothing could be checked; ``""`` where they disagree and the difference does not
    side with forward mode, or the graph holds an op whose modes differ by convention."""
    (r, jv), (u64, v) = products, directions
    if jv.numel() != u64.numel() or r.numel() != v.numel() or not bool(jv.isfinite().all()):
        return None
    s_rev, s_fwd = float(r @ v), float(u64 @ jv)
    size = max(float(r.abs() @ v.abs()), float(u64.abs() @ jv.abs()))
    if not abs(s_rev - s_fwd) > rtol * size:
        return None
    with buffers_kept(prob.f):
        fd = central_difference(prob, _like(u64, outs), _like(v, leaves), before)
    if fd is None or not math.isfinite(fd) or abs(fd - s_fwd) > 0.1 * abs(s_fwd - s_rev):
        return ""
    # (not where f's graph holds an op whose modes differ by convention, at a tie or a
    # repeated index: reverse mode's is the one torch.func.jacrev gives)
    op, blamed = _suspects(prob, leaves, before)
    return op if blamed else ""


#: How far the point of NOTE [checked near the point] is from x, at x's scale.
_NEAR = 0.125


def _near(prob: Problem, leaves: list[Tensor]) -> Problem | None:
    """f's problem at a point near x (NOTE [checked near the point]): ``x + t w``, ``w``
    fixed normal draws (from a generator of its own: no structure of their own, such as a
    sum of 0, for f to meet), ``t`` an eighth of x's largest magnitude (at least an
    eighth); None where x's structure cannot be rebuilt."""
    n = sum(x.numel() for x in leaves)
    w = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    w = w.to(leaves[0].device)
    big = max([1.0] + [float(x.detach().abs().amax()) for x in leaves if x.numel()])
    moved = [(x.detach().double() + _NEAR * big * part.reshape(x.shape).to(x.device)).to(x.dtype)
             for x, part in zip(leaves, w.split([x.numel() for x in leaves]))]
    try:
        near = Problem(prob.f, (tree_unflatten(moved, prob.in_spec),), 0, has_aux=False,
                       call=prob.call, detached=True, aux=False, named="x")
    except Exception as err:  # noqa: BLE001 - not rebuilt: checked at x alone
        if passes_through(err):
            raise
        return None
    near.writes_inputs = prob.writes_inputs
    return near


def _sides(prob: Problem, u64: Tensor, v: Tensor, before: SameDraws
           ) -> tuple[list[Tensor], Tensor, Tensor | None] | None:
    """f's flat outputs, ``u^T J`` by one reverse product without vmap and ``J v`` by one
    forward product (None where forward mode fails), flat, float64, at ``prob``'s point;
    None where the reverse product cannot be computed or f is not finite there."""
    def keep(outs: list[Tensor]) -> list[Tensor]:
        parts = u64.split([o.numel() for o in outs])
        return [t.reshape(o.shape).to(o.dtype) for t, o in zip(parts, outs)]

    leaves = list(prob.leaves)
    before()
    forward = _forward(prob, leaves, v)
    before()
    with buffers_kept(prob.f):
        res = one_reverse_product(prob, keep=keep)
    if (res is None or sum(o.numel() for o in res[0]) != u64.numel()
            or not all_finite(res[0])):
        return None
    r = torch.cat([t.reshape(-1) for t in res[2]]).double()
    if not bool(r.isfinite().all()):
        return None
    return res[0], r, None if forward is None else forward[1]


def _batched_agrees(prob: Problem, u64: Tensor, r: Tensor, rtol: float,
                    before: SameDraws) -> bool:
    """Whether ``u^T J`` computed under torch.vmap with another cotangent (``u``
    reversed) agrees with ``r``, the same product without vmap, at ``prob``'s point
    (NOTE [checked near the point]); True where it cannot be computed (unknown)."""
    leaves = tuple(prob.leaves)
    try:
        before()
        with buffers_kept(prob.f), torch.no_grad():
            prob.reset_primals()
            out, pullback = func_vjp(prob.g, *leaves)
            flat, spec = tree_flatten(out)
            sizes = [o.numel() for o in flat]
            if sum(sizes) != u64.numel():
                return True
            cots = [torch.stack([a, b]).reshape(2, *o.shape).to(o.dtype) for a, b, o
                    in zip(u64.split(sizes), u64.flip(0).split(sizes), flat)]

            def pull(*cot: Tensor) -> Tensor:
                grads = pullback(cot[0] if len(flat) == 1 else tree_unflatten(list(cot), spec))
                return torch.cat([g.reshape(-1) for g in tree_leaves(grads)])

            batched = vmap(pull)(*cots)[0].double()
    except Exception as err:  # noqa: BLE001 - unknown: x's check stands
        if passes_through(err):
            raise
        return True
    if batched.numel() != r.numel():
        return True
    diff, scale = gap(batched, r)
    return diff <= rtol * scale


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


#: Backward nodes whose products differ between the modes by convention, not by a wrong
#: formula: writes that do not accumulate (at a repeated index, torch's backward sends the
#: gradient to every writer, forward mode to the one written last), ties (of max, min, a
#: sort, a median: each mode picks its own), and factorisations of a matrix taken to be
#: symmetric (torch's backward of a Cholesky factor or of eigh returns a symmetric
#: gradient, where the function reads one triangle).
_CONVENTION = frozenset({
    "IndexPutBackward0", "IndexPutImplBackward0", "ScatterBackward0", "ScatterBackward1",
    "IndexCopyBackward0", "PutBackward0", "MaskedScatterBackward0", "IndexReduceBackward0",
    "ScatterReduceBackward0", "MaxBackward0", "MaxBackward1", "MinBackward0",
    "MinBackward1", "AmaxBackward0", "AminBackward0", "MaximumBackward0",
    "MinimumBackward0", "FmaxBackward0", "FminBackward0", "MedianBackward0",
    "MedianBackward1", "NanmedianBackward0", "NanmedianBackward1", "SortBackward0",
    "SortBackward1", "TopkBackward0", "KthvalueBackward0", "ModeBackward0",
    "CummaxBackward0", "CumminBackward0", "MaxPool1DWithIndicesBackward0",
    "MaxPool2DWithIndicesBackward0", "MaxPool3DWithIndicesBackward0",
    "CholeskyBackward0", "LinalgCholeskyExBackward0", "LinalgEighBackward0",
})


_UNLISTED = "an operator (not in the lists of ops known to be so)"


def _suspects(prob: Problem, leaves: list[Tensor], before: SameDraws) -> tuple[str, bool]:
    """What f's graph (one call of f with autograd) names as the op whose backward is
    wrong, and whether one is to blame: an op of torch's known to be so (:func:`known_wrong`)
    where it holds one; its custom autograd.Functions (and custom ops),
    whose backward torch_vjp cannot vouch for, where it holds any; else none where it holds
    an op whose modes differ by convention (:data:`_CONVENTION`); else torch's ops of the
    graph (one of them has a wrong formula)."""
    before()
    try:
        with torch.enable_grad(), buffers_kept(prob.f):
            xs = [x.detach().requires_grad_(True).clone() for x in leaves]
            outs = [o for o in tree_leaves(prob.g(*xs)) if isinstance(o, Tensor)]
    except Exception as err:  # noqa: BLE001 - no graph: nothing to name
        if passes_through(err):
            raise
        outs = []
    known = known_wrong(outs)[1]  # (one of torch's ops known to be so, by name)
    if known is not None:
        return known, True
    custom: list[str] = []
    ops: list[str] = []
    convention = False
    for node in graph_nodes(outs, ordered=True):
        name = type(node).__name__
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            name = name.removesuffix("Backward")
            if name not in custom:
                custom.append(name)
        elif name in _CONVENTION:
            convention = True
        elif name != "AccumulateGrad" and name not in ops:
            ops.append(name)
    if custom:
        shown = ", ".join(custom[:3]) + (", ..." if len(custom) > 3 else "")
        return f"an operator (f's graph holds the custom autograd.Function {shown})", True
    if convention or not ops:
        return _UNLISTED, False
    shown = ", ".join(ops[:6]) + (f", ... ({len(ops)} in all)" if len(ops) > 6 else "")
    return (f"one of torch's operators (not in the lists of ops known to be so; f's graph "
            f"holds the backward nodes {shown})"), True


def blamed_op(prob: Problem, before: SameDraws) -> str | None:
    """The op f's graph blames where a reverse product disagrees with a forward product and
    a central difference that agree (NOTE [reverse products, checked on first use]); None
    where the graph holds an op whose modes differ by convention (or no op). ``before``:
    the generators' state f's call starts from."""
    op, blamed = _suspects(prob, list(prob.leaves), before)
    return op if blamed else None


def warn_forward(prob: Problem, op: str, count: int) -> None:
    """The one-time warning that reverse mode's products were computed in forward mode."""
    fix = ("correct that op's backward" if "custom autograd.Function" in op else
           wrong_reverse_words(function_name(prob.f), op)[1] if op.startswith("torch.") else
           "write f without that op (find it by bisecting f: torch.func.jacrev and "
           "torch.func.jacfwd of the part that holds it disagree), and report it to PyTorch")
    warn_once(
        ("sparse-first-use-fwd", function_key(prob.f)),
        f"{prob.call}: reverse mode's products of {function_name(prob.f)} disagree with a "
        f"forward-mode product and a central difference, which agree: {op} has a backward "
        f"that computes a wrong gradient. The Jacobian was computed in forward mode "
        f"({count} products) instead, and will be for this function from now on.\n"
        f"  Fix: {fix} (or pass mode='fwd' to ask for forward mode directly). This warning "
        f"is shown once per function.",
        JacobianWarning,
    )
