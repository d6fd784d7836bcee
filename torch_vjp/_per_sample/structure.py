"""The structure a per-sample plan is for (NOTE [the structure a plan is for]): what a model
and its loss function run, by module, hook and flag, so that a cached plan is used only
where they run the same code on the same modules."""

from __future__ import annotations

import functools
import numbers
import types
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from torch_vjp._engine.context import flag_of, identity
from torch_vjp._engine.fwdcheck import route_key
from torch_vjp._per_sample.registry import replaced_forward

__all__ = ["structure_of", "loss_key", "loss_tensors", "function_flags", "object_flags",
           "nested_flags", "numbers_of", "note_counters", "restore_numbers"]

# NOTE [the structure a plan is for]
# A plan (which layers have rules, in which dimension each finds the examples, which
# modules mix examples, which parameters the loss reaches) was made by running the model
# and the loss. It stays valid while they run the same code on the same modules: so its key
# holds, per module, the module itself (its identity and type: a submodule replaced), its
# training flag, its forward hooks and pre-hooks (a hook added that reorders or mixes the
# batch), its backward hooks and backward pre-hooks (``register_full_backward_hook``: a
# hook that rescales or mixes the gradients the layers below receive, which the rules read),
# and, for modules defined outside torch, the flags of their attributes and of the
# globals their forward reads (``self.center = True``, ``USE_GATE``), and for torch's own
# modules the flags of their public settings (a Dropout's ``p`` raised from 0, where it
# draws nothing, a Softmax's ``dim``); the global module
# hooks, forward and backward alike; and the flags of the loss function's closure and the globals it reads (an L2 term
# switched on after warm-up; a callable loss object's attributes, a bound method's
# object's). A flag is a bool, str or None value itself, or a number's truth (zero or not:
# ``if l2:``, a coefficient switched on, ``for _ in range(self.reps)``); flags are read into
# dicts and plain objects, ``_MAX_DEPTH`` levels deep (``cfg.extra``, ``CONF["l2"]``,
# ``self.opts["extra"]``, ``cfg.sub.extra``; ``nested_flags``), the entries the code names
# only (a model config of a hundred entries costs the few its methods read), and on torch's
# modules, the attributes a user's module class reads (``self.blocks.extra`` on an
# nn.ModuleList, which its forward branches on); and which of its parameters are frozen,
# selected or not (the plan's probes move the others alone: NOTE [probes at a generic point]
# in ``plan``). A module's numeric attribute that the planning forwards moved (a
# counter a forward increments, which a loop may reset) is left out from then on
# (``note_counters``), else it would make plan after plan. Branches on other values (a
# batch's contents, a threshold compared with a number, a flag deeper than that) are not
# seen.
_OWN_TYPE: dict[type, bool] = {}
_READS: dict[Any, tuple[str, ...]] = {}


#: The most entries of a dict (or attributes of an object) read for flags.
_MAX_NESTED = 256
#: How many levels of dicts and plain objects are read into for flags (``cfg.sub.mix``,
#: ``self.opts["inner"]["mix"]``): each level by the names the code reads alone.
_MAX_DEPTH = 4
#: Types never read one level deep: what holds no flag of the user's, or holds too much.
_NOT_NESTED = (type, types.FunctionType, types.BuiltinFunctionType,
               types.MethodType, functools.partial, nn.Module, Tensor)
_NESTED: dict[type, int] = {}  # per type: 0 not read, 1 a dict, 2 an object's, 3 a module's
#: or a class's (read by the names the code reads); those of other modules than these
_NOT_USERS = frozenset({"torch", "builtins"})
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
    ``reads`` (what the code reads), and so on into those that are dicts or plain objects
    themselves, ``_MAX_DEPTH`` levels deep: ``cfg.extra``, ``CONF["l2"]``,
    ``self.opts["extra"]``, ``cfg.sub.mix``; NotImplemented for anything else."""
    f = flag_of(v, numbers)
    if f is not NotImplemented:
        return f
    return _inside(v, reads, numbers, _MAX_DEPTH)


def _inside(v: object, reads: frozenset[str], numbers: bool, depth: int) -> object:
    """:func:`nested_flags` of a value that is not a flag itself, ``depth`` levels deep."""
    kind = type(v)
    how = _NESTED.get(kind)
    if how is None:
        how = _NESTED[kind] = (1 if kind is dict else 3 if issubclass(kind, types.ModuleType)
                               else 3 if issubclass(kind, type)
                               else 0 if issubclass(kind, _NOT_NESTED) else 2)
    if how == 0 or (how == 3 and not _users(v)):
        return NotImplemented
    items = v if how == 1 else getattr(v, "__dict__", None)
    # (a config module of the user's, mycfg.MIX, or a class, Config.MIX, at any size: only
    # the names read are looked up; torch's own and the builtins hold no flag of the user's)
    if items is None or (how != 3 and len(items) > _MAX_NESTED):  # type: ignore[arg-type]
        return NotImplemented
    # (the names read that the object holds now, looked up each call: a cache by the
    # object's size missed an entry deleted and another added, and reused a stale plan)
    out = []
    for k in _sorted_reads(reads):
        if k in items:  # type: ignore[operator]
            x = items.get(k)  # type: ignore[union-attr]
            f = flag_of(x, numbers)
            if f is NotImplemented and depth > 1:
                f = _inside(x, reads, numbers, depth - 1)
            if f is not NotImplemented:
                out.append((k, f))
    return ("nested", tuple(out))


def _users(v: object) -> bool:
    """Whether a module or a class is the user's: not torch's, not a builtin."""
    name = getattr(v, "__module__" if isinstance(v, type) else "__name__", None)
    return isinstance(name, str) and name.partition(".")[0] not in _NOT_USERS


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


def restore_numbers(before: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    """Puts back the int and float attributes of ``before`` (:func:`numbers_of`) that a
    forward run for torch_vjp's own purposes (planning, a check against the loop) moved: a
    step counter the forward increments advances with the forwards of the computation
    alone."""
    for m, values in before:
        d = m.__dict__
        for k, v in values.items():
            now = d.get(k, d)
            if now is not v and type(now) in _NUMBERS:
                d[k] = v


# flag_of's values: kept as they are, and numbers by their truth (``_flag_types`` in the
# tests checks that these agree with flag_of)
_FLAGS = (bool, str, type(None))
_NUMBERS_FLAGGED = (int, float)


def structure_of(model: nn.Module, params: list[tuple[int, bool]] | None = None
                 ) -> tuple[Any, ...]:
    """The model's structure as NOTE [the structure a plan is for] says, and its modules'
    training flags. With ``params``, the same walk appends ``(id(p), p.requires_grad)`` of
    each parameter there, in the order of ``model.parameters()`` (each once)."""
    entries, training, memo = [], [], {}  # (memo: a hook on many modules is keyed once)
    seen: set[int] = set()
    torch_attrs = _TORCH_ATTRS or _torch_attrs()
    # what the code of the model's own module types reads, for the attributes of torch's
    # modules below them (``self.blocks.mix`` on an nn.ModuleList): the modules come parent
    # first, so a module's readers are counted before it
    read_kinds: set[type] = set()
    read_names: set[str] = set()
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
        ps = m._parameters  # (which are frozen: NOTE [probes at a generic point] in plan.py)
        if ps:
            frozen = []
            for k, p in ps.items():
                if p is None:
                    continue
                if not p.requires_grad:
                    frozen.append(k)
                if params is not None and id(p) not in seen:
                    seen.add(id(p))
                    params.append((id(p), p.requires_grad))
            if frozen:
                entry += (("frozen", tuple(frozen)),)
        replaced = replaced_forward(m)
        if replaced is not None:  # (a layer.forward = ... takes the layer's rule away; and
            # by what it runs, as a hook is: a forward replaced again, by one that mixes the
            # examples or reads another parameter, is another structure)
            f = m.__dict__[replaced]
            entry += (("replaced", replaced, memo.get(id(f)) or memo.setdefault(
                id(f), _hook_key(f))),)
        if not own:  # (and so does nn.Linear.forward = ...: the functions the rules replay;
            # and the flags of its settings: a Dropout's p raised from 0, where it draws
            # nothing, or a Softmax's dim moved onto the batch)
            # (flag_of inlined: one call per attribute of every module, on every call)
            entry += (kind.forward, getattr(kind, "_conv_forward", None), tuple([
                (k, v if type(v) in _FLAGS else bool(v)) for k, v in m.__dict__.items()
                if (type(v) in _FLAGS or type(v) in _NUMBERS_FLAGGED) and k[:1] != "_"
                and k != "training"]))
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
            if kind not in read_kinds:
                read_kinds.add(kind)
                read_names |= reads
        elif read_names and not read_names.isdisjoint(m.__dict__):
            # (a flag the user set on a torch module, a container most likely, that code of
            # the user's reads; the test above is one pass over the module's dict, in C)
            hit = sorted(k for k in m.__dict__.keys() & read_names
                         if k[:1] != "_" and k not in torch_attrs)
            if hit:
                reads = _frozen(read_names)
                found = [(k, nested_flags(m.__dict__[k], reads)) for k in hit]
                entry += (("attrs", tuple(kf for kf in found if kf[1] is not NotImplemented)),)
        entries.append(entry)
        training.append(m.training)
    glob = torch.nn.modules.module
    return (tuple(training), tuple(entries),
            *(_hooks_key(h, memo) if h else () for h in (
                glob._global_forward_hooks, glob._global_forward_pre_hooks,
                glob._global_backward_hooks, glob._global_backward_pre_hooks)))


_FROZEN: dict[frozenset[str], frozenset[str]] = {}


def _frozen(names: set[str]) -> frozenset[str]:
    """``names`` as one frozenset per set of names (the same object on every call, which
    ``_sorted_reads`` keys by its identity)."""
    key = frozenset(names)
    found = _FROZEN.get(key)
    if found is None:
        if len(_FROZEN) >= 256:
            _FROZEN.clear()
        found = _FROZEN[key] = key
    return found


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
    whose ``mix`` flag turned on makes another), and by the entries its ``__call__`` reads
    one level into those attributes (``self.cfg["on"]``) and the globals and closure cells
    it names (``CFG["on"]``), as a bound method's. A function's, method's or partial's also
    by the flags its code reads (:func:`function_flags`, as a loss function is keyed, and
    the entries of a partial's arguments): ``route_key`` reads a dict only by its identity,
    so a hook reading ``flag["on"]`` kept its plan when the flag was switched on. A
    partial's function by this key too (a partial of a hook object)."""
    if isinstance(h, functools.partial):
        # (its function by _hook_key too: a callable object's __call__, whose flags
        # function_flags does not find, as it has no __code__)
        func = h.func if hasattr(h.func, "__code__") else getattr(type(h.func), "__call__", None)
        reads = _names_read(getattr(func, "__code__", None) or _EMPTY_CODE)
        held = tuple(nested_flags(a, reads) for a in (*h.args, *h.keywords.values()))
        return (route_key(h), _hook_key(h.func), held)
    if isinstance(h, types.FunctionType):
        return (route_key(h), function_flags(h))
    if isinstance(h, types.MethodType):
        return ("method", route_key(h.__func__), type(h.__self__), _object_flags(h.__self__),
                function_flags(h))
    # (and by what its __call__ reads: self.cfg["on"], and the globals and closure cells
    # it names, CFG["on"], as a bound method's)
    call = getattr(type(h), "__call__", None)
    return (type(h), _object_flags(h), function_flags(types.MethodType(call, h))
            if isinstance(call, types.FunctionType) else ())


_EMPTY_CODE = (lambda: None).__code__

_LOSS_SETTINGS = (int, float, str, type(None))  # (and tuples: a loss module's settings)


def loss_key(loss_fn: Any) -> Any:
    """What identifies a loss for the plan: its type and settings for a loss module (a new
    instance each call is the same loss); its code and the flags of what it reads for a
    function (NOTE [the structure a plan is for]); a ``functools.partial`` by its function's
    key and the flags of its arguments (a partial made for each step, over a coefficient
    that switches an L2 term on, is the same loss while the flags are); any other callable
    object by its identity (:func:`~torch_vjp._engine.context.identity`, not its address:
    a loss made for each step takes the address of an earlier step's, which has died, and
    may read other parameters; by its address only where it cannot be weakly referenced,
    since a key that held it would keep its model alive) and the flags of its attributes
    and of what its ``__call__`` reads (``self.l2`` switched on after warm-up)."""
    if isinstance(loss_fn, nn.Module):
        return (type(loss_fn), tuple([
            (k, v) for k, v in loss_fn.__dict__.items()
            if k[:1] != "_" and (type(v) is tuple or isinstance(v, _LOSS_SETTINGS))]))
    if isinstance(loss_fn, functools.partial):
        func = loss_fn.func
        call = func if hasattr(func, "__code__") else getattr(type(func), "__call__", None)
        code = getattr(getattr(call, "__func__", call), "__code__", None)
        reads = _names_read(code or _EMPTY_CODE)
        return ("partial", loss_key(func), tuple(loss_fn.keywords), tuple(
            nested_flags(a, reads) for a in (*loss_fn.args, *loss_fn.keywords.values())))
    code = getattr(getattr(loss_fn, "__func__", loss_fn), "__code__", None)
    if code is not None:
        return (code, function_flags(loss_fn))
    call = getattr(type(loss_fn), "__call__", None)
    try:
        weakref.ref(loss_fn)
    except TypeError:  # (held by id: a key that held the object kept its model alive)
        who: Any = id(loss_fn)
    else:
        who = identity(loss_fn)
    if not isinstance(call, types.FunctionType):
        return (type(loss_fn), who, object_flags(loss_fn))
    return (type(loss_fn), who, object_flags(loss_fn, _names_read(call.__code__)),
            function_flags(call))


def loss_tensors(loss_fn: Any, tracked: dict[int, str]) -> tuple[Any, ...]:
    """The tensors a loss holds, for the plan's key beside :func:`loss_key`, which reads
    flags alone: those in a function's closure cells and the globals its code names, a
    ``functools.partial``'s arguments, a loss module's parameters, buffers and tensor
    attributes, another callable object's tensor attributes (and what its ``__call__`` or
    ``forward`` reads), and those in a tuple, list or dict held there; a module held there
    by the parameters it holds itself. Each by :func:`_tensor_flag`: a loss made by a
    factory over ``model.fc1.weight`` (or ``model.fc1``) for an L2 term, then over
    ``model.fc2.weight``, reads another parameter (the plan made for the first gave the
    second's rules alone, silently wrong), and a coefficient held as a tensor may switch a
    term on (``c = torch.tensor(0.)`` made 1)."""
    out: list[Any] = []
    _held_tensors(loss_fn, tracked, out, 2)
    return tuple(out)


def _held_tensors(fn: Any, tracked: dict[int, str], out: list[Any], depth: int) -> None:
    if depth <= 0:
        return
    if isinstance(fn, functools.partial):
        for j, a in enumerate((*fn.args, *fn.keywords.values())):
            _add_tensor(("arg", j), a, tracked, out)
        _held_tensors(fn.func, tracked, out, depth - 1)
        return
    # (a module's own attribute by its dict: Module.__getattr__'s failed lookup of
    # ``__func__`` cost more than the rest; what it finds there, a parameter, buffer or
    # submodule, is never a function, and a class's ``__func__`` is read as before)
    if isinstance(fn, nn.Module) and not hasattr(type(fn), "__func__"):
        func = fn.__dict__.get("__func__", fn)
    else:
        func = getattr(fn, "__func__", fn)
    if isinstance(func, types.FunctionType):
        _function_tensors(func, tracked, out)
        owner = getattr(fn, "__self__", None)
        if owner is not None and not isinstance(owner, (types.ModuleType, type)):
            _held_tensors(owner, tracked, out, depth - 1)
        return
    if isinstance(fn, nn.Module):
        for d in (fn._parameters, fn._buffers):
            for k, v in d.items():
                _add_tensor(k, v, tracked, out)
    for k, v in getattr(fn, "__dict__", {}).items():
        if k[:1] != "_":
            _add_tensor(k, v, tracked, out)
    call = getattr(type(fn), "forward" if isinstance(fn, nn.Module) else "__call__", None)
    if isinstance(call, types.FunctionType):
        _function_tensors(call, tracked, out)


def _function_tensors(func: types.FunctionType, tracked: dict[int, str], out: list[Any]
                      ) -> None:
    """The tensors of a function's closure cells and of the globals its code names."""
    for i, cell in enumerate(func.__closure__ or ()):
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        _add_tensor(i, v, tracked, out)
    glob = func.__globals__
    for n in _sorted_reads(_names_read(func.__code__)):
        v = glob.get(n)
        if v is not None:
            _add_tensor(n, v, tracked, out)


# (values that hold no tensor, skipped by their type at once: a loss module's settings)
_PLAIN = frozenset({bool, int, float, str, type(None)})


def _add_tensor(where: Any, v: Any, tracked: dict[int, str], out: list[Any]) -> None:
    if type(v) in _PLAIN:
        return
    if isinstance(v, Tensor):
        out.append((where, _tensor_flag(v, tracked)))
    elif isinstance(v, nn.Module):  # (a layer whose weight an L2 term reads: by the
        # parameters it holds itself, the model's own layers by name)
        out.append((where, ("module", tuple(
            _tensor_flag(p, tracked) for p in v._parameters.values() if p is not None))))
    elif type(v) in (tuple, list) and len(v) <= _MAX_NESTED:
        for j, x in enumerate(v):
            if isinstance(x, Tensor):
                out.append(((where, j), _tensor_flag(x, tracked)))
    elif type(v) is dict and len(v) <= _MAX_NESTED:
        for k, x in v.items():
            if isinstance(x, Tensor):
                out.append(((where, k if type(k) is str else None), _tensor_flag(x, tracked)))


def _tensor_flag(t: Tensor, tracked: dict[int, str]) -> Any:
    """A tensor a loss holds: the selected parameter it is (or a view of), by name; or
    whether it requires grad; a one-element tensor on the CPU also by its truth (a
    coefficient switched on), as hooks' numbers are. Not by identity: a tensor made anew
    for each step is the same loss."""
    base = t._base if t._base is not None else t
    name = tracked.get(id(base))
    if name is not None:
        return ("param", name)
    if t.requires_grad:
        return ("grad",)
    if t.numel() == 1 and t.device.type == "cpu" and t.layout == torch.strided and (
            not t.is_meta):
        return ("tensor", bool(t))
    return ("tensor",)


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
