"""Measuring a computation: time, peak extra memory, error against a reference, and the
tables that show them. Shared by :func:`torch_vjp.compare_strategies` and the benchmark
suite :mod:`torch_vjp.bench`, so that both measure, judge and print alike.
"""

from __future__ import annotations

import math
import numbers
import platform
import statistics
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torch_vjp._errors import JacobianOptionError, a_type, format_bytes, shape_str

__all__ = [
    "RTOL",
    "NOISY_SPREAD",
    "Timing",
    "median_time",
    "block_times",
    "summarize_times",
    "LiveTensorBytes",
    "device_of",
    "measure_peak",
    "memory_method",
    "leaves",
    "max_error",
    "check_result",
    "ENTRY_FLOOR",
    "reason",
    "shorten",
    "format_time",
    "format_spread",
    "noisy_note",
    "format_bytes",
    "format_table",
    "check_min_run_time",
    "check_tolerance",
]


#: Relative tolerance of the correctness check, by the dtype a result is computed in: each
#: entry's error is compared against ``atol + rtol * max(|its reference|, ENTRY_FLOOR *
#: max|reference|)`` (see :func:`check_result`).
RTOL = {
    torch.float16: 1e-2,
    torch.bfloat16: 2e-2,
    torch.float32: 1e-4,
    torch.float64: 1e-7,
    torch.complex64: 1e-4,
    torch.complex128: 1e-7,
}


#: A timing whose interquartile range exceeds this fraction of its median is *noisy*: the
#: machine disturbed it too much for its place in a ranking to be trusted (on an idle
#: machine the IQR of ``blocked_autorange``'s blocks is a few percent of the median).
NOISY_SPREAD = 0.25


def median_time(fn: Callable[[], Any], min_run_time: float) -> float:
    """Median seconds per call of ``fn`` by ``Timer.blocked_autorange``, on torch's current
    number of threads (``Timer`` would otherwise measure on one thread)."""
    return statistics.median(block_times(fn, min_run_time))


def block_times(fn: Callable[[], Any], min_run_time: float, min_blocks: int = 1) -> list[float]:
    """Seconds per call of ``fn`` in each block that ``Timer.blocked_autorange`` timed (a
    block runs ``fn`` as many times as it takes to make the timer's own cost negligible),
    on torch's current number of threads (``Timer`` would otherwise measure on one thread).
    Blocks of the same size are added until there are ``min_blocks`` (a spread needs more
    than one)."""
    from torch.utils.benchmark import Timer

    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    measurement = timer.blocked_autorange(min_run_time=min_run_time)
    times = [float(t) for t in measurement.times]
    while len(times) < min_blocks:
        times += [float(t) for t in timer.timeit(measurement.number_per_run).times]
    return times


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (what results record as the machine),
    else ``platform.processor()``, else ``platform.machine()``.

    Example:
        >>> isinstance(cpu_model(), str)
        True
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class Timing:
    """A time per call with its spread.

    Attributes:
        median: Seconds per call: the median of the samples, or of the rounds' medians
            when the samples came in rounds (see :func:`summarize_times`).
        q1: The samples' first quartile, in seconds.
        q3: Their third quartile.
        samples: How many samples (timed blocks) there were; with one, the spread is
            unknown (``iqr`` is ``None``).
    """

    median: float
    q1: float
    q3: float
    samples: int

    @property
    def iqr(self) -> float | None:
        """The interquartile range ``q3 - q1`` in seconds (``None`` from a single sample)."""
        return self.q3 - self.q1 if self.samples > 1 else None

    @property
    def spread(self) -> float | None:
        """The IQR as a fraction of the median (``None`` when it is unknown)."""
        iqr = self.iqr
        return None if iqr is None or self.median <= 0 else iqr / self.median

    @property
    def noisy(self) -> bool:
        """The IQR exceeds :data:`NOISY_SPREAD` of the median: too wide to rank."""
        return self.spread is not None and self.spread > NOISY_SPREAD


def summarize_times(rounds: Sequence[Sequence[float]]) -> Timing:
    """One :class:`Timing` from the samples of one or more rounds.

    The time is the median of the rounds' medians (robust to one disturbed round, where
    the smallest would keep whichever round was luckiest); the quartiles are those of every
    sample of every round together, so the spread covers both the noise within a round
    and the drift between rounds.

    Example:
        >>> t = summarize_times([[1.0, 1.1, 1.2], [1.0, 1.3, 2.0], [0.9, 1.0, 1.1]])
        >>> t.median, t.q1, t.q3, t.samples, t.noisy
        (1.1, 1.0, 1.2, 9, False)
    """
    pooled = [t for r in rounds for t in r]
    if not pooled:
        raise ValueError("no timing samples")
    middle = statistics.median(statistics.median(r) for r in rounds if r)
    if len(pooled) == 1:
        return Timing(middle, middle, middle, 1)
    q1, _, q3 = statistics.quantiles(pooled, n=4, method="inclusive")
    return Timing(middle, q1, q3, len(pooled))


def format_spread(timing: Timing | None) -> str:
    """The IQR as a percentage of the median: ``'12%'``; ``'-'`` when unknown.

    Example:
        >>> format_spread(Timing(0.01, 0.0095, 0.0107, 20)), format_spread(None)
        ('12%', '-')
    """
    spread = None if timing is None else timing.spread
    return "-" if spread is None else f"{100 * spread:.0f}%"


def noisy_note(timing: Timing) -> str:
    """The words a noisy timing carries in tables: why it cannot be ranked.

    Example:
        >>> noisy_note(Timing(1.0, 0.8, 1.4, 9))
        'noisy: IQR 60% of the median, too wide to rank'
    """
    return f"noisy: IQR {format_spread(timing)} of the median, too wide to rank"


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of tensor storages created by operators while the mode is active.

    Every operator call passes through ``__torch_dispatch__`` (below vmap and the autograd
    engine, so batched intermediates, saved tensors, basis vectors and results are all
    seen). A storage that an output shares with an input (a view, an in-place op) is not
    new; any other output storage is counted from its creation until Python's weak
    reference to it reports it freed. ``peak`` is the largest total alive at any moment.
    Scratch buffers that a kernel allocates and frees internally are not seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: dict[int, weakref.ref] = {}

    @staticmethod
    def _storage(t: Tensor) -> Any | None:
        if t.device.type == "meta" or t.is_sparse or t._is_zerotensor():
            return None
        try:
            storage = t.untyped_storage()
            storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # storage-less tensor subclasses
            return None
        return storage

    def _released(self, key: int, nbytes: int, _ref: weakref.ref) -> None:
        if self._alive.pop(key, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = set()
        for a in tree_leaves((args, kwargs)):
            if isinstance(a, Tensor):
                storage = self._storage(a)
                if storage is not None:
                    inputs.add(storage.data_ptr())
        for t in tree_leaves(out):
            if not isinstance(t, Tensor):
                continue
            storage = self._storage(t)
            if storage is None:
                continue
            key = storage.data_ptr()
            nbytes = storage.nbytes()
            if nbytes == 0 or key in inputs or key in self._alive:
                continue
            self._alive[key] = weakref.ref(
                storage, lambda r, k=key, n=nbytes: self._released(k, n, r))
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return out


def device_of(tree: Any) -> torch.device:
    """The device of the first tensor in ``tree`` (the CPU when it holds none)."""
    for leaf in tree_leaves(tree):
        if isinstance(leaf, Tensor):
            return leaf.device
    return torch.device("cpu")


def measure_peak(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak extra bytes one call of ``fn`` needs, the result included.

    CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated`` after
    ``reset_peak_memory_stats``) minus what was allocated before the call. Other devices:
    the peak of live tensor bytes counted by :class:`LiveTensorBytes`.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del result
        return int(peak)
    mode = LiveTensorBytes()
    with mode:
        result = fn()
    peak = mode.peak
    del result
    return int(peak)


def memory_method(device: torch.device) -> str:
    """How :func:`measure_peak` measures on ``device``, in words for reports."""
    if device.type == "cuda":
        return ("CUDA caching allocator peak (torch.cuda.max_memory_allocated) minus what was "
                "allocated before")
    return "peak of live tensor bytes created during one call (counted by a TorchDispatchMode)"


def leaves(tree: Any) -> list[Tensor]:
    """Tensor leaves of a result in a canonical order (dict entries by sorted key)."""
    if isinstance(tree, Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in leaves(tree[k])]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in leaves(item)]
    raise TypeError(
        f"expected a tensor, or a tuple, list or dict of them; got {type(tree).__name__}")


def max_error(result: Any, reference: Any) -> float:
    """Largest absolute difference between two results of the same structure and shapes;
    an entry that equals its reference entry, a NaN where the reference has a NaN or the
    same infinity, counts as no difference (see :func:`_entry_errors`).

    Raises:
        ValueError: The structures or the shapes differ (said in the message).
    """
    got, want = leaves(result), leaves(reference)
    if len(got) != len(want):
        raise ValueError(f"returned {len(got)} Jacobian blocks, the reference has {len(want)}")
    error = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        g = torch.as_tensor(g)
        if tuple(g.shape) != tuple(w.shape):
            raise ValueError(
                f"Jacobian block {i} has shape {shape_str(g.shape)}, "
                f"the reference has {shape_str(w.shape)}"
            )
        if g.numel():
            e = float(_entry_errors(g, w)[0].max())
            if math.isnan(e) or e > error:  # (a NaN stays: max(0.0, nan) is 0.0)
                error = e
    return error


def _entry_errors(result: Tensor, reference: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(errors, magnitudes, same)``, flat and in float64 (complex128 for a complex
    operand): each entry's absolute error, its reference entry's size, and whether the two
    entries agree exactly. Entries that agree count an error of 0, a NaN beside a NaN and an
    infinity beside the same infinity included: a Jacobian whose reference is NaN or
    infinite somewhere (``sqrt`` at 0) is matched there by a result with the same entries
    (``inf - inf`` and ``nan - nan`` would be NaN errors, and mark every strategy wrong)."""
    g = result.detach().cpu().reshape(-1)
    w = reference.detach().cpu().reshape(-1)
    dt = torch.complex128 if g.is_complex() or w.is_complex() else torch.float64
    g, w = g.to(dt), w.to(dt)
    same = (g == w) | (torch.isnan(g) & torch.isnan(w))
    errors = torch.where(same, torch.zeros((), dtype=torch.float64), (g - w).abs())
    return errors, w.abs(), same


def _scale(reference: Any) -> float:
    """The largest finite entry of the reference in size (an infinite or NaN entry would
    make every entry's tolerance infinite or NaN, and pass or fail every entry with it)."""
    blocks = [t.detach().abs() for t in leaves(reference) if t.numel()]
    return max((float(torch.where(t.isfinite(), t, 0).max()) for t in blocks), default=0.0)


def _tolerances(result: Any, rtol: float | None, atol: float | None) -> tuple[float, float]:
    if rtol is None:
        rtol = max((RTOL.get(t.dtype, 1e-4) for t in leaves(result)), default=1e-7)
    if atol is None:
        atol = rtol * 1e-3
    return rtol, atol


#: An entry's tolerance counts at least this share of the reference's largest entry: the
#: rounding of a small entry may follow the magnitudes of the others (terms that cancel).
ENTRY_FLOOR = 1e-1


def check_result(result: Any, reference: Any, rtol: float | None, atol: float | None
                 ) -> tuple[float, float, str | None]:
    """``(error, tolerance, why)``: the largest absolute error of ``result`` against
    ``reference``, the largest tolerance of any entry (``atol + rtol * max|reference|``), and
    why the result is wrong: None where every entry is within its own tolerance, ``atol +
    rtol * max(|reference entry|, ENTRY_FLOOR * max|reference|)``. Entry by entry, so that
    one large entry no longer hides wrong small ones (a block of size 1 beside a block of
    1e4 passed with errors of 100%).

    Raises:
        ValueError: The structures or the shapes differ (said in the message).
    """
    rtol, atol = _tolerances(result, rtol, atol)
    error = max_error(result, reference)  # (and the structure and shapes, said as it says)
    scale = _scale(reference)
    floor = ENTRY_FLOOR * scale
    blocks = list(zip(leaves(result), leaves(reference)))
    for i, (g, w) in enumerate(blocks):
        if not w.numel():
            continue
        diff, size, same = _entry_errors(torch.as_tensor(g), w)
        tol = atol + rtol * size.clamp(min=floor)
        # (a NaN or infinite error is wrong, whatever the tolerance; a zero tolerance too)
        bad = ~same & ((diff > tol) | ~torch.isfinite(diff))
        if bool(bad.any()):
            k = int(bad.nonzero()[0])
            where = f" (entry {k} of Jacobian block {i})" if len(blocks) > 1 else (
                f" (entry {k})")
            if not math.isfinite(float(diff[k])):  # (no tolerance to compare it with)
                got, want = torch.as_tensor(g).reshape(-1)[k], w.reshape(-1)[k]
                return error, atol + rtol * scale, (
                    f"value {got.item():.2e}{where} where the reference has {want.item():.2e} "
                    f"(max abs error {error:.2e})")
            return error, atol + rtol * scale, (
                f"abs error {float(diff[k]):.2e}{where} > its tolerance {float(tol[k]):.2e} "
                f"(max abs error {error:.2e})")
    return error, atol + rtol * scale, None


def reason(exc: BaseException, limit: int = 300) -> str:
    """``"TypeName: first line of the message"``, shortened to ``limit`` characters.

    Example:
        >>> reason(ValueError("bad shape")), reason(ValueError("x" * 20), limit=15)
        ('ValueError: bad shape', 'ValueError: ...')
    """
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return shorten(f"{type(exc).__name__}: {first}" if first else type(exc).__name__, limit)


def shorten(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, ending in ``...`` where it was cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_time(seconds: float | None) -> str:
    """Seconds in the unit that fits: ``'1.5 ms'``; ``'-'`` for None or not finite.

    Example:
        >>> format_time(0.0015), format_time(2e-8), format_time(None)
        ('1.5 ms', '20 ns', '-')
    """
    if seconds is None or not math.isfinite(seconds):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def format_table(header: Sequence[str], rows: Iterable[Sequence[str]], align: str) -> list[str]:
    """Aligned plain-text table; ``align`` holds ``<`` or ``>`` per column."""
    rows = [list(header)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        cells = []
        for i, cell in enumerate(row):
            last = i == len(row) - 1
            if align[i] == ">":
                cells.append(cell.rjust(widths[i]))
            else:
                cells.append(cell if last else cell.ljust(widths[i]))
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _real_option(name: str, value: object, *, call: str, positive: bool, must: str) -> float:
    """``value`` as a float if it is a real number (not a bool), finite, and > 0
    (``positive``) or >= 0; else a :class:`JacobianOptionError` saying what it ``must`` be."""
    if (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value) and (value > 0 if positive else value >= 0)):
        return float(value)
    given = f"{name}={value!r}"
    if not isinstance(value, numbers.Real):
        given += f" ({a_type(value)})"
    raise JacobianOptionError(f"{call}: {given}, but it must be {must}")


def check_min_run_time(value: object, *, call: str) -> float:
    """Returns ``min_run_time`` as a float if it is a finite number of seconds > 0.

    ``blocked_autorange`` times calls until their total reaches ``min_run_time``: with nan
    or inf that never happens, and the call hangs.

    Raises:
        JacobianOptionError: anything else (as for the options of torch_vjp.jacobian).
    """
    return _real_option(
        "min_run_time", value, call=call, positive=True,
        must="a finite number of seconds > 0: the time budget of "
        "torch.utils.benchmark.Timer.blocked_autorange, which repeats the call until the "
        "budget is spent (nan or inf never is, so the timing would not end). Fix: keep the "
        "default for figures you report, or pass a small positive number such as 0.01 for a "
        "quick look.",
    )


def check_tolerance(name: str, value: object, *, call: str) -> float | None:
    """Returns ``rtol``/``atol`` if it is ``None`` or a finite number >= 0, else raises.

    Raises:
        JacobianOptionError: anything else.
    """
    if value is None:
        return None
    return _real_option(
        name, value, call=call, positive=False,
        must=f"None or a finite number >= 0: a row is 'ok' when each entry's abs error is at "
        f"most atol + rtol * max(|its reference entry|, {ENTRY_FLOOR:g} * max|reference|), so "
        f"a negative or nan tolerance would mark every "
        f"strategy wrong. Fix: leave {name}=None (the default by dtype) or pass a number "
        f"such as {'1e-5' if name == 'rtol' else '1e-8'}.",
    )
