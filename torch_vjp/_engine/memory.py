"""The memory budget: the ``chunk_size`` and ``max_memory`` options, the memory free on a
device, and the one planner that turns them into a chunk size.

NOTE [memory model]
The extra memory of a Jacobian computation is the Jacobian itself plus the working memory of
the products computed at once. One product (one basis vector) is modelled as costing
``WORK_FACTOR * itemsize * (n_out + n_in)`` bytes, where ``n_out`` and ``n_in`` are the numbers
of output and input elements (times the batch size B for ``batch_jacobian``): the basis
vector, its result, and about two intermediate tensors of that size. A chunk of ``c`` products
is budgeted ``c`` times that. The budget is ``max_memory`` when given, else the memory free on
the device (``MemAvailable`` from ``/proc/meminfo``, lowered to the cgroup limit in a
container, on CPU; ``torch.cuda.mem_get_info`` plus the caching allocator's unused reserve on
CUDA). Requests whose whole unchunked cost is below ``SMALL_REQUEST`` bytes skip reading the
free memory (it costs a system call, and every machine has that much). Functions whose
intermediate tensors are much larger than their inputs and outputs (a convolution stack with a
small input and output) are underestimated by this model: give them a smaller ``max_memory``
or an explicit ``chunk_size``. Forward-mode products that record a graph (f closes over
parameters that require grad) keep every intermediate tangent alive until their chunk is
stored, so there the intermediate results are counted too: ``GRAPH_FACTOR`` times the model
above, and at least ``RECORDED_FACTOR * itemsize`` bytes per element of the inputs and of the
intermediate results in the probe's graph (an MLP 128 -> 256 -> 256 -> 128 whose hidden
layers the inputs and outputs alone undercount: measured 2.1 to 2.4 bytes per element and
itemsize, by chunks of 32 to 4).
"""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Callable

import torch

from torch_vjp._errors import JacobianMemoryError, JacobianOptionError, env_flag, format_bytes

__all__ = [
    "WORK_FACTOR",
    "GRAPH_FACTOR",
    "RECORDED_FACTOR",
    "SMALL_REQUEST",
    "check_chunk_size",
    "parse_max_memory",
    "free_memory",
    "plan_chunk",
    "plan_products",
    "sizes_text",
    "HUGE_PAGE_MIN_BYTES",
    "new_buffer",
]

#: Working memory of one product, in units of ``itemsize * (n_out + n_in)``. See NOTE
#: [memory model].
WORK_FACTOR = 4
#: Working memory of one product in forward mode when the products record autograd graphs
#: (f closes over tensors that require grad), in units of the working memory without: the
#: graph keeps about as much alive as the products themselves use. See NOTE [no graph
#: outlives its chunk] in :mod:`torch_vjp._engine.context`.
GRAPH_FACTOR = 2
#: Working memory of one forward-mode product that records a graph, in units of ``itemsize``
#: per element of the inputs and of the intermediate results it records. See NOTE [memory
#: model].
RECORDED_FACTOR = 3
#: Requests below this many bytes (Jacobian plus all products at once) never read the free
#: memory. See NOTE [memory model].
SMALL_REQUEST = 64 * 2**20


def check_chunk_size(
    chunk_size: object,
    *,
    call: str,
    what: str = "basis vectors (products)",
    cls: type[Exception] = JacobianOptionError,
) -> int | None:
    """Returns ``chunk_size`` if it is ``None`` or a positive int, else raises: the one check
    of every ``chunk_size=`` (per-sample calls name examples and raise their own class).

    Raises:
        JacobianOptionError: ``chunk_size`` is not ``None`` or an int >= 1 (or ``cls``).

    Example:
        >>> check_chunk_size(4, call="f"), check_chunk_size(None, call="f")
        (4, None)
    """
    if chunk_size is None:
        return None
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
            or chunk_size < 1):
        raise cls(
            f"{call}: chunk_size={chunk_size!r}, but it must be None or an int >= 1: the "
            f"number of {what} computed at once. None computes them all at once when memory "
            f"allows; 1 computes one at a time."
        )
    return int(chunk_size)  # (a NumPy integer, a count from an array's shape, as a Python int)


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")


def parse_max_memory(value: object, *, call: str) -> int | None:
    """Parses ``max_memory``: bytes as a number, or a string with a unit.

    Decimal units (``kB``, ``MB``, ``GB``, ``TB``) are powers of 1000, binary units (``KiB``,
    ``MiB``, ``GiB``, ``TiB``) powers of 1024, as the suffix says.

    Args:
        value: ``None``, a positive number of bytes, or a string such as ``"2GB"``,
            ``"512MiB"``, ``"1.5 GB"``.
        call: the public call named in the message.

    Returns:
        The number of bytes, or ``None``.

    Raises:
        JacobianOptionError: the value is not a positive memory size.

    Example:
        >>> parse_max_memory("1.5 GB", call="f"), parse_max_memory("512MiB", call="f")
        (1500000000, 536870912)
    """
    if value is None:
        return None
    how = (
        "Pass a number of bytes (e.g. 2_000_000_000) or a string with a unit: '512MB', "
        "'2GB', '1.5 GB' (decimal: powers of 1000) or '512MiB', '2GiB' (binary: powers of "
        "1024)."
    )
    if isinstance(value, bool):
        raise JacobianOptionError(f"{call}: max_memory={value!r} is not a memory size. {how}")
    if isinstance(value, numbers.Real) and not isinstance(value, (int, float)):
        value = int(value) if isinstance(value, numbers.Integral) else float(value)  # numpy
    if isinstance(value, (int, float)):
        if value <= 0 or isinstance(value, float) and not math.isfinite(value):
            raise JacobianOptionError(
                f"{call}: max_memory={value!r}, but it must be a positive, finite number of "
                f"bytes (None sets no budget). {how}"
            )
        if value < 1:
            raise JacobianOptionError(_under_a_byte(call, value, repr(value), True, how))
        return int(value)
    if isinstance(value, str):
        # ('2_000_000_000', digits grouped as in the example above and in Python's literals)
        m = _SIZE_RE.match(re.sub(r"(?<=\d)_(?=\d)", "", value))
        if m is not None:
            unit = m.group(2).lower()
            if unit in _UNITS:
                size = float(m.group(1)) * _UNITS[unit]
                if not math.isfinite(size):
                    raise JacobianOptionError(
                        f"{call}: max_memory={value!r} is too large a number to be a memory "
                        f"size. {how}"
                    )
                nbytes = int(size)
                if nbytes > 0:
                    return nbytes
                if size > 0:
                    raise JacobianOptionError(
                        _under_a_byte(call, value, m.group(1), unit == "", how))
                raise JacobianOptionError(
                    f"{call}: max_memory={value!r} is zero bytes; it must be positive. {how}"
                )
            if unit in ("k", "m", "g", "t"):
                u = unit.upper()
                raise JacobianOptionError(
                    f"{call}: max_memory={value!r} is ambiguous: write '{m.group(1)}{u}B' "
                    f"(powers of 1000) or '{m.group(1)}{u}iB' (powers of 1024)."
                )
        if value.strip().startswith("-") and _SIZE_RE.match(value.strip()[1:]):
            raise JacobianOptionError(
                f"{call}: max_memory={value!r} is negative; it must be a positive memory size. "
                f"{how}"
            )
    raise JacobianOptionError(f"{call}: max_memory={value!r} is not a memory size. {how}")


def _under_a_byte(call: str, value: object, number: str, unitless: bool, how: str) -> str:
    """The message for a positive ``max_memory`` below one byte (``0.5``, meant as
    gigabytes, say); ``number``: its digits, ``unitless``: it names no unit."""
    hint = ""
    if unitless:
        hint = (f" A number, or a string without a unit, counts bytes: for {number} "
                f"gigabytes, write max_memory='{number}GB'.")
    return (f"{call}: max_memory={value!r} is less than one byte, so no Jacobian fits it."
            f"{hint} {how}")


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_available() -> int | None:
    """Bytes left under this process's cgroup memory limit, or None without a limit."""
    for limit_path, usage_path, stat_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current",
         "/sys/fs/cgroup/memory.stat"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
         "/sys/fs/cgroup/memory/memory.usage_in_bytes", "/sys/fs/cgroup/memory/memory.stat"),
    ):
        limit = _read_int(limit_path)
        if limit is None or limit >= 2**60:
            continue
        usage = _read_int(usage_path) or 0
        reclaimable = 0
        try:
            with open(stat_path) as fh:
                for line in fh:
                    key, _, val = line.partition(" ")
                    if key in ("inactive_file", "total_inactive_file"):
                        reclaimable = max(reclaimable, int(val))
        except (OSError, ValueError):
            pass
        return max(0, limit - max(0, usage - reclaimable))
    return None


def free_memory(device: torch.device) -> tuple[int, str] | None:
    """The memory free for new tensors on ``device``, and where that figure comes from.

    Returns:
        ``(bytes, description)``, or ``None`` where it cannot be known (then no default
        budget applies).
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        reserve = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(0, reserve)), f"free on {device} (torch.cuda.mem_get_info)"
    if device.type != "cpu":
        return None
    available = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        available = None
    source = "MemAvailable in /proc/meminfo"
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            source = "available physical pages"
        except (ValueError, OSError, AttributeError):
            return None
    limit = _cgroup_available()
    if limit is not None and limit < available:
        available, source = limit, "left under this container's cgroup memory limit"
    return int(available), f"free on cpu ({source})"


def plan_chunk(
    n_vectors: int,
    jac_bytes: int,
    per_vector: int,
    *,
    chunk_size: int | None,
    max_memory: int | None,
    device: torch.device,
    call: str,
    what: str | Callable[[], str],
    alternatives: str,
) -> int | None:
    """The chunk size (products at once) that keeps the computation within its budget.

    See NOTE [memory model].

    Args:
        n_vectors: number of products (basis vectors) in all.
        jac_bytes: bytes of the result.
        per_vector: modelled working bytes of one product.
        chunk_size: the caller's ``chunk_size`` (already checked), or None.
        max_memory: the caller's budget in bytes, or None for the free memory.
        device: where the result lives.
        call: the public call named in messages.
        what: the result's size in words, for the message ("10,000 x 10,000 float64 ..."),
            or a function returning it (called only for the message).
        alternatives: what the user can do instead, for the message.

    Returns:
        The chunk size, or ``None`` for all products at once.

    Raises:
        JacobianMemoryError: the result plus one product does not fit the budget.
    """
    if n_vectors == 0:
        # (no product runs: a reverse-mode Jacobian of an empty output, a forward-mode one
        # of an empty input; the result, empty too, is all there is to fit)
        per_vector = 0
    budget: int | None
    source = ""
    if max_memory is not None:
        budget, source = max_memory, f"max_memory={format_bytes(max_memory)}"
    elif jac_bytes + n_vectors * per_vector <= SMALL_REQUEST:
        budget = None
    else:
        free = free_memory(device)
        if free is None:
            budget = None
        else:
            budget = free[0]
            source = f"the {format_bytes(free[0])} {free[1]}, the default budget"
    if budget is None:
        chunk = chunk_size
    else:
        if jac_bytes + per_vector > budget:
            extra = ""
            if jac_bytes <= budget:
                extra = (
                    f" and at least {format_bytes(per_vector)} of working memory for one "
                    f"product, {format_bytes(jac_bytes + per_vector)} in all"
                )
            if callable(what):
                what = what()
            raise JacobianMemoryError(
                f"{call}: the result needs {format_bytes(jac_bytes)}{extra}: {what}. That is "
                f"more than {source}.\n"
                f"  This is checked before the products are computed, so nothing large was "
                f"allocated.\n"
                f"  Alternatives: {alternatives}"
            )
        fit = max(1, (budget - jac_bytes) // max(1, per_vector))
        chunk = fit if chunk_size is None else min(chunk_size, fit)
    if chunk is not None and chunk >= n_vectors:
        return None
    return chunk


def plan_products(
    n_vectors: int,
    n_out: int,
    n_in: int,
    itemsize: int,
    *,
    chunk_size: int | None,
    max_memory: int | None,
    device: torch.device,
    call: str,
    alternatives: str,
    batch: int | None = None,
    records: bool | int = False,
    dtype: torch.dtype | None = None,
    result_bytes: int | None = None,
) -> int | None:
    """The chunk size of ``n_vectors`` products building a Jacobian with ``n_out`` rows and
    ``n_in`` columns (``batch`` blocks of them for ``batch_jacobian``): NOTE [memory model]
    applied by :func:`plan_chunk`.

    Args:
        n_vectors: number of products (``n_out`` in reverse mode, ``n_in`` in forward mode).
        n_out, n_in: output and input elements (per example, with ``batch``).
        itemsize: bytes per element of the widest dtype involved.
        chunk_size, max_memory, device, call, alternatives: as for :func:`plan_chunk`.
        batch: the batch size B of ``batch_jacobian``, or None.
        records: the products record autograd graphs that live until their chunk is stored
            (NOTE [no graph outlives its chunk]), which :data:`GRAPH_FACTOR` more working
            memory per product stands for. An int (not a bool) counts the elements of the
            intermediate results they record (all B examples', with ``batch``), which
            :data:`RECORDED_FACTOR` bytes per element and itemsize stand for, with the
            inputs', where that is more.
        dtype: the result's dtype, named in the message (not named when None).
        result_bytes: the result's bytes where its blocks differ in dtype (each block in
            its own), else None for ``itemsize`` bytes per element.

    Returns:
        The chunk size, or ``None`` for all products at once.

    Raises:
        JacobianMemoryError: the result plus one product does not fit the budget.

    Example:
        >>> plan_products(64, 64, 64, 8, chunk_size=None, max_memory=45_000, call="f",
        ...               device=torch.device("cpu"), alternatives="")
        2
    """
    b = 1 if batch is None else batch
    jac_bytes = itemsize * n_out * n_in * b if result_bytes is None else result_bytes
    per_vector = WORK_FACTOR * itemsize * (n_out + n_in) * b
    if records:
        per_vector *= GRAPH_FACTOR
        if not isinstance(records, bool):
            recorded = RECORDED_FACTOR * itemsize * (int(records) + n_in * b)
            per_vector = max(per_vector, recorded)
    small = jac_bytes + n_vectors * per_vector <= SMALL_REQUEST
    if chunk_size is None and max_memory is None and small:
        return None  # what plan_chunk returns for a small request without options
    return plan_chunk(
        n_vectors,
        jac_bytes,
        per_vector,
        chunk_size=chunk_size,
        max_memory=max_memory,
        device=device,
        call=call,
        what=lambda: sizes_text(n_out, n_in, batch, dtype),
        alternatives=alternatives,
    )


def sizes_text(n_out: int, n_in: int, batch: int | None, dtype: torch.dtype | None) -> str:
    """A Jacobian's size in words, for messages.

    Example:
        >>> sizes_text(3, 4, None, torch.float32)
        '12 float32 elements, 3 output elements times 4 input elements'
    """
    kind = "" if dtype is None else str(dtype).replace("torch.", "") + " "
    if batch is None:
        return (
            f"{n_out * n_in:,} {kind}elements, {n_out:,} output elements times {n_in:,} input "
            f"elements"
        )
    return (
        f"{batch * n_out * n_in:,} {kind}elements, B = {batch:,} blocks of {n_out:,} output "
        f"elements times {n_in:,} input elements"
    )


# NOTE [huge pages]
# A fresh buffer of hundreds of megabytes (B per-sample gradients of a model) costs one page
# fault per 4 kB page when it is first written. With the advice below, ``per_sample_grads``
# on the MLP with B = 256 (686 MB of results) takes 0.26 of the time it takes without
# (benchmarks/results/per_sample_parts.md, huge_pages, paired in one run). torch backs its allocations by huge
# pages only with ``THP_MEM_ALLOC_ENABLE=1`` (off by default), and the kernel, in its common
# ``madvise`` setting, only for memory that asks. So the large results torch_vjp allocates and
# fills itself ask, before anything touches them: ``madvise(MADV_HUGEPAGE)`` on the part of
# the buffer that covers whole 2 MB pages. The advice changes how the memory is backed, never
# what it holds. It is given only on Linux, for CPU tensors of at least
# ``HUGE_PAGE_MIN_BYTES`` (which the C library maps on their own, not inside its heap), and
# only when the kernel's setting is ``madvise`` (``always`` backs them anyway, ``never``
# refuses). ``TORCH_VJP_HUGE_PAGES=0`` turns it off.

#: Buffers from :func:`new_buffer` of at least this many bytes ask for huge pages.
HUGE_PAGE_MIN_BYTES = 32 * 2**20
_HUGE = 2 * 2**20
_MADV_HUGEPAGE = 14
_madvise: Callable[[int, int, int], int] | None | bool = False  # False: not looked up yet


def _huge_page_advice() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` when asking for huge pages can help here, else None (once)."""
    global _madvise
    if _madvise is not False:
        return _madvise  # type: ignore[return-value]
    _madvise = None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            if "[madvise]" not in fh.read():
                return None
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    except (OSError, AttributeError):
        pass
    return _madvise  # type: ignore[return-value]


def new_buffer(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``like.new_empty(shape)``, backed by huge pages where that is cheaper to fill (see
    NOTE [huge pages]). For results torch_vjp allocates and writes itself, before any write.
    Sparse tensors and tensor subclasses are returned as ``new_empty`` makes them.

    Example:
        >>> new_buffer(torch.zeros(2), (3, 4)).shape
        torch.Size([3, 4])
    """
    out = like.new_empty(shape)
    nbytes = out.numel() * out.element_size()
    if (
        nbytes >= HUGE_PAGE_MIN_BYTES
        and type(out) is torch.Tensor  # not a subclass (DTensor, ...) whose memory is elsewhere
        and out.layout == torch.strided
        and out.device.type == "cpu"
        and os.name == "posix"
    ):
        if env_flag("TORCH_VJP_HUGE_PAGES", default=True):
            advise = _huge_page_advice()
            if advise is not None:
                start = out.data_ptr()
                first = (start + _HUGE - 1) // _HUGE * _HUGE
                end = (start + nbytes) // _HUGE * _HUGE
                if end > first:
                    advise(first, end - first, _MADV_HUGEPAGE)  # advice: failure is harmless
    return out
