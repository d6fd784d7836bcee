"""The probe row: a check of a sparse Jacobian's plan on every call that uses it.

NOTE [a cached plan, probed]
What selects ``f``'s branches is not all in the key: a flag in a list or on an object
(``cfg.shift``), a number a closure holds, another function bound to a name. A plan
detected on one branch and used on another leaves out the entries of the other, and the
gathered Jacobian is wrong (0.94 off, with no error, on ``x.roll(cfg.shift)`` after
``cfg.shift`` changed). So every call that uses a cached plan (and, below, every call with
a user's pattern) computes one product more in the same vectorised call: ``J r`` in
forward mode (``r^T J`` in reverse mode) for a fixed row ``r`` (:func:`probe_row`: the
members of one colour take numbers that differ in sign or by a factor of 1.6 at least),
compared with the same product read from the gathered values, element by element, within
rounding (``sqrt(eps)``, for the coarsest of the dtypes its entries pass through: the
output of their row, the leaf of their column, the seeds' and products', of the element's
own scale, ``|J| r``, or of ``sqrt(eps)`` of the largest where that is larger: a row a
thousand times smaller than others is probed too; the row is read as the seeds held it,
in their dtype). An entry the plan leaves out adds
``J[i, j] r[j]`` to the first and nothing to the second. Where they disagree the pattern
is detected again: a different one becomes the plan (its first call is checked as any
first call is), with a one-time warning; the same one means the products are not linear
in their seeds (a hook that clamps the gradient), the result stands as it was, and the
plan is not probed again.
A user's pattern is probed too, in every mode and on every call ("auto"'s first call with
it as well, before its check, whose ``u^T J`` misses an entry left out where ``u`` holds
close numbers at two rows of one colour): where the probe disagrees and f's reverse
products are those of one linear map (the additivity test of "auto"'s check) and f's
products in the probe's own space are additive element by element at the probe's own
scale (not so where a part of f rounds more coarsely than its tensors' dtypes, bfloat16
under autocast cast back to float32: the disagreement is then rounding), the pattern
leaves out entries and a JacobianOptionError says so; otherwise the result stands and the
pattern is not probed again for that function (Plan.unprobed: a pattern serves several,
and another's calls with it are still probed). But first, where the products were
vectorised, the probe row's product is computed once more without vmap
(:func:`batching_wrong`): an operator whose batching rule is wrong (torch.cdist's
backward: a relative error near 1) makes the vectorised products disagree with their own
probe whatever the pattern, and a pattern that holds every entry was refused as leaving
some out. Where the two disagree, the products are computed again one colour at a time
(with a one-time warning; "auto" remembers that route) and probed again.
It costs one product more per call: for ``p`` colours, ``p + 1`` in one vmap (the
single-colour elementwise workload of ``benchmarks/bench_sparse.py`` pays the most); two
where x is bfloat16 or float16 (:func:`probe_rows`: a second row whose levels differ from
the first's for members a multiple of 8 apart).
The probe of a detected plan checks the batching as a user's does: a disagreement of the
vectorised products with the probe row's product computed alone is the batching's, and
the plan's later calls compute reverse mode without vmap (NOTE [wrong batching rules]).

NOTE [wrong batching rules]
Some of torch's batching rules are wrong (torch 2.13): a VJP of one cotangent is right, the
same VJPs of several cotangents under vmap are not (torch.cdist's backward,
``_cdist_backward``, off by a relative error near 1; ``as_strided_scatter``'s). Reverse
mode's products are vmapped over the colours' cotangents, so a sparse Jacobian of such a
function would be silently wrong. The tracer records the first such op it sees on tracked
data (:data:`~torch_vjp._sparse.rules.WRONG_BATCHING`, as ``Pattern.wrong_batching``), and
reverse mode's products of that pattern are computed one colour at a time, without vmap,
with a one-time warning (none where ``chunk_size=1`` asks for that). Forward mode is not
affected (vmapped JVPs use the ops' forward batching; cdist has no forward formula). An op
not in the list is caught on the plan's first use (NOTE [reverse products, checked on first
use] in :mod:`torch_vjp._sparse.guard`), and by the probe of its later calls
(:func:`batching_wrong`). ``as_strided_scatter``'s backward is wrong without vmap too (the
gradient of ``self`` is passed inside the scattered region, not outside it): a pattern
whose detection saw it on tracked data (``Pattern.wrong_reverse``, from
:data:`~torch_vjp._sparse.rules.WRONG_REVERSE`) is computed in forward mode, whose formula
is right: ``"auto"`` takes it without its check against a reverse product (which is the
wrong one), and ``mode="rev"`` is refused. A user's pattern has no detection run: the
first call with it, per function, runs ``f`` once with autograd and reads the same ops off
its graph (:func:`graph_flags`), which holds them as backward nodes: those of the one list
of NOTE [named reverse strategies and wrong formulas] (:func:`known_wrong`), which holds the
antialiased resizes too, wrong alone in some of their resizes (its predicate reads the
node's saved sizes). Reverse mode's products read the same list off the graph of their own
call on every call (NOTE [reverse products read the graph] in
:mod:`torch_vjp._sparse.guard`): an op the tracer's lists do not hold, or one f takes at a
later call only, is caught there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from torch_vjp._engine.context import buffers_kept, func_jvp
from torch_vjp._engine.fwdcheck import cotangent, gap, one_reverse_product, tolerance
from torch_vjp._engine.jacobian import function_key, function_name
from torch_vjp._engine.problem import Problem
from torch_vjp._engine.rows import SameDraws
from torch_vjp._engine.wrongops import wrong_ops
from torch_vjp._errors import JacobianOptionError, JacobianWarning, passes_through, warn_once
from torch_vjp._sparse import rules

__all__ = ["graph_flags", "known_wrong", "reading_known_wrong", "probe_row", "probe_rows", "stale", "stale_rows", "warn_changed",
           "batching_wrong", "users_pattern_misses", "outside_pattern", "linear",
           "misses_message"]


#: The probe row's levels: any two differ in sign or by a factor of 2 at least.
_LEVELS = (1.0, -0.5, 2.0, -0.25, 0.5, -2.0, 0.25, -1.0)
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def probe_row(colors: Tensor, dtype: torch.dtype, device: torch.device,
              variant: int = 0) -> Tensor:
    """The probe row of NOTE [a cached plan, probed] for a colouring (``colors``: the colour
    of each column, or row in reverse mode): the same numbers on every call (computed, not
    drawn: the global random generators are not touched). The k-th member of a colour (in
    index order) gets level ``k mod 8`` of :data:`_LEVELS` times ``1 + frac((k // 8) g +
    1/2) / 4`` (``g`` the golden ratio's fraction, which spreads the members of one level),
    so that members of one colour fewer than 8 apart differ in sign or by a factor of 1.6 at
    least: an entry the plan leaves out shows at the probe's tolerance even in bfloat16 (a
    row of numbers drawn in ``[0.5, 1.5)`` held equal or close ones, in bfloat16 and
    float16, and hid it). ``variant`` 1, the second row of bfloat16 and float16
    (:func:`probe_rows`), takes level ``(k + 3 (k // 8)) mod 8``: members a multiple of 8
    apart, which share a level in the first row, differ in the second (unless 64 apart).

    Example:
        >>> r = probe_row(torch.zeros(3, dtype=torch.long), torch.float64, torch.device("cpu"))
        >>> [round(float(v)) for v in r.sign()]
        [1, -1, 1]
    """
    colors = colors.reshape(-1).to(device="cpu", dtype=torch.long)
    length = colors.numel()
    order = torch.argsort(colors, stable=True)
    ranked = colors[order]
    pos = torch.arange(length)
    starts = torch.ones(length, dtype=torch.bool)
    starts[1:] = ranked[1:] != ranked[:-1]
    first = torch.cummax(torch.where(starts, pos, 0), 0).values
    rank = torch.empty(length, dtype=torch.long)
    rank[order] = pos - first
    index = (rank + 3 * variant * (rank // len(_LEVELS))) % len(_LEVELS)
    levels = torch.tensor(_LEVELS, dtype=torch.float64)[index]
    # (members of one level, 8 apart or more: the golden ratio's multiples spread them)
    scale = 1.0 + 0.25 * torch.frac((rank // len(_LEVELS)).double() * _GOLDEN + 0.5)
    return (levels * scale).to(dtype=dtype, device=device)


def probe_rows(leaves: Any) -> int:
    """How many probe rows a call adds: 2 where a leaf of x is of a 16-bit dtype (bfloat16,
    float16), whose tolerance (``sqrt(eps)``: 9 % and 3 %) hides an entry left out whose
    partner in its colour holds a number of the first row within a few per cent of its own
    (a member of one level, 8 apart); else 1."""
    return 2 if any(torch.finfo(t.dtype).bits <= 16 for t in leaves
                    if t.dtype.is_floating_point) else 1


def stale_rows(plan: Any, coloring: Any, comp: Tensor, extras: Tensor,
               dtypes: tuple[Any, ...]) -> tuple[bool, float, float, int]:
    """:func:`stale` for each probe row's product (``extras``, one per row, in order): whether
    one disagrees, and the largest disagreement with its scale and its element."""
    found: tuple[bool, float, float, int] = (False, 0.0, 0.0, -1)
    for variant, extra in enumerate(extras):
        got = stale(plan, coloring, comp, extra, dtypes, variant)
        if got[0] and (not found[0] or got[1] > found[1]):
            found = got
    return found


def _probe_rtol(products: torch.dtype, seed: torch.dtype, coarsest: torch.dtype) -> float:
    """The probe's relative tolerance: the coarsest of the products', the seeds' and the
    tensors' dtypes."""
    return max(tolerance(products), tolerance(seed), tolerance(coarsest))


def stale(plan: Any, coloring: Any, comp: Tensor, extra: Tensor,
           dtypes: tuple[Any, ...], variant: int = 0) -> tuple[bool, float, float, int]:
    """Whether the probe product ``extra`` (of the probe row in the seeds' dtype, the first
    of ``dtypes``; the second, the coarsest dtype of x's and f's tensors, which
    :func:`_probe_tolerance` narrows per element to the dtypes of its entries' sides)
    disagrees with the same product read from the values the plan gathers from ``comp``
    (NOTE [a cached plan, probed]), by how much, at what scale, and at which element (a
    row in forward mode, a column in reverse mode; -1 where unknown): element by element,
    each within rounding of its own scale (``|J| r``, or the products' own), so that a row
    a thousand times smaller than the largest is probed too; a scale under ``sqrt(eps)`` of
    the largest counts as that (rounding carried over from the large ones)."""
    if extra.numel() == 0:
        return False, 0.0, 0.0, -1
    # (the coarsest of x's dtypes and the outputs': a product computed in float32 and
    # returned in float64, or a float32 output beside a float64 one, is float32's)
    seed, coarsest = dtypes[:2]
    rtol = _probe_rtol(comp.dtype, seed, coarsest)
    device = comp.device
    # (summed in float32 at least: a row of hundreds of terms summed in bfloat16 or float16
    # is off by more than their tolerance, a false alarm of the sums, not of f)
    acc = torch.promote_types(comp.dtype, torch.float32)
    with torch.no_grad():
        where, weights, length = plan.probe_weights(coloring, acc, device, seed, variant)
        values = comp.reshape(-1).index_select(
            0, plan.gather_index(coloring, torch.sparse_csr, device)).to(acc)
        # J r (forward mode: ``where`` the rows) or r^T J (reverse mode: the columns), and
        # |J| |r|
        terms = values * weights
        off = values.new_zeros(length).index_add_(0, where, terms)
        local = values.new_zeros(length).index_add_(0, where, terms.abs())
        extra = extra.to(acc)
        off.sub_(extra).abs_()
        torch.maximum(local, extra.abs(), out=local)
        top = local.max()
        tol = _probe_tolerance(plan, coloring, dtypes, rtol, length, where, acc,
                               comp.dtype, device)
        bound = torch.maximum(local, tol * top).mul_(tol)
        over = off > bound
        top_, over_ = torch.stack((top, over.any().to(top.dtype))).tolist()
        if not math.isfinite(top_):
            # (a NaN or inf of the Jacobian reaches both products alike: the finite rest;
            # J r is finite where |J| r is)
            bad = ~values.new_zeros(length).index_add_(0, where, terms).isfinite()
            if not torch.equal(bad, ~extra.isfinite()):
                return True, math.inf, math.inf, -1
            local = torch.where(bad, 0, local)
            off = torch.where(bad, 0, off)
            bound = torch.maximum(local, tol * local.max()).mul_(tol)
            over = off > bound
            over_ = over.any().item()
        if not over_:
            return False, 0.0, 0.0, -1
        worst = torch.where(over, off - bound, -1).argmax()
        diff, scale = torch.stack((off[worst], local[worst])).tolist()
    return True, diff, scale, int(worst)


def _probe_tolerance(plan: Any, coloring: Any, dtypes: tuple[Any, ...], rtol: float,
                     length: int, where: Tensor, acc: torch.dtype, products: torch.dtype,
                     device: torch.device) -> Tensor | float:
    """Per element of the probe product, the tolerance of the coarsest dtype its entries
    pass through: the output of their row and the leaf of their column (and the products'
    and seeds' dtypes); ``rtol`` (the coarsest of all) where the sides are not known. Kept
    per plan, dtypes and device."""
    if len(dtypes) < 3:
        return rtol
    seed, _, (outs, leaves) = dtypes
    key = ("probe tolerance", coloring.mode, outs, leaves, seed, acc, products, device)
    got = plan._indices.get(key)
    if got is None:
        p = plan.pattern
        if sum(k for k, _ in outs) != p.m or sum(k for k, _ in leaves) != p.n:
            return rtol

        def per(side: Any) -> Tensor:
            return torch.cat([torch.full((k,), tolerance(d) if d.is_floating_point else 0.0,
                                         dtype=acc, device=device) for k, d in side])

        (entries,) = plan.layout_indices(torch.sparse_coo, device)
        each = torch.maximum(per(outs)[entries[0]], per(leaves)[entries[1]])
        base = max(tolerance(products), tolerance(seed))
        got = torch.full((length,), base, dtype=acc, device=device).scatter_reduce_(
            0, where, each, "amax")
        plan._indices[key] = got
    return got


def warn_changed(prob: Problem) -> None:
    warn_once(
        ("sparse-changed", function_key(prob.f)),
        f"{prob.call}: the Jacobian of {function_name(prob.f)} has entries outside the "
        f"sparsity pattern detected on an earlier call: f took another branch (a flag or "
        f"number it reads that is not an argument changed), so the pattern was detected "
        f"again. Each change costs one detection.\n  To skip detection, pass pattern= one "
        f"that covers every branch (the union of torch_vjp.jacobian_sparsity(f, x) over "
        f"them). This warning is shown once per function.",
        JacobianWarning,
    )


def _additive_at_probe_scale(prob: Problem, plan: Any, coloring: Any, comp: Tensor,
                             seed: torch.dtype, rtol: float) -> bool:
    """Whether f's products in the probe's own space (J v, or v^T J in reverse mode) are
    additive element by element within the probe's tolerance of each element's scale
    (``|J| v`` from the values, as :func:`stale` judges): ``J (r + b) == J r + J b`` for the
    probe row ``r`` and ``b``, ``r`` reversed. Not so where f rounds more coarsely than its
    tensors' dtypes say (a part computed in bfloat16 under autocast, then cast to float32;
    entries that cancel), and the probe's disagreement is then rounding, not entries
    the pattern leaves out. True where the products cannot be computed here (unknown)."""
    device = comp.device
    acc = torch.promote_types(comp.dtype, torch.float32)
    fwd = coloring.mode == "fwd"
    p = plan.pattern
    r = plan.probe(coloring, seed, device)
    vs = [r, r.flip(0)]
    vs.append(vs[0] + vs[1])
    try:
        with buffers_kept(prob.f):
            if fwd:
                leaves = tuple(prob.leaves)
                sizes = [x.numel() for x in leaves]
                got = []
                for v in vs:
                    prob.reset_primals()
                    tangents = tuple(t.reshape(x.shape).to(x.dtype) for t, x
                                     in zip(v.split(sizes), leaves))
                    with torch.no_grad():
                        out = func_jvp(prob.g, leaves, tangents)[1]
                    got.append(torch.cat([t.detach().reshape(-1).to(acc)
                                          for t in tree_leaves(out)]))
            else:
                got = []
                for v in vs:
                    def keep(outs: list[Tensor], v: Tensor = v) -> list[Tensor]:
                        parts = v.split([o.numel() for o in outs])
                        return [t.reshape(o.shape).to(o.dtype) for t, o in zip(parts, outs)]
                    res = one_reverse_product(prob, keep=keep)
                    if res is None:
                        return True
                    got.append(torch.cat([t.reshape(-1).to(acc) for t in res[2]]))
    except Exception as err:  # noqa: BLE001 - unknown: judged as before
        if passes_through(err):
            raise
        return True
    with torch.no_grad():
        (entries,) = plan.layout_indices(torch.sparse_coo, device)
        where, at = (entries[0], entries[1]) if fwd else (entries[1], entries[0])
        values = comp.reshape(-1).index_select(
            0, plan.gather_index(coloring, torch.sparse_csr, device)).to(acc).abs()
        local = values.new_zeros(p.m if fwd else p.n).index_add_(
            0, where, values * (vs[0].abs() + vs[1].abs()).to(acc)[at])
        for g in got:
            torch.maximum(local, g.abs(), out=local)
        bound = local.clamp(min=rtol * local.max()).mul_(rtol)
        off = (got[2] - got[0] - got[1]).abs_()
        return not bool((off > bound).any())


def batching_wrong(prob: Problem, plan: Any, coloring: Any, extra: Tensor,
                   dtypes: tuple[Any, ...]) -> bool:
    """Whether the first probe row's product computed with the others under vmap
    (``extra``) disagrees with the same product computed without vmap, beyond the probe's
    tolerance: then an operator of f has a wrong batching rule (torch.cdist's backward), and
    the vectorised products are wrong, whatever the pattern (NOTE [a cached plan, probed]).
    False where the product cannot be computed here (unknown)."""
    seed = dtypes[0]
    acc = torch.promote_types(extra.dtype, torch.float32)
    r = plan.probe(coloring, seed, extra.device)
    try:
        with buffers_kept(prob.f):
            if coloring.mode == "fwd":
                leaves = tuple(prob.leaves)
                tangents = tuple(t.reshape(x.shape).to(x.dtype) for t, x
                                 in zip(r.split([x.numel() for x in leaves]), leaves))
                prob.reset_primals()
                with torch.no_grad():
                    out = func_jvp(prob.g, leaves, tangents)[1]
                got = torch.cat([t.detach().reshape(-1) for t in tree_leaves(out)])
            else:
                def keep(outs: list[Tensor]) -> list[Tensor]:
                    parts = r.split([o.numel() for o in outs])
                    return [t.reshape(o.shape).to(o.dtype) for t, o in zip(parts, outs)]
                res = one_reverse_product(prob, keep=keep)
                if res is None:
                    return False
                got = torch.cat([t.reshape(-1) for t in res[2]])
    except Exception as err:  # noqa: BLE001 - unknown: judged as before
        if passes_through(err):
            raise
        return False
    if got.numel() != extra.numel():
        return False
    diff, scale = gap(extra.reshape(-1).to(acc), got.to(acc))
    return diff > _probe_rtol(extra.dtype, seed, dtypes[1]) * scale


def users_pattern_misses(prob: Problem, plan: Any, dtype: torch.dtype, diff: float,
                          scale: float, pkey: Any, probed: Any) -> None:
    """A user's pattern whose probe disagreed (NOTE [a cached plan, probed]): raises where
    f's reverse products are linear (the pattern leaves out entries), and f's products are
    additive at the probe's own scale (``probed``: the colouring, products and seeds' dtype
    the probe was judged with; :func:`_additive_at_probe_scale`); otherwise the plan is not
    probed again for this function (``pkey``: its route key), and the result stands."""
    coloring, comp, (seed, coarsest, *_), worst = probed
    rtol = _probe_rtol(comp.dtype, seed, coarsest)
    if (not _additive_at_probe_scale(prob, plan, coloring, comp, seed, rtol)
            or not outside_pattern(prob, plan, coloring.mode == "fwd", worst, diff)):
        plan.stop_probing(pkey)
        return
    with buffers_kept(prob.f):
        got = one_reverse_product(prob)
    if got is not None:
        _, us, grads = got
        g = torch.cat([t.reshape(-1) for t in grads]).to(dtype)
        if linear(prob, us, g, dtype):
            raise JacobianOptionError(misses_message(
                prob.call, f"disagrees with one more product of f, computed with the others "
                           f"for a check, by up to {diff:.3g} (at a scale of {scale:.3g})"))
    plan.stop_probing(pkey)


def outside_pattern(prob: Problem, plan: Any, fwd: bool, worst: int, diff: float,
                    reach: float = 2.5) -> bool:
    """Whether the line of the Jacobian where the probe disagreed most (``worst``: row
    ``worst`` in forward mode, computed with one reverse product; column ``worst`` in
    reverse mode, with one JVP) holds non-zeros outside the pattern that can explain the
    disagreement ``diff``: an entry (i, j) left out changes the probe's element by
    ``J[i, j] (r[j] - r[k])`` (or ``J[i, j] r[j]``), ``|r| <= 2.5``, so the entries left out
    of the line weigh ``diff / 5`` at least (``diff / 8`` is asked: room for
    rounding); ``reach``: the largest ``|r|`` (``|u|``, for the random cotangent of
    "auto"'s check, whose ``u^T J`` changes by ``sum_i u[i] J[i, j]`` at most). Not so
    where the disagreement is the rounding of a 16-bit product (bfloat16's softmax,
    nearly one-hot: ``1 - y`` rounds to 0 in the probe's forward product and not in the
    columns'), whose line is exactly zero outside the pattern. True where the line cannot
    be computed here (unknown)."""
    if worst < 0:
        return True
    p = plan.pattern
    leaves = tuple(prob.leaves)
    try:
        with buffers_kept(prob.f):
            if fwd:
                def one(outs: list[Tensor]) -> list[Tensor]:
                    flat = torch.zeros(sum(o.numel() for o in outs), dtype=torch.float64)
                    flat[worst] = 1.0
                    parts = flat.split([o.numel() for o in outs])
                    return [t.reshape(o.shape).to(o) for t, o in zip(parts, outs)]
                got = one_reverse_product(prob, keep=one)
                if got is None:
                    return True
                line = torch.cat([t.reshape(-1).double() for t in got[2]])
                inside = p.cols[p.rows == worst]
            else:
                flat = torch.zeros(sum(x.numel() for x in leaves), dtype=torch.float64)
                flat[worst] = 1.0
                tangents = tuple(t.reshape(x.shape).to(x) for t, x
                                 in zip(flat.split([x.numel() for x in leaves]), leaves))
                prob.reset_primals()
                with torch.no_grad():
                    out = func_jvp(prob.g, leaves, tangents)[1]
                line = torch.cat([t.detach().reshape(-1).double() for t in tree_leaves(out)])
                inside = p.rows[p.cols == worst]
    except Exception as err:  # noqa: BLE001 - unknown: judged as before
        if passes_through(err):
            raise
        return True
    with torch.no_grad():
        line = line.cpu()
        line[inside.cpu()] = 0.0
        mass = float(line.abs().sum())
    return not math.isfinite(mass) or mass * 8.0 * max(reach, 2.5) / 2.5 >= diff


def linear(prob: Problem, us: list[Tensor], g: Tensor, dtype: torch.dtype) -> bool:
    """Whether f's reverse products are those of one linear map, deterministic and additive
    in the cotangent: ``u^T J + v^T J == (u + v)^T J`` for a random ``v`` (``g``: the
    product with ``us``, flat). Then a Jacobian that disagrees with them was computed with
    a pattern that leaves out entries."""
    gen = torch.Generator().manual_seed(1)
    vs: list[Tensor] = []

    def other(outs: list[Tensor]) -> list[Tensor]:
        vs[:] = [cotangent(t, gen) for t in outs]
        return vs

    with buffers_kept(prob.f):
        got_v = one_reverse_product(prob, keep=other)
        got_uv = one_reverse_product(prob, keep=lambda outs: [a + b for a, b in zip(us, vs)])
    if got_v is None or got_uv is None:
        return False
    g_v, g_uv = (torch.cat([t.reshape(-1) for t in r[2]]).to(dtype) for r in (got_v, got_uv))
    off, size = gap(g_uv, g + g_v)
    return off <= tolerance(dtype) * size


def misses_message(call: str, how: str) -> str:
    return (
        f"{call}: pattern leaves out non-zeros of the Jacobian: the Jacobian computed with it "
        f"{how}, while f's reverse products are those of one linear map (deterministic and "
        f"additive in the cotangent). An entry the pattern leaves out is not computed, and "
        f"spoils the entries that share its colour, so the result would be wrong.\n  Fix: "
        f"pass a pattern that holds every entry that can be non-zero "
        f"(torch_vjp.jacobian_sparsity(f, x) detects one; yours added to it: "
        f"detected.to_dense() | pattern.to_dense().bool()), or leave pattern out."
    )


#: What the sparse wing's words call the ops of
#: :func:`~torch_vjp._engine.wrongops.wrong_ops` (the one list of the backward nodes torch
#: computes wrongly, with its predicate of the antialiased resizes), where they say more
#: than its name: the tracer's words for the same ops (:data:`~torch_vjp._sparse.rules.
#: WRONG_BATCHING`, :data:`~torch_vjp._sparse.rules.WRONG_REVERSE`).
_SAID = {"torch.cdist": rules.WRONG_BATCHING["_cdist_forward"],
         "torch.as_strided_scatter": rules.WRONG_REVERSE["as_strided_scatter"][1]}


def known_wrong(outs: list[Tensor]) -> tuple[str | None, str | None]:
    """``(wrong_batching, wrong_reverse)`` of ``Pattern``: the ops of NOTE [named reverse
    strategies and wrong formulas] (:func:`~torch_vjp._engine.wrongops.wrong_ops`) that the
    autograd graph of ``outs`` holds, in the sparse wing's words (None: none)."""
    batching, alone = wrong_ops(outs)
    return (None if batching is None else _SAID.get(batching, batching),
            None if alone is None else _SAID.get(alone, alone))


def reading_known_wrong(g: Callable[..., Any], met: list[tuple[str | None, str | None]]
                        ) -> Callable[..., Any]:
    """``g``, recording into ``met`` the ops of :func:`known_wrong` its outputs' graph holds
    (a walk of the graph its call built: no call of f more)."""
    def read(*args: Any) -> Any:
        out = g(*args)
        met[:] = [known_wrong([t for t in tree_leaves(out) if isinstance(t, Tensor)])]
        return out

    return read


def graph_flags(prob: Problem) -> tuple[str | None, str | None]:
    """``(wrong_batching, wrong_reverse)`` of ``Pattern`` for ``f``, read off the autograd
    graph of one call of ``f`` (NOTE [wrong batching rules]): for a user's pattern, which
    no detection run saw. ``(None, None)`` where the graph cannot be had (an error of
    ``f``'s, which its products raise again; inference mode). The global random generators
    are put back as they were, and the buffers ``f`` updates."""
    draws = SameDraws()
    draws()
    try:
        with torch.enable_grad(), buffers_kept(prob.f):
            # (through a copy: an f that writes into its input writes into the copy)
            leaves = [x.detach().requires_grad_(True).clone() for x in prob.leaves]
            out = prob.g(*leaves)
    except Exception as err:  # noqa: BLE001 - unknown; the products say what it was
        if passes_through(err):
            raise
        return None, None
    finally:
        draws()
    return known_wrong([t for t in tree_leaves(out) if isinstance(t, Tensor)])
