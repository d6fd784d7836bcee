"""Sparse Jacobians: the plan (pattern, colourings, decompression indices), its cache, the
compressed products under vmap, and the decompressed result.

NOTE [compression]
With a column colouring (NOTE [colouring] in :mod:`~torch_vjp._sparse.coloring`) the seed
matrix ``S`` (``n x p``, ``S[j, colour(j)] = 1``) gives ``B = J @ S``, one JVP per colour,
all of them in one ``torch.vmap`` call over the ``p`` rows of ``S.T`` (chunked when the
memory planner of :mod:`torch_vjp._engine.memory` says so); ``J[i, j] = B[i, colour(j)]``
for every ``(i, j)`` of the pattern, so decompression is one gather from ``B`` with an index
computed once per plan. Reverse mode is the transpose: a row colouring, ``C = S.T @ J`` by
one VJP per colour, ``J[i, j] = C[colour(i), j]``. ``mode="auto"`` takes the mode with fewer
colours, reverse mode on a tie: a vmapped JVP costs more than a VJP (forward mode carries
primal and tangent through every op; NOTE [auto crossover] in :mod:`torch_vjp._strategies`),
two to three times as much on the banded workloads of ``benchmarks/bench_sparse.py``
(which times both modes), where both need as many colours.
The gathered values are already in the order of the result's layout
(CSR, coalesced COO, or CSC through a permutation), so building the result is a
constructor call.

NOTE [plan cache]
Detection and colouring cost far more than a sparse Jacobian itself (detection runs ``f``
once under the tracer; colouring is a Python loop over the non-zeros), so a plan is kept per
function and input signature (the structure of ``x``, each leaf's shape, strides, dtype
and device, and the training flags of the modules ``f`` reaches: its own, a bound method's
object's, those in its closure, its globals, a partial's arguments): weakly per function
object (a bound method by its object and function), so that
the cache dies with the function. A plan assumes that ``f``'s structure does not change:
the same branches and the same constant zeros (a weight written in place since, or given
other data, is seen: NOTE [structural zeros that move] in :mod:`~torch_vjp._sparse.tracer`;
so is a module's parameter rebound to another tensor, by the key; anything else is
found by the probe row of NOTE [a cached plan, probed] in
:mod:`~torch_vjp._sparse.probe`). An output whose
size differs from the plan's (``f`` changed) makes the plan be detected again. A user's
pattern keeps its plan (its colourings) with the pattern tensor, as long as that tensor
lives and is not modified (a dense one is compared with a copy: a write through NumPy or
``.data`` bumps no version).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.func import vmap
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from torch_vjp._engine.context import func_jvp, func_vjp, modules_reached
from torch_vjp._engine.jacobian import function_key, function_name
from torch_vjp._engine.memory import WORK_FACTOR, plan_chunk
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.refusals import VMAP_CAUSES
from torch_vjp._engine.rows import SameDraws, map_rows_with_fallback
from torch_vjp._errors import JacobianOptionError, JacobianWarning, quote_error, warn_once
from torch_vjp._sparse.coloring import Coloring, color_columns, color_rows
from torch_vjp._sparse.pattern import Pattern
from torch_vjp._sparse.probe import known_wrong, probe_row, reading_known_wrong

__all__ = [
    "Plan",
    "lookup_plan",
    "cached_plan",
    "user_plan",
    "clear_plans",
    "compressed",
    "compressed_plain",
    "assemble",
]

_LONG = torch.long
_BETA_WARNING = [True]


class Plan:
    """A pattern, its colourings (made when first needed) and, per device, the indices that
    decompress products into each layout. See NOTE [compression].

    Attributes:
        pattern: the ``(m, n)`` pattern.
        user: the pattern was the user's (a size mismatch is then an error, not a reason to
            detect again).
        checked: the route ``"auto"`` takes after its check, per function.
        unprobed: the functions whose calls with the plan no longer add the probe row (NOTE
            [a cached plan, probed]): a user's pattern keeps them by route key, as it
            serves several functions; a detected plan, one function's, as None.
    """

    __slots__ = ("pattern", "user", "checked", "unprobed", "flags", "guarded", "forward_only",
                 "_colorings", "_indices", "__weakref__")

    def __init__(self, pattern: Pattern, user: bool = False) -> None:
        self.pattern = pattern
        self.user = user
        # the functions whose calls with this plan add no probe row (NOTE [a cached plan,
        # probed]): where the probe disagreed and the pattern was not to blame; per
        # function, as a user's pattern serves several
        self.unprobed: set[Any] = set()
        # the route "auto" took after its check (NOTE [auto, checked once] in
        # torch_vjp._engine.fwdcheck), per function: "fwd", "rev" or "rev-loop"
        self.checked: dict[Any, str] = {}
        # a user's pattern: (wrong_batching, wrong_reverse) of Pattern per function, read
        # off its graph (NOTE [wrong batching rules] in torch_vjp._sparse.probe)
        self.flags: dict[Any, tuple[str | None, str | None]] = {}
        # the functions (route key; None for a detected plan) whose reverse products were
        # checked on first use, and those whose reverse product was wrong alone, with the op
        # named (NOTE [reverse products, checked on first use] in torch_vjp._sparse.guard)
        self.guarded: set[Any] = set()
        self.forward_only: dict[Any, str] = {}
        self._colorings: dict[str, Coloring] = {}
        self._indices: dict[Any, Any] = {}

    def remember(self, fkey: Any, route: str) -> None:
        """The route "auto" takes for the function of ``fkey`` from now on (bounded)."""
        if len(self.checked) >= 64:
            self.checked.clear()
        self.checked[fkey] = route

    def guard(self, key: Any) -> bool:
        """Whether this is the first use for the function of ``key`` (then marked used)."""
        if key in self.guarded:
            return False
        if len(self.guarded) >= 64:
            self.guarded.clear()
        self.guarded.add(key)
        return True

    def probes(self, key: Any) -> bool:
        """Whether calls of the function of ``key`` (see ``unprobed``) add the probe row."""
        return key not in self.unprobed

    def stop_probing(self, key: Any) -> None:
        """Calls of the function of ``key`` add no probe row from now on (bounded)."""
        if len(self.unprobed) >= 64:
            self.unprobed.clear()
        self.unprobed.add(key)

    def coloring(self, mode: str) -> Coloring:
        """The colouring for ``"fwd"`` or ``"rev"``; ``"auto"``: the one with fewer colours
        (reverse mode on a tie)."""
        if mode == "auto":
            fwd, rev = self.coloring("fwd"), self.coloring("rev")
            return fwd if fwd.count < rev.count else rev
        c = self._colorings.get(mode)
        if c is None:
            c = color_columns(self.pattern) if mode == "fwd" else color_rows(self.pattern)
            self._colorings[mode] = c
        return c

    def gather_index(
        self, coloring: Coloring, layout: torch.layout, device: torch.device
    ) -> Tensor:
        """Where each value of the result is in the flattened compressed products: in the
        order of ``layout``'s values, on ``device``."""
        key = ("gather", coloring.mode, layout, device)
        idx = self._indices.get(key)
        if idx is None:
            p = self.pattern
            if coloring.mode == "fwd":  # B.T is (colours, m): J[i, j] = B.T[colour(j), i]
                idx = coloring.colors[p.cols] * p.m + p.rows
            else:  # C is (colours, n): J[i, j] = C[colour(i), j]
                idx = coloring.colors[p.rows] * p.n + p.cols
            if layout is torch.sparse_csc:
                idx = idx[p.csc()[1]]
            idx = self._indices[key] = idx.to(device)
        return idx

    def layout_indices(self, layout: torch.layout, device: torch.device) -> tuple[Tensor, ...]:
        """The index tensors of ``layout`` on ``device`` (CSR: row offsets and columns; COO:
        indices; CSC: column offsets and rows; strided: flat positions)."""
        key = ("layout", layout, device)
        got = self._indices.get(key)
        if got is None:
            p = self.pattern
            if layout is torch.sparse_csr:
                got = (p.crow(), p.cols)
            elif layout is torch.sparse_coo:
                got = (torch.stack([p.rows, p.cols]),)
            elif layout is torch.sparse_csc:
                ccol, order = p.csc()
                got = (ccol, p.rows[order])
            else:
                got = (p.rows * p.n + p.cols,)
            got = self._indices[key] = tuple(t.to(device) for t in got)
        return got

    def probe(self, coloring: Coloring, dtype: torch.dtype, device: torch.device,
              variant: int = 0) -> Tensor:
        """:func:`probe_row` of ``coloring``, kept per mode, dtype, device and variant (not
        to be written into)."""
        key = ("probe", coloring.mode, dtype, device, variant)
        got = self._indices.get(key)
        if got is None:
            got = self._indices[key] = probe_row(coloring.colors, dtype, device, variant)
        return got

    def probe_weights(self, coloring: Coloring, dtype: torch.dtype, device: torch.device,
                      seed_dtype: torch.dtype, variant: int = 0
                      ) -> tuple[Tensor, Tensor, int]:
        """``(where, weights, length)``: the probe product read from the values (in the
        pattern's order) is ``zeros(length).index_add_(0, where, values * weights)``, ``J r``
        for a column colouring, ``r^T J`` for a row colouring. ``weights`` in ``dtype``, the
        row as the seeds held it (``seed_dtype``: rounded to it, then to ``dtype``, so
        that a float32 row under float64 products is read as the float32 numbers the
        products took). Kept per dtypes and device."""
        key = ("probe weights", coloring.mode, dtype, device, seed_dtype, variant)
        got = self._indices.get(key)
        if got is None:
            p = self.pattern
            (entries,) = self.layout_indices(torch.sparse_coo, device)
            if coloring.mode == "fwd":
                row = self.probe(coloring, seed_dtype, device, variant).to(dtype)
                got = (entries[0], row[entries[1]], p.m)
            else:
                row = self.probe(coloring, seed_dtype, device, variant).to(dtype)
                got = (entries[1], row[entries[0]], p.n)
            self._indices[key] = got
        return got

    def seeds(self, coloring: Coloring, dtype: torch.dtype, device: torch.device,
              probe: int = 0) -> Tensor:
        """The ``(colours, n)`` (forward) or ``(colours, m)`` (reverse) seed rows: row ``c``
        is 1 where the colour is ``c``; then ``probe`` probe rows (NOTE [a cached plan,
        probed]). Kept per dtype and device when small; each call gets its own
        copy."""
        key = ("seeds", coloring.mode, dtype, device, probe)
        got = self._indices.get(key)
        if got is None:
            colors = coloring.colors.to(device)
            c = torch.arange(coloring.count, device=device).unsqueeze(1)
            got = (colors.unsqueeze(0) == c).to(dtype)
            if probe:
                got = torch.cat([got, *(self.probe(coloring, dtype, device, t).unsqueeze(0)
                                        for t in range(probe))])
            if got.numel() * got.element_size() <= 2**26:
                self._indices[key] = got
            else:
                return got
        # a copy of the kept rows: the products may write into them (a function that
        # writes into its input scales its tangent in place; a backward may scale its
        # grad_output in place), and the next call must find them as they were
        return got.clone()


# ---- the cache -----------------------------------------------------------------------------

#: Plans kept per function (the oldest is forgotten first).
_PLANS_PER_FUNCTION = 32
_PLANS: weakref.WeakKeyDictionary[Any, dict[Any, Plan]] = weakref.WeakKeyDictionary()
_STRONG: dict[Any, dict[Any, Plan]] = {}  # functions that cannot be weakly referenced
_USER: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _slot(f: Any, create: bool) -> tuple[dict[Any, Plan] | None, Any]:
    owner, sub = f, None
    if getattr(f, "__self__", None) is not None and getattr(f, "__func__", None) is not None:
        owner, sub = f.__self__, f.__func__
    try:
        plans = _PLANS.get(owner)
        if plans is None and create:
            plans = _PLANS[owner] = {}
        return plans, sub
    except TypeError:  # not weakly referenceable (a builtin): kept while the process lives
        try:
            plans = _STRONG.get(owner)
            if plans is None and create:
                plans = _STRONG[owner] = {}
            return plans, sub
        except TypeError:  # not hashable: no cache
            return None, sub


def _branch_state(f: Any) -> tuple[Any, ...]:
    """What selects ``f``'s branches or constants besides ``x`` and is cheap to read: the
    training flags of the modules it reaches (BatchNorm and dropout compute another
    function in training mode), and which tensors their parameters are (one rebound,
    ``module.weight = nn.Parameter(...)``, may have other zeros: NOTE [structural zeros
    that move] in :mod:`~torch_vjp._sparse.tracer` sees writes into the old one; buffers
    are left out, as a module may rebind one on every call, a cache of its last input)."""
    try:
        found = modules_reached(f)
    except Exception:  # noqa: BLE001 - an odd callable: nothing to add to the key
        return ()
    flags = tuple(m.training for top in found for m in top.modules())
    tensors = tuple((id(t), _storage_id(t)) for top in found for t in top.parameters())
    return flags + tensors


def _storage_id(t: Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):  # (a sparse tensor)
        return None


def _signature(prob: Problem) -> Any:
    return (
        str(prob.in_spec),
        # (strides: an f that follows x's memory layout, u.as_strided(...), reads other
        # elements at another layout of the same shape)
        tuple((tuple(x.shape), x.stride(), x.dtype, x.device) for x in prob.leaves),
        _branch_state(prob.f),
    )


def lookup_plan(prob: Problem, build: Callable[[], Pattern], *, fresh: bool = False) -> Plan:
    """The cached plan of ``prob.f`` at this input signature, or a new one from ``build()``
    (with ``fresh``, always a new one). See NOTE [plan cache]."""
    plans, sub = _slot(prob.f, create=True)
    key = (sub, _signature(prob))
    if plans is not None and not fresh:
        plan = plans.get(key)
        if plan is not None and plan.pattern.holds():  # (NOTE [structural zeros that move]
            return plan  # in torch_vjp._sparse.tracer: a weight whose zeros moved)
    plan = Plan(build())
    if plans is not None and plan.pattern.by_value is None:
        # (a pattern shaped by x's values holds at this x only: not kept, NOTE [a pattern
        # shaped by values] in torch_vjp._sparse.tracer)
        if key not in plans and len(plans) >= _PLANS_PER_FUNCTION:
            # (bounded: a module that rebinds a parameter on every call makes a key per call)
            del plans[next(iter(plans))]
        plans[key] = plan
    return plan


def cached_plan(prob: Problem) -> Plan | None:
    """The plan cached for ``prob.f`` at this input signature, if any (for tests and
    benchmarks: which colourings a call used)."""
    plans, sub = _slot(prob.f, create=False)
    return None if plans is None else plans.get((sub, _signature(prob)))


def user_plan(pattern: Tensor, build: Callable[[], Pattern]) -> Plan:
    """The plan of a user's pattern tensor, kept with the tensor while it is unchanged."""
    if pattern.is_inference():  # no version counter: a change could not be seen
        return Plan(build(), user=True)
    # (a sparse pattern's version counts writes into its values too: an entry set to zero
    # in place changes the pattern as much as a dense one's)
    version = getattr(pattern, "_version", None)
    got = _USER.get(pattern)
    if got is not None and got[0] == version and (got[2] is None
                                                  or torch.equal(pattern, got[2])):
        return got[1]
    plan = Plan(build(), user=True)
    # a dense pattern's values are kept too: a write through NumPy (a pattern made by
    # torch.from_numpy, its array changed) or .data bumps no version
    copy = pattern.detach().clone() if pattern.layout is torch.strided else None
    try:
        _USER[pattern] = (version, plan, copy)
    except TypeError:  # pragma: no cover - tensors are weakly referenceable
        pass
    return plan


def clear_plans(f: Any = None) -> None:
    """Forgets the cached plans of ``f`` (all plans with None)."""
    if f is None:
        _PLANS.clear()
        _STRONG.clear()
        _USER.clear()
        return
    plans, sub = _slot(f, create=False)
    if plans:
        for key in [k for k in plans if k[0] is sub]:
            del plans[key]


# ---- the products ---------------------------------------------------------------------------


def _flat_cat(tree: Any) -> Tensor:
    if isinstance(tree, Tensor):
        return tree.reshape(-1)
    leaves = tree_leaves(tree)
    return torch.cat([t.reshape(-1) for t in leaves]) if len(leaves) != 1 else leaves[0].reshape(-1)


def _split_rows(
    seeds: Tensor, shapes: list[torch.Size]
) -> Callable[[int, int], tuple[Tensor, ...]]:
    """``rows(start, stop)``: the seed rows split per leaf, each ``(stop - start, *shape)``."""
    sizes = [math.prod(s) for s in shapes]

    def rows(start: int, stop: int) -> tuple[Tensor, ...]:
        block = seeds[start:stop]
        parts = block.split(sizes, dim=1) if len(sizes) > 1 else (block,)
        return tuple(t.reshape(stop - start, *s) for t, s in zip(parts, shapes))

    return rows


def compressed(
    prob: Problem,
    plan: Plan,
    coloring: Coloring,
    *,
    chunk_size: int | None,
    max_memory: int | None,
    probe: int = 0,
    met: list[tuple[str | None, str | None]] | None = None,
) -> tuple[Tensor, int, tuple[Any, ...]]:
    """The compressed Jacobian, ``(colours, m)`` in forward mode or ``(colours, n)`` in
    reverse mode, the number of output elements ``f`` returned, and the dtype of the seeds
    (x's in forward mode, f's first output's in reverse mode) with the coarsest dtype of
    x's and f's tensors (:func:`_dtypes`). See NOTE [compression]. With ``probe``, that many
    rows more: the products with :func:`probe_row` in the seeds' dtype (NOTE [a cached
    plan, probed]). In reverse mode, ``met`` gets the ops torch differentiates wrongly that
    the graph of the products' own call of f holds (:func:`known_wrong`: NOTE [reverse
    products read the graph] in :mod:`~torch_vjp._sparse.guard`), then whether the
    products ran under vmap, several at once."""
    leaves = tuple(prob.leaves)
    x0 = leaves[0]
    p = coloring.count + probe
    n = plan.pattern.n
    g = prob.g
    if coloring.mode == "rev":
        if met is not None:
            g = reading_known_wrong(g, met)
        with torch.no_grad():
            out, pullback = func_vjp(g, *leaves)
            flat_out, spec = tree_flatten(out)
            m = sum(o.numel() for o in flat_out)
            if m != plan.pattern.m or p == 0:
                return x0.new_zeros((p, n)), m, _dtypes(flat_out[0].dtype, leaves, flat_out)
            chunk = _chunk(prob, plan, p, flat_out[0].dtype, chunk_size, max_memory)
            seeds = plan.seeds(coloring, flat_out[0].dtype, flat_out[0].device, probe)
            one = len(flat_out) == 1

            def pull(*cot: Tensor) -> tuple[Tensor]:
                grads = pullback(cot[0] if one else tree_unflatten(list(cot), spec))
                return (_flat_cat(grads),)

            rows = _split_rows(seeds, [o.shape for o in flat_out])
            (res,), _ = map_rows_with_fallback(
                pull, rows, p, chunk_size=chunk, on_fallback=_warn_fallback(prob, "rev")
            )
            if met:
                met.append(chunk != 1 and p > 1)  # (whether they ran under vmap)
            return res, m, _dtypes(seeds.dtype, leaves, flat_out)
    if p == 0:
        with torch.no_grad():
            flat_out = prob.probe()[0]
            m = sum(o.numel() for o in flat_out)
        return x0.new_zeros((0, plan.pattern.m)), m, _dtypes(x0.dtype, leaves, flat_out)
    chunk = _chunk(prob, plan, p, x0.dtype, chunk_size, max_memory)
    seeds = plan.seeds(coloring, x0.dtype, x0.device, probe)

    outs: list[Tensor] = []  # (f's output tangents, for their dtypes)

    def push(*tangents: Tensor) -> tuple[Tensor]:
        out = func_jvp(g, leaves, tangents)[1]
        outs[:] = tree_leaves(out)
        return (_flat_cat(out).detach(),)

    same_draws = SameDraws()
    # (the state before any product: the vectorised attempt's check of one product calls f
    # before the loop, and the loop must draw what detection, just before, drew)
    same_draws()

    def push_one(*tangents: Tensor) -> tuple[Tensor]:
        # (one call of f per colour: every call draws what the first drew, one function)
        same_draws()
        return push(*tangents)

    rows = _split_rows(seeds, [x.shape for x in leaves])
    (res,), _ = map_rows_with_fallback(
        push, rows, p, chunk_size=chunk, on_fallback=_warn_fallback(prob, "fwd"),
        batched_fn=vmap(push) if chunk is None else None, loop_fn=push_one,
    )
    return res, res.shape[1], _dtypes(seeds.dtype, leaves, outs)


def _dtypes(seed: torch.dtype, leaves: Any, outs: Any) -> tuple[Any, ...]:
    """``seed``, the coarsest floating dtype of ``leaves`` and ``outs`` (the largest eps):
    products that pass through several dtypes (a float32 output beside a float64 one) are
    within that one's rounding; and ``((numel, dtype) per output, (numel, dtype) per
    leaf)``, so that the probe judges each row (column) within the rounding of the outputs
    and leaves its entries come from, not of the coarsest of all (a bfloat16 output beside
    a float32 one leaves the float32 rows at float32's tolerance)."""
    dtypes = [t.dtype for t in (*leaves, *outs) if t.dtype.is_floating_point]
    sides = (tuple((t.numel(), t.dtype) for t in outs),
             tuple((t.numel(), t.dtype) for t in leaves))
    return seed, max(dtypes, key=lambda d: torch.finfo(d).eps, default=seed), sides


def compressed_plain(prob: Problem, plan: Plan, coloring: Coloring,
                     probe: int = 0, met: list[tuple[str | None, str | None]] | None = None
                     ) -> tuple[Tensor, int, tuple[Any, ...]]:
    """Reverse mode's compressed products with plain autograd, one ``torch.autograd.grad``
    per colour: for functions torch.func cannot run at all (a module in training mode that
    updates its running statistics, a custom Function without setup_context), as the dense
    ``"auto"`` falls back to (NOTE [auto fallback] in :mod:`torch_vjp._engine.jacobian`).
    With ``probe``, that many products more, and ``met``, as :func:`compressed`, which it
    returns as."""
    leaves = prob.leaves
    p, n = coloring.count + probe, plan.pattern.n
    with torch.enable_grad():
        xs = [x.detach().requires_grad_(True) for x in leaves]
        out = prob.g(*xs)
    flat_out, _ = tree_flatten(out)
    if met is not None:  # (one backward pass per colour: no vmap)
        met[:] = [known_wrong([t for t in flat_out if isinstance(t, Tensor)]), False]
    m = sum(o.numel() for o in flat_out)
    if m != plan.pattern.m or p == 0:
        return leaves[0].new_zeros((p, n)), m, _dtypes(flat_out[0].dtype, leaves, flat_out)
    live = [(j, o) for j, o in enumerate(flat_out) if o.requires_grad]
    sizes = [o.numel() for o in flat_out]
    seeds = plan.seeds(coloring, flat_out[0].dtype, flat_out[0].device, probe)
    res = leaves[0].new_zeros((p, n))
    if not live:
        return res, m, _dtypes(seeds.dtype, leaves, flat_out)
    for c in range(p):
        parts = seeds[c].split(sizes)
        grads = torch.autograd.grad(
            [o for _, o in live], xs, [parts[j].view_as(o) for j, o in live],
            retain_graph=c < p - 1, allow_unused=True,
        )
        res[c] = torch.cat([torch.zeros(x.numel(), dtype=res.dtype, device=res.device)
                            if g is None else g.reshape(-1).to(res.dtype)
                            for g, x in zip(grads, xs)])
    return res, m, _dtypes(seeds.dtype, leaves, flat_out)


def _chunk(
    prob: Problem, plan: Plan, p: int, dtype: torch.dtype, chunk_size: int | None,
    max_memory: int | None,
) -> int | None:
    """The products at once, by the engine's memory planner (NOTE [memory model] in
    :mod:`torch_vjp._engine.memory`): the result is the non-zeros, each product works on
    about ``WORK_FACTOR`` vectors the size of the input and output."""
    pat = plan.pattern
    itemsize = max(torch.empty((), dtype=dtype).element_size(), prob.leaves[0].element_size())
    return plan_chunk(
        p,
        pat.nnz * (itemsize + 8),
        WORK_FACTOR * itemsize * (pat.m + pat.n),
        chunk_size=chunk_size,
        max_memory=max_memory,
        device=prob.leaves[0].device,
        call=prob.call,
        what=lambda: (
            f"{pat.nnz:,} structural non-zeros of a {pat.m:,} x {pat.n:,} Jacobian, "
            f"computed by {p:,} products"
        ),
        alternatives=(
            "a smaller chunk_size or max_memory only bounds the products, not the result; "
            "torch_vjp.vjp / torch_vjp.jvp give products of the Jacobian with vectors "
            "without forming it; or pass a larger max_memory if the memory is there."
        ),
    )


def _warn_fallback(prob: Problem, mode: str) -> Callable[[Exception], None]:
    def warn(err: Exception) -> None:
        unit = "JVP" if mode == "fwd" else "VJP"
        warn_once(
            ("sparse-vmap-fallback", function_key(prob.f), mode, type(err)),
            f"{prob.call}: could not vectorise the {unit}s of {function_name(prob.f)} with "
            f"torch.vmap, so it computes them one colour at a time in a Python loop.\n"
            f"  The vectorised attempt said: {quote_error(err)}\n"
            f"  Typical causes: {VMAP_CAUSES}. This warning is shown once per function.",
            JacobianWarning,
        )

    return warn


def assemble(values: Tensor, plan: Plan, layout: torch.layout) -> Tensor:
    """The ``(m, n)`` Jacobian in ``layout`` from its values in that layout's order."""
    p = plan.pattern
    idx = plan.layout_indices(layout, values.device)
    size = (p.m, p.n)
    if layout is not torch.strided:
        # the result owns its indices: the plan's cached ones, handed out, would change
        # under every later result when a user changes one in place (J.t_(), an index edit)
        idx = tuple(t.clone() for t in idx)
    if layout is torch.sparse_coo:
        return torch.sparse_coo_tensor(
            idx[0], values, size, is_coalesced=True, check_invariants=False
        )
    if layout in (torch.sparse_csr, torch.sparse_csc):
        build = torch.sparse_csr_tensor if layout is torch.sparse_csr else torch.sparse_csc_tensor
        if _BETA_WARNING[0]:  # torch warns once per process that compressed layouts are beta
            _BETA_WARNING[0] = False
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*support is in beta state")
                return build(idx[0], idx[1], values, size, check_invariants=False)
        return build(idx[0], idx[1], values, size, check_invariants=False)
    if layout is not torch.strided:  # pragma: no cover - checked by the caller
        raise JacobianOptionError(f"unsupported layout {layout}")
    dense = values.new_zeros(p.m * p.n)
    dense[idx[0]] = values
    return dense.view(size)
