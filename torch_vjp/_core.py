"""The shared core of Jacobians, batched VJPs/JVPs and the memory budget.

Every public function of :mod:`torch_vjp.jacobians` and :mod:`torch_vjp.transforms` is a thin
layer over the same few moves, each written once here:

* **the function of the differentiated leaves** (:class:`Problem`): ``f`` with the arguments
  picked by ``argnums`` replaced by flat tensor leaves, its outputs validated;
* **the basis** (:func:`basis_rows`): the standard basis vectors (rows of the identity) over a
  list of tensors, built a chunk of rows at a time, optionally broadcast over a batch;
* **vmap or loop** (:func:`map_rows`): apply a product ``fn`` (a VJP or a JVP) to rows of
  vectors, vectorised with ``torch.vmap`` or in a Python loop, a chunk at a time, writing into
  one preallocated result;
* **the memory plan** (:func:`plan_chunk`): the chunk size that fits a budget, and
  :class:`~torch_vjp.JacobianMemoryError` before anything large is allocated;
* **the Jacobian engine** (:func:`jacobian_blocks`): reverse mode (one VJP per output element)
  or forward mode (one JVP per input element), the ``"auto"`` choice and its fallbacks;
* **the disconnection check** (:func:`warn_disconnected`).

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
or an explicit ``chunk_size``.

NOTE [auto fallback]
The vectorised strategies run on torch.func (``vjp``/``jvp`` under ``torch.vmap``), as
``torch.func.jacrev``/``jacfwd`` do. The loop strategies compute one product at a time with
torch.func's ``vjp``/``jvp`` without vmap, which avoids vmap's limits (a custom
``autograd.Function`` without vmap support, ``.item()`` or Python control flow on values
inside a custom backward); where torch.func cannot run ``f`` at all (a custom Function
without ``setup_context``, NumPy calls), they use plain autograd (``torch.autograd.grad``,
``torch.autograd.forward_ad``), at top level only, since that does not compose with outer
transforms. ``strategy="auto"`` runs the vectorised strategy; if that raises, it runs the
loop strategy of the same mode, which runs ``f`` without vmap: if the loop raises too, that
error (``f``'s own, or autograd's) propagates untouched; if not, the vectorised failure was a
transform limitation, and a one-time :class:`~torch_vjp.JacobianWarning` quotes it. When
forward mode fails even in the loop (an operator or custom Function without a forward-mode
formula), ``"auto"`` switches to reverse mode, also with a one-time warning. Out-of-memory
errors and torch_vjp's own errors are never caught.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor
from torch.func import vmap
from torch.utils._pytree import (
    TreeSpec,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_unflatten,
)

from torch_vjp._checks import _user_stacklevel  # noqa: F401 (shared by jacobians, per_sample)
from torch_vjp._errors import (
    JacobianCallError,
    JacobianCallTypeError,
    JacobianMemoryError,
    JacobianOptionError,
    JacobianWarning,
    TorchVJPError,
    shape_str,
)
from torch_vjp._strategies import choose_mode

try:  # the undecorated originals: torch_vjp.checked() may replace torch.func.vjp
    from torch._functorch.eager_transforms import jvp as _func_jvp
    from torch._functorch.eager_transforms import vjp as _func_vjp
except ImportError:  # pragma: no cover - other torch layouts
    _func_vjp = torch.func.vjp
    _func_jvp = torch.func.jvp
try:  # torch.func.jacrev's own vjp: with argnums=0 its pullback returns a tensor, not a
    # 1-tuple, which saves vmap a pytree round trip per call (see NOTE [per-call overhead])
    from torch._functorch.eager_transforms import _vjp_with_argnums
except ImportError:  # pragma: no cover - other torch layouts
    _vjp_with_argnums = None

__all__ = [
    "JacobianOptionError",
    "JacobianCallError",
    "WORK_FACTOR",
    "GRAPH_FACTOR",
    "SMALL_REQUEST",
    "check_chunk_size",
    "parse_max_memory",
    "format_bytes",
    "free_memory",
    "plan_chunk",
    "normalize_argnums",
    "Problem",
    "basis_rows",
    "map_rows",
    "run_with_fallback",
    "jacobian_blocks",
    "assemble",
    "warn_disconnected",
    "warn_once",
    "is_nested",
    "buffers_kept",
    "modules_reached",
    "graph_mode",
]

#: Working memory of one product, in units of ``itemsize * (n_out + n_in)``. See NOTE
#: [memory model].
WORK_FACTOR = 4
#: Working memory of one product in forward mode when the products record autograd graphs
#: (f closes over tensors that require grad), in units of the working memory without: the
#: graph keeps about as much alive as the products themselves use. See NOTE [no graph
#: outlives its chunk].
GRAPH_FACTOR = 2
#: Requests below this many bytes (Jacobian plus all products at once) never read the free
#: memory. See NOTE [memory model].
SMALL_REQUEST = 64 * 2**20


# ---------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------


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
    """
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise cls(
            f"{call}: chunk_size={chunk_size!r}, but it must be None or an int >= 1: the "
            f"number of {what} computed at once. None computes them all at once when memory "
            f"allows; 1 computes one at a time."
        )
    return chunk_size


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
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise JacobianOptionError(
                f"{call}: max_memory={value!r}, but it must be a positive number of bytes. "
                f"{how}"
            )
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is not None:
            unit = m.group(2).lower()
            if unit in _UNITS:
                nbytes = int(float(m.group(1)) * _UNITS[unit])
                if nbytes > 0:
                    return nbytes
                raise JacobianOptionError(
                    f"{call}: max_memory={value!r} is zero bytes; it must be positive. {how}"
                )
            if unit in ("k", "m", "g", "t"):
                u = unit.upper()
                raise JacobianOptionError(
                    f"{call}: max_memory={value!r} is ambiguous: write '{m.group(1)}{u}B' "
                    f"(powers of 1000) or '{m.group(1)}{u}iB' (powers of 1024)."
                )
    raise JacobianOptionError(f"{call}: max_memory={value!r} is not a memory size. {how}")


def format_bytes(n: float) -> str:
    """Formats a byte count in decimal units: ``'80.0 GB'``, ``'512 B'``."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}" if n / size < 100 else f"{n / size:.0f} {unit}"
    return f"{int(n)} B"


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
                    f" (with at least {format_bytes(per_vector)} of working memory for "
                    f"one product)"
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


# ---------------------------------------------------------------------------------------
# argnums and the function of the differentiated leaves
# ---------------------------------------------------------------------------------------


def normalize_argnums(argnums: object, n_args: int, *, call: str) -> tuple[int, ...]:
    """Checks ``argnums`` against the number of primals; returns non-negative indices.

    Raises:
        JacobianCallError: not an int or a non-empty tuple of distinct ints in range.
    """
    if n_args == 0:
        raise JacobianCallError(
            f"{call}: no primals were given. Pass the point at which to differentiate, "
            f"e.g. {call}(f, x)."
        )
    if isinstance(argnums, int) and not isinstance(argnums, bool):
        items: tuple[Any, ...] = (argnums,)
    elif isinstance(argnums, tuple) and argnums:
        items = argnums
    else:
        fix = f" Fix: argnums={tuple(argnums)!r}." if isinstance(argnums, list) and argnums else ""
        raise JacobianCallError(
            f"{call}: argnums={argnums!r}, but it must be an int or a non-empty tuple of "
            f"ints: the positions of the primals to differentiate against.{fix}"
        )
    out = []
    for a in items:
        if isinstance(a, bool) or not isinstance(a, int):
            raise JacobianCallError(
                f"{call}: argnums={argnums!r} holds {a!r}, but its entries must be ints."
            )
        if not -n_args <= a < n_args:
            raise JacobianCallError(
                f"{call}: argnums={argnums!r}, but f was given {n_args} "
                f"primal{'s' if n_args != 1 else ''}, so argnums must lie in "
                f"{-n_args}..{n_args - 1}."
            )
        out.append(a % n_args)
    if len(set(out)) != len(out):
        raise JacobianCallError(
            f"{call}: argnums={argnums!r} names a primal twice; each may appear once."
        )
    return tuple(out)


_LEAF_SPEC: TreeSpec = tree_flatten(0)[1]
_TUPLE_SPECS: dict[int, TreeSpec] = {}


def _tuple_spec(k: int) -> TreeSpec:
    """The structure of a tuple of ``k`` leaves (shared, for cheap comparisons)."""
    spec = _TUPLE_SPECS.get(k)
    if spec is None:
        spec = _TUPLE_SPECS[k] = tree_flatten((0,) * k)[1]
    return spec


def _leaf_name(path: Any, root: str) -> str:
    return root + keystr(path) if path else root


def _primal_name(argnum: int, path: Any, position: int | None) -> str:
    name = f"primals[{argnum}]" + (keystr(path) if path else "")
    if position is not None:
        name += f" (argnums[{position}])"
    return name


def _differentiable(t: object) -> bool:
    """Whether ``t`` is a tensor Jacobians can be taken against: dense, real floating point."""
    return (
        isinstance(t, Tensor)
        and t.dtype.is_floating_point
        and t.layout is torch.strided
        and not t.is_nested
    )


def _check_primal_leaf(leaf: object, name: str, call: str, selected: bool) -> None:
    if isinstance(leaf, Tensor) and (leaf.is_nested or leaf.layout is not torch.strided):
        kind = "a nested tensor" if leaf.is_nested else f"a sparse tensor (layout {leaf.layout})"
        fix = (
            "pass the dense tensor (x.to_dense()) and, if f needs a sparse one, call "
            ".to_sparse() inside f" if not leaf.is_nested else
            "differentiate the dense components (e.g. x.values() or a padded tensor, "
            "x.to_padded_tensor(0.0)) and rebuild the nested tensor inside f"
        )
        raise JacobianCallError(
            f"{call}: {name} is {kind}; Jacobians here (as in torch.func) are taken with "
            f"respect to dense (strided) tensors, whose elements are the Jacobian's columns. "
            f"Fix: {fix}."
        )
    if not isinstance(leaf, Tensor):
        if selected:
            raise JacobianCallError(
                f"{call}: {name} is a {type(leaf).__name__}, but argnums selects it for "
                f"differentiation, and derivatives are taken with respect to tensors. Fix: "
                f"pass torch.tensor(...) for it, or leave its position out of argnums."
            )
        raise JacobianCallError(
            f"{call}: {name} is a {type(leaf).__name__}, but every primal is differentiated, "
            f"and derivatives are taken with respect to tensors. Fix: pass torch.tensor(...) "
            f"for it, or bind it inside f (functools.partial or a lambda)."
        )
    if leaf.dtype.is_complex:
        raise JacobianCallError(
            f"{call}: {name} has dtype {leaf.dtype}; Jacobians here (as in "
            f"torch.func.jacrev) are defined for real tensors. Fix: pass "
            f"torch.view_as_real({name.split(' ')[0]}) and rebuild the complex number inside f."
        )
    if not leaf.dtype.is_floating_point:
        raise JacobianCallError(
            f"{call}: {name} has dtype {leaf.dtype}, but only floating-point tensors can be "
            f"differentiated (an integer has no small changes). Fix: pass it as .double() "
            f"or .float()" + (", or leave its position out of argnums." if selected else ".")
        )


# NOTE [f's own copies]
# A Jacobian, VJP or JVP calls f more than once (a probe for the output sizes, one call per
# chunk or per product in a loop, a fallback), and f may modify its arguments in place. So
# f never sees the caller's tensors: each tensor primal is copied once per call (under the
# caller's grad mode, so a copy stays differentiable with respect to the original when a
# graph is wanted), and before each call of f a copy that an earlier call modified in place
# (its version counter moved) is reset to the caller's value. The caller's tensors are never
# written, and every call of f starts from the same point. The copies cost one pass over the
# primals per call, next to products that each cost at least as much.


class _Copy(list):  # type: ignore[type-arg]
    """``[copy, original, version]`` of one tensor primal; see NOTE [f's own copies]."""

    __slots__ = ()

    def reset(self) -> None:
        copy, original = self[0], self[1]
        # f runs inside torch.func transforms, which refuse a write to a tensor they captured;
        # this write restores the point f is evaluated at, before f runs, so it is done below
        # them (the transforms' inputs share the copy's storage and see the restored values).
        with _below_transforms(), torch.no_grad():
            copy.copy_(original)
        self[2] = copy._version


_below_transforms = getattr(torch._C, "_DisableFuncTorch", contextlib.nullcontext)


def _fresh_copies(
    primals: tuple[Any, ...], detached: bool = False
) -> tuple[tuple[Any, ...], list[_Copy]]:
    """The primals with every tensor replaced by a copy (detached from the caller's graph for
    a detached result), and the copies' guards."""
    guard: list[_Copy] = []

    def copy(t: Any) -> Any:
        if not isinstance(t, Tensor) or t.is_nested or t.layout is not torch.strided:
            return t  # refused later if differentiated; never written by us
        c = t.detach().clone() if detached else t.clone()
        guard.append(_Copy((c, t, c._version)))
        return c

    if all(isinstance(p, Tensor) for p in primals):
        return tuple(copy(p) for p in primals), guard
    return tuple(tree_map(copy, p) for p in primals), guard


class Problem:
    """``f`` as a function of the flat tensor leaves of the differentiated primals.

    ``g(*leaves)`` calls ``f`` with the primals selected by ``argnums`` rebuilt from
    ``leaves`` and the others as given, checks that its output is a pytree of floating-point
    tensors (and, with ``has_aux``, an ``(output, aux)`` pair), and returns what ``f``
    returned. Products are then taken with respect to the leaves, so a VJP returns one
    tensor per leaf and no pytree work is needed in the hot path.

    With ``detached``, the copies of the primals f is called with (NOTE [f's own copies]) are
    detached from the caller's graph. An aux value must be tensors, as torch.func asks.

    Attributes:
        leaves: the differentiated tensors, flattened.
        in_spec: the pytree structure of the differentiated primals (the primal itself for an
            int ``argnums``, a tuple of them for a tuple).
        int_argnums: whether ``argnums`` was an int.
    """

    def __init__(
        self,
        f: Callable[..., Any],
        primals: tuple[Any, ...],
        argnums: object,
        *,
        has_aux: bool,
        call: str,
        detached: bool = False,
    ) -> None:
        if not callable(f):
            raise JacobianCallTypeError(
                f"{call}: f is {_describe(f)}, but it must be a callable: the function to "
                f"differentiate, called as f(*primals). Fix: pass the function itself, e.g. "
                f"{call}(torch.sin, x) or {call}(lambda x: ..., x)."
            )
        # argnums=None: every primal, as torch.func.vjp/jvp (a tuple of them)
        self.selected = argnums is not None
        primals, self._guard = _fresh_copies(primals, detached)
        self.primals = primals
        self._keys: dict[Any, Any] = {}
        if self._init_tensors(f, primals, argnums, has_aux, call):
            return
        if argnums is None:
            if not primals:
                raise JacobianCallError(f"{call}: no primals were given.")
            argnums = tuple(range(len(primals)))
        idx = normalize_argnums(argnums, len(primals), call=call)
        self.f = f
        self.call = call
        self.has_aux = bool(has_aux)
        self.argnums = idx
        self.int_argnums = not isinstance(argnums, tuple)
        diff = primals[idx[0]] if self.int_argnums else tuple(primals[i] for i in idx)
        leaves, self.in_spec = tree_flatten(diff)
        if not leaves:
            raise JacobianCallError(
                f"{call}: the primals selected by argnums={argnums!r} hold no tensors."
            )
        self.leaves: list[Tensor] = leaves
        if self.in_spec.num_leaves == 1 and isinstance(diff, Tensor):
            if not _differentiable(diff):
                _check_primal_leaf(diff, self.leaf_name(0), call, self.selected)
            i = idx[0]
            pre, post = primals[:i], primals[i + 1 :]

            def call_f(x: Tensor) -> Any:
                return f(*pre, x, *post)

        else:
            for k, leaf in enumerate(leaves):
                if not _differentiable(leaf):
                    _check_primal_leaf(leaf, self.leaf_name(k), call, self.selected)
            spec, int_argnums = self.in_spec, self.int_argnums
            if not int_argnums and all(isinstance(primals[i], Tensor) for i in idx):
                if idx == tuple(range(len(primals))):  # every primal, in order

                    def call_f(*xs: Tensor) -> Any:
                        return f(*xs)

                else:
                    call_f = _with_args_at(f, primals, idx)

                self._call_f = call_f
                return

            def call_f(*xs: Tensor) -> Any:
                rebuilt = tree_unflatten(list(xs), spec)
                args = list(primals)
                if int_argnums:
                    args[idx[0]] = rebuilt
                else:
                    for i, value in zip(idx, rebuilt):
                        args[i] = value
                return f(*args)

        self._call_f = call_f

    def _init_tensors(
        self, f: Callable[..., Any], primals: tuple[Any, ...], argnums: object, has_aux: bool,
        call: str,
    ) -> bool:
        """The common case without pytree work: ``argnums`` an int or a tuple of ints, in
        range and distinct (or None: every primal), selecting floating-point tensors.
        Returns False (having set nothing) for anything else, which the general path then
        checks and reports."""
        n = len(primals)
        if argnums is None and n:
            argnums = tuple(range(n))
        if type(argnums) is int:
            if not -n <= argnums < n:
                return False
            i = argnums % n
            x = primals[i]
            if not _differentiable(x):
                return False
            self.argnums = (i,)
            self.int_argnums = True
            self.in_spec = _LEAF_SPEC
            self.leaves = [x]
            if n == 1:
                self._call_f = f
            else:
                pre, post = primals[:i], primals[i + 1 :]

                def call_f(x: Tensor) -> Any:
                    return f(*pre, x, *post)

                self._call_f = call_f
        elif type(argnums) is tuple and argnums:
            idx = []
            for a in argnums:
                if type(a) is not int or not -n <= a < n:
                    return False
                i = a % n
                x = primals[i]
                if not _differentiable(x):
                    return False
                idx.append(i)
            if len(set(idx)) != len(idx):
                return False
            self.argnums = tuple(idx)
            self.int_argnums = False
            self.in_spec = _tuple_spec(len(idx))
            self.leaves = [primals[i] for i in idx]
            if self.argnums == tuple(range(n)):  # every primal, in order
                self._call_f = f
            else:
                self._call_f = _with_args_at(f, primals, idx)
        else:
            return False
        self.f = f
        self.call = call
        self.has_aux = bool(has_aux)
        return True

    def g(self, *xs: Tensor) -> Any:
        """Calls ``f`` at the leaves ``xs`` and validates what it returns.

        Before each call, a primal that an earlier call of ``f`` modified in place is reset
        to the caller's value (NOTE [f's own copies]).
        """
        for guard in self._guard:
            if guard[0]._version != guard[2]:
                guard.reset()
        res = self._call_f(*xs)
        out = res
        if self.has_aux:
            if not (isinstance(res, tuple) and len(res) == 2):
                raise JacobianCallError(
                    f"{self.call}: with has_aux=True, f must return a pair (output, aux), "
                    f"but it returned {_describe(res)}. Return (output, aux), or pass "
                    f"has_aux=False."
                )
            out = res[0]
            self._check_aux(res[1])
        if isinstance(out, Tensor):
            if not out.dtype.is_floating_point:
                self._bad_output(out, None)
        else:
            for path, leaf in tree_flatten_with_path(out)[0]:
                if not (isinstance(leaf, Tensor) and leaf.dtype.is_floating_point):
                    self._bad_output(leaf, path)
            if not tree_leaves(out):
                raise JacobianCallError(
                    f"{self.call}: f returned {_describe(out)}, which holds no tensors: there "
                    f"is nothing to differentiate."
                )
        return res

    def _check_aux(self, aux: Any) -> None:
        """``aux`` must be a tensor or a pytree of tensors (None allowed), under every
        strategy: torch.func's vjp and jvp refuse anything else ("Expected tensors"), and
        vmap carries only tensors."""
        if aux is None or isinstance(aux, Tensor):
            return
        for path, leaf in tree_flatten_with_path(aux)[0]:
            if leaf is not None and not isinstance(leaf, Tensor):
                where = _leaf_name(path, "aux")
                raise JacobianCallError(
                    f"{self.call}: {where} is {_describe(leaf)}, but with has_aux=True the aux "
                    f"value f returns must be a tensor or a tuple, list or dict of tensors "
                    f"(torch.func's transforms carry only tensors out). Fix: return "
                    f"torch.tensor(...) for it, or keep the Python value outside f."
                )

    def _bad_output(self, leaf: object, path: Any) -> None:
        where = _leaf_name(path, "the output of f")
        if not isinstance(leaf, Tensor):
            hint = ""
            if (
                not self.has_aux
                and isinstance(path, tuple)
                and len(path) == 1
                and getattr(path[0], "idx", None) == 1
            ):
                hint = " If f returns (output, aux), pass has_aux=True."
            raise JacobianCallError(
                f"{self.call}: {where} is a {type(leaf).__name__}, but every output of f must "
                f"be a Tensor (or a tuple, list or dict of Tensors): the Jacobian has one "
                f"block per output tensor.{hint}"
            )
        raise JacobianCallError(
            f"{self.call}: {where} has dtype {leaf.dtype}; only real floating-point outputs "
            f"have a Jacobian here (as in torch.func.jacrev). Fix: return it as .double() or "
            f".float() if it is differentiable, or move it to aux with has_aux=True."
        )

    def leaf_name(self, k: int) -> str:
        """The user's name for leaf ``k``: ``primals[1]['w'] (argnums[0])``."""
        flat = tree_flatten_with_path(
            tree_unflatten(list(range(len(self.leaves))), self.in_spec)
        )[0]
        path = flat[k][0]
        if self.int_argnums:
            return _primal_name(self.argnums[0], path, None)
        pos = getattr(path[0], "idx", 0)
        return _primal_name(self.argnums[pos], path[1:], pos if self.selected else None)

    def probe(self, record: bool = False) -> tuple[list[Tensor], TreeSpec]:
        """Runs ``f`` once for the sizes of its outputs: without recording a graph, or with
        ``record`` under the caller's grad mode (so that the outputs show whether ``f``
        involves tensors that require grad)."""
        with contextlib.nullcontext() if record else torch.no_grad():
            res = self.g(*self.leaves)
        out = res[0] if self.has_aux else res
        flat, spec = tree_flatten(out)
        return flat, spec


def _with_args_at(f: Callable[..., Any], primals: tuple[Any, ...], idx: tuple[int, ...]
                  ) -> Callable[..., Any]:
    """``f`` called with ``xs`` in place of the primals at positions ``idx``."""

    def call_f(*xs: Tensor) -> Any:
        args = list(primals)
        for i, value in zip(idx, xs):
            args[i] = value
        return f(*args)

    return call_f


def _describe(obj: object) -> str:
    if isinstance(obj, Tensor):
        return f"a Tensor of shape {shape_str(obj.shape)}"
    if isinstance(obj, tuple):
        return f"a tuple of length {len(obj)}"
    return f"a {type(obj).__name__}"


# ---------------------------------------------------------------------------------------
# Basis and vmap-or-loop
# ---------------------------------------------------------------------------------------

Rows = Callable[[int, int], tuple[Tensor, ...]]


def basis_rows(
    shapes: Sequence[torch.Size],
    dtypes: Sequence[torch.dtype],
    devices: Sequence[torch.device],
    batch: int | None = None,
) -> Rows:
    """The standard basis over several tensors, a chunk of rows at a time.

    Row ``r`` of the basis is the ``r``-th unit vector of the concatenation of the flattened
    tensors, split back into one tensor per shape. ``rows(start, stop)`` returns one tensor
    per shape, of shape ``(stop - start, *shape)`` (or ``(stop - start, batch, *shape)``, the
    row broadcast over a batch, for ``batch_jacobian``).

    Example:
        >>> rows = basis_rows([torch.Size([2]), torch.Size([])], [torch.float32] * 2,
        ...                   [torch.device("cpu")] * 2)
        >>> a, b = rows(1, 3)
        >>> a.tolist(), b.tolist()
        ([[0.0, 1.0], [0.0, 0.0]], [0.0, 1.0])
    """
    numels = [math.prod(s) for s in shapes]
    offsets = [0]
    for n in numels[:-1]:
        offsets.append(offsets[-1] + n)

    def rows(start: int, stop: int) -> tuple[Tensor, ...]:
        c = stop - start
        out = []
        for shape, numel, off, dtype, device in zip(shapes, numels, offsets, dtypes, devices):
            z = torch.zeros((c, numel), dtype=dtype, device=device)
            if start < off + numel and off < stop:
                # element (k, j) is 1 where start + k == off + j
                z.diagonal(start - off).fill_(1)
            z = z.view(c, *shape)
            if batch is not None:
                z = z.unsqueeze(1).expand(c, batch, *shape)
            out.append(z)
        return tuple(out)

    return rows


_NO_BUFFERS = contextlib.nullcontext()


def buffers_kept(f: object) -> Any:
    """Restores the buffers of the modules ``f`` uses if calling ``f`` changed them.

    The Jacobian functions call ``f`` more than once (a probe for the output size, a
    fallback, one call per product in a loop), and a module in training mode updates buffers
    on every call (BatchNorm's running statistics, spectral norm's power-iteration vectors).
    The modules are found from ``f`` itself (:func:`modules_reached`): ``f`` a module, a bound
    method of one, a ``functools.partial``, or a function whose closure or globals name one
    (``lambda t: bn(t)``). Where any of them has a submodule in training mode, every buffer is
    saved first and any that changed is put back, so that nothing of the user's is mutated.

    Returns:
        A context manager (one that does nothing when ``f`` reaches no module in training
        mode).
    """
    modules = modules_reached(f)
    if not modules or is_nested():
        return _NO_BUFFERS
    return _module_buffers_kept(modules)


def modules_reached(f: object, depth: int = 3) -> list[torch.nn.Module]:
    """The ``nn.Module`` objects a callable ``f`` can reach directly: itself, its bound
    ``__self__``, the function and arguments of a ``functools.partial``, ``__wrapped__``, and
    the values a function's closure cells and the globals its code names hold (recursively
    into functions found there, ``depth`` levels). Attributes of plain objects are not
    searched: a module held in a list in a global is not found."""
    found: dict[int, torch.nn.Module] = {}
    seen: set[int] = set()

    def visit(obj: object, level: int) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            found[id(obj)] = obj
            return
        if level <= 0 or isinstance(obj, (Tensor, str, bytes, int, float, type)):
            return
        if isinstance(obj, functools.partial):
            visit(obj.func, level - 1)
            for arg in (*obj.args, *obj.keywords.values()):
                visit(arg, level - 1)
            return
        owner = getattr(obj, "__self__", None)
        if owner is not None:
            visit(owner, level - 1)
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is not None:
            visit(wrapped, level - 1)
        func = getattr(obj, "__func__", obj)
        code = getattr(func, "__code__", None)
        if code is None:
            return
        for cell in getattr(func, "__closure__", None) or ():
            try:
                visit(cell.cell_contents, level - 1)
            except ValueError:  # an empty cell
                pass
        glob = getattr(func, "__globals__", None) or {}
        for name in code.co_names:
            value = glob.get(name)
            if value is not None and not isinstance(value, types.ModuleType):
                visit(value, level - 1)

    visit(f, depth)
    return list(found.values())


@contextlib.contextmanager
def _module_buffers_kept(modules: Sequence[torch.nn.Module]) -> Any:
    saved = None
    if any(m.training for module in modules for m in module.modules()):
        seen: set[int] = set()
        saved = []
        for module in modules:
            for b in module.buffers():
                if id(b) not in seen:
                    seen.add(id(b))
                    saved.append((b, b.detach().clone()))
    try:
        yield
    finally:
        if saved:
            with torch.no_grad():  # (kernels update running statistics without a version bump)
                for buf, copy in saved:
                    if not torch.equal(buf, copy):
                        buf.copy_(copy)


def graph_mode(create_graph: object, *, call: str) -> tuple[Any, bool]:
    """How a Jacobian treats autograd graphs: a context to run it in, and whether the result
    is detached. See NOTE [no graph outlives its chunk].

    Returns:
        ``(context, detached)``: ``torch.enable_grad()`` and False with
        ``create_graph=True``; no change and True by default; no change and False inside an
        outer torch.func transform, whose gradient must flow through.

    Raises:
        JacobianOptionError: ``create_graph`` is not a bool.
    """
    if not isinstance(create_graph, bool):
        raise JacobianOptionError(
            f"{call}: create_graph={create_graph!r}, but it must be True or False: whether "
            f"the result is differentiable (True) or detached (False, the default)."
        )
    if is_nested():
        return _NO_BUFFERS, False
    if create_graph:
        return torch.enable_grad(), False
    return _NO_BUFFERS, True


# NOTE [no graph outlives its chunk]
# Under grad mode, a product that involves tensors requiring grad (a module's parameters that
# f closes over) records an autograd graph, and a result that holds it keeps every chunk's
# graph alive: chunk_size and max_memory would bound nothing. Unless create_graph=True asks
# for a differentiable result, the Jacobian is detached, and:
# * reverse mode runs its products under torch.no_grad(): f itself still runs with grad
#   enabled inside torch.func's vjp (its own level), and a first-order pullback needs no graph;
# * forward mode keeps the caller's grad mode (f may itself call torch.func's reverse
#   transforms, whose pullbacks decide create_graph by the grad mode, and forward mode over a
#   pullback without create_graph is silently wrong for some operators, such as logdet), and
#   detaches each chunk's products as they are stored, so that a chunk's graph is freed
#   before the next chunk runs.
# Inside an outer torch.func transform nothing is detached: the outer transform
# differentiates through the result.


def is_nested() -> bool:
    """Whether we run inside a torch.func transform (vmap, grad, jvp) of an outer call."""
    return torch._C._functorch.maybe_current_level() is not None


def _unbatched_first(tree: Any) -> Any:
    return tree_map(lambda t: t[0] if isinstance(t, Tensor) else t, tree)


def map_rows(
    fn: Callable[..., Any],
    rows: Rows,
    n: int,
    *,
    vectorized: bool,
    chunk_size: int | None,
    extras: bool = False,
    batched_fn: Callable[..., Any] | None = None,
    detach: bool = False,
) -> tuple[list[Tensor], Any]:
    """Applies ``fn`` to ``n`` vectors and stacks the results along a new leading dimension.

    ``fn(*vector)`` takes one vector (a tuple of tensors, one per entry of ``rows``) and
    returns a tuple of tensors, or ``(tuple_of_tensors, extra)`` with ``extras=True`` where
    ``extra`` (an aux value) does not depend on the vector and is returned once. Vectors are
    taken ``chunk_size`` at a time (all at once for ``None``); each chunk runs under
    ``torch.vmap`` when ``vectorized`` (or through ``batched_fn``, a version of ``fn`` that
    takes a chunk of vectors itself), else one vector at a time in a Python loop; a chunk of
    one vector is always a plain call, as in torch.func.jacrev. Chunk results are written into
    one preallocated result (stacked instead inside an outer torch.func transform).

    With ``detach``, each chunk's results are detached as they are stored, so that no
    autograd graph outlives its chunk (NOTE [no graph outlives its chunk]).

    Returns:
        ``(stacked results, extra)``; ``extra`` is None without ``extras``.
    """
    step = n if chunk_size is None else min(chunk_size, n)
    collector = _Collector(n, detach)
    extra: Any = None
    if vectorized and batched_fn is None:
        batched_fn = vmap(fn)
    start = 0
    while start < n:
        stop = min(n, start + step)
        vecs = rows(start, stop)
        if vectorized and stop - start > 1:
            res = batched_fn(*vecs)  # type: ignore[misc]
            if extras:
                res, ex = res
                if start == 0:
                    extra = _unbatched_first(ex)
            collector.put(start, stop, res)
        else:
            for k in range(stop - start):
                res = fn(*[v[k] for v in vecs])
                if extras:
                    res, ex = res
                    if start + k == 0:
                        extra = ex
                collector.put_row(start + k, res)
        start = stop
    return collector.result(), extra


class _Collector:
    """Gathers chunk results into ``n`` stacked rows, allocating the result once."""

    __slots__ = ("n", "buffers", "pieces", "detach")

    def __init__(self, n: int, detach: bool = False) -> None:
        self.n = n
        self.buffers: list[Tensor] | None = None
        self.pieces: list[list[Tensor]] | None = None
        self.detach = detach

    def _prepare(self, like: Sequence[Tensor], stacked: bool) -> None:
        if self.buffers is not None or self.pieces is not None:
            return
        wrapped = any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in like)
        if wrapped:
            self.pieces = [[] for _ in like]
        else:
            self.buffers = [
                t.new_empty((self.n, *(t.shape[1:] if stacked else t.shape))) for t in like
            ]

    def put(self, start: int, stop: int, res: Sequence[Tensor]) -> None:
        if self.detach:
            res = [t.detach() for t in res]
        if start == 0 and stop == self.n:
            self.pieces = [[t] for t in res]
            return
        self._prepare(res, stacked=True)
        if self.buffers is not None:
            for buf, t in zip(self.buffers, res):
                buf[start:stop].copy_(t)
        else:
            for piece, t in zip(self.pieces, res):  # type: ignore[arg-type]
                piece.append(t)

    def put_row(self, i: int, res: Sequence[Tensor]) -> None:
        if self.detach:
            res = [t.detach() for t in res]
        if self.n == 1:
            self.pieces = [[t.unsqueeze(0)] for t in res]
            return
        self._prepare(res, stacked=False)
        if self.buffers is not None:
            for buf, t in zip(self.buffers, res):
                buf[i].copy_(t)
        else:
            for piece, t in zip(self.pieces, res):  # type: ignore[arg-type]
                piece.append(t.unsqueeze(0))

    def result(self) -> list[Tensor]:
        if self.buffers is not None:
            return self.buffers
        assert self.pieces is not None
        return [p[0] if len(p) == 1 else torch.cat(p) for p in self.pieces]


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, (MemoryError, torch.OutOfMemoryError))


# ---------------------------------------------------------------------------------------
# Warnings
# ---------------------------------------------------------------------------------------

_WARNED: set[tuple[Any, ...]] = set()



def function_key(f: object) -> object:
    """What identifies ``f`` for one-time warnings: its code object (the same for every
    lambda made by one line), or its type."""
    code = getattr(f, "__code__", None)
    if code is None:
        code = getattr(getattr(f, "forward", None), "__code__", None)
    return code if code is not None else type(f)


def function_name(f: object) -> str:
    name = getattr(f, "__qualname__", None) or getattr(f, "__name__", None)
    return str(name) if name else type(f).__name__


def warn_once(key: tuple[Any, ...], message: str) -> None:
    """Emits ``message`` as a :class:`JacobianWarning` the first time ``key`` is seen."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, JacobianWarning, stacklevel=_user_stacklevel())


def _quote(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 300:
        first = first[:297] + "..."
    return f"{type(err).__name__}: {first}"


# ---------------------------------------------------------------------------------------
# The Jacobian engine
# ---------------------------------------------------------------------------------------


class Blocks:
    """The result of :func:`jacobian_blocks`: ``blocks[j][i]`` is the Jacobian of flat output
    ``j`` with respect to flat input leaf ``i``; ``views[j][i]`` holds the same elements (a
    row slice of the stacked products), cheap to scan for all-zero blocks; ``connected`` is
    True when every output was seen to depend on the differentiated leaves through autograd
    (it requires grad in reverse mode, it has a tangent in forward mode)."""

    __slots__ = ("blocks", "out_spec", "aux", "mode", "views", "connected")

    def __init__(
        self,
        blocks: list[list[Tensor]],
        out_spec: TreeSpec,
        aux: Any,
        mode: str,
        views: list[list[Tensor]] | None = None,
        connected: bool = False,
    ):
        self.blocks = blocks
        self.out_spec = out_spec
        self.aux = aux
        self.mode = mode
        self.views = views if views is not None else blocks
        self.connected = connected


def _row_shapes(flat_out: Sequence[Tensor], batch: int | None, prob: Problem) -> list[torch.Size]:
    if batch is None:
        return [o.shape for o in flat_out]
    for j, o in enumerate(flat_out):
        if o.dim() == 0 or o.shape[0] != batch:
            where = "the output of f" if len(flat_out) == 1 else f"output {j} of f"
            raise JacobianCallError(
                f"{prob.call}: {where} has shape {shape_str(o.shape)}, but x has shape "
                f"{shape_str(prob.leaves[0].shape)}: f must map a batch row by row, "
                f"(B, *in) -> (B, *out), so every output needs the leading dimension "
                f"B = {batch}.\n"
                f"  If f reduces over the batch (a loss, a mean), its Jacobian mixes "
                f"examples: use torch_vjp.jacobian instead (or torch_vjp.per_sample_grads "
                f"for per-example gradients of a loss)."
            )
    return [o.shape[1:] for o in flat_out]


def _sizes_text(n_out: int, n_in: int, batch: int | None, dtype: torch.dtype) -> str:
    if batch is None:
        return (
            f"{n_out * n_in:,} {_dtype_name(dtype)} elements, {n_out:,} output elements "
            f"times {n_in:,} input elements"
        )
    return (
        f"{batch * n_out * n_in:,} {_dtype_name(dtype)} elements, B = {batch:,} blocks of "
        f"{n_out:,} output elements times {n_in:,} input elements"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


JACOBIAN_ALTERNATIVES = (
    "torch_vjp.vjp / torch_vjp.jvp give products of the Jacobian with vectors without "
    "forming it (batched=True for many at once); torch_vjp.batch_jacobian gives only the "
    "per-example blocks when f maps a batch row by row; a smaller argnums (or fewer "
    "outputs) gives a smaller block; or pass a larger max_memory if the memory is there."
)


def _plan(
    prob: Problem,
    mode: str,
    out_rows: Sequence[torch.Size],
    out_dtypes: Sequence[torch.dtype],
    opts: Any,
    records: bool = False,
) -> int | None:
    """The chunk size for this Jacobian; see NOTE [memory model]. ``records``: the products
    record autograd graphs that live until their chunk is stored (NOTE [no graph outlives
    its chunk]), which :data:`GRAPH_FACTOR` more working memory per product stands for."""
    in_rows = _in_rows(prob, opts.batch)
    n_out = sum(math.prod(s) for s in out_rows)
    n_in = sum(math.prod(s) for s in in_rows)
    itemsize = max(
        max(d.itemsize for d in out_dtypes), max(leaf.dtype.itemsize for leaf in prob.leaves)
    )
    b = 1 if opts.batch is None else opts.batch
    n_vectors = n_out if mode == "rev" else n_in
    jac_bytes = itemsize * n_out * n_in * b
    per_vector = WORK_FACTOR * itemsize * (n_out + n_in) * b
    if records:
        per_vector *= GRAPH_FACTOR
    if (
        opts.chunk_size is None
        and opts.max_memory is None
        and jac_bytes + n_vectors * per_vector <= SMALL_REQUEST
    ):
        return None  # what plan_chunk returns for a small request without options
    res_dtype = prob.leaves[0].dtype if mode == "rev" else out_dtypes[0]
    return plan_chunk(
        n_vectors,
        jac_bytes,
        per_vector,
        chunk_size=opts.chunk_size,
        max_memory=opts.max_memory,
        device=prob.leaves[0].device,
        call=prob.call,
        what=lambda: _sizes_text(n_out, n_in, opts.batch, res_dtype),
        alternatives=opts.alternatives,
    )


class _Opts:
    """The per-call options every engine function needs."""

    __slots__ = ("batch", "chunk_size", "max_memory", "alternatives", "probe", "detached")

    def __init__(
        self,
        batch: int | None,
        chunk_size: int | None,
        max_memory: int | None,
        alternatives: str,
        probe: Callable[[], tuple[list[Tensor], TreeSpec]] | None,
        detached: bool = False,
    ) -> None:
        self.batch = batch
        self.chunk_size = chunk_size
        self.max_memory = max_memory
        self.alternatives = alternatives
        self.probe = probe
        self.detached = detached


class _Shapes:
    """The outputs' sizes, known before any derivative is computed (from the probe, or
    remembered from an earlier call: see NOTE [output sizes])."""

    __slots__ = ("flat", "spec", "rows", "key", "records")

    def __init__(
        self,
        flat: list[Tensor],
        spec: TreeSpec,
        rows: list[torch.Size],
        key: Any = None,
        records: bool = False,
    ) -> None:
        self.flat = flat
        self.spec = spec
        self.rows = rows
        self.key = key  # the cache entry these came from, if any
        # f involves tensors that require grad (closed-over parameters), so products in the
        # caller's grad mode record graphs (NOTE [no graph outlives its chunk])
        self.records = records

    def check(self, flat: Sequence[Tensor], spec: TreeSpec) -> None:
        """Raises :class:`_StaleShapes` if remembered sizes do not match the outputs."""
        if self.key is None:
            return
        if spec != self.spec or any(
            o.shape != m.shape or o.dtype != m.dtype for o, m in zip(flat, self.flat)
        ):
            _SHAPES.pop(self.key, None)
            raise _StaleShapes


class _StaleShapes(Exception):
    """Remembered output sizes turned out wrong: compute again, probing first."""


# NOTE [output sizes]
# Forward mode (and "auto", to choose) needs the sizes of f's outputs before it computes
# anything, for the memory plan: the probe runs f once without a graph. For the same f
# (the same object, held weakly) called on primals of the same shapes, dtypes and devices,
# the sizes found are remembered and the probe is skipped, so that repeated calls cost no
# more than torch.func.jacfwd. Remembered sizes are checked against the outputs the
# products produce; a mismatch (f's output changed for the same input shapes) discards
# them and the call starts over with a probe.
_SHAPES: dict[Any, tuple[Any, list[Tensor], TreeSpec, list[torch.Size], bool]] = {}
_SHAPES_MAX = 256


def _shapes_key(prob: Problem, opts: _Opts) -> Any:
    """The cache key of this call's output sizes, or None where they cannot be cached
    (computed once per :class:`Problem` and batch size)."""
    if opts.probe is not None:
        return None
    try:
        return prob._keys[opts.batch]
    except KeyError:
        pass
    key = prob._keys[opts.batch] = _new_shapes_key(prob, opts.batch)
    return key


def _new_shapes_key(prob: Problem, batch: int | None) -> Any:
    f = prob.f
    owner = getattr(f, "__self__", None)
    target, fid = (owner, id(getattr(f, "__func__", f))) if owner is not None else (f, None)
    try:
        ref = weakref.ref(target)
    except TypeError:
        return None
    sig: list[Any] = []
    for p in prob.primals:
        if isinstance(p, Tensor):
            sig.append((p.shape, p.dtype, p.device))
        elif p is None or isinstance(p, (bool, int, float, str)):
            sig.append((type(p), p))
        else:  # a pytree (a dict of parameters, say): its structure and its leaves' sizes
            leaves, spec = tree_flatten(p)
            if spec.is_leaf():
                return None
            sig.append(spec)
            for leaf in leaves:
                if isinstance(leaf, Tensor):
                    sig.append((leaf.shape, leaf.dtype, leaf.device))
                elif leaf is None or isinstance(leaf, (bool, int, float, str)):
                    sig.append((type(leaf), leaf))
                else:
                    return None
    key = (id(target), fid, ref, tuple(sig), prob.argnums, prob.int_argnums, prob.has_aux,
           batch)
    try:
        hash(key)
    except TypeError:  # an unhashable f
        return None
    return key


def _probe_shapes(prob: Problem, opts: _Opts) -> _Shapes:
    key = _shapes_key(prob, opts)
    record = opts.detached and torch.is_grad_enabled()
    if key is not None:
        hit = _SHAPES.get(key)
        if hit is not None:
            return _Shapes(hit[1], hit[2], hit[3], key, record and hit[4])
    if opts.probe is not None:
        flat, spec = opts.probe()
    else:
        flat, spec = prob.probe(record)
    records = record and any(o.requires_grad for o in flat)
    rows = _row_shapes(flat, opts.batch, prob)
    if key is not None:
        if len(_SHAPES) >= _SHAPES_MAX:
            _SHAPES.pop(next(iter(_SHAPES)))
        meta = [torch.empty(o.shape, dtype=o.dtype, device="meta") for o in flat]
        _SHAPES[key] = (key[2], meta, spec, rows, records)
    return _Shapes([o.detach() for o in flat], spec, rows, None, records)


def _in_rows(prob: Problem, batch: int | None) -> list[torch.Size]:
    return [leaf.shape if batch is None else leaf.shape[1:] for leaf in prob.leaves]


def jacobian_blocks(
    prob: Problem,
    mode: str | None,
    *,
    vectorized: bool,
    fallback: bool,
    chunk_size: int | None,
    max_memory: int | None,
    batch: int | None = None,
    probe: Callable[[], tuple[list[Tensor], TreeSpec]] | None = None,
    alternatives: str = JACOBIAN_ALTERNATIVES,
    functorch_loops: bool = False,
    detached: bool = False,
) -> Blocks:
    """Computes every block of the Jacobian of ``prob.g``.

    Args:
        prob: the function of the differentiated leaves.
        mode: ``"rev"``, ``"fwd"``, or ``None`` to choose by size (``"auto"``).
        vectorized: products under ``torch.vmap`` (else a Python loop).
        fallback: on a failure of the vectorised products, fall back as NOTE [auto
            fallback] says (``"auto"``).
        chunk_size: products at once (checked), or None.
        max_memory: the budget in bytes, or None for the free memory.
        batch: for ``batch_jacobian``: the batch size B; basis vectors are broadcast over
            the batch and blocks are ``(B, *out_row, *in_row)``.
        probe: returns the flat outputs (tensors or meta tensors of the right shapes) and
            their structure without computing derivatives; ``prob.probe`` by default.
            Forward mode needs the output sizes before it runs, for the memory plan.
        alternatives: the alternatives named by a :class:`JacobianMemoryError`.
        functorch_loops: loops use torch.func's vjp/jvp (composable with outer transforms,
            as the inner Jacobian of a Hessian needs) rather than plain autograd.
        detached: the result needs no autograd graph (NOTE [no graph outlives its chunk]).

    Returns:
        The blocks, the output structure, the aux value and the mode used.
    """
    opts = _Opts(batch, chunk_size, max_memory, alternatives, probe, detached)
    try:
        return _blocks(prob, mode, vectorized, fallback, opts, functorch_loops)
    except _StaleShapes:  # remembered output sizes were wrong: they are gone now
        return _blocks(prob, mode, vectorized, fallback, opts, functorch_loops)


def _blocks(
    prob: Problem,
    mode: str | None,
    vectorized: bool,
    fallback: bool,
    opts: _Opts,
    functorch_loops: bool,
) -> Blocks:
    batch = opts.batch
    shapes: _Shapes | None = None
    if mode != "rev":
        shapes = _probe_shapes(prob, opts)
        if mode is None:
            n_in = sum(math.prod(s) for s in _in_rows(prob, batch))
            mode = choose_mode(n_in, sum(math.prod(s) for s in shapes.rows))
    if not vectorized:
        return _loop(prob, mode, shapes, opts, functorch_loops)
    if not fallback:
        return _vectorized(prob, mode, shapes, opts)
    return _auto(prob, mode, shapes, opts, functorch_loops)


def _vectorized(prob: Problem, mode: str, shapes: _Shapes | None, opts: _Opts) -> Blocks:
    if mode == "rev":
        return _rev(prob, opts, vectorized=True)
    return _fwd(prob, shapes or _probe_shapes(prob, opts), opts, vectorized=True)


def _loop(
    prob: Problem, mode: str, shapes: _Shapes | None, opts: _Opts, functorch: bool
) -> Blocks:
    """One product at a time: with torch.func (composable with outer transforms, like
    ``torch.func.jacrev(chunk_size=1)``), or, at top level where torch.func cannot run ``f``
    at all (an old-style custom Function, NumPy), with plain autograd."""

    def with_func() -> Blocks:
        if mode == "rev":
            return _rev(prob, opts, vectorized=False)
        return _fwd(prob, shapes or _probe_shapes(prob, opts), opts, vectorized=False)

    if functorch or is_nested() or _forward_ad_active(prob.leaves):
        return with_func()
    try:
        return with_func()
    except Exception as err:  # noqa: BLE001 - plain autograd decides below
        if _passes_through(err):
            raise
    if mode == "rev":
        return _rev_plain(prob, opts)
    return _fwd_plain(prob, shapes or _probe_shapes(prob, opts), opts)


def _forward_ad_active(leaves: Sequence[Tensor]) -> bool:
    """Whether plain forward-mode AD is running around us (then plain loops would break
    it: it does not nest)."""
    if getattr(fwAD, "_current_level", -1) >= 0:
        return True
    return any(fwAD.unpack_dual(x).tangent is not None for x in leaves)


def _passes_through(err: BaseException) -> bool:
    """Errors that no fallback may hide: out of memory, torch_vjp's own, and the signal to
    start over (see NOTE [output sizes])."""
    return isinstance(err, (MemoryError, torch.OutOfMemoryError, TorchVJPError, _StaleShapes))


def _auto(
    prob: Problem, mode: str, shapes: _Shapes | None, opts: _Opts, functorch: bool
) -> Blocks:
    """The vectorised strategy, then its loop, then (from forward mode) reverse mode.
    See NOTE [auto fallback]."""
    try:
        return _vectorized(prob, mode, shapes, opts)
    except Exception as err:  # noqa: BLE001 - classified: the loop below decides
        if _passes_through(err):
            raise
        failure = err
    try:
        res = _loop(prob, mode, shapes, opts, functorch)
    except Exception as err:  # noqa: BLE001
        if mode == "rev" or _passes_through(err):
            raise
        loop_failure = err
    else:
        warn_once(
            ("vmap-fallback", function_key(prob.f), mode, type(failure)),
            _fallback_message(prob, mode, failure),
        )
        return res
    warn_once(
        ("fwd-to-rev", function_key(prob.f), type(loop_failure)),
        f"{prob.call}: forward-mode AD fails on f ({function_name(prob.f)}), so "
        f"strategy='auto' uses reverse mode instead, which may be slower for this shape.\n"
        f"  Forward mode said: {_quote(loop_failure)}\n"
        f"  Pass strategy='rev' to skip the forward-mode attempts. This warning is shown "
        f"once per function.",
    )
    return _auto(prob, "rev", shapes, opts, functorch)


def _fallback_message(prob: Problem, mode: str, err: BaseException) -> str:
    loop = f"{mode}-loop"
    unit = "JVP per input element" if mode == "fwd" else "VJP per output element"
    return (
        f"{prob.call}: strategy='auto' could not vectorise the Jacobian of "
        f"{function_name(prob.f)} (strategy={mode!r}: torch.func transforms under "
        f"torch.vmap), so it used strategy={loop!r}: one {unit} at a time in a Python loop, "
        f"usually many times slower.\n"
        f"  The vectorised attempt said: {_quote(err)}\n"
        f"  Typical causes: a custom autograd.Function without setup_context or vmap "
        f"support, or with .item() or Python control flow on tensor values in its backward; "
        f"NumPy calls inside f; an operator without a batching rule. Pass "
        f"strategy={loop!r} to skip the vectorised attempt. This warning is shown once per "
        f"function."
    )


def run_with_fallback(
    fn: Callable[..., Any],
    rows: Rows,
    n: int,
    *,
    vectorized: bool,
    fallback: bool,
    chunk: int | None,
    warn_key: tuple[Any, ...],
    message: Callable[[Exception], str],
    extras: bool = False,
    batched_fn: Callable[..., Any] | None = None,
) -> tuple[list[Tensor], Any]:
    """:func:`map_rows`, falling back to a loop when the vectorised products fail.

    With ``fallback``, a failure of the vectorised products is followed by one product
    computed unbatched: if that raises, its error propagates untouched; else ``message(err)``
    is warned once per ``warn_key`` and the products are computed in a loop.
    """
    if not (fallback and vectorized) or n == 1 or chunk == 1:  # no vmap: nothing to fall back from
        return map_rows(
            fn, rows, n, vectorized=vectorized, chunk_size=chunk, extras=extras,
            batched_fn=batched_fn,
        )
    try:
        return map_rows(
            fn, rows, n, vectorized=True, chunk_size=chunk, extras=extras, batched_fn=batched_fn
        )
    except Exception as err:  # noqa: BLE001 - classified below, never swallowed blindly
        if _passes_through(err):
            raise
        failure = err
    # One product, unbatched: an error here is not vmap's, and propagates.
    fn(*[v[0] for v in rows(0, 1)])
    warn_once(warn_key + (type(failure),), message(failure))
    return map_rows(fn, rows, n, vectorized=False, chunk_size=chunk, extras=extras)


def _rev_blocks(
    stacked: Sequence[Tensor], out_rows: Sequence[torch.Size], batch: int | None
) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
    """stacked[i]: (n_out, [B,] *in_i) -> blocks[j][i]: ([B,] *out_j, *in_i), and the row
    slices they are views of."""
    numels = [math.prod(s) for s in out_rows]
    blocks: list[list[Tensor]] = [[] for _ in out_rows]
    views: list[list[Tensor]] = [[] for _ in out_rows]
    for res_i in stacked:
        parts = res_i.split(numels) if len(numels) > 1 else (res_i,)
        tail = res_i.shape[1:]
        for j, part in enumerate(parts):
            block = part.reshape((*out_rows[j], *tail))
            if batch is not None:
                block = block.movedim(len(out_rows[j]), 0)
            blocks[j].append(block)
            views[j].append(part)
    return blocks, views


def _fwd_blocks(
    stacked: Sequence[Tensor], in_rows: Sequence[torch.Size]
) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
    """stacked[j]: (n_in, [B,] *out_j) -> blocks[j][i]: ([B,] *out_j, *in_i), views of
    ``stacked[j]`` (returned twice: they are also the views to scan for zeros, holding the
    same elements as the row slices, first element first)."""
    numels = [math.prod(s) for s in in_rows]
    blocks: list[list[Tensor]] = []
    for res_j in stacked:
        moved = res_j.movedim(0, -1)
        parts = moved.split(numels, dim=-1) if len(numels) > 1 else (moved,)
        row_blocks = []
        for part, shape in zip(parts, in_rows):
            if len(shape) == 0:
                part = part.squeeze(-1)
            elif len(shape) > 1:
                part = part.unflatten(-1, shape)
            row_blocks.append(part)
        blocks.append(row_blocks)
    return blocks, blocks


# NOTE [per-call overhead]
# torch.func.jacrev and jacfwd cost little more than the vmapped products themselves, so
# every microsecond of Python around the products shows in the ratio to them on small and
# medium Jacobians. The vectorised strategies therefore take a direct path in the common
# case (every product in one chunk): the basis is one ``torch.eye``, the products one
# ``vmap`` call whose stacked result is used as it is (a view of it per block, no copy), and
# nothing is flattened where the structure is a single tensor. With one differentiated
# tensor, reverse mode uses torch.func's ``_vjp_with_argnums(argnums=0)``, as jacrev does:
# its pullback returns a tensor rather than a 1-tuple, which vmap handles with less pytree
# work. For ``batch_jacobian`` the basis vectors repeated over the batch are materialised
# rather than broadcast (a stride-0 batch dimension makes the first matmul of every product
# run as a loop of small matrix products, each copying its operand; materialised, it is one
# matrix product): this is the memory that NOTE [memory model] already counts per product;
# benchmarks/bench_jacobian.py times batch_jacobian against vmap(jacrev(f_single)) (B = 64,
# 32 -> 32 MLP). Several chunks, loops and batched aux values go through :func:`map_rows`.


def _eye_basis(
    shape: torch.Size, n: int, dtype: torch.dtype, device: torch.device, batch: int | None
) -> Tensor:
    """All ``n`` rows of the standard basis over one tensor of ``shape`` (``n`` elements):
    ``(n, *shape)``, or ``(n, batch, *shape)`` repeated over a batch (materialised: see
    NOTE [per-call overhead]); as ``basis_rows`` gives for one shape, in one call."""
    z = torch.eye(n, dtype=dtype, device=device)
    if len(shape) != 1:
        z = z.view(n, *shape)
    if batch is not None:
        z = z.unsqueeze(1).expand(n, batch, *shape).contiguous()
    return z


def _rev(prob: Problem, opts: _Opts, *, vectorized: bool) -> Blocks:
    """Reverse mode with torch.func: one ``vjp`` forward, then its pullback per output
    element, under vmap or in a loop (under ``torch.no_grad()`` for a detached result: NOTE
    [no graph outlives its chunk])."""
    if opts.detached:
        with torch.no_grad():
            return _rev_products(prob, opts, vectorized=vectorized)
    return _rev_products(prob, opts, vectorized=vectorized)


def _rev_products(prob: Problem, opts: _Opts, *, vectorized: bool) -> Blocks:
    connected = [False]
    has_aux = prob.has_aux
    prob_g = prob.g

    def g(*xs: Tensor) -> Any:
        res = prob_g(*xs)
        out = res[0] if has_aux else res
        if isinstance(out, Tensor):
            connected[0] = out.requires_grad
        else:
            connected[0] = all(o.requires_grad for o in tree_leaves(out))
        return res

    leaves = prob.leaves
    nested = is_nested()
    one_leaf = len(leaves) == 1 and _vjp_with_argnums is not None
    if one_leaf:  # the pullback returns a tensor
        res = _vjp_with_argnums(g, leaves[0], argnums=0, has_aux=has_aux)
    else:  # the pullback returns a tuple, one tensor per leaf
        res = _func_vjp(g, *leaves, has_aux=has_aux)
    out, pullback = res[0], res[1]
    if nested:
        # Differentiated by an outer transform (a Hessian's forward-over-reverse): the
        # backward pass must itself be differentiable. torch.func's pullback decides by the
        # grad mode, which graph_mode turns off at top level; and forward mode over a
        # pullback run without create_graph is silently wrong for some operators (logdet).
        pullback = functools.partial(pullback, create_graph=True)
    aux = res[2] if has_aux else None
    if isinstance(out, Tensor):
        flat_out, out_spec = [out], _LEAF_SPEC
    else:
        flat_out, out_spec = tree_flatten(out)
    out_rows = _row_shapes(flat_out, opts.batch, prob)
    n = sum(math.prod(s) for s in out_rows)
    out_dtypes = [o.dtype for o in flat_out]
    chunk = _plan(prob, "rev", out_rows, out_dtypes, opts)
    if n == 0:
        stacked = [leaf.new_zeros((0, *leaf.shape)) for leaf in leaves]
    else:
        if out_spec.is_leaf():
            fn = pullback
        else:

            def fn(*cot: Tensor) -> Any:
                return pullback(tree_unflatten(list(cot), out_spec))

        if vectorized and chunk is None and n > 1:  # NOTE [per-call overhead]
            if len(flat_out) == 1:
                o = flat_out[0]
                vecs: tuple[Tensor, ...] = (
                    _eye_basis(out_rows[0], n, o.dtype, o.device, opts.batch),
                )
            else:
                vecs = basis_rows(
                    out_rows, out_dtypes, [o.device for o in flat_out], opts.batch
                )(0, n)
                if opts.batch is not None:
                    vecs = tuple(v.contiguous() for v in vecs)
            products = vmap(fn)(*vecs)
            stacked = [products] if one_leaf else list(products)
        else:
            if one_leaf:
                pb = fn

                def fn(*cot: Tensor) -> Any:
                    return (pb(*cot),)

            rows = basis_rows(out_rows, out_dtypes, [o.device for o in flat_out], opts.batch)
            stacked, _ = map_rows(fn, rows, n, vectorized=vectorized, chunk_size=chunk)
    blocks, views = _rev_blocks(stacked, out_rows, opts.batch)
    return Blocks(blocks, out_spec, aux, "rev", views, connected[0])


def _fwd(prob: Problem, shapes: _Shapes, opts: _Opts, *, vectorized: bool) -> Blocks:
    """Forward mode with torch.func: ``jvp`` per input element, under vmap or in a loop."""
    leaves = tuple(prob.leaves)
    in_rows = _in_rows(prob, opts.batch)
    n = sum(math.prod(s) for s in in_rows)
    chunk = _plan(prob, "fwd", shapes.rows, [o.dtype for o in shapes.flat], opts, shapes.records)
    has_aux = prob.has_aux
    connected = [False]
    prob_g = prob.g
    check = shapes.check
    unpack_dual = fwAD.unpack_dual

    def g(*xs: Tensor) -> Any:
        res = prob_g(*xs)
        out = res[0] if has_aux else res
        if isinstance(out, Tensor):
            check((out,), _LEAF_SPEC)
            connected[0] = unpack_dual(out).tangent is not None
        else:
            flat, spec = tree_flatten(out)
            check(flat, spec)
            connected[0] = all(unpack_dual(o).tangent is not None for o in flat)
        return res

    aux = None
    if n == 0:
        stacked = [o.new_zeros((0, *o.shape), device=leaves[0].device) for o in shapes.flat]
        if has_aux:
            with torch.no_grad():
                aux = prob.g(*leaves)[1]
    elif vectorized and chunk is None and n > 1 and not has_aux:  # NOTE [per-call overhead]

        def push(*tangents: Tensor) -> Any:
            tan = _func_jvp(g, leaves, tangents)[1]
            return tan if isinstance(tan, Tensor) else tuple(tree_leaves(tan))

        if len(leaves) == 1:
            x = leaves[0]
            vecs: tuple[Tensor, ...] = (_eye_basis(in_rows[0], n, x.dtype, x.device, opts.batch),)
        else:
            vecs = basis_rows(
                in_rows, [x.dtype for x in leaves], [x.device for x in leaves], opts.batch
            )(0, n)
            if opts.batch is not None:
                vecs = tuple(v.contiguous() for v in vecs)
        products = vmap(push)(*vecs)
        stacked = [products] if isinstance(products, Tensor) else list(products)
    else:

        def fn(*tangents: Tensor) -> Any:
            res = _func_jvp(g, leaves, tangents, has_aux=has_aux)
            tan = res[1]
            tan_flat = (tan,) if isinstance(tan, Tensor) else tuple(tree_leaves(tan))
            return (tan_flat, res[2]) if has_aux else tan_flat

        rows = basis_rows(
            in_rows, [x.dtype for x in leaves], [x.device for x in leaves], opts.batch
        )
        stacked, aux = map_rows(
            fn, rows, n, vectorized=vectorized, chunk_size=chunk, extras=has_aux,
            detach=opts.detached,
        )
    if opts.detached:
        stacked = [t.detach() for t in stacked]
    blocks, views = _fwd_blocks(stacked, in_rows)
    return Blocks(blocks, shapes.spec, aux, "fwd", views, connected[0])


def _detach_tree(tree: Any) -> Any:
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, tree)


def _rev_plain(prob: Problem, opts: _Opts) -> Blocks:
    """Reverse mode with plain autograd, one ``torch.autograd.grad`` per output element
    (under ``torch.no_grad()`` for a detached result, as :func:`_rev`)."""
    if opts.detached:
        with torch.no_grad():
            return _rev_plain_products(prob, opts)
    return _rev_plain_products(prob, opts)


def _rev_plain_products(prob: Problem, opts: _Opts) -> Blocks:
    """Reverse mode with plain autograd, one ``torch.autograd.grad`` per output element.

    No torch.func transform is involved, so functions that torch.func cannot run (a custom
    ``autograd.Function`` without ``setup_context``, NumPy calls) work here. The result is
    differentiable (``create_graph``) when grad mode is on and a primal requires grad.
    """
    need_graph = torch.is_grad_enabled() and any(x.requires_grad for x in prob.leaves)
    with torch.enable_grad():
        xs = [x.view_as(x) if need_graph else x.detach().requires_grad_() for x in prob.leaves]
        res = prob.g(*xs)
    out = res[0] if prob.has_aux else res
    aux = None
    if prob.has_aux:
        aux = res[1] if need_graph else _detach_tree(res[1])
    flat_out, out_spec = tree_flatten(out)
    out_rows = _row_shapes(flat_out, opts.batch, prob)
    n = sum(math.prod(s) for s in out_rows)
    chunk = _plan(prob, "rev", out_rows, [o.dtype for o in flat_out], opts)
    diff = [j for j, o in enumerate(flat_out) if o.requires_grad]
    d_outs = [flat_out[j] for j in diff]
    connected = len(diff) == len(flat_out)

    def fn(*cot: Tensor) -> tuple[Tensor, ...]:
        if not d_outs:
            return tuple(torch.zeros_like(x) for x in xs)
        grads = torch.autograd.grad(
            d_outs, xs, [cot[j] for j in diff], retain_graph=True, create_graph=need_graph,
            allow_unused=True,
        )
        return tuple(torch.zeros_like(x) if gx is None else gx for gx, x in zip(grads, xs))

    if n == 0:
        stacked = [x.new_zeros((0, *x.shape)) for x in prob.leaves]
    else:
        rows = basis_rows(
            out_rows, [o.dtype for o in flat_out], [o.device for o in flat_out], opts.batch
        )
        stacked, _ = map_rows(fn, rows, n, vectorized=False, chunk_size=chunk)
    blocks, views = _rev_blocks(stacked, out_rows, opts.batch)
    return Blocks(blocks, out_spec, aux, "rev", views, connected)


def _fwd_plain(prob: Problem, shapes: _Shapes, opts: _Opts) -> Blocks:
    """Forward mode with plain forward-mode AD (``torch.autograd.forward_ad``), one
    forward pass with dual tensors per input element."""
    leaves = prob.leaves
    in_rows = _in_rows(prob, opts.batch)
    n = sum(math.prod(s) for s in in_rows)
    chunk = _plan(prob, "fwd", shapes.rows, [o.dtype for o in shapes.flat], opts, shapes.records)
    has_aux = prob.has_aux

    def primal(t: Any) -> Any:
        return fwAD.unpack_dual(t).primal if isinstance(t, Tensor) else t

    connected = [True]

    def fn(*tangents: Tensor) -> Any:
        with fwAD.dual_level():
            duals = [fwAD.make_dual(x, t) for x, t in zip(leaves, tangents)]
            res = prob.g(*duals)
            out = res[0] if has_aux else res
            flat, spec = tree_flatten(out)
            shapes.check(flat, spec)
            tans = []
            for o in flat:
                p, t = fwAD.unpack_dual(o)
                if t is None:
                    connected[0] = False
                    t = torch.zeros_like(p)
                tans.append(t)
            aux = tree_map(primal, res[1]) if has_aux else None
        return (tuple(tans), aux) if has_aux else tuple(tans)

    aux = None
    if n == 0:
        stacked = [o.new_zeros((0, *o.shape), device=leaves[0].device) for o in shapes.flat]
        if has_aux:
            with torch.no_grad():
                aux = prob.g(*leaves)[1]
    else:
        rows = basis_rows(
            in_rows, [x.dtype for x in leaves], [x.device for x in leaves], opts.batch
        )
        stacked, aux = map_rows(fn, rows, n, vectorized=False, chunk_size=chunk, extras=has_aux,
                                detach=opts.detached)
    blocks, views = _fwd_blocks(stacked, in_rows)
    return Blocks(blocks, shapes.spec, aux, "fwd", views, connected[0] and n > 0)


def assemble(prob: Problem, res: Blocks) -> Any:
    """Arranges blocks in torch.func's layout: the output's pytree, each leaf replaced by
    the differentiated primals' structure (the primal for an int ``argnums``, a tuple of
    them for a tuple) holding that output's Jacobian blocks."""
    if prob.in_spec.is_leaf() and res.out_spec.num_leaves == 1:
        per_out = [res.blocks[0][0]]
        if res.out_spec.is_leaf():
            return per_out[0]
        return tree_unflatten(per_out, res.out_spec)
    per_out = [tree_unflatten(row, prob.in_spec) for row in res.blocks]
    return tree_unflatten(per_out, res.out_spec)


# ---------------------------------------------------------------------------------------
# Disconnected outputs
# ---------------------------------------------------------------------------------------


def _perturbation_scale(dtype: torch.dtype) -> float:
    eps = torch.finfo(dtype).eps
    return 1e-3 if eps < 1e-4 else 16 * eps


def _differs(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape:
        return True
    differ = a != b
    if a.is_floating_point():
        differ &= ~(a.isnan() & b.isnan())
    return bool(differ.any())


_VERIFIED: dict[Any, None] = {}


def warn_disconnected(prob: Problem, res: Blocks, batch: int | None = None) -> None:
    """Warns about each all-zero block whose output does not depend on its input through
    autograd although its value does.

    Free in the usual case: every output was seen to depend on the one input (see
    :class:`Blocks`); with several inputs, each block's first element, else the block, is
    checked for zeros, once per function and input shapes (the key of NOTE [output
    sizes]) as long as every block is found non-zero.
    Only for an all-zero block does it re-run ``f`` with fresh leaves to ask autograd
    whether the output is connected to the input (a connected zero block is a true zero
    derivative), and, if it is not, run ``f`` at a slightly moved input (with the same
    random state) to see whether the value changes: an output that changes but has no
    autograd path went through ``.item()``, ``.numpy()``, ``torch.tensor(...)`` or
    ``.detach()``, and its block of zeros is not its derivative. Skipped inside outer
    torch.func transforms.
    """
    if res.connected and len(prob.leaves) == 1:
        return  # every output depends on the one input through autograd
    if is_nested() or torch.compiler.is_compiling():
        return
    key = None
    if res.connected:  # several inputs: scanned once per function and input shapes
        key = _shapes_key(prob, _Opts(batch, None, None, "", None))
        if key is not None and key in _VERIFIED:
            return
    flat = [(j, i, v) for j, row in enumerate(res.views) for i, v in enumerate(row) if v.numel()]
    if not flat:
        return
    # Each block's first element settles most blocks; only blocks whose first element is
    # zero are scanned in full.
    nonzero = [v[(0,) * v.dim()].item() != 0 for _, _, v in flat]
    for k, (nz, (_, _, v)) in enumerate(zip(nonzero, flat)):
        if not nz and v.numel() > 1:
            nonzero[k] = bool(v.any())
    zero_pairs = [(j, i) for (j, i, _), nz in zip(flat, nonzero) if not nz]
    if not zero_pairs:
        if key is not None:
            if len(_VERIFIED) >= _SHAPES_MAX:
                _VERIFIED.pop(next(iter(_VERIFIED)))
            _VERIFIED[key] = None
        return
    leaves = [x.detach().requires_grad_() for x in prob.leaves]
    with torch.enable_grad():
        out = prob.g(*leaves)
    flat_out = tree_leaves(out[0] if prob.has_aux else out)
    disconnected = []
    for j, i in zero_pairs:
        o = flat_out[j]
        if o.requires_grad:
            (gi,) = torch.autograd.grad(
                o, leaves[i], torch.ones_like(o), allow_unused=True, retain_graph=True
            )
            if gi is not None:
                continue
        disconnected.append((j, i))
    if not disconnected:
        return
    del out, flat_out
    devices = sorted(
        {x.device.index or 0 for x in prob.leaves if x.device.type == "cuda"}
    )
    gen = torch.Generator().manual_seed(0)

    def evaluate(xs: Sequence[Tensor]) -> list[Tensor]:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            r = prob.g(*xs)
        return tree_leaves(r[0] if prob.has_aux else r)

    base = evaluate(prob.leaves)
    moved_by_input: dict[int, list[Tensor]] = {}
    out_paths = tree_flatten_with_path(tree_unflatten(list(range(len(base))), res.out_spec))[0]
    for j, i in disconnected:
        if i not in moved_by_input:
            x = prob.leaves[i]
            noise = torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device)
            step = _perturbation_scale(x.dtype) * (1 + x.detach().abs()) * noise
            xs = list(prob.leaves)
            xs[i] = x.detach() + step
            moved_by_input[i] = evaluate(xs)
        if not _differs(base[j], moved_by_input[i][j]):
            continue
        path = out_paths[j][0]
        out_name = "the output of f" if res.out_spec.is_leaf() else _leaf_name(path, "output")
        warnings.warn(
            f"{prob.call}: {out_name} does not depend on {prob.leaf_name(i)} through "
            f"autograd, although its value changes when {prob.leaf_name(i)} changes: its "
            f"Jacobian block is all zeros, which is not its derivative.\n"
            f"  f turns a tensor computed from {prob.leaf_name(i)} into a Python number or "
            f"NumPy array (.item(), .tolist(), .numpy(), float(...), torch.tensor(...)), or "
            f"calls .detach() on it, and autograd cannot follow that. Keep the computation "
            f"in torch operations on the tensor itself.",
            JacobianWarning,
            stacklevel=_user_stacklevel(),
        )
