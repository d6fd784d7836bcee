"""Rows of vectors: the standard basis, a product applied to every row (vectorised with
``torch.vmap`` or in a Python loop, a chunk at a time), and the one policy that falls back
from the vectorised form to the loop.

NOTE [one fallback policy]
Whatever is computed vectorised (Jacobian products, batched backward passes, per-sample
gradients) falls back to its Python loop in one way, :func:`run_with_fallback`: a failure
of the vectorised attempt is classified by running without vmap, either one item (when a
check of one is given) or the whole loop. If that raises too, the error is the user's own
(``f``'s, the model's, autograd's) and propagates untouched; if not, vmap could not batch
the computation, and the caller's ``on_fallback`` decides what to say (a one-time warning)
or raises instead (a strategy that promised vmap). Out-of-memory errors, torch_vjp's own
errors and the signal to start over (:class:`Restart`) are never caught.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.func import vmap
from torch.utils._pytree import tree_map

from torch_vjp._engine.compile_key import tracing
from torch_vjp._errors import passes_through as never_caught

__all__ = [
    "Rows",
    "basis_rows",
    "eye_basis",
    "map_rows",
    "Restart",
    "passes_through",
    "run_with_fallback",
    "map_rows_with_fallback",
    "SameDraws",
    "loop_draws",
    "own_generators",
]

Rows = Callable[[int, int], tuple[Tensor, ...]]
R = TypeVar("R")


class SameDraws:
    """Makes the calls of ``f`` in a loop of products draw the same random numbers: called
    before each, it keeps the global generators' state at the first and restores it before
    every later one. A forward-mode loop calls ``f`` once per column, and the columns must be
    of one function (one dropout mask, as reverse mode's one call of ``f`` has); the
    generators end as one call of ``f`` leaves them. ``own``: ``torch.Generator`` objects of
    f's own, kept alike, or a function that finds them, called at the first call (a loop
    that runs no product searches for nothing); ``host``: NumPy's and Python's global
    generators too (NOTE [auto's extra calls draw what the products draw]; a few
    microseconds, so not in the loops)."""

    __slots__ = ("cpu", "cuda", "own", "own_states", "host")

    def __init__(self, own: Sequence[torch.Generator] | Callable[[], Sequence[torch.Generator]]
                 = (), host: bool = False) -> None:
        self.cpu: Tensor | None = None
        self.cuda: list[Tensor] | None = None
        self.own = own
        self.own_states: list[Tensor] = []
        self.host: Any = host

    def __call__(self) -> None:
        if self.cpu is None:
            if callable(self.own):
                self.own = self.own()
            self.cpu = torch.get_rng_state()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                self.cuda = torch.cuda.get_rng_state_all()
            self.own_states = [g.get_state() for g in self.own]
            if self.host:
                self.host = _host_states()
            return
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        for g, state in zip(self.own, self.own_states):
            g.set_state(state)
        if self.host:
            for module, state in self.host:
                module.setstate(state) if module is random else module.set_state(state)


def loop_draws(prob: Any, n: int) -> SameDraws:
    """The :class:`SameDraws` of a loop of ``n`` products, one call of f each: f's own
    generators kept alike too where there are several calls, found at the first (a loop
    that runs no product, or one, searches nothing)."""
    return SameDraws(lambda: own_generators(prob) if n > 1 else ())


def own_generators(prob: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects f reaches (in its closure, defaults, globals, modules
    or among the primals: :func:`torch_vjp._function_calls.generators`), for the calls that
    'auto' adds (NOTE [auto's extra calls draw what the products draw]): a search of f's
    objects, so where f is first probed or checked only, not on every call."""
    from torch_vjp._function_calls import generators  # (it imports the engine)

    return generators(prob.f, prob.primals)


def _host_states() -> list[tuple[Any, Any]]:
    """The states of Python's global generator and, where NumPy is imported, of NumPy's."""
    states: list[tuple[Any, Any]] = [(random, random.getstate())]
    np = sys.modules.get("numpy")
    if np is not None:
        states.append((np.random, np.random.get_state()))
    return states


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
    row broadcast over a batch, for ``batch_jacobian``), for ``0 <= start <= stop``.

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
            if tracing():  # NOTE [a basis inductor fuses]
                z = (torch.arange(start, stop, device=device)[:, None]
                     == torch.arange(off, off + numel, device=device)[None, :]).to(dtype)
            else:
                z = torch.zeros((c, numel), dtype=dtype, device=device)
                if start < off + numel and off < stop:
                    # element (k, j) is 1 where start + k == off + j
                    z.diagonal(start - off).fill_(1)
            z = z.view(c, *shape)
            if batch is not None:
                z = z.unsqueeze(1).expand(c, batch, *shape)
                if c == 1:  # one vector, for a loop: materialised (NOTE [one vector at a time])
                    z = z.contiguous()
            out.append(z)
        return tuple(out)

    return rows


def eye_basis(
    shape: torch.Size, n: int, dtype: torch.dtype, device: torch.device, batch: int | None
) -> Tensor:
    """All ``n`` rows of the standard basis over one tensor of ``shape`` (``n`` elements):
    ``(n, *shape)``, or ``(n, batch, *shape)`` repeated over a batch (materialised: see
    NOTE [per-call overhead]); as :func:`basis_rows` gives for one shape, in one call.

    Example:
        >>> eye_basis(torch.Size([2]), 2, torch.float32, torch.device("cpu"), 3).shape
        torch.Size([2, 3, 2])
    """
    z = torch.eye(n, dtype=dtype, device=device)
    if len(shape) != 1:
        z = z.view(n, *shape)
    if batch is not None:
        z = z.unsqueeze(1).expand(n, batch, *shape).contiguous()
    return z


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

    Example:
        >>> x = torch.arange(6.0).view(3, 2)
        >>> stacked, _ = map_rows(lambda v: (2 * v,), lambda s, e: (x[s:e],), 3,
        ...                       vectorized=True, chunk_size=2)
        >>> stacked[0].tolist()
        [[0.0, 2.0], [4.0, 6.0], [8.0, 10.0]]
    """
    # NOTE [one vector at a time]
    # Without vmap, each vector is taken as rows(i, i + 1)[0]: a tensor of its own (for the
    # standard basis, a fresh contiguous one), as torch.func.jacrev's chunk_size=1 passes
    # them, never a view into a chunk of rows. A backward formula may read its grad_output
    # through an absolute as_strided (as_strided_scatter's does), which on a row of a larger
    # basis tensor, at a storage offset, reads the wrong elements.
    step = n if chunk_size is None else min(chunk_size, n)
    collector = _Collector(n, detach)
    extra: Any = None
    if vectorized and batched_fn is None:
        batched_fn = vmap(fn)
    start = 0
    while start < n:
        stop = min(n, start + step)
        if vectorized and stop - start > 1:
            vecs = rows(start, stop)
            res = batched_fn(*vecs)  # type: ignore[misc]
            if extras:
                res, ex = res
                if start == 0:
                    extra = _unbatched_first(ex)
            collector.put(start, stop, res)
        else:
            for k in range(stop - start):
                # each vector its own tensor (NOTE [one vector at a time])
                res = fn(*[v[0] for v in rows(start + k, start + k + 1)])
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


class Restart(Exception):
    """The signal to compute again from the start (remembered output sizes were wrong: NOTE
    [output sizes]); no fallback catches it."""


def passes_through(err: BaseException) -> bool:
    """Errors that no fallback may hide: out of memory, torch_vjp's own, and
    :class:`Restart`."""
    return isinstance(err, Restart) or never_caught(err)


def routes_that_run(
    route: Callable[[str], R], names: Sequence[str]
) -> Iterator[tuple[str, R]]:
    """``(name, route(name))`` for each of ``names`` in turn whose route runs: a route that
    raises (no batching rule, no forward formula) is passed over, unless its error is one no
    fallback may hide (:func:`passes_through`)."""
    for name in names:
        try:
            got = route(name)
        except Exception as err:  # noqa: BLE001 - no batching rule, no formula: the next
            if passes_through(err):
                raise
            continue
        yield name, got


def run_with_fallback(
    vectorized: Callable[[], R],
    loop: Callable[[], R],
    *,
    on_fallback: Callable[[Exception], None],
    check_one: Callable[[], object] | None = None,
) -> R:
    """Runs ``vectorized()``; if it fails, runs ``loop()`` instead: the one fallback policy
    (NOTE [one fallback policy]).

    Args:
        vectorized: the computation under ``torch.vmap``.
        loop: the same computation without vmap.
        on_fallback: called with the vectorised attempt's error once the fallback is known
            to be needed (the loop, or the check of one item, ran without error): warns, or
            raises (``raise StrategyError(...) from err``), which then propagates.
        check_one: computes one item without vmap, before ``on_fallback`` and the loop (an
            error here is the user's own, and propagates untouched). ``None``: the loop is
            its own check, and ``on_fallback`` is called after it succeeds.

    Returns:
        What ``vectorized()`` or, after a failure, ``loop()`` returned.

    Raises:
        Whatever ``vectorized()`` raises that :func:`passes_through` (out of memory,
        torch_vjp's own errors, :class:`Restart`); whatever ``check_one()``, ``loop()`` or
        ``on_fallback`` raise, untouched.

    Example:
        >>> def batched():
        ...     raise RuntimeError("no batching rule")
        >>> said = []
        >>> run_with_fallback(batched, lambda: "looped", on_fallback=said.append)
        'looped'
        >>> said
        [RuntimeError('no batching rule')]
    """
    try:
        return vectorized()
    except Exception as err:  # noqa: BLE001 - classified below, never swallowed blindly
        if passes_through(err):
            raise
        failure = err
    if check_one is None:  # the loop decides: its error propagates
        result = loop()
        on_fallback(failure)
        return result
    check_one()  # one item without vmap: an error here is not vmap's, and propagates
    on_fallback(failure)
    return loop()


def map_rows_with_fallback(
    fn: Callable[..., Any],
    rows: Rows,
    n: int,
    *,
    chunk_size: int | None,
    on_fallback: Callable[[Exception], None],
    extras: bool = False,
    batched_fn: Callable[..., Any] | None = None,
    loop_fn: Callable[..., Any] | None = None,
) -> tuple[list[Tensor], Any]:
    """:func:`map_rows` vectorised, falling back to its loop by :func:`run_with_fallback`,
    with one product computed unbatched as the check.

    A single product, or chunks of one, run without vmap: there is nothing to fall back
    from, and an error propagates at once. ``loop_fn``: ``fn`` as called one vector at a
    time (chunks of one, the loop), where that differs (one that replays the random draws
    of f's first call, :class:`SameDraws`); ``fn`` by default.
    """
    loop_fn = fn if loop_fn is None else loop_fn
    if n == 1 or chunk_size == 1:
        return map_rows(
            loop_fn, rows, n, vectorized=True, chunk_size=chunk_size, extras=extras,
            batched_fn=batched_fn,
        )
    return run_with_fallback(
        lambda: map_rows(
            fn, rows, n, vectorized=True, chunk_size=chunk_size, extras=extras,
            batched_fn=batched_fn,
        ),
        lambda: map_rows(loop_fn, rows, n, vectorized=False, chunk_size=chunk_size,
                         extras=extras),
        on_fallback=on_fallback,
        check_one=lambda: fn(*[v[0] for v in rows(0, 1)]),
    )
