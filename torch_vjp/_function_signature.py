"""What a custom Function's forward declares, read from its signature."""

from __future__ import annotations

import inspect

import torch

__all__ = ["declared_inputs"]


def declared_inputs(cls: type) -> int:
    """How many inputs ``cls.forward`` declares (not counting ctx; 0 where it cannot be
    told, or for ``*args``): a backward may return a trailing None for each one a call left
    to its default (``forward(ctx, x, scale=None)`` called as ``apply(x)``)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())
    except (TypeError, ValueError):
        return 0
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 0
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    old_style = getattr(cls, "setup_context", None) is torch.autograd.Function.setup_context
    return max(0, len(positional) - (1 if old_style else 0))
