"""Building the per-sample plan (NOTE [the per-sample plan] in ``plan``), and the cache of
plans per model structure.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from torch_vjp._engine.context import Watched
from torch_vjp._engine.fwdcheck import all_finite
from torch_vjp._errors import TorchVJPError, a_type, quote_error
from torch_vjp._per_sample.args import Job, Selection
from torch_vjp._per_sample.structure import (loss_key, loss_tensors, note_counters, numbers_of,
                                             restore_numbers, structure_of)
from torch_vjp._per_sample.fallback import REENTRANT, outside_reason
from torch_vjp._per_sample.flow import NON_FINITE, ShapeRecord, call_dims, walk
from torch_vjp._per_sample.losses import check_connected, loss_sum
from torch_vjp._per_sample.order import DATA_WRITE, OrderWatch, route_data_orders
from torch_vjp._per_sample.plan import (WHOLE, CallPlan, GenericPoint, ParamPlan, Plan, Slots,
                                        aliases_of, call_key, seeded_forward, vmap_blockers)
from torch_vjp._per_sample.recorder import Recorder
from torch_vjp._per_sample.registry import (Call, UserRule, declining_rule, settings_changed,
                                            settings_of)
from torch_vjp._per_sample.renorm import READ_AGAIN, TableReads, renormalising_tables

__all__ = ["input_entries", "plan_for", "plan_key", "forget_plans", "build_plan"]

_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[Any, Plan]] = weakref.WeakKeyDictionary()
_MAX_PER_MODEL = 16


def _tail(t: Any) -> Any:
    if isinstance(t, Tensor):  # (requires_grad: a reentrant checkpoint's block has a
        # gradient only where its input requires grad; NOTE [reentrant checkpoints])
        return (t.shape[1:], t.dtype, t.device, t.requires_grad)
    return type(t)


def plan_key(job: Job) -> Any:
    """The model structure a plan is valid for: the shapes of one example, the modules
    (NOTE [the structure a plan is for] in :mod:`torch_vjp._per_sample.structure`), the selected
    parameters (and which have gradient hooks), the loss, the strategy, which inputs are
    one tensor (the batch size is not part of it; a batch of one is planned apart)."""
    sel, targets, xs = job.sel, job.targets, job.xs
    # (list comprehensions and one pass over the tensors: generators cost more, every call)
    tensors = sel.tensors.values()
    return (
        job.strategy,
        job.batch == 1,
        tuple([_tail(x) for x in xs]),
        tuple([_first(xs, x) for x in xs]),  # (each_once)
        None if targets is None else (
            _tail(targets) if isinstance(targets, Tensor)
            else tuple([_tail(t) for t in tree_leaves(targets)])),
        job.structure,  # NOTE [the structure a plan is for] in _per_sample/structure.py
        tuple(sel.canonical),
        tuple([t.requires_grad for t in tensors]),
        tuple([bool(t._backward_hooks) for t in tensors]),
        loss_key(job.loss_fn),
        loss_tensors(job.loss_fn, sel.tracked),
    )


def _first(xs: tuple[Any, ...], x: Any) -> int:  # (x's first position in xs, by identity)
    for j, y in enumerate(xs):
        if y is x:
            return j
    raise ValueError("not in the inputs")  # (x is taken from xs)


def forget_plans(model: nn.Module | None = None) -> None:
    """Drops the cached plans (of one model, or all)."""
    if model is None:
        _PLANS.clear()
    else:
        _PLANS.pop(model, None)


_REENTRANT_REASON = (
    "the model runs torch.utils.checkpoint with use_reentrant=True on a block whose input "
    "requires grad, which only backward() differentiates (torch.autograd.grad, which the "
    "rules and vmap need, refuses it); the loop runs backward() per example. Fix: "
    "use_reentrant=False in torch.utils.checkpoint")

# NOTE [gradient hooks on a parameter]
# A hook registered on a parameter (``p.register_hook(fn)``) acts on the gradient that
# reaches the parameter: in a per-example loop, on each example's gradient. The rules and
# vmap never pass through the parameter's own gradient (vmap differentiates stand-ins), so a
# parameter with such a hook is computed by the loop, under every strategy but 'hooks', which
# refuses it. Whether each selected parameter has hooks is part of the plan's key: a hook
# registered after the first call makes a new plan.
_HOOKED = ("a gradient hook is registered on it (Tensor.register_hook), which only the "
           "per-example loop applies to each example's gradient")


def input_entries(xs: tuple[Any, ...]) -> list[tuple[str, Tensor]]:
    """The input tensors, named for :class:`Watched` (it puts back what a forward moved)."""
    return [(f"input {i}", x) for i, x in enumerate(xs)
            if isinstance(x, Tensor) and not x.is_inference()]  # (no version counter)


def plan_for(job: Job, *, rebuild: bool = False) -> Plan:
    """The cached plan for this model structure, built now on a miss (or with ``rebuild``)."""
    key = plan_key(job)
    model = job.model
    try:
        cache = _PLANS.setdefault(model, {})
    except TypeError:  # a model that cannot be weakly referenced: no cache
        cache = {}
    # (a plan of this batch size first: NOTE [plans of one batch size] in plan.py)
    plan = None if rebuild else cache.get((key, job.batch), cache.get(key))
    if plan is not None and plan.stale:
        plan = None  # a check made again found it wrong (NOTE [checked again] in verify.py)
    if plan is not None and plan.settings and settings_changed(plan.settings):
        plan = None  # a layer's settings changed since (its rule may no longer apply)
    if plan is None:
        # Planning runs the model a few times: its buffers and parameters are put back
        # afterwards, and the ones those runs changed are the ones each call must keep (a
        # model in training mode that updates buffers in its forward, as spectral
        # normalisation does; an Embedding with max_norm, which renormalises the rows it
        # looks up in place, in any mode), and a forward that assigns new tensors to its
        # modules is put back after each planning run (the copies cost one copy of the
        # parameters, on the first call of a model structure).
        watched = Watched(model.named_buffers(), model.named_parameters())
        slots = Slots(model.modules())
        inputs = Watched(params=input_entries(job.xs))
        moved: dict[str, bool] = {}

        def reset() -> None:  # (after each planning forward: every run starts alike)
            slots.restore()
            moved.update(inputs.restore())

        job.reset = reset
        numbers = numbers_of(model)
        try:
            with torch.enable_grad():  # (the plan is for the pass run in grad mode)
                plan = build_plan(job)
        finally:
            job.reset = None
            reset()
            changed = watched.restore()
            del watched, inputs
            counters = note_counters(numbers)
            restore_numbers(numbers)  # (a step counter: the planning forwards do not count)
        if counters:
            # the forwards moved a numeric attribute (a counter): the structure leaves it out
            # from now on, and the plan is kept under that key too
            job.structure = structure_of(model)
            extra_key = plan_key(job)
        else:
            extra_key = None
        plan.mutable_inputs = bool(moved)
        plan.mutable_buffers = [n for n, is_buffer in changed.items() if is_buffer]
        plan.mutable_params = [n for n, is_buffer in changed.items() if not is_buffer]
        plan.rebinds = slots.changed
        if job.strategy in ("auto", "hooks"):  # (what vmap cannot batch: the loop)
            plan.no_vmap(vmap_blockers(model))
        hooked = [n for n, t in job.sel.tensors.items() if t._backward_hooks]
        if hooked:
            plan.to_loop(hooked, _HOOKED)
        plan.one_draw()  # (NOTE [one draw per example] in plan.py)
        if any(NON_FINITE in p.reason for p in plan.params.values()):
            return plan  # (made for this batch's NaN alone: the next batch plans afresh)
        if plan.batch_bound or plan.mixing is not None:  # (of this batch size only)
            key, extra_key = (key, job.batch), extra_key and (extra_key, job.batch)
        if plan.data_bound is None:  # (else of this batch alone: planned at every call)
            if len(cache) >= _MAX_PER_MODEL:
                cache.pop(next(iter(cache)))
            cache[key] = plan
            if extra_key is not None:
                cache[extra_key] = plan
    plan.batch_now = job.batch  # (NOTE [checked at each batch size] in verify.py)
    return plan



class _Randomness(TorchDispatchMode):
    """Sees whether random operators run, and whether they are given a generator."""

    def __init__(self) -> None:
        super().__init__()
        self.global_rng = False
        self.explicit = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()) and _draws(
                func, args, kwargs):
            if kwargs.get("generator") is not None:
                self.explicit = True
            else:
                self.global_rng = True
        return func(*args, **kwargs)


def _draws(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a random operator draws: not with a dropout probability of zero, nor out of
    training mode (the attention kernel of ``F.scaled_dot_product_attention`` with
    ``dropout_p=0``, as every ``nn.MultiheadAttention`` of ``dropout=0.0`` calls it; rrelu in
    eval mode), which leave the generator as it was and compute the same for each example
    alone. Taken for random, such a model's plan was never checked against the loop."""
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name, arg.default_value)
        if (arg.name == "dropout_p" and value == 0) or (
                arg.name in ("training", "train") and value is False):
            return False
    return True


def _vmap_randomness(rng: _Randomness) -> str | None:
    if rng.explicit and rng.global_rng:
        return None
    return "same" if rng.explicit else "different"


def _all_params(sel: Selection, method: str, reason: str = "") -> dict[str, ParamPlan]:
    return {n: ParamPlan(n, method, "", reason) for n in sel.canonical}


def build_plan(job: Job) -> Plan:
    """Builds the plan (NOTE [the per-sample plan])."""
    model, xs, sel, batch, strategy = job.model, job.xs, job.sel, job.batch, job.strategy
    if strategy == "loop":
        # (no forward here: the plan's first call finds what a forward changes in place)
        return Plan(strategy, _all_params(sel, "loop", "strategy='loop'"), verified=True,
                    watch=True)
    if strategy == "vmap":
        rng = _Randomness()
        with torch.no_grad(), rng:
            # (on one example, as vmap runs the model: a model that fails on the whole batch,
            # a view with the size of one example written in, was refused here)
            seeded_forward(model, each_once(xs, lambda x: x[:1]), aliases_of(sel))
        _after_forward(job)
        mode = _vmap_randomness(rng)
        method = "vmap" if mode else "loop"
        reason = "strategy='vmap'" if mode else (
            "strategy='vmap', but the model draws from the global generator and from a "
            "generator of its own: no setting of vmap's randomness replays both")
        return Plan(strategy, _all_params(sel, method, reason), vmap_randomness=mode,
                    random_global=rng.global_rng)
    # (in grad mode, as the pass the plan is for: a module with a fast path for inference,
    # nn.TransformerEncoder's, takes it only without grad, and would call other modules)
    # (a table renormalised in place and read again: NOTE [renormalised tables read again])
    tables = renormalising_tables(model) if batch > 1 else []
    reads = TableReads() if tables else contextlib.nullcontext()
    with torch.enable_grad():
        try:
            with reads:
                full = _shape_run(model, xs, aliases_of(sel))
            _after_forward(job)
        except (TorchVJPError, MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as err:  # noqa: BLE001 - the model fails on the whole batch
            if strategy == "hooks":
                raise  # the model's own error, untouched
            # the definition runs one example at a time: vmap and the loop may still work
            failure = f"{quote_error(err)}, on a batch of {batch}"
            return Plan(strategy, _all_params(
                sel, "vmap", f"the model failed on the whole batch ({failure})"),
                batch_failure=failure, batch_bound=True)
        small = None
        if batch > 1:
            # (a batch of two is compared with three examples, not one: a forward that
            # squeezes, x.squeeze(), drops the batch dimension of a batch of one)
            other = batch - 1 if batch > 2 else batch + 1
            try:
                small = _shape_run(model, each_once(xs, lambda x: x[:other] if other < batch
                                                    else torch.cat([x, x[-1:]])),
                                   aliases_of(sel))
                small[1].batch = other
                _after_forward(job)
            except (TorchVJPError, MemoryError, torch.OutOfMemoryError):
                raise
            except Exception:  # noqa: BLE001 - a model that cannot run on fewer examples
                small = None
    if isinstance(reads, TableReads) and reads.read_again:
        plan = Plan(strategy, _all_params(sel, "loop", READ_AGAIN))
        plan.settings = settings_of(tables)  # (made again if max_norm is set otherwise)
        return plan
    out_dims = None if batch == 1 else _batch_dims_of(full[0], small, batch)
    tracked = {id(t): n for n, t in sel.tensors.items()}
    if batch > 1 and out_dims is None:
        return _unsplittable(strategy, sel, full[0], batch)
    return _grad_probe(job, tracked, out_dims, full, small, expand=batch > 1)


def each_once(xs: Sequence[Tensor], fn: Callable[[Tensor], Tensor]) -> tuple[Tensor, ...]:
    """``fn`` of each input, one result per distinct tensor: an input passed twice (the
    same tensor as an attention's key and value) stays one tensor in the planning runs, as
    in the pass the plan is for, where a module that compares its arguments by identity
    (``nn.MultiheadAttention``'s ``key is value``) makes other layer calls otherwise."""
    done: dict[int, Tensor] = {}
    return tuple(x if x is None else done[id(x)] if id(x) in done else
                 done.setdefault(id(x), fn(x)) for x in xs)


def _after_forward(job: Job) -> None:
    """Puts back what a planning forward assigned to or registered on the model's modules
    (``job.reset`` while planning), so that the next run starts from the caller's model."""
    if job.reset is not None:
        job.reset()


def _shape_run(
    model: nn.Module, xs: Sequence[Tensor], aliases: dict[str, Tensor] | None
) -> tuple[Any, ShapeRecord]:
    """One forward, recording the tensor input shapes of every call of the model's modules,
    in the order the recorder sees them (when each call returns); the output detached, so
    that its graph is freed at once. (A nested tensor has no shape: None.)"""
    record = ShapeRecord([])
    ours = {id(m) for m in model.modules()}

    def hook(module: nn.Module, args: Any, kwargs: dict, output: Any) -> None:
        if id(module) in ours:  # (keyword arguments too, as the recorder lists them)
            record.calls.append((id(module), [
                None if t.is_nested else tuple(t.shape)
                for t in tree_leaves((args, kwargs) if kwargs else args)
                if isinstance(t, Tensor)
            ]))

    handle = torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True)
    try:
        out = seeded_forward(model, xs, aliases)
    finally:
        handle.remove()
        # (a removed global hook registered with_kwargs leaves its id in torch's with-kwargs
        # dict, which makes torch.compile(module) warn about global hooks afterwards)
        torch.nn.modules.module._global_forward_hooks_with_kwargs.pop(handle.id, None)
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, out), record


def _batch_dims_of(full: Any, small: tuple[Any, Any] | None, batch: int) -> list[int] | None:
    """The dimension of each output tensor that holds the examples: the one of size B that
    shrinks to B - 1 with one example fewer (grows to B + 1 with one more, for a batch of
    two: ``small[1].batch``), or the only one of size B."""
    leaves = [t for t in tree_leaves(full) if isinstance(t, Tensor)]
    small_leaves = (
        [t for t in tree_leaves(small[0]) if isinstance(t, Tensor)] if small is not None else None
    )
    if not leaves:
        return None
    dims = []
    for j, t in enumerate(leaves):
        cands = [d for d in range(t.dim()) if t.shape[d] == batch]
        if small_leaves is not None and len(small_leaves) == len(leaves):
            s = small_leaves[j]
            if s.dim() == t.dim():
                cands = [
                    d for d in cands
                    if s.shape[d] == small[1].batch  # type: ignore[index]
                    and all(s.shape[e] == t.shape[e] for e in range(t.dim()) if e != d)
                ]
        if len(cands) != 1:
            return None
        dims.append(cands[0])
    return dims


def _unsplittable(strategy: str, sel: Selection, out: Any, batch: int) -> Plan:
    shapes = ", ".join(
        str(tuple(t.shape)) for t in tree_leaves(out) if isinstance(t, Tensor)
    )
    reason = (
        f"the model's output ({shapes}) does not hold the {batch} examples along one "
        f"dimension that shrinks with the batch, so its loss cannot be split into the "
        f"examples' own losses for the per-layer rules"
    ) if shapes else (
        f"the model's output, {a_type(out)}, holds no tensor that torch's pytree reaches (a "
        f"dataclass or an object of another class of its own), so its loss cannot be split "
        f"into the examples' own losses for the per-layer rules. Fix: return the tensors in "
        f"a dict, a tuple or a namedtuple")
    return Plan(strategy, _all_params(sel, "vmap", reason), batch_bound=True)


class _NotGeneric(Exception):
    """A non-finite output at NOTE [probes at a generic point]'s point, not at its own."""


def _grad_probe(
    job: Job,
    tracked: dict[int, str],
    out_dims: list[int] | None,
    full: tuple[Any, ShapeRecord],
    small: tuple[Any, ShapeRecord] | None,
    *,
    expand: bool,
) -> Plan:
    """Steps 2 to 5 of NOTE [the per-sample plan], at the generic point of NOTE [probes at
    a generic point] in ``plan``, else at the parameters' own values where the model
    raises anything there (or gives a non-finite output)."""
    point = GenericPoint(job.model, job.sel)
    if point:
        own = job.reset

        def reset() -> None:  # (the planning's own reset sees the model's parameters)
            point.unswap()
            if own is not None:
                own()
            point.swap()

        job.reset = reset
        try:
            point.swap()
            return _probe_at(job, tracked, out_dims, full, small, expand=expand,
                             grad_inputs=True, point=point)
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except Exception:  # noqa: BLE001 - retried at the model's own values
            pass
        finally:
            point.unswap()
            job.reset = own
        _after_forward(job)
    return _probe_at(job, tracked, out_dims, full, small, expand=expand, grad_inputs=True,
                     point=None)


_NO_DERIVATIVE = "the plan's data-flow test differentiates by the inputs, which torch cannot ("
_COMPLEX = ("its parameters are complex, and the rules give the per-sample gradients of real "
            "parameters (the fallback gives torch's convention for complex ones, the "
            "conjugate Wirtinger derivative times two)")


def _probe_at(
    job: Job,
    tracked: dict[int, str],
    out_dims: list[int] | None,
    full: tuple[Any, ShapeRecord],
    small: tuple[Any, ShapeRecord] | None,
    *,
    expand: bool,
    grad_inputs: bool,
    point: GenericPoint | None,
) -> Plan:
    """Steps 2 to 5 of NOTE [the per-sample plan] (see :func:`_grad_probe`).

    The recorded forward first runs with the rewrites of NOTE [direct uses] (``expand``)
    and with the floating inputs requiring grad (their gradients tell which rows of a
    first layer's input belong to which example). A model that cannot run so is run again
    without the rewrites (a table of one row expanded to the batch, which a forward that
    repeats it by hand then repeats B times too), then with its inputs as given (a model
    that changes its input in place, or sets ``requires_grad`` on a view of it); a model
    that fails under the recording even then has every parameter planned for vmap or the
    loop, with the reason (``hooks`` refuses it with that reason)."""
    model, sel, batch = job.model, job.sel, job.batch
    # (views of leaves, not the leaves: a global module hook that registers a multi-grad
    # hook on a module's inputs, torch's ModuleTracker and FlopCounterMode, cannot take a
    # leaf inside autograd.grad, which the probe's data-flow test runs)
    leaves = each_once(job.xs, lambda x: (
        x.detach().requires_grad_(True).view_as(x)
        if grad_inputs and (x.is_floating_point() or x.is_complex()) else x))
    rng = _Randomness()
    aliases = aliases_of(sel) if point is None else None
    if aliases is not None:
        tracked = {id(t): n for n, t in aliases.items()}
    elif point is not None:
        tracked = point.tracked
    rec = Recorder(model, tracked, batch, probe=True, expand_shared=expand, direct=expand,
                   owners=sel.owners)
    # (NOTE [orders that depend on the data] in order.py)
    watch = OrderWatch(leaves, batch, model) if batch > 1 else contextlib.nullcontext()
    try:
        with torch.enable_grad(), rng, watch:
            with rec:
                out = seeded_forward(model, leaves, aliases)
    except (TorchVJPError, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as err:  # noqa: BLE001 - retried as the docstring says
        _after_forward(job)
        if expand or grad_inputs:
            return _probe_at(job, tracked, out_dims, full, small, expand=False,
                             grad_inputs=expand and grad_inputs, point=point)
        if point is not None:
            raise _NotGeneric from err  # (retried at the model's own values)
        return Plan(job.strategy, _all_params(
            sel, "vmap", f"the model's forward fails while the hooks record it "
                         f"({quote_error(err)})"))
    _after_forward(job)
    if point is not None and all_finite(full[0]) and not all_finite(out):
        raise _NotGeneric
    # The rewrites of NOTE [direct uses] must not change what the model computes.
    rewritten = any(c.shared for c in rec.calls) or any(
        c.module is None and c.rule.name == "broadcast parameter" for c in rec.calls)
    if rewritten and not _same_output(out, full[0] if point is None else _plain_run(job)):
        return _probe_at(job, tracked, out_dims, full, small, expand=False,
                         grad_inputs=grad_inputs, point=point)
    plan = Plan(job.strategy, {}, out_dims=out_dims, random_global=rng.global_rng,
                vmap_randomness=_vmap_randomness(rng))
    layers = list({id(c.module): c.module for c in rec.calls if c.module is not None}.values())
    plan.settings = settings_of(layers)
    plan.wanted = dict(rec.wanted)
    total = loss_sum(job.fn, job.loss_fn, out, job.targets, batch, out_dims)
    check_connected(job.fn, total, out)
    calls = rec.calls
    try:
        if batch == 1:
            dims: list[tuple[int | None, str]] = [(None, "") for _ in calls]
        else:
            dims, plan.mixing = call_dims(job, out, out_dims, rec, full, small)
        # the rules' factors are those of real parameters (x^T g, not x^H g): a complex
        # parameter's layer is computed by the fallback, which follows torch's convention
        dims = [(None, _COMPLEX) if any(t.is_complex() for t, _ in c.params.values()) else dw
                for c, dw in zip(calls, dims)]
        outside = walk(total, calls, [d is not None or (batch == 1 and why != _COMPLEX)
                                      for d, why in dims], tracked)
    except RuntimeError as err:
        if "derivative for" in str(err) and "is not implemented" in str(err):
            why = f"{_NO_DERIVATIVE}{quote_error(err)}); vmap needs none there"
            return Plan(job.strategy, _all_params(sel, "vmap", why))
        if REENTRANT not in str(err):
            raise
        if not grad_inputs:
            # a reentrant checkpoint on a block whose input requires grad: only backward()
            # passes through it, which the loop uses (NOTE [reentrant checkpoints])
            return Plan(job.strategy, _all_params(sel, "loop", _REENTRANT_REASON),
                        by_backward=True)
        # torch.utils.checkpoint(use_reentrant=True) refuses autograd.grad with inputs=; it
        # may have met them because the inputs were made to require grad (a block whose
        # input does not require grad gives its parameters no gradient, in backward as in
        # the loop)
        return _probe_at(job, tracked, out_dims, full, small, expand=expand,
                         grad_inputs=False, point=point)
    uses: dict[str, list[tuple[Call, int | None, str]]] = {}
    for c, (d, why) in zip(calls, dims):
        valid = (batch == 1 and why != _COMPLEX) or d is not None
        plan.calls.append(CallPlan(call_key(c), c.path, c.rule.name, d, valid, why))
        if c.shared and valid:
            plan.expand.add(id(c.module))
        if c.module is None and c.rule.name == "broadcast parameter" and valid:
            plan.direct = True
        for role, (t, _) in c.params.items():
            name = tracked.get(id(t))
            if name is not None:
                uses.setdefault(name, []).append((c, d, why))
    fallback = plan.vmap_randomness and "vmap" or "loop"
    for name in sel.canonical:
        used = uses.get(name, [])
        bad = [(c, why) for c, d, why in used
               if not ((batch == 1 and why != _COMPLEX) or d is not None)]
        if bad:
            c, why = bad[0]
            plan.params[name] = ParamPlan(name, fallback, "", f"in '{c.path}', {why}")
        elif name in outside and batch == 1 and not sel.tensors[name].is_complex():
            # a batch of one: the example's gradient is the parameter's own gradient, which
            # the rules' one backward gives (NOTE [a batch of one] in hooks.py)
            plan.params[name] = ParamPlan(name, "rule", WHOLE)
            plan.whole.add(name)
        elif name in outside:
            plan.params[name] = ParamPlan(name, fallback, "", outside_reason(model, name, used))
        elif not used:
            plan.params[name] = ParamPlan(name, "zero", "", "no gradient reaches it")
        else:
            how = ", ".join(dict.fromkeys(
                f"{c.rule.name} rule" + (f" in '{c.path}'" if c.path else "") for c, _, _ in used))
            user = ", ".join(dict.fromkeys(
                c.rule.name for c, _, _ in used if isinstance(c.rule, UserRule)))
            plan.params[name] = ParamPlan(name, "rule", how, user=user)
    route_data_orders(plan, calls, tracked, watch if batch > 1 else None, out)
    if batch > 1 and watch.data_writes:  # (NOTE [writes at an index of the data])
        plan.mixing = plan.mixing or watch.mixing  # (values added up at equal ids)
        plan.data_bound = DATA_WRITE.format(ops=", ".join(sorted(watch.data_writes)))
    declined = _declined_layers(model, plan.params)  # (decided on their settings too)
    if declined:
        plan.settings = settings_of(layers + declined)
    return plan


def _declined_layers(model: nn.Module, params: dict[str, ParamPlan]) -> list[nn.Module]:
    mods = dict(model.named_modules())
    found = {id(m): m for m in (mods.get(n.rpartition(".")[0]) for n, p in params.items()
                                if p.method != "rule") if m is not None and declining_rule(m)}
    return list(found.values())


def _plain_run(job: Job) -> Any:
    """The model's output at the generic point (swapped in), without the recording."""
    with torch.no_grad():
        out = seeded_forward(job.model, job.xs, None)
    _after_forward(job)
    return out


def _same_output(a: Any, b: Any) -> bool:
    la = [t for t in tree_leaves(a) if isinstance(t, Tensor)]
    lb = [t for t in tree_leaves(b) if isinstance(t, Tensor)]
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if x.shape != y.shape or not torch.allclose(x.detach(), y, rtol=1e-6, atol=1e-7,
                                                    equal_nan=True):
            return False
    return True
