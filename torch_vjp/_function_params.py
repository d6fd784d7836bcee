"""The parameters of the modules a callable ``fn`` uses, checked by
:func:`torch_vjp.check_function` as if they were inputs.

NOTE [parameters of fn's modules]
``check_function(model, x)`` with a model whose forward calls ``LinearFn.apply(x,
self.weight)`` differentiated ``x`` only: the gradient that ``LinearFn.backward`` returns
for the weight (a transposed product, a forgotten factor: where such bugs usually are) was
never compared with finite differences, and the check passed. The parameters that require
grad of the modules ``fn`` reaches (itself, a closure's, a module among the inputs; found as
the Jacobian functions find them) are therefore checked too, where they feed a custom
Function: ``fn`` is called with each module's parameters replaced for the call by
``torch.nn.utils.stateless._reparametrize_module`` (what ``torch.func.functional_call``
does), so that the finite differences move a parameter without writing into it: nothing of
the caller's changes, not even a version counter. A parameter that several of these
modules hold (one weight shared by two layers, neither owning the other) is replaced in
every one of them. Parameters that reach no custom Function
(a plain ``Linear`` before it) have torch's own gradients and are left out. A tensor that
``fn`` captures outside any module (``lambda x: F.apply(x, w)``) cannot be replaced for a
call: if it requires grad and feeds a custom Function, the report notes that its gradient
was not checked, and how to check it (pass it as an input).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from torch_vjp._engine.context import modules_reached, reached
from torch_vjp._function_graph import custom_nodes

__all__ = ["Params", "module_parameters"]


@dataclass(frozen=True)
class Params:
    """The parameters checked beside the inputs: their names (``"Model.fc.weight"``), the
    tensors, and ``fn`` as a function of the inputs followed by the parameters' values."""

    names: tuple[str, ...]
    tensors: tuple[Tensor, ...]
    run: Callable[..., Any]
    # (the shapes of tensors fn captures outside any module that require grad and feed a
    # custom Function: their gradients are not checked, and the report says so)
    unchecked: tuple[tuple[int, ...], ...] = ()


def _reparametrize() -> Any:
    try:
        from torch.nn.utils.stateless import _reparametrize_module
    except ImportError:  # pragma: no cover - an older or newer torch: inputs only
        return None
    return _reparametrize_module


def module_parameters(fn: Callable[..., Any], inputs: tuple[Any, ...], diff: list[int],
                      before_call: Callable[[], None]) -> Params | None:
    """The parameters of ``fn``'s modules that feed a custom Function (NOTE [parameters of
    fn's modules]), or None. One call of ``fn`` (``before_call`` runs first) to see which
    parameters feed one; its errors pass through."""
    swap = _reparametrize()
    if swap is None:
        return None
    roots, _ = reached(fn)
    known = {id(m) for m in roots}
    roots += [m for m in modules_reached(inputs) if id(m) not in known]
    entries: list[tuple[int, str, Tensor]] = []
    # (every place of each parameter: one shared by two modules fn reaches, neither owning
    # the other, is swapped in both, or the differences moved one use of it only)
    places: dict[int, list[tuple[int, str]]] = {}
    for r, root in enumerate(roots):
        for name, p in root.named_parameters():
            if p.requires_grad:
                if id(p) not in places:
                    places[id(p)] = []
                    entries.append((r, name, p))
                places[id(p)].append((r, name))
    n = len(inputs)

    def run(*args: Any) -> Any:
        per_root: dict[int, dict[str, Tensor]] = {}
        for (_, _, p), value in zip(entries, args[n:]):
            for r, name in places[id(p)]:
                per_root.setdefault(r, {})[name] = value
        with contextlib.ExitStack() as stack:
            for r, mapping in per_root.items():
                stack.enter_context(swap(roots[r], mapping, tie_weights=True))
            return fn(*args[:n])

    # (which parameters feed a custom Function: one call with leaves for every one)
    leaves = [p.detach().clone().requires_grad_(True) for _, _, p in entries]
    # (copies of every tensor input: a forward that writes into an input that is not
    # differentiated, an output buffer, must not write into the caller's)
    args = [inputs[i].detach().clone().requires_grad_(True) if i in diff else
            a.detach().clone() if isinstance(a, Tensor) else a
            for i, a in enumerate(inputs)]
    before_call()
    with torch.enable_grad():
        out = run(*args, *leaves)
    roots_out = [o.grad_fn for o in torch.utils._pytree.tree_leaves(out)
                 if isinstance(o, Tensor) and o.grad_fn is not None]
    ours = [a for a in args if isinstance(a, Tensor) and a.requires_grad] + leaves
    below = _leaves_below(custom_nodes(roots_out, ours))
    keep = [k for k, leaf in enumerate(leaves) if id(leaf) in below]
    known_ids = {id(t) for t in ours}
    unchecked = tuple(tuple(t.shape) for t in below.values() if id(t) not in known_ids)
    if not keep and not unchecked:
        return None
    kept = [entries[k] for k in keep]

    def run_kept(*args: Any) -> Any:
        values = dict(zip(keep, args[n:]))
        full = [values.get(k, p) for k, (_, _, p) in enumerate(entries)]
        return run(*args[:n], *full)

    # (two modules of one class, each with its own w, were both "M.w": which one's gradient
    # was wrong, the report did not say; such roots are numbered in the order fn reaches them)
    kinds = [type(root).__name__ for root in roots]
    label = [f"{k}[{kinds[:r].count(k)}]" if kinds.count(k) > 1 else k
             for r, k in enumerate(kinds)]
    return Params(
        names=tuple(f"{label[r]}.{name}" for r, name, _ in kept),
        tensors=tuple(p for _, _, p in kept),
        run=run_kept,
        unchecked=unchecked,
    )


def _leaves_below(nodes: list[Any]) -> dict[int, Tensor]:
    """The leaf tensors the autograd graph below ``nodes`` accumulates into, by id."""
    found: dict[int, Tensor] = {}
    seen: set[int] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            found[id(variable)] = variable
        for nxt, _ in node.next_functions:
            if nxt is not None:
                stack.append(nxt)
    return found
