"""vjp_fn's batched products checked once against products without vmap, at the vjp point
and, where that point has structure, near it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from torch_vjp._engine.fwdcheck import (cotangent, gap, least_of, remember, tolerance)
from torch_vjp._engine.fwdnoise import linearity_noise, rounding_scale
from torch_vjp._engine.rows import passes_through
from torch_vjp._errors import JacobianWarning, warn_once

__all__ = ["checked_batch"]


# NOTE [batched products, checked once]
# vjp_fn(v, batched=True) computes K products under torch.vmap, which runs the batching
# rules of the backward formulas: torch.cdist's is wrong (a relative error near 1), as in
# NOTE [auto, checked once]. So the first batched call for a function and the shapes of its
# primals and outputs also takes one product without vmap, of the cotangents combined with
# random weights ``w`` (from a generator of its own), and compares it with the same
# combination of the K products: by linearity they agree, within rounding (``sqrt(eps)`` of
# their scale, or of the numbers they were computed from where those cancel: NOTE [the
# scale of what is compared] in fwdnoise.py). The user's cotangents alone cannot always tell: all zero (a masked or padded
# step), or K equal rows, and a wrong rule passes. So the route is decided by cotangents of
# the check's own as well: min(K, 4) random ones, vectorised as the call's are (its chunk
# size), and their combination without vmap. Where both agree, the products are returned
# and "rev" remembered (not where the own check's scale is zero, a Jacobian zero at this
# point: it tells nothing, and the next call checks again). Where either disagrees, the K
# products are computed again one at a time; if those agree (on the own cotangents), they
# are returned, with a one-time warning, and later batched calls of that key take the loop
# directly; if they do not (NaNs), the loop's result stands, silently, and later calls stay
# vectorised (as NOTE [jacobian_of, checked once]). Where both agree at a point with
# zeros, repeats or sums of 0, they are compared once more near it (NOTE [batched pullback,
# checked near the point] in nearcheck.py). Costs, once per key: two products
# without vmap and min(K, 4) under it. Not checked: complex values, calls inside an outer
# torch.func transform, chunks of one (already the loop), retain_graph=False (the check's
# products would find the graph freed), and a vmap that fell back to the loop (the own
# cotangents' vmap fails too: the call's loop stands). Batched jvp
# is not checked: forward mode runs f again under vmap with the forward formulas, whose
# known bug (triangular_solve's) is in the formula itself, which the unbatched product
# shares.

#: Cotangents of the check's own (NOTE [batched products, checked once]), at most.
_OWN = 4


def checked_batch(
    call: str, key: Hashable, named: tuple[Hashable, str], vectors: Sequence[Tensor],
    result: Sequence[Tensor], loop: Callable[[], Sequence[Tensor]],
    single: Callable[..., Sequence[Tensor | None]],
    products: Callable[[Sequence[Tensor], bool], Sequence[Tensor]],
    near: Callable[[Sequence[Tensor]], tuple[float, float] | None] | None = None,
) -> Sequence[Tensor]:
    """``result``, K products stacked (one tensor per input of f), of the K-stacked
    ``vectors``, where products without vmap (``single``) agree with them and with the
    vectorised products of random cotangents (``products(vecs, True)``; ``False``: one at
    a time); else ``loop()`` (NOTE [batched products, checked once]). ``key`` is
    remembered: "rev" or "rev-loop". ``near(cots)``: the gap of the products of ``cots``
    under vmap and one at a time near the point, None where not compared (NOTE [batched
    pullback, checked near the point] in :mod:`torch_vjp._engine.nearcheck`), asked where
    the point's check passed."""
    gen = torch.Generator().manual_seed(0)
    noise_gen = torch.Generator().manual_seed(1)  # (NOTE [the scale of what is compared])
    dtype = least_of(r.dtype for r in result)
    rtol = tolerance(dtype)

    def combination(vecs: Sequence[Tensor], g: torch.Generator
                    ) -> tuple[Tensor, list[Tensor]]:
        # (random weights, and the cotangents ``vecs`` combined with them: one per output)
        w = torch.randn(vecs[0].shape[0], generator=g, dtype=torch.float64)
        with torch.no_grad():
            return w, [torch.tensordot(w.to(v.dtype).to(v.device), v, dims=1) for v in vecs]

    def against(vecs: Sequence[Tensor]) -> Callable[[Sequence[Tensor]], tuple[float, float]]:
        # (the gap of K products of ``vecs`` to one product of their random combination,
        # at the scale of the products' rounding where that is larger)
        w, combined = combination(vecs, gen)
        want = single(*combined)
        floor: list[float] = []

        def gap_of(res: Sequence[Tensor]) -> tuple[float, float]:
            diff = scale = 0.0
            with torch.no_grad():
                for r, g in zip(res, want):
                    mine = torch.tensordot(w.to(r.dtype).to(r.device), r.detach(), dims=1)
                    d, s = gap(mine.reshape(-1), (torch.zeros_like(mine) if g is None
                                                  else g.detach().to(mine.dtype)).reshape(-1))
                    if math.isnan(d) or d > diff:  # (a NaN stays: it is a disagreement)
                        diff = d
                    scale = max(scale, s)
            if not diff <= rtol * scale:
                if not floor:
                    floor.append(rounding_scale(linearity_noise(
                        lambda cs: single(*cs), lambda: combination(vecs, noise_gen)[1]), dtype))
                scale = max(scale, floor[0])
            return diff, scale

        return gap_of

    diff, scale = against(vectors)(result)
    own = [cotangent(v[:_OWN], gen) for v in vectors]
    own_gap = against(own)
    if diff <= rtol * scale:
        try:
            diff, scale = own_gap(products(own, True))
        except Exception as err:  # noqa: BLE001 - vmap cannot run f: the call's products
            if passes_through(err):  # came from its loop (run_with_fallback), right
                raise
            remember(key, "rev")
            return result
        if diff <= rtol * scale:  # the common case
            if scale > 0:  # (a zero Jacobian here tells nothing of the route)
                there = near(own) if near is not None else None
                if there is not None and not there[0] <= rtol * there[1]:
                    return _near_loop(call, key, named, loop, *there)
                remember(key, "rev")
            return result
    looped = loop()
    loop_diff, loop_scale = own_gap(products(own, False))
    wrong = loop_diff <= rtol * loop_scale
    remember(key, "rev-loop" if wrong else "rev")
    if wrong:
        warn_once(
            (call, "batched route", named[0]),
            f"{call}: the K products of batched=True (torch.vmap over the pullback) disagree "
            f"with one product without vmap on {named[1]} (by up to {diff:.3g}, at a scale of "
            f"{scale:.3g}): an operator in f's backward has a wrong batching rule "
            f"(torch.cdist's is one). vjp_fn returned the products computed one cotangent at "
            f"a time, and does so for this function and shapes from now on.\n"
            f"  Pass chunk_size=1 to compute them that way directly. This warning is shown "
            f"once per function.",
            JacobianWarning,
        )
    return looped


def _near_loop(call: str, key: Hashable, named: tuple[Hashable, str],
               loop: Callable[[], Sequence[Tensor]], diff: float, scale: float
               ) -> Sequence[Tensor]:
    """The products one at a time, where those under vmap were found wrong near the point
    (NOTE [batched pullback, checked near the point]), remembered, with a one-time
    warning."""
    from torch_vjp._engine.nearcheck import near_batched_message

    looped = loop()
    remember(key, "rev-loop")
    warn_once((call, "batched route", named[0]),
              near_batched_message(call, named[1], diff, scale), JacobianWarning)
    return looped
