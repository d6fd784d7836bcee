"""torch plugin hook that makes ``torch.vjp`` available on a plain ``import torch``.

Installing torch_vjp registers :func:`_autoload` in torch's plugin entry-point group
``torch.backends``. ``torch/__init__.py`` (``_import_device_backends``) calls every hook of
that group late in ``import torch`` and turns any exception into a ``RuntimeError`` that makes
``import torch`` fail. Hence the rules this module follows:

* It installs as its own top-level module (``_torch_vjp_autoload``, see ``setup.py``) and
  imports only the standard library at module level: loading the entry point imports this
  module outside any guard, so its import cannot depend on torch_vjp being healthy.
* :func:`_autoload` never raises. Whatever goes wrong becomes a ``RuntimeWarning`` naming
  torch_vjp and ``TORCH_VJP_AUTOLOAD=0``; ``import torch`` goes on normally.
* It stays cheap. By default nothing of torch_vjp runs at ``import torch``: the hook finds
  torch_vjp's import spec and registers a lazy module (see ``NOTE [lazy torch.vjp]``) as
  ``sys.modules["torch_vjp"]``, ``sys.modules["torch.vjp"]`` and ``torch.vjp``. The first
  attribute access, ``import torch_vjp`` or ``import torch.vjp`` executes torch_vjp in that
  same module object, so ``torch.vjp is torch_vjp`` always holds.
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
        if _is_off(os.environ.get("TORCH_VJP_AUTOLOAD")):
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
    if existing is not None and existing is not module:
        _warn(
            f"torch_vjp: torch already has an attribute `vjp` ({type(existing).__name__}); "
            f"left as it is, so torch.vjp is not torch_vjp. {_HOW_TO_TURN_OFF}"
        )
        return
    if module is None:
        checked = os.environ.get("TORCH_VJP_CHECKED", "").strip()
        if checked and not _is_off(checked):
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
# ``_lazy_module`` builds torch_vjp's module object from its spec without executing it and
# turns it into a ``_LazyModule``, as ``importlib.util.LazyLoader`` does, with three changes:
# * Thread safety: the first access executes the module under a lock; other threads wait for
#   it, while the executing thread itself (torch_vjp's own imports) reads the module as is.
# * ``__class__``, ``__name__``, ``__file__``, ``__cached__``, ``__loader__`` and ``__package__``
#   are answered without executing torch_vjp: ``isinstance`` checks and module scanners such
#   as ``inspect.getmodule`` read them. ``__spec__`` is not, so that ``import torch_vjp`` and
#   ``import torch.vjp`` (which read it) execute the module as a normal import would.
# * Failure: a torch_vjp that raises while executing leaves sys.modules and ``torch`` as a
#   failed import would (no ``torch_vjp``, no ``torch.vjp``), warns, and raises the error to
#   the code that touched the module. The lazy object returns to its unexecuted state, so a
#   reference kept to it raises the same error again instead of showing a half-run module.

_STATE_KEY = "__torch_vjp_lazy_state__"
_PASSTHROUGH = frozenset(
    {"__class__", "__name__", "__file__", "__cached__", "__loader__", "__package__", "__path__", "__spec__"}
)


class _LoadState:
    """What a ``_LazyModule`` needs to execute itself; kept in the module's own namespace."""

    __slots__ = ("spec", "initial", "lock", "loading_thread")

    def __init__(self, spec: importlib.machinery.ModuleSpec) -> None:
        self.spec = spec
        self.initial: dict[str, object] = {}
        self.lock = threading.RLock()
        self.loading_thread: int | None = None


class _LazyModule(types.ModuleType):
    """torch_vjp before first use; see ``NOTE [lazy torch.vjp]``."""

    def __getattribute__(self, name: str) -> object:
        if name not in _PASSTHROUGH:
            _execute(self)
        return types.ModuleType.__getattribute__(self, name)


def _lazy_module() -> types.ModuleType | None:
    """Register an unexecuted torch_vjp as ``sys.modules["torch_vjp"]``; None if not found."""
    spec = importlib.util.find_spec(_MODULE)
    if spec is None:
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
    module.__class__ = _LazyModule
    sys.modules[_MODULE] = module
    return module


def _execute(module: types.ModuleType) -> None:
    """Execute a ``_LazyModule`` in place, once; re-raise (after cleaning up) if it fails."""
    namespace = types.ModuleType.__getattribute__(module, "__dict__")
    state = namespace.get(_STATE_KEY)
    if state is None or state.loading_thread == threading.get_ident():
        return  # already executed, or torch_vjp's own code reading itself while it runs
    if _submodule_initializing():
        # ``import torch_vjp.x`` is running x's code, which reads its (still lazy) parent:
        # running the parent now would import x a second time, or import names from the
        # half-run x. The parent runs on the first access after x has finished.
        return
    with state.lock:
        if namespace.get(_STATE_KEY) is not state:
            return  # another thread executed it while this one waited
        state.loading_thread = threading.get_ident()
        try:
            state.spec.loader.exec_module(module)
        except BaseException as err:
            namespace.clear()
            namespace.update(state.initial)
            state.loading_thread = None
            if isinstance(err, Exception):
                _forget(module)
                _warn(
                    f"torch_vjp: importing torch_vjp on first use of torch.vjp failed "
                    f"({_describe(err)}); torch.vjp has been removed. Reinstall torch_vjp to "
                    f"fix it. {_HOW_TO_TURN_OFF}"
                )
            raise
        namespace.pop(_STATE_KEY, None)
        if type(module) is _LazyModule:  # unless torch_vjp gave itself a class of its own
            module.__class__ = types.ModuleType


def _submodule_initializing() -> bool:
    """Whether a ``torch_vjp.<name>`` module is being executed by an import right now."""
    prefix = _MODULE + "."
    for name, mod in list(sys.modules.items()):
        if name.startswith(prefix):
            spec = getattr(mod, "__spec__", None)
            if spec is not None and getattr(spec, "_initializing", False):
                return True
    return False


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


def _is_off(value: str | None) -> bool:
    """Whether an environment value is one of ``0``, ``false``, ``no``, ``off``."""
    return value is not None and value.strip().lower() in _OFF_VALUES


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
