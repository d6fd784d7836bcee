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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from torch_vjp._engine.blocks import Blocks
from torch_vjp._engine.fwdcheck import (
    PIECE,
    largest_difference,
    least_precise,
    max_abs_difference,
    tolerance,
)
from torch_vjp._engine.jacobian import function_key, function_name
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.rows import passes_through
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
    if diff <= rtol * scale:  # the common case
        return res
    # (a float32 step inside a float64 f, as the RMSNorm of Llama and T5, rounds every
    # route at float32's: its asymmetry is that rounding, no wrong formula)
    rtol = tolerance(_least_precise(outer))
    if diff <= rtol * scale:
        return res
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
    warn_once(
        ("fwd-over-rev", function_key(f)),
        f"{call}: forward-over-reverse (strategy='auto') gave a Hessian of "
        f"{function_name(f)} that is not symmetric (entries that must be equal differ by "
        f"up to {diff:.3g}, at a scale of {scale:.3g}), and reverse-over-reverse disagrees "
        f"with it (by up to {gap:.3g}): an operator in f has a wrong forward-mode derivative "
        f"of its backward formula (torch.triangular_solve is one). strategy='auto' returned "
        f"the reverse-over-reverse Hessian.\n"
        f"  Pass strategy='rev' to compute it that way directly. This warning is shown once "
        f"per function.",
        JacobianWarning,
    )
    return rev


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
