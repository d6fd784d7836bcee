"""Where the engine runs: torch.func's own transforms, outer transforms around a call, the
autograd graph a result may keep, and the module buffers a call must put back.

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
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from torch_vjp._errors import JacobianOptionError

try:  # the undecorated originals: torch_vjp.checked() may replace torch.func.vjp
    from torch._functorch.eager_transforms import jvp as func_jvp
    from torch._functorch.eager_transforms import vjp as func_vjp
except ImportError:  # pragma: no cover - other torch layouts
    func_vjp = torch.func.vjp
    func_jvp = torch.func.jvp
try:  # torch.func.jacrev's own vjp: with argnums=0 its pullback returns a tensor, not a
    # 1-tuple, which saves vmap a pytree round trip per call (see NOTE [per-call overhead])
    from torch._functorch.eager_transforms import _vjp_with_argnums as vjp_with_argnums
except ImportError:  # pragma: no cover - other torch layouts
    vjp_with_argnums = None

__all__ = [
    "flag_of",
    "func_vjp",
    "func_jvp",
    "vjp_with_argnums",
    "NO_CONTEXT",
    "is_nested",
    "graph_mode",
    "buffers_kept",
    "modules_reached",
    "reached",
    "recording_connected",
    "captured_values",
    "named_globals",
    "module_tree",
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
                 primals: tuple[object, ...] = ()) -> Any:
    """Restores the buffers of the modules ``f`` uses if calling ``f`` changed them.

    The Jacobian functions call ``f`` more than once (a probe for the output size, a
    fallback, one call per product in a loop), and a module in training mode updates buffers
    on every call (BatchNorm's running statistics, spectral norm's power-iteration vectors).
    The modules are found from ``f`` itself (:func:`modules_reached`): ``f`` a module, a bound
    method of one, a ``functools.partial``, or a function whose closure or globals name one
    (``lambda t: bn(t)``), with every module they hold (:func:`module_tree`: a BatchNorm kept
    in a plain list attribute too). Where any of them is in training mode, every buffer is
    saved first and any that changed is put back, so that nothing of the user's is mutated.

    Args:
        f: the function.
        modules: ``modules_reached(f)``, where the caller has it already.
        primals: the arguments ``f`` is called with: a module among them (``f(bn, x)``
            with ``argnums=1``) is kept too.

    Returns:
        A context manager (one that does nothing when ``f`` reaches no module in training
        mode).
    """
    if modules is None:
        modules = modules_reached(f)
        if primals:
            known = {id(m) for m in modules}
            modules += [m for m in modules_reached(primals) if id(m) not in known]
    if not modules or is_nested():
        return NO_CONTEXT
    return _module_buffers_kept(modules)


#: Items of one container (or attributes of one object) :func:`modules_reached` searches.
_ITEMS_SEARCHED = 32
#: Objects :func:`modules_reached` looks at in all, whatever the depth.
_OBJECTS_SEARCHED = 256
_NOT_SEARCHED = (Tensor, str, bytes, int, float, complex, bool, type, types.ModuleType,
                 type(None))


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


def captured_values(func: types.FunctionType) -> Iterator[object]:
    """What a function reads besides its arguments: the contents of its closure cells (empty
    ones skipped) and the values of the globals its code names (those that exist)."""
    for cell in func.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
    for _, value in named_globals(func):
        yield value


def named_globals(func: types.FunctionType) -> Iterator[tuple[str, object]]:
    """The globals a function's code names that exist, each with its name (a name its code
    reads as an attribute, ``torch.sin``'s ``sin``, is skipped where no global has it)."""
    glob = func.__globals__
    for name in func.__code__.co_names:
        value = glob.get(name)
        if value is not None:
            yield name, value


#: The attributes every nn.Module has (its registries, hooks, training flag): not searched
#: by :func:`module_tree`.
_MODULE_ATTRS = frozenset(torch.nn.Module().__dict__)
_PLAIN_TYPES = frozenset({int, float, bool, str, type(None), Tensor, torch.nn.Parameter})


def module_tree(roots: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every module the ``roots`` hold, each once, in the order of ``Module.modules()``: the
    registered submodules, and the modules held in a plain list, tuple or dict attribute of
    any of them (``self.norms = [nn.BatchNorm1d(3)]``, which nn.Module does not register, and
    whose buffers ``modules()`` and ``buffers()`` therefore miss; the first
    :data:`_ITEMS_SEARCHED` items of each), with theirs in turn."""
    out: list[torch.nn.Module] = []
    seen: set[int] = set()
    stack = list(roots)[::-1]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        attrs = m.__dict__
        children = [c for c in attrs["_modules"].values() if c is not None]
        for name in attrs.keys() - _MODULE_ATTRS:  # (attributes of its own: containers?)
            value = attrs[name]
            if type(value) in _PLAIN_TYPES:  # (a number, a string, a flag: the common case)
                continue
            items: Iterable[object]
            if isinstance(value, (list, tuple)):
                items = value[:_ITEMS_SEARCHED]
            elif isinstance(value, dict):
                items = itertools.islice(value.values(), _ITEMS_SEARCHED)
            else:
                continue
            children += [c for c in items if isinstance(c, torch.nn.Module)]
        stack.extend(reversed(children))
    return out


def modules_reached(f: object, depth: int = 6) -> list[torch.nn.Module]:
    """The ``nn.Module`` objects a callable ``f`` can reach directly: itself, its bound
    ``__self__``, the function and arguments of a ``functools.partial``, ``__wrapped__``, the
    values a function's closure cells, defaults and the globals its code names hold, the
    attributes of a plain object (``lambda x: self.model(x)``, a callable wrapper object)
    and the items of a list, tuple or dict (the first :data:`_ITEMS_SEARCHED`), recursively,
    ``depth`` levels, and at most :data:`_OBJECTS_SEARCHED` objects in all (the search runs
    on every call). A module reached deeper, or only through a module it does not own, is
    not found."""
    return reached(f, depth)[0]


def reached(f: object, depth: int = 6) -> tuple[list[torch.nn.Module], list[Tensor]]:
    """The modules (:func:`modules_reached`) and the tensors ``f`` reaches the same way (a
    tensor in a closure cell, a default, a global, a ``partial``'s arguments, a dict of
    parameters ``f`` hands to ``functional_call``; not those inside the modules)."""
    found: dict[int, torch.nn.Module] = {}
    tensors: dict[int, Tensor] = {}
    seen: set[int] = set()

    # Runs on every call, so the common kinds (functions, bound methods) are read directly:
    # getattr with a default on a missing attribute raises and catches inside, ~0.3 us each.
    def visit_code(func: types.FunctionType, level: int) -> None:
        wrapped = func.__dict__.get("__wrapped__")
        if wrapped is not None:
            visit(wrapped, level - 1)
        for value in captured_values(func):
            visit(value, level - 1)
        for value in func.__defaults__ or ():
            visit(value, level - 1)
        if func.__kwdefaults__:
            for value in func.__kwdefaults__.values():
                visit(value, level - 1)

    def visit(obj: object, level: int) -> None:
        if isinstance(obj, Tensor):
            tensors[id(obj)] = obj
            return
        if isinstance(obj, _NOT_SEARCHED) or id(obj) in seen or len(seen) >= _OBJECTS_SEARCHED:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            found[id(obj)] = obj
            return
        if level <= 0:
            return
        kind = type(obj)
        if kind is types.FunctionType:
            visit_code(obj, level)
            return
        if kind is types.MethodType:
            visit(obj.__self__, level - 1)
            if type(obj.__func__) is types.FunctionType:
                visit_code(obj.__func__, level)
            return
        if isinstance(obj, (list, tuple)):
            for item in obj[:_ITEMS_SEARCHED]:
                visit(item, level - 1)
            return
        if isinstance(obj, dict):
            for item in itertools.islice(obj.values(), _ITEMS_SEARCHED):
                visit(item, level - 1)
            return
        if isinstance(obj, functools.partial):
            visit(obj.func, level - 1)
            for arg in (*obj.args, *obj.keywords.values()):
                visit(arg, level - 1)
            return
        owner = getattr(obj, "__self__", None)
        if owner is not None:
            visit(owner, level - 1)
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is not None:
            visit(wrapped, level - 1)
        func = getattr(obj, "__func__", obj)
        if type(func) is types.FunctionType:
            visit_code(func, level)
            return
        attrs = getattr(obj, "__dict__", None)  # a plain object: its attributes
        if isinstance(attrs, dict):
            for item in itertools.islice(attrs.values(), _ITEMS_SEARCHED):
                visit(item, level - 1)

    visit(f, depth)
    return list(found.values()), list(tensors.values())


class Watched:
    """Copies of named buffers and parameters, to put back what a forward changed in place.

    A buffer counts as changed where its values differ (kernels update running statistics
    without a version bump); a parameter where its version moved, values equal or not
    (Embedding's max_norm renormalises only the rows a batch looks up that are too long, so
    one batch may change nothing that the next one does). Also a context manager that puts
    them back on exit."""

    __slots__ = ("entries",)

    def __init__(
        self,
        buffers: Iterable[tuple[str, Tensor]] = (),
        params: Iterable[tuple[str, Tensor]] = (),
    ) -> None:
        self.entries = [(n, True, t, t.detach().clone(), t._version) for n, t in buffers]
        self.entries += [(n, False, t, t.detach().clone(), t._version) for n, t in params]

    def restore(self) -> dict[str, bool]:
        """Puts back what changed; the names of those that had, each with whether it is a
        buffer (a parameter once changed is reported on every later call)."""
        changed: dict[str, bool] = {}
        with torch.no_grad():
            for n, is_buffer, t, copy, version in self.entries:
                if is_buffer:
                    if not torch.equal(t, copy):
                        t.copy_(copy)
                        changed[n] = True
                elif t._version != version:
                    if not torch.equal(t, copy):
                        t.copy_(copy)
                    changed[n] = False
        return changed

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def _module_buffers_kept(modules: Sequence[torch.nn.Module]) -> Any:
    # (every module they hold, those in a plain list attribute too: :func:`module_tree`)
    tree = module_tree(modules)
    # (a module in training mode without buffers, as most are, needs no context)
    if not any(m.training for m in tree):
        return NO_CONTEXT
    seen: set[int] = set()
    buffers = []
    for m in tree:
        for b in m._buffers.values():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                buffers.append(("", b))
    return Watched(buffers) if buffers else NO_CONTEXT


def recording_connected(f: Callable[..., Any], has_aux: bool
                        ) -> tuple[Callable[..., Any], list[bool]]:
    """``f`` as torch.func.vjp calls it, recording into the list returned with it whether
    each flat output depends on the primals (requires grad at the transform's level), for
    :func:`torch_vjp._checks.check_cotangents`' ``connected``."""
    connected: list[bool] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        res = f(*args, **kwargs)
        out = res[0] if has_aux and isinstance(res, tuple) and len(res) == 2 else res
        connected[:] = [not isinstance(o, Tensor) or o.requires_grad for o in tree_leaves(out)]
        return res

    return recorded, connected
