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
vmap (for "auto"'s check, on one more call of f). With a process group, each step is
agreed between the ranks (an ``agree`` hook, NOTE [a reverse product checked forward, on
every rank alike] in :mod:`torch_vjp._engine.revcheck`): a rank whose products did not scale
exactly stopped the measure alone, while the others called f's backward nine times more,
and a backward that ran a collective waited for ever; every rank now stops where one does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

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
    agree: Agree | None = None,
    stops: Callable[[BaseException], bool] | None = None,
) -> float:
    """``max |p(a) + p(b) - p(a + b)|`` over ``probes`` pairs of cotangents ``a``, ``b`` from
    ``draw`` (one per output), for ``p = product`` (one result per input, None: zeros): the
    rounding of the products (NOTE [the scale of what is compared]). Entries that are not
    finite in all three are left out; 0.0 where none is left, and where ``p`` does not scale
    exactly with its cotangent (it is not linear: what differs is not rounding).
    ``agree(flag, err)``: with a process group, whether ``flag`` holds on some rank, raising
    on every rank where some rank's ``err`` is not None (NOTE [a reverse product checked
    forward, on every rank alike] in :mod:`torch_vjp._engine.revcheck`): every rank stops
    where some rank's products do not scale exactly, or failed, so every rank calls
    ``product`` as many times (a backward that runs a collective pairs its calls).
    ``stops(err)``: the errors raised (on every rank); any other makes the result 0.0. None:
    one process, every error raised.

    Example:
        >>> linearity_noise(lambda us: [2 * us[0]], lambda: [torch.ones(2)])
        0.0
    """
    step = _Steps(agree, stops)
    first = step(lambda: _first(product, list(draw())))
    if first is None:
        return 0.0
    a, pa = first
    if not _homogeneous(product, a, pa, agree, stops):
        return 0.0  # (not rounding: a backward that is not linear in its cotangent)
    noise = 0.0
    for _ in range(probes):
        pair = step(lambda: _pair(product, draw, a))
        if pair is None:
            return 0.0
        b, pb, pab = pair
        with torch.no_grad():
            for ga, gb, gab in zip(pa, pb, pab):
                if ga is None or gb is None or gab is None or ga.numel() == 0:
                    continue  # (None where an input is not reached: zero in all three)
                ga, gb, gab = (g.detach().double().reshape(-1) for g in (ga, gb, gab))
                diff = (ga + gb - gab).abs()
                diff = torch.where(diff.isfinite(), diff, 0.0)
                noise = max(noise, float(diff.amax()))
        a, pa = b, pb
    return noise


#: ``agree(flag, err)`` (:data:`torch_vjp._engine.revcheck.Agree`).
Agree = Callable[[bool, BaseException | None], bool]


class _Steps:
    """Runs one step of :func:`linearity_noise` (None: it failed, or found nothing to
    measure), every rank alike through ``agree`` (None: one process, errors raised)."""

    def __init__(self, agree: Agree | None, stops: Callable[[BaseException], bool] | None
                 ) -> None:
        self.agree, self.stops = agree, stops

    def __call__(self, run: Callable[[], T | None]) -> T | None:
        if self.agree is None:
            return run()
        got, stop = None, None
        try:
            got = run()
        except Exception as err:  # noqa: BLE001 - every rank hears of it before raising
            got = None
            if self.stops is None or self.stops(err):
                stop = err
        if self.agree(got is None, stop):
            return None
        return got


T = TypeVar("T")


def _first(product: Callable[[Sequence[Tensor]], Sequence[Tensor | None]],
           a: list[Tensor]) -> tuple[list[Tensor], Sequence[Tensor | None]]:
    return a, product(a)


def _pair(product: Callable[[Sequence[Tensor]], Sequence[Tensor | None]],
          draw: Callable[[], Sequence[Tensor]], a: Sequence[Tensor]
          ) -> tuple[list[Tensor], Sequence[Tensor | None], Sequence[Tensor | None]]:
    b = list(draw())
    with torch.no_grad():
        return b, product(b), product([x + y for x, y in zip(a, b)])


def _homogeneous(product: Callable[[Sequence[Tensor]], Sequence[Tensor | None]],
                 a: Sequence[Tensor], pa: Sequence[Tensor | None] | None = None,
                 agree: Agree | None = None,
                 stops: Callable[[BaseException], bool] | None = None) -> bool:
    """Whether ``p(2 a) == 2 p(a)`` and ``p(-a) == -p(a)`` exactly: so for products linear in
    the cotangent, whose every step scales exactly by 2 and by -1 (NOTE [the scale of what is
    compared]); not for a backward that clips, or adds to, its gradient. ``pa``: ``p(a)``,
    where computed (None: computed here); ``agree``, ``stops``: as for
    :func:`linearity_noise` (with a process group, False on every rank where so on some,
    each product called on every rank or none)."""
    step = _Steps(agree, stops)
    if pa is None:
        pa = step(lambda: product(a))
        if pa is None:
            return False
    for c in (2.0, -1.0):
        if not step(lambda: _scales(product, a, pa, c) or None):
            return False
    return True


def _scales(product: Callable[[Sequence[Tensor]], Sequence[Tensor | None]],
            a: Sequence[Tensor], pa: Sequence[Tensor | None], c: float) -> bool:
    """Whether ``p(c a) == c p(a)`` exactly (:func:`_homogeneous`)."""
    with torch.no_grad():
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


def reverse_noise(prob: Any, agree: Agree | None = None) -> float:
    """:func:`linearity_noise` of ``prob``'s reverse products (products without vmap, on
    one more call of f, from the primals ``prob`` holds), with cotangents drawn in float64
    from a generator of its own; 0.0 where plain autograd cannot compute them. ``agree``:
    with a process group, 0.0 on every rank where that is so on some, and an error no
    check may hide raised on every rank (:func:`linearity_noise`); None: one process."""
    from torch_vjp._engine.fwdcheck import cotangent  # (which imports this module)

    gen = torch.Generator().manual_seed(1)
    step = _Steps(agree, passes_through)

    def call() -> tuple[list[Tensor], list[Tensor]] | None:
        prob.reset_primals()
        xs = [x.detach().requires_grad_(True) for x in prob.leaves]
        res_f = prob.g(*[x.clone() for x in xs])
        out = res_f[0] if prob.has_aux else res_f
        flat, _ = tree_flatten(out)
        live = [o for o in flat if isinstance(o, Tensor) and o.requires_grad]
        return (xs, live) if live else None

    try:
        with torch.enable_grad():
            called = step(call)
            if called is None:
                return 0.0
            xs, live = called

            def product(us: Sequence[Tensor]) -> Sequence[Tensor | None]:
                return torch.autograd.grad(live, xs, list(us), retain_graph=True,
                                           allow_unused=True)

            return linearity_noise(product, lambda: [cotangent(o, gen) for o in live],
                                   agree=agree, stops=passes_through)
    except Exception as err:  # noqa: BLE001 - what plain autograd cannot run measures nothing
        if passes_through(err) or agree is not None:  # (with agree: raised on every rank)
            raise
        return 0.0
