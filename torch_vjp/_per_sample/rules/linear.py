"""Linear layers: ``nn.Linear`` and GPT-2's ``Conv1D`` (``transformers``).

``y = x W^T + b`` row by row, so the gradient example ``i`` alone gives ``W`` is
``sum_t g[i, t] x[i, t]^T`` over the rows ``t`` of the input that belong to example ``i``
(:class:`~torch_vjp._per_sample.factors.OuterFactor`), and ``b``'s is ``sum_t g[i, t]``.
"""

from __future__ import annotations

from torch import nn

from torch_vjp._per_sample.factors import OuterFactor, SmallFactor
from torch_vjp._per_sample.registry import Rule, register_rule, to_batch_first

__all__ = ["LinearRule", "Conv1DRule"]


def _rows(call, grads, batch):
    """The input and output gradient as ``(B, T, p)`` and ``(B, T, q)``, or as ``(B, p)``
    and ``(B, q)`` where each example is one row (``T == 1``)."""
    x = to_batch_first(call.x, call.bdim)
    g = to_batch_first(grads[0], call.bdim)
    if x.dim() == 2 and x.shape[0] == batch:
        return x, g
    p, q = x.shape[-1], g.shape[-1]
    return x.reshape(batch, -1, p), g.reshape(batch, -1, q)


def _bias(gg, rows=None, weight=None):
    if gg.dim() == 2:
        return SmallFactor(gg, rows, sq=None if weight is None else weight.g_sq_norms)
    return SmallFactor(gg[:, 0] if gg.shape[1] == 1 else gg.sum(1), rows)


@register_rule(nn.Linear)
class LinearRule(Rule):
    name = "Linear"

    def factors(self, call, grads, roles, batch):
        if grads[0] is None:
            return []
        a, gg = _rows(call, grads, batch)
        out = []
        w = None
        if "weight" in roles:
            _, rows = call.params["weight"]
            w = OuterFactor(a, gg, (gg.shape[-1], a.shape[-1]), rows)
            out.append(("weight", w))
        if "bias" in roles:
            out.append(("bias", _bias(gg, call.params["bias"][1], w)))
        return out


@register_rule("transformers.pytorch_utils.Conv1D", stock_only=True)
class Conv1DRule(Rule):
    """GPT-2's ``Conv1D``: a Linear layer whose weight is stored as ``(in, out)``."""

    name = "Conv1D (transformers)"

    def factors(self, call, grads, roles, batch):
        if grads[0] is None:
            return []
        a, gg = _rows(call, grads, batch)
        out = []
        if "weight" in roles:
            out.append(("weight", OuterFactor(a, gg, (a.shape[-1], gg.shape[-1]), None,
                                              transposed=True)))
        if "bias" in roles:
            out.append(("bias", _bias(gg)))
        return out
