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
    [forward over reverse, checked] above."""
    diff, scale = asymmetry(res.blocks, outer.leaves)
    rtol = tolerance(outer.leaves[0].dtype)
    # (a float32 step inside a float64 f, as the RMSNorm of Llama and T5, rounds every
    # route at float32's: its asymmetry is that rounding, no wrong formula)
    symmetric = diff <= rtol * scale or diff <= tolerance(_least_precise(outer)) * scale
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
    if gap <= rtol * scale:
        return res  # asymmetric for real (f is not smooth here): both routes agree
    if gap <= rtol * _gradient_scale(outer):
        # (a Hessian that is zero comes back as rounding, entries of 1e-14 whose scale is
        # their own; the gradient's scale over the input's says what rounding is here)
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
