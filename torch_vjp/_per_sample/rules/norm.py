"""Normalisation layers: LayerNorm, RMSNorm, GroupNorm and BatchNorm in eval mode.

Each normalises an example with statistics of that example alone (BatchNorm in eval mode
with its running statistics), then applies a per-feature affine map ``y = x_hat w + b``; so
example ``i``'s gradient of ``w`` is ``sum g[i] * x_hat[i]`` and of ``b`` is ``sum g[i]``
over the positions that share a feature. ``x_hat`` is recomputed from the recorded input.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torch_vjp._per_sample.factors import SmallFactor
from torch_vjp._per_sample.registry import Rule, register_rule, to_batch_first

__all__ = ["LayerNormRule", "RMSNormRule", "GroupNormRule", "BatchNormEvalRule"]


def affine_factors(xhat: Tensor, g: Tensor, sum_dims: tuple[int, ...], roles: set[str]):
    """The per-sample gradients of an affine map's ``weight`` and ``bias``."""
    out = []
    if "weight" in roles:
        prod = xhat * g
        out.append(("weight", SmallFactor(prod.sum(sum_dims) if sum_dims else prod)))
    if "bias" in roles:
        out.append(("bias", SmallFactor(g.sum(sum_dims) if sum_dims else g)))
    return out


def _normalized_input(call, g, batch):
    """Input and output gradient of a LayerNorm/RMSNorm call as ``(B, rows, *normalized)``,
    and the normalized dimensions."""
    k = len(call.module.normalized_shape)
    x = to_batch_first(call.x, call.bdim)
    gb = to_batch_first(g, call.bdim)
    x = x.reshape(batch, -1, *x.shape[x.dim() - k:])
    return x, gb.reshape(x.shape), tuple(range(2, 2 + k))


class _LastDims(Rule):
    """A layer applied to the last ``len(normalized_shape)`` dimensions."""

    def batch_dims(self, module, x):
        if not isinstance(x, Tensor):
            return ()
        return tuple(range(max(0, x.dim() - len(module.normalized_shape))))


@register_rule(nn.LayerNorm)
class LayerNormRule(_LastDims):
    name = "LayerNorm"

    def factors(self, call, grads, roles, batch):
        if grads[0] is None:
            return []
        x, gb, dims = _normalized_input(call, grads[0], batch)
        var, mean = torch.var_mean(x, dim=dims, keepdim=True, unbiased=False)
        xhat = (x - mean) * torch.rsqrt(var + call.module.eps)
        return affine_factors(xhat, gb, (1,), roles)


if hasattr(nn, "RMSNorm"):

    @register_rule(nn.RMSNorm)
    class RMSNormRule(_LastDims):
        name = "RMSNorm"

        def factors(self, call, grads, roles, batch):
            if grads[0] is None:
                return []
            m = call.module
            x, gb, dims = _normalized_input(call, grads[0], batch)
            eps = m.eps if m.eps is not None else torch.finfo(x.dtype).eps
            xhat = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
            return affine_factors(xhat, gb, (1,), roles)


class _ChannelsFirst(Rule):
    """A layer over ``(N, C, *)`` inputs: the examples are along dimension 0."""

    def batch_dims(self, module, x):
        return (0,) if isinstance(x, Tensor) and x.dim() >= 2 else ()


@register_rule(nn.GroupNorm)
class GroupNormRule(_ChannelsFirst):
    name = "GroupNorm"

    def factors(self, call, grads, roles, batch):
        if grads[0] is None:
            return []
        m = call.module
        x = to_batch_first(call.x, call.bdim)
        gb = to_batch_first(grads[0], call.bdim)
        C = x.shape[1]
        xg = x.reshape(batch, m.num_groups, -1)
        var, mean = torch.var_mean(xg, dim=2, keepdim=True, unbiased=False)
        xhat = ((xg - mean) * torch.rsqrt(var + m.eps)).reshape(batch, C, -1)
        return affine_factors(xhat, gb.reshape(batch, C, -1), (2,), roles)


@register_rule(nn.modules.batchnorm._BatchNorm)
class BatchNormEvalRule(_ChannelsFirst):
    """BatchNorm with running statistics in eval mode: a per-channel affine map of each
    example (in training mode it mixes examples, which the plan refuses)."""

    name = "BatchNorm (eval)"

    def applies(self, module):
        return (
            not module.training
            and module.running_mean is not None
            and module.running_var is not None
        )

    def factors(self, call, grads, roles, batch):
        if grads[0] is None:
            return []
        m = call.module
        x = to_batch_first(call.x, call.bdim)
        gb = to_batch_first(grads[0], call.bdim)
        C = x.shape[1]
        x3 = x.reshape(batch, C, -1)
        rm = m.running_mean.to(x.dtype).view(1, C, 1)
        rv = m.running_var.to(x.dtype).view(1, C, 1)
        xhat = (x3 - rm) * torch.rsqrt(rv + m.eps)
        return affine_factors(xhat, gb.reshape(batch, C, -1), (2,), roles)
