"""Sharded Jacobians: the basis split over the ranks of a ``torch.distributed`` process group.

NOTE [sharded Jacobian]
``tv.jacobian(..., process_group=group)`` splits the products that build the Jacobian over
the group's ranks. In reverse mode there is one VJP per output element (a row of the
Jacobian), in forward mode one JVP per input element (a column); the elements are numbered
over the concatenation of the flattened outputs (in the order of ``tree_flatten``) or of
the flattened differentiated primals. Of ``n`` products, rank ``r`` of ``W`` computes those
numbered ``[n * r // W, n * (r + 1) // W)``: contiguous, sizes differing by at most one, and
empty on some ranks when ``n < W``. Each rank runs them with the engine's own moves
(:func:`basis_rows` shifted to its range, :func:`map_rows` with the chunk size planned for
its share, padded to the largest share and chunked alike on every rank so that an f that
runs a collective is called as many times on every rank: NOTE [every rank runs as many
products] in ``torch_vjp._sharded_comm`` and NOTE [the ranks agree on their chunks] in
``torch_vjp._sharded_work``), and
then, by default, every rank receives every shard: each is padded to the largest share (``ceil(n / W)`` rows), gathered with one
``all_gather`` per stacked tensor (gloo and NCCL gather tensors of equal size), cut back to its length and cut into blocks as
the single-process Jacobian is, so that every rank returns the same value that
``tv.jacobian`` returns on one process. With ``shard=True`` nothing is gathered: each rank
returns a :class:`JacobianShard` holding its own products and their range.

Ranks must agree on what they compute, or a collective would wait for ever or gather
mismatched pieces. Before any product, one ``all_gather_object`` compares every rank's call
with rank 0's: strategy, ``argnums``, ``has_aux``, ``shard``, the differentiated primals'
structure (the paths of their leaves, in flattening order: a dict built in another key order
on another rank numbers the products otherwise), shapes and dtypes, the arguments of ``f``
not differentiated (the Jacobian depends on them too: their tensors' shapes, dtypes and
checksums, their numbers' values; other objects are not compared), the parameters and buffers of the modules ``f`` reaches and the tensors it
captures (weights drawn on each rank without a common seed make a function of each rank's
own; where one differs, one more call of ``f`` on every rank, recording the tensors torch's
functions are given, tells whether ``f`` reads it: a module's part that ``f`` never calls,
a head of each rank's own, may differ), the states of the random generators (where one
differs, one more call of ``f`` tells whether it draws: each rank's products would be of its
own draws, its own dropout mask, and the gathered Jacobian a mix of several functions; a
deterministic ``f`` runs whatever state each rank's generators hold), and checksums of the values (the sum and a sum
weighted by numbers spread like random ones, alike on every rank, in float64, of the finite values, and one of where the
non-finite ones are and what they are; each compared to the bound of float64 rounding, 2 n
eps times the sum of its terms' magnitudes: the same values summed with different thread
counts may differ in the last bits). The mode of ``"auto"`` is then chosen from sizes alone, the same on every rank,
and its products are checked against one reverse product as on one process (NOTE [sharded
auto, checked] in ``torch_vjp._sharded_check``), and that reverse product against one forward
product (NOTE [a sharded reverse product checked forward] in ``torch_vjp._sharded_forward``). After the products, one ``all_reduce``
(MAX) of a status code, and of a digest of the structure of ``f``'s output (numbered
in its flattening order too: every rank raises where the ranks' differ), tells every rank
whether some rank failed: then every rank raises
(the failing ranks their own error, the others a :class:`JacobianCallError` naming the rank
and quoting its error), and none waits for a gather that will not come. Where ``"auto"``'s vmap fails on some rank, every rank
falls back to a loop, and where its loop fails in reverse mode, every rank to plain autograd
(NOTE [the ranks agree on their fallbacks] in ``torch_vjp._sharded_work``: an f that runs a
collective is called as often on every rank); when forward mode fails on some rank, every
rank computes again in reverse mode, so that the shards fit together.

Not supported with a group: ``create_graph=True`` and use inside an outer torch.func
transform (the gathered Jacobian would not carry gradients back to the other ranks'
products). A function torch.func cannot run at all (a module in training mode that updates
its running statistics, an old-style custom Function) is computed by ``"auto"`` with plain
autograd, each rank its own share of reverse-mode products (``torch_vjp._sharded_work``);
``"rev-loop"`` does too; the other named strategies use torch.func's ``vjp``/``jvp``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch.utils._pytree import tree_unflatten

from torch_vjp._engine.blocks import Blocks, assemble, fwd_blocks, rev_blocks
from torch_vjp._engine.fwdcheck import (
    CHECKED,
    no_route_message,
    remember,
    route_key,
    signature,
    wrong_route_message,
)
from torch_vjp._engine.jacobian import (
    JACOBIAN_ALTERNATIVES,
    function_key,
    function_name,
    no_forward_message,
)
from torch_vjp._engine.mixing import cross_row_flow, mixing_message
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.rows import SameDraws, own_generators
from torch_vjp._engine.shapes import in_rows, row_shapes
from torch_vjp._errors import (
    JacobianCallError,
    JacobianWarning,
    failing_rank,
    warn_once,
)
from torch_vjp._sharded_buffers import plain_module
from torch_vjp._sharded_check import (
    agreed_route,
    check_agreement,
    noise_verdict,
    own_gap,
    verdict,
)
from torch_vjp._sharded_forward import forward_instead, gathered_ops, known_route
from torch_vjp._sharded_formulas import NamedForward, forward_formula_route
from torch_vjp._sharded_group import JacobianShard, check_group, told_on_failure
from torch_vjp._sharded_work import (
    FAILED,
    NO_FWD,
    OK,
    PASSES,
    RETRY,
    Work,
    all_max,
    comm_device,
    exchange,
    gather,
    outputs_apart,
    outputs_said,
    probe_outputs,
    shard_range,
    try_products,
)
from torch_vjp._strategies import Strategy, choose_mode

__all__ = [
    "JacobianShard", "all_max", "comm_device", "shard_range", "check_group", "plain_module",
    "sharded_jacobian",
    "told_on_failure",
]

_OK, _RETRY, _NO_FWD, _FAILED, _PASSES = OK, RETRY, NO_FWD, FAILED, PASSES  # (_sharded_work)


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def sharded_jacobian(
    prob: Problem,
    strat: Strategy,
    group: Any,
    *,
    shard: bool,
    chunk_size: int | None,
    max_memory: int | None,
    batch: int | None = None,
    alternatives: str = JACOBIAN_ALTERNATIVES,
) -> Any:
    """The Jacobian of ``prob`` with its products split over ``group`` (NOTE [sharded
    Jacobian]): the whole Jacobian (``(J, aux)`` with ``has_aux``) on every rank, or this
    rank's :class:`JacobianShard` with ``shard``. With ``batch`` (``batch_jacobian``), the
    products are those of one row of the batch, each computed for every row at once. (A
    model's buffers swapped for rank 0's are put back on return: NOTE [DDP's buffers in a
    sharded Jacobian] in ``torch_vjp._sharded_buffers``.)"""
    with contextlib.ExitStack() as kept:
        return _sharded(prob, strat, group, shard, chunk_size, max_memory, batch,
                        alternatives, kept)


def _sharded(prob: Problem, strat: Strategy, group: Any, shard: bool, chunk_size: int | None,
             max_memory: int | None, batch: int | None, alternatives: str,
             kept: contextlib.ExitStack) -> Any:
    dist = _dist()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = comm_device(group, prob.leaves[0].device)
    check_agreement(prob, strat.name, shard, group, rank, world, device, kept, max_memory)
    work = Work(prob, strat, rank, world, shard, chunk_size, max_memory, batch, alternatives,
                group, device)
    mode, shapes, key, route = strat.mode, None, None, None
    if mode is None:  # "auto": the mode from sizes alone, the same on every rank
        said = None
        try:
            shapes = probe_outputs(prob)
            n_in = sum(math.prod(s) for s in in_rows(prob, batch))
            rows = row_shapes(shapes[0], batch, prob, shapes[1])
            # (the mode is chosen from the outputs' sizes: alike on every rank, or every
            # rank raises before any product, NOTE [outputs alike on every rank])
            said = outputs_said(shapes[1], [(tuple(int(d) for d in s),) for s in rows])
            n_out = sum(math.prod(s) for s in rows)
            mode = choose_mode(n_in, n_out)
            # (with argnums, and apart for products one at a time, which run no vmap: NOTE
            # [a chunk of one checks no vmap] in _engine/jacobian.py; a budget's chunks
            # differ per rank, so any max_memory call counts apart)
            key = (signature(route_key(prob.f), prob.leaves, batch, prob.primals), mode,
                   prob.argnums, chunk_size == 1 or max_memory is not None)
            err = None
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it before raising
            err = exc
        code, hi, lo, _ = exchange(_OK if err is None else _FAILED, said, 0, group, device)
        if code == _FAILED:
            _raise_failure(prob, err, group, rank, world)
        if hi != -lo:
            outputs_apart(prob.call, said, group)
        route = agreed_route(key, group, device)  # NOTE [sharded auto, checked]
    # (a call that checks: the check's reverse products, and the routes tried after it,
    # draw what the products drew, and the generators end where the products left them,
    # NOTE [auto's extra calls draw what the products draw] in _engine/jacobian.py)
    while True:
        checks = key is not None and route is None
        first = SameDraws(own_generators(prob), host=True) if checks else None
        if first is not None:
            first()
        work.read = [] if route == "rev" else None
        with NamedForward(prob, strat, batch, group, device, work) as named:  # (NOTE [sharded
            part, code, err = _attempt(lambda: _route(work, route or mode, shapes), work,
                                       prob.call)  # forward mode through a wrong formula])
        part, code, err = named.done(code == _OK, (part, code, err), _attempt)
        # (NOTE [a remembered route through a known wrong operator]: on every rank where
        # some rank's products met one, the route is forgotten and the call checked again)
        if work.read is None or not all_max(int(code == _OK and work.stale()), group, device):
            break
        CHECKED.pop(key, None)
        route = None
    if code == _NO_FWD:
        if err is not None:
            _warn_no_forward(prob, err)
        mode, route = "rev", route and "rev"
        part, code, err = _attempt(lambda: work.run(mode, None), work, prob.call)
    if code >= _FAILED:
        _raise_failure(prob, err, group, rank, world)
    if route is not None:  # (remembered by every rank: not checked again; "fwd" for a
        # reverse mode chosen by size: NOTE [a sharded reverse product checked forward])
        mode = "fwd" if route == "fwd" else "rev"
    elif first is not None and not all_max(int(torch.is_inference_mode_enabled()), group,
                                           device):  # (NOTE [sharded auto, checked])
        after, ops, unchecked = SameDraws(first.own, host=True), [], []
        after()
        try:
            part, mode = _checked(prob, work, part, mode, shapes, key, group, device, first,
                                  ops, unchecked)
            part, mode = known_route(prob, part, mode, gathered_ops(ops, group), key,
                                     lambda name: _known(prob, work, name, shapes, first),
                                     bool(unchecked), lambda: agreed_route(key, group, device))
        finally:
            after()
    assert part is not None
    stacked, spec, rows_out, aux, start, stop, n = part
    if shard:
        values = tree_unflatten(list(stacked), prob.in_spec if mode == "rev" else spec)
        return JacobianShard(values, mode, start, stop, n, aux)
    full = gather(list(stacked), n, group, world, device,
                  lambda e: _raise_failure(prob, e, group, rank, world))
    if mode == "rev":
        blocks, views = rev_blocks(full, rows_out, batch)
    else:
        blocks, views = fwd_blocks(full, in_rows(prob, batch))
    jac = assemble(prob, Blocks(blocks, spec, aux, mode, views))
    return (jac, aux) if prob.has_aux else jac


def _attempt(compute: Any, work: Work, call: str) -> tuple[Any, int, Any]:
    """``(part, code, err)``: this rank's products, and the worst status over the ranks
    (exchanged with the plan where some rank made none: NOTE [the ranks agree on their
    chunks] in ``torch_vjp._sharded_work``). Raises, on every rank, where the ranks' outputs
    of f are structured differently (a dict built in another key order: the products are
    numbered in each rank's own order)."""
    work.attempt()
    while True:
        part, status, err = try_products(compute, work)
        # (a digest of the output's structure, and of its leaves' shapes (and dtypes, which
        # forward mode gathers): its largest and smallest over the ranks differ where some
        # rank's differs. NOTE [outputs alike on every rank])
        said = None if part is None else outputs_said(part[1], _output_leaves(part))
        if work.told is not None:
            code, hi, lo = work.told
        else:
            code, hi, lo, _ = exchange(status, said, 0, work.group, work.device)
        if code != _RETRY:
            break
        work.retry()  # (every rank's next fallback: NOTE [the ranks agree on their fallbacks])
    if status == _RETRY:
        err = None  # (a fallback this rank would have taken: no error of its own)
    if code == _OK and hi != -lo:
        outputs_apart(call, said, work.group)
    return part, code, err


# NOTE [outputs alike on every rank]
# The products are numbered over f's output elements (reverse mode) and gathered as tensors
# of f's output shapes (forward mode): outputs of other shapes (or dtypes, forward mode) on
# some rank mixed rows of several numberings in the gathered Jacobian, silently, or made
# gloo abort the process. f's arguments and weights agree (compared before any product):
# such an f reads something of each rank's own (a number bound per rank, a global). Every
# rank raises before any product where it can: "auto" compares the outputs' rows when it
# chooses its mode, and every try compares them when it agrees its chunks
# (``outputs_apart`` in torch_vjp._sharded_comm): f run more often on one rank than on
# another waited for ever in a collective of its own, or of its backward.


def _output_leaves(part: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """The shape of each output leaf (of one row of the batch for ``batch_jacobian``), and
    in forward mode its dtype: what the ranks' outputs must agree on."""
    stacked, rows_out = part[0], part[2]
    if rows_out is not None:  # (reverse mode: the rows' shapes number the products)
        return [(tuple(int(d) for d in s),) for s in rows_out]
    return [(tuple(int(d) for d in t.shape[1:]), str(t.dtype).replace("torch.", ""))
            for t in stacked]


def _route(work: Work, route: str, shapes: Any) -> tuple[Any, ...] | None:
    """This rank's products by ``route`` ("fwd", "rev", "rev-loop" or "fwd-loop")."""
    if route.endswith("-loop"):
        return work._products(route[:3], shapes if route == "fwd-loop" else None, False)
    return work.run(route, shapes if route == "fwd" else None)


def _known(prob: Problem, work: Work, name: str, shapes: Any, first: SameDraws) -> Any:
    """Every rank's products by the route ``name`` (NOTE [sharded auto reads the graph for
    known wrong operators]), or None on every rank where it failed on some."""
    first()
    alt, code, err = _attempt(lambda: _route(work, name, shapes), work, prob.call)
    if code == _PASSES:  # (out of memory: no other route hides it)
        _raise_failure(prob, err, work.group, work.rank, work.world)
    return alt if code == _OK else None


def _checked(prob: Problem, work: Work, part: tuple[Any, ...], mode: str, shapes: Any,
             key: Any, group: Any, device: torch.device, first: SameDraws, ops: list[Any],
             unchecked: list[bool]) -> tuple[tuple[Any, ...], str]:
    """``(part, mode)`` if every rank's products agree with a reverse product; else the
    first of the next routes that does, on every rank alike, and "rev" (NOTE [sharded auto,
    checked]). ``first()`` puts the generators back where the products started, before each
    reverse product and each route; ``ops`` receives the known wrong operators of the first
    reverse product's graph (NOTE [sharded auto reads the graph for known wrong
    operators]); ``unchecked`` receives True where x or some rank's reverse product is not
    finite: nothing compared (NOTE [sharded auto at a point it cannot check])."""
    floor: list[float] = []  # (the rounding's scale and the tolerance, measured once)
    def agrees(p: tuple[Any, ...], m: str) -> tuple[bool, float, float]:
        err = None
        first()
        try:
            mine = own_gap(prob, m, p[0], p[4], p[5], work.batch, None if ops else ops)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it before raising
            mine, err = None, exc
        ok, d, s, failed = verdict(mine, prob.leaves[0].dtype, err is not None, group, device)
        if not ok and not failed:  # (on every rank alike: NOTE [sharded auto, checked])
            ok, s = noise_verdict(prob, d, s, mine, floor, group, device,
                                  lambda e: _raise_failure(prob, e, group, work.rank,
                                                           work.world))
        if failed:
            _raise_failure(prob, err, group, work.rank, work.world)
        return ok, d, s

    part, mode, ok, diff, scale = forward_formula_route(prob, part, mode, agrees(part, mode),
        ops, group, device, lambda: _known(prob, work, "rev", shapes, first), agrees)
    if not math.isfinite(scale):  # (some rank's, through the verdict's MAX: every rank's)
        if work.batch is not None:  # (but a flow across rows shows there too)
            _refuse_mixing(prob, work, None, None, group, device)
        unchecked.append(True)
        return part, mode
    if mode != "fwd" or not ok:  # NOTE [a sharded reverse product checked forward]
        def forward() -> tuple[Any, bool]:
            work.looped = False
            alt, code, err = _attempt(lambda: work.run("fwd", shapes), work, prob.call)
            if code == _PASSES:  # (out of memory: no other route hides it)
                _raise_failure(prob, err, group, work.rank, work.world)
            return (alt if code == _OK else None), work.looped

        fwd = forward_instead(prob, part, mode, work.batch, key, group, device, first,
                              forward, lambda e: _raise_failure(prob, e, group, work.rank,
                                                                work.world),
                              lambda: _known(prob, work, "rev-loop", shapes, first))
        if fwd is not None:
            return fwd
    if ok:
        remember(key, mode)
        return part, mode
    for name in ("rev", "rev-loop") if mode == "fwd" else ("rev-loop",):
        first()
        alt, code, err = _attempt(lambda: _route(work, name, shapes), work, prob.call)
        if code == _PASSES:  # (out of memory: no other route hides it)
            _raise_failure(prob, err, group, work.rank, work.world)
        if code != _OK or not agrees(alt, "rev")[0]:
            continue
        remember(key, name)
        warn_once(
            (prob.call, function_key(prob.f), mode, name),
            wrong_route_message(prob.call, function_name(prob.f), mode, name, diff, scale,
                                "strategy"),
            JacobianWarning,
        )
        return alt, "rev"
    if work.batch is not None:
        _refuse_mixing(prob, work, diff, scale, group, device)
    remember(key, mode)
    warn_once((prob.call, function_key(prob.f), mode, "none"),
              no_route_message(prob.call, function_name(prob.f), mode, diff, scale,
                               "strategy"),
              JacobianWarning)
    return part, mode


def _refuse_mixing(prob: Problem, work: Work, diff: float | None, scale: float | None,
                   group: Any, device: torch.device) -> None:
    """batch_jacobian's "auto" where no route agrees: every rank raises NOTE [a batch that
    mixes rows]'s error once some rank finds a flow across rows (each rank tests the batch
    itself: the ranks hold the same f and x, checked before the products), rather than
    return a result that is no per-example Jacobian with a warning only."""
    err = flow = None
    try:
        flow = cross_row_flow(prob, work.batch)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it before raising
        err = exc
    code = all_max(_FAILED if err is not None else 0 if flow is None else 1, group, device)
    if code == _FAILED:
        _raise_failure(prob, err, group, work.rank, work.world)
    if code == 1:
        said: list[Any] = [None] * work.world
        _dist().all_gather_object(said, flow, group=group)
        rows, j = next(s for s in said if s is not None)
        raise JacobianCallError(mixing_message(prob.call, function_name(prob.f), diff, scale,
                                               rows, j))


def _raise_failure(prob: Problem, err: BaseException | None, group: Any, rank: int,
                   world: int) -> None:
    """Every rank raises once some rank failed: its own error, or one naming the rank that
    failed and quoting it."""
    found = failing_rank(err, group, world)
    if err is not None:
        raise err
    assert found is not None
    first, quoted = found
    raise JacobianCallError(
        f"{prob.call}: rank {first} of the process_group failed while computing its share of "
        f"the Jacobian, so this rank ({rank}) has no whole Jacobian to return. Rank "
        f"{first} said: {quoted}\n"
        f"  The cause and its fix are in rank {first}'s traceback."
    )


def _warn_no_forward(prob: Problem, err: BaseException) -> None:
    warn_once(
        ("fwd-to-rev-sharded", function_key(prob.f), type(err)),
        no_forward_message(prob, err, "on every rank of the process_group"),
        JacobianWarning,
    )
