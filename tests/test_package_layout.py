"""The package's inside, as issue #11 left it: private modules of a readable size, and no
private name reached across package lines (a package's own modules may share theirs)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "torch_vjp"
MAX_LINES = 600


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def test_no_private_module_is_over_600_lines():
    long = {name: n for path, name in _modules()
            if path.stem.startswith("_") or any(p.startswith("_") for p in name.split(".")[1:-1])
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"private modules over {MAX_LINES} lines (split them): {long}"


def test_no_private_name_is_imported_across_package_lines():
    crossing = []
    for path, name in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] == "torch_vjp"):
                continue
            # the package the source module belongs to; its own modules, and those of the
            # packages inside it, may share private names
            home = node.module.rsplit(".", 1)[0]
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and not (name + ".").startswith(home + "."):
                    crossing.append(f"{name}: from {node.module} import {alias.name}")
    assert crossing == [], "\n".join(crossing)
