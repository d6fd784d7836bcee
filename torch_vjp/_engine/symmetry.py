"""The symmetry of a Hessian, as a check of forward-over-reverse.

NOTE [forward over reverse, checked]
``hessian(strategy="auto")`` differentiates the gradient in forward mode, which runs the
forward-mode formulas of the operators in f's backward pass. A few of those are wrong in torch
(torch.triangular_solve's: a relative error near 1 on the matrix argument), and torch.func
returns such a Hessian silently, or fails. A Hessian of a twice-differentiable f is
symmetric, and a wrong formula almost never keeps it so: the entries ``H[..., a, b]`` and
``H[..., b, a]`` come from different products (column b of the product for input element a
against column a of the product for b). So "auto" compares them, at a cost of one pass over
the Hessian, in pieces that bound the extra memory, and one synchronisation; only where they
disagree beyond rounding (``sqrt(eps)`` of the Hessian's scale) does it compute the Hessian
again reverse-over-reverse, whose formulas are the ones every gradient uses. If the two
Hessians agree (f is not smooth at the point: asymmetric for real), or differ by less than
``sqrt(eps)`` in absolute terms (a Hessian that is zero comes back as rounding of 1e-14, whose
scale is its own), forward-over-reverse stands; if not, the reverse-over-reverse one is
returned, with a one-time warning. Explicit
strategies are not checked: "fwd" is forward-over-reverse as asked.

A wrong formula can keep the Hessian symmetric: ``torch.scatter_reduce(...,
reduce='prod')``'s forward-mode formula is wrong (torch 2.13), and the Hessian of a sum of
squared products through it came back symmetric and wrong by up to 3 at entries of 2.6. So
a symmetric Hessian is also compared with one reverse-over-reverse product ``u^T H`` (a
random ``u``; one more gradient of f and its backward, about a third of a small Hessian's
cost), once per function and signature of the primals (as "auto"'s Jacobian is checked
once, NOTE [auto, checked once]); where they disagree, reverse over reverse is computed
and compared as above, and the signature is compared again at its next call. Where f draws
random numbers, the product's call would draw others: nothing is compared, and the
generators are put back where the Hessian's products left them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from torch_vjp._engine.blocks import Blocks
from torch_vjp._engine.fwdcheck import (
    CHECKED,
    PIECE,
    cotangent,
    largest_difference,
    least_precise,
    max_abs_difference,
    one_reverse_product,
    remember,
    reverse_gap,
    route_key,
    signature,
    tolerance,
)
from torch_vjp._engine.jacobian import function_key, function_name
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.rows import SameDraws, own_generators, passes_through
from torch_vjp._errors import JacobianWarning, warn_once

__all__ = ["asymmetry", "forward_over_reverse_checked"]

def _largest(t: Tensor) -> Tensor:
    return t.abs().amax()


def asymmetry(
    blocks: Sequence[Sequence[Tensor]], leaves: Sequence[Tensor]
) -> tuple[float, float]:
    """The largest difference between Hessian entries that must be equal, and the largest
    entry: ``(difference, scale)``, read with one synchronisation.

    ``blocks[o * L + k][i]`` (``L = len(leaves)``) is the Hessian block of flat output ``o``
    of f with respect to leaves ``k`` then ``i``, shaped ``out_o + leaf_k + leaf_i``; it must
    equal the transpose of ``blocks[o * L + i][k]``.

    Example:
        >>> H = torch.tensor([[2.0, 1.0], [1.5, 3.0]])
        >>> asymmetry([[H]], [torch.zeros(2)])
        (0.5, 3.0)
    """
    n_leaves = len(leaves)
    numels = [x.numel() for x in leaves]
    parts: list[Tensor] = []  # each 1-d: differences and largest entries, as ``kinds`` says
    kinds: list[str] = []
    with torch.no_grad():
        for j in range(len(blocks)):
            o, k = divmod(j, n_leaves)
            for i in range(k, n_leaves):
                n_k, n_i = numels[k], numels[i]
                a = blocks[j][i].detach()
                if n_k * n_i == 0 or a.numel() == 0:
                    continue
                m = a.numel() // (n_k * n_i)
                a = a.reshape(m, n_k, n_i)
                if i == k:
                    b = a.transpose(1, 2)
                else:
                    b = blocks[o * n_leaves + i][k].detach().reshape(m, n_i, n_k)
                    parts.append(_largest(b).reshape(1))
                    kinds.append("s")
                    b = b.transpose(1, 2)
                if a.numel() <= PIECE:  # both maxima in one reduction
                    parts.append(torch.stack((a - b, a)).abs_().flatten(1).amax(1))
                    kinds.append("ds")
                else:
                    parts += [max_abs_difference(a, b).reshape(1), _largest(a).reshape(1)]
                    kinds += ["d", "s"]
    if not parts:
        return 0.0, 0.0
    values = (parts[0] if len(parts) == 1 else torch.cat([p.float() for p in parts])).tolist()
    diff = scale = 0.0
    for kind, value in zip("".join(kinds), values):
        if kind == "d":
            diff = max(diff, value)
        else:
            scale = max(scale, value)
    return diff, scale


def forward_over_reverse_checked(
    f: Callable[..., Any],
    outer: Problem,
    res: Blocks,
    outer_blocks: Callable[[str], Blocks],
    call: str,
) -> Blocks:
    """The forward-over-reverse Hessian ``res`` if it is symmetric, or agrees with
    reverse-over-reverse; else reverse-over-reverse's, with a one-time warning. See NOTE
    [forward over reverse, checked] above. A Hessian "auto" computed reverse over reverse
    (forward mode could not run f) is returned as it is; either route's Hessian that stays
    asymmetric is said (NOTE [an asymmetric Hessian, said])."""
    diff, scale = asymmetry(res.blocks, outer.leaves)
    rtol = tolerance(outer.leaves[0].dtype)
    # (a float32 step inside a float64 f, as the RMSNorm of Llama and T5, rounds every
    # route at float32's: its asymmetry is that rounding, no wrong formula)
    symmetric = diff <= rtol * scale or diff <= tolerance(_least_precise(outer)) * scale
    if res.mode != "fwd":
        if not symmetric:
            _say_asymmetric(f, outer, diff, scale, "reverse over reverse (forward mode "
                            "could not run f)", call)
        return res
    # (the reverse product is compared once per function and signature, as "auto"'s
    # Jacobian is: NOTE [forward over reverse, checked])
    key = ("hessian: forward over reverse",
           signature(route_key(f), outer.leaves, None, outer.primals))
    if symmetric and CHECKED.get(key) == "fwd":  # the common case
        return res
    if symmetric:
        agrees = _reverse_agrees(f, outer, res)
        if agrees is not False:
            if agrees:  # (None: nothing compared, a later call compares)
                remember(key, "fwd")
            return res
    rtol = tolerance(_least_precise(outer))
    try:
        rev = outer_blocks("rev")
    except Exception as err:  # noqa: BLE001 - no safer route: forward over reverse stands
        if passes_through(err):
            raise
        return res
    gap = float(largest_difference(res.blocks, rev.blocks))
    if gap <= rtol * scale:  # both routes agree: said (NOTE [an asymmetric Hessian, said])
        looped = _loop_instead(outer, res, outer_blocks, rtol)
        if looped is not None:  # NOTE [vectorised, outvoted]
            warn_once(
                ("vectorised hessian outvoted", function_key(f)),
                f"{call}: the vectorised Hessian of {function_name(f)} (strategy='auto') is "
                f"not symmetric (entries that must be equal differ by up to {diff:.3g}, at a "
                f"scale of {scale:.3g}), forward over reverse and reverse over reverse "
                f"alike, while the Hessian computed in a Python loop, without torch.vmap, is "
                f"symmetric: an operator in f has a wrong batching rule in its derivatives. "
                f"strategy='auto' returned the loop's Hessian.\n  Pass "
                f"strategy='rev-loop' to compute it that way directly. This warning is shown "
                f"once per function.",
                JacobianWarning,
            )
            return looped
        _say_asymmetric(f, outer, diff, scale, "forward over reverse and reverse over "
                        "reverse alike", call)
        return res
    if gap <= rtol * _gradient_scale(outer):
        # (a Hessian that is zero comes back as rounding, entries of 1e-14 whose scale is
        # their own; the gradient's scale over the input's says what rounding is here)
        return res
    if _quotient_sides_with_forward(f, outer, res, rev):
        # NOTE [reverse over reverse, outvoted]
        warn_once(
            ("rev-over-rev outvoted", function_key(f)),
            f"{call}: forward-over-reverse (strategy='auto') and reverse-over-reverse give "
            f"different Hessians of {function_name(f)} (by up to {gap:.3g}), and a "
            f"difference quotient of f's gradient agrees with forward over reverse: autograd "
            f"cannot differentiate f's backward a second time in reverse mode, as where a "
            f"custom torch.autograd.Function's backward is marked "
            f"@torch.autograd.function.once_differentiable or runs under torch.no_grad (its "
            f"second derivative then comes back as zeros). strategy='auto' returned the "
            f"forward-over-reverse Hessian.\n  Pass strategy='fwd' to compute it that way "
            f"directly; strategy='rev' gives the other Hessian. This warning is shown once "
            f"per function.",
            JacobianWarning,
        )
        return res
    how = ("that is symmetric, but one reverse-over-reverse product disagrees with it"
           if symmetric else
           f"that is not symmetric (entries that must be equal differ by up to {diff:.3g}, "
           f"at a scale of {scale:.3g})")
    warn_once(
        ("fwd-over-rev", function_key(f)),
        f"{call}: forward-over-reverse (strategy='auto') gave a Hessian of "
        f"{function_name(f)} {how}, and reverse-over-reverse disagrees "
        f"with it (by up to {gap:.3g}): an operator in f has a wrong forward-mode derivative "
        f"of its backward formula (torch.triangular_solve is one; torch.scatter_reduce with "
        f"reduce='prod' another). strategy='auto' returned "
        f"the reverse-over-reverse Hessian.\n"
        f"  Pass strategy='rev' to compute it that way directly. This warning is shown once "
        f"per function.",
        JacobianWarning,
    )
    return rev


def _quotient_sides_with_forward(f: Callable[..., Any], outer: Problem, res: Blocks,
                                 rev: Blocks) -> bool:
    """Whether a central difference quotient of f's gradient along a random direction agrees
    with the forward-over-reverse Hessian ``res`` and not with the reverse-over-reverse
    ``rev``.

    NOTE [reverse over reverse, outvoted]
    Where the two routes disagree, "auto" takes reverse over reverse, whose formulas are the
    ones every gradient uses (NOTE [forward over reverse, checked]). But reverse over reverse
    can be the wrong one: through a custom autograd.Function whose backward is marked
    once_differentiable (or runs under torch.no_grad), the gradient's reverse-mode
    derivative comes back as zeros, silently, while forward mode differentiates the
    backward's operations themselves and is right. A third opinion that runs no derivative
    formula of the gradient decides: ``(g(x + h v) - g(x - h v)) / 2h`` for a scalar f (its
    gradient shaped as its inputs), with ``h = eps^(1/3)`` of the input's scale, against
    ``H v`` read from each route's blocks (``v^T H``: a Hessian of a scalar is symmetric),
    at a tolerance of ``eps^(1/4)`` of the larger scale. Forward over reverse is kept only
    where the quotient agrees with it and not with reverse over reverse; nothing is decided
    where f draws random numbers (the quotient's calls would draw others: the generators
    are put back), where the gradient cannot be had, or for complex or non-finite points."""
    leaves = outer.leaves
    if any(x.is_complex() or not x.dtype.is_floating_point for x in leaves) or not all(
            bool(torch.isfinite(x).all()) for x in leaves):
        return False
    gen = torch.Generator().manual_seed(1)
    vs = [cotangent(x, gen) for x in leaves]
    eps = max(torch.finfo(x.dtype).eps for x in leaves)
    size = max([float(x.detach().abs().max()) for x in leaves if x.numel()] + [1.0])
    h = eps ** (1 / 3) * size
    draws = SameDraws(lambda: own_generators(SimpleNamespace(f=f, primals=outer.primals)),
                      host=True)
    draws()  # (the generators' states, kept)
    try:
        with torch.no_grad():
            sides = []
            for sign in (1.0, -1.0):
                g = outer.g(*[(x.detach() + sign * h * v).to(x.dtype)
                              for x, v in zip(leaves, vs)])
                sides.append(tree_flatten(g)[0])
        drew = _drew(draws)
    except Exception as err:  # noqa: BLE001 - no quotient: nothing decided
        if passes_through(err):
            raise
        return False
    finally:
        draws()  # (put back)
    plus, minus = sides
    if drew or len(plus) != len(leaves) or not all(
            isinstance(a, Tensor) and a.shape == x.shape for a, x in zip(plus, leaves)):
        return False  # (a scalar f only: its gradient is shaped as its inputs)
    quotient = [((a - b) / (2 * h)).detach() for a, b in zip(plus, minus)]
    got = (plus, vs, quotient)
    fwd_gap, fwd_scale = reverse_gap(outer, res, None, got)
    rev_gap, rev_scale = reverse_gap(outer, rev, None, got)
    rtol = eps ** 0.25
    scale = max(fwd_scale, rev_scale)
    return fwd_gap <= rtol * scale < rev_gap


def _loop_instead(outer: Problem, res: Blocks, outer_blocks: Callable[..., Blocks],
                  rtol: float) -> Blocks | None:
    """The Hessian computed reverse over reverse in a loop without torch.vmap, where it is
    symmetric and differs from the vectorised ``res``; None otherwise.

    NOTE [vectorised, outvoted]
    Both vectorised routes run the gradient under torch.vmap (NOTE [the gradient inside a
    Hessian]) and the outer products under it too, so a wrong batching rule in f's second
    derivatives makes both wrong alike, and asymmetric: a GPT-2 loss of two layers, with
    ``h.1.ln_1.weight`` and ``h.0.attn.c_attn.bias`` selected, came back from both (and from
    torch.func.hessian) with a cross block off by 1.2e-4 at a scale of 4.4e-3, its transpose
    right; the loop, symmetric, agreed with a difference quotient of the gradient. Where the
    vectorised Hessian is asymmetric and the routes agree, the loop is computed once (the
    vectorised strategies are not tried again: the rest of the call runs without vmap) and
    returned where it is symmetric. (That GPT-2 case is layer_norm's backward with a weight,
    which the gradient now reads off f's graph and computes right before any check: NOTE [a
    single product batched wrongly] in :mod:`torch_vjp._engine.hessian`; this stays for
    operators not known there.)"""
    try:
        looped = outer_blocks("rev", True)
    except Exception as err:  # noqa: BLE001 - no loop: the vectorised Hessian stands
        if passes_through(err):
            raise
        return None
    diff, scale = asymmetry(looped.blocks, outer.leaves)
    if not diff <= rtol * scale:
        return None
    if float(largest_difference(res.blocks, looped.blocks)) <= rtol * scale:
        return None
    return looped


def _say_asymmetric(f: Callable[..., Any], outer: Problem, diff: float, scale: float,
                    route: str, call: str) -> None:
    """A one-time warning that the Hessian "auto" returns is not symmetric (NOTE [an
    asymmetric Hessian, said]), unless its asymmetry is rounding of a Hessian that is zero.

    NOTE [an asymmetric Hessian, said]
    A Hessian that both routes compute asymmetric, or that reverse over reverse alone
    computes so, is no wrong forward-mode formula: f is not twice differentiable at the
    point (a kink, where mixed partial derivatives may differ), or autograd differentiates
    f's gradient wrongly: a custom autograd.Function whose backward detaches a saved tensor
    or runs under torch.no_grad drops those terms, and both routes differentiate that same
    backward. torch.func.hessian and torch.autograd.functional.hessian return it silently;
    "auto" returns it too (there is no other route to take), and says so once per
    function."""
    if diff <= tolerance(_least_precise(outer)) * _gradient_scale(outer):
        return  # (rounding of a Hessian that is zero: as in forward_over_reverse_checked)
    warn_once(
        ("asymmetric hessian", function_key(f)),
        f"{call}: the Hessian of {function_name(f)} is not symmetric (entries that must be "
        f"equal differ by up to {diff:.3g}, at a scale of {scale:.3g}), computed by "
        f"{route}: either f is not twice differentiable at this point, or autograd "
        f"differentiates f's gradient wrongly, as where a custom torch.autograd.Function's "
        f"backward detaches a saved tensor or runs under torch.no_grad (its Hessian then "
        f"lacks those terms). strategy='auto' returned the Hessian as computed.\n"
        f"  Fix: write the backward of each custom autograd.Function with differentiable "
        f"torch operations of its saved tensors, not detached (torch.autograd.gradgradcheck "
        f"checks it). This warning is shown once per function.",
        JacobianWarning,
    )


def _reverse_agrees(f: Callable[..., Any], outer: Problem, res: Blocks) -> bool | None:
    """Whether one reverse-over-reverse product ``u^T H`` (random ``u``, one more gradient
    of f and its backward) agrees with the forward-over-reverse Hessian ``res`` (NOTE
    [forward over reverse, checked]): a wrong forward-mode formula that keeps the Hessian
    symmetric (``torch.scatter_reduce(..., reduce='prod')``'s, whose Hessian of a sum of
    products is symmetric and wrong) disagrees there. None where there is no such product
    to compare (plain autograd cannot run the gradient's backward, a complex tensor, a
    point holding a NaN), and where f draws random numbers (a dropout: the product's call
    of f draws anew, and would compare another function; the generators are put back where
    the Hessian's products left them, :func:`_drew`): the forward-over-reverse Hessian
    stands, and a later call compares."""
    draws = SameDraws(lambda: own_generators(SimpleNamespace(f=f, primals=outer.primals)),
                      host=True)
    draws()  # (the generators' states, kept)
    try:
        got = one_reverse_product(outer)
        drew = _drew(draws)
    finally:
        draws()  # (put back)
    if got is None or drew:
        return None
    diff, scale = reverse_gap(outer, res, None, got)
    if math.isnan(diff):
        return False
    if diff <= tolerance(outer.leaves[0].dtype) * scale:
        return True
    rtol = tolerance(_least_precise(outer))  # (a float32 step: as below)
    # (a Hessian that is zero comes back as rounding: as below)
    return diff <= rtol * scale or diff <= rtol * _gradient_scale(outer)


def _drew(draws: SameDraws) -> bool:
    """Whether a generator ``draws`` kept (the global ones, f's own, Python's and NumPy's)
    moved since it kept their states."""
    if not torch.equal(torch.get_rng_state(), draws.cpu):
        return True
    if draws.cuda is not None and any(not torch.equal(a, b) for a, b in
                                      zip(torch.cuda.get_rng_state_all(), draws.cuda)):
        return True
    if any(not torch.equal(g.get_state(), state)
           for g, state in zip(draws.own, draws.own_states)):
        return True
    for module, state in draws.host or ():
        if module is random:
            if random.getstate() != state:
                return True
        else:
            now = module.get_state()
            if now[0] != state[0] or not (now[1] == state[1]).all() or now[2:] != state[2:]:
                return True
    return False


def _least_precise(outer: Problem) -> torch.dtype:
    """The least precise floating dtype f's gradient computes in (from the graph of one
    more gradient, taken with inputs that require grad); the inputs' where it cannot be
    had."""
    try:
        with torch.enable_grad():
            xs = [x.detach().requires_grad_(True) for x in outer.leaves]
            grads = [g for g in tree_flatten(outer.g(*[x.clone() for x in xs]))[0]
                     if isinstance(g, Tensor)]
    except Exception as err:  # noqa: BLE001 - no graph: the inputs' dtype
        if passes_through(err):
            raise
        return outer.leaves[0].dtype
    return least_precise(grads, outer.leaves)


def _gradient_scale(outer: Problem) -> float:
    """The scale rounding in a Hessian takes at this point: the largest gradient entry over
    the largest input entry (at least 1), from one more gradient; 0 where it cannot be
    had. A Hessian of a function scaled by ``s`` has its rounding scaled by ``s`` too, so a
    wrong formula at a small scale is still seen."""
    try:
        grads = [g for g in tree_flatten(outer.g(*outer.leaves))[0]
                 if isinstance(g, Tensor) and g.numel()]
    except Exception as err:  # noqa: BLE001 - no scale: the floor is 0
        if passes_through(err):
            raise
        return 0.0
    if not grads:
        return 0.0
    g = max(float(t.detach().abs().max()) for t in grads)
    x = max([float(t.detach().abs().max()) for t in outer.leaves if t.numel()] + [1.0])
    return g / x if math.isfinite(g) else 0.0
