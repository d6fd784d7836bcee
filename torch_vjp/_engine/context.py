"""Where the engine runs: torch.func's own transforms, outer transforms around a call, the
autograd graph a result may keep, the module buffers a call must put back, and what a
function reads (its globals, the modules a module holds) for the keys of decisions
remembered for it (NOTE [what a route key covers]).

NOTE [no graph outlives its chunk]
Under grad mode, a product that involves tensors requiring grad (a module's parameters that
f closes over) records an autograd graph, and a result that holds it keeps every chunk's
graph alive: chunk_size and max_memory would bound nothing. Unless create_graph=True asks
for a differentiable result, the Jacobian is detached, and:
* reverse mode runs its products under torch.no_grad(): f itself still runs with grad
  enabled inside torch.func's vjp (its own level), and a first-order pullback needs no graph;
* forward mode keeps the caller's grad mode (f may itself call torch.func's reverse
  transforms, whose pullbacks decide create_graph by the grad mode, and forward mode over a
  pullback without create_graph is silently wrong for some operators, such as logdet), and
  detaches each chunk's products as they are stored, so that a chunk's graph is freed
  before the next chunk runs.
Inside an outer torch.func transform nothing is detached: the outer transform
differentiates through the result.

NOTE [forward mode, one thread at a time]
torch keeps forward-mode AD's state for the whole process, not per thread: the current dual
level (torch.autograd.forward_ad) and torch.func.jvp's nesting count. Two threads computing
forward products at once make their dual tensors in one level, and the first to leave it
takes the other's tangents with it: torch raises "Trying to access a forward AD level with
an invalid index", or a Jacobian comes back wrong, silently (a column of zeros). So every
forward product the engine computes (func_jvp, and the plain loops' dual levels) holds
FORWARD_AD, one lock for the process, reentrant: f may itself call a forward transform of
this package. Reverse mode keeps its state per thread and takes no lock. (An f that waits,
inside a forward product, for another thread's forward product would wait for ever: the
lock serialises them; f's own calls in its own thread are reentrant.)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import numbers
import threading
import types
import weakref
from collections.abc import Hashable, Iterable
from typing import Any

import torch
from torch import Tensor

from torch_vjp._engine.kept import (CAPTURED, KEPT_ELEMENTS, KEPT_TOTAL, LEARNED_FROM, MOVES,
                                     Walked, Watched, captured_kept, module_buffers,
                                     renormed_weights, walked_tensors, walked_tree)
from torch_vjp._engine.reach import ITEMS_SEARCHED, captured_values, named_globals, reached
from torch_vjp._errors import JacobianOptionError

try:  # the undecorated originals: torch_vjp.checked() may replace torch.func.vjp
    from torch._functorch.eager_transforms import jvp as _torch_jvp
    from torch._functorch.eager_transforms import vjp as func_vjp
except ImportError:  # pragma: no cover - other torch layouts
    func_vjp = torch.func.vjp
    _torch_jvp = torch.func.jvp

#: Held by every forward product: NOTE [forward mode, one thread at a time].
FORWARD_AD = threading.RLock()


def func_jvp(*args: Any, **kwargs: Any) -> Any:
    """``torch.func.jvp`` (the undecorated original), one thread at a time: NOTE [forward
    mode, one thread at a time]. (Where torch.compile traces the call, the lock is left
    out: dynamo cannot enter it, and a compiled call's forward products run in the traced
    graph.)"""
    if torch.compiler.is_compiling():
        return _torch_jvp(*args, **kwargs)
    with FORWARD_AD:
        return _torch_jvp(*args, **kwargs)


def forward_level_of_another_thread() -> bool:
    """Whether the dual level open now (forward AD's, one per process) may be another
    thread's: one of this package's forward products holds :data:`FORWARD_AD` in another
    thread. (Where this thread holds it, or no one does, a level open now is this thread's
    own: NOTE [forward mode, one thread at a time].)"""
    if FORWARD_AD.acquire(blocking=False):
        FORWARD_AD.release()
        return False
    return True

try:  # torch.func.jacrev's own vjp: with argnums=0 its pullback returns a tensor, not a
    # 1-tuple, which saves vmap a pytree round trip per call (see NOTE [per-call overhead])
    from torch._functorch.eager_transforms import _vjp_with_argnums as vjp_with_argnums
except ImportError:  # pragma: no cover - other torch layouts
    vjp_with_argnums = None

__all__ = [
    "flag_of",
    "func_vjp",
    "func_jvp",
    "FORWARD_AD",
    "forward_level_of_another_thread",
    "vjp_with_argnums",
    "NO_CONTEXT",
    "is_nested",
    "graph_mode",
    "buffers_kept",
    "KEPT_ELEMENTS",
    "KEPT_TOTAL",
    "captured_tensors",
    "modules_reached",
    "reached",
    "captured_values",
    "named_globals",
    "module_tree",
    "identity",
    "module_key",
    "route_key",
    "grad_enabled",
    "Watched",
]

#: A context manager that does nothing (shared: entering it costs nothing).
NO_CONTEXT = contextlib.nullcontext()


class grad_enabled:
    """``torch.set_grad_enabled(mode)`` as a context manager, without its decorator
    machinery: a third of the cost, for the per-call paths that enter several (the fixed
    cost of a per-sample call on a small model is made of such microseconds)."""

    __slots__ = ("mode", "prev")

    def __init__(self, mode: bool) -> None:
        self.mode = mode
        self.prev = True

    def __enter__(self) -> None:
        self.prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(self.mode)

    def __exit__(self, *exc: Any) -> None:
        torch._C._set_grad_enabled(self.prev)


def is_nested() -> bool:
    """Whether we run inside a torch.func transform (vmap, grad, jvp) of an outer call."""
    return torch._C._functorch.maybe_current_level() is not None


def graph_mode(create_graph: object, *, call: str) -> tuple[Any, bool]:
    """How a Jacobian treats autograd graphs: a context to run it in, and whether the result
    is detached. See NOTE [no graph outlives its chunk].

    Returns:
        ``(context, detached)``: ``torch.enable_grad()`` and False with
        ``create_graph=True``; no change and True by default; no change and False inside an
        outer torch.func transform, whose gradient must flow through.

    Raises:
        JacobianOptionError: ``create_graph`` is not a bool.
    """
    if not isinstance(create_graph, bool):
        raise JacobianOptionError(
            f"{call}: create_graph={create_graph!r}, but it must be True or False: whether "
            f"the result is differentiable (True) or detached (False, the default)."
        )
    if is_nested():
        return NO_CONTEXT, False
    if create_graph:
        return torch.enable_grad(), False
    return NO_CONTEXT, True


def buffers_kept(f: object, modules: list[torch.nn.Module] | None = None,
                 primals: tuple[object, ...] = (),
                 found: tuple[list[torch.nn.Module], list[Tensor]] | None = None,
                 trees: dict[int, list[torch.nn.Module]] | None = None) -> Any:
    """Restores the buffers of the modules ``f`` uses, and the tensors it captures, if
    calling ``f`` changed them (NOTE [what a call puts back], in kept.py).

    The Jacobian functions call ``f`` more than once (a probe for the output size, a
    fallback, one call per product in a loop), and a module in training mode updates buffers
    on every call (BatchNorm's running statistics, spectral norm's power-iteration vectors).
    The modules are found from ``f`` itself (:func:`reached`): ``f`` a module, a bound
    method of one, a ``functools.partial``, or a function whose closure or globals name one
    (``lambda t: bn(t)``), with every module they hold (:func:`module_tree`: a BatchNorm kept
    in a plain list attribute too). Where any of them is in training mode, every buffer is
    saved first and any that changed is put back, so that nothing of the user's is mutated.
    The tensors found the same way (``lambda t: F.batch_norm(t, rm, rv, training=True)``'s
    ``rm`` and ``rv``) are saved and put back too, those small enough to copy.

    Args:
        f: the function.
        modules: ``modules_reached(f)``, where the caller has it already (then captured
            tensors are not kept).
        primals: the arguments ``f`` is called with: a module among them (``f(bn, x)``
            with ``argnums=1``) is kept too.
        found: ``reached(f)``, where the caller has it already (one walk per call).
        trees: ``module_tree`` of each module of ``found`` by its id, where the caller has
            them already.

    Returns:
        A context manager (one that does nothing when ``f`` reaches no module in training
        mode and no tensor it could keep).
    """
    tensors: list[Tensor] | None = None  # (None: not looked for)
    if modules is None:
        modules, tensors = found if found is not None else reached(f)
        modules = list(modules)  # (extended below: not the caller's list)
        if primals and not all(isinstance(p, Tensor) for p in primals):
            # (tensor primals reach no module: the walk of a tuple of them finds none)
            known = {id(m) for m in modules}
            modules += [m for m in modules_reached(primals) if id(m) not in known]
    if (not modules and not tensors) or is_nested():
        return NO_CONTEXT
    given = trees or {}
    trees = {id(m): given.get(id(m)) or module_tree((m,)) for m in modules}
    kept = module_buffers(trees.values()) if modules else []
    renormed = renormed_weights(trees.values()) if modules else []
    key = None
    captured = captured_kept(tensors, {id(t) for _, t in kept}) if tensors else []
    if captured:  # (NOTE [captured tensors, learned once] in kept.py)
        try:
            key = route_key(f)
            moves = MOVES.get(key)
        except TypeError:  # (an unhashable key: kept on every call)
            key, moves = None, None
        # (small tensors, where a state lives, are kept on every call; only larger ones,
        # weights, are left out once a call was seen to move none)
        kept += [(CAPTURED, t) for _, t in captured
                 if moves is not False or t.numel() < LEARNED_FROM]
        if moves is not None:
            key = None
    # (NOTE [one walk per call] in kept.py: the call reads the trees and tensors found here)
    return Walked(f, trees, tensors, Watched(kept, renormed) if kept or renormed else None,
                  key)


def captured_tensors(f: object) -> tuple[Tensor, ...]:
    """The tensors ``f`` reaches (:func:`reached`), as the running call's
    :func:`buffers_kept` found them (those it puts back and those it cannot: one
    collection, NOTE [what a call puts back]), but inference tensors (no version counter)."""
    found = walked_tensors(f)
    if found is None:
        found = reached(f)[1]
    return tuple(t for t in found if not t.is_inference())


_FLAG_TYPES = (bool, str, type(None))
_NUMBER_TYPES = (int, float)


def flag_of(v: object, numbers: bool = True) -> object:
    """What a plain value a function branches on contributes to a key that says whether an
    earlier decision still holds (the route of NOTE [auto, checked once], the per-sample
    plan of NOTE [the structure a plan is for]): a bool, str or None itself, a number's
    truth (``if l2:``, a coefficient switched on; a number that changes every call, a time
    step, must not make every call a first one), and ``NotImplemented`` for any other value
    (or for a number, without ``numbers``).

    Example:
        >>> flag_of(True), flag_of(0.0), flag_of(3), flag_of("lower"), flag_of([1])
        (True, False, True, 'lower', NotImplemented)
    """
    kind = type(v)
    if kind in _FLAG_TYPES:
        return v
    if numbers and kind in _NUMBER_TYPES:
        return bool(v)
    return NotImplemented


#: The attributes every nn.Module has (its registries, hooks, training flag): not searched
#: by :func:`module_tree`. Learned from a Module built on the first call, not at import: building
#: one logs torch's ``python.nn_module`` API usage, and ``TORCH_VJP_CHECKED=1`` imports this
#: package in every process that imports torch, one that never builds a module included.
_MODULE_ATTRS: frozenset[str] | None = None
_PLAIN_TYPES = frozenset({int, float, bool, str, type(None), Tensor, torch.nn.Parameter})


def module_own_attrs() -> frozenset[str]:
    """:data:`_MODULE_ATTRS`, learned on the first call (not at import: see there)."""
    global _MODULE_ATTRS
    if _MODULE_ATTRS is None:
        _MODULE_ATTRS = frozenset(torch.nn.Module().__dict__)
    return _MODULE_ATTRS


def module_tree(roots: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every module the ``roots`` hold, each once, in the order of ``Module.modules()``: the
    registered submodules, and the modules held in a plain list, tuple or dict attribute of
    any of them (``self.norms = [nn.BatchNorm1d(3)]``, which nn.Module does not register, and
    whose buffers ``modules()`` and ``buffers()`` therefore miss; the first
    :data:`ITEMS_SEARCHED` items of each), with theirs in turn. The plain attributes of
    torch.nn's own classes are not looked at: theirs hold no module (a Linear's are numbers;
    a Transformer's layers are in a ModuleList), and the look cost 1.7 us per module."""
    module_attrs = module_own_attrs()
    out: list[torch.nn.Module] = []
    seen: set[int] = set()
    stack = list(roots)[::-1]
    torch_classes = _TORCH_CLASSES
    while stack:
        m = stack.pop()
        i = id(m)
        if i in seen:
            continue
        seen.add(i)
        out.append(m)
        attrs = m.__dict__
        modules = attrs["_modules"]
        cls = type(m)
        own = torch_classes.get(cls)
        if own is None:
            own = torch_classes[cls] = (cls.__module__ or "").startswith("torch.nn.")
        if own and not modules:  # (a leaf of torch.nn's: most of a model)
            continue
        children = [c for c in modules.values() if c is not None]
        if not own:
            for name, value in attrs.items():  # (attributes of its own: containers?)
                if type(value) in _PLAIN_TYPES or name in module_attrs:
                    continue  # (a number, a string, a flag: the common case)
                items: Iterable[object]
                if isinstance(value, (list, tuple)):
                    items = value[:ITEMS_SEARCHED]
                elif isinstance(value, dict):
                    items = itertools.islice(value.values(), ITEMS_SEARCHED)
                else:
                    continue
                children += [c for c in items if isinstance(c, torch.nn.Module)]
        stack.extend(reversed(children))
    return out


#: class -> whether it is one of torch.nn's own (see :func:`module_tree`).
_TORCH_CLASSES: dict[type, bool] = {}


#: id -> (a weak reference to the object, its token): see :func:`identity`.
_IDENTITIES: dict[int, tuple[weakref.ref, int]] = {}
_TOKENS = itertools.count()
#: Builtin callables (they cannot be weakly referenced), held with their token.
_HELD: dict[int, tuple[object, int]] = {}
_BUILTIN_CALLABLES = (types.BuiltinFunctionType, types.MethodDescriptorType,
                      types.WrapperDescriptorType, types.MethodWrapperType,
                      types.ClassMethodDescriptorType)


def identity(obj: object) -> Hashable:
    """``obj``'s identity in a key that outlives it: its ``id`` and a token no later object
    shares. CPython gives a new object the address, so the ``id``, of one that died: a
    route remembered for a dead module was taken by a new module of the same type, whose
    Jacobian was then never checked. An object that cannot be weakly referenced (a
    ``__slots__`` class's, a bytearray) is held by the key instead, which compares by identity
    (lists, tuples and dicts count otherwise, see :func:`route_key`)."""
    i = id(obj)
    entry = _IDENTITIES.get(i)
    if entry is not None and entry[0]() is obj:
        return (i, entry[1])
    try:
        ref = weakref.ref(obj, functools.partial(_forget, i))
    except TypeError:
        if isinstance(obj, _BUILTIN_CALLABLES):
            # (torch.Tensor.exp, torch.sin: held, so that its address is not reused; a
            # token per call re-ran the check on every call and filled CHECKED)
            held = _HELD.get(i)
            if held is None or held[0] is not obj:
                held = _HELD[i] = (obj, next(_TOKENS))
            return (i, held[1])
        # (held by the key itself, so that its address is not reused while the key lives:
        # a token per call made every call a first one, and flooded CHECKED)
        return _Same(obj)
    token = next(_TOKENS)
    _IDENTITIES[i] = (ref, token)
    return (i, token)


class _Same:
    """An object that cannot be weakly referenced (a bytearray, a tuple or dict over
    :data:`_CONTENTS` items, a ``__slots__`` class's), as a key holds it: by identity,
    alive while the key is."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return type(other) is _Same and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _forget(i: int, ref: weakref.ref) -> None:
    entry = _IDENTITIES.get(i)
    if entry is not None and entry[0] is ref:
        del _IDENTITIES[i]


def route_key(f: object, depth: int = 3) -> Hashable:
    """Which function a remembered route is for: what f runs, as far as a cheap look can
    tell (NOTE [what a route key covers]). A function by its code, what its closure and
    defaults hold and the globals its code names (each by :func:`_held`); a bound method by
    its function and object; a ``functools.partial`` by its function and arguments; a module
    by :func:`module_key`; any other callable by :func:`identity` and type. Two functions
    made by one line over other operators (``make(op)``), two ``nn.Sequential`` of other
    layers, one whose layer was replaced (``model[0] = other``) or whose global helper was
    defined again have other keys; a lambda made anew each step over the same model and a
    new batch (a tensor, or a tuple of them) has the same, one over a new object of another
    kind each step (a dataclass) has a new one, and is checked again."""
    if isinstance(f, types.MethodType):
        return ("method", route_key(f.__func__, depth), _held(f.__self__, depth),
                type(f.__self__))
    if isinstance(f, functools.partial):
        return ("partial", route_key(f.func, depth), tuple(_held(a, depth) for a in f.args),
                tuple((k, _held(v, depth)) for k, v in sorted(f.keywords.items())))
    if isinstance(f, types.FunctionType):
        cells = []
        for c in f.__closure__ or ():
            try:
                cells.append(_held(c.cell_contents, depth))
            except ValueError:  # an empty cell
                cells.append(None)
        return ("function", f.__code__, tuple(cells),
                tuple(_held(d, depth) for d in f.__defaults__ or ()),
                tuple((name, _global(v, depth)) for name, v in named_globals(f)))
    if isinstance(f, torch.nn.Module):
        return module_key(f)
    return ("object", identity(f), type(f))


def _global(v: object, depth: int) -> Hashable:
    """A global a function names, as a key holds it: a Python module (``torch``, ``F``), and
    torch's own functions, whose code is not defined again between calls, by
    :func:`identity` (reading their globals in turn cost 70 us for ``F.cross_entropy``);
    anything else by :func:`_held`."""
    kind = type(v)
    if kind is types.ModuleType or (
            kind is types.FunctionType and (v.__module__ or "").startswith("torch")):
        return identity(v)
    return _held(v, depth)


def module_key(module: torch.nn.Module) -> Hashable:
    """A module as a route key holds it: the :func:`identity`, type and training flag of
    every module it holds (:func:`module_tree`: its registered submodules and those in a
    plain list attribute), so that replacing a layer (``model[0] = TriSolve()``), or
    switching train and eval mode, makes another key. (By identity, not by a weak
    reference, whose hash is the module's: a module class that defines ``__eq__`` has
    none.) Within a call, the tree :func:`buffers_kept` walked is read again."""
    tree = walked_tree(module)  # (the walk of this call's buffers_kept)
    if tree is None:
        tree = module_tree((module,))
    return ("module", tuple((identity(m), type(m), m.training) for m in tree))


# NOTE [what a route key covers]
# A route remembered by NOTE [auto, checked once] is taken unchecked by every later call
# with the same key, so the key must change wherever f may run other operators: a route
# checked for a layer's forward-mode formula is wrong for the layer that replaced it (the
# first check catches torch.triangular_solve's wrong formula; a remembered route would not).
# A function is keyed by its code and by what it reads besides its arguments: its closure
# cells and defaults, and the globals its code names (context.named_globals, as
# captured_values reads them: a helper defined again in a notebook is a new function); a
# module by every module it holds, each by identity, type and training flag (a layer
# replaced, one in a plain list attribute included; BatchNorm and dropout run otherwise in
# training mode). Values are held as _held says, ``depth`` levels deep. Not covered: the
# globals of a module's forward (its class's code) and of functions ``depth`` levels down,
# forward hooks added later, a module's plain attributes other than modules (a flag it
# branches on): such a change is not seen, and the remembered route is taken. The key is computed on every
# call of "auto" (measured with timeit on a shared 2-core CPU: 3 us for a lambda over a
# global tensor, 0.5 us before it read globals; 10 us for a Sequential of 6 modules, 80 us
# for one of 101; a Jacobian call of the smallest function costs about 320 us there): the
# module tree is walked once per call, for this key and buffers_kept alike (_Walked).


#: Immutable values a key holds as they are (none can be weakly referenced).
_VALUES = (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size, slice,
           range, complex, float, int, bytes, str, frozenset, type(None), type(Ellipsis))

#: Items of a list, tuple or dict a key reads, at most (a larger one: by identity).
_CONTENTS = 1024


def _held(v: object, depth: int) -> Hashable:
    if isinstance(v, Tensor):
        return ("T", tuple(v.shape), v.dtype, v.device)
    if isinstance(v, torch.nn.Module):
        return module_key(v)
    flag = flag_of(v)
    if flag is not NotImplemented:
        return flag
    if callable(v) and depth > 1 and isinstance(v, (types.FunctionType, types.MethodType,
                                                     functools.partial)):
        return route_key(v, depth - 1)
    if isinstance(v, _VALUES):  # (immutable values: by value)
        return ("value", type(v), v)
    if isinstance(v, numbers.Number) and not isinstance(v, Tensor):
        # (a NumPy scalar, a Decimal: by its truth, as flag_of takes a number)
        return ("number", type(v), bool(v))
    if depth > 1 and isinstance(v, tuple) and len(v) <= _CONTENTS:
        # (a tuple, a namedtuple, a torch.Size: by what it holds)
        return (type(v), tuple(_held(item, depth - 1) for item in v))
    if depth > 1 and isinstance(v, (list, dict)) and len(v) <= _CONTENTS:
        # (a list or dict changes in place, a log or a counter on every call: by its id,
        # which a new one takes over once it dies, and by the callables it holds, which
        # say what it runs)
        items = v.values() if isinstance(v, dict) else v
        return (id(v), type(v), tuple(_held(item, depth - 1) for item in items
                                      if callable(item) and not isinstance(item, Tensor)))
    return (identity(v), type(v))


def modules_reached(f: object, depth: int = 6) -> list[torch.nn.Module]:
    """The ``nn.Module`` objects a callable ``f`` can reach directly: itself, its bound
    ``__self__``, the function and arguments of a ``functools.partial``, ``__wrapped__``, the
    values a function's closure cells, defaults and the globals its code names hold, the
    attributes of a plain object (``lambda x: self.model(x)``, a callable wrapper object)
    and the items of a list, tuple or dict (the first :data:`ITEMS_SEARCHED`), recursively,
    ``depth`` levels, and at most :data:`OBJECTS_SEARCHED` objects in all (the search runs
    on every call). A module reached deeper, or only through a module it does not own, is
    not found."""
    return reached(f, depth)[0]
