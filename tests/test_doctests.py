"""The examples in torch_vjp's docstrings run and give what they show.

Every ``.py`` file of the package is imported as ``torch_vjp.<module>`` and its docstring
examples are run with :mod:`doctest` (flags ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``;
``torch`` and ``tv`` = ``torch_vjp`` are available without an import, as in the docs).
``torch_vjp.bench`` and ``torch_vjp.__main__`` are skipped only when an optional
dependency of theirs (the ``bench`` extra) is missing; any other import failure fails.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path
from types import ModuleType

import pytest
import torch

import torch_vjp

PACKAGE_DIR = Path(torch_vjp.__file__).resolve().parent
OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# Modules whose imports may need the optional ``bench`` extra.
OPTIONAL = ("torch_vjp.bench", "torch_vjp.__main__")


def module_names() -> list[str]:
    """``torch_vjp.<module>`` for every module file of the package, sorted."""
    names = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR).with_suffix("")
        parts = list(rel.parts)
        if "__pycache__" in parts or any(not p.isidentifier() for p in parts):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        # A module in a folder without __init__.py is not part of the torch_vjp package.
        if not all((PACKAGE_DIR.joinpath(*parts[:i]) / "__init__.py").is_file()
                   for i in range(1, len(parts))):
            continue
        names.append(".".join(["torch_vjp", *parts]))
    return names


def _is_optional(name: str) -> bool:
    return any(name == opt or name.startswith(opt + ".") for opt in OPTIONAL)


def _missing_optional_dependency(name: str, exc: ModuleNotFoundError) -> str | None:
    """The missing third-party module, when ``name`` is optional and that is why it failed."""
    missing = exc.name or ""
    if _is_optional(name) and missing and missing.split(".")[0] not in ("torch_vjp", "torch"):
        return missing
    return None


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = _missing_optional_dependency(name, exc)
        if missing:
            pytest.skip(f"{name} needs {missing!r}: install the 'bench' extra")
        raise


def _tests(module: ModuleType) -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    extraglobs = {"torch": torch, "tv": torch_vjp}
    tests = finder.find(module, module.__name__, extraglobs=extraglobs)
    # DocTestFinder follows objects defined in this module only; keep those with examples.
    return sorted((t for t in tests if t.examples), key=lambda t: t.name)


def test_module_list():
    names = module_names()
    assert "torch_vjp" in names
    assert "torch_vjp._errors" in names


@pytest.mark.parametrize("name", module_names())
def test_docstring_examples(name: str):
    module = _import(name)
    tests = _tests(module)
    if not tests:
        pytest.skip(f"{name} has no docstring examples")
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    reports: list[str] = []
    saved_dtype = torch.get_default_dtype()
    try:
        for test in tests:
            torch.manual_seed(0)
            out: list[str] = []
            result = runner.run(test, out=out.append, clear_globs=True)
            if result.failed:
                reports.append("".join(out))
    finally:
        torch.set_default_dtype(saved_dtype)
    summary = runner.summarize(verbose=False)
    assert summary.attempted > 0
    assert not reports, (
        f"{summary.failed} of {summary.attempted} docstring examples in {name} failed:\n"
        + "\n".join(reports)
    )


def test_some_examples_exist():
    """The package documents itself with runnable examples: at least one is found."""
    count = 0
    for name in module_names():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if _missing_optional_dependency(name, exc):
                continue
            raise
        count += sum(len(t.examples) for t in _tests(module))
    assert count > 0, "no docstring examples found in any torch_vjp module"
