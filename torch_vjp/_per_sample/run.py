"""The computation behind the public per-sample functions, under a plan.

Every public function prepares a :class:`~torch_vjp._per_sample.args.Job` (:func:`prepare`),
gets the plan for the model structure (:func:`plan_of`), computes under it inside
:class:`BuffersKept`, and on the first call of a plan checks the result against the
per-example loop (:func:`~torch_vjp._per_sample.verify.verify`), computing again when the check routed parameters
elsewhere.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from torch_vjp._engine.compile_key import tracing
from torch_vjp._engine.context import Watched, grad_enabled
from torch_vjp._engine.memory import new_buffer
from torch_vjp._errors import (
    PerSampleError,
    StrategyError,
    TorchVJPError,
    quote_error,
)
from torch_vjp._per_sample import rules as _rules  # noqa: F401 - registers the rules
from torch_vjp._per_sample.args import (
    Job,
    Selection,
    as_inputs,
    check_model,
    check_opacus_hooks,
    check_static_mixing,
    check_targets,
    select,
)
from torch_vjp._per_sample.structure import structure_of
from torch_vjp._per_sample.distributed import ddp_add_to_grads, strip_prefix, unwrap
from torch_vjp._per_sample.factors import (
    CHUNK_ELEMENTS,
    full_precision,
    region_sq_norms,
    region_weighted_sum,
    widened,
    write_region,
)
from torch_vjp._per_sample.norms_wide import (
    Narrowed,
    checks_once,
    clip_factors,
    narrow_norms,
    overflowed,
    total_sq,
    wide_dtype,
    wide_sq_rows,
)
from torch_vjp._per_sample.keep import KEEP_ELEMENTS, KeepBudget
from torch_vjp._per_sample.fallback import CannotBatch, fallback_grads, warn_loop
from torch_vjp._per_sample.hooks import HooksResult, RuleRaised, hooks_pass
from torch_vjp._per_sample.plan import (
    ONE_DRAW,
    Plan,
    Slots,
    aliases_of,
    forward,
    mixing_error,
)
from torch_vjp._per_sample.probe import input_entries, plan_for
from torch_vjp._per_sample.registry import registered_types
from torch_vjp._strategies import get_per_sample_strategy

__all__ = ["prepare", "plan_of", "BuffersKept", "grads", "norms_and_sums", "add_to_grads",
           "clip_factors", "param_sums"]


# Per model: the selection of parameters and the static checks, for the same parameters
# (and requires_grad flags) and training flags; what every call would otherwise recompute
# (read by get first: setdefault makes a weak reference to the model each time).
_STATIC: weakref.WeakKeyDictionary[nn.Module, dict[Any, Selection]] = weakref.WeakKeyDictionary()


def prepare(fn: str, model: Any, loss_fn: Any, inputs: Any, targets: Any, params: Any,
            strategy: Any) -> Job:
    """Checks the arguments of a public function; the selection is made once per model."""
    strategy = get_per_sample_strategy(strategy, call=f"torch_vjp.{fn}")
    if not tracing() and torch.is_inference_mode_enabled():
        # (no_grad is lifted for the call; inference mode cannot be: the tensors made in it,
        # the inputs most likely, can never enter a graph. Dynamo cannot trace the query: a
        # graph break inside the user's torch.compile, an error with fullgraph=True)
        raise PerSampleError(
            f"torch_vjp.{fn}: called inside torch.inference_mode(), where torch records no "
            f"graph, so no gradient can be computed (the per-example loop would return zeros)."
            f"\nFix: call it outside the inference_mode block, on tensors made outside it; "
            f"torch.no_grad() is fine, the per-sample functions compute with grad enabled.")
    model, ddp, prefix = unwrap(fn, model)
    if (ddp is not None and ddp._check_sync_bufs_pre_fwd()
            and not getattr(getattr(ddp, "_join_config", None), "enable", False)):
        # (as DDP's own forward does first: rank 0's buffers, BatchNorm's running statistics,
        # on every rank before any per-example forward reads them; NOTE [DDP]. Not inside
        # ddp.join(): a rank that has joined shadows the broadcast of DDP's own forward
        # alone, and one more here paired with nothing there)
        ddp._sync_buffers()
    check_model(fn, model)
    check_opacus_hooks(fn, "", model)  # (every call: its hooks may be switched on again)
    xs, batch = as_inputs(fn, inputs, model)
    check_targets(fn, targets, batch)
    if tracing():
        # (under the user's torch.compile, which traces the plain program: no plan, so no
        # structure key; its caches, keyed by code objects, made dynamo fail on a guard)
        structure: tuple[Any, ...] = (tuple(m.training for m in model.modules()),)
        key = None
    else:
        structure = structure_of(model, flags := [])
        key = _static_key(flags, params, structure, prefix)
    training = structure[0]
    cache = (_STATIC.get(model) or _STATIC.setdefault(model, {})) if key is not None else {}
    sel = cache.get(key)
    if sel is None:
        sel = select(fn, model, strip_prefix(params, prefix))
        if not check_static_mixing(fn, model, batch):
            key = None  # (a BatchNorm of the batch's statistics, at one example: checked again)
        sel.training = training
        sel.tables = _tables(model, frozenset(map(id, sel.tensors.values())))
        if prefix:  # results named as the wrappers name the parameters
            sel.key_of = {prefix + n: c for n, c in sel.key_of.items()}
            sel.names = [prefix + n for n in sel.names]
        if key is not None:
            if len(cache) >= 8:
                cache.clear()
            cache[key] = sel
    if sel.tables:
        sel.sparse = frozenset(id(m.weight) for m in (r() for r in sel.tables)
                               if m is not None and getattr(m, "sparse", False))
    return Job(fn, model, loss_fn, xs, targets, sel, batch, strategy, ddp=ddp,
               structure=structure)


def _static_key(flags: list[Any], params: Any, structure: tuple[Any, ...], prefix: str) -> Any:
    # (flags: each parameter's (id, requires_grad); a wrapper's selection: kept apart)
    if params is None:
        names: Any = None
    elif isinstance(params, str):
        names = (params,)
    elif isinstance(params, (list, tuple)) and all(isinstance(n, str) for n in params):
        names = tuple(params)
    else:
        return None  # a generator, or something select() reports
    return (names, tuple(flags), structure, prefix)


def _tables(model: nn.Module, selected: frozenset[int]) -> tuple[Any, ...]:
    """The Embedding(Bag) layers whose weight is selected (those with ``sparse=True`` get a
    sparse ``.grad``, as backward gives them), held weakly: ``_STATIC`` is weak in the
    model, and a selection that held a model that is one Embedding kept it alive."""
    return tuple(
        weakref.ref(m) for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and id(m.weight) in selected
    )


class BuffersKept:
    """Puts back the buffers and parameters the plan found a forward changes (spectral
    normalisation's vectors in training mode, the rows an Embedding with max_norm
    renormalises): nothing of the model changes (SPEC §0). Inside, ``job.reset`` is the
    function that puts them back (None where no forward changes one): the per-example runs
    call it before each example, so that every example runs alone from the caller's state,
    as the definition says."""

    __slots__ = ("job", "plan", "watched", "slots", "changed", "inputs", "inputs_moved")

    def __init__(self, job: Job, plan: Plan):
        self.job = job
        self.plan = plan
        model = job.model
        # plan.watch: what a forward changes is not known yet (planning ran no forward,
        # strategy='loop'), so this first call keeps everything and tells the plan
        if plan.watch:
            self.watched: Watched | None = Watched(model.named_buffers(),
                                                   model.named_parameters())
        elif plan.mutable_buffers or plan.mutable_params:
            self.watched = Watched(_named(model.get_buffer, plan.mutable_buffers),
                                   _named(model.get_parameter, plan.mutable_params))
        else:
            self.watched = None
        self.slots = Slots(model.modules()) if plan.rebinds or plan.watch else None
        self.changed: dict[str, bool] = {}  # what reset() found changed: name -> a buffer
        # (the inputs, where a forward changes them in place: each forward sees them as given)
        self.inputs = (Watched(params=input_entries(job.xs))
                       if plan.mutable_inputs or plan.watch else None)
        self.inputs_moved = False

    def reset(self) -> None:
        if self.slots is not None and self.slots.restore():
            self.changed[""] = False  # (read on a watched call: the forward rebinds)
        if self.watched is not None:
            self.changed.update(self.watched.restore())
        if self.inputs is not None and self.inputs.restore():
            self.inputs_moved = True

    def __enter__(self) -> None:
        kept = self.watched is not None or self.slots is not None or self.inputs is not None
        self.job.reset = self.reset if kept else None

    def __exit__(self, *exc: object) -> None:
        if self.watched is not None or self.slots is not None or self.inputs is not None:
            self.reset()
        plan = self.plan
        if plan.watch:
            plan.mutable_inputs = self.inputs_moved
            plan.rebinds = self.changed.pop("", None) is not None
            plan.mutable_buffers = [n for n, b in self.changed.items() if b]
            plan.mutable_params = [n for n, b in self.changed.items() if not b]
            plan.watch = False
        self.job.reset = None


def _named(get: Callable[[str], Tensor], names: list[str]) -> list[tuple[str, Tensor]]:
    """``(name, get(name))`` for each name that still resolves."""
    out = []
    for n in names:
        try:
            out.append((n, get(n)))
        except AttributeError:
            continue
    return out


def plan_of(job: Job, rebuild: bool = False) -> Plan:
    """The plan for this call; refuses what the strategy cannot compute right."""
    plan = plan_for(job, rebuild=rebuild)
    job.by_backward = plan.by_backward
    job.batch_failure = plan.batch_failure
    if plan.mixing is not None and job.strategy in ("auto", "hooks"):
        raise mixing_error(job.fn, plan.mixing, job.strategy)
    if job.strategy == "hooks":
        missing = {n: p.reason for n, p in plan.params.items() if p.method in ("vmap", "loop")}
        if missing:
            raise _no_rule_error(job.fn, missing, plan)
    return plan


def _no_rule_error(fn: str, missing: dict[str, str], plan: Plan) -> StrategyError:
    lines = "\n".join(f"    {n!r}: {why}" for n, why in missing.items())
    # (vmap only where it can run the model: not for a model vmap cannot batch, an
    # Embedding with max_norm or a stock recurrent layer, nor one that draws from the global
    # generator and from its own, whose per-sample gradients only the loop gives)
    other = ("computes the other parameters with vmap (or the loop), or strategy='vmap'"
             if plan.vmap_randomness is not None else
             "computes the other parameters with the per-example loop, as vmap cannot run "
             "this model, or strategy='loop'")
    return StrategyError(
        f"torch_vjp.{fn}: strategy='hooks' cannot compute {len(missing)} parameter(s) "
        f"with a per-layer rule:\n{lines}\n"
        f"  Rules exist for {', '.join(registered_types())} and nn.MultiheadAttention, and "
        f"for parameters added to (or expanded over) the batch; add one for a layer of your "
        f"own with torch_vjp.register_per_sample_rule. Or use strategy='auto', which "
        f"{other}."
    )


def _hooks(job: Job, plan: Plan) -> tuple[Plan, HooksResult]:
    """The rules' pass; a model whose layer calls are not the plan's gets a new plan, once."""
    if not plan.rule_params and (not plan.zero_params or plan.fallback_params()):
        return plan, HooksResult()  # (the fallback computes the zero parameters then)
    res = _recorded_pass(job, plan)
    if res.mismatch:
        plan = job.replanned = plan_of(job, rebuild=True)  # (the caller checks this one)
        res = _recorded_pass(job, plan)
        if res.mismatch:  # the layers called change from call to call: no rules this time
            why = "the layers the model calls change from one call to the next"
            names = plan.rule_params + plan.zero_params
            if job.strategy == "hooks":
                raise _no_rule_error(job.fn, {n: why for n in names}, plan)
            res = HooksResult(moved={n: why for n in names})
    if res.moved and plan.random_global:
        res = _one_draw_moved(job, plan, res)
    if res.moved and job.strategy == "hooks":  # (rules only: what this call left, refused)
        raise _no_rule_error(job.fn, res.moved, plan)
    return plan, res


def _one_draw_moved(job: Job, plan: Plan, res: HooksResult) -> HooksResult:
    """A model that draws random numbers, some of whose rule parameters this call left to
    the fallback: the fallback's runs draw other numbers than the rules' pass did, so the
    others follow them there ('auto'), or the call is refused ('hooks'): NOTE [one draw per
    example] in ``plan``."""
    if job.strategy == "hooks":
        n, why = next(iter(res.moved.items()))
        raise StrategyError(
            f"torch_vjp.{job.fn}: strategy='hooks' cannot compute {n!r} with its rule on this "
            f"call ({why}), and the model draws random numbers (dropout in training mode): "
            f"computed apart from the rules' pass, its per-sample gradients would be of "
            f"another random draw than those of the other parameters, so no example's "
            f"gradients would be of one draw.\n"
            f"  Fix: strategy='auto' (which then computes every parameter of such a call by "
            f"one method) or strategy='loop'; or the model in eval mode.")
    why = f"{ONE_DRAW} (on this call, {next(iter(res.moved.values()))})"
    moved = dict(res.moved)
    for n in plan.rule_params:
        moved.setdefault(n, why)
    return HooksResult(moved=moved)


def _recorded_pass(job: Job, plan: Plan) -> HooksResult:
    """:func:`hooks_pass`, where a forward that fails only while the hooks record it (a
    module whose fast path the recording turns off, and which cannot run without it) leaves
    the rule parameters to the fallback ('auto') or is refused with the reason ('hooks'); a
    forward that fails by itself raises its own error."""
    try:
        return hooks_pass(job, plan)
    except RuleRaised as raised:
        err = raised.err  # (raised below, outside this handler: its context untouched)
    except (TorchVJPError, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as err:  # noqa: BLE001 - judged below
        if job.reset is not None:
            job.reset()
        why = f"the model's forward fails while the hooks record it ({quote_error(err)})"
        if job.strategy == "hooks":
            with grad_enabled(True):
                forward(job.model, job.xs, aliases_of(job.sel))  # the model's own error
            if job.reset is not None:
                job.reset()
            raise _no_rule_error(job.fn, {n: why for n in plan.rule_params}, plan) from None
        return HooksResult(moved={n: why for n in plan.rule_params})
    if job.reset is not None:
        job.reset()
    raise err  # a user's rule's own error, as it is


def _fallback_names(plan: Plan, res: HooksResult) -> tuple[list[str], list[str]]:
    """The parameters left to vmap and to the loop in this call (where it moved none, copies
    of the plan's lists, made once: ``Plan.route`` drops them)."""
    if not res.moved and "_fallback" in plan.__dict__:
        return tuple(map(list, plan.__dict__["_fallback"]))  # type: ignore[return-value]
    vmap_names, loop_names = [], []
    for n, p in plan.params.items():
        method = "vmap" if n in res.moved else p.method
        if method == "vmap" and plan.vmap_randomness is not None:
            vmap_names.append(n)
        elif method in ("vmap", "loop"):
            loop_names.append(n)
    if not plan.rule_params and (vmap_names or loop_names):
        # no rules' pass checks that no gradient reaches the zero parameters on this call
        # (:func:`hooks_pass`), and a forward that branches on a value one for the whole
        # batch can reach them: the fallback computes them too, zeros where none does
        (vmap_names or loop_names).extend(plan.zero_params)
    if not res.moved:
        plan.__dict__["_fallback"] = (list(vmap_names), list(loop_names))
    return vmap_names, loop_names


# --------------------------------------------------------------------------------------------
# The three computations
# --------------------------------------------------------------------------------------------


# NOTE [one run]
# Under "auto", a plan with parameters for the rules and parameters for vmap would run the
# model twice: the rules' pass, then vmap over the examples. per_sample_grads, whose result
# is B x P whichever way it is computed, gives all of them to vmap instead: one run. (The
# norms and the clipped step keep the rules, which spare them that B x P.) If vmap cannot
# batch the model after all, the rules come back and the loop takes the rest.


def grads(job: Job, plan: Plan, chunk: int | None) -> tuple[dict[str, Tensor], bool]:
    """Per-sample gradients of every canonical parameter, under the plan; and whether they
    came from one vmap run (NOTE [one run])."""
    if job.strategy == "auto" and plan.rule_params:
        together, loop_names = _fallback_names(plan, HooksResult())
        if together:
            # (the zero parameters too: no rules' pass checks that no gradient reaches them)
            together = together + plan.rule_params + plan.zero_params
            try:
                results = fallback_grads(job, "auto", together, 0, job.batch, chunk,
                                         plan.vmap_randomness, strict=True)
            except CannotBatch as err:
                vmap_names = [n for n in together if n not in plan.rule_set()
                              and n not in plan.zero_params]
                plan.route(vmap_names, f"vmap cannot batch this model ({err})")
                warn_loop(job.fn, job.model, err.failure)
            else:
                if job.reset is not None:
                    job.reset()
                results.update(fallback_grads(job, "loop", loop_names, 0, job.batch, chunk, None))
                return results, True
    return _split(job, plan, chunk), False


def _split(job: Job, plan: Plan, chunk: int | None) -> dict[str, Tensor]:
    plan, res = _hooks(job, plan)
    sel, batch = job.sel, job.batch
    results: dict[str, Tensor] = {}
    with grad_enabled(False):
        for n in plan.rule_params:
            if n in res.moved:
                continue
            p = sel.tensors[n]
            out = new_buffer(p, (batch, *p.shape))
            fs = res.factors.get(n)
            if fs:
                write_region(fs, out, chunk)
            else:
                out.zero_()
            results[n] = out
        for n in plan.zero_params:
            results[n] = sel.tensors[n].new_zeros((batch, *sel.tensors[n].shape))
    vmap_names, loop_names = _fallback_names(plan, res)
    if job.reset is not None:
        job.reset()
    results.update(_vmap_group(job, plan, vmap_names, 0, batch, chunk))
    results.update(fallback_grads(job, "loop", loop_names, 0, batch, chunk, None))
    return results


def _vmap_group(job: Job, plan: Plan, names: list[str], start: int, stop: int,
                chunk: int | None) -> dict[str, Tensor]:
    """The vmap group for examples ``start:stop``. strategy='vmap' raises where vmap fails;
    the others loop, and the plan keeps it (later calls go to the loop at once)."""
    if job.strategy == "vmap":
        return fallback_grads(job, "vmap", names, start, stop, chunk, plan.vmap_randomness)
    try:
        return fallback_grads(job, "auto", names, start, stop, chunk, plan.vmap_randomness,
                              strict=True)
    except CannotBatch as err:
        if job.reset is not None:
            job.reset()
        out = fallback_grads(job, "loop", names, start, stop, chunk, None)  # (may raise the
        plan.no_vmap(f"vmap cannot batch this model ({err})")  # model's own error first)
        warn_loop(job.fn, job.model, err.failure)
        return out


def _fallback_chunk(sel: Selection, names: list[str], batch: int) -> int:
    per_example = sum(sel.tensors[n].numel() for n in names)
    return max(1, min(batch, (CHUNK_ELEMENTS * 2) // max(1, per_example)))


def norms_and_sums(
    job: Job, plan: Plan, max_norm: float | None
) -> tuple[Tensor, dict[str, Tensor] | None, dict[str, Tensor]]:
    """Per-sample gradient norms (and with ``max_norm`` the clipped sums), and each
    parameter's squared norms."""
    plan, res = _hooks(job, plan)
    sel, batch = job.sel, job.batch
    like = next(iter(sel.tensors.values()))
    if like.is_complex():  # (squared norms are real)
        like = like.real
    # (squared norms in float64: NOTE [norms past the square] in norms_wide)
    wide = wide_dtype(like.dtype, like.device)

    def rules_sq() -> tuple[dict[str, Tensor], Tensor]:
        # (the clipped step keeps per-sample gradients formed for a norm, within a budget,
        # for its sum: see KEEP_ELEMENTS)
        keep = KeepBudget(KEEP_ELEMENTS) if max_norm is not None else None
        out: dict[str, Tensor] = {}
        # (the rules' norms and sums with autocast off: NOTE [norms at float32's precision])
        with grad_enabled(False), full_precision(like.device):
            for n in plan.rule_params:
                if n in res.moved:
                    continue
                fs = res.factors.get(n)
                if fs and len(fs) == 1 and fs[0].rows is None:  # the common case
                    out[n] = fs[0].sq_norms(None, keep)
                else:
                    out[n] = (region_sq_norms(fs, tuple(sel.tensors[n].shape), batch, like)
                              if fs else like.new_zeros(batch, dtype=wide_dtype(*at)))
            for n in plan.zero_params:
                out[n] = like.new_zeros(batch, dtype=wide_dtype(*at))
        return out, total_sq(out.values(), like, batch)

    # (in float32 with one check where it costs no sync: NOTE [one check on the CPU])
    at = (like.dtype, like.device)  # (wide_dtype(*at) is float32 in narrow_norms)
    if checked := checks_once(like):
        with narrow_norms():
            per_param, sq = rules_sq()
    if not checked or overflowed(sq):
        per_param, sq = rules_sq()
    sums: dict[str, Tensor] | None = {} if max_norm is not None else None
    vmap_names, loop_names = _fallback_names(plan, res)
    groups = [(names, method) for names, method in ((vmap_names, "vmap"), (loop_names, "loop"))
              if names]

    def add_sums(s: int, e: int, g: dict[str, Tensor]) -> None:
        c = clip_factors(sq[s:e], max_norm, like.dtype)  # type: ignore[arg-type]
        # (with autocast off, at float32's precision at least: NOTE [norms at float32's
        # precision] in torch_vjp._per_sample.factors)
        with full_precision(like.device):
            for n, gn in g.items():
                gn = widened(gn)
                w = torch.tensordot(c.to(gn.dtype), gn, dims=1)
                sums[n] = w if n not in sums else sums[n] + w  # type: ignore[index]

    # NOTE [one pass of the fallback]
    # The clip factor of an example needs its full norm: the rules' part is known already,
    # and each chunk of examples gets its gradients from every fallback group (vmap, then
    # the loop) before its sums are taken. (The sums once took a second pass where there
    # were two groups: it ran the model again, and a model that draws random numbers,
    # dropout, drew other masks there, so the sums were not of the gradients whose norms
    # made the clip factors, and a clipped contribution could pass max_norm.)
    for names, _ in groups:
        sq = sq.to(wide)  # (finite, if taken in float32: exact)
        for n in names:
            per_param[n] = like.new_zeros(batch, dtype=wide)
    step = min([_fallback_chunk(sel, names, batch) for names, _ in groups]) if groups else 1
    for s in range(0, batch if groups else 0, step):
        e = min(batch, s + step)
        g: dict[str, Tensor] = {}
        for names, method in groups:
            if job.reset is not None:
                job.reset()
            g.update(_vmap_group(job, plan, names, s, e, None) if method == "vmap"
                     else fallback_grads(job, "loop", names, s, e, None, None))
        with grad_enabled(False):
            for names, _ in groups:
                for n in names:
                    per_param[n][s:e] = wide_sq_rows(g[n])
                    sq[s:e] += per_param[n][s:e].to(sq.dtype)
            if sums is not None:
                add_sums(s, e, g)
        del g
    # (ghost norms can round to a hair below zero; the norms alone read the total no more)
    norms = sq.clamp_min_(0).sqrt_() if sums is None else sq.clamp_min_(0).sqrt()
    norms = norms if norms.dtype == like.dtype else norms.to(like.dtype)
    if sums is not None:
        c = clip_factors(sq, max_norm, like.dtype)  # type: ignore[arg-type]
        with grad_enabled(False), full_precision(like.device):
            for n in plan.rule_params:
                fs = res.factors.get(n)
                if n in res.moved or not fs:
                    continue
                sums[n] = region_weighted_sum(fs, c, sel.tensors[n])
    # (each parameter's squared norms, for the check against the loop's, in ``like``'s dtype)
    return norms, sums, Narrowed(per_param, like.dtype)  # type: ignore[return-value]


def param_sums(job: Job, sums: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every selected parameter's clipped sum as it is added to ``.grad``, in selection
    order: zeros where no gradient reaches the parameter, in its dtype and shape."""
    out = {}
    for n, p in job.sel.tensors.items():
        s = sums.get(n)
        if s is None:
            s = torch.zeros_like(p)
        if s.dtype != p.dtype:
            s = s.to(p.dtype)
        if s.shape != p.shape:
            s = s.reshape(p.shape)
        out[n] = s
    return out


def _grad_dtype(p: Tensor) -> torch.dtype:
    """``p.grad_dtype`` (where torch has it), else ``p.dtype``. Read at trace time inside
    the user's torch.compile: dynamo cannot trace the attribute ("torch.* op returned
    non-Tensor"), which broke the graph of accumulate_clipped_grads there, and raised with
    ``fullgraph=True``."""
    return getattr(p, "grad_dtype", None) or p.dtype


# (what torch.compiler.assume_constant_result does, without importing dynamo with torch_vjp)
_grad_dtype._dynamo_marked_constant = True  # type: ignore[attr-defined]


def add_to_grads(job: Job, sums: dict[str, Tensor]) -> None:
    """Adds each selected parameter's clipped sum to its ``.grad``, as backward would (a
    sparse ``.grad`` for an Embedding with ``sparse=True``; through DDP's reducer for a model
    wrapped in DistributedDataParallel, NOTE [DDP])."""
    if job.ddp is not None:
        ddp_add_to_grads(job.fn, job.ddp, job.sel.tensors, sums, job.sel.sparse)
        return
    sparse = job.sel.sparse
    with grad_enabled(False):
        for n, s in param_sums(job, sums).items():
            p = job.sel.tensors[n]
            # (in the dtype backward gives: that of the .grad it accumulates into, else the
            # parameter's grad_dtype, float32 for bfloat16 weights trained in mixed precision;
            # assigning another dtype raises)
            want = p.grad.dtype if p.grad is not None else _grad_dtype(p)
            if s.dtype != want:
                s = s.to(want)
            if sparse and id(p) in sparse:
                s = s.to_sparse()
            if p.grad is None:
                p.grad = s
            elif p.grad.is_sparse and not s.is_sparse:  # (dense first: torch adds no
                p.grad = s + p.grad  # dense to sparse, as backward does; a dense .grad
            else:  # takes a sparse sum in place, as backward adds)
                p.grad.add_(s)
            # backward then runs the hooks of register_post_accumulate_grad_hook (an
            # optimizer step in backward, gradient logging): so does this call
            for hook in tuple((p._post_accumulate_grad_hooks or {}).values()):
                hook(p)
