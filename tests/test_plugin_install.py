"""The torch plugin in every install mode (SPEC §7): ``import torch`` never fails.

Each test installs a copy of this checkout (``setup.py``, ``README.md``, ``torch_vjp/``) into
a throwaway virtual environment, the way a user would, and then runs fresh interpreters of
that environment: where the checkout is, after it moved, with ``TORCH_VJP_AUTOLOAD=0``; for
some modes also with the installed package deleted or broken, and after an uninstall.

* torch and the rest of this environment's packages are linked into the throwaway one
  (``host_packages``), except pip, the build tools and every trace of torch_vjp itself, so
  that nothing is downloaded and the copy under test is the only torch_vjp there.
* The build tools are chosen per install mode (``BuildTools``), since setuptools decides
  what an editable install looks like: before 80, ``setup.py develop`` links the checkout
  through ``easy-install.pth``; from 80 on it runs ``pip install -e .``. setuptools < 80
  comes from ``ensurepip``'s bundled wheel (Python 3.11) or this environment; setuptools
  >= 80 and wheel from this environment, else from the package index; a mode whose tools
  are not at hand is skipped, and says so.
* This environment's pip installs into the throwaway one (``pip --python``), with no build
  isolation and no index.
* For each kind of layout an install can have (files in site-packages, setuptools' import
  finder, a ``.pth`` line with the checkout, an ``.egg-link``), a child runs a real
  ``import torch`` where the checkout is, and uses ``torch.vjp``. Every other check runs
  what ``import torch`` does with plugins (torch's ``_import_device_backends``: load each
  ``torch.backends`` entry point, call it) in a child with a bare stand-in module as
  ``torch``, in a tenth of the time: the hook's module failing to import, the bug these
  tests guard against, fails there exactly as in ``import torch``.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HOOK_MODULE = "_torch_vjp_autoload"
BROKEN_MESSAGE = "simulated broken torch_vjp"
NOT_FOUND = "the package torch_vjp cannot be found"

# The host's packages that the throwaway environments do not get: pip and the build tools
# (each test picks its own) and torch_vjp in any install mode.
_NOT_LINKED = (
    "torch_vjp",
    "torch-vjp",
    "_torch_vjp",
    "__editable__",
    "pip",
    "setuptools",
    "pkg_resources",
    "_distutils_hack",
    "wheel",
    "easy-install",
    "__pycache__",
)

# What torch's ``_import_device_backends`` does, with a stand-in module as ``torch``. Prints
# each plugin failure (torch would raise), whether ``torch.vjp`` was attached, and where the
# hook's module and the package it attached were found.
PLUGIN_LOOP = """
import sys, types
from importlib.metadata import entry_points

torch = sys.modules["torch"] = types.ModuleType("torch")
for backend_extension in entry_points(group="torch.backends"):
    try:
        entrypoint = backend_extension.load()
        entrypoint()
    except Exception as err:
        print("FAILED", backend_extension.name, type(err).__name__, err)
hook = sys.modules.get("_torch_vjp_autoload")
vjp = vars(torch).get("vjp")
print("torch.vjp:", vjp is not None)
print("hook:", getattr(hook, "__file__", None))
print("package:", getattr(vjp, "__file__", None))
"""

IMPORT_TORCH = """
import sys, types
import torch

lazy = torch.vjp
assert type(lazy) is not types.ModuleType and "torch_vjp" not in sys.modules
import torch_vjp

assert torch_vjp is lazy and sys.modules["torch.vjp"] is torch_vjp
assert issubclass(torch.vjp.TorchVJPError, Exception) and torch.vjp.grad is torch_vjp.grad
print("hook:", sys.modules["_torch_vjp_autoload"].__file__)
print("package:", torch_vjp.__file__)
"""


IMPORT_BROKEN = """
try:
    import torch_vjp
except Exception as err:
    print("import torch_vjp:", type(err).__name__, err)
else:
    print("import torch_vjp: no error")
print("after:", "torch_vjp" in sys.modules, "vjp" in vars(torch))
"""


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TORCH_VJP_", "PYTHON"))
        and key not in ("TORCH_DEVICE_BACKEND_AUTOLOAD", "VIRTUAL_ENV")
    }
    env.update(extra or {})
    return env


def _run(args, *, cwd: Path, env: dict[str, str] | None = None, check: bool = True):
    result = subprocess.run(
        [str(arg) for arg in args],
        cwd=cwd,
        env=_child_env(env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check:
        assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


def _plugin_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "RuntimeWarning: torch_vjp" in line]


def _link_entries(source: Path, dest: Path, names=None) -> None:
    """Symlink ``source``'s entries (or the given ones) into ``dest``, first one wins."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in sorted(source.iterdir()) if names is None else [source / n for n in names]:
        if entry.exists() and not (dest / entry.name).exists():
            (dest / entry.name).symlink_to(entry)


@pytest.fixture(scope="module")
def host_packages(tmp_path_factory) -> Path:
    """A folder linking the host's torch, numpy and everything beside them, bar _NOT_LINKED."""
    import numpy
    import torch

    folder = tmp_path_factory.mktemp("host-packages")
    for package in (torch, numpy):
        site = Path(package.__file__).resolve().parents[1]
        names = [
            entry.name
            for entry in sorted(site.iterdir())
            if not entry.name.lower().startswith(_NOT_LINKED) and entry.suffix != ".pth"
        ]
        _link_entries(site, folder, names)
    return folder


def _setuptools_major(version: str) -> int:
    return int(version.split(".")[0])


class BuildTools:
    """Folders holding one kind of build tool each: ``old`` (setuptools < 80), ``new``
    (setuptools >= 80), ``wheel`` and ``pip``; made on first use, cached for the module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[str, Path | str] = {}

    def __call__(self, *kinds: str) -> list[Path]:
        folders = []
        for kind in kinds:
            if kind not in self.made:
                folder = self.root / kind
                self.made[kind] = getattr(self, f"_make_{kind}")(folder) or folder
            if isinstance(self.made[kind], str):
                pytest.skip(self.made[kind])
            folders.append(self.made[kind])
        return folders

    @staticmethod
    def _link_host_distribution(name: str, folder: Path) -> bool:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            return False
        # its packages and its .dist-info (setuptools finds its commands through it)
        tops = {Path(file).parts[0] for file in dist.files or ()}
        names = [
            top
            for top in sorted(tops)
            if top.endswith(".dist-info") or ("." not in top and top != "__pycache__")
        ]
        _link_entries(Path(dist.locate_file("")), folder, names)
        return True

    @staticmethod
    def _pip_target(folder: Path, *requirements: str) -> str | None:
        result = _run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
             folder, *requirements],
            cwd=folder.parent,
            check=False,
        )
        if result.returncode != 0:
            return f"could not install {requirements}:\n{result.stderr[-1000:]}"
        return None

    def _make_old(self, folder: Path) -> str | None:
        import ensurepip

        bundled = Path(ensurepip.__file__).parent / "_bundled"
        for wheel in sorted(bundled.glob("setuptools-*.whl")):
            if _setuptools_major(wheel.name.split("-")[1]) < 80:
                return self._pip_target(folder, "--no-index", str(wheel))
        host = self._host_setuptools_major()
        if host is not None and host < 80 and self._link_host_distribution("setuptools", folder):
            return None
        return "no setuptools < 80 at hand (ensurepip bundles none, the host's is newer)"

    def _make_new(self, folder: Path) -> str | None:
        host = self._host_setuptools_major()
        if host is not None and host >= 80 and self._link_host_distribution("setuptools", folder):
            return None
        return self._pip_target(folder, "setuptools>=80")

    def _make_wheel(self, folder: Path) -> str | None:
        if self._link_host_distribution("wheel", folder):
            return None
        return self._pip_target(folder, "wheel")

    def _make_pip(self, folder: Path) -> str | None:
        if self._link_host_distribution("pip", folder):
            return None
        return "pip is not installed here"

    @staticmethod
    def _host_setuptools_major() -> int | None:
        try:
            return _setuptools_major(importlib.metadata.version("setuptools"))
        except importlib.metadata.PackageNotFoundError:
            return None


@pytest.fixture(scope="module")
def build_tools(tmp_path_factory) -> BuildTools:
    return BuildTools(tmp_path_factory.mktemp("build-tools"))


class Install:
    """A copy of this checkout installed into a throwaway virtual environment."""

    def __init__(self, root: Path, host_packages: Path, tools: list[Path]) -> None:
        self.root = root
        self.checkout = root / "checkout"
        self.checkout.mkdir(parents=True)
        shutil.copy2(REPO / "setup.py", self.checkout)
        shutil.copy2(REPO / "README.md", self.checkout)
        shutil.copytree(
            REPO / "torch_vjp",
            self.checkout / "torch_vjp",
            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
        )
        self.elsewhere = root / "elsewhere"  # the children's working folder
        self.elsewhere.mkdir()
        venv = root / "venv"
        _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
        self.python = venv / "bin" / "python"
        purelib = _run(
            [self.python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            cwd=root,
        ).stdout.strip()
        self.site_packages = Path(purelib)
        # after the environment's own site-packages, so that what is installed there wins
        paths = "".join(f"{path}\n" for path in (host_packages, *tools))
        (self.site_packages / "zz_host_packages.pth").write_text(paths)

    def pip(self, *args: str, env: dict[str, str] | None = None) -> str:
        """This environment's pip, installing into the throwaway one; returns its output."""
        result = _run(
            [sys.executable, "-m", "pip", "--python", self.python, *args],
            cwd=self.checkout,
            env={"PIP_NO_INDEX": "1", **(env or {})},
        )
        return result.stdout + result.stderr

    def setup_py(self, *args: str, env: dict[str, str] | None = None) -> str:
        result = _run(
            [self.python, "setup.py", *args],
            cwd=self.checkout,
            env={"PIP_NO_INDEX": "1", **(env or {})},
        )
        return result.stdout + result.stderr

    def import_torch(self) -> subprocess.CompletedProcess[str]:
        """A real ``import torch`` that then uses torch.vjp."""
        return _run([self.python, "-c", IMPORT_TORCH], cwd=self.elsewhere)

    def plugin_loop(self, **env: str) -> subprocess.CompletedProcess[str]:
        return _run([self.python, "-c", PLUGIN_LOOP], cwd=self.elsewhere, env=env)

    def move_checkout(self, back: bool = False) -> None:
        self.checkout = self.checkout.rename(self.root / ("checkout" if back else "moved"))


def _fields(stdout: str) -> dict[str, str]:
    """``name: value`` lines of a child's output, and ``FAILED`` lines under ``FAILED``."""
    fields: dict[str, str] = {}
    for line in stdout.splitlines():
        if line.startswith("FAILED"):
            fields["FAILED"] = fields.get("FAILED", "") + line + "\n"
        elif ": " in line:
            name, value = line.split(": ", 1)
            fields[name] = value
    return fields


# name: (build tools, how to install, what the installer's output shows for this mode)
NO_ISOLATION = ("--no-deps", "--no-build-isolation")
PEP_660 = "Building editable for torch_vjp (pyproject.toml)"
MODES = {
    "wheel": (("new",), ("pip", "install", *NO_ISOLATION, "."), "Building wheel for torch_vjp"),
    "pep660": (("new",), ("pip", "install", *NO_ISOLATION, "-e", "."), PEP_660),
    "pep660-compat": (
        ("new",),
        ("pip", "install", *NO_ISOLATION, "-e", ".", "--config-settings",
         "editable_mode=compat"),
        PEP_660,
    ),
    "setup.py-develop-setuptools<80": (
        ("old",), ("setup.py", "develop", "--no-deps"), "torch-vjp.egg-link"
    ),
    # runs ``pip install -e .``, as pep660
    "setup.py-develop-setuptools>=80": (
        ("new", "pip"), ("setup.py", "develop", "--no-deps"), PEP_660
    ),
    # no pyproject.toml, wheel importable: pip runs ``setup.py develop``
    "legacy-pip-e": (
        ("old", "wheel"),
        ("pip", "install", *NO_ISOLATION, "-e", "."),
        "Running setup.py develop for torch",
    ),
}
# Modes whose installed metadata (the entry point) is in the checkout: an .egg-link to it.
EGG_LINKED = {"setup.py-develop-setuptools<80", "legacy-pip-e"}
# A real ``import torch`` once per kind of layout; the other two modes repeat a layout.
REAL_IMPORT_TORCH = {"wheel", "pep660", "pep660-compat", "setup.py-develop-setuptools<80"}
UNINSTALL = {
    "pep660": ("pip", "uninstall", "--yes", "torch_vjp"),
    "setup.py-develop-setuptools<80": ("setup.py", "develop", "--uninstall"),
}


def _install(mode: str, root: Path, host_packages: Path, build_tools: BuildTools) -> Install:
    kinds, command, marker = MODES[mode]
    install = Install(root, host_packages, build_tools(*kinds))
    # setuptools >= 80's ``develop`` runs this environment's ``pip install -e .``
    env = {"PIP_NO_BUILD_ISOLATION": "0"}  # pip reads "0" as "no build isolation"
    output = getattr(install, command[0].replace(".", "_"))(*command[1:], env=env)
    assert marker in output, f"not the install mode {mode!r}:\n{output}"
    return install


@pytest.mark.parametrize("mode", list(MODES))
def test_install_mode(mode, tmp_path, host_packages, build_tools):
    install = _install(mode, tmp_path, host_packages, build_tools)
    editable = mode != "wheel"
    package = (install.checkout if editable else install.site_packages) / "torch_vjp"

    # where the checkout is: torch.vjp, from the package installed
    if mode in REAL_IMPORT_TORCH:
        result = install.import_torch()
    else:
        result = install.plugin_loop()
        assert "FAILED" not in _fields(result.stdout)
    assert _plugin_warnings(result.stderr) == []
    fields = _fields(result.stdout)
    assert Path(fields["package"]) == package / "__init__.py"
    hook = Path(fields["hook"])
    # the hook's module is a file in the install location, whatever the install mode
    assert hook == install.site_packages / HOOK_MODULE / "__init__.py", hook
    assert not hook.is_symlink()

    result = install.plugin_loop(TORCH_VJP_AUTOLOAD="0")
    assert _fields(result.stdout) == {"torch.vjp": "False", "hook": str(hook), "package": "None"}
    assert _plugin_warnings(result.stderr) == []

    install.move_checkout()
    result = install.plugin_loop()
    if not editable:  # nothing of the install was in the checkout
        assert _fields(result.stdout)["torch.vjp"] == "True"
        assert _plugin_warnings(result.stderr) == []
    elif mode in EGG_LINKED:  # the metadata, entry point included, moved with the checkout
        assert _fields(result.stdout) == {"torch.vjp": "False", "hook": "None", "package": "None"}
        assert _plugin_warnings(result.stderr) == []
    else:  # the installed hook warns that the package it points to is gone
        expected = {"torch.vjp": "False", "hook": str(hook), "package": "None"}
        assert _fields(result.stdout) == expected
        [warning] = _plugin_warnings(result.stderr)
        assert NOT_FOUND in warning and "Set TORCH_VJP_AUTOLOAD=0" in warning

    result = install.plugin_loop(TORCH_VJP_AUTOLOAD="0")
    assert "FAILED" not in _fields(result.stdout)
    assert _fields(result.stdout)["torch.vjp"] == "False"
    assert _plugin_warnings(result.stderr) == []

    if mode == "wheel":
        _check_package_deleted_or_broken(install)
    if mode in UNINSTALL:
        install.move_checkout(back=True)
        command = UNINSTALL[mode]
        getattr(install, command[0].replace(".", "_"))(*command[1:])
        assert not (install.site_packages / HOOK_MODULE).exists()
        result = install.plugin_loop()
        assert _fields(result.stdout) == {"torch.vjp": "False", "hook": "None", "package": "None"}
        assert _plugin_warnings(result.stderr) == []


def _check_package_deleted_or_broken(install: Install) -> None:
    package = install.site_packages / "torch_vjp"

    shutil.rmtree(package)
    result = install.plugin_loop()
    assert "FAILED" not in _fields(result.stdout)
    assert _fields(result.stdout)["torch.vjp"] == "False"
    [warning] = _plugin_warnings(result.stderr)
    assert NOT_FOUND in warning and "Set TORCH_VJP_AUTOLOAD=0" in warning

    package.mkdir()  # a folder without ``__init__.py`` is no torch_vjp either
    result = install.plugin_loop()
    assert _fields(result.stdout)["torch.vjp"] == "False"
    [warning] = _plugin_warnings(result.stderr)
    assert NOT_FOUND in warning

    (package / "__init__.py").write_text(f"raise ImportError({BROKEN_MESSAGE!r})\n")
    for env in ({}, {"TORCH_VJP_AUTOLOAD": "0"}):
        result = install.plugin_loop(**env)
        assert "FAILED" not in _fields(result.stdout)
        assert _fields(result.stdout)["torch.vjp"] == str(not env)  # attached, not imported
        assert _plugin_warnings(result.stderr) == []
    # ``import torch_vjp`` raises, at the import statement, as a normal import would, and
    # leaves no torch_vjp and no torch.vjp behind
    result = _run([install.python, "-c", PLUGIN_LOOP + IMPORT_BROKEN], cwd=install.elsewhere)
    fields = _fields(result.stdout)
    assert fields["import torch_vjp"] == f"ImportError {BROKEN_MESSAGE}"
    assert fields["after"] == "False False"
    assert _plugin_warnings(result.stderr) == []
