"""Operators torch differentiates wrongly, read off f's graph for an explicitly named
reverse strategy.

NOTE [named reverse strategies and wrong formulas]
"auto" checks its route against other products (NOTE [auto, checked once], NOTE [a reverse
product checked forward]); a named strategy computes what was asked, unchecked. Two of
torch's (2.13) derivatives are known wrong, and reverse mode through them returned a wrong
Jacobian without a word:

* the batching rule of ``torch.cdist``'s backward (``CdistBackward0``): the products under
  torch.vmap are off by a relative error near 1; each alone is right. ``strategy="rev"``
  computes the rows one at a time, without vmap, where f's graph holds one, with a one-time
  warning (none where ``chunk_size=1`` asks for that already);
* the backward formula of ``torch.as_strided_scatter`` (``AsStridedScatterBackward0``) for
  the tensor scattered into: wrong with or without vmap. ``"rev"`` and ``"rev-loop"`` are
  refused where the tensor scattered into is computed from the differentiated inputs (the
  gradient of the scattered source is right), with the strategies that compute it
  (forward mode is right).

The graph is the one the products' own call of f builds (torch.func's vjp records it): no
call of f more, and a walk of its nodes per call (a fraction of the call's own cost: each
node was an operator f ran). Not read where torch.func cannot run f (the plain-autograd
loop), nor for strategies that nest (a Hessian's gradient). The same ops are known to the
sparse Jacobians (NOTE [wrong batching rules] in :mod:`torch_vjp._sparse.probe`), which read
them on their own.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from torch import Tensor

from torch_vjp._engine.graph import graph_nodes
from torch_vjp._errors import JacobianWarning, StrategyError, warn_once

__all__ = ["named_reverse", "wrong_ops"]

#: Backward nodes whose batching rule is wrong (the products under vmap), by their name.
_BATCHED_WRONGLY = {"CdistBackward0": "torch.cdist"}
#: Backward nodes wrong alone, where their first input (``self``) is differentiated.
_WRONG_ALONE = {"AsStridedScatterBackward0": "torch.as_strided_scatter"}


def named_reverse(call: str, found: tuple[str | None, str | None], vectorized: bool,
                  chunk: int | None, named: tuple[str, Hashable]) -> bool:
    """Whether a named reverse strategy (``vectorized``: "rev", else "rev-loop") is to run
    its products under vmap, where f's graph holds the ops ``found`` (:func:`wrong_ops`;
    ``chunk``: the products at once, None: all; ``named``: f's name, and its key for the
    one-time warning): not where it holds an op whose batching rule is wrong, with a
    one-time warning (none where ``chunk`` is 1); an op whose backward is wrong alone is
    refused (NOTE [named reverse strategies and wrong formulas])."""
    batching, alone = found
    name = named[0]
    strategy = "rev" if vectorized else "rev-loop"
    if alone is not None:
        raise StrategyError(
            f"{call}: strategy={strategy!r} computes with reverse-mode AD, and torch's "
            f"backward formula of {alone} is wrong for the tensor scattered into (the "
            f"gradient of that tensor is passed inside the scattered region rather than "
            f"outside it), which f ({name}) computes from its differentiated inputs, so the "
            f"Jacobian would be wrong, with or without torch.vmap.\n"
            f"  Fix: strategy='fwd-loop' (forward mode, whose formula is right; torch.vmap "
            f"has no batching rule for it), or 'auto', which checks its reverse products "
            f"and takes forward mode there."
        )
    if batching is None or not vectorized:
        return vectorized
    if chunk != 1:
        warn_once(
            ("named rev, batched wrongly", named[1]),
            f"{call}: strategy='rev' computes its rows under torch.vmap, whose batching "
            f"rule for the backward of {batching} in f ({name}) is wrong (torch's: the rows "
            f"are off by a relative error near 1, each alone is right), so it computed the "
            f"rows one reverse product at a time, without vmap, as it does wherever f's "
            f"graph holds that operator.\n"
            f"  Pass strategy='rev-loop' (or chunk_size=1) to compute them that way "
            f"directly. This warning is shown once per function.",
            JacobianWarning,
        )
    return False


def wrong_ops(outs: Sequence[Tensor]) -> tuple[str | None, str | None]:
    """``(batched wrongly, wrong alone)``: the ops of NOTE [named reverse strategies and
    wrong formulas] the graph of ``outs`` holds, by name (None: none)."""
    batching = alone = None
    for node in graph_nodes(outs):
        name = type(node).__name__
        batching = batching or _BATCHED_WRONGLY.get(name)
        if name in _WRONG_ALONE and node.next_functions and node.next_functions[0][0] is not None:
            alone = alone or _WRONG_ALONE[name]
    return batching, alone
