"""What the clipped step keeps of the per-sample gradients its norms formed: a budget
(:data:`KEEP_ELEMENTS`), the kept gradients (:data:`Kept`), and their weighted sum."""

from __future__ import annotations

import math
from typing import Union

import torch
from torch import Tensor

__all__ = ["KEEP_ELEMENTS", "KeepBudget", "Kept", "kept_weighted_sum"]

#: Elements of per-sample gradients the clipped step may keep, in all, from the norms to the
#: clipped sums (16 MB in float32): a factor that forms its examples' gradients to take their
#: norms keeps them where they fit, and its clipped sum is then one matrix-vector product
#: instead of a second weight gradient (a convolution's is the dearest). Bounded by a
#: constant, so the clipped step still holds no buffer that grows with the model.
KEEP_ELEMENTS = 1 << 22


class KeepBudget:
    """What is left of :data:`KEEP_ELEMENTS` in one clipped step."""

    __slots__ = ("left",)

    def __init__(self, elements: int) -> None:
        self.left = elements

    def buffer(self, batch: int, shape: tuple[int, ...], like: Tensor) -> Tensor | None:
        """An empty ``(batch, *shape)`` tensor if the budget allows it (then taken from
        it), else None."""
        return like.new_empty((batch, *shape)) if self.take(batch * math.prod(shape)) else None

    def take(self, elements: int) -> bool:
        """Whether ``elements`` more fit the budget (then taken from it)."""
        if elements > self.left:
            return False
        self.left -= elements
        return True


#: What a factor keeps of the per-sample gradients it formed (:attr:`Factor.kept`): one
#: ``(B, ...)`` tensor, or the chunks ``(start, stop, gradients)`` as they were formed
#: (kept as they are, not copied into one new buffer: ``rules/conv.py``'s figure).
Kept = Union[Tensor, "list[tuple[int, int, Tensor]]"]


def kept_weighted_sum(kept: Kept, c: Tensor) -> Tensor:
    """``sum_i c[i] G_i`` from the per-sample gradients ``kept``, of shape ``G_i``'s."""
    if isinstance(kept, Tensor):
        return torch.tensordot(c.to(kept.dtype), kept, dims=1)
    # (chunk by chunk, each added by the product itself: one matrix-vector product into the
    # sum, where tensordot made a product and its sum another pass, behind a Python layer)
    total: Tensor | None = None
    for s, e, g in kept:
        rows = g.reshape(e - s, -1)
        if total is None:
            total = torch.mv(rows.T, c[s:e].to(g.dtype))
        else:
            total.addmv_(rows.T, c[s:e].to(g.dtype))
    assert total is not None
    return total.view(kept[0][2].shape[1:])
