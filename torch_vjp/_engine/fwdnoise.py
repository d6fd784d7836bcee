"""The rounding of reverse products, measured: the scale the checks of
:mod:`torch_vjp._engine.fwdcheck` compare routes at, where the products are small beside the
numbers they were computed from.

NOTE [the scale of what is compared]
A route is taken to agree with the reverse product where they differ by at most
``sqrt(eps)`` of their scale. Their largest entry is that scale where the products are of the
size of the numbers the backward formulas combine, as for most functions. Where those
numbers cancel, it is not: the rounding of each is ``eps`` of *its* size, and the products,
far smaller, hold that rounding whole. A softmax near one-hot in bfloat16 (``s * (u - (u *
s).sum())``, with ``s`` rounded to 1 at its peak), or a cross product whose cotangent is
parallel to an input (``cross(u, a) ~ 0``, or the gradient of ``x . (x x a)``, zero up to
rounding), gave products of a thousandth (or ``1e-16``) of the numbers summed: two correct
routes differed by their rounding, "by up to 4.4e-16, at a scale of 4.4e-16", and "auto" or
batched vjp warned that no route agreed (or that a batching rule was wrong), and remembered
the loop. The products alone cannot show the size of what they were computed from; their
linearity can: ``J^T a + J^T b - J^T (a + b)`` is zero but for rounding, which is ``eps`` of
the size of the numbers the backward formulas combined, at this point, in the dtype they
computed in. So where a route disagrees at the products' own scale, the checks measure that
rounding (:func:`linearity_noise`, a few pairs of random cotangents through products without
vmap) and compare at ``noise / eps`` where that is larger (:func:`rounding_scale`). A wrong
formula (a relative error near 1, as torch.cdist's batching rule) still disagrees: the scale
grows only where the products' rounding is itself a fraction ``sqrt(eps)`` of them or more,
a point where no route can be told right from wrong. A backward that is not linear in its
cotangent (a hook that clips or adds to the gradient) also breaks ``J^T a + J^T b = J^T (a +
b)``, by far more than rounding; its products are no Jacobian's, and no route should agree.
Rounding is told from that by exact scaling: multiplying by 2 or by -1 is exact in floating
point, and so, step by step, are the products of a backward linear in its cotangent (the same
operations in the same order on numbers scaled exactly): ``p(2 a) == 2 p(a)`` and ``p(-a) ==
-p(a)`` bit for bit. Where either fails, nothing is measured and the check stays at the
products' own scale (as where the graph's sums are not deterministic). Costs: nothing where
the routes agree; where one disagrees, once per check, ``3 + 2 * PROBES`` products without
vmap (for "auto"'s check, on one more call of f).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from torch_vjp._engine.rows import passes_through

__all__ = ["PROBES", "linearity_noise", "reverse_noise", "rounding_scale"]

#: Pairs of random cotangents the rounding is measured with: its size varies from pair to
#: pair (a product with few entries may round exactly in one), the largest is taken.
PROBES = 4


def linearity_noise(
    product: Callable[[Sequence[Tensor]], Sequence[Tensor | None]],
    draw: Callable[[], Sequence[Tensor]],
    probes: int = PROBES,
) -> float:
    """``max |p(a) + p(b) - p(a + b)|`` over ``probes`` pairs of cotangents ``a``, ``b`` from
    ``draw`` (one per output), for ``p = product`` (one result per input, None: zeros): the
    rounding of the products (NOTE [the scale of what is compared]). Entries that are not
    finite in all three are left out; 0.0 where none is left, and where ``p`` does not scale
    exactly with its cotangent (it is not linear: what differs is not rounding).

    Example:
        >>> linearity_noise(lambda us: [2 * us[0]], lambda: [torch.ones(2)])
        0.0
    """
    a = list(draw())
    pa = product(a)
    if not _homogeneous(product, a, pa):
        return 0.0  # (not rounding: a backward that is not linear in its cotangent)
    noise = 0.0
    with torch.no_grad():
        for _ in range(probes):
            b = list(draw())
            pb = product(b)
            pab = product([x + y for x, y in zip(a, b)])
            for ga, gb, gab in zip(pa, pb, pab):
                if ga is None or gb is None or gab is None or ga.numel() == 0:
                    continue  # (None where an input is not reached: zero in all three)
                ga, gb, gab = (g.detach().double().reshape(-1) for g in (ga, gb, gab))
                diff = (ga + gb - gab).abs()
                diff = torch.where(diff.isfinite(), diff, 0.0)
                noise = max(noise, float(diff.amax()))
            a, pa = b, pb
    return noise


def _homogeneous(product: Callable[[Sequence[Tensor]], Sequence[Tensor | None]],
                 a: Sequence[Tensor], pa: Sequence[Tensor | None]) -> bool:
    """Whether ``p(2 a) == 2 p(a)`` and ``p(-a) == -p(a)`` exactly: so for products linear in
    the cotangent, whose every step scales exactly by 2 and by -1 (NOTE [the scale of what is
    compared]); not for a backward that clips, or adds to, its gradient."""
    with torch.no_grad():
        for c in (2.0, -1.0):
            for g, gc in zip(pa, product([c * x for x in a])):
                if (g is None) != (gc is None):
                    return False
                if g is None:
                    continue
                want, got = c * g.detach(), gc.detach()
                if not bool(((want == got) | (want.isnan() & got.isnan())).all()):
                    return False
    return True


def rounding_scale(noise: float, dtype: torch.dtype) -> float:
    """The size of the numbers whose rounding in ``dtype`` is ``noise``: ``noise / eps``.

    Example:
        >>> rounding_scale(2.0 ** -52, torch.float64)
        1.0
    """
    if not math.isfinite(noise):
        return 0.0
    return noise / torch.finfo(dtype).eps


def reverse_noise(prob: Any) -> float:
    """:func:`linearity_noise` of ``prob``'s reverse products (products without vmap, on
    one more call of f, from the primals ``prob`` holds), with cotangents drawn in float64
    from a generator of its own; 0.0 where plain autograd cannot compute them."""
    from torch_vjp._engine.fwdcheck import cotangent  # (which imports this module)

    gen = torch.Generator().manual_seed(1)
    try:
        with torch.enable_grad():
            prob.reset_primals()
            xs = [x.detach().requires_grad_(True) for x in prob.leaves]
            res_f = prob.g(*[x.clone() for x in xs])
            out = res_f[0] if prob.has_aux else res_f
            flat, _ = tree_flatten(out)
            live = [o for o in flat if isinstance(o, Tensor) and o.requires_grad]
            if not live:
                return 0.0

            def product(us: Sequence[Tensor]) -> Sequence[Tensor | None]:
                return torch.autograd.grad(live, xs, list(us), retain_graph=True,
                                           allow_unused=True)

            return linearity_noise(product, lambda: [cotangent(o, gen) for o in live])
    except Exception as err:  # noqa: BLE001 - what plain autograd cannot run measures nothing
        if passes_through(err):
            raise
        return 0.0
