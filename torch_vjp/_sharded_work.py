"""One rank's share of a sharded Jacobian's products (NOTE [sharded Jacobian] in
:mod:`torch_vjp._sharded`): its range of basis vectors, reverse or forward mode, with
``"auto"``'s fallbacks from vmap to a loop, and from torch.func to plain autograd (reverse
mode) for a function torch.func cannot run at all, and the gather of every rank's shards.
(The other collectives it runs, and the ranges and padding of the shares, are
:mod:`torch_vjp._sharded_comm`'s; re-exported here.)
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from torch_vjp._engine.context import func_jvp, func_vjp, is_nested
from torch_vjp._engine.jacobian import (
    NoForwardMode,
    fallback_message,
    func_refusal,
    function_key,
    fwd_loop_refusal,
    function_name,
)
from torch_vjp._engine.gradmode import in_grad_mode
from torch_vjp._engine.memory import plan_products
from torch_vjp._engine.plain import plain_pullback, plain_push
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.refusals import vmap_refusal
from torch_vjp._engine.rows import (
    SameDraws,
    basis_rows,
    loop_draws,
    map_rows,
    own_generators,
    run_with_fallback,
)
from torch_vjp._engine.shapes import Shapes, in_rows, recorded_elements, row_shapes
from torch_vjp._engine.wrongops import reading_wrong_ops, wrong_ops
from torch_vjp._errors import (
    JacobianCallError,
    JacobianWarning,
    passes_through,
    quote_error,
    warn_once,
)
from torch_vjp._sharded_comm import (
    all_max,
    comm_device,
    exchange,
    outputs_apart,
    outputs_said,
    padded_count,
    shard_range,
)
from torch_vjp._strategies import Strategy

__all__ = [
    "FAILED", "NO_FWD", "OK", "PASSES", "RETRY", "Work", "all_max", "comm_device", "exchange",
    "gather", "outputs_apart", "outputs_said", "padded_count", "probe_outputs", "shard_range",
    "try_products",
]

# A rank's status in the exchanges after its products (RETRY: "auto"'s vmap, or its loop,
# failed on this rank, and every rank takes the next fallback, NOTE [the ranks agree on
# their fallbacks]; PASSES: an error no fallback may hide, out of memory or torch_vjp's
# own: every rank raises, on an alternative route of "auto"'s check too)
OK, RETRY, NO_FWD, FAILED, PASSES = 0, 1, 2, 3, 4


# NOTE [the ranks agree on their chunks]
# Every rank runs as many products (NOTE [every rank runs as many products]), but the chunk
# each plans for them is its own: a chunk_size or max_memory that differs between ranks, or
# a budget planned from each device's free memory. vmap calls f (forward mode) or the
# pullback once per chunk, so an f that runs a collective was called more often on one
# rank than on another, which then waited for ever. So the ranks agree on one chunk, the
# smallest any rank planned (it fits every rank's budget), in one all_reduce (MAX) before
# their first chunk. That exchange is failure-aware: it has the shape of the one that
# follows the products (:func:`exchange`: the status, a digest of f's output, and the
# chunk), so a rank whose f failed before its planning, or whose planning failed (a budget
# too small on that rank), or that has no products to plan (an output of another size on
# that rank), pairs its status with the others' plan. A planning rank that receives no plan
# from some rank (the chunk's place holds 0) takes the result as the status of every rank
# and tells ``_attempt`` in ``torch_vjp._sharded``, which then exchanges no status again:
# where some rank failed, every rank stops and raises (the failing rank its own error, the
# others one naming it), where forward mode failed on some rank every rank computes in
# reverse mode, and where outputs differ every rank names the difference. One such
# exchange per try: "auto"'s fallbacks, and "rev-loop"'s to plain autograd, are tries of
# their own, their chunks agreed again (NOTE [the ranks agree on their fallbacks]).


# NOTE [the ranks agree on their fallbacks]
# "auto" falls back from vmap to a loop where vmap fails, and in reverse mode from the loop
# to plain autograd where torch.func cannot run f at all ("rev-loop" too, from its loop). Each rank met its own failures:
# one whose f takes a path of its own (a rank-dependent branch with an operator vmap
# refuses) looped alone, and an f that runs a collective, in its forward (forward mode
# calls f once per chunk under vmap, once per product in a loop) or its backward (reverse
# mode, the pullback), was then called more often on that rank: the others waited for
# ever, or paired its collective with the exchange after the products. So with a group a
# rank whose attempt fails says RETRY in that exchange (:func:`exchange`, failure-aware as
# NOTE [the ranks agree on their chunks] says), and where the worst status is RETRY every
# rank takes the next fallback, its products computed again (those of a rank whose vmap
# ran are dropped): every rank calls f, and its pullback, as often, in the same order. A
# rank warns of a fallback only where its own attempt failed (the others loop for it).


def gather(stacked: list[Tensor], n: int, group: Any, world: int, device: torch.device,
           fail: Any) -> list[Tensor]:
    """All ranks' shards of each stacked tensor, in rank order: each padded to the largest
    share, gathered, and cut back (NOTE [sharded Jacobian] in ``torch_vjp._sharded``). Before
    each ``all_gather`` and after the last, an ``all_reduce`` says whether some rank failed
    (out of memory): ``fail(err)`` raises on every rank, none left waiting in a gather."""
    import torch.distributed as dist
    m, full, err = -(-n // world), [], None
    for t in stacked + [None]:  # (None: the last status, after the last gather)
        try:
            if t is not None and err is None:
                src = torch.cat([t, t.new_zeros((m - t.shape[0], *t.shape[1:]))]).to(device)
                pieces = [src.new_empty(src.shape) for _ in range(world)]
        except Exception as exc:  # noqa: BLE001 - every rank hears of it before the gather
            err = exc
        if all_max(int(err is not None), group, device):
            fail(err)
        if t is None:
            return full
        dist.all_gather(pieces, src, group=group)
        try:
            full.append(torch.cat([p[: b - a] for r, p in enumerate(pieces)
                                   for a, b in [shard_range(n, r, world)]]).to(t.device))
        except Exception as exc:  # noqa: BLE001 - told at the next status
            err = exc
    return full


def _own(stacked: list[Tensor], k: int) -> list[Tensor]:
    """This rank's ``k`` products of the padded ones it ran (NOTE [every rank runs as many
    products])."""
    return [t if t.shape[0] == k else t[:k] for t in stacked]


class Work:
    """This rank's products, in one mode, with ``"auto"``'s vmap-to-loop fallback."""

    def __init__(self, prob: Problem, strat: Strategy, rank: int, world: int, shard: bool,
                 chunk_size: int | None, max_memory: int | None, batch: int | None,
                 alternatives: str, group: Any = None, device: Any = None) -> None:
        self.prob, self.strat, self.rank, self.world = prob, strat, rank, world
        self.shard, self.chunk_size, self.max_memory = shard, chunk_size, max_memory
        self.batch, self.alternatives = batch, alternatives
        self.group, self.device, self.met, self.chunk = group, device, [], None  # (_rev's)
        self.pulled: tuple[Any, Any, Any] | None = None  # (:meth:`looped_again`'s)
        self._mode = "rev"
        # (the known wrong operators the reverse products' graph holds, where read: NOTE [a
        # remembered route through a known wrong operator])
        self.read: list[tuple[str | None, str | None]] | None = None
        self.attempt()

    def stale(self) -> bool:
        """Whether the products read met an operator that makes their route wrong: one
        whose backward is wrong alone, or one whose batching rule is wrong where they ran
        under vmap."""
        return any(alone is not None or batching is not None and not self.looped
                   for batching, alone in self.read or [])

    def attempt(self) -> None:
        """A new attempt at the products: its chunks are agreed again (NOTE [the ranks agree
        on their chunks])."""
        self.agreed = False
        # (the exchange of the plan that stood for the status: (code, hi, lo), and the error
        # that stopped this rank's products there)
        self.told: tuple[int, int, int] | None = None
        self.stop: BaseException | None = None
        self.looped = False  # (forward mode fell back from vmap to a loop on this rank)
        # ("auto" with a group: 0 vmap, 1 a loop, 2 plain autograd (reverse mode), agreed
        # by every rank; this rank's own failure at each, NOTE [the ranks agree on their
        # fallbacks])
        self.level = 0
        self.failures: dict[int, BaseException] = {}

    def retry(self) -> None:
        """Some rank's attempt failed (RETRY): the next fallback, on every rank, with its
        chunks agreed again (NOTE [the ranks agree on their fallbacks])."""
        self.agreed, self.told, self.stop = False, None, None
        self.level += 1

    @property
    def failed(self) -> BaseException | None:
        """This rank's own failure in the attempt that asked for a RETRY, or None."""
        return self.failures.get(self.level)

    def run(self, mode: str, shapes: Any) -> tuple[Any, ...] | None:
        """This rank's products in ``mode``; None where a fallback failed on this rank
        (RETRY: NOTE [the ranks agree on their fallbacks])."""
        if self.strat.mode is not None:  # a named strategy: no fallback but plain autograd's
            if self.level > 0:  # (some rank's "rev-loop" turned to plain autograd)
                return self._rev_plain()
            try:
                return self._products(mode, shapes, self.strat.vectorized)
            except Exception as err:  # noqa: BLE001 - torch.func's known refusals below
                if passes_through(err) or is_nested():
                    raise
                if mode == "rev" and not self.strat.vectorized:
                    # ("rev-loop": plain autograd where torch.func refuses to run f, as on
                    # one process, on every rank where it refuses on some: NOTE [the ranks
                    # agree on their fallbacks]; any other error is f's own, or torch's,
                    # and f is not called again: raised once, untouched)
                    if vmap_refusal(err) is None:
                        raise
                    if self.group is None:
                        return self._rev_plain()
                    self.failures[0] = err
                    return None
                if mode == "fwd" and not self.strat.vectorized:
                    refusal = fwd_loop_refusal(self.prob, err)
                    if refusal is None:
                        raise
                    raise refusal from None
                why = vmap_refusal(err)
                if why is None or not self.strat.vectorized:
                    raise
                # (with a group, only reverse mode has the plain-autograd loop)
                raise func_refusal(self.prob, mode, why, err,
                                   choices="'auto' or 'rev-loop'") from None
        if mode == "rev":
            return self._auto(mode, shapes)
        try:
            return self._auto(mode, shapes)
        except Exception as err:  # noqa: BLE001 - forward mode may yield to reverse mode
            if passes_through(err):
                raise
            raise NoForwardMode(err) from None

    def _auto(self, mode: str, shapes: Any) -> tuple[Any, ...] | None:
        if self.group is not None:
            return self._agreed(mode, shapes)
        prob = self.prob

        def warn(err: Exception) -> None:
            self.looped = True
            warn_once(
                ("vmap-fallback-sharded", function_key(prob.f), mode, type(err)),
                fallback_message(prob, mode, err, who="this rank"),
                JacobianWarning,
            )

        try:
            return run_with_fallback(
                lambda: self._products(mode, shapes, True),
                lambda: self._products(mode, shapes, False),
                on_fallback=warn,
            )
        except Exception as err:  # noqa: BLE001 - plain autograd decides below
            if mode != "rev" or passes_through(err) or is_nested():
                raise
            plain_err = err
        # torch.func cannot run f at all (a module in training mode that updates its
        # running statistics): plain autograd, as on one process (NOTE [auto fallback])
        res = self._rev_plain()
        warn_once(
            ("plain-sharded", function_key(prob.f)),
            f"{prob.call}: torch.func cannot run f ({function_name(prob.f)}): "
            f"{vmap_refusal(plain_err) or quote_error(plain_err)}. strategy='auto' computed "
            f"this rank's share of the products with plain autograd, one backward pass per "
            f"output element, without vmap. This warning is shown once per function.",
            JacobianWarning,
        )
        return res

    def _agreed(self, mode: str, shapes: Any) -> tuple[Any, ...] | None:
        """``"auto"``'s products at the fallback every rank takes (NOTE [the ranks agree on
        their fallbacks]): None where this one failed on this rank (its error is kept in
        :attr:`failures`), which then says RETRY."""
        level, prob = self.level, self.prob
        if level >= 2 or level == 1 and mode != "rev":  # (the last fallback: errors raise)
            if level == 1:  # (forward mode's loop: its error makes every rank go reverse)
                return self._looped(mode, shapes)
            res = self._rev_plain()
            own = self.failures.get(1)
            if own is not None:
                warn_once(
                    ("plain-sharded", function_key(prob.f)),
                    f"{prob.call}: torch.func cannot run f ({function_name(prob.f)}): "
                    f"{vmap_refusal(own) or quote_error(own)}. strategy='auto' computed "
                    f"this rank's share of the products with plain autograd, one backward "
                    f"pass per output element, without vmap. This warning is shown once per "
                    f"function.",
                    JacobianWarning,
                )
            return res
        try:
            if level == 0:
                return self._products(mode, shapes, True)
            return self._looped(mode, shapes)
        except Exception as err:  # noqa: BLE001 - every rank takes the next fallback
            if passes_through(err) or is_nested():
                raise
            self.failures[level] = err
            return None

    def _looped(self, mode: str, shapes: Any) -> tuple[Any, ...]:
        """The products without vmap, every rank's (NOTE [the ranks agree on their
        fallbacks]), with the warning of this rank's own failed vmap."""
        res = self._products(mode, shapes, False)
        self.looped = True
        own = self.failures.get(0)
        if own is not None:
            warn_once(
                ("vmap-fallback-sharded", function_key(self.prob.f), mode, type(own)),
                fallback_message(self.prob, mode, own, who="this rank"),
                JacobianWarning,
            )
        return res

    def _chunk(self, k: int, n_out: int, n_in: int, out_dtypes: list[torch.dtype], dtype: Any,
               said: Any, records: int = 0) -> int | None:
        """The chunk size for this rank's ``k`` products: the result it holds is the whole
        Jacobian (gathered), or with ``shard`` its own ``k`` rows or columns. ``records``:
        the elements of the intermediate results the products record (forward mode of an
        ``f`` that involves tensors requiring grad; 0 for none: ``probe_outputs``), counted
        as the single-process engine counts them. With a group,
        the smallest chunk of every rank's (NOTE [the ranks agree on their chunks]);
        ``said``: what this rank says of f's output (:func:`outputs_said`)."""
        if self.shard:
            n_out, n_in = (k, n_in) if self._mode == "rev" else (n_out, k)
        itemsize = max(max(d.itemsize for d in out_dtypes),
                       max(leaf.dtype.itemsize for leaf in self.prob.leaves))

        def plan() -> int | None:
            return plan_products(
                k, n_out, n_in, itemsize, chunk_size=self.chunk_size,
                max_memory=self.max_memory, device=self.prob.leaves[0].device,
                call=self.prob.call, alternatives=self.alternatives, batch=self.batch,
                dtype=dtype, records=records,
            )

        if self.group is None or self.agreed:
            return plan()
        self.agreed = True
        try:
            mine, err, status = plan(), None, OK
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it before raising
            mine, err, status = None, exc, PASSES if passes_through(exc) else FAILED
        code, hi, lo, neg = exchange(status, said if err is None else None,
                                     0 if err is not None else mine or k, self.group,
                                     self.device)
        if neg != 0 and hi != -lo:
            # (every rank planned, for outputs of other shapes on some rank: each numbered
            # its products, and counted its chunks, over its own, and an f whose backward
            # runs a collective (reverse mode), or f (forward mode), was called more often
            # on one rank. Every rank raises here, before any product: NOTE [outputs alike
            # on every rank] in torch_vjp._sharded)
            outputs_apart(self.prob.call, said, self.group)
        if neg == 0:  # (some rank sent its status, not a plan: the result is the status)
            self.told = (code, hi, lo)
            if err is not None:
                raise err
            if code != OK:
                self.stop = JacobianCallError(
                    f"{self.prob.call}: another rank of the process_group failed before "
                    f"planning its products (status {code}).")
                raise self.stop
            return mine
        return None if mine is None and -neg >= k else min(-neg, k)

    def _products(self, mode: str, shapes: Any, vectorized: bool) -> tuple[Any, ...]:
        self._mode = mode
        with torch.no_grad() if mode == "rev" else contextlib.nullcontext():
            if mode == "rev":
                return self._rev(vectorized)
            # ("fwd-loop" computes with plain forward-mode AD, as on one process: torch.func
            # cannot run some functions it runs, one that calls .backward() itself)
            plain = self.strat.mode == "fwd" and not self.strat.vectorized
            return self._fwd(shapes if shapes is not None else probe_outputs(self.prob),
                             vectorized, plain)

    def looped_again(self) -> tuple[Any, ...]:
        """A named ``"rev"``'s products again, one reverse product at a time, from the
        pullback of its first call of f: f is not called again, as on one process (NOTE
        [sharded reverse mode through a wrong formula] in ``torch_vjp._sharded_formulas``)."""
        pulled, self.pulled = self.pulled, None
        self._mode = "rev"
        with torch.no_grad():
            return self._rev(False, pulled)

    def _pull(self) -> tuple[Any, Any, Any]:
        """``(out, pullback, aux)`` of one call of f under torch.func's ``vjp``, its graph
        read for the known wrong operators (:attr:`met`)."""
        prob = self.prob
        g, self.met = reading_wrong_ops(prob.g_inner, prob.has_aux, grad := [None])  # (det's
        res = func_vjp(g, *prob.leaves, has_aux=prob.has_aux)  # backward: NOTE [a backward
        if self.read is not None:  # right only in grad mode] in _engine/wrongops.py)
            self.read[:] = self.met
        pullback = res[1] if grad[0] is None else lambda *c: in_grad_mode(res[1], *c)
        return res[0], pullback, res[2] if prob.has_aux else None

    def _rev(self, vectorized: bool, pulled: tuple[Any, Any, Any] | None = None
             ) -> tuple[Any, ...]:
        prob = self.prob
        leaves = prob.leaves
        if pulled is None:
            pulled = self._pull()
            # (a named "rev" keeps its call's pullback until the ranks have read its graph:
            # its products again without vmap reuse it, NOTE [sharded reverse mode through a
            # wrong formula])
            self.pulled = pulled if self.strat.mode == "rev" and self.strat.vectorized else None
        out, pullback, aux = pulled
        flat_out, out_spec = tree_flatten(out)
        rows_out = row_shapes(flat_out, self.batch, prob, out_spec)
        n = sum(math.prod(s) for s in rows_out)
        start, stop = shard_range(n, self.rank, self.world)
        m = padded_count(n, self.world)  # NOTE [every rank runs as many products]
        if m == 0:
            stacked = [leaf.new_zeros((0, *leaf.shape)) for leaf in leaves]
        else:
            n_in = sum(math.prod(s) for s in in_rows(prob, self.batch))
            chunk = self.chunk = self._chunk(m, n, n_in, [o.dtype for o in flat_out],
                                             leaves[0].dtype, _rev_said(out_spec, rows_out))
            rows = basis_rows(rows_out, [o.dtype for o in flat_out],
                              [o.device for o in flat_out], self.batch)

            def fn(*cot: Tensor) -> Any:
                return pullback(tree_unflatten(list(cot), out_spec))

            stacked, _ = map_rows(fn, lambda s, e: rows(start + s, start + e), m,
                                  vectorized=vectorized, chunk_size=chunk, detach=True)
            stacked = _own(stacked, stop - start)
        return stacked, out_spec, rows_out, aux, start, stop, n

    def _rev_plain(self) -> tuple[Any, ...]:
        """This rank's reverse-mode products with plain autograd: f once, then one
        ``torch.autograd.grad`` per output element of its share (as
        ``torch_vjp._engine.plain.rev_plain`` on one process)."""
        prob = self.prob
        fn, flat_out, out_spec, aux, _ = plain_pullback(prob)
        self.met = [wrong_ops(flat_out)]  # (NOTE [sharded reverse mode through a wrong formula])
        rows_out = row_shapes(flat_out, self.batch, prob, out_spec)
        n = sum(math.prod(s) for s in rows_out)
        start, stop = shard_range(n, self.rank, self.world)
        m = padded_count(n, self.world)  # NOTE [every rank runs as many products]
        if m == 0:
            stacked = [x.new_zeros((0, *x.shape)) for x in prob.leaves]
        else:
            n_in = sum(math.prod(s) for s in in_rows(prob, self.batch))
            chunk = self._chunk(m, n, n_in, [o.dtype for o in flat_out], prob.leaves[0].dtype,
                                _rev_said(out_spec, rows_out))
            rows = basis_rows(rows_out, [o.dtype for o in flat_out],
                              [o.device for o in flat_out], self.batch)
            with torch.no_grad():
                stacked, _ = map_rows(fn, lambda s, e: rows(start + s, start + e), m,
                                      vectorized=False, chunk_size=chunk, detach=True)
            stacked = _own(stacked, stop - start)
        return stacked, out_spec, rows_out, aux, start, stop, n

    def _fwd(self, shapes: Any, vectorized: bool, plain: bool = False) -> tuple[Any, ...]:
        prob = self.prob
        leaves = tuple(prob.leaves)
        flat_out, out_spec, records = shapes
        rows_in = in_rows(prob, self.batch)
        n = sum(math.prod(s) for s in rows_in)
        start, stop = shard_range(n, self.rank, self.world)
        m = padded_count(n, self.world)  # NOTE [every rank runs as many products]
        has_aux = prob.has_aux
        aux = None
        if m == 0:
            stacked = [o.new_zeros((0, *o.shape), device=leaves[0].device) for o in flat_out]
            if has_aux:
                with torch.no_grad():
                    aux = prob.g(*leaves)[1]
        else:
            n_out = sum(math.prod(s) for s in row_shapes(flat_out, self.batch, prob, out_spec))
            said = outputs_said(out_spec, [(tuple(int(d) for d in o.shape),
                                            str(o.dtype).replace("torch.", ""))
                                           for o in flat_out])
            chunk = self._chunk(m, n_out, n, [o.dtype for o in flat_out],
                                flat_out[0].dtype if flat_out else None, said, records)
            rows = basis_rows(rows_in, [x.dtype for x in leaves], [x.device for x in leaves],
                              self.batch)
            g = prob.g_inner
            # (one call of f per column where no vmap runs: the same draws for each, as on
            # one process: NOTE [auto's extra calls draw what the products draw]; plain_push
            # keeps its own)
            same_draws = (None if plain or vectorized and chunk != 1
                          else loop_draws(prob, m))

            def push(*tangents: Tensor) -> Any:
                if same_draws is not None:
                    same_draws()
                res = func_jvp(g, leaves, tangents, has_aux=has_aux)
                tan_flat = tuple(tree_leaves(res[1]))
                return (tan_flat, res[2]) if has_aux else tan_flat

            fn = plain_push(prob, Shapes(flat_out, out_spec, []).check, m)[0] if plain else push
            stacked, aux = map_rows(fn, lambda s, e: rows(start + s, start + e), m,
                                    vectorized=vectorized and not plain, chunk_size=chunk,
                                    extras=has_aux, detach=True)
            stacked = _own(stacked, stop - start)
        return stacked, out_spec, None, aux, start, stop, n


def try_products(compute: Any, work: Work) -> tuple[Any, int, Any]:
    """``(part, status, err)`` of one try at this rank's products: ``part`` None where it
    failed, or where ``"auto"``'s fallback failed on this rank (RETRY: NOTE [the ranks agree
    on their fallbacks])."""
    try:
        part = compute()
    except NoForwardMode as failed:
        return None, NO_FWD, failed.err
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it before raising
        err = None if exc is work.stop else exc  # (another rank failed: no error of its own)
        return None, PASSES if passes_through(exc) else FAILED, err
    if part is None:
        return None, RETRY, work.failed
    return part, OK, None


def _rev_said(spec: Any, rows_out: Any) -> tuple[Any, Any]:
    return outputs_said(spec, [(tuple(int(d) for d in r),) for r in rows_out])


def probe_outputs(prob: Problem) -> tuple[list[Tensor], Any, int]:
    """The outputs (detached), their structure, and what forward-mode products will record:
    0 for no autograd graph, else the elements of the intermediate results they record
    (``recorded_elements``), as the engine's ``probe_shapes`` finds them for a detached
    result (NOTE [memory model]): a chunk planned without them let an f closing over
    parameters that require grad peak at 1.6 times max_memory on every rank."""
    # (drawing nothing: the products that follow draw what a plain call draws, as on one
    # process, NOTE [auto's extra calls draw what the products draw])
    draws = SameDraws(own_generators(prob))
    draws()
    try:
        flat, spec = prob.probe(torch.is_grad_enabled())
    finally:
        draws()
    records = recorded_elements(flat) if any(o.requires_grad for o in flat) else 0
    return [o.detach() for o in flat], spec, records
