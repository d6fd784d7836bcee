"""The custom Function nodes of a graph: :func:`custom_nodes`, those between its roots and
leaves, which :func:`torch_vjp.check_function` looks for in a callable."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

__all__ = ["custom_nodes"]


def custom_nodes(roots: Sequence[Any], leaves: Sequence[Tensor]) -> list[Any]:
    """The custom Function nodes on some path from ``roots`` to ``leaves`` (iterative DFS)."""
    leaf_ids = {id(t) for t in leaves}
    state: dict[int, Any] = {}  # id -> node; holds references so that ids stay unique
    reaches: dict[int, bool] = {}
    found: list[Any] = []
    stack: list[tuple[Any, bool]] = [(r, False) for r in roots if r is not None]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            hit = id(getattr(node, "variable", None)) in leaf_ids
            for nxt, _ in node.next_functions:
                if nxt is not None and reaches.get(id(nxt), False):
                    hit = True
            reaches[key] = hit
            if hit and hasattr(type(node), "_forward_cls"):
                found.append(node)
            continue
        if key in state:
            continue
        state[key] = node
        stack.append((node, True))
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in state:
                stack.append((nxt, False))
    found.reverse()  # roughly the order in which backward runs them
    return found
