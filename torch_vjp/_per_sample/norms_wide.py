"""Per-example norms whose squares leave the parameters' dtype: NOTE [norms past the square].

NOTE [norms past the square]
A float32 gradient can be finite with a norm its dtype holds (up to 3.4e38) while its
squared norm does not (above 1.8e19): ``vector_norm`` itself sums the squares in float32
and returns inf, and a squared norm kept in float32 is inf. An example's norm came out inf,
its clip factor ``max_norm / inf`` 0, and the clipped step dropped it from the sum without a
word. (float16 squares leave their range at a norm of 256, bfloat16's with float32's.)

So the per-example squared norms, the total across parameters and the clip factors are
kept in float64 (:func:`wide_dtype`: a vector of B numbers), and every norm of a tensor
is taken by :func:`row_norms`, which takes the plain norm and, for all rows at once (no
value is read back to the host, no branch on one), the norm of the rows scaled by
``2**-80`` times ``2**80``, keeping the second where the first is inf: exact powers of two,
so nothing rounds but the norm itself, and a row with no overflow keeps its plain norm
bit for bit. A gradient that is itself inf keeps norm inf (clip factor 0), one with a NaN
keeps norm NaN, as before. Where the device has no float64 (MPS) the squared norms stay in
float32, as before.

NOTE [one check on the CPU]
That costs a plain call some per cent (on the MLP and the CNN of bench_per_sample.py: a
second norm or a float64 copy of every gradient, the sums in float64). Where reading a
number back costs no device sync (a CPU tensor, run eagerly: not under the user's
torch.compile, export, vmap or another transform of torch.func), the squared norms, their
total and the clip factors of a float32 model are taken as before in float32, inside
:func:`narrow_norms`, and the total's sum read once: an overflow anywhere (a row's squares,
a product of two norms, a ghost norm's products, the total across parameters) leaves an
inf or a NaN there, no operation taken turns either back into a number, and the sum of
B finite totals is finite but where it passes float32's range (a false alarm: the float64
norms, as right). Only then are the rules' norms taken again, as above, sync-free, in
float64; a gradient with an inf or a NaN gets the same norm either way. Elsewhere (CUDA,
MPS, under a trace or a transform, compile=True's program) the norms are taken as above at
once, and so are those of the parameters the vmap or the loop computes (a chunk of examples
at a time, their clipped sums taken with it: a second pass would run the model again).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import Tensor

from torch_vjp._engine.compile_key import tracing

__all__ = ["wide_dtype", "row_norms", "wide_sq_rows", "wide_sq_norms", "total_sq",
           "clip_factors", "Narrowed", "SMALL", "narrow_norms",
           "checks_once", "overflowed"]

_DOWN = 2.0 ** -80
_UP = 2.0 ** 80
#: Elements up to which a float32 tensor's norms are taken in float64 at once.
SMALL = 1 << 16

_STATE = threading.local()


class narrow_norms:  # noqa: N801 - used as a function of contextlib would be
    """Within it, in this thread, the functions here take the norms in the gradients' own
    dtype, as before (NOTE [one check on the CPU]): the caller reads the total once. (A
    class rather than a generator of contextlib: entered on every call of the norms, where
    the generator's frame cost a few microseconds more.)"""

    __slots__ = ("before",)

    def __enter__(self) -> None:
        self.before = getattr(_STATE, "narrow", False)
        _STATE.narrow = True

    def __exit__(self, *exc: object) -> None:
        _STATE.narrow = self.before


def checks_once(like: Tensor) -> bool:
    """Whether the norms of a model of ``like``'s dtype are taken in :func:`narrow_norms`,
    then checked with :func:`overflowed` (NOTE [one check on the CPU]): float32 on the CPU,
    run eagerly (a number read back there costs no sync; under a trace or a transform of
    torch.func it cannot be read)."""
    return (like.dtype == torch.float32 and like.device.type == "cpu"
            and type(like) in (Tensor, torch.nn.Parameter) and not FORCE_SYNC_FREE
            and not torch._C._are_functorch_transforms_active() and not tracing())


#: Set (by the tests) to take every norm sync-free, as on a device.
FORCE_SYNC_FREE = False


def overflowed(total: Tensor) -> bool:
    """Whether the ``(B,)`` total squared norms taken in :func:`narrow_norms` may hold an
    overflow (an inf or a NaN anywhere): one number read back."""
    return type(total) is not Tensor or not math.isfinite(total.sum().item())


def _narrow() -> bool:
    # (a trace never reads the flag: dynamo folds is_compiling() to True, and takes the
    # sync-free norms)
    return not torch.compiler.is_compiling() and getattr(_STATE, "narrow", False)


def wide_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the per-example squared norms of gradients of ``dtype``: float64 where
    the device has it, else ``dtype``'s real dtype (NOTE [norms past the square])."""
    if dtype.is_complex:
        dtype = dtype.to_real()
    if (dtype == torch.float64 or not dtype.is_floating_point or device.type == "mps"
            or _narrow()):
        return dtype
    return torch.float64


def row_norms(v: Tensor) -> Tensor:
    """L2 norm of each ``v[i]``, in float32 at least (float64 for a small ``v`` of a lower
    precision than float64), without overflowing where the squares would (NOTE [norms past
    the square]). In :func:`narrow_norms`, the plain norm in ``v``'s dtype."""
    dim = tuple(range(1, v.dim()))
    if v.dtype == torch.float64 or v.dtype == torch.complex128 or _narrow():
        return torch.linalg.vector_norm(v, dim=dim)
    if v.dtype == torch.float16:  # (float32 holds float16's squares)
        return torch.linalg.vector_norm(v, dim=dim, dtype=torch.float32)
    if v.numel() <= SMALL and v.device.type != "mps":
        # (one call: the copy costs less than the calls that find the rows to scale)
        wide = torch.complex128 if v.is_complex() else torch.float64
        return torch.linalg.vector_norm(v, dim=dim, dtype=wide)
    at = torch.float32 if v.dtype == torch.bfloat16 else None
    n = torch.linalg.vector_norm(v, dim=dim, dtype=at)
    # each row scaled by 1 but those whose norm overflowed, by 2**-80 (scaling them all made
    # the squares of ordinary gradients subnormal, which the CPU takes many times longer on);
    # the rows scaled by 1 get the same norm again, bit for bit
    w = torch.where(n.isinf(), _DOWN, 1.0)
    far = torch.linalg.vector_norm(v * w.to(v.dtype).view(-1, *(1,) * len(dim)), dim=dim,
                                   dtype=at)
    return far.div_(w)


def wide_sq_rows(v: Tensor) -> Tensor:
    """Squared L2 norm of each row of ``v`` viewed as ``(B, -1)``, in :func:`wide_dtype`."""
    rows = v if v.dim() == 2 else v.reshape(v.shape[0], -1)
    if getattr(_STATE, "narrow", False) and not torch.compiler.is_compiling():
        # (what row_norms and wide_dtype give in narrow_norms, where this is called the
        # most: the plain norm in v's dtype, squared; asked once, a few microseconds fewer
        # a call of every factor's norms)
        return torch.linalg.vector_norm(rows, dim=1).square_()
    return wide_sq_norms(rows)


def wide_sq_norms(v: Tensor) -> Tensor:
    """Squared L2 norm of each ``v[i]`` (over all its dimensions, read in place), in
    :func:`wide_dtype`."""
    if getattr(_STATE, "narrow", False) and not torch.compiler.is_compiling():
        return torch.linalg.vector_norm(v, dim=tuple(range(1, v.dim()))).square_()
    n = row_norms(v)
    return n.to(wide_dtype(n.dtype, n.device)).square_()


def total_sq(values: Iterable[Tensor], like: Tensor, batch: int) -> Tensor:
    """The sum of the parameters' squared norms, in a new tensor of :func:`wide_dtype` (in
    float64 no sum of float32 squares overflows)."""
    vs = list(values)
    wide = wide_dtype(like.dtype, like.device)
    if not vs or any(v.dtype != wide for v in vs):
        total = like.new_zeros(batch, dtype=wide)
        for v in vs:
            total.add_(v)
        return total
    if len(vs) == 1:
        return vs[0].clone()
    total = torch.add(vs[0], vs[1])
    for v in vs[2:]:
        total.add_(v)
    return total


def clip_factors(sq: Tensor, max_norm: float | Tensor, dtype: torch.dtype | None = None
                 ) -> Tensor:
    """``min(1, max_norm / ||g_i||)`` from the squared norms, 1 for a zero gradient, 0 for
    an inf one, NaN for one with a NaN (``max_norm`` a 0-d tensor in a compiled program).
    With ``dtype``, the parameters' (squared norms of :func:`wide_dtype`), in it or float32
    if it is narrower: the dtype the factors' sums read them in."""
    c = sq.rsqrt().mul_(max_norm).clamp_(max=1.0)
    if dtype is None:
        return c
    want = torch.promote_types(dtype, torch.float32)
    return c if c.dtype == want else c.to(want)


class Narrowed(Mapping[str, Tensor]):
    """Squared norms of :func:`wide_dtype` read in ``dtype`` (inf where they overflow it),
    each on reading: what the check against the per-example loop compares with the loop's
    own, taken in the parameters' dtype."""

    __slots__ = ("wide", "dtype")

    def __init__(self, wide: dict[str, Tensor], dtype: torch.dtype) -> None:
        self.wide, self.dtype = wide, dtype

    def __getitem__(self, name: str) -> Tensor:
        return self.wide[name].to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.wide)

    def __len__(self) -> int:
        return len(self.wide)
