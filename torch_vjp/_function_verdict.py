"""What :func:`torch_vjp.check_function` says when the values of a gradient do not match:
the dot-product probes (:class:`Probe`), the message that blames backward, and the one that
blames the point instead, where forward has a kink (NOTE [kinks]).

NOTE [kinks]
At a point where forward is not differentiable (relu, abs or clamp exactly at their corner,
max at a tie), the central difference ``(f(x + eps t) - f(x - eps t)) / (2 eps)`` averages
the two one-sided slopes, while backward (torch's own formulas too: relu's gradient at 0 is
0) returns one of them: the dot-product test would blame a correct backward. When a probe
fails, the checker therefore compares the one-sided differences along its tangent ``t``:
their gap, weighted by the probe's cotangent ``c`` (``sqrt(sum (c * gap)^2)``), is about
``eps |f''| t^2`` where forward is smooth, and does not shrink with the step at a kink. A
gap above the test's tolerance that stays (at least half of it, at most twice it) at a step
ten times smaller, and above the rounding of both, is a kink (a gap of rounding grows
tenfold: a forward computing in float32 inside, its outputs moved off float32's grid, was
refused as a kink, a backward returning zeros included). A backward that returns either
one-sided slope, element by element, lies within ``0.5 sum |c * gap|`` of the central
differences; an error more than twice that is backward's whatever the kink, and is blamed
(a relu whose backward doubled every gradient, checked at whole numbers, was refused as a
kink, 'a backward that may be right'). An error within it is tested again with ``c`` zero
on the outputs whose gaps make up all but a quarter of the tolerance (:func:`hidden_error`):
a backward a few percent off on the smooth outputs (a sin beside a relu at 0, or relu's
other elements) hid inside the kink's excuse and was refused as a kink. Else: the point is
refused with a :class:`FunctionCheckValueError` (as a non-finite one is), not blamed on
backward.

NOTE [a smaller step]
The central difference carries a truncation error of about ``eps^2 |f3| / 6`` (``f3`` the
third derivative), small against the first derivative where forward curves gently at the
scale of ``eps``, but not near a singularity: log or 1/x at x = 3e-6 with eps = 1e-6 is off
by a few 1e-4, and at x = 1e-7 the step leaves the domain (NaN). A correct backward failed
there. When a probe fails, its differences are therefore taken again with steps 10, 100, ...
(up to 1e8) times smaller, as long as their rounding (which grows as the step shrinks) stays
below a tenth of ``rtol`` of the probe's scale, so that the test is not loosened:
differences that converge to what backward returned clear it, and the report notes the step
that was needed. A wrong backward disagrees at every step. The first passing step must be
where the larger steps converge: its change to one more step, ten times smaller, is the one
their error's ``step ** 2`` trend predicts (:func:`_converges`). A forward that computes in
float32 inside, with outputs moved off float32's grid (``F.apply(x) * 1.37``), is flat at
steps below float32's rounding: the differences jumped to that plateau, passed a backward
returning zeros there, and the report said they had converged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from torch_vjp._backward_check import dtype_name
from torch_vjp._function_values import NORM_SHARE, inner, paired_norm, spread

__all__ = ["Kink", "Probe", "Rough", "conjugated", "find_kink", "kink_message", "parameter_fix",
           "smaller_step", "swap_message", "swapped_partner", "value_message"]


@dataclass(frozen=True)
class Probe:
    lhs: float  # <J t, c>, J t by central differences
    rhs: float  # <t, J^T c>, J^T c from backward
    size: float  # max(|(J t) * c|, |t * (J^T c)|) (NOTE [the dot-product test])
    noise: float  # the rounding error the finite differences can carry
    # (the probe's point, tangent and cotangents: kept to look for a kink, NOTE [kinks])
    x: Tensor | None = field(default=None, repr=False, compare=False)
    t: Tensor | None = field(default=None, repr=False, compare=False)
    cots: Sequence[Tensor] = field(default=(), repr=False, compare=False)
    g_size: float = 0.0  # the backward side's share of ``size``
    step: float = 0.0  # the step of the central differences
    # (the gradients backward returned for every differentiated input in this probe's pass,
    # by input index: two in each other's places show, NOTE [swapped gradients])
    grads: dict[int, Tensor] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class Rough:
    """The one-sided differences of a failed probe disagree more at a step ten times
    smaller (``growth`` times): rounding coarser than the outputs' dtype, no kink (NOTE
    [kinks])."""

    growth: float


@dataclass(frozen=True)
class Kink:
    """Where the one-sided differences of a probe disagree most (NOTE [kinks])."""

    output: int  # index among the differentiated outputs
    index: tuple[int, ...]  # the element of that output
    left: float  # (f(x) - f(x - eps t)) / eps there
    right: float  # (f(x + eps t) - f(x)) / eps there
    # (how far from the central differences any choice of one-sided slopes lies, in the
    # probe's terms: 0.5 sum |c * gap|; an error beyond it is backward's, NOTE [kinks])
    explains: float = math.inf
    # (|c * gap| element by element, per output: where the kink lies, :func:`hidden_error`)
    weights: tuple[Tensor, ...] = field(default=(), compare=False, repr=False)
    # (<J t, c'> and <t, backward(c')> with c' zero where the kink lies, where they differ)
    hidden: tuple[float, float] | None = None


def smaller_step(p: Probe, at: Callable[[Tensor], list[Tensor]], eps: float, atol: float,
                 rtol: float, unit: float) -> Probe | None:
    """The failed probe ``p`` again with central differences of steps 10, 100, ... times
    smaller: the first that passes, where one more step confirms that the differences
    converge there (else None), or, where none passes, the last finite one whose rounding
    stays small, or None (NOTE [a smaller step]). ``at(xi)``: forward's differentiated
    outputs with the probe's input at ``xi``."""
    x, t, cots = p.x, p.t, p.cots
    assert x is not None and t is not None

    def probe_at(step: float) -> tuple[float, float, float]:
        with torch.no_grad():
            f_plus, f_minus = at(x + step * t), at(x - step * t)
        jt = [(a - b) / (2 * step) for a, b in zip(f_plus, f_minus)]
        lhs = sum((inner(c, j) for c, j in zip(cots, jt)), 0.0)
        size = max(spread(cots, jt), p.g_size, NORM_SHARE * paired_norm(cots, jt))
        level = [a.abs() + b.abs() for a, b in zip(f_plus, f_minus)]
        return lhs, size, 10 * unit * spread(cots, level) / (2 * step)

    # (the larger steps' finite differences: a passing step must continue their trend)
    larger = [(eps, p.lhs)] if math.isfinite(p.lhs) else []
    closest = None
    for k in range(1, 9):
        step = eps / 10 ** k
        lhs, size, noise = probe_at(step)
        if not (math.isfinite(lhs) and math.isfinite(size)):
            continue  # (NaN off the domain: a smaller step may stay in it)
        if noise > 0.1 * rtol * size:
            break  # (rounding, growing as the step shrinks, would loosen the test)
        closest = replace(p, lhs=lhs, size=size, noise=noise, step=step)
        if abs(lhs - p.rhs) <= atol + rtol * size + noise:
            return closest if _converges(larger, step, lhs, probe_at, atol, rtol) else None
        larger.append((step, lhs))
    return closest


def _converges(larger: list[tuple[float, float]], step: float, lhs: float,
               probe_at: Callable[[float], tuple[float, float, float]], atol: float,
               rtol: float) -> bool:
    """Whether the differences ``lhs`` at ``step``, which pass the test where the larger
    steps' failed, are where the larger ones converge (NOTE [a smaller step]): their error
    shrinks as ``step ** 2`` (truncation, ``lhs(s) = T + C s^2``), so the change to a step
    ten times smaller is the one the last larger step predicts. A forward that rounds
    coarser than its outputs' dtype (float32 inside, outputs moved off its grid) is flat
    below its rounding: differences that jump from the slope to a plateau with no trend
    towards it, and a backward missing that slope would pass at the plateau."""
    nxt = step / 10
    lhs_next, size, noise = probe_at(nxt)
    if not (math.isfinite(lhs_next) and math.isfinite(size)):
        return False
    change = lhs - lhs_next
    if larger:
        s_j, lhs_j = larger[-1]
        predicted = (lhs_j - lhs) * (step ** 2 - nxt ** 2) / (s_j ** 2 - step ** 2)
    else:
        predicted = 0.0  # (no finite larger step: the next one must agree)
    return abs(change - predicted) <= atol + rtol * size + noise


def find_kink(p: Probe, at: Callable[[Tensor], list[Tensor]], eps: float, tol: float,
              unit: float) -> Kink | Rough | None:
    """Where forward has a kink along the failed probe's tangent, or :class:`Rough` where
    its differences grow noisier as the step shrinks, or None (NOTE [kinks]): three more
    forwards per step, only once the test has failed."""
    x, t, cots = p.x, p.t, p.cots
    assert x is not None and t is not None
    seen = []
    for step in (eps, eps / 10):
        with torch.no_grad():
            f0, fp, fm = (at(x + k * step * t) for k in (0, 1, -1))
        gap = [((a - b) - (b - c)) / step for a, b, c in zip(fp, f0, fm)]
        level = [a.abs() + 2 * b.abs() + c.abs() for a, b, c in zip(fp, f0, fm)]
        seen.append((spread(cots, gap), 10 * unit * spread(cots, level) / step, gap,
                     (f0, fp, fm)))
    (big, big_noise, gap, (f0, fp, fm)), (small, small_noise, _, _) = seen
    # (a kink's gap keeps its size at the smaller step; rounding's grows tenfold: a forward
    # that rounds coarser than its outputs' dtype, float32 inside with outputs off its grid,
    # is no kink, and a wrong backward there must be blamed)
    if small >= 2 * big and small > max(tol, small_noise):
        return Rough(small / big if big > 0 else math.inf)
    if not (big > max(tol, big_noise) and max(small_noise, 0.5 * big) < small < 2 * big):
        return None
    weighted = [(c.abs() * d.abs()).reshape(-1) for c, d in zip(cots, gap)]
    k = max(range(len(weighted)),
            key=lambda j: float(weighted[j].max()) if weighted[j].numel() else -1.0)
    flat_at = int(weighted[k].argmax())
    index = tuple(int(d) for d in torch.unravel_index(torch.tensor(flat_at), f0[k].shape))
    left = ((f0[k] - fm[k]) / eps).reshape(-1)[flat_at].item()
    right = ((fp[k] - f0[k]) / eps).reshape(-1)[flat_at].item()
    explains = 0.5 * sum(float(w.sum()) for w in weighted)
    return Kink(k, index, left, right, explains,
                tuple(c.abs() * d.abs() for c, d in zip(cots, gap)))


def hidden_error(p: Probe, kink: Kink, at: Callable[[Tensor], list[Tensor]],
                 vjp: Callable[[list[Tensor]], Tensor], step: float, tol: float
                 ) -> tuple[float, float] | None:
    """The dot-product test again with the probe's cotangent zero on the outputs where
    the kink lies (NOTE [kinks]): ``(<J t, c'>, <t, backward(c')>)`` where they disagree
    beyond what the outputs kept can explain, else None. The kink's gap excuses an error
    of up to ``0.5 sum |c * gap|``, and a backward wrong by a few percent on the smooth
    outputs lies inside it (a relu whose backward scaled every gradient by 1.05, checked at
    whole numbers, was refused as a kink, 'a backward that may be right'); with the kinked
    outputs' cotangent zero, no kink is left to excuse it. ``vjp(cots)``: backward's
    gradient for the probe's input at the probe's point."""
    x, t = p.x, p.t
    assert x is not None and t is not None
    flat = torch.cat([w.reshape(-1).to(torch.float64) for w in kink.weights])
    order = torch.argsort(flat, descending=True)
    # (the smallest weights whose gaps together excuse at most a quarter of the tolerance)
    tail = torch.flip(torch.cumsum(torch.flip(flat[order], (0,)), 0), (0,))
    masked = int((0.5 * tail > 0.25 * tol).sum())
    if masked >= flat.numel():
        return None  # (every output carries the kink: nothing left to test)
    keep = torch.ones_like(flat, dtype=torch.bool)
    keep[order[:masked]] = False
    cots, start = [], 0
    for c in p.cots:
        n = c.numel()
        cots.append(c * keep[start:start + n].reshape(c.shape).to(c.device))
        start += n
    rhs = inner(t, vjp(cots))
    with torch.no_grad():
        f_plus, f_minus = at(x + step * t), at(x - step * t)
    lhs = sum((inner(c, (a - b) / (2 * step)) for c, a, b in zip(cots, f_plus, f_minus)),
              0.0)
    left = 0.5 * float(tail[masked]) if masked < flat.numel() else 0.0
    err = abs(lhs - rhs)
    return (lhs, rhs) if not math.isfinite(err) or err > tol + left else None


def value_message(call: str, fn: Any, is_function: bool, i: int | str, rows: list[Probe],
                  p: Probe,
                  dtype: torch.dtype, eps: float, atol: float, rtol: float,
                  rough: Rough | Kink | None = None, conjugate: bool = False) -> str:
    """The values of the gradient for input ``i`` (or the parameter ``i`` names) are
    wrong; ``rough``: forward's differences grow noisier as the step shrinks, and a
    right backward may fail too; ``conjugate``: the gradient's conjugate passes (NOTE
    [conjugated gradients])."""
    what = i if isinstance(i, str) else f"input {i}"
    if is_function:
        who = f"the gradient that {fn.__name__}.backward returns for {what}"
        fix_who = f"{fn.__name__}.backward"
    else:
        who = f"the gradient autograd computes through fn for {what}"
        fix_who = "the backward of the custom Function(s) fn uses"
    err = abs(p.lhs - p.rhs)
    lines = [
        f"{call}: {who} does not match finite differences of forward.",
        f"  dot-product test in {dtype_name(dtype)} with a random tangent t and "
        f"cotangent c: <J t, c> = {p.lhs:.6g} (central differences of forward, "
        f"eps={eps:g}), but <t, backward(c)> = {p.rhs:.6g}; |error| = {err:.3g} > "
        f"atol + rtol * size = {atol:g} + {rtol:g} * {p.size:.3g}.",
        f"  backward must return dL/d({what}) = grad_output times the Jacobian "
        f"d(output)/d({what}): for every c, <t, backward(c)> equals <J t, c>, the "
        f"change of <output, c> along t.",
    ]
    hint = _ratio_hint(rows) if not conjugate else (
        f"The gradient does not match finite differences, but its complex conjugate "
        f"matches them: {fix_who} conjugates where PyTorch's convention does not, or does "
        f"not where it does (in every probe, <t, conj(backward(c))> = <J t, conj(c)>). For a complex input, backward returns grad_output times the conjugated "
        f"derivative: for a holomorphic f, grad_output * f'(z).conj() (for z * z, "
        f"grad_output * 2 * z.conj()); for a @ b, grad_output @ b.mH, not b.mT.\n"
        f"  Fix: conjugate the derivative factors in {fix_who} for {what} (not grad_output), "
        f"or drop the .conj() it has there.")
    if isinstance(rough, Kink):  # (NOTE [kinks]: one it cannot explain)
        lines.append(
            f"  forward has a kink at these inputs too (one-sided rates of {rough.right:.6g} "
            f"and {rough.left:.6g}), but " + (
                f"any choice of one-sided slopes stays within {rough.explains:.3g} of "
                f"<J t, c>, far less than the error: it is backward's." if rough.hidden is None
                else f"with c zero on the outputs where the kink lies, <J t, c'> = "
                f"{rough.hidden[0]:.6g} while <t, backward(c')> = {rough.hidden[1]:.6g}: no "
                f"kink is left to excuse that error, it is backward's."))
        rough = None
    if rough is not None:
        lines.append(
            f"  But forward's finite differences grow noisier as the step shrinks (their "
            f"one-sided gap grew {rough.growth:.3g} times at a step ten times smaller): "
            f"forward rounds coarser than its {dtype_name(dtype)} outputs hold (it computes in "
            f"float32 or lower inside, say), so this test cannot tell a right backward from a "
            f"wrong one at eps={eps:g}.\n"
            f"  Fix: check with a step and tolerances for that precision, e.g. "
            f"check_function(fn, ..., eps=5e-3, atol=1e-5, rtol=1e-2) for float32 inside."
        )
    elif hint:
        lines.append(f"  {hint}")
    else:
        lines.append(
            f"  Fix: re-derive {fix_who} for {what}; torch.func.jacrev(forward) gives "
            f"the Jacobian J to compare grad_output @ J against (in float64, on a small "
            f"input). Forward must be deterministic for this test to apply."
        )
    return "\n".join(lines)


# NOTE [swapped gradients]
# A backward that returns the gradients of two inputs of one shape in each other's places
# (``return gy, gx`` for ``forward(ctx, x, y)``) passes every check of count, shape, dtype and
# device, and torch gives each input the other's gradient without a word. The dot-product
# test fails for both; each probe's pass has every input's gradient for the same
# cotangents, so the test is run again with the pair exchanged (:func:`swapped_partner`):
# where both inputs' probes pass then, the message says the gradients are swapped, not that
# each needs re-deriving. No further call of forward or backward is needed.


def swapped_partner(i: int, probes: dict[int, list[Probe]],
                    passes: Callable[[Probe], bool]) -> int | None:
    """The input ``j`` whose gradient stands in ``i``'s place and ``i``'s in ``j``'s: every
    probe of ``i`` passes with backward's gradient for ``j``, and every probe of ``j`` with
    the one for ``i`` (NOTE [swapped gradients]); None where there is no such input."""
    for j in probes:
        if j == i:
            continue
        pairs = [(p, j) for p in probes[i]] + [(q, i) for q in probes[j]]
        if all(k in p.grads and p.t is not None and p.grads[k].shape == p.t.shape
               and passes(replace(p, rhs=inner(p.t, p.grads[k]))) for p, k in pairs):
            return j
    return None


# NOTE [conjugated gradients]
# torch's convention for complex gradients (the conjugate Wirtinger derivative) makes backward
# return grad_output times the *conjugated* derivative: grad_output * f'(z).conj() for a
# holomorphic f, grad_output @ b.mH for a @ b. A backward written from the real formulas
# (grad_output * f'(z), grad_output @ b.mT) returns conj(J^H conj(c)) instead of J^H c, so its
# conjugate is the right gradient for the conjugated cotangent: <t, conj(backward(c))> equals
# <J t, conj(c)>. Where every failed input's probe passes that test, the message says so (a
# backward conjugating the whole gradient, as for abs, is caught alike). Two calls of forward
# per probe, on the failure path only.


def conjugated(rows: list[Probe], i: int, at: Callable[[Tensor], list[Tensor]],
               passes: Callable[[Probe], bool]) -> bool:
    """Whether the gradient backward returned for input ``i`` is right once conjugated, for
    the conjugated cotangents, in every probe of ``rows`` (NOTE [conjugated gradients]);
    ``at(xi)``: forward's differentiated outputs with input ``i`` at ``xi``."""
    for p in rows:
        g = p.grads.get(i)
        if p.x is None or p.t is None or g is None or not p.x.is_complex():
            return False
        with torch.no_grad():
            f_plus, f_minus = at(p.x + p.step * p.t), at(p.x - p.step * p.t)
        jt = [(a - b) / (2 * p.step) for a, b in zip(f_plus, f_minus)]
        lhs = sum((inner(c.conj(), j) for c, j in zip(p.cots, jt)), 0.0)
        if not passes(replace(p, lhs=lhs, rhs=inner(p.t, g.conj()))):
            return False
    return bool(rows)


def swap_message(call: str, fn: Any, is_function: bool, i: int, j: int, shape: str) -> str:
    """The gradients of inputs ``i`` and ``j`` (both of ``shape``) are in each other's
    places (NOTE [swapped gradients])."""
    a, b = sorted((i, j))
    if is_function:
        who = f"{fn.__name__}.backward returns the gradients of input {a} and input {b}"
        fix = (f"  Fix: return them in forward's order in {fn.__name__}.backward: the "
               f"gradient for input {a} at index {a}, the one for input {b} at index {b}.")
    else:
        who = (f"the gradients autograd computes through fn for input {a} and input {b} "
               f"come back")
        fix = ("  Fix: in the backward of the custom Function fn uses, return the gradients "
               "in its forward's order, one per forward input.")
    return (
        f"{call}: {who} in each other's places: the gradient at index {a} matches finite "
        f"differences of forward for input {b}, and the one at index {b} those for input "
        f"{a}.\n"
        f"  backward returns one gradient per forward input, in forward's order, dL/d(input "
        f"{a}) at index {a}: torch takes them by position, and as both inputs have shape "
        f"{shape}, nothing else tells them apart, so each input silently gets the other's "
        f"gradient.\n" + fix
    )


def kink_message(call: str, i: int | str, x: Tensor, kink: Kink, n_outputs: int, eps: float) -> str:
    """The point refused: forward has a kink there (NOTE [kinks]); ``i`` an input's index or
    a parameter's name."""
    what = i if isinstance(i, str) else f"input {i}"
    name = "the output of fn" if n_outputs == 1 else f"output {kink.output} of fn"
    at = f" at index {kink.index}" if kink.index else ""
    zeros = int((x == 0).sum()) if x.numel() else 0
    whole = int((x == x.round()).sum()) if x.numel() and not x.is_complex() else 0
    held = []
    if zeros:
        held.append(f"{zeros} zero{'s' if zeros != 1 else ''}")
    if whole > zeros:
        held.append(f"{whole} whole number{'s' if whole != 1 else ''}")
    holds = f" ({what} holds {' and '.join(held)}, where kinks often lie)" if held else ""
    shape = ", ".join(str(d) for d in x.shape)
    dtype = "" if x.dtype == torch.float32 else f", dtype=torch.{dtype_name(x.dtype)}"
    return (
        f"{call}: forward is not differentiable at these inputs: along a random direction t "
        f"of {what}, {name}{at} changes at a rate of {kink.right:.6g} on one side and "
        f"{kink.left:.6g} on the other (one-sided differences, eps={eps:g}), so no gradient "
        f"matches its finite differences there, right or wrong.\n"
        f"  This is a kink: relu, abs or clamp exactly at their corner, max or min at a tie, "
        f"a piecewise formula at its boundary{holds}. backward returns one side's slope "
        f"there (torch's own relu gives 0 at 0), and the central difference that the values "
        f"are checked against averages the two sides, so the check would blame a backward "
        f"that may be right. (The count, shapes, dtypes and devices of what backward returns "
        f"were checked, and are right.)\n"
        + (parameter_fix(i, "away from the kink") if isinstance(i, str) else
           f"  Fix: check at a point away from kinks, e.g. torch.randn({shape}{dtype}): random "
           f"values lie on a kink with probability zero.")
    )


def parameter_fix(label: str, where: str) -> str:
    """The fix where the point refused is a module's parameter (``label``, ``"parameter
    Model.w"``): its values are the module's, not an argument the caller can change in the
    call (the inputs' ``torch.randn(...)`` was suggested)."""
    name = label.removeprefix("parameter ")
    attr = name.split(".", 1)[1] if "." in name else name
    return (
        f"  Fix: {label} is the module's own tensor, not an argument of fn: check a copy of "
        f"the module whose {attr} is moved {where} (m = copy.deepcopy(model); "
        f"torch.nn.init.normal_(m.{attr}); torch_vjp.check_function(m, ...)), or leave its "
        f"gradient unchecked with model.{attr}.requires_grad_(False)."
    )


def _ratio_hint(rows: list[Probe]) -> str | None:
    if all(abs(p.rhs) <= 1e-12 * max(p.size, 1e-300) for p in rows) and any(
        abs(p.lhs) > 0 for p in rows
    ):
        return (
            "backward returns zero for this input (or None), but forward depends on it: "
            "return grad_output times the Jacobian for it."
        )
    if any(p.rhs == 0 for p in rows):
        return None
    ratios = [p.lhs / p.rhs for p in rows]
    r = ratios[0]
    if all(abs(q - r) <= 1e-3 * max(abs(r), 1e-12) for q in ratios) and abs(r - 1) > 1e-3:
        if abs(r + 1) <= 1e-3:
            return "In every probe <t, backward(c)> = -<J t, c>: backward has the sign flipped."
        k = 1 / r
        return (
            f"In every probe <t, backward(c)> = {k:.6g} * <J t, c>: backward's result is "
            f"{k:.6g} times the right one, a constant factor off (a forgotten constant such as "
            f"the 2 in d(x**2)/dx = 2x, or a mean's 1/n)."
        )
    return None
