""""auto"'s check of the reverse product, run once more at a point near x.

NOTE [auto, checked near the point]
NOTE [auto, checked once] and NOTE [a reverse product checked forward] (in
:mod:`torch_vjp._engine.revcheck`) compare values at the first call's point only, and a
formula the lists of wrong operators do not hold can agree with the right one there: a
custom autograd.Function whose backward is wrong, fed ``u[1:] * u[:-1]`` at zeros (every
product is 0), or multiplied by ``x.sum()`` at a point summing to 0, or whose backward
calls an op whose batching rule is wrong by a factor (0 times a factor is 0). The check
passed, the route was remembered for the function and signature, and every later call
returned a Jacobian wrong by 1.8-3.5 at a scale of one (batch_jacobian by 2.6), without a
word. So where the modes agree at x and x has such structure (an entry exactly 0, a value
repeated, sums of 0 within rounding, whole or along a dimension: :func:`structured`; values
drawn at random have none, and cost nothing more), the comparison runs once more at a
point near x,
``x + t w`` (``w`` fixed normal draws of a generator of its own, ``t`` an eighth of x's
largest magnitude, at least an eighth), which a coincidence at x does not follow: one
forward product along the check's ``v``, one reverse product without vmap with its ``u``,
and the same reverse product computed under torch.vmap beside another cotangent (``u``
reversed). Where the modes disagree there and a central difference sides with forward
mode (and the reverse products scale with their cotangent, as backward formulas' do),
the reverse product is wrong, as at x: "auto" takes forward mode, with the warning of
NOTE [a reverse product checked forward], whose numbers are those near x. Where the modes
agree but the product under vmap does not, a batching rule in f's backward is wrong:
"auto" computes the rows one reverse product at a time, without vmap (``"rev-loop"``),
with a one-time warning. Where f cannot be computed near x (outside its domain: an error,
NaN, infinities, a non-float output, another shape), x's check stands: the point is not
one the caller passed. It runs on the first call per function and signature only (the
one that runs the check); later calls take the remembered route and cost nothing more.
Three products more (one of them vectorised over two cotangents), and the central
difference where the modes disagree there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from torch_vjp._engine.problem import Problem
from torch_vjp._engine.wrongops import wrong_ops

__all__ = ["NearSides", "batched_gap", "near_leaves", "near_sides", "stops_the_call",
           "structured", "wrong_batching_message"]

def stops_the_call(err: BaseException) -> bool:
    """Whether an error near x stops the call: out of memory only. Any other (f's own, or
    torch_vjp's refusal of what f returns there, or a restart for outputs of another size)
    is of a point the caller did not pass: x's check stands."""
    return isinstance(err, (MemoryError, torch.OutOfMemoryError))


def structured(leaves: Sequence[Tensor]) -> bool:
    """Whether x has the structure at which a wrong formula can agree with the right one
    (NOTE [auto, checked near the point]): an entry exactly 0, a value repeated among
    :data:`_SAMPLE` entries spread over x (zeros, ones, a constant, integers, a one-hot or
    identity matrix), or sums of 0 within rounding, whole or along a dimension
    (``x - x.mean()``, ``x - x.mean(0)``). Values drawn at random have none of these (in
    float16 and bfloat16 a repeat among the entries sampled is likely: checked near x).
    A few passes over x, no sort of all of it."""
    with torch.no_grad():
        for x in leaves:
            if x.numel() == 0 or not x.is_floating_point():
                continue
            x = x.detach()
            flat = x.reshape(-1)
            step = max(1, flat.numel() // _SAMPLE)
            if (not bool((x != 0).all())
                    or torch.unique(flat[::step]).numel() < flat[::step].numel()):
                return True
            eps = torch.finfo(x.dtype).eps
            y = x.double()
            sums = [(y.sum(), y.abs().sum())]
            sums += [(y.sum(d), y.abs().sum(d)) for d, n in enumerate(x.shape) if n > 1]
            if any(bool((total.abs() <= 4 * eps * size).all()) for total, size in sums):
                return True
    return False


#: Entries of x compared for a repeated value by :func:`structured`.
_SAMPLE = 1024


#: How far the point of NOTE [auto, checked near the point] is from x, at x's scale.
NEAR = 0.125


def near_leaves(leaves: Sequence[Tensor]) -> list[Tensor]:
    """``x + t w`` for the leaves ``x`` (NOTE [auto, checked near the point]): ``w`` fixed
    normal draws of a generator of their own (no structure, such as a sum of 0, for f to
    meet), ``t`` an eighth of x's largest magnitude, at least an eighth."""
    n = sum(x.numel() for x in leaves)
    w = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    big = max([1.0] + [float(x.detach().abs().amax()) for x in leaves if x.numel()])
    return [(x.detach().double() + NEAR * big * part.reshape(x.shape).to(x.device)
             ).to(x.dtype)
            for x, part in zip(leaves, w.split([x.numel() for x in leaves]))]


class NearSides:
    """f's products near x: the flat outputs (``outs``), ``J v`` by forward mode
    (``tangents``), ``u^T J`` without vmap (``grads``), the same under torch.vmap beside
    another cotangent (``batched``; None where vmap cannot run f), and whether the graph
    there holds an operator of NOTE [named reverse strategies and wrong formulas]
    (``known``: those are read on every call, NOTE [auto reads the graph for known wrong
    operators], whose route and words stand)."""

    __slots__ = ("xs", "outs", "tangents", "grads", "batched", "known")

    def __init__(self, xs: list[Tensor], outs: list[Tensor], tangents: Sequence[Tensor],
                 grads: list[Tensor], batched: list[Tensor] | None, known: bool) -> None:
        self.xs, self.outs, self.tangents = xs, outs, tangents
        self.grads, self.batched, self.known = grads, batched, known


def near_sides(prob: Problem, outputs: Callable[[Sequence[Tensor]], tuple[Tensor, ...]],
               us: Sequence[Tensor], vs: Sequence[Tensor], redraw: Callable[[], None]
               ) -> NearSides | None:
    """The products of NOTE [auto, checked near the point] at :func:`near_leaves`, with
    the check's cotangents ``us`` (shaped like f's flat outputs at x) and tangents ``vs``;
    ``outputs(xs)`` calls f at the leaves ``xs`` (flat outputs). None where f cannot be
    computed there as at x (an error, NaN, infinities, a non-float output, another shape
    or dtype)."""
    xs = near_leaves(prob.leaves)
    try:
        redraw()
        with torch.enable_grad():
            prob.reset_primals()
            outs, tangents = torch.func.jvp(lambda *ys: outputs(ys), tuple(xs), tuple(vs))
        if not _like(outs, us) or not _finite(tangents):
            return None
        redraw()
        with torch.enable_grad():
            prob.reset_primals()
            live = [x.detach().requires_grad_(True) for x in xs]
            outs = list(outputs(live))
            if not _like(outs, us) or not _finite(outs):
                return None
            pairs = [(o, u) for o, u in zip(outs, us) if o.requires_grad]
            if not pairs:
                return None
            known = wrong_ops([o for o, _ in pairs]) != (None, None)
            got = torch.autograd.grad([o for o, _ in pairs], live, [u for _, u in pairs],
                                      allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g.detach() for x, g in zip(xs, got)]
        if not _finite(grads):
            return None
    except Exception as err:  # noqa: BLE001 - at a point the caller did not pass: x's
        if stops_the_call(err):  # check stands
            raise
        return None
    return NearSides(xs, [o.detach() for o in outs], tangents, grads,
                     _batched(prob, outputs, xs, us, redraw), known)


def _batched(prob: Problem, outputs: Callable[[Sequence[Tensor]], tuple[Tensor, ...]],
             xs: list[Tensor], us: Sequence[Tensor], redraw: Callable[[], None]
             ) -> list[Tensor] | None:
    """``u^T J`` at ``xs`` computed under torch.vmap beside another cotangent (``u``
    reversed), the first row of the two; None where vmap cannot run f."""
    cots = tuple(torch.stack([u, u.reshape(-1).flip(0).reshape(u.shape)]) for u in us)
    try:
        redraw()
        with torch.enable_grad():
            prob.reset_primals()
            _, pullback = torch.func.vjp(lambda *ys: outputs(ys), *xs)
            rows = torch.func.vmap(lambda *c: pullback(tuple(c)))(*cots)
    except Exception as err:  # noqa: BLE001 - no batching rule: the loop's rows stand
        if stops_the_call(err):
            raise
        return None
    flat, _ = tree_flatten(rows)
    if len(flat) != len(xs):
        return None
    return [r[0].detach() for r in flat]


def _like(outs: Sequence[Tensor], us: Sequence[Tensor]) -> bool:
    return len(outs) == len(us) and all(
        isinstance(o, Tensor) and o.is_floating_point() and o.shape == u.shape
        and o.dtype == u.dtype for o, u in zip(outs, us))


def _finite(ts: Sequence[Tensor]) -> bool:
    return all(bool(t.isfinite().all()) for t in ts if t.numel())


def batched_gap(sides: NearSides) -> tuple[float, float]:
    """``(max |batched - plain|, max(|batched|, |plain|))`` of the reverse product near x
    under vmap and without it; ``(0, 0)`` where vmap could not run f."""
    if sides.batched is None:
        return 0.0, 0.0
    diff = scale = 0.0
    for a, b in zip(sides.batched, sides.grads):
        if a.numel() == 0:
            continue
        a, b = a.double().reshape(-1).cpu(), b.double().reshape(-1).cpu()
        d = float((a - b).abs().amax())
        diff = d if math.isnan(d) else max(diff, d)
        scale = max(scale, float(torch.maximum(a.abs(), b.abs()).amax()))
    return diff, scale


def wrong_batching_message(call: str, name: str, diff: float, scale: float) -> str:
    """The one-time warning that reverse mode's rows under torch.vmap were found wrong near
    x (NOTE [auto, checked near the point]): computed one at a time instead."""
    return (
        f"{call}: at a point near x, a reverse product of {name} computed under torch.vmap "
        f"disagrees with the same product without vmap (by up to {diff:.3g}, at a scale of "
        f"{scale:.3g}; at x itself they agreed, a coincidence of that point): an operator in "
        f"f's backward (a custom autograd.Function's, or a custom op's) has a wrong "
        f"batching rule, so reverse mode's rows under vmap would be wrong at other points. "
        f"strategy='auto' computed the rows one reverse product at a time, without vmap, "
        f"and does so for this function and input shapes from now on.\n"
        f"  Fix the batching rule (its vmap staticmethod or registered vmap), or pass "
        f"strategy='rev-loop' to compute the rows that way directly. This warning is shown "
        f"once per function."
    )
