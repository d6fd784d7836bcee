"""The torch namespace plugin (SPEC §7): ``import torch`` provides ``torch.vjp``.

The hook runs inside ``import torch``, so each test runs a fresh interpreter
(``sys.executable``) on a small script and checks what it printed, its warnings and its exit
status. The entry point exists only once the package is pip-installed (editable is fine);
without it those tests are skipped, and say so.

A broken torch_vjp is simulated with a ``torch_vjp`` package placed first on ``PYTHONPATH``
whose ``__init__`` raises; a failing hook, by making ``importlib.util.find_spec`` raise for
``torch_vjp`` in the child before it imports torch.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HOOK_SOURCE = REPO / "torch_vjp" / "_autoload" / "__init__.py"
BROKEN_MESSAGE = "simulated broken torch_vjp"


def _entry_point() -> importlib.metadata.EntryPoint | None:
    for entry_point in importlib.metadata.entry_points(group="torch.backends"):
        if entry_point.name == "torch_vjp":
            return entry_point
    return None


ENTRY_POINT = _entry_point()
needs_install = pytest.mark.skipif(
    ENTRY_POINT is None,
    reason="torch_vjp is not pip-installed: torch's 'torch.backends' entry point 'torch_vjp' "
    "does not exist (run `pip install -e .`)",
)


def run_python(
    tmp_path: Path,
    code: str,
    *,
    env: dict[str, str] | None = None,
    path: tuple[Path, ...] = (),
    flags: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as ``script.py`` in a fresh interpreter; fail the test if it fails.

    The child starts in ``tmp_path`` (so the repository root is not on its path), without
    the caller's ``TORCH_VJP_*``, ``TORCH_DEVICE_BACKEND_AUTOLOAD`` and ``PYTHONWARNINGS``,
    with ``env`` added and ``path`` put first on ``PYTHONPATH``.
    """
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    environ = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("TORCH_VJP_")
        and key not in ("TORCH_DEVICE_BACKEND_AUTOLOAD", "PYTHONWARNINGS")
    }
    environ.update(env or {})
    pythonpath = [str(p) for p in path]
    if environ.get("PYTHONPATH"):
        pythonpath.append(environ["PYTHONPATH"])
    if pythonpath:
        environ["PYTHONPATH"] = os.pathsep.join(pythonpath)
    result = subprocess.run(
        [sys.executable, *flags, str(script)],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"child failed:\n{result.stdout}\n{result.stderr}"
    return result


def broken_torch_vjp(tmp_path: Path, body: str | None = None) -> Path:
    """A folder holding a ``torch_vjp`` package whose import raises (or runs ``body``)."""
    folder = tmp_path / "shadow"
    package = folder / "torch_vjp"
    package.mkdir(parents=True)
    if body is None:
        body = f"raise ImportError({BROKEN_MESSAGE!r})\n"
    (package / "__init__.py").write_text(textwrap.dedent(body))
    return folder


def plugin_warnings(stderr: str) -> list[str]:
    """The lines of ``stderr`` that are warnings from the plugin."""
    return [line for line in stderr.splitlines() if "RuntimeWarning: torch_vjp" in line]


def assert_warned(stderr: str, *fragments: str) -> None:
    """Exactly one plugin warning, naming torch_vjp, the switch-off and ``fragments``."""
    lines = plugin_warnings(stderr)
    assert len(lines) == 1, stderr
    for fragment in ("torch_vjp", "Set TORCH_VJP_AUTOLOAD=0", *fragments):
        assert fragment in lines[0], lines[0]


# --- the hook module ---------------------------------------------------------------------


def _module_level_imports(tree: ast.Module) -> list[tuple[str, int]]:
    """(module, level) of every import statement outside functions and classes."""
    found = []
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level))
        pending.extend(ast.iter_child_nodes(node))
    return found


def test_hook_module_imports_only_the_standard_library():
    imports = _module_level_imports(ast.parse(HOOK_SOURCE.read_text()))
    assert imports, "no imports found: the AST walk is broken"
    allowed = set(sys.stdlib_module_names) | {"__future__"}
    outside = [name for name, level in imports if level or name.split(".")[0] not in allowed]
    assert outside == []


@pytest.mark.parametrize(
    ("value", "default", "on"),
    [
        (None, True, True),
        ("", True, True),
        ("1", True, True),
        ("yes", True, True),
        ("0", True, False),
        (" 0 ", True, False),
        ("false", True, False),
        ("No", True, False),
        ("OFF", True, False),
        (None, False, False),
        ("", False, False),
        ("1", False, True),
        (" off ", False, False),
    ],
    ids=["unset", "empty", "1", "yes", "0", "padded-0", "false", "No", "OFF",
         "unset-default-off", "empty-default-off", "1-default-off", "padded-off-default-off"],
)
def test_switch_values(monkeypatch, value, default, on):
    spec = importlib.util.spec_from_file_location("_hook_under_test", HOOK_SOURCE)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    if value is None:
        monkeypatch.delenv("TORCH_VJP_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("TORCH_VJP_TEST_SWITCH", value)
    assert hook.env_flag("TORCH_VJP_TEST_SWITCH", default=default) is on


@needs_install
def test_entry_point_targets_an_installed_copy_of_this_checkout_hook():
    hook = ENTRY_POINT.load()
    module = sys.modules[ENTRY_POINT.module]
    assert hook is module._autoload
    assert callable(hook)
    installed = Path(module.__file__).read_bytes()
    assert installed == HOOK_SOURCE.read_bytes(), (
        f"the installed hook {module.__file__} differs from {HOOK_SOURCE}: reinstall the package"
    )
    # A file in the install location, even in an editable install (see setup.py), so that
    # ``import torch`` does not depend on this checkout staying where it is. This also
    # checks setup.py against the setuptools that installed the package.
    location = Path(module.__file__).resolve()
    assert REPO not in location.parents, (
        f"the hook {location} is this checkout's file, not a copy: reinstall the package, "
        f"or setup.py no longer works with this setuptools"
    )


@needs_install
def test_hook_module_loads_neither_torch_nor_torch_vjp(tmp_path):
    result = run_python(
        tmp_path,
        f"""
        import sys
        import {ENTRY_POINT.module}
        print(sorted(m for m in ("torch", "torch_vjp", "torch.vjp") if m in sys.modules))
        """,
    )
    assert result.stdout.split() == ["[]"]


# --- autoload ----------------------------------------------------------------------------


@needs_install
def test_import_torch_provides_torch_vjp_without_running_it(tmp_path):
    result = run_python(
        tmp_path,
        f"""
        import importlib, sys, types
        import torch

        lazy = torch.vjp
        assert sys.modules["torch.vjp"] is lazy and isinstance(lazy, types.ModuleType)
        # nothing of torch_vjp has run yet: it is not even imported
        assert type(lazy) is not types.ModuleType
        assert "torch_vjp" not in sys.modules and "torch_vjp._errors" not in sys.modules
        # a second call of the hook changes nothing
        importlib.import_module({ENTRY_POINT.module!r})._autoload()
        assert torch.vjp is lazy and "torch_vjp" not in sys.modules
        error = torch.vjp.TorchVJPError  # first use imports torch_vjp into this same object
        assert type(lazy) is types.ModuleType and sys.modules["torch_vjp"] is lazy
        # as a normal import leaves it, and the hook's importer is gone
        assert lazy.__spec__.loader is lazy.__loader__
        assert not [f for f in sys.meta_path if type(f).__name__ == "_LazyImporter"]

        import torch_vjp

        assert torch_vjp is lazy and torch.vjp is torch_vjp
        assert sys.modules["torch.vjp"] is torch_vjp
        assert torch.vjp.TorchVJPError is torch_vjp.TorchVJPError is error
        assert torch.vjp.grad is torch_vjp.grad
        print("ok")
        """,
    )
    assert result.stdout.split() == ["ok"]
    assert plugin_warnings(result.stderr) == []


@needs_install
@pytest.mark.parametrize(
    "statement",
    [
        "import torch.vjp",
        "from torch.vjp import TorchVJPError",
    ],
    ids=["import-torch.vjp", "from-torch.vjp-import"],
)
def test_torch_vjp_import_statements(tmp_path, statement):
    result = run_python(
        tmp_path,
        f"""
        import sys
        {statement}
        import torch, torch_vjp
        assert torch.vjp is torch_vjp and sys.modules["torch.vjp"] is torch_vjp
        assert issubclass(torch.vjp.TorchVJPError, Exception)
        print("ok")
        """,
    )
    assert result.stdout.split() == ["ok"]


@needs_install
def test_import_torch_vjp_before_torch(tmp_path):
    result = run_python(
        tmp_path,
        """
        import sys, types
        import torch_vjp
        import torch
        assert type(torch_vjp) is types.ModuleType
        assert torch.vjp is torch_vjp and sys.modules["torch.vjp"] is torch_vjp
        import torch.vjp
        print("ok")
        """,
    )
    assert result.stdout.split() == ["ok"]
    assert plugin_warnings(result.stderr) == []


@needs_install
def test_torch_vjp_imported_past_the_hook_still_shows_in_torch_vjp(tmp_path):
    # torch_vjp loaded into a module object of its own, not the one the hook registered (as
    # an import hook placed before the hook's importer could do): a reference kept to the
    # registered one then shows that module too
    result = run_python(
        tmp_path,
        """
        import importlib.util, sys, types
        import torch

        lazy = torch.vjp
        spec = lazy.__spec__
        module = importlib.util.module_from_spec(spec)
        sys.modules["torch_vjp"] = module
        spec.loader.exec_module(module)
        assert module is not lazy and torch.vjp is module
        print(lazy.grad is module.grad, type(lazy) is types.ModuleType)
        print([f for f in sys.meta_path if type(f).__name__ == "_LazyImporter"])
        """,
    )
    assert result.stdout.split() == ["True", "True", "[]"]
    assert plugin_warnings(result.stderr) == []


@needs_install
@pytest.mark.parametrize(
    "env",
    [
        {"TORCH_VJP_AUTOLOAD": "0"},
        {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    ],
    ids=["TORCH_VJP_AUTOLOAD=0", "TORCH_DEVICE_BACKEND_AUTOLOAD=0"],
)
def test_autoload_switched_off(tmp_path, env):
    result = run_python(
        tmp_path,
        """
        import sys
        import torch
        print(hasattr(torch, "vjp"), "torch.vjp" in sys.modules, "torch_vjp" in sys.modules)
        import torch_vjp
        import torch.vjp
        assert torch.vjp is torch_vjp and sys.modules["torch.vjp"] is torch_vjp
        print("ok")
        """,
        env=env,
    )
    assert result.stdout.split() == ["False", "False", "False", "ok"]


@needs_install
def test_checked_env_turns_checking_on_with_no_code_change(tmp_path):
    result = run_python(
        tmp_path,
        """
        import sys, types
        import torch

        module = sys.modules["torch_vjp"]
        assert type(module) is types.ModuleType  # imported by the hook, not lazily
        assert torch.vjp is module
        x = torch.ones(4, requires_grad=True)
        try:
            (x * 2).backward(torch.ones(3))
        except Exception as err:
            print(type(err).__name__, isinstance(err, module.GradOutputsError))
        """,
        env={"TORCH_VJP_CHECKED": "1"},
    )
    assert result.stdout.split() == ["GradOutputsError", "True"]
    assert plugin_warnings(result.stderr) == []


@needs_install
def test_unrelated_torch_use_does_not_run_torch_vjp(tmp_path):
    # isinstance, module scanners, the TorchScript builtin table (dir(torch)) and pickling a
    # layout (which scans torch's namespace) must not execute the lazy module.
    result = run_python(
        tmp_path,
        """
        import inspect, pickle, sys, types
        import torch

        assert not isinstance(torch.vjp, torch.layout)
        inspect.getmodule(sys._getframe())
        torch.jit._builtins._get_builtin_table()
        assert pickle.loads(pickle.dumps(torch.sparse_coo)) is torch.sparse_coo
        x = torch.randn(3, requires_grad=True)
        (x ** 2).sum().backward()
        print("torch_vjp" in sys.modules, type(torch.vjp) is types.ModuleType)
        """,
    )
    assert result.stdout.split() == ["False", "False"]


@needs_install
def test_concurrent_first_use_runs_torch_vjp_once(tmp_path):
    shadow = broken_torch_vjp(
        tmp_path,
        """
        import builtins, time
        builtins.torch_vjp_runs = getattr(builtins, "torch_vjp_runs", 0) + 1
        time.sleep(0.2)
        VALUE = 42
        """,
    )
    result = run_python(
        tmp_path,
        """
        import builtins, threading
        import torch

        barrier = threading.Barrier(8)
        seen = []

        def use():
            barrier.wait()
            seen.append(torch.vjp.VALUE)

        threads = [threading.Thread(target=use) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(builtins.torch_vjp_runs, seen)
        """,
        path=(shadow,),
    )
    assert result.stdout.strip() == "1 [42, 42, 42, 42, 42, 42, 42, 42]"


CONCURRENT_USE = """
import importlib, sys, threading, types
import torch

hook = importlib.import_module(HOOK)
NAMES = ("jacobian", "per_sample_grads", "TorchVJPError", "check_function", "vjp", "hessian",
         "compare_strategies", "__version__")
THREADS = len(NAMES)


def unimport():
    \"\"\"Back to the state right after ``import torch``: torch.vjp attached, nothing run.\"\"\"
    for name in [n for n in sys.modules if n == "torch_vjp" or n.startswith("torch_vjp.")]:
        del sys.modules[name]
    sys.modules.pop("torch.vjp", None)
    vars(torch).pop("vjp", None)
    hook._autoload()
    assert type(torch.vjp) is not types.ModuleType, "torch.vjp was imported at once"


def first_use(how):
    barrier = threading.Barrier(THREADS)
    seen = {}

    def use(name):
        barrier.wait()
        try:
            if how == "import torch_vjp in each thread":
                import torch_vjp as module
            elif how == "torch.vjp":
                module = torch.vjp
            else:
                module = tv
            seen[name] = getattr(module, name)
        except BaseException as err:
            seen[name] = err

    if how == "import torch; import torch_vjp":
        import torch_vjp as tv
    threads = [threading.Thread(target=use, args=(name,)) for name in NAMES]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    import torch_vjp
    assert torch.vjp is torch_vjp and sys.modules["torch.vjp"] is torch_vjp
    return [
        f"{how}: {name}: {seen[name]!r}"
        for name in NAMES
        if seen[name] is not getattr(torch_vjp, name)
    ]


problems = []
for round_index in range(ROUNDS):
    for how in ("torch.vjp", "import torch_vjp in each thread", "import torch; import torch_vjp"):
        unimport()
        problems += first_use(how)
print(len(problems), problems[:3])
"""


@needs_install
def test_concurrent_first_use_sees_the_whole_module(tmp_path):
    # Right after ``import torch`` (and ``import torch_vjp``), eight threads at once read
    # torch_vjp's attributes, through torch.vjp, their own ``import torch_vjp`` or the
    # main thread's; each must see the finished module. Every round makes torch.vjp
    # unimported again (as right after ``import torch``), so one child runs many rounds.
    # A hook that let a thread read the module while another was still running it failed
    # this in about half of the rounds.
    result = run_python(tmp_path, f"HOOK, ROUNDS = {ENTRY_POINT.module!r}, 6\n{CONCURRENT_USE}")
    assert result.stdout.strip() == "0 []"
    assert plugin_warnings(result.stderr) == []


# --- failures never break ``import torch`` --------------------------------------------------


@needs_install
def test_broken_torch_vjp_fails_on_first_use_and_warns(tmp_path):
    result = run_python(
        tmp_path,
        f"""
        import sys
        import torch

        assert torch.ones(2).sum().item() == 2.0
        kept = torch.vjp
        for attempt in ("torch.vjp", "kept again"):
            try:
                kept.grad
            except ImportError as err:
                assert str(err) == {BROKEN_MESSAGE!r}, err
            else:
                raise AssertionError("no error from the broken torch_vjp")
        # as after any failed import: no torch.vjp, no torch_vjp in sys.modules
        print(hasattr(torch, "vjp"), "torch.vjp" in sys.modules, "torch_vjp" in sys.modules)
        try:
            import torch_vjp
        except ImportError as err:
            print(err)
        """,
        path=(broken_torch_vjp(tmp_path),),
    )
    assert result.stdout.splitlines() == ["False False False", BROKEN_MESSAGE]
    assert_warned(result.stderr, "first use of torch.vjp", f"ImportError: {BROKEN_MESSAGE}")


@needs_install
def test_import_of_a_broken_torch_vjp_raises_at_the_import_statement(tmp_path):
    # as a normal import would: each import statement raises torch_vjp's error, which
    # leaves no torch_vjp and no torch.vjp behind; ``import torch`` itself is untouched
    result = run_python(
        tmp_path,
        """
        import sys
        import torch

        print(type(torch.vjp).__name__, "torch_vjp" in sys.modules)
        statements = ("import torch_vjp", "from torch_vjp import grad", "import torch_vjp.autograd")
        for statement in statements:
            try:
                exec(statement)
            except ImportError as err:
                print(f"{statement}: {err}")
            else:
                print(f"{statement}: no error")
            print(hasattr(torch, "vjp"), "torch.vjp" in sys.modules, "torch_vjp" in sys.modules)
        """,
        path=(broken_torch_vjp(tmp_path),),
    )
    assert result.stdout.splitlines() == [
        "_LazyModule False",
        f"import torch_vjp: {BROKEN_MESSAGE}",
        "False False False",
        f"from torch_vjp import grad: {BROKEN_MESSAGE}",
        "False False False",
        f"import torch_vjp.autograd: {BROKEN_MESSAGE}",
        "False False False",
    ]
    assert plugin_warnings(result.stderr) == []


@needs_install
def test_concurrent_first_use_of_a_broken_torch_vjp(tmp_path):
    # every thread gets torch_vjp's error (none a half-run module), and all of them warn
    # alike (Python shows one warning per place)
    result = run_python(
        tmp_path,
        """
        import threading
        import torch

        lazy = torch.vjp
        barrier = threading.Barrier(8)
        seen = []

        def use():
            barrier.wait()
            try:
                lazy.grad
            except BaseException as err:
                seen.append(f"{type(err).__name__}: {err}")

        threads = [threading.Thread(target=use) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(sorted(set(seen)), len(seen), hasattr(torch, "vjp"))
        """,
        path=(broken_torch_vjp(tmp_path),),
    )
    assert result.stdout.strip() == f"['ImportError: {BROKEN_MESSAGE}'] 8 False"
    assert len(set(plugin_warnings(result.stderr))) == 1
    assert_warned(plugin_warnings(result.stderr)[0], "first use of torch.vjp")


@needs_install
def test_broken_torch_vjp_with_checked_env_warns_at_import_torch(tmp_path):
    result = run_python(
        tmp_path,
        """
        import sys
        import torch
        assert torch.ones(2).sum().item() == 2.0
        print(hasattr(torch, "vjp"), "torch.vjp" in sys.modules, "torch_vjp" in sys.modules)
        """,
        env={"TORCH_VJP_CHECKED": "1"},
        path=(broken_torch_vjp(tmp_path),),
    )
    assert result.stdout.split() == ["False", "False", "False"]
    assert_warned(result.stderr, f"ImportError: {BROKEN_MESSAGE}", "TORCH_VJP_CHECKED is set")
    # the warning points at the user's ``import torch``
    assert f"{tmp_path / 'script.py'}:3: RuntimeWarning: torch_vjp" in result.stderr


@needs_install
def test_warnings_as_errors_cannot_break_import_torch(tmp_path):
    result = run_python(
        tmp_path,
        """
        import torch
        print(hasattr(torch, "vjp"))
        """,
        env={"TORCH_VJP_CHECKED": "1"},
        path=(broken_torch_vjp(tmp_path),),
        flags=("-W", "error::RuntimeWarning"),
    )
    assert result.stdout.split() == ["False"]
    assert_warned(result.stderr, f"ImportError: {BROKEN_MESSAGE}")


FIND_SPEC_PATCH = """
import importlib.util

_find_spec = importlib.util.find_spec

def find_spec(name, *args, **kwargs):
    if name == "torch_vjp":
        {action}
    return _find_spec(name, *args, **kwargs)

importlib.util.find_spec = find_spec
"""


@needs_install
def test_failing_hook_warns_and_torch_vjp_still_imports(tmp_path):
    patch = FIND_SPEC_PATCH.format(action="raise RuntimeError('simulated hook failure')")
    result = run_python(
        tmp_path,
        patch
        + """
import torch
assert torch.ones(2).sum().item() == 2.0
print(hasattr(torch, "vjp"))
import torch_vjp
assert torch.vjp is torch_vjp
print("ok")
""",
    )
    assert result.stdout.split() == ["False", "ok"]
    assert_warned(result.stderr, "hook failed (RuntimeError: simulated hook failure)")


@needs_install
def test_missing_package_warns(tmp_path):
    result = run_python(
        tmp_path,
        FIND_SPEC_PATCH.format(action="return None")
        + """
import sys
import torch
print(hasattr(torch, "vjp"), "torch_vjp" in sys.modules)
""",
    )
    assert result.stdout.split() == ["False", "False"]
    assert_warned(result.stderr, "cannot be found")


@needs_install
def test_existing_torch_vjp_attribute_is_left_alone(tmp_path):
    result = run_python(
        tmp_path,
        f"""
        import importlib, os, sys
        import torch

        sentinel = object()
        torch.vjp = sentinel
        del os.environ["TORCH_VJP_AUTOLOAD"]
        importlib.import_module({ENTRY_POINT.module!r})._autoload()
        print(torch.vjp is sentinel, "torch_vjp" in sys.modules, "torch.vjp" in sys.modules)
        """,
        env={"TORCH_VJP_AUTOLOAD": "0"},
    )
    assert result.stdout.split() == ["True", "False", "False"]
    assert_warned(result.stderr, "already has an attribute `vjp` (object)")


def test_submodule_import_first_after_import_torch():
    """``import torch`` then ``from torch_vjp.<sub> import ...``: no circular import, no
    module executed twice."""
    code = (
        "import torch\n"
        "from torch_vjp.per_sample import per_sample_grads\n"
        "import torch_vjp._errors as errors, torch_vjp.function_check as fc\n"
        "import torch_vjp\n"
        "assert errors.FunctionCheckError is fc.FunctionCheckError is torch_vjp.FunctionCheckError\n"
        "assert torch.vjp is torch_vjp and torch_vjp.per_sample_grads is per_sample_grads\n"
        "print('OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK"
