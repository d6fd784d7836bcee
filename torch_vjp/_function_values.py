"""The numbers of check_function's value test: random probes, inner products and norms in
float64, the dtype the values are checked in (:func:`value_dtype`, :func:`widen`), the
narrower grid a forward may compute in (:func:`output_grid`), and non-finite values."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["GRIDS", "NORM_SHARE", "balanced", "inner", "non_finite", "norm", "output_grid",
           "paired_norm", "randn_like", "real_dtype", "spread", "value_dtype", "where_text",
           "widen"]

# NOTE [the dot-product test]
# Each probe compares <c, J t> (finite differences along a random t, against a random
# cotangent c) with <t, J^T c> (the backward's gradient g for c). Both are sums of n random-
# signed terms, so their natural scale is sqrt(sum |term|^2), not |c| |J t| (sqrt(n) times
# larger for n terms of one size): the tolerance is rtol times that scale, plus the
# rounding the finite differences carry, 10 unit/(2 eps) times the same scale of c against
# |f(x + eps t)| + |f(x - eps t)|. A floor of NORM_SHARE of the product of the norms keeps
# a probe whose terms are all small by chance from a false alarm.
# A probe's cotangent is weighted output by output (:func:`balanced`) so that each output's
# share of <c, J t> is of one size: outputs 1e7 apart in scale (1e4 sin(a) b beside
# 1e-3 tanh(a + b)) left the small one's share below the large one's tolerance, and a
# gradient 3% wrong there passed; the floor's product of norms is taken output by output
# (:func:`paired_norm`) for the same reason.


#: The floor of a probe's scale, as a share of the product of the norms (NOTE [the
#: dot-product test]).
NORM_SHARE = 1e-3

#: Narrower dtypes a forward may compute in inside, coarsest first.
GRIDS = (torch.bfloat16, torch.float16, torch.float32)


def output_grid(outputs: Sequence[Any]) -> torch.dtype | None:
    """The coarsest dtype narrower than the outputs' on whose grid every output value lies,
    or None: a forward that computes in float32 inside returns float64 values that float32
    holds exactly, and carries float32's rounding. Integer values lie on every grid and
    say nothing; without other values, None."""
    values = []
    for o in outputs:
        if isinstance(o, Tensor) and o.is_floating_point() and o.numel():
            v = o.detach().reshape(-1)
            v = v[torch.isfinite(v) & (v != v.round())]
            if v.numel():
                values.append(v)
    if not values:
        return None
    for d in GRIDS:
        unit = torch.finfo(d).eps
        narrower = [v for v in values if torch.finfo(v.dtype).eps < unit]
        if len(narrower) == len(values) and all(
            torch.equal(v.to(d).to(v.dtype), v) for v in values
        ):
            return d
    return None


def randn_like(t: Tensor, gen: torch.Generator) -> Tensor:
    dtype = t.dtype if (t.is_floating_point() or t.is_complex()) else torch.float64
    wide = torch.complex128 if dtype.is_complex else torch.float64
    return torch.randn(tuple(t.shape), generator=gen, dtype=wide).to(device=t.device, dtype=dtype)


def non_finite(a: Any) -> tuple[int, int, tuple[int, ...], str] | None:
    """For a strided floating-point or complex tensor holding NaN or inf: how many such
    elements, of how many, the index of the first and its value; else ``None``."""
    if not (isinstance(a, Tensor) and (a.is_floating_point() or a.is_complex())
            and a.layout == torch.strided and a.device.type != "meta"):
        return None
    bad = ~torch.isfinite(a.detach())
    count = int(bad.sum())
    if not count:
        return None
    first = int(bad.reshape(-1).nonzero()[0, 0])
    index = tuple(int(d) for d in torch.unravel_index(torch.tensor(first), a.shape))
    value = a.detach().reshape(-1)[first].item()
    return count, a.numel(), index, str(value)


def where_text(where: tuple[int, int, tuple[int, ...], str]) -> str:
    """``"2 of 12 elements are NaN or inf; the first, at index (1, 2), is nan"``."""
    count, total, index, value = where
    if total == 1:
        return f"its one element is {value}"
    return (f"{count} of {total} elements {'is' if count == 1 else 'are'} NaN or inf; the "
            f"first, at index {index}, is {value}")


def widen(a: Any) -> Any:
    if isinstance(a, Tensor):
        if a.is_complex() and a.dtype != torch.complex128:
            return a.detach().to(torch.complex128)
        if a.is_floating_point() and a.dtype != torch.float64:
            return a.detach().to(torch.float64)
    return a


def value_dtype(inputs: Sequence[Any], diff: list[int]) -> torch.dtype:
    """The least precise dtype among the differentiated inputs."""
    return max((inputs[i].dtype for i in diff), key=lambda d: -torch.finfo(real_dtype(d)).eps)


def real_dtype(dtype: torch.dtype) -> torch.dtype:
    return {torch.complex32: torch.float16, torch.complex64: torch.float32,
            torch.complex128: torch.float64}.get(dtype, dtype)


def inner(a: Tensor, b: Tensor) -> float:
    """Real inner product; for complex tensors Re(sum(conj(a) b)), which matches torch's
    convention for complex gradients."""
    a, b = a.detach(), b.detach()
    if a.is_complex() or b.is_complex():
        return float((a.to(torch.complex128).conj() * b.to(torch.complex128)).real.sum())
    return float((a.to(torch.float64) * b.to(torch.float64)).sum())


def spread(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    """``sqrt(sum |a_k b_k|^2)`` over the elements of pairs of tensors: the scale of the
    inner product ``<a, b>`` when the signs of its terms are random (a random probe's),
    ``sqrt(n)`` times smaller than ``|a| |b|`` for ``n`` terms of one size, so that a wrong
    element among ``n`` is not lost in the product of the norms."""
    total = 0.0
    for x, y in zip(a, b):
        x64 = x.detach().abs().to(torch.float64)
        y64 = y.detach().abs().to(torch.float64)
        total += float((x64 * y64).pow(2).sum())
    return math.sqrt(total)


def norm(tensors: Sequence[Tensor]) -> float:
    return math.sqrt(sum(float(t.detach().abs().to(torch.float64).pow(2).sum()) for t in tensors))


def balanced(cots: list[Tensor], sides: list[tuple[list[Tensor], list[Tensor]]],
             unit: float) -> list[Tensor]:
    """A probe's cotangents with each output's scaled so that its share of ``<J t, c>`` is
    of one size with the others' (NOTE [the dot-product test]): ``sides`` are forward's
    outputs at ``x + eps t`` and ``x - eps t`` for each input. An output's weight stays
    below what would let its rounding (``unit`` of its values) reach the larger ones'
    tolerance, and an output that no input moves keeps its own."""
    scale, level = [0.0] * len(cots), [0.0] * len(cots)
    for plus, minus in sides:
        for k, (a, b) in enumerate(zip(plus, minus)):
            a, b = a.detach().to(torch.complex128 if a.is_complex() else torch.float64), b
            scale[k] += float((a - b).abs().pow(2).sum())
            level[k] += float((a.abs() + b.abs()).pow(2).sum())
    scale, level = [math.sqrt(v) for v in scale], [math.sqrt(v) for v in level]
    top = max(scale, default=0.0)
    if not math.isfinite(top) or top == 0.0:
        return cots
    weights = [1.0 if s == 0.0 or not math.isfinite(lv) else
               max(1.0, min(top / s, 1e-7 * top / (unit * lv) if lv > 0 else top / s))
               for s, lv in zip(scale, level)]
    return [c * w if w != 1.0 else c for c, w in zip(cots, weights)]


def paired_norm(cots: Sequence[Tensor], jt: Sequence[Tensor]) -> float:
    """``sqrt(sum_k (|c_k| |jt_k|)^2)``: the product of the norms output by output, so that
    a cotangent weighted up on a small output (:func:`balanced`) is not multiplied by a
    large output's differences."""
    return math.sqrt(sum((norm([c]) * norm([j])) ** 2 for c, j in zip(cots, jt)))
