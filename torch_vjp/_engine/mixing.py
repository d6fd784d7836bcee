"""batch_jacobian's test of a batch that mixes its rows (NOTE [a batch that mixes rows]):
where no route of "auto" agrees with a reverse product, reverse products with cotangents
zero outside half of the rows tell a flow across rows from a random or clipped f."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from torch_vjp._engine.fwdcheck import one_reverse_product
from torch_vjp._engine.problem import Problem

__all__ = ["cross_row_flow", "mixing_message"]


# NOTE [a batch that mixes rows]
# batch_jacobian's products take each basis vector for every row of the batch at once, which
# gives row b's own block only where row b of f's output depends on row b of x alone (SPEC
# §3: f maps a batch row by row). Where f mixes the rows (a mean over the batch, BatchNorm
# in training mode), the result is a sum of cross-example blocks, not a Jacobian of f, and
# "auto"'s check (NOTE [auto, checked once]) finds every route off the reverse product of
# the whole batch. Other functions do too: a random f (dropout), and a deterministic
# row-wise f whose backward is not linear in its cotangent (a hook or a custom Function
# that clamps the gradient, as RNNs do), so a failed check alone says nothing about mixing.
# So mixing is tested directly (cross_row_flow): one reverse product whose cotangent is
# random on a random half S of the batch's rows and zero on the others. For a row-wise f,
# the gradient on a row outside S is exactly zero (or NaN, where a derivative is infinite:
# 0 * inf), whatever its backward does with a nonzero cotangent: nothing flows there. A
# finite nonzero value there is a flow across rows; the complement of S is tried too where
# S shows none. A backward that makes something of nothing (one that adds noise to the
# gradient) would show a flow too, so one more product, with a zero cotangent, must give no
# finite nonzero value anywhere before the flow counts. Where it does, a JacobianCallError
# names the rows and the fixes, rather than return a result known to be no Jacobian of f;
# otherwise the first result stands, with the warning of no_route_message. Up to three
# more calls of f, only where no route agrees; nothing is remembered: every call of a
# mixing f raises. The explicit strategies are not checked (the docstring says which sums
# they give).


def _flow_outside(grads: Sequence[Tensor], rows: Tensor | None, batch: int) -> int | None:
    """The first row (outside ``rows``, a boolean mask of the batch; anywhere for None) where
    a gradient of a batched leaf holds a finite nonzero value, or None."""
    for g in grads:
        if g.dim() == 0 or g.shape[0] != batch or g.is_complex():
            continue
        hit = (g != 0) & g.isfinite()
        hit = hit.reshape(batch, -1).any(1)
        if rows is not None:
            hit &= ~rows.to(hit.device)
        found = hit.nonzero()
        if found.numel():
            return int(found[0, 0])
    return None


def cross_row_flow(prob: Problem, batch: int) -> tuple[list[int], int] | None:
    """``(S, j)`` where a reverse product with a cotangent zero outside the rows ``S`` of the
    batch gives a finite nonzero gradient on row ``j`` of x, not in ``S``: f mixes rows
    (NOTE [a batch that mixes rows]); None where no such flow shows."""
    if batch < 2:
        return None
    gen = torch.Generator().manual_seed(1)
    inside = torch.zeros(batch, dtype=torch.bool)
    inside[torch.randperm(batch, generator=gen)[: batch // 2]] = True
    for rows in (inside, ~inside):

        def keep(us: list[Tensor], rows: Tensor = rows) -> list[Tensor]:
            return [torch.where(rows.to(u.device).reshape(-1, *(1,) * (u.dim() - 1)), u,
                                torch.zeros((), dtype=u.dtype, device=u.device))
                    if u.dim() and u.shape[0] == batch else u for u in us]

        got = one_reverse_product(prob, keep, anywhere=True)
        if got is None:
            return None
        j = _flow_outside(got[2], rows, batch)
        if j is None:
            continue
        nothing = one_reverse_product(prob, lambda us: [torch.zeros_like(u) for u in us],
                                      anywhere=True)
        if nothing is None or _flow_outside(nothing[2], None, batch) is not None:
            return None  # (a backward that gives something for nothing: no test)
        return rows.nonzero().flatten().tolist(), j
    return None


def mixing_message(call: str, name: str, diff: float | None, scale: float | None,
                   rows: Sequence[int], j: int) -> str:
    """The error of NOTE [a batch that mixes rows]: a cotangent on ``rows`` alone gave a
    gradient on row ``j`` (``diff``: None where no route was compared, at a NaN point)."""
    compared = ("no route was compared: a NaN or an infinity is in the products here"
                if diff is None else
                f"every route also disagrees with a reverse product of the whole batch, by up "
                f"to {diff:.3g}, at a scale of {scale:.3g}")
    shown = ", ".join(str(r) for r in rows[:5]) + (", ..." if len(rows) > 5 else "")
    return (
        f"{call}: f ({name}) mixes examples of the batch (a mean over the batch, BatchNorm in "
        f"training mode, attention across rows): row b of its output depends on other rows "
        f"of x, so it has no per-example Jacobian, which batch_jacobian computes for a "
        f"function that maps a batch row by row. A reverse product whose cotangent is zero "
        f"outside rows {shown} of f's output gives a nonzero gradient on row {j} of x "
        f"({compared}).\n"
        f"  Fix: torch_vjp.jacobian(f, x) of the whole batch, and take its diagonal blocks "
        f"(J[b, ..., b, ...]) if those are what you want; or make f row-wise (BatchNorm in "
        f"eval mode, or GroupNorm or LayerNorm; no statistic over the batch)."
    )
