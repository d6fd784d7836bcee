"""torch plugin hook that makes ``torch.vjp`` available on a plain ``import torch``.

Installing torch_vjp registers :func:`_autoload` in torch's plugin entry-point group
``torch.backends``. ``torch/__init__.py`` (``_import_device_backends``) calls every hook of
that group late in ``import torch`` and turns any exception into a ``RuntimeError`` that makes
``import torch`` fail. Hence the rules this module follows:

* It installs as its own top-level module (``_torch_vjp_autoload``), a real file in the
  install location in every install mode, editable ones included (see ``setup.py``), and
  imports only the standard library at module level: loading the entry point imports this
  module outside any guard, so its import cannot depend on torch_vjp, or the checkout an
  editable install points to, being there and healthy.
* :func:`_autoload` never raises. Whatever goes wrong becomes a ``RuntimeWarning`` naming
  torch_vjp and ``TORCH_VJP_AUTOLOAD=0``; ``import torch`` goes on normally.
* It stays cheap. By default nothing of torch_vjp runs at ``import torch``: the hook finds
  torch_vjp's import spec and registers a lazy module (see ``NOTE [lazy torch.vjp]``) as
  ``torch.vjp`` and ``sys.modules["torch.vjp"]``. The first use (``import torch_vjp``, or
  reading an attribute of ``torch.vjp``) imports torch_vjp, as a normal import would (errors
  included), into that same module object, so ``torch.vjp is torch_vjp`` holds.
* With ``TORCH_VJP_CHECKED`` set (to anything but an empty string, ``0``, ``false``, ``no`` or
  ``off``), the hook imports torch_vjp at once, so that its process-wide checks are active
  with no code change. ``torch.autograd`` and ``torch.func`` are already imported at that
  point of ``import torch``.

Environment:
    TORCH_VJP_AUTOLOAD: ``0`` (or ``false``, ``no``, ``off``) turns the hook off;
        ``torch.vjp`` then exists only after ``import torch_vjp``.
    TORCH_DEVICE_BACKEND_AUTOLOAD: torch's own switch; ``0`` skips every ``torch.backends``
        hook, this one included.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
import types
import warnings

_MODULE = "torch_vjp"
_ALIAS = "torch.vjp"
_OFF_VALUES = frozenset({"0", "false", "no", "off"})
_HOW_TO_TURN_OFF = "Set TORCH_VJP_AUTOLOAD=0 to stop torch from loading torch_vjp."


def _autoload() -> None:
    """Make ``torch.vjp`` available while torch is being imported; never raises.

    Called by torch for the ``torch.backends`` entry point ``torch_vjp``. Does nothing when
    ``TORCH_VJP_AUTOLOAD`` is ``0``. Otherwise registers torch_vjp, lazily (or imported at
    once when ``TORCH_VJP_CHECKED`` is set), as ``torch.vjp`` and ``sys.modules["torch.vjp"]``.
    Any failure is reported as a ``RuntimeWarning`` instead of raised.

    Example:
        >>> import torch, torch_vjp
        >>> torch.vjp is torch_vjp
        True
    """
    try:
        if not env_flag("TORCH_VJP_AUTOLOAD", default=True):
            return
        _attach()
    except Exception as err:  # the hook must never make ``import torch`` fail
        _warn(
            f"torch_vjp: the torch plugin hook failed ({_describe(err)}), so torch.vjp may "
            f"not be available; torch itself imported normally. `import torch_vjp` makes "
            f"torch.vjp available. {_HOW_TO_TURN_OFF}"
        )


def _attach() -> None:
    """Find or create the torch_vjp module object and alias it as ``torch.vjp``."""
    torch = sys.modules.get("torch")
    if torch is None:  # not called from ``import torch``: there is nothing to attach to
        return
    module = sys.modules.get(_MODULE)
    existing = vars(torch).get("vjp")
    if module is None and _pending_state(existing) is not None:
        return  # attached by an earlier call, and not imported yet
    if existing is not None and existing is not module:
        _warn(
            f"torch_vjp: torch already has an attribute `vjp` ({type(existing).__name__}); "
            f"left as it is, so torch.vjp is not torch_vjp. {_HOW_TO_TURN_OFF}"
        )
        return
    if module is None:
        if env_flag("TORCH_VJP_CHECKED"):
            module = _import_now(note=" TORCH_VJP_CHECKED is set, but checking is not on.")
        else:
            module = _lazy_module()
        if module is None:
            return
    # else: ``import torch_vjp`` came first and is importing torch; torch_vjp aliases itself
    # when it finishes, and aliasing it now keeps ``torch.vjp`` right in between.
    if sys.modules.get(_ALIAS) is not module:
        sys.modules[_ALIAS] = module
    torch.vjp = module


def _import_now(note: str = "") -> types.ModuleType | None:
    """Import torch_vjp normally; on failure warn, undo its aliases and return None."""
    try:
        return importlib.import_module(_MODULE)
    except Exception as err:
        _forget(None)
        _warn(
            f"torch_vjp: importing torch_vjp failed ({_describe(err)}), so torch.vjp is not "
            f"available; torch itself imported normally.{note} Reinstall torch_vjp to fix "
            f"it. {_HOW_TO_TURN_OFF}"
        )
        return None


# NOTE [lazy torch.vjp]
# ``_lazy_module`` builds torch_vjp's module object from its spec without executing it, makes
# it a ``_LazyModule`` and registers it as ``torch.vjp`` and ``sys.modules["torch.vjp"]``,
# but not as ``sys.modules["torch_vjp"]``: torch_vjp is not imported yet. A ``_LazyImporter``
# at the front of ``sys.meta_path`` hands this same object to the import system when
# torch_vjp is imported, and executes it there. So torch_vjp is only ever loaded by a normal
# import, with the import system's per-module locks:
# * ``import torch_vjp``, ``from torch_vjp import x`` and ``import torch_vjp.sub`` import it
#   as if the hook had never run (the package before its submodules, errors raised at the
#   import statement), into the object that is already ``torch.vjp``.
# * Any other use (``torch.vjp.jacobian``) first runs ``import torch_vjp``. Only
#   ``__class__``, ``__name__``, ``__file__``, ``__cached__``, ``__loader__``, ``__package__``,
#   ``__path__`` and ``__spec__`` are answered without importing: ``isinstance`` checks and
#   module scanners such as ``inspect.getmodule`` read them, and so does the import system,
#   also while it loads the module and to find out whether to wait for another thread
#   loading it. (``import torch.vjp`` reads only ``__spec__``, so it binds the unimported
#   module; C code there would swallow an error raised on that read.)
# * Threads: a thread that touches the module while another is loading it waits for that
#   load through the import system (which also resolves a concurrent circular import as it
#   would for any module). The loading thread itself, and so torch_vjp's own code, reads
#   the module as it stands, as in any import.
# * Failure: a torch_vjp that raises while executing leaves sys.modules and ``torch`` as a
#   failed import would (no ``torch_vjp``, no ``torch.vjp``); a first use through an
#   attribute warns that ``torch.vjp`` is gone. The lazy object returns to its unexecuted
#   state, so a reference kept to it raises the error again instead of showing a half-run
#   module.

_STATE_KEY = "__torch_vjp_lazy_state__"
_PASSTHROUGH = frozenset(
    {
        "__class__",
        "__name__",
        "__file__",
        "__cached__",
        "__loader__",
        "__package__",
        "__path__",
        "__spec__",
    }
)


class _LoadState:
    """What a ``_LazyModule`` needs to be imported; kept in the module's own namespace."""

    __slots__ = ("spec", "importer", "initial", "loading_thread", "loads")

    def __init__(self, spec: importlib.machinery.ModuleSpec) -> None:
        self.spec = spec
        self.importer: _LazyImporter | None = None
        self.initial: dict[str, object] = {}
        self.loading_thread: int | None = None  # the thread loading it now
        self.loads = 0  # loads begun


class _LazyModule(types.ModuleType):
    """torch_vjp before it is imported; see ``NOTE [lazy torch.vjp]``."""

    def __getattribute__(self, name: str) -> object:
        if name not in _PASSTHROUGH:
            _execute(self)
        return types.ModuleType.__getattribute__(self, name)


class _LazyImporter:
    """Meta path finder and loader that imports the pending ``_LazyModule`` in place."""

    def __init__(self, module: types.ModuleType, spec: importlib.machinery.ModuleSpec) -> None:
        self.module = module
        self.spec = spec  # torch_vjp's own spec, with its own loader

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _MODULE:
            return None
        if _pending_state(self.module) is None:
            self.remove()
            return None
        spec = importlib.machinery.ModuleSpec(
            _MODULE,
            self,
            origin=self.spec.origin,
            is_package=self.spec.submodule_search_locations is not None,
        )
        spec.submodule_search_locations = self.spec.submodule_search_locations
        spec.cached = self.spec.cached
        spec.has_location = self.spec.has_location
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        state = _pending_state(self.module)
        if state is None:
            return None  # imported meanwhile: exec_module loads a fresh module
        state.loading_thread = threading.get_ident()
        state.loads += 1
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        state = _pending_state(module)
        if module is not self.module or state is None:
            self.spec.loader.exec_module(module)
            return
        namespace = types.ModuleType.__getattribute__(module, "__dict__")
        try:
            self.spec.loader.exec_module(module)
        except BaseException:
            namespace.clear()
            namespace.update(state.initial)
            state.loading_thread = None
            _forget(module)
            raise
        _finish(module, state)

    def remove(self) -> None:
        """Take this importer off ``sys.meta_path``."""
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass

    # While torch_vjp loads, its ``__spec__.loader`` is this importer: the loader methods
    # that code may ask of it then (``importlib.resources``, ``pkgutil.get_data``, ...) are
    # torch_vjp's own loader's.
    def __getattr__(self, name: str) -> object:
        if name not in _LOADER_METHODS:
            raise AttributeError(name)
        return getattr(self.spec.loader, name)


_LOADER_METHODS = frozenset(
    {"get_code", "get_data", "get_filename", "get_resource_reader", "get_source", "is_package"}
)


def _lazy_module() -> types.ModuleType | None:
    """Register an unexecuted torch_vjp as ``torch.vjp``; None if torch_vjp is not found."""
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or spec.origin in (None, "namespace"):  # a folder without ``__init__``
        _warn(
            f"torch_vjp: its torch plugin entry point is installed but the package torch_vjp "
            f"cannot be found, so torch.vjp is not available; torch itself imported normally. "
            f"Reinstall or uninstall torch_vjp. {_HOW_TO_TURN_OFF}"
        )
        return None
    if spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return _import_now()
    module = importlib.util.module_from_spec(spec)
    namespace = vars(module)
    state = _LoadState(spec)
    namespace[_STATE_KEY] = state
    state.initial = dict(namespace)
    state.importer = _LazyImporter(module, spec)
    module.__class__ = _LazyModule
    for finder in list(sys.meta_path):  # importers of earlier lazy modules, never imported
        if isinstance(finder, _LazyImporter):
            finder.remove()
    sys.meta_path.insert(0, state.importer)
    return module


def _pending_state(obj: object) -> _LoadState | None:
    """The load state of a ``_LazyModule`` not imported yet; None for anything else."""
    try:
        if not isinstance(obj, types.ModuleType):
            return None
        return types.ModuleType.__getattribute__(obj, "__dict__").get(_STATE_KEY)
    except Exception:
        return None


def _finish(module: types.ModuleType, state: _LoadState) -> None:
    """Turn a ``_LazyModule`` whose import succeeded into a plain module."""
    namespace = types.ModuleType.__getattribute__(module, "__dict__")
    namespace.pop(_STATE_KEY, None)
    state.loading_thread = None
    if type(module) is _LazyModule:  # unless torch_vjp gave itself a class of its own
        module.__class__ = types.ModuleType
    spec = namespace.get("__spec__")
    if spec is not None and spec.loader is state.importer:
        namespace["__spec__"] = state.spec  # what a normal import of torch_vjp leaves
    if state.importer is not None:
        state.importer.remove()


def _execute(module: types.ModuleType) -> None:
    """Import a pending ``_LazyModule`` (or wait for the thread importing it); see the NOTE.

    Re-raises the import's error; when that failure removed ``torch.vjp``, also warns.
    """
    state = _pending_state(module)
    if state is None or state.loading_thread == threading.get_ident():
        return  # imported, or this thread is importing it
    torch = sys.modules.get("torch")
    attached = torch is not None and vars(torch).get("vjp") is module
    try:
        # Each round either loads it in this thread (which returns, or raises its error) or
        # waits for another thread's load; after a failed one, this thread tries itself.
        while True:
            if state.loading_thread is None and sys.modules.get(_MODULE) is module:
                del sys.modules[_MODULE]  # put there by hand, not imported: import it
            loading, loads = state.loading_thread, state.loads
            imported = __import__(_MODULE)
            if _pending_state(module) is not state:
                return  # imported
            if state.loading_thread is not None:
                if (state.loading_thread, state.loads) == (loading, loads):
                    # the import system gave up waiting for that same load: a concurrent
                    # circular import, where the module is read as it stands
                    return
                continue  # another thread began a new load (the one waited for failed)
            if imported is not module:
                # torch_vjp was imported into another module object, past the hook's
                # importer: make this one show the same module.
                namespace = types.ModuleType.__getattribute__(module, "__dict__")
                namespace.update(vars(imported))
                _finish(module, state)
                return
    except Exception as err:
        if attached and vars(torch).get("vjp") is not module:
            _warn(
                f"torch_vjp: importing torch_vjp on first use of torch.vjp failed "
                f"({_describe(err)}); torch.vjp has been removed. Reinstall torch_vjp to "
                f"fix it. {_HOW_TO_TURN_OFF}"
            )
        raise


def _forget(module: types.ModuleType | None) -> None:
    """Remove ``torch_vjp``/``torch.vjp`` entries left by a failed import of torch_vjp.

    Removes ``module`` itself when given, and any other module named ``torch_vjp`` that is
    no longer ``sys.modules["torch_vjp"]`` (aliases a failed eager import made of itself).
    """
    try:
        current = sys.modules.get(_MODULE)

        def stale(obj: object) -> bool:
            if obj is None:
                return False
            if obj is module:
                return True
            return (
                isinstance(obj, types.ModuleType)
                and type(obj) is types.ModuleType
                and obj is not current
                and vars(obj).get("__name__") == _MODULE
            )

        if module is not None and current is module:
            del sys.modules[_MODULE]
        if stale(sys.modules.get(_ALIAS)):
            del sys.modules[_ALIAS]
        torch = sys.modules.get("torch")
        if torch is not None and stale(vars(torch).get("vjp")):
            delattr(torch, "vjp")
    except Exception:  # cleaning up must not hide the error being reported
        pass


def env_flag(name: str, default: bool = False) -> bool:
    """Whether the environment variable ``name`` turns its switch on: ``default`` when it is
    unset or empty, off for ``0``, ``false``, ``no`` or ``off``, on for anything else (case
    and surrounding spaces ignored). The one rule by which torch_vjp reads its switches
    (``TORCH_VJP_AUTOLOAD``, ``TORCH_VJP_CHECKED``): the same function as
    ``torch_vjp._errors.env_flag``, held here too because this module imports nothing of
    torch_vjp (a wheel installs it as its own top-level module); a test checks that the two
    agree."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in _OFF_VALUES


def _describe(err: BaseException) -> str:
    """``"ValueError: message"`` for a warning, never raising."""
    try:
        return f"{type(err).__name__}: {err}"
    except Exception:
        return type(err).__name__


# Frames a warning is not attributed to: this module, the import system and torch's
# ``__init__``, so that it points at the user's ``import torch`` or use of ``torch.vjp``.
_INTERNAL_MODULES = frozenset(
    {
        __name__,
        "torch",
        "importlib",
        "importlib.util",
        "importlib._bootstrap",
        "importlib._bootstrap_external",
    }
)


def _stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` call in :func:`_warn`: the first outside frame."""
    try:
        frame = sys._getframe(2)  # the caller of _warn; stacklevel 2 from warnings.warn
        level = 2
        while frame is not None and frame.f_globals.get("__name__") in _INTERNAL_MODULES:
            frame = frame.f_back
            # warnings.warn does not count the import system's bootstrap frames
            filename = frame.f_code.co_filename if frame is not None else ""
            if not ("importlib" in filename and "_bootstrap" in filename):
                level += 1
        return level if frame is not None else 2
    except Exception:
        return 2


def _warn(message: str) -> None:
    """Emit a ``RuntimeWarning``; if warnings are errors, write to stderr instead."""
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=_stacklevel())
    except Exception:
        try:
            sys.stderr.write(f"RuntimeWarning: {message}\n")
        except Exception:
            pass
