"""One detection run: ``f`` called once under the :class:`~torch_vjp._sparse.tracer.Tracer`,
its outputs' index sets read off as the Jacobian's pattern."""

from __future__ import annotations

import types

import torch
from torch.utils._pytree import tree_leaves

from torch_vjp._engine.context import buffers_kept, module_tree, modules_reached
from torch_vjp._engine.jacobian import function_key, function_name
from torch_vjp._engine.problem import Problem
from torch_vjp._errors import JacobianWarning, warn_once
# (the rules register themselves)
from torch_vjp._sparse import contract, local_rules, rules, scatters  # noqa: F401
from torch_vjp._sparse.functions import functions_ruled
from torch_vjp._sparse.pattern import Pattern
from torch_vjp._sparse.tracer import Tracer, ValueReads, one_thread

__all__ = ["detect"]


def detect(prob: Problem) -> Pattern:
    """The sparsity pattern of ``prob.g`` at its leaves: runs ``f`` once, for real, under
    the tracer (NOTE [shadow storage], NOTE [what the pattern means] in
    :mod:`~torch_vjp._sparse.tracer`; custom autograd.Functions: NOTE [custom Functions] in
    :mod:`~torch_vjp._sparse.functions`). Module buffers ``f`` updates (BatchNorm's running
    statistics) are put back. Warns once per function and op when an op without a rule made
    the pattern conservative.

    Returns:
        The ``(m, n)`` pattern of the flattened output and input.
    """
    leaves = prob.leaves
    n = sum(leaf.numel() for leaf in leaves)
    tracer = Tracer(n)
    with one_thread():
        for leaf in leaves:
            tracer.register_input(leaf)
    with buffers_kept(prob.f), functions_ruled(tracer), tracer, ValueReads(tracer):
        res = prob.g(*leaves)
    flat = [res] if isinstance(res, torch.Tensor) else tree_leaves(res)
    with one_thread():
        ids = torch.cat([tracer.ids_or_empty(o).reshape(-1) for o in flat])
        rows, cols = tracer.table.expand(ids)
    if tracer.conservative_ops:
        ops = sorted(tracer.conservative_ops)
        names = ", ".join(ops)
        warn_once(
            ("sparsity-rule", function_key(prob.f), tuple(ops)),
            f"{prob.call}: no sparsity rule for {names} (called by "
            f"{function_name(prob.f)}), so every output element of "
            f"{'that op' if len(ops) == 1 else 'those ops'} is taken to depend on every "
            f"input element it reads. The pattern is still safe (it includes every entry "
            f"that can be non-zero), but it may be denser than the Jacobian, and then "
            f"sparse_jacobian needs more products.\n"
            f"  If you know the structure, pass it as pattern= (a boolean (m, n) tensor). "
            f"This warning is shown once per function.",
            JacobianWarning,
        )
    pattern = Pattern(ids.numel(), n, rows, cols, ordered=True)
    pattern.by_value = tracer.by_value
    pattern.wrong_batching = tracer.wrong_batching
    pattern.wrong_reverse = tracer.wrong_reverse
    pattern.guard(tracer.guards.values())  # (after buffers_kept put buffers back)
    if pattern.guards:
        pattern.house(_holders(prob.f))
    return pattern


def _holders(f: object) -> list[object]:
    """Where the tensors whose values shaped ``f``'s pattern may live, to be watched there
    (:meth:`~torch_vjp._sparse.pattern.Pattern.house`): every module ``f`` reaches, with
    the modules they hold (a plain list attribute's too: :func:`module_tree`), and ``f``
    itself or its bound object where that is a plain object (a callable holding
    ``self.W``)."""
    try:
        found: list[object] = list(module_tree(modules_reached(f)))
    except Exception:  # noqa: BLE001 - an odd callable: no module to watch
        found = []
    own = f.__self__ if isinstance(f, types.MethodType) else f
    if not isinstance(own, (torch.nn.Module, types.FunctionType, type, types.ModuleType)):
        found.append(own)
    return found
