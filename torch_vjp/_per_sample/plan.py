"""The plan: which parameter is computed how, found once per model structure and cached
(built by ``probe``, with the data-flow tests of ``flow``).

NOTE [the per-sample plan]
A per-layer rule is right for a layer call only if the rows of the layer's output along one
dimension belong to single examples, row ``i`` to example ``i``: example ``i``'s loss then
depends on that row alone. Shapes cannot tell (a sequence-first output with ``T == B``, a
table of ``T == B`` rows used by every example, a batch that the model sorts and restores, a
reshape that scrambles examples), so the plan asks the data flow. Once per model structure
(``probe.plan_key``), on the first call:

1. The model runs on the batch and on the batch without its last example (a batch of two:
   with its last example twice, as a forward that squeezes, ``x.squeeze()``, drops the
   batch dimension of one example), without a graph; the dimension of each output (and of
   each module's tensor inputs) that changes by one holds the examples. The output's batch dimensions split the loss into the examples'
   own losses (``losses.loss_sum``).
2. The model runs once more, with its parameters moved to a generic point near their
   values (NOTE [probes at a generic point]: a trainable gate at zero hides no mixing
   there; the NOTE says what it does not cover), recording every module call and every
   rule call (``recorder``), and for two examples ``k`` the gradient of example ``k``'s own loss alone
   is taken with respect to every recorded tensor. Example ``k``'s loss depends only on index
   ``k`` along the batch dimension of anything that holds the examples one per row; a rule
   call is trusted with the dimension along which this holds for both examples (and only
   that one).
3. A module whose outputs pass that test while an input that carries the examples fails it
   mixes examples inside its forward (attention across the batch, ``x - x.mean(0)``,
   BatchNorm in training mode). So does one where, for every example at once, the gradient
   of a random weighting of the examples' losses breaks a row's ratio to another
   weighting's (``weighted.weighted_grads``; a module that mixes only some examples, those
   that share a group id, can leave the two probed ones apart), where that gradient is
   linear in the weights (a backward hook that normalises over the batch is not). The plan
   names the innermost such module, and the strategies
   that rely on rules refuse the model (:class:`~torch_vjp.PerSampleError`). The module
   calls of the two runs are matched module by module; a module called a different number
   of times in them (a loop over the examples) cannot be matched, and if only such modules
   look like mixing, no rule is trusted (the fallback computes the definition) rather than
   the model refused.
4. The autograd graph of the total loss is walked from the loss, skipping trusted calls: a
   parameter reached otherwise is used outside the layers that have rules. (A trusted call
   whose weight is computed, a parametrization, is walked through, to find what the weight
   is computed from; its own parameters the rule computes, a plain bias, stay the rule's.)
5. Random operators are classified while the model runs (NOTE [randomness]).
6. A rule call whose rows the model orders by its own data (a sort of the batch by a length,
   restored after) leaves the rules (NOTE [orders that depend on the data] in ``order``).

A parameter whose every use is a trusted rule call is computed by rules; the others by vmap
(or the loop). The first real computation under a plan is then checked against the
per-example loop on three examples, the first, the middle and the last (a model that
draws from the global generator, whose draws no per-example run can replay, is checked with
its dropout layers in eval mode, the plan's computation made again for the check; a model
that still draws then is not checked); a disagreement routes the parameters concerned to vmap, then to the loop. A rule
that cannot split a call into examples raises ``registry.Declined`` rather than rely on
the check: that call's parameters go to the fallback. Later calls on models of the same structure reuse the plan: the
recorded layer calls are compared with the plan's and a mismatch (data-dependent control
flow) builds a new one. The check is made again now and then, for what the plan's key cannot
see (NOTE [checked again] in ``verify``).

NOTE [randomness]
``vmap(randomness="different")`` gives each example its own draws from the global
generator, as dropout in a per-example loop does; but an operator given a generator seeded
inside the forward draws the same numbers for every example in a loop, which only
``randomness="same"`` reproduces. A model with both kinds goes to the loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from torch_vjp._errors import PerSampleError
from torch_vjp._per_sample.args import Selection
from torch_vjp._per_sample.registry import Call

__all__ = [
    "Plan", "ParamPlan", "CallPlan", "call_key", "forward", "functional_call", "Slots",
    "seeded_forward", "aliases_of", "GenericPoint", "mixing_error", "parametrize_cache_off",
    "WHOLE", "ONE_DRAW", "vmap_blockers",
]

_SEED = 0x7E5


#: How a plan shows a parameter taken whole for a batch of one (NOTE [a batch of one] in
#: ``hooks``).
WHOLE = "its whole gradient (a batch of one: the example's gradient is the batch's)"


@dataclass
class ParamPlan:
    """How one (canonical) parameter is computed: ``method`` is ``"rule"``, ``"vmap"``,
    ``"loop"`` or ``"zero"`` (no gradient reaches it); ``how`` names the rules (and layers)
    for ``"rule"``; ``reason`` says why a parameter is not computed by rules; ``user`` names
    the rules registered by the user among them."""

    name: str
    method: str
    how: str = ""
    reason: str = ""
    user: str = ""


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
    #: per_sample_grads under "auto" computed every parameter with vmap in one run (NOTE
    #: [one run]), and that was checked against the loop
    verified_one_run: bool = False
    #: calls under the plan after its first check, and the one of its last (NOTE [checked
    #: again] in ``verify``); a check is under way; a check found it stale (made anew)
    uses: int = 0
    checked_at: int = 0
    rechecking: bool = False
    stale: bool = False
    mutable_buffers: list[str] = field(default_factory=list)
    #: parameters a forward changes in place (Embedding's max_norm renormalises the rows it
    #: looks up): put back after each call, as the buffers are
    mutable_params: list[str] = field(default_factory=list)
    #: a forward assigns new tensors to a module's parameters or buffers, or registers new
    #: ones: every call puts back what each module held (Slots)
    rebinds: bool = False
    #: a forward changes its input tensors in place (``x.mul_(2)``): every call copies the
    #: inputs and puts them back after each forward, so that each forward, and the caller,
    #: sees them as given
    mutable_inputs: bool = False
    #: the layers the rules compute (held weakly) and their settings when planned
    #: (``layer_settings``): the plan is made again where they change
    settings: tuple[Any, ...] | None = None
    #: the two lists above are not known yet (planning ran no forward): the first call
    #: keeps every buffer and parameter, and fills them in (BuffersKept)
    watch: bool = False
    #: the hooked layers and attention modules, ``(path, module)``, found once (Recorder)
    layers: Any = None
    #: a reentrant checkpoint refused autograd.grad: the loop runs backward() (NOTE
    #: [reentrant checkpoints] in ``fallback``)
    by_backward: bool = False
    #: a batch of one: the 'rule' parameters taken whole from the rules' backward, used
    #: outside the layers with rules (NOTE [a batch of one] in ``hooks``)
    whole: set[str] = field(default_factory=set)
    #: the model raised this error (quoted) on the whole batch it was planned on: every
    #: parameter goes to the fallback, which runs one example at a time
    batch_failure: str | None = None
    #: made for the batch size it was planned at only (NOTE [plans of one batch size]): a
    #: model refused there (mixing, a failure on the whole batch, an output that does not
    #: hold the batch) may be per-example at another size
    batch_bound: bool = False
    #: made for the batch it was probed on only: the model writes rows at an index of its
    #: data (NOTE [writes at an index of the data] in ``order``), the reason
    data_bound: str | None = None
    #: the batch sizes the plan's results were checked at against the loop, and the size of
    #: the call under way (NOTE [checked at each batch size] in ``verify``); this call's
    #: check is one of a new batch size
    batches: set[int] = field(default_factory=set)
    batch_now: int = 0
    new_batch: bool = False

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
        for key in ("_rule_set", "_rule", "_zero", "_fallback"):
            self.__dict__.pop(key, None)
        for c in self.calls:
            c.roles = None
        for n in names:
            p = self.params[n]
            if p.method == "rule":
                p.method, p.how, p.reason = "vmap" if self.vmap_randomness else "loop", "", reason
            elif p.method in ("vmap", "zero"):  # (a gradient the plan thought none reaches)
                p.method, p.how, p.reason = "loop", "", reason
        if names:
            self.one_draw()

    def to_loop(self, names: Sequence[str], reason: str) -> None:
        """Plans ``names`` for the loop, whatever they were planned for."""
        self.route([], "")  # (drops the lists made from the methods)
        for n in names:
            p = self.params[n]
            p.method, p.how, p.reason = "loop", "", reason
        if names:
            self.one_draw()

    def no_vmap(self, why: str) -> None:
        """Plans for the loop what was planned for vmap, which cannot batch the model
        (``why``: :func:`vmap_blockers`, '' for none); what a later check or call moves
        goes there too."""
        if not why:
            return
        self.vmap_randomness = None
        self.route([], "")  # (drops the lists made from the methods)
        for p in self.params.values():
            if p.method == "vmap":
                p.method = "loop"
                if self.strategy != "hooks":  # (which refuses it for its reason)
                    p.reason = f"{p.reason}; {why}" if p.reason else why

    def one_draw(self) -> None:
        """Under ``"auto"`` and ``"vmap"``, a model that draws from the global generator gets
        one method for all its parameters (NOTE [one draw per example])."""
        if not (self.random_global and self.strategy in ("auto", "vmap")):
            return
        live = [n for n, p in self.params.items() if p.method != "zero"]
        methods = {self.params[n].method for n in live}
        if len(methods) < 2:
            return
        if "loop" in methods or not self.vmap_randomness:
            self.to_loop([n for n in live if self.params[n].method != "loop"], ONE_DRAW)
        else:
            self.route([n for n in live if self.params[n].method == "rule"], ONE_DRAW)


# NOTE [plans of one batch size]
# The batch size is not part of a plan's key: a plan made at one size serves every other
# (a batch of one apart), as DP-SGD's Poisson sampling draws a new size at each step. A plan
# that refuses the model, or leaves every parameter to the fallback, for what the planning
# runs saw at their batch size (a module that mixes examples, a forward that fails on the
# whole batch, an output that does not hold the examples along one dimension) is kept under
# the key and that size only: a forward that branches on the batch size
# (``if x.shape[0] > 4: h = h - h.mean(0)``) is per-example at another size, where a plan of
# its own is made. A plan made at a size where the model is per-example is checked again at
# each new size (NOTE [checked at each batch size] in ``verify``).

# NOTE [one draw per example]
# Each method draws its own random numbers: the rules' pass one dropout mask for the whole
# batch, vmap one per example in its own run, the loop one per example in each of its runs.
# A model with dropout whose parameters were split between methods (a parameter no rule
# covers, or one with a gradient hook, which only the loop applies) got, for one example,
# each parameter's gradient under another mask: the gradient of no single draw (in a
# Linear -> Dropout -> scale -> Linear, the zero columns of one layer's gradient were not
# those of the other's). So under "auto" (and "vmap", whose hooked parameters take the
# loop) such a model gets one method for all of them: vmap where every parameter not on the
# loop can take it, else the loop; each example then runs once, under one draw, for every
# parameter. (A model that draws nothing, dropout with p=0 included, keeps its split.)
# "hooks" never splits a plan: what no rule covers, or a hooked parameter, it refuses. A
# call whose rules' pass leaves some rule parameters to the fallback (a layer's input changed
# in place after the layer used it) moves every rule parameter of a random model with them
# under "auto", and is refused under "hooks" (``run._one_draw_moved``).
ONE_DRAW = ("the model draws random numbers (dropout in training mode), and its other "
            "parameters need vmap or the per-example loop: every parameter is computed by "
            "one of them, so that an example's gradients are all of one draw")


_RECURRENT = (nn.RNN, nn.GRU, nn.LSTM)


def vmap_blockers(model: nn.Module) -> str:
    """The modules of ``model`` that torch.func.vmap is known not to batch, said in words
    ('' for none): an Embedding(Bag) with ``max_norm`` (``embedding_renorm_`` has no batching
    rule that takes a batched index) and torch's recurrent layers (their fused kernels write
    into an output of one example's shape). The fallback of such a model is the loop: vmap
    would fail on every call, after a first attempt on each."""
    found = []
    for path, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
            found.append(f"'{path}' ({type(m).__name__} with max_norm)")
        elif isinstance(m, _RECURRENT) and type(m).forward is _stock_forward(m):
            found.append(f"'{path}' ({type(m).__name__})")
    if not found:
        return ""
    return (f"vmap cannot batch {', '.join(found[:3])}{' and others' if len(found) > 3 else ''}"
            f", so the per-example loop computes it")


def _stock_forward(m: nn.Module) -> Any:
    return next(c.forward for c in _RECURRENT if isinstance(m, c))


def call_key(c: Call) -> Any:
    """What identifies a recorded rule call from one forward to the next."""
    return (id(c.module) if c.module is not None else c.path, c.rule.name,
            tuple(sorted(c.params)))


def forward(model: nn.Module, xs: tuple[Tensor, ...], aliases: dict[str, Tensor] | None) -> Any:
    """``model(*xs)``, with the selected parameters replaced by ``aliases`` if given (stand-ins
    that require grad, for parameters that do not)."""
    if aliases is None:
        return model(*xs)
    return functional_call(model, aliases, xs)


def functional_call(model: nn.Module, state: dict[str, Tensor], args: tuple[Any, ...],
                    then: Callable[[Any], Any] | None = None) -> Any:
    """``torch.func.functional_call(model, state, args, strict=False, tie_weights=True)``,
    after which every module holds its own tensors again; with ``then``, ``then(output)``,
    called while ``state`` is still in place.

    A module registered under two names (``self.b = self.a``) comes back from torch's call
    holding the substitutes (detached tensors) in place of its parameters and buffers, for
    good: torch puts the originals back under one name and then the substitutes under the
    other. Those modules' dicts are saved first and put back after.

    ``then`` is the loss: a loss function that reads a parameter through the model (an L2
    term on ``model.fc.weight``) must read the substitute, the tensor differentiated, as
    the model's forward does; called after torch's call it read the parameter itself, and
    vmap's gradients left that term out."""
    slots = Slots(_aliased_modules(model))
    try:
        if then is None or _reparametrize is None:
            out = torch.func.functional_call(model, state, args, strict=False,
                                             tie_weights=True)
            return out if then is None else then(out)
        with _reparametrize(model, state, tie_weights=True, strict=False):
            return then(model(*args))
    finally:
        slots.restore()


try:  # (what torch.func.functional_call runs the module under)
    from torch.nn.utils.stateless import _reparametrize_module as _reparametrize
except ImportError:  # pragma: no cover - another torch: the loss reads the parameters
    _reparametrize = None


class Slots:
    """What modules hold in their ``_parameters`` and ``_buffers`` dicts, to put back after a
    forward that assigns new tensors to them (``self.w = nn.Parameter(..)`` or
    ``self.steps = self.steps + 1`` in a forward) or registers new ones (a buffer made on
    the first call). The values of the tensors are :class:`Watched`'s concern."""

    __slots__ = ("saved", "changed")

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.saved = [(d, dict(d)) for m in modules for d in (m._parameters, m._buffers)]
        self.changed = False  # restore() ever found something to put back

    def restore(self) -> bool:
        """Puts back what changed; whether anything had."""
        changed = False
        for d, old in self.saved:
            if len(d) != len(old) or any(d.get(k, d) is not v for k, v in old.items()):
                changed = True
                d.clear()
                d.update(old)
        self.changed = self.changed or changed
        return changed


def _aliased_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` registered under more than one name."""
    count: dict[int, int] = {}
    found: list[nn.Module] = []
    for _, m in model.named_modules(remove_duplicate=False):
        k = count.get(id(m), 0)
        if k == 1:
            found.append(m)
        count[id(m)] = k + 1
    return found


def aliases_of(sel: Selection) -> dict[str, Tensor] | None:
    """Stand-ins that require grad for the selected tensors, where some do not."""
    if not sel.frozen:
        return None
    return {n: t.detach().requires_grad_(True) for n, t in sel.tensors.items()}


# NOTE [probes at a generic point]
# The data-flow tests (steps 2 and 3 of NOTE [the per-sample plan]) read which gradient
# entries are exactly zero, and the plan is then kept for the model structure, whatever
# values the parameters take later. At the parameters' current values a dependence can
# vanish: a cross-example term behind a gate initialised at zero (``h + gate *
# h.mean(0)``, ReZero, an adapter), a zero-initialised LoRA ``B`` or last layer, ``(1 - a)
# * mix`` with ``a == 1``; a plan made there trusted rules that an optimizer step then made
# wrong, silently. So the probed forward, its data-flow tests and the graph walk run at a
# point near the current one where no such accident holds (:class:`GenericPoint`): every
# floating entry ``p`` of a parameter that requires grad is ``p * (1 + u)`` there, and an
# entry that is exactly zero is ``u * s`` (``u`` uniform in [1/32, 1/16) from a fixed seed,
# so that plans do not depend on a random draw; ``s`` the mean magnitude of the tensor's
# entries, 1 for a tensor of zeros). Signs are kept and zeros become small positive
# numbers, so that a parameter that is a scale, a variance or a log's argument stays in
# its domain.
# The moved values are new tensors (``nn.Parameter`` leaves), put in the modules'
# ``_parameters`` dicts in place of the parameters for the probe (:class:`GenericPoint`,
# forward and loss alike: a loss that reads a parameter, an L2 term, reads the moved one
# too) and the parameters put back after it: the user's storage is never written, so
# parameters that share storage (``nn.Parameter(other.data)``, views of one flat buffer)
# and an expanded parameter are safe, and nothing outlives the probe. (While the probe
# runs, the module attributes hold the copies, as under ``torch.func.functional_call``:
# the forward itself, and another thread reading those attributes then, see moved
# values.) Only parameters that require grad move: a frozen one does not move under an
# optimizer (and a change of ``requires_grad`` makes a new plan), so a frozen zero that
# switches a cross-example term off keeps it off, as the model computes. Selected frozen
# parameters get stand-ins at their own values (as ``aliases_of`` gives). Buffers stay as
# they are (running statistics, masks, schedules). The shape runs of step 1, which also
# find what a forward changes in place, run at the parameters' own values; a model that
# raises anything (forward, loss, backward of the data-flow test) at the generic point, or
# gives a non-finite output there where it does not at its own values, is probed at its
# own values. This costs one copy of the parameters that require grad while a plan is
# made and nothing per call (a key holding which parameters are zero would cost a pass
# over them on every call).
#
# What this covers: a dependence that vanishes because a parameter that requires grad
# sits at an exact value (zero, one, a cancellation) where a small relative move revives
# it. What it does not: a gate that stays exactly zero in a whole neighbourhood of the
# current values (``relu(g)`` or ``g.clamp(0, 1)`` with ``g < 0``, a hard threshold, a
# coefficient kept in a buffer or a frozen parameter that a schedule changes later). A
# plan made there is kept after the gate opens, and the check of the first call under a
# plan does not run again, so the rules' results are then wrong, silently: pass
# ``strategy='vmap'`` or ``'loop'`` for such a model (docs/pages/per-sample.md).
_GENERIC_SEED = 0x9E3779B9


class GenericPoint:
    """The generic point of NOTE [probes at a generic point]: moved copies of the
    parameters that require grad, and stand-ins for the selected ones that do not, which
    :meth:`swap` puts in the modules' ``_parameters`` dicts and :meth:`unswap` takes out
    again. Nothing of the model is written but those dicts."""

    __slots__ = ("places", "tracked")

    def __init__(self, model: nn.Module, sel: Selection) -> None:
        new: dict[int, Tensor] = {}
        frozen_sel = {id(t) for t in sel.tensors.values() if not t.requires_grad}
        gens: dict[torch.device, torch.Generator] = {}
        with torch.no_grad():
            for p in model.parameters():
                if id(p) in frozen_sel:
                    new[id(p)] = nn.Parameter(p.detach(), requires_grad=True)
                    continue
                if not p.requires_grad or not (p.is_floating_point() or p.is_complex()) or (
                        p.is_meta or p.layout != torch.strided or p.numel() == 0 or
                        type(p.data) is not Tensor):  # (a DTensor's shards, say)
                    continue
                real = p.real if p.is_complex() else p
                gen = gens.get(p.device)
                if gen is None:
                    try:
                        gen = torch.Generator(device=p.device)
                    except RuntimeError:  # a device without generators: the CPU's
                        gen = torch.Generator()
                    gens[p.device] = gen.manual_seed(_GENERIC_SEED)
                u = torch.rand(p.shape, generator=gen, device=gen.device,
                               dtype=real.dtype).to(p.device).add_(1).div_(32)
                scale = p.abs().mean().to(real.dtype)
                scale = torch.where(scale > 0, scale, torch.ones_like(scale))
                moved = torch.where(p == 0, u * scale, p * (1 + u))
                new[id(p)] = nn.Parameter(moved, requires_grad=True)
        #: (the dict, the key, the parameter, its copy) for every place a parameter is held
        self.places = [(d, k, p, new[id(p)]) for m in model.modules()
                       for d in (m._parameters,) for k, p in d.items()
                       if p is not None and id(p) in new]
        #: ``id`` of the copy of each selected tensor -> its canonical name
        self.tracked = {id(new[id(t)]): n for n, t in sel.tensors.items() if id(t) in new}

    def __bool__(self) -> bool:
        return bool(self.places)

    def swap(self) -> None:
        for d, k, _, copy in self.places:
            d[k] = copy

    def unswap(self) -> None:
        for d, k, p, _ in self.places:
            d[k] = p


def seeded_forward(
    model: nn.Module, xs: Sequence[Tensor], aliases: dict[str, Tensor] | None = None
) -> Any:
    devices = sorted({x.device.index or 0 for x in xs
                      if x is not None and x.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(_SEED)
        return forward(model, tuple(xs), aliases)


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


# NOTE [parametrize.cached()]
# Inside ``torch.nn.utils.parametrize.cached()`` a parametrized tensor (weight_norm's
# weight, say) is computed once and the same tensor is returned at every later read,
# graph and all. A per-sample call runs the model many times (the plan's probes, the rules'
# pass, vmap over stand-ins of the parameters, one forward and backward per example): with
# the cache on, every run after the first would read the weight the first run computed,
# from the caller's own parameters, so vmap's stand-ins receive no gradient (zeros,
# silently) and the loop's second backward meets a freed graph. Each public function
# therefore runs with the cache off, as a plain forward computes: the caller's cache is
# set aside for the call and put back after it, on an error too, so the caller's block
# goes on as it was. The counter is changed relatively, as ``cached()`` changes it (minus
# its value on entry, plus that on exit), so that another thread entering or leaving a
# ``cached()`` block meanwhile keeps its change; the caller's dict is put back only where
# the call's own empty one is still in place and the counter is not back at zero (where
# it is, the dict is emptied, as ``cached()`` does on leaving its last block). torch's
# cache is one for the process, not per thread: while another thread's block is open
# (or after it closes during the call, the counter then below zero), reads in the call
# are cached too; per-sample calls and ``cached()`` blocks in concurrent threads do not
# mix. A forward that enters ``cached()`` itself caches within that forward, as it would
# alone. (A module attribute read per call when the cache is off, as it is almost always.)


class _CacheSetAside:
    __slots__ = ("count", "saved", "ours")

    def __enter__(self) -> None:
        self.count = n = parametrize._cache_enabled
        self.saved = parametrize._cache
        parametrize._cache_enabled -= n
        self.ours = parametrize._cache = {}

    def __exit__(self, *exc: object) -> None:
        parametrize._cache_enabled += self.count
        if not parametrize._cache_enabled:
            parametrize._cache = {}
        elif parametrize._cache is self.ours:
            parametrize._cache = self.saved


def parametrize_cache_off(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: ``fn`` runs with torch's parametrization cache off (NOTE
    [parametrize.cached()])."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not parametrize._cache_enabled:
            return fn(*args, **kwargs)
        with _CacheSetAside():
            return fn(*args, **kwargs)

    return run
