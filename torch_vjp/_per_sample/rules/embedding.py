"""Embeddings: ``nn.Embedding`` and ``nn.EmbeddingBag``.

Example ``i``'s gradient of the table is ``sum_t onehot(idx[i, t]) g[i, t]^T``: the output
gradients of its positions scattered into the rows of the indices it looked up
(:class:`~torch_vjp._per_sample.factors.EmbeddingFactor`).

An ``EmbeddingBag`` reduces each bag of indices to one row of its output, so a bag's
gradient of the table is ``sum_t w_t onehot(idx_t) g[bag]^T`` over the bag's positions
``t``: ``w_t`` is the position's ``per_sample_weights`` entry (mode ``"sum"``), or one over
the number of the bag's indices that are not ``padding_idx`` (mode ``"mean"``); positions
that hold ``padding_idx`` get nothing. In mode ``"max"`` each column ``d`` of the output is
the largest ``table[idx_t, d]`` of the bag, so ``g[bag, d]`` goes to column ``d`` of that
arg-max row alone. The bags are the examples (the output is ``(bags, D)``, whether the input
is 2-D or 1-D with ``offsets``); in a batch of one every bag belongs to the one example.
These gradients are sparse in the table's rows, so they are held as distinct
(example, row) pairs (:class:`BagFactor`) and their norms and clipped sums never form a
``(B, V, D)`` tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from torch_vjp._per_sample.factors import EmbeddingFactor, Factor
from torch_vjp._per_sample.keep import KeepBudget
from torch_vjp._per_sample.norms_wide import wide_sq_norms
from torch_vjp._per_sample.registry import Rule, register_rule, to_batch_first

__all__ = ["EmbeddingRule", "EmbeddingBagRule", "BagFactor"]


def _declined(module) -> str:
    what = "max_norm (rows renormalised in place)" if module.max_norm is not None else (
        "scale_grad_by_freq (gradients scaled by counts over the whole batch)")
    return f"the {type(module).__name__} rule does not handle {what}"


@register_rule(nn.Embedding)
class EmbeddingRule(Rule):
    name = "Embedding"

    def applies(self, module):
        # renormalising rows (max_norm) and scaling by frequency in the batch both make one
        # example's gradient depend on the others' indices
        return not module.scale_grad_by_freq and module.max_norm is None

    def declined(self, module):
        return _declined(module)

    def batch_dims(self, module, x):
        return tuple(range(x.dim())) if isinstance(x, Tensor) else ()

    def factors(self, call, grads, roles, batch):
        if grads[0] is None or "weight" not in roles:
            return []
        m = call.module
        idx = to_batch_first(call.x, call.bdim).reshape(batch, -1)
        gb = to_batch_first(grads[0], call.bdim)
        gb = gb.reshape(batch, idx.shape[1], gb.shape[-1])
        return [("weight", EmbeddingFactor(idx, gb, m.num_embeddings, m.padding_idx))]


class BagFactor(Factor):
    """``G_i = sum_{k: ex[k] = i} onehot(idx[k]) src[k]^T``: a table's per-sample gradients
    as rows ``src: (K, D)`` given to (example, row) pairs ``(ex[k], idx[k])``.

    The pairs are made distinct (rows of one pair added) and sorted by example when the
    factor is built, so that a pair's row is a row of ``G_i`` itself: squared norms are sums
    of squared row norms per example, and a range of examples is a contiguous slice.

    Args:
        ex: ``(K,)`` the example of each pair.
        idx: ``(K,)`` the table row of each pair.
        src: ``(K, D)`` what each pair adds to that row.
        batch: the number of examples ``B`` (some may have no pair).
        num_embeddings: the number of rows ``V`` of the table.
    """

    def __init__(self, ex: Tensor, idx: Tensor, src: Tensor, batch: int, num_embeddings: int):
        num = num_embeddings
        uniq, inv = torch.unique(ex * num + idx, return_inverse=True)  # sorted: by example
        self.src = src.new_zeros((uniq.numel(), src.shape[1])).index_add_(0, inv, src)
        self.ex = torch.div(uniq, num, rounding_mode="floor")
        self.idx = uniq - self.ex * num
        self.num = num
        self._batch = batch
        self.region_shape = (num, src.shape[1])

    @property
    def batch(self) -> int:
        return self._batch

    def _dtype(self) -> torch.dtype:
        return self.src.dtype

    def _device(self) -> torch.device:
        return self.src.device

    def write_range(self, out: Tensor, start: int, stop: int, accumulate: bool) -> None:
        bounds = torch.tensor([start, stop], dtype=self.ex.dtype, device=self.ex.device)
        lo, hi = torch.searchsorted(self.ex, bounds).tolist()
        n, D = stop - start, self.src.shape[1]
        keys = (self.ex[lo:hi] - start) * self.num + self.idx[lo:hi]
        src = self.src[lo:hi].to(out.dtype)
        if not accumulate:
            out.zero_()
        if out.is_contiguous():
            out.view(n * self.num, D).index_add_(0, keys, src)
        else:
            tmp = torch.zeros((n * self.num, D), dtype=out.dtype, device=out.device)
            out.add_(tmp.index_add_(0, keys, src).view(out.shape))

    def sq_norms(self, chunk_size: int | None, keep: KeepBudget | None = None) -> Tensor:
        # the pairs are distinct, so each is one row of one example's gradient
        rows = wide_sq_norms(self.src)  # (NOTE [norms past the square])
        return rows.new_zeros(self._batch).index_add_(0, self.ex, rows)

    def weighted_sum(self, c: Tensor) -> Tensor:
        scaled = self.src * c.to(self.src.dtype)[self.ex].unsqueeze(1)
        return self.src.new_zeros(self.region_shape).index_add_(0, self.idx, scaled)

    def merge_key(self) -> Any:
        return ("embedding-bag", self.num, self.src.shape[1], self._batch)

    @staticmethod
    def merge(factors: list[Factor]) -> Factor:
        fs: list[BagFactor] = factors  # type: ignore[assignment]
        return BagFactor(
            torch.cat([f.ex for f in fs]), torch.cat([f.idx for f in fs]),
            torch.cat([f.src for f in fs]), fs[0].batch, fs[0].num,
        )


def _bag_inputs(call) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The ``input``, ``offsets`` and ``per_sample_weights`` of an ``EmbeddingBag`` call
    (the recorder moves arguments passed by keyword to their positions)."""
    args = call.args
    x = args[0]
    offsets = args[1] if len(args) > 1 else None
    psw = args[2] if len(args) > 2 else call.kwargs.get("per_sample_weights")
    return x, offsets, psw


def _flat_bags(m: nn.EmbeddingBag, x: Tensor, offsets: Tensor | None):
    """Every position of the input as ``(idx, bag)``, both ``(N,)`` longs, and the number of
    bags."""
    if x.dim() == 2:  # (bags, T): one bag per row, offsets unused
        n, T = x.shape
        bag = torch.arange(n, device=x.device).repeat_interleave(T)
        return x.reshape(-1).long(), bag, n
    N = x.shape[0]
    offsets = offsets.long()
    nbags = offsets.numel() - (1 if m.include_last_offset else 0)
    starts = offsets[:nbags]
    # A position belongs to the last bag that starts at or before it, as in torch's own
    # offset-to-bag map (the last bag runs to the end of the input even where
    # include_last_offset gives a smaller last offset); counting the starts at each position
    # and taking the running sum gives that bag, empty bags included.
    starts = starts[starts < N]
    count = torch.zeros(N, dtype=torch.long, device=x.device)
    count.index_add_(0, starts, torch.ones_like(starts))
    bag = count.cumsum(0) - 1
    return x.long(), bag, nbags


def _tile(t: Tensor, rows: int) -> Tensor:
    """``t`` once per output row (a shared call's one bag, used by every example)."""
    return t.repeat(rows, *([1] * (t.dim() - 1)))


def _max_rows(weight: Tensor, idx: Tensor, bag: Tensor, nbags: int) -> tuple[Tensor, Tensor]:
    """For mode ``"max"``: the table row whose value each ``(bag, column)`` of the output
    took, ``(nbags, D)``, and where there is one (an empty bag's output is zero and takes
    nothing). Ties go to the bag's first position, as torch's CPU kernel resolves them; a
    tie only matters between distinct rows with equal values."""
    M, D = idx.numel(), weight.shape[1]
    vals = weight[idx]  # (M, D): the rows the forward compared, as the forward's own gather
    where = bag.unsqueeze(1).expand(M, D)
    best = vals.new_full((nbags, D), float("-inf")).scatter_reduce_(0, where, vals, "amax")
    pos = torch.arange(M, device=idx.device).unsqueeze(1).expand(M, D)
    pos = torch.where(vals == best[bag], pos, M)
    first = torch.full((nbags, D), M, dtype=torch.long, device=idx.device)
    first.scatter_reduce_(0, where, pos, "amin")
    found = first < M
    rows = idx[first.clamp(max=max(M - 1, 0))] if M else first
    return rows, found


@register_rule(nn.EmbeddingBag)
class EmbeddingBagRule(Rule):
    """``nn.EmbeddingBag`` in modes sum (with or without ``per_sample_weights``), mean and
    max, with a 2-D input or a 1-D input and ``offsets``; see the module docstring."""

    name = "EmbeddingBag"

    def applies(self, module):
        # as for Embedding: max_norm renormalises the rows the batch looked up (in place) and
        # scale_grad_by_freq scales by counts over the whole batch
        return not module.scale_grad_by_freq and module.max_norm is None

    def declined(self, module):
        return _declined(module)

    def batch_dims(self, module, x):
        # the output is (bags, D) for both input layouts, and a bag is the unit of examples
        return (0,) if isinstance(x, Tensor) and x.dim() in (1, 2) else ()

    def factors(self, call, grads, roles, batch):
        g = grads[0]
        if g is None or "weight" not in roles:
            return []
        m = call.module
        weight = call.params["weight"][0].detach()
        x, offsets, psw = _bag_inputs(call)
        if call.shared:
            # the recorder expanded the one example's input to the batch along dimension 0;
            # the other arguments (offsets, weights) are the call's own: undo the expansion
            x = x[:1]
        idx, bag, nbags = _flat_bags(m, x, offsets)
        keep = bag >= 0
        if m.padding_idx is not None:
            keep &= idx != m.padding_idx
        rows_out = g.shape[0]
        if m.mode == "max":
            row, found = _max_rows(weight, idx[keep], bag[keep], nbags)
            if call.shared:
                row, found = row.expand(rows_out, -1), found.expand(rows_out, -1)
            ex = self._examples(call, rows_out, g.device)
            return [("weight", self._max_factor(row, found, ex, g, batch, m.num_embeddings))]
        w = keep.to(g.dtype)
        if m.mode == "sum" and psw is not None:
            w = w * psw.reshape(-1).to(g.dtype)
        elif m.mode == "mean":
            count = g.new_zeros(nbags).index_add_(0, bag[keep], w[keep])
            w = w / count[bag.clamp(min=0)].clamp(min=1)
        idx, bag, w = idx[keep], bag[keep], w[keep]
        if call.shared:  # one bag, once per example
            n = idx.numel()
            idx, w = _tile(idx, rows_out), _tile(w, rows_out)
            bag = torch.arange(rows_out, device=g.device).repeat_interleave(n)
        ex = self._examples(call, rows_out, g.device)
        src = g[bag] * w.unsqueeze(1)
        return [("weight", BagFactor(ex[bag], idx, src, batch, m.num_embeddings))]

    @staticmethod
    def _examples(call, rows: int, device: torch.device) -> Tensor:
        """The example of each output row: row ``r`` is example ``r``, or all rows are
        example 0 in a batch of one (no batch dimension)."""
        if call.bdim is None:
            return torch.zeros(rows, dtype=torch.long, device=device)
        return torch.arange(rows, device=device)

    @staticmethod
    def _max_factor(row, found, ex, g, batch, num):
        """Pairs for mode ``"max"``: ``g[bag, d]`` to column ``d`` of row ``row[bag, d]``."""
        D = g.shape[1]
        col = torch.arange(D, device=g.device).expand_as(row)
        keys = (ex.unsqueeze(1) * num + row)[found]
        uniq, inv = torch.unique(keys, return_inverse=True)
        src = g.new_zeros((uniq.numel(), D))
        src.index_put_((inv, col[found]), g[found], accumulate=True)
        pair_ex = torch.div(uniq, num, rounding_mode="floor")
        return BagFactor(pair_ex, uniq - pair_ex * num, src, batch, num)
