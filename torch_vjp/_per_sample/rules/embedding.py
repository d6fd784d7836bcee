"""Embeddings: ``nn.Embedding``.

Example ``i``'s gradient of the table is ``sum_t onehot(idx[i, t]) g[i, t]^T``: the output
gradients of its positions scattered into the rows of the indices it looked up
(:class:`~torch_vjp._per_sample.factors.EmbeddingFactor`).
"""

from __future__ import annotations

from torch import Tensor, nn

from torch_vjp._per_sample.factors import EmbeddingFactor
from torch_vjp._per_sample.registry import Rule, register_rule, to_batch_first

__all__ = ["EmbeddingRule"]


@register_rule(nn.Embedding)
class EmbeddingRule(Rule):
    name = "Embedding"

    def applies(self, module):
        # renormalising rows (max_norm) and scaling by frequency in the batch both make one
        # example's gradient depend on the others' indices
        return not module.scale_grad_by_freq and module.max_norm is None

    def batch_dims(self, module, x):
        return tuple(range(x.dim())) if isinstance(x, Tensor) else ()

    def factors(self, call, grads, roles, batch):
        if grads[0] is None or "weight" not in roles:
            return []
        m = call.module
        idx = to_batch_first(call.x, call.bdim).reshape(batch, -1)
        gb = to_batch_first(grads[0], call.bdim).reshape(batch, idx.shape[1], -1)
        return [("weight", EmbeddingFactor(idx, gb, m.num_embeddings, m.padding_idx))]
