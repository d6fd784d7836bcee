"""The plan: which parameter is computed how, found once per model structure and cached.

NOTE [the per-sample plan]
A per-layer rule is right for a layer call only if the rows of the layer's output along one
dimension belong to single examples, row ``i`` to example ``i``: example ``i``'s loss then
depends on that row alone. Shapes cannot tell (a sequence-first output with ``T == B``, a
table of ``T == B`` rows used by every example, a batch that the model sorts and restores, a
reshape that scrambles examples), so the plan asks the data flow. Once per model structure
(:func:`plan_key`), on the first call:

1. The model runs on the batch and on the batch without its last example, without a graph;
   the dimension of each output (and of each module's tensor inputs) that shrinks by one
   holds the examples. The output's batch dimensions split the loss into the examples'
   own losses (``losses.loss_sum``).
2. The model runs once more, recording every module call and every rule call
   (``recorder``), and for two examples ``k`` the gradient of example ``k``'s own loss alone
   is taken with respect to every recorded tensor. Example ``k``'s loss depends only on index
   ``k`` along the batch dimension of anything that holds the examples one per row; a rule
   call is trusted with the dimension along which this holds for both examples (and only
   that one).
3. A module whose outputs pass that test while an input that carries the examples fails it
   mixes examples inside its forward (attention across the batch, ``x - x.mean(0)``,
   BatchNorm in training mode): the plan names the innermost such module, and the strategies
   that rely on rules refuse the model (:class:`~torch_vjp.PerSampleError`).
4. The autograd graph of the total loss is walked from the loss, skipping trusted calls: a
   parameter reached otherwise is used outside the layers that have rules.
5. Random operators are classified while the model runs (NOTE [randomness]).

A parameter whose every use is a trusted rule call is computed by rules; the others by vmap
(or the loop). The first real computation under a plan is then checked against the
per-example loop on two examples (unless the model draws from the global generator, whose
draws no per-example run can replay); a disagreement routes the parameters concerned to
vmap, then to the loop. Later calls on models of the same structure reuse the plan: the
recorded layer calls are compared with the plan's and a mismatch (data-dependent control
flow) builds a new one.

NOTE [randomness]
``vmap(randomness="different")`` gives each example its own draws from the global
generator, as dropout in a per-example loop does; but an operator given a generator seeded
inside the forward draws the same numbers for every example in a loop, which only
``randomness="same"`` reproduces. A model with both kinds goes to the loop.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torch_vjp._errors import PerSampleError, TorchVJPError, quote_error
from torch_vjp._per_sample.args import Selection
from torch_vjp._per_sample.losses import example_loss, loss_sum
from torch_vjp._per_sample.recorder import ModuleCall, Recorder, Wanted
from torch_vjp._per_sample.registry import Call, declining_rule

__all__ = [
    "Plan", "ParamPlan", "CallPlan", "plan_for", "plan_key", "walk", "forget_plans", "forward",
    "aliases_of", "call_key", "mixing_error",
]

_SEED = 0x7E5


@dataclass
class ParamPlan:
    """How one (canonical) parameter is computed: ``method`` is ``"rule"``, ``"vmap"``,
    ``"loop"`` or ``"zero"`` (no gradient reaches it); ``how`` names the rules (and layers)
    for ``"rule"``; ``reason`` says why a parameter is not computed by rules."""

    name: str
    method: str
    how: str = ""
    reason: str = ""


@dataclass
class CallPlan:
    """What the plan trusts of one recorded rule call."""

    key: Any
    path: str
    rule: str
    bdim: int | None
    valid: bool
    reason: str = ""
    names: frozenset[str] | None = None  # the selected parameters the call uses (filled once)
    roles: set[str] | None = None  # the roles of those the rules compute (filled once)


@dataclass
class Plan:
    """The plan for one model structure; see NOTE [the per-sample plan]."""

    strategy: str
    params: dict[str, ParamPlan]
    calls: list[CallPlan] = field(default_factory=list)
    out_dims: list[int] | None = None
    expand: set[int] = field(default_factory=set)
    direct: bool = False
    wanted: dict[int, Any] = field(default_factory=dict)
    mixing: str | None = None
    random_global: bool = False
    vmap_randomness: str | None = "different"
    verified: bool = False
    mutable_buffers: list[str] = field(default_factory=list)
    #: the hooked layers and attention modules, ``(path, module)``, found once (Recorder)
    layers: Any = None

    # The lists below are made once, when the finished plan is first used; route() resets them.

    def _by_method(self, method: str) -> list[str]:
        key = "_" + method
        found = self.__dict__.get(key)
        if found is None:
            found = self.__dict__[key] = [n for n, p in self.params.items() if p.method == method]
        return found

    @property
    def rule_params(self) -> list[str]:
        return self._by_method("rule")

    def rule_set(self) -> frozenset[str]:
        """The parameters computed by rules, as a set."""
        found = self.__dict__.get("_rule_set")
        if found is None:
            found = self.__dict__["_rule_set"] = frozenset(self.rule_params)
        return found

    @property
    def zero_params(self) -> list[str]:
        return self._by_method("zero")

    def fallback_params(self) -> list[str]:
        return [n for n, p in self.params.items() if p.method in ("vmap", "loop")]

    def signature(self) -> list[Any]:
        """The keys of the rule calls, in order (made once)."""
        sig = self.__dict__.get("_signature")
        if sig is None or len(sig) != len(self.calls):
            sig = self.__dict__["_signature"] = [c.key for c in self.calls]
        return sig

    def route(self, names: Sequence[str], reason: str) -> None:
        """Moves ``names`` off the rules (or off vmap) after a failed check."""
        for key in ("_rule_set", "_rule", "_zero"):
            self.__dict__.pop(key, None)
        for c in self.calls:
            c.roles = None
        for n in names:
            p = self.params[n]
            if p.method == "rule":
                p.method, p.how, p.reason = "vmap" if self.vmap_randomness else "loop", "", reason
            elif p.method == "vmap":
                p.method, p.reason = "loop", reason


def call_key(c: Call) -> Any:
    """What identifies a recorded rule call from one forward to the next."""
    return (id(c.module) if c.module is not None else c.path, c.rule.name,
            tuple(sorted(c.params)))


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------

_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[Any, Plan]] = weakref.WeakKeyDictionary()
_MAX_PER_MODEL = 16


def _loss_key(loss_fn: Any) -> Any:
    """What identifies a loss for the plan: its type and settings for a loss module (a new
    instance each call is the same loss), its code for a function."""
    if isinstance(loss_fn, nn.Module):
        settings = tuple(
            (k, v) for k, v in loss_fn.__dict__.items()
            if not k.startswith("_") and isinstance(v, (int, float, str, bool, type(None)))
        )
        return (type(loss_fn), settings)
    code = getattr(loss_fn, "__code__", None)
    return code if code is not None else (type(loss_fn), id(loss_fn))


def _tail(t: Any) -> Any:
    if isinstance(t, Tensor):
        return (tuple(t.shape[1:]), t.dtype, t.device.type)
    return type(t)


def plan_key(
    model: nn.Module, loss_fn: Any, xs: Sequence[Tensor], targets: Any, sel: Selection,
    strategy: str, batch: int,
) -> Any:
    """The model structure a plan is valid for: the shapes of one example, the training
    flags, the selected parameters, the loss, the strategy (the batch size is not part of it;
    a batch of one is planned apart)."""
    return (
        strategy,
        batch == 1,
        tuple(_tail(x) for x in xs),
        None if targets is None else (
            _tail(targets) if isinstance(targets, Tensor)
            else tuple(_tail(t) for t in tree_leaves(targets))),
        sel.training or tuple(m.training for m in model.modules()),
        tuple(sel.canonical),
        tuple(t.requires_grad for t in sel.tensors.values()),
        _loss_key(loss_fn),
    )


def forget_plans(model: nn.Module | None = None) -> None:
    """Drops the cached plans (of one model, or all)."""
    if model is None:
        _PLANS.clear()
    else:
        _PLANS.pop(model, None)


def plan_for(
    fn: str,
    model: nn.Module,
    loss_fn: Callable,
    xs: tuple[Tensor, ...],
    targets: Any,
    sel: Selection,
    batch: int,
    strategy: str,
    *,
    rebuild: bool = False,
) -> Plan:
    """The cached plan for this model structure, built now on a miss (or with ``rebuild``)."""
    key = plan_key(model, loss_fn, xs, targets, sel, strategy, batch)
    try:
        cache = _PLANS.setdefault(model, {})
    except TypeError:  # a model that cannot be weakly referenced: no cache
        cache = {}
    plan = None if rebuild else cache.get(key)
    if plan is None:
        # Planning runs the model a few times: its buffers are put back afterwards, and the
        # ones those runs changed are the ones each call must keep (a model in training mode
        # that updates buffers in its forward, as spectral normalisation does).
        saved = [(n, b, b.detach().clone()) for n, b in model.named_buffers()]
        try:
            plan = build_plan(fn, model, loss_fn, xs, targets, sel, batch, strategy)
        finally:
            changed = []
            with torch.no_grad():
                for n, b, copy in saved:
                    if not torch.equal(b, copy):
                        b.copy_(copy)
                        changed.append(n)
        plan.mutable_buffers = changed
        if len(cache) >= _MAX_PER_MODEL:
            cache.pop(next(iter(cache)))
        cache[key] = plan
    return plan


# --------------------------------------------------------------------------------------------
# Building a plan
# --------------------------------------------------------------------------------------------


class _Randomness(TorchDispatchMode):
    """Sees whether random operators run, and whether they are given a generator."""

    def __init__(self) -> None:
        super().__init__()
        self.global_rng = False
        self.explicit = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            if kwargs.get("generator") is not None:
                self.explicit = True
            else:
                self.global_rng = True
        return func(*args, **kwargs)


def _vmap_randomness(rng: _Randomness) -> str | None:
    if rng.explicit and rng.global_rng:
        return None
    return "same" if rng.explicit else "different"


def forward(model: nn.Module, xs: tuple[Tensor, ...], aliases: dict[str, Tensor] | None) -> Any:
    """``model(*xs)``, with the selected parameters replaced by ``aliases`` if given (stand-ins
    that require grad, for parameters that do not)."""
    if aliases is None:
        return model(*xs)
    return torch.func.functional_call(model, aliases, xs, strict=False, tie_weights=True)


def aliases_of(sel: Selection) -> dict[str, Tensor] | None:
    """Stand-ins that require grad for the selected tensors, where some do not."""
    if not sel.frozen:
        return None
    return {n: t.detach().requires_grad_(True) for n, t in sel.tensors.items()}


def _seeded_forward(
    model: nn.Module, xs: Sequence[Tensor], aliases: dict[str, Tensor] | None = None
) -> Any:
    devices = sorted({x.device.index or 0 for x in xs if x.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(_SEED)
        return forward(model, tuple(xs), aliases)


def _all_params(sel: Selection, method: str, reason: str = "") -> dict[str, ParamPlan]:
    return {n: ParamPlan(n, method, "", reason) for n in sel.canonical}


def build_plan(
    fn: str,
    model: nn.Module,
    loss_fn: Callable,
    xs: tuple[Tensor, ...],
    targets: Any,
    sel: Selection,
    batch: int,
    strategy: str,
) -> Plan:
    """Builds the plan (NOTE [the per-sample plan])."""
    if strategy == "loop":
        if next(model.buffers(), None) is not None:
            with torch.no_grad():  # once, so that plan_for sees the buffers a forward changes
                _seeded_forward(model, xs, aliases_of(sel))
        return Plan(strategy, _all_params(sel, "loop", "strategy='loop'"), verified=True)
    if strategy == "vmap":
        rng = _Randomness()
        with torch.no_grad(), rng:
            _seeded_forward(model, xs, aliases_of(sel))
        mode = _vmap_randomness(rng)
        method = "vmap" if mode else "loop"
        reason = "strategy='vmap'" if mode else (
            "strategy='vmap', but the model draws from the global generator and from a "
            "generator of its own: no setting of vmap's randomness replays both")
        return Plan(strategy, _all_params(sel, method, reason), vmap_randomness=mode,
                    random_global=rng.global_rng)
    with torch.no_grad():
        try:
            full = _shape_run(model, xs, aliases_of(sel))
        except (TorchVJPError, MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as err:  # noqa: BLE001 - the model fails on the whole batch
            if strategy == "hooks":
                raise  # the model's own error, untouched
            # the definition runs one example at a time: vmap and the loop may still work
            return Plan(strategy, _all_params(
                sel, "vmap", f"the model failed on the whole batch ({quote_error(err)})"))
        small = None
        if batch > 1:
            try:
                small = _shape_run(model, tuple(x[: batch - 1] for x in xs), aliases_of(sel))
            except (TorchVJPError, MemoryError, torch.OutOfMemoryError):
                raise
            except Exception:  # noqa: BLE001 - a model that cannot run on fewer examples
                small = None
    out_dims = None if batch == 1 else _batch_dims_of(full[0], small, batch)
    tracked = {id(t): n for n, t in sel.tensors.items()}
    if batch > 1 and out_dims is None:
        return _unsplittable(strategy, sel, full[0], batch)
    plan = _grad_probe(fn, model, loss_fn, xs, targets, sel, tracked, batch, strategy,
                       out_dims, full, small, expand=batch > 1)
    return plan


@dataclass
class _ShapeRecord:
    calls: list[tuple[int, list[tuple[int, ...]]]]


def _shape_run(
    model: nn.Module, xs: Sequence[Tensor], aliases: dict[str, Tensor] | None
) -> tuple[Any, _ShapeRecord]:
    """One forward without a graph, recording the tensor input shapes of every call of the
    model's modules, in the order the recorder sees them (when each call returns)."""
    record = _ShapeRecord([])
    ours = {id(m) for m in model.modules()}

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if id(module) in ours:
            record.calls.append(
                (id(module), [tuple(t.shape) for t in tree_leaves(args) if isinstance(t, Tensor)])
            )

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        out = _seeded_forward(model, xs, aliases)
    finally:
        handle.remove()
    return out, record


def _batch_dims_of(full: Any, small: tuple[Any, Any] | None, batch: int) -> list[int] | None:
    """The dimension of each output tensor that holds the examples: the one of size B that
    shrinks to B - 1 with one example fewer (or the only one of size B)."""
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
                    if s.shape[d] == batch - 1
                    and all(s.shape[e] == t.shape[e] for e in range(t.dim()) if e != d)
                ]
        if len(cands) != 1:
            return None
        dims.append(cands[0])
    return dims


def _unsplittable(strategy: str, sel: Selection, out: Any, batch: int) -> Plan:
    shapes = ", ".join(
        str(tuple(t.shape)) for t in tree_leaves(out) if isinstance(t, Tensor)
    ) or "no tensor"
    reason = (
        f"the model's output ({shapes}) does not hold the {batch} examples along one "
        f"dimension that shrinks with the batch, so its loss cannot be split into the "
        f"examples' own losses for the per-layer rules"
    )
    return Plan(strategy, _all_params(sel, "vmap", reason))


def _confined(g: Tensor | None, shape: Sequence[int], k: int, batch: int) -> set[int] | None:
    """The dimensions of size B along which the gradient of example ``k``'s loss is zero
    except at index ``k`` (None where the gradient is unused or all zero, or where no
    dimension has size B: a flat tensor, the per-entry weights of an EmbeddingBag say, whose
    entries cannot be told apart from the shape alone; the check against the loop then
    decides)."""
    if g is None or batch not in tuple(shape):
        return None
    if tuple(g.shape) != tuple(shape) and g.numel() == math.prod(shape):
        g = g.reshape(shape)  # the gradient of a view's base (see recorder.out_edge)
    nz = g.detach() != 0
    if not bool(nz.any()):
        return None
    dims = set()
    for d, size in enumerate(shape):
        if size != batch or d >= nz.dim():
            continue
        along = nz.movedim(d, 0).reshape(batch, -1).any(1)
        if bool(along[k]) and int(along.sum()) == 1:
            dims.add(d)
    return dims


def _other_outputs_mixed(
    c: Call,
    more: dict[int, int],
    grads: dict[tuple[int, int], list[Tensor | None]],
    i: int,
    ks: Sequence[int],
    batch: int,
) -> str:
    """Why an output of ``c`` other than the first does not keep the examples apart along
    the dimension its rule names (``""`` where each does, or is unused)."""
    for j, d in more.items():
        y = c.outputs[j]
        gs = grads.get((i, j))
        if gs is None or d >= y.dim() or y.shape[d] != batch:
            if gs is not None and any(g is not None and bool((g != 0).any()) for g in gs):
                return (f"its output {j} of shape {tuple(y.shape)} has no dimension {d} of "
                        f"size {batch} that could hold the examples")
            continue
        for a, k in enumerate(ks):
            got = _confined(gs[a], y.shape, k, batch)
            if got is not None and d not in got:
                return (f"the rows of its output {j} (shape {tuple(y.shape)}) do not belong to "
                        f"single examples along dimension {d} (an example's loss depends on "
                        f"other rows: they are shared by examples, reordered, or mixed)")
    return ""


def _probe_indices(batch: int) -> tuple[int, ...]:
    if batch == 2:
        return (1, 0)
    return (batch - 1, batch // 2)


def _grad_probe(
    fn: str,
    model: nn.Module,
    loss_fn: Callable,
    xs: tuple[Tensor, ...],
    targets: Any,
    sel: Selection,
    tracked: dict[int, str],
    batch: int,
    strategy: str,
    out_dims: list[int] | None,
    full: tuple[Any, _ShapeRecord],
    small: tuple[Any, _ShapeRecord] | None,
    *,
    expand: bool,
) -> Plan:
    """Steps 2 to 5 of NOTE [the per-sample plan]."""
    leaves = tuple(
        x.detach().requires_grad_(True) if x.is_floating_point() or x.is_complex() else x
        for x in xs
    )
    rng = _Randomness()
    aliases = aliases_of(sel)
    if aliases is not None:
        tracked = {id(t): n for n, t in aliases.items()}
    rec = Recorder(model, tracked, batch, probe=True, expand_shared=expand, direct=expand,
                   owners=sel.owners)
    with torch.enable_grad(), rng:
        with rec:
            out = _seeded_forward(model, leaves, aliases)
    # The rewrites of NOTE [direct uses] must not change what the model computes.
    rewritten = any(c.shared for c in rec.calls) or any(
        c.module is None and c.rule.name == "broadcast parameter" for c in rec.calls)
    if rewritten and not _same_output(out, full[0]):
        return _grad_probe(fn, model, loss_fn, xs, targets, sel, tracked, batch, strategy,
                           out_dims, full, small, expand=False)
    plan = Plan(strategy, {}, out_dims=out_dims, random_global=rng.global_rng,
                vmap_randomness=_vmap_randomness(rng))
    plan.wanted = dict(rec.wanted)
    total = loss_sum(fn, loss_fn, out, targets, batch, out_dims)
    calls = rec.calls
    if batch == 1:
        call_dims: list[tuple[int | None, str]] = [(None, "") for _ in calls]
    else:
        call_dims = _call_dims(fn, loss_fn, out, targets, batch, out_dims, rec, full, small, plan)
    outside = walk(total, calls, [d is not None or batch == 1 for d, _ in call_dims], tracked)
    uses: dict[str, list[tuple[Call, int | None, str]]] = {}
    for c, (d, why) in zip(calls, call_dims):
        valid = batch == 1 or d is not None
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
        bad = [(c, why) for c, d, why in used if not (batch == 1 or d is not None)]
        if bad:
            c, why = bad[0]
            plan.params[name] = ParamPlan(name, fallback, "", f"in '{c.path}', {why}")
        elif name in outside:
            plan.params[name] = ParamPlan(name, fallback, "", _outside_reason(model, name, used))
        elif not used:
            plan.params[name] = ParamPlan(name, "zero", "", "no gradient reaches it")
        else:
            how = ", ".join(dict.fromkeys(
                f"{c.rule.name} rule" + (f" in '{c.path}'" if c.path else "") for c, _, _ in used))
            plan.params[name] = ParamPlan(name, "rule", how)
    return plan


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


def _outside_reason(model: nn.Module, name: str, used: list[Any]) -> str:
    if used:
        return ("it is used outside the layers that have rules (directly in a forward, or "
                "by a layer without one)")
    path = name.rpartition(".")[0]
    try:
        m = model.get_submodule(path)
    except AttributeError:
        return "it has no per-layer rule"
    declining = declining_rule(m)
    if declining is not None:
        where = f"module '{path}'" if path else "the model itself"
        return f"{declining.declined(m)} ({where}: {type(m).__name__})"
    if not path:
        return (f"it belongs to the model itself, a {type(m).__name__}, which has no per-layer "
                f"rule")
    return f"its module '{path}' is a {type(m).__name__}, which has no per-layer rule"


def _call_dims(
    fn: str,
    loss_fn: Callable,
    out: Any,
    targets: Any,
    batch: int,
    out_dims: list[int] | None,
    rec: Recorder,
    full: tuple[Any, _ShapeRecord],
    small: tuple[Any, _ShapeRecord] | None,
    plan: Plan,
) -> list[tuple[int | None, str]]:
    """The trusted batch dimension of each rule call (None, and the reason, where none),
    and ``plan.mixing`` (steps 2 and 3 of NOTE [the per-sample plan])."""
    calls = rec.calls
    edges: list[Any] = []
    owners: list[tuple[str, int, int]] = []  # ("call" | "in" | "out", index, position)
    others: list[dict[int, int]] = []  # per call: its other outputs that hold the examples
    for i, c in enumerate(calls):
        e = c.out_edges[0] if c.out_edges else None
        if e is not None:
            owners.append(("call", i, 0))
            edges.append(e)
        more = {j: d for j, d in c.rule.other_output_dims(c.module, c.x).items()
                if j < len(c.out_edges)}
        others.append(more)
        for j in more:
            e = c.out_edges[j]
            if e is not None:
                owners.append(("other", i, j))
                edges.append(e)
    for i, mc in enumerate(rec.module_calls):
        for j, e in enumerate(mc.in_edges):
            if e is not None:
                owners.append(("in", i, j))
                edges.append(e)
        for j, e in enumerate(mc.out_edges):
            if e is not None:
                owners.append(("out", i, j))
                edges.append(e)
    grads_by_k: list[list[Tensor | None]] = []
    ks = _probe_indices(batch)
    for k in ks:
        loss_k = example_loss(fn, loss_fn, out, targets, k, out_dims)
        if edges and loss_k.requires_grad:
            grads = torch.autograd.grad(loss_k, edges, allow_unused=True, retain_graph=True)
        else:
            grads = [None] * len(edges)
        grads_by_k.append(list(grads))
    call_grads: dict[int, list[Tensor | None]] = {}
    other_grads: dict[tuple[int, int], list[Tensor | None]] = {}
    in_grads: dict[tuple[int, int], list[Tensor | None]] = {}
    out_grads: dict[tuple[int, int], list[Tensor | None]] = {}
    for pos, (kind, i, j) in enumerate(owners):
        gs = [grads_by_k[a][pos] for a in range(len(ks))]
        if kind == "call":
            call_grads[i] = gs
        elif kind == "other":
            other_grads[(i, j)] = gs
        elif kind == "in":
            in_grads[(i, j)] = gs
        else:
            out_grads[(i, j)] = gs
    plan.mixing = _find_mixing(rec.module_calls, in_grads, out_grads, ks, batch, full, small)
    result: list[tuple[int | None, str]] = []
    for i, c in enumerate(calls):
        y = c.outputs[0] if c.outputs else None
        if y is None:
            result.append((None, "the layer returned no tensor"))
            continue
        fixed = c.extra.get("fixed_bdim")
        cands = (fixed,) if fixed is not None else c.rule.batch_dims(c.module, c.x)
        if not cands and not isinstance(c.x, Tensor):
            result.append((None, f"the {c.rule.name} rule does not handle this call's input "
                                 f"(a {type(c.x).__name__})"))
            continue
        cands = tuple(d for d in cands if d < y.dim() and y.shape[d] == batch)
        if not cands:
            result.append((None, f"its output of shape {tuple(y.shape)} has no dimension that "
                                 f"could hold the {batch} examples (a table shared by every "
                                 f"example)"))
            continue
        dims: set[int] | None = None
        for a, k in enumerate(ks):
            got = _confined(call_grads.get(i, [None] * len(ks))[a], y.shape, k, batch)
            if got is None:
                continue
            got &= set(cands)
            dims = got if dims is None else dims & got
        if dims is None:  # no probed example's loss depends on this call
            dims = set(cands) if len(cands) == 1 else set()
            if not dims:
                result.append((None, "its output does not reach the losses of the probed "
                                     "examples, so its batch dimension cannot be told"))
                continue
        if len(dims) == 1:
            bad = _other_outputs_mixed(c, others[i], other_grads, i, ks, batch)
            if bad:
                result.append((None, bad))
                continue
            result.append((dims.pop(), ""))
        elif not dims:
            result.append((None, "its output's rows do not belong to single examples (an "
                                 "example's loss depends on several of them along every "
                                 "dimension that could hold the examples: the rows are "
                                 "shared by examples, reordered, or mixed)"))
        else:
            result.append((None, f"more than one dimension of its output ({sorted(dims)}) "
                                 f"could hold the examples"))
    return result


def _find_mixing(
    module_calls: list[ModuleCall],
    in_grads: dict[tuple[int, int], list[Tensor | None]],
    out_grads: dict[tuple[int, int], list[Tensor | None]],
    ks: Sequence[int],
    batch: int,
    full: tuple[Any, _ShapeRecord],
    small: tuple[Any, _ShapeRecord] | None,
) -> str | None:
    """The innermost module whose outputs keep examples apart while an input that carries
    the examples does not: its forward mixes examples (None if there is none)."""
    carries = _carrying_inputs(full[1], None if small is None else small[1],
                               [id(mc.module) for mc in module_calls])
    mixers: list[ModuleCall] = []
    for i, mc in enumerate(module_calls):
        def ok(gs: list[Tensor | None], shape: Sequence[int]) -> bool:
            for a, k in enumerate(ks):
                got = _confined(gs[a], shape, k, batch)
                if got is not None and not got:
                    return False
            return True

        outs_ok = all(ok(out_grads.get((i, j), [None] * len(ks)), s)
                      for j, s in enumerate(mc.out_shapes))
        if not outs_ok:
            continue
        for j, s in enumerate(mc.in_shapes):
            if not carries(i, j):
                continue
            gs = in_grads.get((i, j))
            if gs is not None and not ok(gs, s):
                mixers.append(mc)
                break
    if not mixers:
        return None
    # the innermost: no other mixer lies inside it
    paths = [mc.path for mc in mixers]
    inner = [
        mc for mc in mixers
        if not any(p != mc.path and (mc.path == "" or p.startswith(mc.path + ".")) for p in paths)
    ]
    mc = inner[0] if inner else mixers[0]
    where = f"module '{mc.path}' ({type(mc.module).__name__})" if mc.path else (
        f"the model's own forward ({type(mc.module).__name__})")
    return where


def _carrying_inputs(
    full: _ShapeRecord, small: _ShapeRecord | None, order: list[int]
) -> Callable[[int, int], bool]:
    """Whether input ``j`` of module call ``i`` carries the examples: its shape shrinks with
    the batch (every input, where the three runs did not call the same modules in the same
    order)."""
    if (
        small is None
        or [c[0] for c in full.calls] != order
        or [c[0] for c in small.calls] != order
    ):
        return lambda i, j: True

    def carries(i: int, j: int) -> bool:
        a, b = full.calls[i][1], small.calls[i][1]
        if j >= len(a) or j >= len(b):
            return True
        return a[j] != b[j]

    return carries


def walk(total: Tensor, calls: list[Call], trusted: list[bool], tracked: dict[int, str]) -> set[str]:
    """Names of tracked parameters the loss reaches other than through a trusted rule call.

    Walks the autograd graph from the loss; at the output node of a trusted call it continues
    only into the call's inputs, skipping the layer's own use of its parameters. A call whose
    weight is computed from a parameter (a parametrization) is walked through, so that
    parameter is found and left to the fallback rather than mistaken for unused.
    """
    jump: dict[Any, list[Any]] = {}
    for c, ok in zip(calls, trusted):
        if ok and c.complete:
            for e in c.out_edges:
                if e is not None:
                    jump[e.node] = [x.node for x in c.in_edges]
    found: set[str] = set()
    seen: set[Any] = set()
    stack = [total.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nxt = jump.get(node)
        if nxt is not None:
            stack.extend(nxt)
            continue
        var = getattr(node, "variable", None)
        if var is not None:
            name = tracked.get(id(var))
            if name is not None:
                found.add(name)
            continue
        stack.extend(n for n, _ in node.next_functions)
    return found


def mixing_error(fn: str, where: str, strategy: str) -> PerSampleError:
    """The error for a model that mixes examples (SPEC §5)."""
    return PerSampleError(
        f"torch_vjp.{fn}: {where} mixes examples: the output it gives one example depends "
        f"on the other examples of the batch (attention or statistics across the batch, "
        f"x - x.mean(0), batch_norm in training mode), so a layer's per-example gradients in "
        f"a batch are not the gradients an example gives alone, and strategy={strategy!r} "
        f"cannot be right.\n"
        f"  Fix: make the forward treat each example on its own (normalise per example: "
        f"GroupNorm/LayerNorm; attend within an example); or, if the per-example definition "
        f"(the model run on each example alone) is what you want, pass strategy='vmap' or "
        f"strategy='loop', which compute exactly that."
    )

