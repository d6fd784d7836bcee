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

NOTE [batched pullback, checked near the point]
``vjp_fn(v, batched=True)`` compares its products under torch.vmap with products without
it once per function and signature (NOTE [batched products, checked once] in
:mod:`torch_vjp._engine.fwd_batch`), at the vjp point only: a custom op with a wrong
batching rule in f's backward (wrong by a factor) agreed at zeros, or multiplied by
``x.sum()`` at a point summing to 0, "rev" was remembered, and the batched products at
later vjp points were wrong by 3.5-7.4 without a word. So where the two agreed and the
point has the structure of :func:`structured`, the comparison runs once more near it
(:func:`near_leaves`): one more call of f inside ``torch.func.vjp`` there, its pullback
of the check's own cotangents under torch.vmap and one at a time
(:func:`pullback_near`); where they disagree, the batched products are computed one at a
time, without vmap, with a one-time warning (:func:`near_batched_message`), for that
function and signature from now on. The generators and the modules' buffers are put back
after the call; where f cannot be computed near the point as at it, the point's check
stands.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from torch_vjp._engine.context import buffers_kept, func_jvp
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.rows import SameDraws, own_generators
from torch_vjp._engine.wrongops import wrong_ops

__all__ = ["NearSides", "batched_gap", "near_batched_message", "near_leaves", "near_sides",
           "pullback_near", "stops_the_call", "structured", "wrong_batching_message"]

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
               us: Sequence[Tensor], vs: Sequence[Tensor], redraw: Callable[[], None],
               agree: Callable[[bool, BaseException | None], bool] | None = None
               ) -> NearSides | None:
    """The products of NOTE [auto, checked near the point] at :func:`near_leaves`, with
    the check's cotangents ``us`` (shaped like f's flat outputs at x) and tangents ``vs``;
    ``outputs(xs)`` calls f at the leaves ``xs`` (flat outputs). None where f cannot be
    computed there as at x (an error, NaN, infinities, a non-float output, another shape
    or dtype). ``agree(flag, err)``: with a process group, whether ``flag`` (this rank's
    step failed) holds on some rank, raising on every rank where some rank's ``err`` (out
    of memory) is not None (NOTE [a reverse product checked forward, on every rank alike]
    in :mod:`torch_vjp._engine.revcheck`): each step that decides whether f (or its
    backward) is called again goes on only where it did on every rank, so every rank calls
    them as many times, and an error escapes on every rank or none. None: one process
    (the error raised)."""
    near = _step(lambda: near_leaves(prob.leaves), agree)
    if near is None:
        return None
    xs = near

    def forward() -> tuple[Sequence[Tensor], Sequence[Tensor]] | None:
        redraw()
        with torch.enable_grad():
            prob.reset_primals()
            outs, tangents = func_jvp(lambda *ys: outputs(ys), tuple(xs), tuple(vs))
        return (outs, tangents) if _like(outs, us) and _finite(tangents) else None

    jvp = _step(forward, agree)
    if jvp is None:
        return None
    tangents = jvp[1]
    live = [x.detach().requires_grad_(True) for x in xs]

    def call() -> tuple[list[Tensor], list[tuple[Tensor, Tensor]], bool] | None:
        redraw()
        with torch.enable_grad():
            prob.reset_primals()
            outs = list(outputs(live))
            if not _like(outs, us) or not _finite(outs):
                return None
            pairs = [(o, u) for o, u in zip(outs, us) if o.requires_grad]
            if not pairs:
                return None
            return outs, pairs, wrong_ops([o for o, _ in pairs]) != (None, None)

    called = _step(call, agree)  # (before f's backward: it may run a collective too)
    if called is None:
        return None
    outs, pairs, known = called

    def backward() -> list[Tensor] | None:
        got = torch.autograd.grad([o for o, _ in pairs], live, [u for _, u in pairs],
                                  allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g.detach() for x, g in zip(xs, got)]
        return grads if _finite(grads) else None

    grads = _step(backward, agree)
    if grads is None:
        return None
    return NearSides(xs, [o.detach() for o in outs], tangents, grads,
                     _batched(prob, outputs, xs, us, redraw, agree), known)


T = TypeVar("T")


def _step(run: Callable[[], T | None],
          agree: Callable[[bool, BaseException | None], bool] | None) -> T | None:
    """``run()``, None where it failed (its error at a point the caller did not pass: x's
    check stands) or returned None; with ``agree`` (a process group), None on every rank
    where it failed on some, and out of memory on some rank raises on every rank. Out of
    memory raises."""
    got, stop = None, None
    try:
        got = run()
    except Exception as err:  # noqa: BLE001 - at a point the caller did not pass: x's
        if not stops_the_call(err):  # check stands
            got = None
        elif agree is None:
            raise
        else:
            stop = err
    if agree is not None and agree(got is None, stop):
        return None
    return got


def _batched(prob: Problem, outputs: Callable[[Sequence[Tensor]], tuple[Tensor, ...]],
             xs: list[Tensor], us: Sequence[Tensor], redraw: Callable[[], None],
             agree: Callable[[bool, BaseException | None], bool] | None = None
             ) -> list[Tensor] | None:
    """``u^T J`` at ``xs`` computed under torch.vmap beside another cotangent (``u``
    reversed), the first row of the two; None where vmap cannot run f (``agree``: its
    backward runs on every rank or none, as in :func:`near_sides`)."""
    cots = tuple(torch.stack([u, u.reshape(-1).flip(0).reshape(u.shape)]) for u in us)

    def call() -> Callable[..., Any]:
        redraw()
        with torch.enable_grad():
            prob.reset_primals()
            return torch.func.vjp(lambda *ys: outputs(ys), *xs)[1]

    pullback = _step(call, agree)  # (no batching rule: the loop's rows stand)
    if pullback is None:
        return None
    def pull() -> Any:
        with torch.enable_grad():
            return torch.func.vmap(lambda *c: pullback(tuple(c)))(*cots)

    rows = _step(pull, agree)
    if rows is None:
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


def pullback_near(prob: Problem, has_aux: bool, cots: Sequence[Tensor]
                  ) -> tuple[float, float] | None:
    """``(max |batched - plain|, scale)`` of f's pullback at a point near the vjp point (NOTE
    [batched pullback, checked near the point]) of the K-stacked cotangents ``cots`` (one
    per flat output, each shaped like it at the point), under torch.vmap and one at a
    time; None where the point has no structure, or f cannot be computed near it as at
    it (or vmap cannot run its pullback)."""
    if not structured(prob.leaves):
        return None
    xs = near_leaves(prob.leaves)
    draws = SameDraws(own_generators(prob), host=True)
    draws()  # (the generators' states, kept)
    try:
        with torch.enable_grad(), buffers_kept(prob.f, primals=prob.primals):
            prob.reset_primals()
            res = torch.func.vjp(prob.g_inner, *xs, has_aux=has_aux)
            flat, spec = tree_flatten(res[0])
            if not _like(flat, [c[0] for c in cots]) or not _finite(flat):
                return None

            def pull(*c: Tensor) -> list[Tensor]:
                return tree_flatten(res[1](tree_unflatten(list(c), spec), retain_graph=True))[0]

            rows = torch.func.vmap(pull)(*cots)
            plain = [pull(*(c[k] for c in cots)) for k in range(cots[0].shape[0])]
    except Exception as err:  # noqa: BLE001 - at a point the caller did not pass: the
        if stops_the_call(err):  # point's check stands
            raise
        return None
    finally:
        draws()  # (put back)
        prob.reset_primals()
    diff = scale = 0.0
    for i, r in enumerate(rows):
        one = torch.stack([p[i] for p in plain]).detach().double().reshape(-1).cpu()
        r = r.detach().double().reshape(-1).cpu()
        if r.numel() == 0:
            continue
        d = float((r - one).abs().amax())
        diff = d if math.isnan(d) else max(diff, d)
        scale = max(scale, float(torch.maximum(r.abs(), one.abs()).amax()))
    return diff, scale


def near_batched_message(call: str, name: str, diff: float, scale: float) -> str:
    """The one-time warning that vjp_fn's batched products were found wrong near the vjp
    point (NOTE [batched pullback, checked near the point]): computed one at a time."""
    return (
        f"{call}: at a point near the vjp point, the products of batched=True (torch.vmap "
        f"over the pullback) of {name} disagree with the same products without vmap (by up "
        f"to {diff:.3g}, at a scale of {scale:.3g}; at the vjp point itself they agreed, a "
        f"coincidence of its zeros, repeats or sums of 0): an operator in f's backward (a "
        f"custom autograd.Function's, or a custom op's) has a wrong batching rule, so the "
        f"batched products would be wrong at other points. vjp_fn returned the products "
        f"computed one cotangent at a time, and does so for this function and shapes from "
        f"now on.\n"
        f"  Fix the batching rule (its vmap staticmethod or registered vmap), or pass "
        f"chunk_size=1 to compute the products that way directly. This warning is shown "
        f"once per function."
    )
