"""Packaging for torch_vjp.

The runtime requirement on torch is a range that torch 2.13.0 satisfies; install with
``torch==2.13.0`` pinned (see the README) so that pip never resolves a newer build.
"""

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.develop import develop as _develop

try:
    from setuptools.command.editable_wheel import editable_wheel as _editable_wheel
except ImportError:  # setuptools < 64: no PEP 660 editable installs
    _editable_wheel = None

# ``_torch_vjp_autoload`` is the target of torch's plugin entry point. It lives inside the
# torch_vjp source folder but installs as its own top-level module, because loading an
# entry point ``pkg.mod:fn`` imports ``pkg/__init__.py`` first, outside any guard: the
# hook's own module must be one whose import cannot fail. It must also be a real file in
# the install location in every install mode: an editable install that only pointed to it
# (a ``.pth`` line with this folder, setuptools' import finder, a link tree) would make
# ``import torch`` fail once the checkout moves, and a ``.pth`` line with this folder does
# not even find it (``package_dir`` below remaps it). The wheel of ``pip install .`` holds
# it as a file already; the two command classes below add it to editable installs.
HOOK_MODULE = "_torch_vjp_autoload"
HOOK_SOURCE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "torch_vjp", "_autoload", "__init__.py"
)


def _hook_source() -> bytes:
    with open(HOOK_SOURCE, "rb") as source:
        return source.read()


class _WithHookModule:
    """Wraps one of setuptools' editable-install strategies: the editable wheel it writes
    (a ``.pth`` file, an import finder or a link tree) also gets the hook module as a file."""

    def __init__(self, strategy):
        self._strategy = strategy

    def __enter__(self):
        self._strategy.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._strategy.__exit__(*exc_info)

    def __call__(self, wheel, files, mapping):
        self._strategy(wheel, files, mapping)
        wheel.writestr(f"{HOOK_MODULE}/__init__.py", _hook_source())


cmdclass = {}

if _editable_wheel is not None:

    class editable_wheel(_editable_wheel):
        """PEP 660 editable installs (``pip install -e .``, every ``editable_mode``), and
        ``setup.py develop`` with setuptools >= 80, which runs ``pip install -e .``."""

        # setuptools has built editable wheels through ``_select_strategy`` since 64.0;
        # tests/test_plugin.py checks that the installed hook module is a copy, not this file.
        def _select_strategy(self, *args, **kwargs):
            return _WithHookModule(super()._select_strategy(*args, **kwargs))

    cmdclass["editable_wheel"] = editable_wheel


class develop(_develop):
    """``setup.py develop`` (and a legacy ``pip install -e .``, which runs it). Before
    setuptools 80 it links this checkout with an ``.egg-link`` and an ``easy-install.pth``
    line; the hook module is then copied next to them. From setuptools 80 on it runs
    ``pip install -e .`` (see ``editable_wheel``)."""

    def run(self):
        super().run()
        if not hasattr(self, "egg_link"):  # setuptools >= 80
            return
        target = os.path.join(self.install_dir, HOOK_MODULE)
        if self.uninstall:
            if os.path.isdir(target) and not self.dry_run:
                shutil.rmtree(target)
            return
        self.mkpath(target)
        self.copy_file(HOOK_SOURCE, os.path.join(target, "__init__.py"))


cmdclass["develop"] = develop

setup(
    name="torch_vjp",
    version="0.1.0",
    description="Explicit Jacobians, batched VJPs/JVPs, per-sample gradients and "
    "friendly grad_outputs errors for PyTorch.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # Every package under torch_vjp/ (the private ones too: _engine, _per_sample, ...), and
    # the hook as its own top-level module in place of torch_vjp/_autoload.
    packages=find_packages(include=["torch_vjp", "torch_vjp.*"], exclude=["torch_vjp._autoload"])
    + [HOOK_MODULE],
    package_dir={HOOK_MODULE: "torch_vjp/_autoload"},
    package_data={"torch_vjp": ["py.typed"]},
    install_requires=["torch>=2.5,<3", "numpy>=1.24"],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout>=2.1", "pytest-xdist>=3.3", "hypothesis>=6.80"],
        "bench": ["tqdm>=4.60", "matplotlib>=3.7"],
        "docs": ["mkdocs>=1.5", "mkdocs-material>=9", "mkdocstrings[python]>=0.24"],
        # The peers the benchmarks compare against, where installed (all optional).
        "peers": ["opacus>=1.4", "backpack-for-pytorch>=1.6", "jax>=0.4"],
    },
    entry_points={
        "torch.backends": [f"torch_vjp = {HOOK_MODULE}:_autoload"],
        "console_scripts": ["torch-vjp = torch_vjp.__main__:main"],
    },
    cmdclass=cmdclass,
    zip_safe=False,
)
