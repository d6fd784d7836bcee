"""Normalisation layers: LayerNorm, RMSNorm, GroupNorm, InstanceNorm, BatchNorm in eval mode.

Each normalises an example with statistics of that example alone (BatchNorm in eval mode,
and InstanceNorm in eval mode with ``track_running_stats``, with their running statistics),
then applies a per-feature affine map ``y = x_hat w + b``; so example ``i``'s gradient of
``w`` is ``sum g[i] * x_hat[i]`` and of ``b`` is ``sum g[i]`` over the positions that share
a feature. ``x_hat`` is recomputed from the recorded input; for LayerNorm, from the mean and
reciprocal standard deviation its forward kernel saved, where they can be read (NOTE [the
forward's statistics]).

The channels-first layers (GroupNorm, InstanceNorm, BatchNorm) see ``(N, C, *)`` inputs with
the examples along dimension 0; for a batch of one the plan gives no batch dimension
(``call.bdim is None``) and all ``N`` rows of the input belong to the one example, so their
contributions are summed (:func:`_channels_first`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_vjp._engine.compile_key import tracing
from torch_vjp._per_sample.factors import SmallFactor
from torch_vjp._per_sample.registry import Rule, register_rule, to_batch_first

__all__ = [
    "LayerNormRule", "RMSNormRule", "GroupNormRule", "InstanceNormRule", "BatchNormEvalRule",
]


def affine_factors(xhat: Tensor, g: Tensor, sum_dims: tuple[int, ...], roles: set[str]):
    """The per-sample gradients of an affine map's ``weight`` and ``bias``.

    ``xhat`` is the rule's own temporary (every rule here computes it afresh): ``xhat * g``
    is written over it where the product keeps its shape and dtype, which spares a second
    buffer the size of the input (on the CPU a fresh one of a few hundred KB is a new
    mapping each time, about half the cost of the product)."""
    out = []
    if "weight" in roles:
        if xhat.shape == g.shape and xhat.dtype == torch.result_type(xhat, g):
            prod = xhat.mul_(g)
        else:
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


# NOTE [the forward's statistics]
# A LayerNorm's ``x_hat`` is ``(x - mean) * rstd``, and the forward's kernel
# (``native_layer_norm``) saves ``mean`` and ``rstd`` for its backward. Read from the
# layer's output node when the call is recorded (the rules run after the backward, which
# frees them), they spare the rule a second normalisation: one subtraction and one product
# in place of ``F.layer_norm``'s passes (0.2 of its time on the (32, 32, 128) inputs of
# benchmarks/bench_per_sample.py's transformer, one thread). They are used only where they
# are the statistics of the recorded input itself: the node is the output's own
# ``NativeLayerNormBackward0``, its saved input is the recorded tensor (a layer whose forward
# normalises something else, a copy in float32, has another node or another input, and the
# rule recomputes), and that tensor was not modified in place since (the rules' pass moves
# such a call's parameters to the fallback: ``Call.x_version``). The statistics themselves
# are the kernel's own outputs, which nothing else holds. Under autocast the kernel runs in
# float32 on an input of lower precision: the dtypes differ, and the rule recomputes (it
# does in the recorded input's dtype).


def _forward_stats(call) -> tuple[Tensor, Tensor] | None:
    """The ``mean`` and ``rstd`` a LayerNorm call's kernel saved, where they are those of
    the recorded input (NOTE [the forward's statistics]), else None."""
    x = call.x
    edge = call.out_edges[0] if call.out_edges else None
    if edge is None or edge.output_nr != 0 or not isinstance(x, Tensor) or tracing():
        return None  # (traced, compile=True: the rule normalises, as the graph can hold it)
    node = edge.node
    if type(node).__name__ != "NativeLayerNormBackward0":
        return None
    try:
        if node._saved_input is not x:
            return None
        mean, rstd = node._saved_result1, node._saved_result2
    except (AttributeError, RuntimeError):  # (freed, or another torch's node)
        return None
    k = len(call.module.normalized_shape)
    want = (*x.shape[:x.dim() - k], *([1] * k))
    if (tuple(mean.shape) != want or tuple(rstd.shape) != want or mean.dtype != x.dtype
            or rstd.dtype != x.dtype):
        return None
    return mean, rstd


@register_rule(nn.LayerNorm)
class LayerNormRule(_LastDims):
    name = "LayerNorm"

    def at_forward(self, call) -> None:
        """Keeps the statistics the forward's kernel saved (NOTE [the forward's
        statistics])."""
        stats = _forward_stats(call)
        if stats is not None:
            call.extra["stats"] = stats

    def factors(self, call, grads, roles, batch):
        if grads[0] is None:
            return []
        x, gb, dims = _normalized_input(call, grads[0], batch)
        stats = call.extra.get("stats")
        if stats is not None and stats[0].dtype == x.dtype:
            ones = (1,) * len(dims)
            mean, rstd = (to_batch_first(s, call.bdim).reshape(batch, -1, *ones) for s in stats)
            xhat = (x - mean).mul_(rstd)
        else:
            # the layer's own kernel without its affine map: 0.18 of the time a var_mean
            # over the last dimensions took (benchmarks/results/per_sample_parts.md)
            xhat = F.layer_norm(x, x.shape[2:], eps=call.module.eps)
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


def _channels_first(call, g: Tensor) -> tuple[Tensor, Tensor]:
    """The input and output gradient of a channels-first call as ``(N, C, L)``.

    ``N`` is the batch when ``call.bdim == 0``; with ``call.bdim is None`` (a batch of one)
    it is whatever the input has, every row belonging to the one example: the rows are not
    moved behind a new leading dimension (``to_batch_first``) because dimension 1 must stay
    the channels; :func:`_per_example` sums them instead.
    """
    x = call.x
    return x.reshape(x.shape[0], x.shape[1], -1), g.reshape(x.shape[0], x.shape[1], -1)


def _per_example(factors, call):
    """Sums per-row factors ``(N, C)`` into one example's when the call has no batch
    dimension (see :func:`_channels_first`)."""
    if call.bdim is not None:
        return factors
    return [(role, SmallFactor(f.value.sum(0, keepdim=True))) for role, f in factors]


@register_rule(nn.GroupNorm)
class GroupNormRule(_ChannelsFirst):
    name = "GroupNorm"

    def factors(self, call, grads, roles, batch):
        if grads[0] is None:
            return []
        m = call.module
        x, gb = _channels_first(call, grads[0])
        N, C, _ = x.shape
        xhat = F.group_norm(x, m.num_groups, eps=m.eps)  # the layer's kernel, no affine map
        return _per_example(affine_factors(xhat, gb, (2,), roles), call)


# the public classes, not their private base, so that messages listing the rules name them
@register_rule(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
class InstanceNormRule(_ChannelsFirst):
    """InstanceNorm1d/2d/3d with ``affine=True``: each channel of each example is normalised
    with its own mean and variance over the spatial positions; in eval mode with
    ``track_running_stats=True``, with the running statistics instead (as BatchNorm in eval
    mode). In training mode with ``track_running_stats=True`` the output still uses the
    example's own statistics, but the forward updates the running statistics from the whole
    batch, which ``args.check_static_mixing`` refuses before any rule runs."""

    name = "InstanceNorm"

    def batch_dims(self, module, x):
        # an input without a batch dimension, (C, *), has only its channels and positions:
        # neither holds examples that the layer keeps apart
        if not isinstance(x, Tensor) or x.dim() <= module._get_no_batch_dim():
            return ()
        return (0,)

    def factors(self, call, grads, roles, batch):
        if grads[0] is None:
            return []
        m = call.module
        x, g = call.x, grads[0]
        if x.dim() == m._get_no_batch_dim():  # (C, *): one example, as the layer does
            x, g = x.unsqueeze(0), g.unsqueeze(0)
        N, C = x.shape[0], x.shape[1]
        x3, g3 = x.reshape(N, C, -1), g.reshape(N, C, -1)
        if m.training or not m.track_running_stats:  # as F.instance_norm's use_input_stats
            xhat = F.group_norm(x3, C, eps=m.eps)  # one group per channel: each its own
        else:
            mean = m.running_mean.to(x3.dtype).view(1, C, 1)
            var = m.running_var.to(x3.dtype).view(1, C, 1)
            xhat = (x3 - mean) * torch.rsqrt(var + m.eps)
        return _per_example(affine_factors(xhat, g3, (2,), roles), call)


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

    def declined(self, module):
        return ("the BatchNorm rule applies in eval mode with running statistics only (in "
                "training mode the layer normalises with statistics of the whole batch)")

    def factors(self, call, grads, roles, batch):
        if grads[0] is None:
            return []
        m = call.module
        x3, g3 = _channels_first(call, grads[0])
        C = x3.shape[1]
        rm = m.running_mean.to(x3.dtype).view(1, C, 1)
        rv = m.running_var.to(x3.dtype).view(1, C, 1)
        xhat = (x3 - rm) * torch.rsqrt(rv + m.eps)
        return _per_example(affine_factors(xhat, g3, (2,), roles), call)
