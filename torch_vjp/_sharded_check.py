"""What a sharded Jacobian checks: that every rank makes the same call (NOTE [sharded
Jacobian] in ``torch_vjp._sharded``), and ``"auto"``'s products against one reverse
product, on every rank.

NOTE [sharded auto, checked]
``"auto"`` checks its vectorised Jacobian against one reverse product without vmap (NOTE
[auto, checked once] in ``torch_vjp._engine.fwdcheck``): forward-mode formulas and the
batching rules of backward formulas are wrong for a few torch operators. With a process
group no rank holds the whole Jacobian before the gather (and with ``shard=True`` none
ever does), so each rank checks its own products:

- forward mode: its columns ``[start, stop)`` give ``(u^T J)[start:stop]``, compared with
  those entries of one reverse product ``u^T J``;
- reverse mode: its rows ``[start, stop)`` give ``u'^T J`` for the cotangent ``u'`` that is
  ``u`` on those rows and zero elsewhere, compared with one reverse product with ``u'``.

``u`` comes from a generator of the check's own, the same on every rank. One ``all_reduce``
(MAX) of the largest difference, the largest entry and an "unchecked" flag (a rank whose
reverse product plain autograd cannot take) makes the verdict the same on every rank. Where
it is a disagreement, every rank (all of them, whatever its own difference: an f that runs
collectives pairs its calls with the other ranks') measures the rounding of its reverse
products, and one more ``all_reduce`` (MAX) compares again at the scale of the numbers they
were computed from, as one process does (NOTE [the scale of what is compared] in
``torch_vjp._engine.fwdnoise``): a long float32 computation whose routes differ by rounding
only, far above ``sqrt(eps)`` of the products, is not a wrong formula. So every rank takes
the same next route: reverse mode under vmap after forward mode, then
one reverse product at a time, the first that agrees, with the single-process warning.
The route is remembered under the key the single-process check uses (the same function,
input signature and size-chosen mode: the verdict is about f's operators, not about the
group); before computing, one ``all_reduce`` (SUM of one-hot votes) takes a remembered
route only where every rank remembers the same one, so that ranks whose caches differ
(one rank also ran the function alone) still compute in one mode. For batch_jacobian,
where no route agrees, each rank tests the batch for a flow across rows (NOTE [a batch that
mixes rows]), and every rank raises its error once one rank finds one, as one process does.
In inference mode autograd records no graph, so there is no reverse product to compare with
(its products read as zeros: a false warning that the route disagrees, and a route
remembered from it): as on one process, nothing is checked and nothing remembered, on every
rank where some rank is in it (one ``all_reduce``, MAX, of the flag before the check).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
import sys
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves

from torch_vjp._engine.context import buffers_kept, modules_reached, reached
from torch_vjp._engine.fwdcheck import (
    CHECKED,
    all_finite,
    gap,
    least_precise,
    one_reverse_product,
    stacked_gap,
    tolerance,
)
from torch_vjp._engine.fwdnoise import reverse_noise
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.rows import SameDraws, own_generators
from torch_vjp._errors import JacobianCallError, quote_error, shape_str
from torch_vjp._sharded_buffers import rank0_buffers, unsynced_buffer
from torch_vjp._sharded_forward import agreeing
from torch_vjp._sharded_words import (
    argument_differs,
    call_differs,
    draws_differ,
    function_differs,
    not_joined,
    order_differs,
)

__all__ = [
    "ROUTES", "agreed_route", "check_agreement", "fail_before_exchange", "leaf_paths",
    "noise_verdict", "own_gap", "verdict",
]

#: The routes "auto" may take, in the order it tries them.
ROUTES = ("fwd", "rev", "rev-loop")


def agreed_route(key: Hashable, group: Any, device: torch.device) -> str | None:
    """The route every rank of ``group`` remembers for ``key``, or None where some rank
    remembers none or another one (then the call is checked again)."""
    import torch.distributed as dist

    votes = torch.zeros(len(ROUTES) + 1, dtype=torch.int64, device=device)
    route = CHECKED.get(key)
    votes[ROUTES.index(route) if route in ROUTES else len(ROUTES)] = 1
    dist.all_reduce(votes, op=dist.ReduceOp.SUM, group=group)
    world = dist.get_world_size(group)
    for name, n in zip(ROUTES, votes.tolist()):
        if n == world:
            return name
    return None


def own_gap(prob: Problem, mode: str, stacked: Sequence[Tensor], start: int, stop: int,
            batch: int | None, ops: list[Any] | None = None
            ) -> tuple[float, float, float] | None:
    """``(difference, scale, rtol)`` between ``u^T J`` read from this rank's products
    (``stacked``, in ``mode``, numbered ``[start, stop)``) and one reverse product (NOTE
    [sharded auto, checked]), ``rtol`` the rounding of the least precise dtype f's graph
    computes in (a float32 step in a float64 f: ``least_precise``); None where the reverse
    product cannot be taken; ``(0, inf, 0)`` where x or it holds a NaN or an infinity
    (from a tensor f reads but does not differentiate, x finite): no comparison there, and
    a scale that :func:`verdict`'s MAX carries to every rank, which then takes the route of
    a point it cannot check (NOTE [sharded auto at a point it cannot check] in
    ``torch_vjp._sharded_forward``). ``ops``: receives the known wrong operators of the
    reverse product's graph (NOTE [sharded auto reads the graph for known wrong
    operators] in ``torch_vjp._sharded_forward``), read at a point not finite too."""
    keep = None if mode == "fwd" else (lambda us: _only_rows(us, start, stop, batch))
    finite = all_finite(prob.leaves)  # (x is the same on every rank, checked before)
    # (and, in forward mode, the operator whose forward-mode formula is wrong, as a third
    # entry of ``ops``: NOTE [sharded forward mode through a wrong formula])
    fwd: list[str | None] | None = [] if ops is not None and mode == "fwd" else None
    got = one_reverse_product(prob, keep, anywhere=not finite, ops=ops, forward=fwd)
    if fwd and ops:
        ops[-1] = (*ops[-1], fwd[0])
    if not finite:
        return 0.0, math.inf, 0.0
    if stop == start:
        # (nothing to compare, but f called as on the other ranks: an f that runs
        # collectives waited for ever for this rank's call)
        return 0.0, 0.0, 0.0
    if got is None:
        return None
    flat, us, grads = got
    if not all_finite(grads):
        return 0.0, math.inf, 0.0
    rtol = tolerance(least_precise(flat, prob.leaves))
    return (*_gap(prob, mode, stacked, start, stop, batch, flat, us, grads), rtol)


def _gap(prob: Problem, mode: str, stacked: Sequence[Tensor], start: int, stop: int,
         batch: int | None, flat: Sequence[Tensor], us: Sequence[Tensor],
         grads: Sequence[Tensor]) -> tuple[float, float]:
    """:func:`own_gap`'s ``(difference, scale)``, from the reverse product ``grads`` of the
    cotangents ``us`` of the outputs ``flat``."""
    with torch.no_grad():
        if mode == "fwd":
            if len(flat) != len(stacked):
                return math.inf, 0.0
            k = stop - start
            mine = None
            for t, u in zip(stacked, us):
                t = t.detach()
                if batch is None:
                    part = t.reshape(k, -1) @ u.reshape(-1).to(t.dtype)
                else:
                    part = (t.reshape(k, batch, -1) * u.reshape(1, batch, -1).to(t.dtype)).sum(-1)
                part = part.to(grads[0].dtype) if grads else part
                mine = part if mine is None else mine + part
            ref = (torch.cat([g.reshape(-1) for g in grads])[start:stop] if batch is None
                   else torch.cat([g.reshape(batch, -1) for g in grads], 1)[:, start:stop].T)
            if mine is None or mine.shape != ref.shape:
                return math.inf, 0.0
            return gap(mine.reshape(-1), ref.reshape(-1))
        rows = _flat_cotangent(us, batch)[..., start:stop]  # (k,) or (B, k)
        return stacked_gap(rows, stacked, grads, batch)


def verdict(gap: tuple[float, float, float] | None, dtype: torch.dtype, failed: bool,
            group: Any, device: torch.device) -> tuple[bool, float, float, bool]:
    """Every rank's ``(agrees, difference, scale, failed)`` from each rank's :func:`own_gap`:
    the largest difference against the largest scale over the ranks, within the largest
    rounding any rank's graph computes at (at least ``dtype``'s: every rank decides alike);
    a rank that could not check counts as agreeing: where none could, the result stands;
    ``failed``: some rank's check raised (every rank raises next)."""
    import torch.distributed as dist

    diff, scale, rtol = (0.0, 0.0, 0.0) if gap is None else gap
    if math.isnan(diff):
        diff = math.inf  # (a NaN is a disagreement; MAX of a NaN is not defined by every backend)
    rtol = max(rtol, tolerance(dtype))
    t = torch.tensor([diff, scale, float(failed), rtol], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    diff, scale, failed_any, rtol = t.tolist()
    # (a rank that could not check adds nothing: another rank's disagreement stands)
    return diff <= rtol * scale, diff, scale, bool(failed_any)


def noise_verdict(prob: Problem, diff: float, scale: float, gap: Any, floor: list[float],
                  group: Any, device: torch.device,
                  fail: Callable[[BaseException | None], None]) -> tuple[bool, float]:
    """``(agrees, scale)`` where :func:`verdict` found a disagreement: compared again at the
    scale of the numbers the products were computed from (NOTE [the scale of what is
    compared] in ``torch_vjp._engine.fwdnoise``), measured once per check (``floor`` keeps
    it) on every rank, each its own reverse products' rounding, the largest taken: the
    verdict is the same on every rank, so every rank calls f as many times, and an f that
    runs collectives pairs with the other ranks' calls. Each step of the measure is agreed
    too (``reverse_noise``'s ``agree``): a rank whose products do not scale exactly with
    their cotangent, or fail, stops it on every rank (it had stopped alone, and the others
    called f's backward again); ``fail(err)`` raises on every rank where some rank's step
    raised an error no check may hide."""
    import torch.distributed as dist

    if not math.isfinite(diff):
        return False, scale
    if not floor:
        # (the rounding of the least precise dtype this rank's graph computes in: own_gap's
        # rtol is its sqrt(eps); noise / eps, fwdnoise.rounding_scale, is the scale)
        rtol = max(gap[2] if gap is not None else 0.0, tolerance(prob.leaves[0].dtype))
        noise = reverse_noise(prob, agreeing(group, device, fail))
        own = noise / rtol ** 2 if math.isfinite(noise) else 0.0
        t = torch.tensor([own, rtol], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        floor += [float(t[0]), float(t[1])]
    scale = max(scale, floor[0])
    return diff <= floor[1] * scale, scale


#: Elements of a tensor checksummed at a time: the float64 temporaries of one chunk (about
#: a dozen of its size) stay small whatever the tensor's size (a model's embedding); with
#: max_memory, at most max_memory / :data:`_CHUNK_BYTES` (a 256 x 256 weight's at once had
#: peaked at 11.7 times a max_memory the products kept to).
_CHUNK, _CHUNK_BYTES = 1 << 20, 128


def _checksums(leaf: Tensor, chunk: int = _CHUNK) -> tuple[Any, int]:
    """``(((sum, sum of |terms|) per checksum), numel)`` of a tensor's values (NOTE [sharded
    Jacobian]): a complex tensor's real and imaginary parts both, a chunk of
    ``chunk`` elements at a time (the whole tensor at once held a dozen float64 copies of
    it: 2 GB more for a 100 MB weight)."""
    x = leaf.detach().reshape(-1)
    if x.is_complex():  # (before float64: .to(float64) drops the imaginary part)
        x = torch.view_as_real(x).reshape(-1)
    n = x.numel()
    totals = [[0.0, 0.0] for _ in range(3)]
    for start in range(0, n, chunk):
        part = x[start:start + chunk].to(torch.float64)
        # (weights alike on every rank, spread like random ones: the fractional parts of
        # multiples of the golden ratio, computed where x is, without a CPU generator's
        # draw; a change that cancels in the plain sum, or in a position-weighted one, does
        # not cancel here. The non-finite values apart, by where they are and what they
        # are, so that one inf masks nothing)
        w = torch.arange(start, start + part.numel(), dtype=torch.float64, device=x.device)
        w = w.mul_(0.6180339887498949).frac_().sub_(0.5)
        finite = torch.isfinite(part)
        xf = torch.where(finite, part, 0.0)
        kinds = torch.where(torch.isnan(part), 1.0, torch.where(part > 0, 2.0, 3.0))
        odd = torch.where(finite, 0.0, kinds * (w + 4.0))
        terms = torch.stack((xf, xf * w, odd))
        for total, s, a in zip(totals, terms.sum(1).tolist(), terms.abs().sum(1).tolist()):
            total[0] += s
            total[1] += a
    return tuple((s, a) for s, a in totals), n


def _other_leaf(leaf: Any, chunk: int = _CHUNK) -> tuple[Any, ...]:
    """What every rank must agree on of one leaf of an argument that is not differentiated:
    a tensor's shape, dtype and checksums, a number's value; other objects (a module, a
    device, a string) are not compared (NOTE [sharded Jacobian])."""
    if isinstance(leaf, Tensor):
        sums = None
        if leaf.layout == torch.strided and not leaf.is_nested and leaf.device.type != "meta":
            try:
                sums = _checksums(leaf, chunk)
            except (RuntimeError, TypeError):  # (a dtype float64 cannot hold: unchecked)
                sums = None
        return ("tensor", tuple(leaf.shape), str(leaf.dtype).replace("torch.", ""), sums)
    if isinstance(leaf, (bool, int, float, complex)) or leaf is None:
        return ("number", repr(leaf))
    return ("object",)


def _used_tensors(prob: Problem, chunk: int = _CHUNK
                  ) -> tuple[list[tuple[str, str, Any]], list[Tensor]]:
    """``(name, owner, what to agree on)`` of the tensors ``f`` may use that are not its
    arguments, and the tensors themselves: the parameters and buffers of the modules it
    reaches (itself, a closure's or an argument's) and the tensors it captures (NOTE
    [sharded Jacobian]). (A module in training mode that updates its buffers, BatchNorm's
    running statistics, cannot run in a sharded Jacobian at all: torch.func refuses the
    in-place update.)"""
    modules, tensors = reached(prob.f)
    known = {id(m) for m in modules}
    modules += [m for m in modules_reached(prob.primals) if id(m) not in known]
    seen: set[int] = set()
    used, objects = [], []
    for root in modules:
        for prefix, m in root.named_modules():
            for name, t in (*m._parameters.items(), *m._buffers.items()):
                if isinstance(t, Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    used.append((f"{prefix}.{name}" if prefix else name, type(root).__name__,
                                 _other_leaf(t, chunk)))
                    objects.append(t)
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            used.append(("", "", _other_leaf(t, chunk)))
            objects.append(t)
    return used, objects


class _Reads(torch.overrides.TorchFunctionMode):
    """Records the ids of the tensors passed to torch functions and methods while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        for leaf in tree_leaves((args, kwargs or {})):
            if isinstance(leaf, Tensor):
                self.ids.add(id(leaf))
        return func(*args, **(kwargs or {}))


def _read_by_f(prob: Problem, tensors: Sequence[Tensor]) -> list[bool]:
    """Whether one call of ``f`` reads each of ``tensors``: a parameter of a module that
    ``f`` reaches but never calls (a head left out) differs between ranks harmlessly. f is
    called once, without a graph, its draws and buffers put back; a call that fails reads
    every tensor (the products will raise its error)."""
    reads = _Reads()
    draws = SameDraws(own_generators(prob), host=True)
    draws()
    try:
        with torch.no_grad(), buffers_kept(prob.f, primals=prob.primals), reads:
            prob.g(*prob.leaves)
    except Exception:  # noqa: BLE001 - (the products raise it, on every rank)
        return [True] * len(tensors)
    finally:
        draws()
    return [id(t) in reads.ids for t in tensors]


def _rng_digests(gens: Sequence[torch.Generator]) -> tuple[str, ...]:
    """A digest of the state of each generator ``f`` may draw from: torch's CPU generator,
    the current CUDA device's (where CUDA is initialised), Python's and NumPy's global ones,
    and ``gens`` (f's own)."""
    def digest(*parts: Any) -> str:
        h = hashlib.sha1()
        for part in parts:
            h.update(part.cpu().numpy().tobytes() if isinstance(part, Tensor)
                     else part.tobytes() if hasattr(part, "tobytes") else repr(part).encode())
        return h.hexdigest()

    try:
        out = [digest(torch.get_rng_state())]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out.append(digest(torch.cuda.get_rng_state()))
        out.append(digest(random.getstate()))
        np = sys.modules.get("numpy")
        if np is not None:
            kind, keys, *rest = np.random.get_state()
            out.append(digest(kind, np.asarray(keys), rest))
        out += [digest(g.get_state()) for g in gens]
    except Exception:  # noqa: BLE001 - unknown: then whether f draws decides
        return ("?",)
    return tuple(out)


def _draws_from(prob: Problem, gens: Sequence[torch.Generator]) -> list[bool]:
    """Which generators of :func:`_rng_digests` one call of ``f`` draws from (moves); f is
    called once, without a graph, its draws and buffers put back; a call that fails draws
    from none (the products will raise its error)."""
    draws = SameDraws(gens, host=True)
    draws()
    try:
        before = _rng_digests(gens)
        with torch.no_grad(), buffers_kept(prob.f, primals=prob.primals):
            prob.g(*prob.leaves)
        return [a != b for a, b in zip(before, _rng_digests(gens))]
    except Exception:  # noqa: BLE001 - (the products raise it, on every rank)
        return []
    finally:
        draws()


def leaf_paths(tree: Any) -> list[str] | None:
    """The paths of ``tree``'s leaves, in flattening order (``keystr``: ``[0]['w']``); None
    where a node of it has no keys (a pytree node registered without
    ``flatten_with_keys_fn``): then no order is compared."""
    try:
        return [keystr(path) for path, _ in tree_flatten_with_path(tree)[0]]
    except Exception:  # noqa: BLE001 - (a node without keys; its unflatten refusing zeros)
        return None


def _signature(prob: Problem, strategy: str, shard: bool,
               gens: Sequence[torch.Generator], chunk: int = _CHUNK) -> dict[str, Any]:
    others = []
    for i, primal in enumerate(prob.primals):
        if i in prob.argnums:
            continue
        leaves = tree_leaves(primal)
        paths = leaf_paths(primal) or [f"<leaf {j}>" for j in range(len(leaves))]
        # (by path: a dict built in another order on another rank is the same argument)
        others.append((i, sorted(((path, _other_leaf(leaf, chunk)) for path, leaf in zip(paths,
                                                                                 leaves)),
                                 key=lambda item: item[0])))
    return {
        "strategy": strategy,
        "argnums": prob.argnums,
        "has_aux": prob.has_aux,
        "shard": shard,
        "paths": leaf_paths(tuple(prob.primals[i] for i in prob.argnums)),
        "shapes": [tuple(leaf.shape) for leaf in prob.leaves],
        "dtypes": [str(leaf.dtype).replace("torch.", "") for leaf in prob.leaves],
        "sums": [_checksums(leaf, chunk) for leaf in prob.leaves],
        "others": others,
        "used": _used_tensors(prob, chunk)[0],
        "rng": _rng_digests(gens),
    }


def _same_sums(a: Any, b: Any) -> bool:
    """Whether two :func:`_checksums` agree to float64's rounding of their sums."""
    (sums_a, n), (sums_b, _) = a, b
    # (each sum against the bound of float64 rounding for n terms summed in any order,
    # 2 n eps sum|terms|: the same values summed with other thread counts differ by no
    # more, at any scale)
    bound = 2 * max(n, 1) * torch.finfo(torch.float64).eps
    return all(abs(u - v) <= bound * max(su, sv) for (u, su), (v, sv) in zip(sums_a, sums_b))


def _other_differs(ref: list[Any], got: list[Any], r: int) -> tuple[str, str] | None:
    """``(name, how)`` of the first argument not differentiated that differs on rank ``r``
    from rank 0, or None."""
    if len(ref) != len(got):  # (an argument passed on some ranks only: f(x, *extra))
        more, fewer, where = (got, ref, f"on rank {r} but not on rank 0") if len(got) > len(
            ref) else (ref, got, f"on rank 0 but not on rank {r}")
        return f"primals[{more[len(fewer)][0]}]", f"it is passed {where}"
    for (i, leaves_a), (_, leaves_b) in zip(ref, got):
        if len(leaves_a) != len(leaves_b):
            return f"primals[{i}]", f"it holds {len(leaves_b)} leaves on rank {r} but " \
                f"{len(leaves_a)} on rank 0"
        for (path, a), (path_b, b) in zip(leaves_a, leaves_b):
            name = f"primals[{i}]{path}"
            if path != path_b:
                return f"primals[{i}]", (f"it holds primals[{i}]{path_b} on rank {r} where "
                                         f"rank 0's holds {name}")
            if a[0] != b[0]:
                return name, f"it is a {b[0]} on rank {r} but a {a[0]} on rank 0"
            if a[0] == "tensor":
                if a[1:3] != b[1:3]:
                    return name, (f"it has shape {shape_str(b[1])} and dtype {b[2]} on "
                                  f"rank {r} but {shape_str(a[1])} and {a[2]} on rank 0")
                if a[3] is not None and b[3] is not None and not _same_sums(a[3], b[3]):
                    return name, (f"it holds different values on rank {r} than on rank 0 "
                                  f"(their checksums differ)")
            elif a != b:
                return name, f"it is {b[1]} on rank {r} but {a[1]} on rank 0"
    return None


def check_agreement(prob: Problem, strategy: str, shard: bool, group: Any, rank: int,
                    world: int, device: torch.device, kept: contextlib.ExitStack,
                    max_memory: int | None = None) -> None:
    """Raises, on every rank, if some rank's call differs from rank 0's, or some rank could
    not even set its call up (NOTE [sharded Jacobian]); takes rank 0's buffers of a model
    DDP wraps (NOTE [DDP's buffers in a sharded Jacobian]), which ``kept`` puts back. The
    checksums' temporaries fit ``max_memory`` (:data:`_CHUNK_BYTES`)."""
    import torch.distributed as dist

    gens = own_generators(prob)
    chunk = _CHUNK if max_memory is None else max(1024, min(_CHUNK,
                                                            max_memory // _CHUNK_BYTES))
    try:
        mine = _signature(prob, strategy, shard, gens, chunk)
    except Exception as err:  # (an argument whose checksum this rank cannot take: the
        fail_before_exchange(err, group)  # others raise too, not wait in the exchange)
        raise
    sigs: list[Any] = [None] * world
    try:
        dist.all_gather_object(sigs, mine, group=group)
    except RuntimeError as err:  # (gloo's timeout, a peer gone: DistBackendError)
        raise JacobianCallError(not_joined(prob.call, rank, err)) from err
    for r, sig in enumerate(sigs):
        if "failed" in sig:
            raise JacobianCallError(
                f"{prob.call}: rank {r} of the process_group rejected its call before any "
                f"product, so this rank ({rank}) has no whole Jacobian to return. Rank {r} "
                f"said: {sig['failed']}\n"
                f"  The cause and its fix are in rank {r}'s traceback; every rank must make "
                f"the same call."
            )
    ref = sigs[0]
    for r, sig in enumerate(sigs[1:], start=1):
        for key in ("strategy", "argnums", "has_aux", "shard", "paths", "shapes", "dtypes"):
            if sig[key] == ref[key]:
                continue
            if key == "paths":  # (before the shapes: leaves in another order differ there)
                order_differs(prob.call, "the differentiated primals", ref[key] or [],
                              sig[key] or [], r, "primals")
            call_differs(prob, r, key, ref[key], sig[key])
        for i, (a, b) in enumerate(zip(ref["sums"], sig["sums"])):
            if not _same_sums(a, b):
                call_differs(prob, r, "values", None, None, i)
        other = _other_differs(ref["others"], sig["others"], r)
        if other is not None:
            argument_differs(prob, *other)
        if len(sig["used"]) != len(ref["used"]):
            function_differs(prob, f"f uses {len(sig['used'])} tensors that are not its "
                                  f"arguments on rank {r} but {len(ref['used'])} on rank 0")
    # generators in other states on some rank are an error only where f draws from them
    # (dropout in training mode): each rank's products would be of its own draws, and the
    # gathered Jacobian would mix the functions of several masks
    differ_at = [r for r, sig in enumerate(sigs) if sig["rng"] != ref["rng"]]
    if differ_at:
        n = len(ref["rng"])
        # (which generators differ: those at a place where some rank's digest is another)
        apart = [any(len(sig["rng"]) != n or sig["rng"][i] != ref["rng"][i] for sig in sigs)
                 for i in range(n)]
        moved = _draws_from(prob, gens)
        hit = any(m and (i >= n or apart[i]) for i, m in enumerate(moved))
        flag = torch.tensor([int(hit)], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag.item()):
            draws_differ(prob, differ_at[0])
    # a tensor f reaches that differs between ranks is an error only where f reads it
    differ = {i: how for r, sig in reversed(list(enumerate(sigs[1:], start=1)))
              for i, how in _used_differs(ref["used"], sig["used"], r)}
    unsynced: dict[int, Any] = {}
    if differ:
        objects = _used_tensors(prob, chunk)[1]
        differ, unsynced = rank0_buffers(prob, group, device, differ, objects, kept)
    if differ:
        order = sorted(differ)
        flags = torch.tensor(_read_by_f(prob, [objects[i] for i in order]), dtype=torch.int64,
                             device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        for i, read in zip(order, flags.tolist()):
            if read and i in unsynced:
                unsynced_buffer(prob, differ[i], unsynced[i], group)
            if read:
                function_differs(prob, differ[i])


def fail_before_exchange(err: BaseException, group: Any) -> None:
    """This rank's call failed before the exchange that opens a sharded Jacobian (an invalid
    option, primal or argnums): tells the other ranks, which are waiting in that exchange, so
    that they raise too (:func:`check_agreement`) instead of waiting for ever. The caller
    raises ``err`` next."""
    try:
        import torch.distributed as dist

        said: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(said, {"failed": quote_error(err)}, group=group)
    except Exception:  # noqa: BLE001 - the caller's own error is what this rank raises
        pass


def _used_differs(ref: list[Any], got: list[Any], r: int) -> Iterator[tuple[int, str]]:
    """``(index, how)`` for each tensor ``f`` reaches (:func:`_used_tensors`, as many on
    both ranks) that differs on rank ``r`` from rank 0's."""
    for i, ((name, owner, a), (name_b, owner_b, b)) in enumerate(zip(ref, got)):
        what = (f"the {name!r} of the {owner} f uses" if owner
                else f"a tensor of shape {shape_str(a[1])} that f captures")
        if (name, owner, a[:3]) != (name_b, owner_b, b[:3]):
            yield i, (f"{what} has shape {shape_str(b[1])} and dtype {b[2]} on rank {r} but "
                      f"{shape_str(a[1])} and {a[2]} on rank 0")
        elif a[3] is not None and b[3] is not None and not _same_sums(a[3], b[3]):
            yield i, (f"{what} holds different values on rank {r} than on rank 0 (their "
                      f"checksums differ)")


def _flat_cotangent(us: Sequence[Tensor], batch: int | None) -> Tensor:
    """The cotangents concatenated in the products' numbering: flat, or ``(B, n)`` per row."""
    if batch is None:
        return torch.cat([u.reshape(-1).to(torch.float64) for u in us])
    return torch.cat([u.reshape(batch, -1).to(torch.float64) for u in us], 1)


def _only_rows(us: list[Tensor], start: int, stop: int, batch: int | None) -> list[Tensor]:
    """The cotangents with every element outside the products ``[start, stop)`` zeroed."""
    out, offset = [], 0
    for u in us:
        n = u.numel() if batch is None else math.prod(u.shape[1:])
        v = u.clone().reshape(-1) if batch is None else u.clone().reshape(batch, -1)
        lo, hi = min(max(start - offset, 0), n), min(max(stop - offset, 0), n)
        v[..., :lo] = 0
        v[..., hi:] = 0
        out.append(v.reshape(u.shape))
        offset += n
    return out

