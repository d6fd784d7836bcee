"""Jacobian blocks: the stacked products cut into one block per (output, input) pair, and
the blocks arranged in torch.func's layout.

A Jacobian of flat outputs ``j`` and flat input leaves ``i`` is a grid of blocks
``blocks[j][i]`` of shape ``(*out_j, *in_i)`` (``(B, *out_j, *in_i)`` for
``batch_jacobian``). Reverse mode stacks one product per output element, forward mode one
per input element; :func:`rev_blocks` and :func:`fwd_blocks` cut either into the grid
without copying, and :func:`assemble` arranges the grid as the output's pytree of the
differentiated primals' structure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_unflatten

from torch_vjp._engine.problem import Problem

__all__ = ["Blocks", "rev_blocks", "fwd_blocks", "assemble", "cotangent_products"]


class Blocks:
    """The result of a Jacobian computation: ``blocks[j][i]`` is the Jacobian of flat output
    ``j`` with respect to flat input leaf ``i``; ``views[j][i]`` holds the same elements (a
    row slice of the stacked products), cheap to scan for all-zero blocks; ``connected`` is
    True when every output was seen to depend on the differentiated leaves through autograd
    (it requires grad in reverse mode, it has a tangent in forward mode); ``looped`` is True
    when "auto" computed them by its loop because torch.vmap could not run f;
    ``forward_instead`` is True when they were computed by plain forward mode because the
    plain reverse loop met a wrong backward formula (NOTE [a plain loop through a wrong
    backward] in :mod:`torch_vjp._engine.wrongops`)."""

    __slots__ = ("blocks", "out_spec", "aux", "mode", "views", "connected", "looped",
                 "forward_instead")

    def __init__(
        self,
        blocks: list[list[Tensor]],
        out_spec: TreeSpec,
        aux: Any,
        mode: str,
        views: list[list[Tensor]] | None = None,
        connected: bool = False,
    ):
        self.blocks = blocks
        self.out_spec = out_spec
        self.aux = aux
        self.mode = mode
        self.views = views if views is not None else blocks
        self.connected = connected
        self.looped = False
        self.forward_instead = False


def owned(t: Tensor) -> Tensor:
    """``t``, or a contiguous copy of it where it is an expanded view (a stride 0 along a
    dimension of size above 1, as vmap gives for an input the output does not depend on):
    such a view cannot be written into, and a block handed to the user is an ordinary
    tensor, as torch.autograd.functional.jacobian's zeros are.

    Example:
        >>> owned(torch.zeros(3).expand(2, 3)).stride()
        (3, 1)
    """
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return t.contiguous()
    return t


def rev_blocks(
    stacked: Sequence[Tensor], out_rows: Sequence[torch.Size], batch: int | None
) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
    """stacked[i]: (n_out, [B,] *in_i) -> blocks[j][i]: ([B,] *out_j, *in_i), and the row
    slices they are views of.

    Example:
        >>> blocks, _ = rev_blocks([torch.zeros(6, 4)], [torch.Size([2]), torch.Size([4])],
        ...                        None)
        >>> [tuple(b[0].shape) for b in blocks]
        [(2, 4), (4, 4)]
    """
    numels = [math.prod(s) for s in out_rows]
    blocks: list[list[Tensor]] = [[] for _ in out_rows]
    views: list[list[Tensor]] = [[] for _ in out_rows]
    for res_i in stacked:
        res_i = owned(res_i)
        parts = res_i.split(numels) if len(numels) > 1 else (res_i,)
        tail = res_i.shape[1:]
        for j, part in enumerate(parts):
            block = part.reshape((*out_rows[j], *tail))
            if batch is not None:
                block = block.movedim(len(out_rows[j]), 0)
            blocks[j].append(block)
            views[j].append(part)
    return blocks, views


def fwd_blocks(
    stacked: Sequence[Tensor], in_rows: Sequence[torch.Size]
) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
    """stacked[j]: (n_in, [B,] *out_j) -> blocks[j][i]: ([B,] *out_j, *in_i), views of
    ``stacked[j]`` (returned twice: they are also the views to scan for zeros, holding the
    same elements as the row slices, first element first), or of a copy of it where an
    earlier ``stacked[k]`` shares its memory (NOTE [blocks of outputs that share memory]).

    Example:
        >>> blocks, _ = fwd_blocks([torch.zeros(5, 3)], [torch.Size([]), torch.Size([2, 2])])
        >>> [tuple(b.shape) for b in blocks[0]]
        [(3,), (3, 2, 2)]
    """
    numels = [math.prod(s) for s in in_rows]
    blocks: list[list[Tensor]] = []
    seen: set[int] = set()
    for res_j in stacked:
        res_j = owned(res_j)
        where = _storage(res_j)
        if where is not None:
            if where in seen:  # NOTE [blocks of outputs that share memory]
                res_j = res_j.clone()
            else:
                seen.add(where)
        moved = res_j.movedim(0, -1)
        parts = moved.split(numels, dim=-1) if len(numels) > 1 else (moved,)
        row_blocks = []
        for part, shape in zip(parts, in_rows):
            if len(shape) == 0:
                part = part.squeeze(-1)
            elif len(shape) > 1:
                part = part.unflatten(-1, shape)
            row_blocks.append(part)
        blocks.append(row_blocks)
    return blocks, blocks


# NOTE [blocks of outputs that share memory]
# Forward mode's products of an output are its tangent, and where f returns one tensor twice,
# or a view of another of its outputs ((y, y), (y, y[0]), (x, x)), those tangents share
# memory: their blocks did too, and a write into one block changed another (torch.func.jacfwd
# returns them so). Each block handed to the user is its own memory, as in reverse mode: the
# products of an output whose memory an earlier output's hold are copied (all of them, where
# the two merely share a storage without overlapping: a copy the size of that block, and
# only where f's outputs share memory).


def _storage(t: Tensor) -> int | None:
    """The address of ``t``'s storage; None for an empty tensor, or one without a storage of
    its own (a batched tensor of an outer torch.vmap, a tensor subclass)."""
    if t.numel() == 0:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def assemble(prob: Problem, res: Blocks) -> Any:
    """Arranges blocks in torch.func's layout: the output's pytree, each leaf replaced by
    the differentiated primals' structure (the primal for an int ``argnums``, a tuple of
    them for a tuple) holding that output's Jacobian blocks."""
    if prob.in_spec.is_leaf() and res.out_spec.num_leaves == 1:
        per_out = [res.blocks[0][0]]
        if res.out_spec.is_leaf():
            return per_out[0]
        return tree_unflatten(per_out, res.out_spec)
    per_out = [tree_unflatten(row, prob.in_spec) for row in res.blocks]
    return tree_unflatten(per_out, res.out_spec)


def cotangent_products(leaves: Sequence[Tensor], res: Blocks, batch: int | None,
                       us: Sequence[Tensor]) -> list[Tensor] | None:
    """``u^T J`` read from the blocks, one flat tensor per input leaf (in the leaf's dtype),
    for cotangents ``us`` (one per flat output; for ``batch_jacobian`` the blocks are
    per row of the batch, and so is the product); None where the blocks are not shaped as
    ``us`` and ``leaves`` say (f's outputs are not the blocks' rows).

    Example:
        >>> res = Blocks([[torch.eye(2)]], None, None, "rev", [[torch.eye(2)]], True)
        >>> cotangent_products([torch.ones(2)], res, None, [torch.tensor([1.0, 2.0])])
        [tensor([1., 2.])]
    """
    if len(us) != len(res.blocks):
        return None
    found = []
    with torch.no_grad():
        for i, x in enumerate(leaves):
            n_in = math.prod(x.shape[1:]) if batch is not None else x.numel()
            total = torch.zeros(x.numel(), dtype=x.dtype, device=x.device)
            for j, u in enumerate(us):
                block = res.blocks[j][i].detach()
                if block.numel() != u.numel() * n_in:
                    return None
                if batch is None:
                    part = u.reshape(1, -1).to(block.dtype) @ block.reshape(u.numel(), n_in)
                else:
                    n_row = math.prod(u.shape[1:])
                    rows = u.reshape(batch, n_row, 1).to(block.dtype)
                    part = (rows * block.reshape(batch, n_row, n_in)).sum(1)
                total += part.reshape(-1).to(total.dtype)
            found.append(total)
    return found
