"""The nodes of a computed graph: :func:`graph_nodes`, the one walk of the engine's passes
that read a graph (its dtypes, its structure's key, the tensors that retain their gradient,
a checkpoint that refuses ``torch.autograd.grad``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

__all__ = ["graph_nodes"]


def graph_nodes(outs: Sequence[Tensor], ordered: bool = False) -> list[Any]:
    """The autograd nodes reachable from ``outs``' ``grad_fn``, each once (a depth-first
    walk; the list holds the nodes, so their ids stay theirs while it lives).

    ``ordered``: the walk takes ``outs`` and each node's ``next_functions`` in their order
    (the order a key of the graph's structure is read in); otherwise in any order.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> [type(n).__name__ for n in graph_nodes([(x * 2).sum()], ordered=True)]
        ['SumBackward0', 'MulBackward0', 'AccumulateGrad']
    """
    found: list[Any] = []
    seen: set[int] = set()
    stack = [o.grad_fn for o in (reversed(outs) if ordered else outs) if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        nexts = node.next_functions
        stack.extend(nxt for nxt, _ in (reversed(nexts) if ordered else nexts) if nxt is not None)
    return found
