"""Arguments of the per-sample functions: their checks, and the selection of parameters.

Every check raises a :class:`~torch_vjp.PerSampleError` subclass (``PerSampleValueError``,
``PerSampleTypeError``) naming the call, what it got, and what it must be.
"""

from __future__ import annotations

import functools
import numbers
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from torch_vjp._engine.context import flag_of
from torch_vjp._engine.fwdcheck import route_key
from torch_vjp._errors import PerSampleError, PerSampleTypeError, PerSampleValueError, shape_str

__all__ = [
    "check_model",
    "structure_of",
    "function_flags",
    "check_trainable",
    "as_inputs",
    "check_targets",
    "check_max_norm",
    "check_static_mixing",
    "Selection",
    "select",
    "access",
    "Job",
]


def check_model(fn: str, model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise PerSampleTypeError(
            f"torch_vjp.{fn}: model must be a torch.nn.Module, got {type(model).__name__}.\n"
            f"  Per-sample gradients are taken with respect to the module's parameters; wrap a "
            f"function in an nn.Module that owns its parameters."
        )
    if isinstance(model, torch.jit.ScriptModule):
        raise PerSampleTypeError(
            f"torch_vjp.{fn}: model is a TorchScript module ({type(model).__name__}), but "
            f"per-sample gradients need the Python module: its layers' forward hooks (strategy "
            f"'hooks'), torch.func.functional_call (strategy 'vmap') and per-example calls "
            f"all run the Python modules. Fix: pass the module before torch.jit.script (or "
            f"torch.jit.trace), and script it for inference only."
        )


def as_inputs(fn: str, inputs: Any) -> tuple[tuple[Tensor, ...], int]:
    """Normalises ``inputs`` to a tuple of tensors and returns the batch size."""
    xs = (inputs,) if isinstance(inputs, Tensor) else inputs
    if not isinstance(xs, (tuple, list)) or len(xs) == 0:
        raise PerSampleTypeError(
            f"torch_vjp.{fn}: inputs must be a tensor or a tuple of tensors, got "
            f"{type(inputs).__name__}.\n"
            f"  Each tensor holds the batch along its first dimension and is passed as "
            f"model(*inputs)."
        )
    for k, x in enumerate(xs):
        if not isinstance(x, Tensor):
            raise PerSampleTypeError(
                f"torch_vjp.{fn}: inputs[{k}] is a {type(x).__name__}, not a tensor.\n"
                f"  inputs must be a tensor or a tuple of tensors, each with the batch along "
                f"its first dimension; bind other arguments of the model in the module."
            )
        if x.dim() == 0:
            raise PerSampleValueError(
                f"torch_vjp.{fn}: inputs[{k}] is a 0-dimensional tensor, so it has no batch "
                f"dimension.\n  Per-sample gradients split every input along its first "
                f"dimension, one example per row."
            )
    B = xs[0].shape[0]
    for k, x in enumerate(xs[1:], 1):
        if x.shape[0] != B:
            raise PerSampleValueError(
                f"torch_vjp.{fn}: inputs[{k}] has shape {shape_str(x.shape)}, but inputs[0] has "
                f"shape {shape_str(xs[0].shape)}: their first dimensions (the batch) differ, "
                f"{x.shape[0]} vs {B}.\n  Every input must hold the same examples along its "
                f"first dimension."
            )
    return tuple(xs), B


def check_targets(fn: str, targets: Any, B: int) -> None:
    if targets is None:
        return
    leaves = (targets,) if isinstance(targets, Tensor) else tree_flatten(targets)[0]
    for leaf in leaves:
        if isinstance(leaf, Tensor) and (leaf.dim() == 0 or leaf.shape[0] != B):
            raise PerSampleValueError(
                f"torch_vjp.{fn}: targets has shape {shape_str(leaf.shape)}, but the batch has "
                f"{B} examples (inputs[0] has {B} rows).\n  targets[i] must belong to "
                f"inputs[i]: the first dimension of targets must be {B}."
            )


def check_max_norm(fn: str, max_norm: Any) -> float:
    if isinstance(max_norm, Tensor) and max_norm.numel() == 1:
        max_norm = max_norm.item()
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise PerSampleTypeError(
            f"torch_vjp.{fn}: max_norm must be a positive number, got "
            f"{type(max_norm).__name__}."
        )
    if not (max_norm > 0) or max_norm == float("inf"):
        raise PerSampleValueError(
            f"torch_vjp.{fn}: max_norm must be a positive finite number, got {max_norm}.\n"
            f"  Each example's gradient is scaled to L2 norm at most max_norm."
        )
    return float(max_norm)


_BN_FIX = (
    "  Fix: put it in eval mode so that it uses its running statistics (model.eval(), or "
    "{access}.eval() for this module alone), or replace it with nn.GroupNorm(num_groups, {c}), "
    "which normalises each example on its own."
)


def access(path: str) -> str:
    if not path:
        return "model"
    out = "model"
    for part in path.split("."):
        out += f"[{part}]" if part.isdigit() else f".{part}"
    return out


def check_static_mixing(fn: str, model: nn.Module) -> None:
    """Raises PerSampleError for layers whose output for one example depends on the others."""
    for path, m in model.named_modules():
        where = f"module '{path}'" if path else "the model itself"
        kind = type(m).__name__
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            c = getattr(m, "num_features", "C")
            if m.training:
                raise PerSampleError(
                    f"torch_vjp.{fn}: {where} ({kind}) is in training mode, where it normalises "
                    f"each example with the mean and variance of the whole batch, so one "
                    f"example's gradient depends on every other example and per-sample "
                    f"gradients are not defined.\n" + _BN_FIX.format(access=access(path), c=c)
                )
            if m.running_mean is None or m.running_var is None:
                raise PerSampleError(
                    f"torch_vjp.{fn}: {where} ({kind}) has no running statistics "
                    f"(track_running_stats=False), so it normalises each example with the "
                    f"statistics of the whole batch even in eval mode, and per-sample "
                    f"gradients are not defined.\n  Fix: replace it with "
                    f"nn.GroupNorm(num_groups, {c}), which normalises each example on its own, "
                    f"or build it with track_running_stats=True and use it in eval mode."
                )



@dataclass
class Selection:
    names: list[str]  # output keys, in order
    key_of: dict[str, str]  # output name -> canonical name of its tensor
    tensors: dict[str, Tensor]  # canonical name -> parameter
    owners: set[str]  # paths of modules that own a selected tensor (under any alias)
    frozen: bool  # some selected tensor does not require grad
    #: every module's training flag when the selection was made (set by the caller)
    training: tuple[bool, ...] = ()
    #: ``id`` of the selected weights of Embedding(Bag) layers with ``sparse=True`` (read
    #: from ``tables`` on every call: the flag is a plain attribute a user may switch)
    sparse: frozenset[int] = frozenset()
    #: the Embedding(Bag) layers whose weight is selected
    tables: tuple[nn.Module, ...] = ()

    @property
    def canonical(self) -> list[str]:
        return list(self.tensors)

    @property
    def tracked(self) -> dict[int, str]:
        """``id(tensor)`` of every selected tensor -> its canonical name (made once)."""
        found = self.__dict__.get("_tracked")
        if found is None:
            found = self.__dict__["_tracked"] = {id(t): n for n, t in self.tensors.items()}
        return found


def select(fn: str, model: nn.Module, params: Any) -> Selection:
    all_named = list(model.named_parameters(remove_duplicate=False))
    lazy = [n for n, p in all_named if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise PerSampleValueError(
            f"torch_vjp.{fn}: the model has parameters that a lazy module has not created yet "
            f"({', '.join(repr(n) for n in lazy[:4])}{', ...' if len(lazy) > 4 else ''}): "
            f"they take their shapes from the first forward pass, and the per-sample "
            f"functions need the parameters before they run the model (to select them and "
            f"to keep the model as it was).\n  Fix: run the model once first, "
            f"model(inputs) under torch.no_grad() (in eval mode if it has batch norm), as "
            f"torch's own docs advise before an optimizer is made."
        )
    by_name = dict(all_named)
    if params is None:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        if not names:
            raise PerSampleValueError(
                f"torch_vjp.{fn}: the model has no parameter that requires grad, so there is "
                f"nothing to differentiate.\n  Pass params=[...] with the names of the "
                f"parameters you want (see model.named_parameters())."
            )
    else:
        if isinstance(params, str):
            params = [params]
        try:
            names = list(params)
        except TypeError:
            raise PerSampleTypeError(
                f"torch_vjp.{fn}: params must be None or a list of parameter names, got "
                f"{type(params).__name__}."
            ) from None
        for n in names:
            if not isinstance(n, str):
                raise PerSampleTypeError(
                    f"torch_vjp.{fn}: params must hold parameter names (str), got a "
                    f"{type(n).__name__}.\n  Use the names of model.named_parameters(), e.g. "
                    f"params=[name for name, _ in model.named_parameters()]."
                )
            if n not in by_name:
                known = ", ".join(repr(k) for k in list(by_name)[:8])
                more = ", ..." if len(by_name) > 8 else ""
                raise PerSampleValueError(
                    f"torch_vjp.{fn}: params names {n!r}, which is not a parameter of the model.\n"
                    f"  Its parameters are: {known}{more}."
                )
        if not names:
            raise PerSampleValueError(f"torch_vjp.{fn}: params is empty; name at least one parameter.")
        names = list(dict.fromkeys(names))
    canon_of_id: dict[int, str] = {}
    for n, p in all_named:
        canon_of_id.setdefault(id(p), n)
    key_of = {n: canon_of_id[id(by_name[n])] for n in names}
    tensors = {}
    for n in names:
        c = key_of[n]
        tensors.setdefault(c, by_name[c])
    ids = {id(t) for t in tensors.values()}
    owners = {n.rpartition(".")[0] for n, p in all_named if id(p) in ids}
    frozen = any(not t.requires_grad for t in tensors.values())
    return Selection(names, key_of, tensors, owners, frozen)


@dataclass
class Job:
    """One call of a public per-sample function, its arguments checked: what every step of
    the computation (planning, the rules' pass, the fallbacks, the check) works on.

    Attributes:
        fn: the public function's name, for messages.
        model, loss_fn: as given.
        xs: the inputs as a tuple of tensors, the examples along dimension 0.
        targets: as given (None, or a pytree of tensors with the examples along dimension 0).
        sel: the selected parameters.
        batch: the number of examples B.
        strategy: the strategy asked for.
        reset: puts back the buffers a forward changes (None where none does); the
            per-example runs call it before each example.
        ddp: the DistributedDataParallel wrapper the caller passed (``model`` is then its
            module), or None (NOTE [DDP] in ``distributed``).
        structure: :func:`structure_of` the model.
        by_backward: the per-example loop differentiates with ``backward()`` (a reentrant
            checkpoint refused ``autograd.grad``: NOTE [reentrant checkpoints] in
            ``fallback``).
    """

    fn: str
    model: nn.Module
    loss_fn: Callable[..., Any]
    xs: tuple[Tensor, ...]
    targets: Any
    sel: Selection
    batch: int
    strategy: str
    reset: Callable[[], None] | None = None
    ddp: Any = None
    structure: Any = None
    by_backward: bool = False


# NOTE [the structure a plan is for]
# A plan (which layers have rules, in which dimension each finds the examples, which
# modules mix examples, which parameters the loss reaches) was made by running the model
# and the loss. It stays valid while they run the same code on the same modules: so its key
# holds, per module, the module itself (its identity and type: a submodule replaced), its
# training flag, its forward hooks and pre-hooks (a hook added that reorders or mixes the
# batch), its backward hooks and backward pre-hooks (``register_full_backward_hook``: a
# hook that rescales or mixes the gradients the layers below receive, which the rules read),
# and, for modules defined outside torch, the flags of their attributes and of the
# globals their forward reads (``self.center = True``, ``USE_GATE``); the global module
# hooks, forward and backward alike; and the flags of the loss function's closure and the globals it reads (an L2 term
# switched on after warm-up; a callable loss object's attributes, a bound method's
# object's). A flag is a bool, str or None value itself, or a number's truth (zero or not:
# ``if l2:``, a coefficient switched on, ``for _ in range(self.reps)``); flags are read one
# level into a dict or plain object (``cfg.extra``, ``CONF["l2"]``, ``self.opts["extra"]``;
# ``nested_flags``), the entries the code names only (a model config of a hundred entries
# costs the few its methods read). A module's numeric attribute that the planning forwards moved (a
# counter a forward increments, which a loop may reset) is left out from then on
# (``note_counters``), else it would make plan after plan. Branches on other values (a
# batch's contents, a threshold compared with a number, a flag two levels deep) are not
# seen.
_OWN_TYPE: dict[type, bool] = {}
_READS: dict[Any, tuple[str, ...]] = {}


#: The most entries of a dict (or attributes of an object) read one level deep for flags.
_MAX_NESTED = 256
#: Types never read one level deep: what holds no flag of the user's, or holds too much.
_NOT_NESTED = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
               types.MethodType, functools.partial, nn.Module, Tensor)
_NESTED: dict[type, int] = {}  # per type: 0 not read, 1 a dict, 2 an object's attributes
_CODE_READS: dict[Any, frozenset[str]] = {}  # per code object: ``_names_read``
_TYPE_READS: dict[type, frozenset[str]] = {}  # per module type: ``_type_reads``
#: Per set of names read (by id; the set is held, so that its id is not reused): the names
#: sorted, so that a call looks up those names alone in an object read one level deep (a
#: model config of a hundred entries of which the forward reads two).
_KEYS: dict[int, tuple[frozenset[str], tuple[str, ...]]] = {}


def _names_read(code: types.CodeType) -> frozenset[str]:
    """The names a code object reads and the strings it holds (``cfg.extra``,
    ``CONF["extra"]``), with those of the functions, lambdas and comprehensions defined in
    it (a ``lambda: cfg.extra`` inside a forward)."""
    found = _CODE_READS.get(code)
    if found is None:
        names = set(code.co_names)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                names |= _names_read(c)
            elif isinstance(c, str):
                names.add(c)
        found = _CODE_READS[code] = frozenset(names)
    return found


def _type_reads(kind: type) -> frozenset[str]:
    """What the methods of a module type of the user's read (``_names_read`` of each
    function its classes define, but ``__init__``): the entries a forward, or a method it
    calls, may branch on one level into an attribute (``self.opts["extra"]``)."""
    found = _TYPE_READS.get(kind)
    if found is None:
        names: set[str] = set()
        for cls in kind.__mro__:
            if cls.__module__.startswith("torch.") or cls is object:
                continue
            for k, f in vars(cls).items():
                f = getattr(f, "__func__", getattr(f, "fget", f))
                code = getattr(f, "__code__", None)
                if k != "__init__" and isinstance(code, types.CodeType):
                    names |= _names_read(code)
        found = _TYPE_READS[kind] = frozenset(names)
    return found


def nested_flags(v: object, reads: frozenset[str], numbers: bool = True) -> object:
    """A value's flag (``flag_of``), or, for a dict or a plain object (a config namespace, a
    dataclass), the flags of those of its entries or attributes whose names are in
    ``reads`` (what the code reads), one level deep: ``cfg.extra``, ``CONF["l2"]``,
    ``self.opts["extra"]``; NotImplemented for anything else."""
    f = flag_of(v, numbers)
    if f is not NotImplemented:
        return f
    return _inside(v, reads, numbers)


def _inside(v: object, reads: frozenset[str], numbers: bool) -> object:
    """:func:`nested_flags` of a value that is not a flag itself."""
    kind = type(v)
    how = _NESTED.get(kind)
    if how is None:
        how = _NESTED[kind] = (1 if kind is dict else
                               0 if issubclass(kind, _NOT_NESTED) else 2)
    if how == 0:
        return NotImplemented
    items = v if how == 1 else getattr(v, "__dict__", None)
    if items is None or len(items) > _MAX_NESTED:  # type: ignore[arg-type]
        return NotImplemented
    # (the names read that the object holds now, looked up each call: a cache by the
    # object's size missed an entry deleted and another added, and reused a stale plan)
    out = []
    for k in _sorted_reads(reads):
        if k in items:  # type: ignore[operator]
            f = flag_of(items.get(k), numbers)  # type: ignore[union-attr]
            if f is not NotImplemented:
                out.append((k, f))
    return ("nested", tuple(out))


def _sorted_reads(reads: frozenset[str]) -> tuple[str, ...]:
    """``reads`` in a fixed order (the key must not depend on a set's iteration order)."""
    hit = _KEYS.get(id(reads))
    if hit is None or hit[0] is not reads:
        if len(_KEYS) >= 4096:
            _KEYS.clear()
        hit = _KEYS[id(reads)] = (reads, tuple(sorted(reads)))
    return hit[1]


def function_flags(fn: Any) -> tuple[Any, ...]:
    """The flags of what a Python function reads: its closure cells and the globals its code
    (or a function, lambda or comprehension defined in it) names, and the entries and
    attributes one level into those that the code names (``cfg.l2``, ``CONF["l2"]``); for a
    bound method, also those of its object (``self.l2``). A method's function for a bound
    method."""
    owner = getattr(fn, "__self__", None)
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return ()
    names = _READS.get(code)
    glob = getattr(fn, "__globals__", {})
    reads = _names_read(code)
    if names is None:
        names = _READS[code] = tuple(sorted(n for n in reads if n in glob))
    out = []
    for n in names:
        f = nested_flags(glob.get(n), reads)
        if f is not NotImplemented:
            out.append((n, f))
    for i, cell in enumerate(fn.__closure__ or ()):
        try:
            f = nested_flags(cell.cell_contents, reads)
        except ValueError:  # an empty cell
            continue
        if f is not NotImplemented:
            out.append((i, f))
    if owner is not None and not isinstance(owner, (types.ModuleType, type)):
        out.append(("self", object_flags(owner, reads)))
    return tuple(out)


def object_flags(obj: object, reads: frozenset[str] = frozenset()) -> tuple[Any, ...]:
    """The flags of an object's own attributes, numbers by their truth, and one level into
    those that are dicts or plain objects (``nested_flags``: the entries named in ``reads``,
    what the code that uses the object reads). (An ``nn.Module``'s private containers,
    ``_parameters`` and the like, are left out.)"""
    module = isinstance(obj, nn.Module)
    out = []
    for k, v in getattr(obj, "__dict__", {}).items():
        if (module and k[:1] == "_") or (reads and k not in reads):
            # (with ``reads``, only what the code names: a trainer's status string that
            # changes every step is no flag of its loss, and must not make a plan per call)
            continue
        f = nested_flags(v, reads)
        if f is not NotImplemented:
            out.append((k, f))
    return tuple(out)


#: Per module type of the user's: the numeric attributes a forward changes (counters), left
#: out of the structure (found by ``note_counters`` while a plan is made).
_COUNTERS: dict[type, frozenset[str]] = {}
_NUMBERS = (int, float)
#: What every nn.Module holds (its containers of parameters, buffers, submodules and hooks,
#: and its training flag, which the structure holds apart): never a flag of the user's.
#: Learned from a Module built on first use (:func:`_torch_attrs`), not at import: building one
#: logs torch's ``python.nn_module`` API usage, and ``TORCH_VJP_CHECKED=1`` imports this package
#: in every process that imports torch.
_TORCH_ATTRS: frozenset[str] | None = None


def _torch_attrs() -> frozenset[str]:
    global _TORCH_ATTRS
    if _TORCH_ATTRS is None:
        _TORCH_ATTRS = frozenset(nn.Module().__dict__) - {"_is_full_backward_hook"}
    return _TORCH_ATTRS


def numbers_of(model: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    """The numeric attributes of the model's modules of the user's, for ``note_counters``."""
    return [(m, {k: v for k, v in m.__dict__.items() if type(v) in _NUMBERS})
            for m in model.modules() if _OWN_TYPE.get(type(m))]


def note_counters(before: list[tuple[nn.Module, dict[str, Any]]]) -> bool:
    """Records the numeric attributes that changed since ``before`` (the forwards that made a
    plan moved them: counters, a step number) as counters of their module's type, which the
    structure then leaves out; whether any was new."""
    new = False
    torch_attrs = _torch_attrs()
    for m, values in before:
        moved = {k for k, v in values.items() if m.__dict__.get(k, None) is not v
                 and m.__dict__.get(k, None) != v}
        known = _COUNTERS.get(type(m), torch_attrs)
        if moved - known:
            _COUNTERS[type(m)] = known | moved  # (with torch's attributes: what is skipped)
            new = True
    return new


def structure_of(model: nn.Module) -> tuple[Any, ...]:
    """The model's structure as NOTE [the structure a plan is for] says, and its modules'
    training flags."""
    entries, training, memo = [], [], {}  # (memo: a hook on many modules is keyed once)
    torch_attrs = _TORCH_ATTRS or _torch_attrs()
    for m in model.modules():
        kind = type(m)
        own = _OWN_TYPE.get(kind)
        if own is None:
            own = _OWN_TYPE[kind] = not kind.__module__.startswith("torch.")
        fh, ph = m._forward_hooks, m._forward_pre_hooks
        bh, bph = m._backward_hooks, m._backward_pre_hooks
        entry: tuple[Any, ...] = (id(m), kind, _hooks_key(fh, memo) if fh else (),
                                  _hooks_key(ph, memo) if ph else ())
        if bh or bph:  # (rare: kept out of the entry of every module without them)
            entry += (("backward", _hooks_key(bh, memo) if bh else (),
                       _hooks_key(bph, memo) if bph else ()),)
        if own:
            skip = _COUNTERS.get(kind) or torch_attrs
            reads = _TYPE_READS.get(kind) or _type_reads(kind)
            flags = []
            for k, v in m.__dict__.items():
                if k in skip:
                    continue
                # (a private attribute's own flag, not what it holds)
                f = flag_of(v) if k[:1] == "_" else nested_flags(v, reads)
                if f is not NotImplemented:
                    flags.append((k, f))
            entry += (*flags, *function_flags(kind.forward))
        entries.append(entry)
        training.append(m.training)
    glob = torch.nn.modules.module
    return (tuple(training), tuple(entries),
            *(_hooks_key(h, memo) if h else () for h in (
                glob._global_forward_hooks, glob._global_forward_pre_hooks,
                glob._global_backward_hooks, glob._global_backward_pre_hooks)))


def _hooks_key(hooks: dict[int, Any], memo: dict[int, Any]) -> tuple[Any, ...]:
    """Hooks by what they run, not by their handles: a hook registered and removed around
    every step is the same hook each time, and must not make a plan per call (a tool's
    global hooks, a ModuleTracker, are too). A function, a bound method or a
    ``functools.partial`` counts by its code and what it holds (``route_key``: a
    ``partial(scale, k=2.0)`` swapped for a ``partial(center)`` that mixes examples, or a
    hook factory's closure over another flag, is another hook); see :func:`_hook_key`
    (``memo``: the keys found in this look at the model, by the hook's ``id``)."""
    return tuple([memo.get(id(h)) or memo.setdefault(id(h), _hook_key(h))
                  for h in hooks.values()])


def _hook_key(h: Any) -> Any:
    """One hook's part of :func:`_hooks_key`: a function or ``functools.partial`` by
    ``route_key``; a bound method by its function, its object's type and the object's
    bool/str/None attributes and the truth of its numbers; another callable object by its
    type and those attributes (a hook object made afresh each step keeps the plan; one
    whose ``mix`` flag turned on makes another)."""
    if isinstance(h, (types.FunctionType, functools.partial)):
        return route_key(h)
    if isinstance(h, types.MethodType):
        return ("method", route_key(h.__func__), type(h.__self__), _object_flags(h.__self__))
    return (type(h), _object_flags(h))


def _object_flags(obj: object) -> tuple[Any, ...]:
    """The flags of a hook object's attributes (its ``__dict__`` and ``__slots__``): bools,
    strings and None by value, numbers (numpy's too, and a one-element tensor on the CPU)
    by their truth, as route_key reads a closure's: a mixing weight of 0.0 made 0.5 is
    another hook."""
    items = list(getattr(obj, "__dict__", {}).items())
    for cls in type(obj).__mro__:
        slots = getattr(cls, "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                items.append((name, getattr(obj, name)))
    out = []
    for k, v in items:
        f = flag_of(v)
        if f is NotImplemented:
            if isinstance(v, numbers.Number):
                f = bool(v)
            elif (isinstance(v, Tensor) and v.numel() == 1 and v.device.type == "cpu"
                  and not v.requires_grad):
                f = ("tensor", bool(v))
            else:
                continue
        out.append((k, f))
    return tuple(out)


def check_trainable(fn: str, model: nn.Module, params: Any) -> None:
    """Refuses a selected parameter that does not require grad where ``.grad`` is written."""
    if params is None:
        return
    named = dict(model.named_parameters(remove_duplicate=False))
    names = [params] if isinstance(params, str) else params
    try:
        names = list(names)
    except TypeError:
        return  # select() reports it
    for n in names:
        t = named.get(n) if isinstance(n, str) else None
        if t is not None and not t.requires_grad:
            raise PerSampleValueError(
                f"torch_vjp.{fn}: params names {n!r}, which does not require grad. This call "
                f"adds the clipped gradients to .grad, as backward does, and backward never "
                f"gives a tensor that does not require grad a .grad (an optimizer would then "
                f"move a frozen parameter).\n  Fix: leave {n!r} out of params, or set its "
                f"requires_grad to True if it is meant to train; per_sample_grad_norms and "
                f"per_sample_grads accept it."
            )
