"""A backward pass run in grad mode, its results detached (NOTE [a backward right only in
grad mode] in :mod:`torch_vjp._engine.wrongops`): the one way every reverse product that
is to be detached runs where f's graph holds a backward that is right only in grad mode
(``torch.linalg.det``'s)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

__all__ = ["in_grad_mode"]


def in_grad_mode(backward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``backward(*args, **kwargs)`` run under ``torch.enable_grad()``, every tensor of its
    result detached (anything else, None included, as it is): the graph its pass records
    lives for the call only. ``backward`` is a pullback or ``torch.autograd.grad``, given
    ``create_graph=True`` by its caller where it decides by that and not by the grad
    mode."""
    with torch.enable_grad():
        res = backward(*args, **kwargs)
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, res)
