"""The cache key of a compiled entry (NOTE [compiled Jacobians] in
:mod:`torch_vjp._engine.compiled`): what identifies the program a function traces to, and the
signature of a call's arguments and of the global state a traced program bakes in; and
:func:`tracing`, whether this thread's call is traced (the one test every place that
behaves differently inside a trace reads)."""

from __future__ import annotations

import functools
import re
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._guards
from torch import Tensor
from torch.utils._pytree import tree_flatten

from torch_vjp._engine.context import module_own_attrs

__all__ = ["program_key", "held_key", "call_signature", "global_state", "key_stem",
           "number_key", "module_flags", "globals_read", "HOOK_GUARDS", "HookGuards",
           "tracing", "GuardReads", "Reads"]


def program_key(f: object, *, passed: bool = False, depth: int = 3,
                keep: list[object] | None = None) -> object:
    """What identifies the program ``f`` traces to (see NOTE [compiled Jacobians]).

    With ``passed`` (``f`` is an argument of the compiled program, which reads its closure
    on every call), a tensor that a function's closure or defaults hold counts by its
    signature, numbers and strings by value, and a function they hold (``depth`` levels
    deep) by its own key (:func:`held_key`), and so do the arguments of a ``partial``: a
    lambda or a ``partial`` over a new batch each step, or over a loss made for each batch,
    finds its entry again. Otherwise (``f`` baked into the program) everything counts by
    identity. ``keep``, where given, gets every object the key counts by its ``id`` (the
    cache holds those, weakly where it can, so that their ids stay theirs: NOTE [what an
    entry keeps] in :mod:`torch_vjp._engine.compiled`)."""
    held: Callable[[object], object] = (
        (lambda v: held_key(v, depth - 1, keep)) if passed else id)
    if isinstance(f, functools.partial):  # (dynamo reads its arguments as it reads a closure)
        inner = (program_key(f.func, passed=True, depth=depth - 1, keep=keep) if passed
                 else program_key(f.func))
        return ("partial", inner, tuple(map(held, f.args)),
                tuple((k, held(v)) for k, v in sorted(f.keywords.items())))
    if isinstance(f, types.MethodType):
        _kept(f.__self__, keep)
        return ("method", f.__func__, id(f.__self__),
                _values_read(f.__func__, passed, depth, keep))
    if isinstance(f, types.FunctionType):
        cells = tuple(held(c.cell_contents) if _filled(c) else None
                      for c in (f.__closure__ or ()))
        # (keyword-only defaults too, by name: dynamo reads them as it reads the others;
        # left out, a function made anew over another value, say -0.0 for 0.0, which
        # dynamo's guard on the constant takes for equal, ran the other one's program)
        defaults = (*map(held, f.__defaults__ or ()),
                    *((k, held(v)) for k, v in sorted((f.__kwdefaults__ or {}).items())))
        return ("function", f.__code__, cells, defaults,
                _values_read(f, passed, depth, keep))
    _kept(f, keep)
    if isinstance(f, torch.nn.Module):
        return ("object", id(f),
                _values_read(getattr(type(f), "forward", None), passed, depth, keep))
    return ("object", id(f))


def held_key(v: object, depth: int = 2, keep: list[object] | None = None) -> object:
    """What a value passed to a compiled program (or held by the closure or ``partial`` of
    one) counts as in its key: a tensor by its signature, numbers and strings by value, a
    function, bound method or ``partial`` (``depth`` levels deep) by :func:`program_key`,
    a module without parameters or submodules (a loss, ``nn.CrossEntropyLoss()`` made for
    each batch) by its type, attributes and buffers, a tuple, list or dict of tensors and
    numbers (string keys) by its structure and their signatures (a batch ``{"x": x, "y":
    y}`` made for each step, as a tensor is); anything else by identity (and put in
    ``keep``, as :func:`program_key` does). Dynamo reads such values on every call, so a
    new one of the same key runs the same program."""
    if depth >= 1 and isinstance(v, (types.FunctionType, functools.partial, types.MethodType)):
        # (a bound method by its function and its object: ``self.loss`` is a new method
        # object on every access, and by its own id it made a new program on every call)
        return program_key(v, passed=True, depth=depth, keep=keep)
    if (isinstance(v, torch.nn.Module) and not v._parameters and not v._modules
            and type(v).forward is not torch.nn.Module.forward):
        # (its attributes but those every module has, its registries and hooks, learned
        # from a Module built on the first call, not at import, which would log torch's
        # API usage: the user's own, private ones too, ``self._margin``: two instances that
        # differ there only shared an entry, and dynamo's guard on it recompiled it on
        # every call that alternated them, until it went eager, blaming a global)
        own = module_own_attrs()
        attrs = tuple((k, held_key(x, 0, keep)) for k, x in v.__dict__.items()
                      if k not in own or k == "training")
        buffers = tuple((k, _leaf_signature(x, keep)) for k, x in v._buffers.items())
        return ("module", type(v), attrs, buffers)
    if type(v) in (tuple, list, dict):  # (a batch held as a dict or tuple of tensors)
        try:
            try:
                return ("plain", _plain_signature(v))
            except _NotPlain:
                return ("items", _items_key(v, keep))
        except RecursionError:  # (one that holds itself: by identity)
            pass
    return _leaf_signature(v, keep)


# NOTE [the globals a program reads]
# Dynamo guards every value a traced program reads, its globals included: a tensor on its
# signature (``requires_grad`` too), a number, string or flag on its value. The key held
# the closure's values but not the globals': a module-level tensor whose ``requires_grad``
# alternated between calls (a weight frozen for every other step), or a module-level
# number switched back and forth, recompiled the one entry on every call (NOTE [a
# recompiled entry] in compiled.py), and after ``REBUILD_WARN_AT`` calls it stayed eager,
# blaming a global. So the key holds the globals that ``f``'s code (and the code of the
# lambdas, functions and comprehensions defined in it, :func:`globals_read`) reads: tensors
# by signature, numbers, strings and flags by value, and the helper functions of ``f``'s
# own module by their own key (their globals in turn); a module's forward's globals too.
# Each state finds a program of its own, compiled once. A global rebound to a tensor of
# the same signature runs the same program, which reads it on every call. Not held: the
# tensors ``f`` reaches through objects (``self.w`` of a bound method's object): an object
# that also holds a log of tensors growing on every call would make every call a new key,
# where the program, which never reads the log, serves them all.

#: code object -> the global names it and the code defined in it read (co_names).
_NAMES: weakref.WeakKeyDictionary[types.CodeType, tuple[str, ...]] = (
    weakref.WeakKeyDictionary())
_VALUE_TYPES = (bool, int, float, complex, str, type(None))


def _code_names(code: types.CodeType) -> tuple[str, ...]:
    names = _NAMES.get(code)
    if names is None:
        found = dict.fromkeys(code.co_names)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):  # (a lambda, a function, a comprehension)
                found.update(dict.fromkeys(_code_names(c)))
        names = _NAMES[code] = tuple(found)
    return names


def globals_read(f: object) -> Iterator[tuple[str, object]]:
    """The globals that ``f``'s code, and the code defined in it, name, each with its name
    (a name read as an attribute, ``torch.sin``'s ``sin``, where a global has it too; none
    for an object that is not a Python function). See NOTE [the globals a program
    reads]."""
    if type(f) is not types.FunctionType:
        return
    glob = f.__globals__
    for name in _code_names(f.__code__):
        if name in glob:
            yield name, glob[name]


def _values_read(f: object, passed: bool, depth: int, keep: list[object] | None) -> object:
    """The global tensors (by signature), numbers, strings and flags (by value) ``f``
    reads, by name (NOTE [the globals a program reads]; a module's forward's too, which
    ``context.reached`` does not look into), and the helper functions of ``f``'s own module
    it calls, by :func:`program_key` (``depth`` levels deep: their globals in turn);
    nothing where ``f`` is baked into the program."""
    if not passed or type(f) is not types.FunctionType:
        return ()
    out = []
    for k, v in globals_read(f):
        if type(v) in _VALUE_TYPES or isinstance(v, Tensor):
            out.append((k, _leaf_signature(v)))
        elif (depth > 1 and type(v) is types.FunctionType
              and v.__globals__ is f.__globals__):
            out.append((k, program_key(v, passed=True, depth=depth - 1, keep=keep)))
    return tuple(out)


# NOTE [what a program read beyond its key]
# The key holds what ``f``'s closure, defaults and own module's globals hold, not what the
# program reads through an object (``self.w`` of a bound method's object or of an object
# a closure holds), nor the globals of helpers defined in other modules, nor the items of
# a global dict or list (``CFG["scale"]``). Dynamo guards each of those, so a call that
# switched one back and forth (``self.w.requires_grad_`` on every other step, a global
# setting toggled) recompiled the one entry on every call (NOTE [a recompiled entry] in
# compiled.py), and after ``REBUILD_WARN_AT`` of them it stayed eager. Keying every tensor
# an object holds would make an object that also keeps a growing log of tensors a new key
# on every call. So the first compile of a key notes, from dynamo's own guards
# (``guard_filter_fn``, which keeps every guard), the tensors and constants the program
# read from ``f`` (or a function passed beside it) and from globals, by the guard's own
# expression: :class:`GuardReads`. From then on that key is extended with their
# signatures (tensors by :func:`_leaf_signature`, constants by value), read anew on each
# call (:class:`Reads`): each state finds a program of its own, compiled once, and one that
# changes on every call (a step counter) counts as a closure over new objects does, warned
# about and left eager (NOTE [closures over new objects] in compiled.py). Left out,
# as the key holds them already: the primals, the closure cells and defaults of ``f``
# themselves, a module's parameters, buffers and training flag (:func:`module_flags`).

_READ_GUARDS = frozenset({"TENSOR_MATCH", "CONSTANT_MATCH", "EQUALS_MATCH"})
_ROOT = re.compile(r"args\[(\d+)\]")
_GLOBAL = re.compile(r"G\['__import_(\w+)'\]")  # (another module's globals, as dynamo
_OWN = re.compile(r"(torch|torch_vjp)(_dot_|$)")  # names it: dots as _dot_)
_KEYED = re.compile(r"args\[0\]\.(__closure__\[\d+\]\.cell_contents|__defaults__\[\d+\]"
                    r"|__kwdefaults__\[[^]]+\])$")


class GuardReads:
    """A ``guard_filter_fn`` for ``torch.compile`` that keeps every guard and notes the
    expressions of those NOTE [what a program read beyond its key] holds. The compiled
    function takes ``(f, *primals, *passed, *rest)`` as its ``args``: ``primals`` the
    number of primals, ``passed`` of the functions passed beside ``f``."""

    def __init__(self, primals: int, passed: int) -> None:
        self.primals = primals
        self.passed = passed
        self.names: dict[str, None] = {}

    def __call__(self, entries: Any) -> list[bool]:
        for e in entries:
            if e.guard_type in _READ_GUARDS and self._beyond_key(e.name):
                self.names[e.name] = None
        return [True] * len(entries)

    def _beyond_key(self, name: str) -> bool:
        if "._parameters[" in name or "._buffers[" in name or name.endswith(".training"):
            return False
        if name.startswith("G["):  # (the user's modules: not torch's, nor ours)
            found = _GLOBAL.match(name)
            return found is not None and not _OWN.match(found.group(1))
        root = _ROOT.match(name)
        if root is None:
            return False
        i = int(root.group(1))
        if i != 0 and not self.primals < i <= self.primals + self.passed:
            return False  # (a primal, or an argument made anew for each call)
        return name != root.group(0) and _KEYED.match(name) is None

    def reads(self, scope: dict[str, Any]) -> Reads | None:
        """What the program read, evaluated in ``scope`` (the compiled function's
        globals), or None where it read nothing the key does not hold."""
        return Reads(tuple(self.names), scope) if self.names else None


class Reads:
    """The expressions of dynamo's guards a key is extended with (NOTE [what a program read
    beyond its key]), each compiled once and evaluated as dynamo's guards are: all of them
    in one evaluation (``together``), one by one only where one of them fails (each call of
    a steady function evaluates them, and the MLP of the benchmark suite, which reads the
    six items of the dict its closure holds, paid six evaluations)."""

    __slots__ = ("names", "codes", "together", "scope")

    def __init__(self, names: tuple[str, ...], scope: dict[str, Any]) -> None:
        from torch._dynamo import guards  # (the helpers its guard text calls)

        known = getattr(guards, "_get_closure_vars", None)
        self.names = names
        self.codes = tuple(compile(n, "<guard>", "eval") for n in names)
        self.together = compile(f"({', '.join(names)},)", "<guards>", "eval")
        self.scope = {**(known() if known else getattr(guards, "CLOSURE_VARS", {})),
                      "G": scope}

    def union(self, other: Reads) -> Reads:
        return Reads(tuple(dict.fromkeys((*self.names, *other.names))), self.scope["G"])

    def signature(self, f: object, args: tuple[Any, ...]) -> tuple[object, ...]:
        """The signature of what each expression reads in this call (``args``: the primals
        and the functions passed beside ``f``), as the key's last item: ``("reads", ...)``,
        which :func:`key_stem` leaves out."""
        local = {"args": (f, *args)}
        try:  # (all at once; one by one below where one of them is gone)
            values = eval(self.together, self.scope, local)  # noqa: S307 - dynamo's text
        except Exception:  # noqa: BLE001 - told apart below
            values = None
        if values is not None:
            return ("reads", tuple([_leaf_signature(v) for v in values]))
        out = []
        for code in self.codes:
            try:
                v = eval(code, self.scope, local)  # noqa: S307 - dynamo's own guard text
            except Exception:  # noqa: BLE001 - gone: the program's guard fails as well
                out.append(("unread",))
                continue
            out.append(_leaf_signature(v))
        return ("reads", tuple(out))


def _items_key(v: Any, keep: list[object] | None) -> object:
    """A tuple, list or dict that holds objects other than tensors and numbers (``[model]``,
    ``{0: layer}``): by its type and each item's :func:`held_key` (an object by its identity,
    kept weakly where it can be), never by the container's own identity. A list or dict
    cannot be held weakly, so the cache entry held it, and with it what it holds (a model
    and its parameters), alive after the function and the caller dropped them."""
    if type(v) is dict:
        return (dict, tuple((_leaf_signature(k, keep), held_key(x, 0, keep))
                            for k, x in v.items()))
    return (type(v), tuple(held_key(x, 0, keep) for x in v))


def _kept(v: object, keep: list[object] | None) -> None:
    if keep is not None:
        keep.append(v)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _leaf_signature(v: object, keep: list[object] | None = None) -> object:
    if isinstance(v, Tensor):
        return ("T", tuple(v.shape), _strides(v), v.dtype, v.device, v.layout,
                v.requires_grad, type(v), _bits(v))
    if v is None or isinstance(v, (bool, int, float, complex, str, torch.dtype)):
        return number_key(v)
    _kept(v, keep)
    return ("id", id(v))


def number_key(v: Any) -> object:
    """A number (or string, None, dtype) as a key holds it: by its type and value, a float's
    (and a complex's parts) by their exact bits (``float.hex``). ``0.0 == -0.0``, but a
    program traced for one bakes its sign in (``math.copysign(1.0, s)``, ``1 / s``), and
    dynamo's guard on the constant compares with ``==``: keyed by value, a call with
    ``-0.0`` ran the program traced for ``0.0``, silently. Every NaN is one key (none equals
    itself)."""
    if isinstance(v, float):
        return (type(v), float.hex(v))
    if isinstance(v, complex):
        return (type(v), float.hex(v.real), float.hex(v.imag))
    return (type(v), v)


def _strides(t: Tensor) -> object:
    """``t``'s strides (None for a sparse layout, which has none): dynamo's guards hold
    them (``dynamic=False``), so a program traced for a contiguous tensor is recompiled for
    its transpose; in the key, each layout finds a program of its own instead of
    recompiling the entry on every call that alternates them (NOTE [a recompiled entry] in
    :mod:`torch_vjp._engine.compiled`), which after ``REBUILD_WARN_AT`` such calls ran
    eagerly, blaming a global."""
    return t.stride() if t.layout is torch.strided else None


def _bits(t: Tensor) -> tuple[bool, bool, bool]:
    """Whether ``t`` is a conjugate or negative view, or an inference tensor: dynamo's
    guards hold its dispatch keys, which say so, and recompile a program traced for one
    kind of tensor for the other; in the key, as the strides are (:func:`_strides`), each
    finds a program of its own (alternating a tensor made under ``torch.inference_mode``
    and one made outside recompiled the entry on every call, and the eighth went eager,
    blaming a global)."""
    return t.is_conj(), t.is_neg(), t.is_inference()


class _NotPlain(Exception):
    """A container that only pytree knows how to flatten."""


def _plain_signature(v: object) -> object:
    """The signature of tensors (and numbers) nested in plain tuples, lists and dicts with
    string keys: what ``tree_flatten`` and the spec's hash would give apart, at a fraction of
    their cost (a dict of parameters is a common primal). Raises ``_NotPlain`` for any other
    container (a namedtuple, an OrderedDict, a registered pytree node)."""
    kind = type(v)
    if kind is tuple or kind is list:
        return (kind, tuple([_plain_signature(x) for x in v]))  # type: ignore[attr-defined]
    if kind is dict:
        if not all(type(k) is str for k in v):  # type: ignore[attr-defined]
            raise _NotPlain
        return (dict, tuple([(k, _plain_signature(x))
                             for k, x in v.items()]))  # type: ignore[attr-defined]
    if isinstance(v, Tensor) or v is None or kind in (bool, int, float, complex, str):
        return _leaf_signature(v)  # (a number: number_key)
    raise _NotPlain


def call_signature(args: tuple[Any, ...]) -> object:
    """The signature of a call's arguments (tensors by shape, strides, dtype, device, layout,
    ``requires_grad`` and their conjugate, negative and inference bits; other values by
    equality, or identity), with the state that changes what a traced program computes
    without being an argument: grad and inference mode, autocast, the global module hooks
    and the settings dynamo guards (:func:`global_state`)."""
    return (_arguments(args), global_state())


def global_state() -> object:
    """Grad mode and inference mode, autocast (enabled, and its dtype, per device type),
    the other settings dynamo's global state guard holds (the default dtype, deterministic
    algorithms, the number of threads, float32 matmul precision and reduced-precision
    reductions, torch function, subclasses' or all of it, autocast's cast cache), the
    torch function modes on the stack (:func:`_function_modes`), and the keys of the global
    module hook dicts (``nn.modules.module.register_module_forward_hook`` and its kin): what
    a compiled program bakes in, and the first-call check must see again when it changes
    (NOTE [compiled Jacobians]). A few microseconds. (Dynamo guards each of these: left out of the
    key, a call that switched one back and forth, ``torch.no_grad()`` and
    ``torch.inference_mode()`` say, whose grad mode is off alike, recompiled the one entry,
    and after ``REBUILD_WARN_AT`` switches it stayed eager, blaming a global.)"""
    cast = _autocast()
    hooks = tuple(tuple(h) for h in _global_hook_dicts())
    guarded = (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
               torch.is_deterministic_algorithms_warn_only_enabled(), torch.get_num_threads(),
               torch.get_float32_matmul_precision(),
               torch._C._get_cublas_allow_fp16_reduced_precision_reduction(),
               torch._C._get_cublas_allow_bf16_reduced_precision_reduction(),
               torch._C._is_torch_function_enabled(),
               torch._C._is_torch_function_all_disabled(), torch.is_autocast_cache_enabled())
    modes = _function_modes() if torch._C._len_torch_function_stack() else ()
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), cast, hooks, guarded,
            modes)


def _function_modes() -> tuple[object, ...]:
    """The torch function modes on the stack, by type, and a default device's by its
    device (``with torch.device(...)``, ``torch.set_default_device``): dynamo's guard holds
    the stack, so a call inside such a mode and one outside it recompiled the one entry,
    and after ``REBUILD_WARN_AT`` alternations it stayed eager, blaming a global."""
    from torch.utils._device import DeviceContext  # (imported by torch already)

    out = []
    for i in range(torch._C._len_torch_function_stack()):
        mode = torch._C._get_function_stack_at(i)
        out.append((type(mode), mode.device) if isinstance(mode, DeviceContext)
                   else type(mode))
    return tuple(out)


def _autocast() -> tuple[tuple[str, torch.dtype], ...]:
    """Each device type whose autocast is enabled, with its dtype. Every device type autocast
    knows (``xpu``, ``mps``, ``hpu``...: dynamo's guard holds them all; keyed on ``cpu`` and
    ``cuda`` alone, a call that switched another one's autocast recompiled the entry, and
    after ``REBUILD_WARN_AT`` switches it stayed eager, blaming a global), asked one by one
    only where one is enabled (about 0.2 us each)."""
    if not torch._C._is_any_autocast_enabled() and not any(  # (the common case)
            map(torch.is_autocast_enabled, _AUTOCAST_UNSAID)):
        return ()
    return tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(d))


def _unsaid(devices: tuple[str, ...]) -> tuple[str, ...]:
    """The device types among ``devices`` whose autocast ``torch._C._is_any_autocast_enabled``
    does not report (``mps`` and ``maia`` in torch 2.13), tried once in this thread
    (autocast's state is thread-local); every one already enabled counts as unsaid."""
    out = []
    for d in devices:
        if torch.is_autocast_enabled(d) or torch._C._is_any_autocast_enabled():
            out.append(d)
            continue
        torch.set_autocast_enabled(d, True)
        try:
            if not torch._C._is_any_autocast_enabled():
                out.append(d)
        finally:
            torch.set_autocast_enabled(d, False)
    return tuple(out)


_AUTOCAST_DEVICES: tuple[str, ...] = tuple(torch._C._autocast_supported_devices())
_AUTOCAST_UNSAID = _unsaid(_AUTOCAST_DEVICES)


# NOTE [train and eval entries]
# The key holds the training flags of the modules ``f`` reaches and of every module they
# hold (``context.module_tree``, the walk buffers_kept reads too): the two modes are two
# programs, and the one that fails (a model with dropout, whose training-mode draws differ
# between the eager and the compiled run; BatchNorm's running statistics, written under
# vmap) stays eager alone. Left to dynamo's guard on ``training``, a single training-mode
# call recompiled the eval-mode entry (NOTE [a recompiled entry] in compiled.py), its check
# failed, and the key, eval mode's too, ran eagerly from then on; so it went for a
# submodule switched on its own (``model.dropout.train()``), until the flags of the whole
# tree were keyed. The modules among the arguments count too (``f(x, model)`` with
# ``argnums=0``: a model ``f`` reaches only through an argument).


def module_flags(m: torch.nn.Module) -> object:
    """What the key holds of a module ``f`` or an argument reaches (NOTE [train and eval
    entries]): its training flag, and whether each of
    its own parameters requires grad. Dynamo guards both; with the training flag alone, a
    model frozen and unfrozen on alternate calls (``model.requires_grad_(False)`` for the
    other half of a step) recompiled its one entry on every call, and after
    ``REBUILD_WARN_AT`` calls it stayed eager, blaming a global."""
    return m.training, tuple([p.requires_grad for p in m._parameters.values() if p is not None])


def _global_hook_dicts() -> tuple[dict[Any, Any], ...]:
    m = torch.nn.modules.module
    return (m._global_forward_pre_hooks, m._global_forward_hooks,  # noqa: SLF001
            m._global_backward_pre_hooks, m._global_backward_hooks)  # noqa: SLF001


def _arguments(args: tuple[Any, ...]) -> object:
    if all(type(a) is Tensor for a in args):  # the common case, without pytree's cost
        return tuple((a.shape, _strides(a), a.dtype, a.device, a.layout, a.requires_grad,
                      _bits(a)) for a in args)
    try:
        return ("plain", _plain_signature(args))
    except _NotPlain:
        pass
    leaves, spec = tree_flatten(args)
    return (spec, tuple(map(_leaf_signature, leaves)))


def key_stem(key: object) -> object:
    """``key`` with what the closures, defaults and ``partial`` arguments of the functions
    in it hold, the globals they read, and what a program read beyond the key, left out:
    the keys of one function written anew for each call, over new objects (or read with a
    new value), share a stem (the warning of ``_closure_variants`` in
    :mod:`torch_vjp._engine.compiled`)."""
    if type(key) is not tuple:
        return key
    if key and type(key[-1]) is tuple and key[-1][:1] == ("reads",):  # (NOTE [what a
        key = key[:-1]  # program read beyond its key]: a key extended by it, or not yet)
    if key and key[0] == "function" and len(key) == 5:
        return ("function", key[1])
    if key and key[0] == "method" and len(key) == 4:  # (the globals it reads left out)
        return key[:3]
    if key and key[0] == "object" and len(key) == 3:  # (a module: its forward's globals)
        return key[:2]
    if key and key[0] == "partial" and len(key) == 4:
        return ("partial", key_stem(key[1]), len(key[2]), tuple(k for k, _ in key[3]))
    return tuple(key_stem(k) for k in key)


class HookGuards:
    """Dynamo guards on the hooks of the modules a program calls while any compiled call of
    ours runs (and may compile).

    By default (``torch._dynamo.config.skip_nnmodule_hook_guards``) dynamo does not guard
    the empty hook dicts of the modules it traces, so a hook registered after the first
    call would be ignored by every later one: a forward hook that rescales an output, left
    out of the Jacobian. A count under a lock keeps the setting for overlapping calls in
    several threads; the user's own compiles that run meanwhile get the stricter guards
    too, which only costs them a check. Held while every program of ours compiles, not
    only where :func:`modules_reached` finds a module: a module reached in a way that
    search does not follow must not lose its hooks.

    NOTE [hook guards while compiling]
    Guards are built when a program is compiled, and checked, whatever the setting, on
    every later call. So the setting is held where torch_vjp compiles (a first call), not
    around the calls of a compiled program: where one meets a new hook, its guard fails
    and dynamo compiles a variant then, without the setting, but that call is a first call
    again (NOTE [a recompiled entry] in compiled.py), which drops the variant and compiles
    a new program under the setting. Holding it on every call cost about 6 us of a 160 us
    compiled call (the config module's attribute writes)."""

    __slots__ = ("depth", "saved", "lock")

    def __init__(self) -> None:
        self.depth = 0
        self.saved = True
        self.lock = threading.Lock()

    def __enter__(self) -> None:
        config = torch._dynamo.config  # (imported by torch.compile, which ran before)
        with self.lock:
            if self.depth == 0:
                self.saved = config.skip_nnmodule_hook_guards
                config.skip_nnmodule_hook_guards = False
            self.depth += 1

    def __exit__(self, *exc: Any) -> None:
        config = torch._dynamo.config
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                config.skip_nnmodule_hook_guards = self.saved


HOOK_GUARDS = HookGuards()


def tracing() -> bool:
    """Whether dynamo is tracing us (the user's torch.compile), or export running us for
    real in this thread: see NOTE [compiled Jacobians].

    ``torch.compiler.is_compiling()`` is a process-wide flag, set for the whole of a
    compile: read alone, a call in one thread while another thread compiled (or exported)
    anything took the plain form, without the eager path's copies of ``f``'s inputs (its
    in-place writes reached the caller's tensors) or ``buffers_kept``, and with none of its
    fallbacks (a BatchNorm in training mode failed), ``compile=False`` included; the
    per-sample functions skipped their inference-mode check (and returned zeros), checked
    mode its checks and its disconnection warning. Dynamo
    folds ``is_dynamo_compiling()`` to True where it traces this call; run for real, the
    call is in the compile (a backend's or export's own tracing) only where this thread's
    compile or tracing context is set."""
    if torch.compiler.is_dynamo_compiling():
        return True
    if not torch.compiler.is_compiling():
        return False
    return (torch._guards.CompileContext.try_get() is not None
            or torch._guards.TracingContext.try_get() is not None)
