"""Compare Jacobian strategies on your own function: time, peak extra memory and error.

:func:`compare_strategies` runs every Jacobian strategy of :func:`torch_vjp.jacobian` on the
function and inputs you give it, checks each result against an independent reference, times
it, measures the extra memory it needed, and returns a :class:`StrategyComparison`: one
:class:`StrategyRow` per strategy, the fastest correct one as ``.best``, an aligned table as
``str(report)`` and ``report.to_dict()`` for JSON. A strategy that fails is a row that says
why, not an exception.

Time, memory and error are measured by :mod:`torch_vjp._measure`, which the benchmark suite
:mod:`torch_vjp.bench` shares.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from torch_vjp._engine.context import buffers_kept
from torch_vjp._engine.fwdcheck import least_precise
from torch_vjp._compare_reference import NoReference, reference_jacobian
from torch_vjp._engine.problem import Problem
from torch_vjp._function_calls import SameDraws, generators, buffers_used
from torch_vjp._errors import (
    JacobianOptionError,
    StrategyError,
    every_time,
    StrategyTypeError,
    format_bytes,
    shape_str,
)
from torch_vjp._measure import (
    NOISY_SPREAD,
    RTOL,
    Timing,
    check_min_run_time,
    check_result,
    check_tolerance,
    device_of,
    format_table,
    format_time,
    block_times,
    format_spread,
    measure_peak,
    memory_method,
    noisy_note,
    reason,
    shorten,
    summarize_times,
)

__all__ = ["compare_strategies", "StrategyComparison", "StrategyRow"]

_CALL = "torch_vjp.compare_strategies"


# --------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StrategyRow:
    """One strategy's result in a :class:`StrategyComparison`.

    Attributes:
        strategy: The strategy name passed to :func:`torch_vjp.jacobian`.
        status: ``"ok"`` (matches the reference), ``"wrong"`` (ran, but its result differs
            from the reference by more than the tolerance, or has the wrong structure),
            ``"failed"`` (raised; ``reason`` says what) or ``"unchecked"`` (ran, but no
            reference could be computed).
        time: Median seconds per call, or ``None`` if it failed.
        peak_memory: Peak extra bytes of one call, the Jacobian included, or ``None``.
        error: Largest absolute difference from the reference, or ``None``.
        reason: Why the row is not ``"ok"`` (the exception's type and first line, or the
            size of the error against the tolerance); ``None`` for an ``"ok"`` row.
        warnings: Messages of the warnings the strategy emitted on its checked run (a
            fallback to a slower strategy, for example).
        iqr: The interquartile range of the timed blocks' seconds per call (``None`` when
            the strategy was not timed, or only one block was).
        noisy: The IQR exceeds 25% of the median (``torch_vjp._measure.NOISY_SPREAD``):
            the machine disturbed the timing too much to rank it against the others.
    """

    strategy: str
    status: str
    time: float | None = None
    peak_memory: int | None = None
    error: float | None = None
    reason: str | None = None
    warnings: tuple[str, ...] = ()
    iqr: float | None = None
    noisy: bool = False

    @property
    def spread(self) -> float | None:
        """The IQR as a fraction of the median time (``None`` when unknown)."""
        if self.iqr is None or not self.time:
            return None
        return self.iqr / self.time

    @property
    def ok(self) -> bool:
        """True when the strategy ran and matched the reference."""
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        """The row as plain JSON-serialisable values (``time`` in seconds). A NaN or
        infinite error, which strict JSON cannot hold (``json.dumps`` writes a bare ``NaN``
        that ``JSON.parse`` and ``json.dumps(..., allow_nan=False)`` refuse), is the string
        ``"nan"``, ``"inf"`` or ``"-inf"``."""
        return {
            "strategy": self.strategy,
            "status": self.status,
            "time_s": self.time,
            "iqr_s": self.iqr,
            "noisy": self.noisy,
            "peak_memory_bytes": self.peak_memory,
            "max_abs_error": (self.error if self.error is None or math.isfinite(self.error)
                              else str(self.error)),
            "reason": self.reason,
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True)
class StrategyComparison:
    """What :func:`compare_strategies` returns: one row per strategy, and how they were measured.

    Attributes:
        rows: One :class:`StrategyRow` per strategy, in the order they were asked for.
        reference: How the reference Jacobian was computed, or why none could be.
        tolerance: The largest tolerance of any entry the rows were judged by, ``atol +
            rtol * max|reference|`` (each entry's: ``atol + rtol * max(|its reference
            entry|, 0.1 * max|reference|)``).
        device: The device of the primals.
        threads: ``torch.get_num_threads()`` during the measurement.
        memory_method: How ``peak_memory`` was measured on this device.
        description: The call compared, with the input and output shapes.
    """

    rows: tuple[StrategyRow, ...]
    reference: str
    tolerance: float | None
    device: str
    threads: int
    memory_method: str
    description: str
    torch_version: str = field(default=torch.__version__)

    @property
    def best(self) -> StrategyRow | None:
        """The fastest row whose result matched the reference (``None`` when none did),
        by median time.

        When no reference could be computed, the fastest row that ran is returned.
        """
        good = [r for r in self.rows if r.status == "ok"]
        if not good:
            good = [r for r in self.rows if r.status == "unchecked"]
        timed = [r for r in good if r.time is not None]
        return min(timed, key=lambda r: r.time) if timed else None

    def __getitem__(self, strategy: str) -> StrategyRow:
        for row in self.rows:
            if row.strategy == strategy:
                return row
        raise KeyError(f"no row for strategy {strategy!r}; rows: {[r.strategy for r in self.rows]}")

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-serialisable values (times in seconds, memory in bytes)."""
        best = self.best
        return {
            "description": self.description,
            "device": self.device,
            "threads": self.threads,
            "torch": self.torch_version,
            "reference": self.reference,
            "tolerance": self.tolerance,
            "memory_method": self.memory_method,
            "best": best.strategy if best is not None else None,
            "rows": [row.to_dict() for row in self.rows],
        }

    def __str__(self) -> str:
        best = self.best
        header = ("strategy", "median time", "IQR", "vs best", "peak extra memory",
                  "max abs error", "status")
        body = []
        for row in self.rows:
            if row.time is not None and best is not None and best.time:
                ratio = f"{row.time / best.time:.2f}x"
            else:
                ratio = "-"
            error = "-" if row.error is None else f"{row.error:.1e}"
            if row is best:
                status = "best"
            elif row.status == "ok":
                status = "ok"
            else:
                status = f"{row.status}: {row.reason}" if row.reason else row.status
            if row.noisy:
                status += f" ({noisy_note(_timing(row))})"
            if row.warnings and row.status != "failed":
                status += f" (warned: {row.warnings[0].splitlines()[0]})"
            status = shorten(status, 110)
            body.append((row.strategy, format_time(row.time), format_spread(_timing(row)),
                         ratio, format_bytes(row.peak_memory), error, status))
        lines = [
            f"compare_strategies: {self.description}",
            f"device {self.device}, {self.threads} threads, torch {self.torch_version}",
            f"reference: {self.reference}"
            + (f"; tolerance {self.tolerance:.1e}" if self.tolerance is not None else ""),
            f"memory: {self.memory_method}",
            "time: median of blocked_autorange's blocks; IQR: their interquartile range, as a "
            f"percentage of the median (noisy: over {100 * NOISY_SPREAD:.0f}%, too wide to "
            "rank)",
            "",
            *format_table(header, body, "<>>>>><"),
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        best = self.best
        return (f"StrategyComparison({len(self.rows)} strategies, "
                f"best={best.strategy if best is not None else None!r})")


# --------------------------------------------------------------------------------------
# compare_strategies
# --------------------------------------------------------------------------------------


def _timing(row: StrategyRow) -> Timing | None:
    if row.time is None:
        return None
    if row.iqr is None:
        return Timing(row.time, row.time, row.time, 1)
    return Timing(row.time, row.time - row.iqr / 2, row.time + row.iqr / 2, 2)


def _registered_strategies() -> tuple[str, ...]:
    """Every registered strategy, the concrete ones first and ``"auto"`` (which picks
    among them) last."""
    from torch_vjp._strategies import STRATEGIES

    names = [name for name in STRATEGIES if name != "auto"]
    return tuple(names + ["auto"] if "auto" in STRATEGIES else names)


def _describe(primals: tuple, argnums: int | tuple[int, ...], out: Any) -> str:
    def shapes(tree: Any) -> str:
        leaves = [t for t in tree_leaves(tree) if isinstance(t, Tensor)]
        text = ", ".join(shape_str(t.shape) for t in leaves)
        return text if len(leaves) == 1 else f"[{text}]"

    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    inputs = ", ".join(
        f"primals[{i}]: {shapes(primals[i])}" for i in nums if -len(primals) <= i < len(primals)
    )
    dtypes = sorted({str(t.dtype).replace("torch.", "")
                     for t in tree_leaves(primals) if isinstance(t, Tensor)})
    return f"f({inputs}) -> {shapes(out)}, argnums={argnums}, {'/'.join(dtypes)}"


def compare_strategies(
    f: Callable[..., Any],
    *primals: Any,
    argnums: int | tuple[int, ...] = 0,
    strategies: Sequence[str] | str | None = None,
    min_run_time: float = 0.2,
    memory: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
) -> StrategyComparison:
    """Runs every Jacobian strategy on ``f`` at ``primals``, checks, times and measures each.

    For each strategy, :func:`torch_vjp.jacobian` is called once and its result compared
    with a reference; a correct strategy is then timed and its memory measured. A strategy
    that raises becomes a row with status ``"failed"`` and the exception's type and first
    line as ``reason``; one whose result is off becomes ``"wrong"``. Mistakes in the
    arguments (``argnums``, the primals, the options) raise before ``f`` runs, as in
    :func:`torch_vjp.jacobian`; errors raised by ``f`` itself on a plain call (before any
    strategy runs) propagate unchanged. Nothing of the caller's is mutated: a module in
    training mode gets its buffers (BatchNorm's running statistics) back after every call,
    and the global random generator its state. A random ``f`` (dropout in training mode)
    gets the caller's draws for the reference and for each strategy's checked call. What
    ``f`` changes outside tensors (a Python counter, a list it appends to, an attribute it
    sets) is not undone: ``f`` runs many times (the reference, each strategy, each timed
    call), and such a change is seen by the calls after it, as in any benchmark loop.

    How each column is measured:

    * **time**: the median of ``torch.utils.benchmark.Timer(...).blocked_autorange(
      min_run_time=min_run_time)`` (at least three blocks of calls), on
      ``torch.get_num_threads()`` threads; **IQR**: the interquartile range of its blocks'
      times. A row whose IQR exceeds 25% of its
      median is marked *noisy*: the machine disturbed it too much to rank it (run again
      when the machine is quieter, or raise ``min_run_time``).
    * **reference and error**: the reference is a Python loop of ``torch.autograd.grad``
      over the output elements, on float64 copies of the primals: independent of torch_vjp,
      and of vmap, whose batching rules the vectorised strategies rely on (torch.cdist's
      backward has a wrong one, which ``torch.func.jacrev`` inherits). If ``f`` cannot run
      in float64 (it holds float32 weights, say), the primals' own dtype is used; if the
      loop fails, ``torch.func.jacrev`` is used instead. ``report.reference`` says which. ``error`` is the largest
      absolute difference; a row is ``"ok"`` when every entry's is at most ``atol + rtol *
      max(|its reference entry|, 0.1 * max|reference|)`` (one large entry does not hide
      wrong small ones; an entry equal to its reference entry, a NaN or an infinity
      included, is right, and an infinite reference entry widens no other's tolerance).
    * **peak extra memory**: on CUDA, the caching allocator's peak during one call
      (``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats``)
      minus what was allocated before it. On CPU, the peak of live tensor bytes during one
      call, counted by a ``TorchDispatchMode`` that sees every operator's outputs (below
      vmap and autograd: batched intermediates, saved tensors, basis vectors and the
      Jacobian itself) and follows each new storage until it is freed; views and in-place
      results are not counted twice, and buffers a kernel allocates and frees internally
      are not seen. Both figures include the returned Jacobian. (``tracemalloc`` cannot
      be used: torch allocates tensor memory outside Python's allocator.)

    Args:
        f: The function, as for :func:`torch_vjp.jacobian`.
        *primals: Its arguments.
        argnums: The argument(s) to differentiate with respect to.
        strategies: Strategy names to compare, in this order; default: every registered
            strategy (``"rev"``, ``"fwd"``, ``"rev-loop"``, ``"fwd-loop"``, ``"auto"``). A
            single name may be given as a string.
        min_run_time: Seconds of timing per strategy (``blocked_autorange``'s budget), a
            finite number > 0. Keep the default for figures you report; lower it (e.g.
            ``0.01``) in tests.
        memory: Measure peak extra memory (one extra call per strategy).
        rtol: Relative tolerance of the correctness check; default by the result dtype:
            1e-2 (float16), 2e-2 (bfloat16), 1e-4 (float32), 1e-7 (float64); that of a
            less precise dtype f casts to inside (float32 in a float64 Llama or T5, whose
            RMSNorm computes in float32), which rounds every strategy at its precision.
        atol: Absolute tolerance added to it; default ``rtol * 1e-3``. Both must be
            ``None`` or finite numbers >= 0.

    Returns:
        A :class:`StrategyComparison`: ``.rows``, ``.best``, ``str()`` and ``.to_dict()``.

    Raises:
        StrategyError: A name in ``strategies`` is not a registered strategy, the sequence
            is empty, or it names a strategy twice.
        StrategyTypeError: ``strategies`` is neither a name nor a sequence of names (an
            entry that is not a str included).
        JacobianOptionError: ``min_run_time`` is not a finite number of seconds > 0,
            ``rtol``/``atol`` is not ``None`` or a finite number >= 0, or ``memory`` is not
            a bool (numpy's bool included).
        JacobianCallError: ``argnums``, a primal or an output of ``f`` does not fit, as in
            :func:`torch_vjp.jacobian` (an ``argnums`` out of range or repeated, an integer
            primal, an integer output, ...).

    Example:
        >>> W = torch.randn(3, 5, dtype=torch.float64)
        >>> report = tv.compare_strategies(lambda x: torch.tanh(W @ x),
        ...                                torch.randn(5, dtype=torch.float64),
        ...                                strategies=("rev", "fwd"), min_run_time=0.01)
        >>> tuple(row.strategy for row in report.rows)
        ('rev', 'fwd')
        >>> all(row.ok for row in report.rows) and report.best.strategy in ("rev", "fwd")
        True
        >>> print(report)  # doctest: +ELLIPSIS
        compare_strategies: f(primals[0]: (5,)) -> (3,), argnums=0, float64
        ...
        strategy  median time  IQR  vs best  peak extra memory  max abs error  status
        ...
    """
    names = _normalise_strategies(strategies)
    min_run_time = check_min_run_time(min_run_time, call=_CALL)
    rtol = check_tolerance("rtol", rtol, call=_CALL)
    atol = check_tolerance("atol", atol, call=_CALL)
    np = sys.modules.get("numpy")  # (a numpy bool, read from an array or a config, is one)
    if np is not None and isinstance(memory, np.bool_):
        memory = bool(memory)
    if not isinstance(memory, bool):
        # (a str such as "no" is truthy: memory would be measured against the caller's wish)
        raise JacobianOptionError(
            f"{_CALL}: memory={memory!r}, but it must be True or False: "
            f"whether to measure each strategy's peak extra memory (one more call per "
            f"strategy). Fix: memory=False to skip the measurement, or leave the default True."
        )
    # argnums and the primals are checked as torch_vjp.jacobian checks them, before f runs.
    # (aux=False: compare_strategies has no has_aux, so no message may offer it)
    prob = Problem(f, primals, argnums, has_aux=False, call=_CALL, aux=False)
    device = device_of(primals)

    # Every call of f below (the plain call, the reference, each strategy's checked call,
    # its memory measurement and its timing loop) runs inside buffers_kept(f): a module in
    # training mode gets its buffers (BatchNorm's running statistics) back after each, so
    # every call sees the same module and nothing of the caller's is left changed.
    # (NOTE [check_function's draws], as there: the reference and each strategy's checked
    # call start from the caller's generator state, which is put back at the end)
    with SameDraws(primals, generators(f, primals), buffers_used(f, primals)) as draws:
        with buffers_kept(f, primals=primals):
            # A plain call first: an error of f's own propagates untouched, before any
            # strategy; an output that has no Jacobian raises as in torch_vjp.jacobian.
            out = prob.g(*prob.leaves)
            description = _describe(primals, argnums, out)
            # (a second call at the same point: a random f, dropout in training mode, gives
            # every strategy draws of its own, and the report says so)
            again, least = _traced_call(prob)
            # (a random f may return another shape on each call, a random subset of its
            # input: another shape is another output, not an error of the comparison)
            random_f = not all(
                not isinstance(a, Tensor) or a.shape == b.shape and torch.allclose(
                    a, b, rtol=0.0, atol=0.0, equal_nan=True)
                for a, b in zip(tree_leaves(out), tree_leaves(again)))
            del out, again

        with buffers_kept(f, primals=primals):
            try:
                reference, reference_note = reference_jacobian(f, primals, argnums, draws.reset)
            except NoReference as exc:
                reference, reference_note = None, f"none could be computed ({exc})"
        # (only a step narrower than the primals' own dtypes is a cast in f's graph: float32
        # primals compute in float32 without one, and their tolerance is float32's anyway)
        if (reference is not None and rtol is None and _rtol_for(None, reference, least)
                and _rtol_for(None, [x for x in prob.leaves if isinstance(x, Tensor)], least)):
            reference_note += (
                f"; f computes in {str(least).replace('torch.', '')} inside (a cast in its "
                f"graph), so every strategy rounds at that precision and is judged at its "
                f"tolerance")
        if random_f:
            reference_note += (
                "; f is random (two calls at the same point differ: dropout in training mode, "
                "say): the reference and each strategy start from the same generator state, "
                "so a strategy that calls f once per Jacobian sees the reference's draws, but "
                "one that calls it once per product (fwd-loop) draws anew each time and may be "
                "marked wrong for that: fix f's draws (model.eval(), or a seeded generator) to "
                "compare every strategy")

        from torch_vjp.jacobians import jacobian

        rows = []
        worst_tol = None
        for name in names:
            def call(name: str = name) -> Any:
                return jacobian(f, *primals, argnums=argnums, strategy=name)

            # (every_time: a once-only warning, of an earlier call of f or an earlier report,
            # is recorded on every row it concerns)
            with warnings.catch_warnings(record=True) as caught, every_time():
                warnings.simplefilter("always")
                try:
                    with buffers_kept(f, primals=primals):
                        draws.reset()
                        result = call()
                except Exception as exc:  # noqa: BLE001 - a failing strategy is a row
                    rows.append(StrategyRow(name, "failed", reason=reason(exc),
                                            warnings=_messages(caught)))
                    continue
            messages = _messages(caught)
            status, error, why = "unchecked", None, None
            if reference is not None:
                try:
                    error, row_tol, why = check_result(result, reference,
                                                       _rtol_for(rtol, result, least), atol)
                except (ValueError, TypeError) as exc:
                    status, why = "wrong", str(exc)
                else:
                    worst_tol = row_tol if worst_tol is None else max(worst_tol, row_tol)
                    status = "ok" if why is None else "wrong"
            del result
            peak = timing = None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    with buffers_kept(f, primals=primals):
                        if memory:
                            peak = measure_peak(call, device)
                        timing = summarize_times([block_times(call, min_run_time, 3)])
                except Exception as exc:  # noqa: BLE001 - ran once, then failed: still a row
                    status, why = "failed", f"on a repeated call: {reason(exc)}"
            rows.append(StrategyRow(
                name, status, timing.median if timing else None, peak, error, why, messages,
                iqr=timing.iqr if timing else None, noisy=timing.noisy if timing else False))

    return StrategyComparison(
        rows=tuple(rows),
        reference=reference_note,
        tolerance=worst_tol,
        device=str(device),
        threads=torch.get_num_threads(),
        memory_method=memory_method(device) if memory else "not measured (memory=False)",
        description=description,
    )


def _messages(caught: list[warnings.WarningMessage]) -> tuple[str, ...]:
    """The distinct messages of recorded warnings, deprecation notices left out."""
    skip = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
    return tuple(dict.fromkeys(str(w.message) for w in caught if not issubclass(w.category, skip)))


def _normalise_strategies(strategies: Sequence[str] | str | None) -> tuple[str, ...]:
    from torch_vjp._strategies import get_strategy

    if strategies is None:
        return _registered_strategies()
    if isinstance(strategies, str):
        strategies = (strategies,)
    try:
        names = tuple(strategies)
    except TypeError:
        raise StrategyTypeError(
            f"{_CALL}: strategies must be a strategy name or a sequence of them, got "
            f"{type(strategies).__name__}. Valid strategies: {_registered_strategies()}."
        ) from None
    if not names:
        raise StrategyError(
            f"{_CALL}: strategies={strategies!r} names no strategy, so there is nothing to "
            f"compare. Fix: leave strategies=None to compare every strategy "
            f"{_registered_strategies()}, or name some, e.g. strategies=('rev', 'fwd')."
        )
    for k, name in enumerate(names):
        if not isinstance(name, str):
            raise StrategyTypeError(
                f"{_CALL}: strategies[{k}] is {name!r} ({type(name).__name__}), but each "
                f"entry must be a strategy name, a str. Valid strategies: "
                f"{_registered_strategies()}; e.g. strategies=('rev', 'fwd')."
            )
        get_strategy(name, call=_CALL)  # raises StrategyError naming the valid ones
    twice = [name for name in dict.fromkeys(names) if names.count(name) > 1]
    if twice:
        raise StrategyError(
            f"{_CALL}: strategies={strategies!r} names {twice[0]!r} twice; each strategy "
            f"may appear once (the report has one row per strategy, looked up by name). "
            f"Fix: strategies={tuple(dict.fromkeys(names))!r}."
        )
    return names


def _traced_call(prob: Problem) -> tuple[Any, torch.dtype | None]:
    """f's output at the primals, and the least precise floating dtype its graph computes
    in (:func:`~torch_vjp._engine.fwdcheck.least_precise`): a float32 step inside a float64
    f (the RMSNorm of Llama and T5) rounds every strategy at float32's, so their results
    differ from the float64 reference by that much, and are right. None, with f called
    plainly, where f cannot run with inputs that require grad (it calls ``.numpy()``, say)."""
    # (the leaves as the caller gave them: the plain call before this one may have written
    # into them, and f at another point is not f drawing other random numbers)
    prob.reset_primals()
    try:
        with torch.enable_grad():
            xs = [x.detach().requires_grad_(True) for x in prob.leaves]
            out = prob.g(*[x.clone() for x in xs])
        outs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        return out, least_precise(outs, prob.leaves)
    except Exception:  # noqa: BLE001 - f runs plainly (its own errors propagate from there)
        return prob.g(*prob.leaves), None


def _rtol_for(rtol: float | None, result: Any, least: torch.dtype | None) -> float | None:
    """``rtol``, or where not given and f computes in a less precise dtype than its result
    (``least``), the default tolerance of that dtype."""
    if rtol is not None or least is None:
        return rtol
    dtypes = [t.dtype for t in tree_leaves(result) if isinstance(t, Tensor)
              and t.dtype.is_floating_point]
    if all(torch.finfo(least).eps <= torch.finfo(d).eps for d in dtypes):
        return None  # (the result's own dtype decides)
    return RTOL.get(least, 1e-4)
