"""Attention: the projections inside ``nn.MultiheadAttention``.

``nn.MultiheadAttention``'s parameters are used inside ``F.multi_head_attention_forward``,
not by submodules: its packed in-projection (query, key and value blocks of one weight), the
out-projection, and ``bias_k``/``bias_v``. While the recorder runs, a
``TorchFunctionMode`` routes that function through :func:`mha_forward`, torch's own
arithmetic step for step, in which each projection is a recorded Linear call (over the
block of weight rows it uses) and ``bias_k``/``bias_v`` are recorded as parameters repeated
over the batch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_vjp._per_sample.registry import _stock

if TYPE_CHECKING:  # (the recorder imports this module)
    from torch_vjp._per_sample.recorder import Recorder

__all__ = ["AttentionMode", "is_attention", "mha_forward", "NotHandled"]


def is_attention(module: nn.Module) -> bool:
    """A stock ``nn.MultiheadAttention``, whose projections are handled inside its forward."""
    return isinstance(module, nn.MultiheadAttention) and _stock(
        module, nn.MultiheadAttention, defined=False)


class AttentionMode(torch.overrides.TorchFunctionMode):
    """Routes ``F.multi_head_attention_forward`` through :func:`mha_forward` while active."""

    def __init__(self, recorder: Any):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward:
            try:
                return mha_forward(self.recorder, *args, **kwargs)
            except NotHandled:
                pass
        return func(*args, **kwargs)


class NotHandled(Exception):
    """This attention call is left to torch (no parameter tracked, or an unusual layout)."""


def mha_forward(
    rec: Recorder,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    bias_k: Tensor | None,
    bias_v: Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    training: bool = True,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: Tensor | None = None,
    k_proj_weight: Tensor | None = None,
    v_proj_weight: Tensor | None = None,
    static_k: Tensor | None = None,
    static_v: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """torch's ``multi_head_attention_forward`` (torch 2.13) with recorded projections.

    The attention arithmetic is torch's own, step for step; only the in- and out-projections
    go through :meth:`Recorder.linear`, and ``bias_k``/``bias_v`` through
    :meth:`Recorder.expand`, so that the per-sample rules see their inputs and output edges.
    Raises ``NotHandled`` for calls it leaves to torch.
    """
    weights = (
        in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
        q_proj_weight, k_proj_weight, v_proj_weight, bias_k, bias_v,
    )
    if not any(isinstance(w, Tensor) and id(w) in rec.tracked for w in weights):
        raise NotHandled
    helpers = ("_mha_shape_check", "_canonical_mask", "_none_or_dtype")
    if not all(hasattr(F, h) for h in helpers) or isinstance(embed_dim_to_check, Tensor):
        raise NotHandled
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3 or query.shape[1] != rec.batch:
        raise NotHandled
    path = rec.attention_path
    is_batched = F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, num_heads)
    if not is_batched:
        raise NotHandled
    tgt_len, bsz, embed_dim = query.shape
    src_len, _, _ = key.shape
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. "
            "You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask,
            mask_name="attn_mask",
            other_type=None,
            other_name="",
            target_type=query.dtype,
            check_other=False,
        )
        if key_padding_mask is not None:
            is_causal = False
    if embed_dim != embed_dim_to_check:
        raise AssertionError(
            f"was expecting embedding dimension of {embed_dim_to_check}, but got {embed_dim}"
        )
    head_dim = embed_dim // num_heads
    if head_dim * num_heads != embed_dim:
        raise AssertionError(f"embed_dim {embed_dim} not divisible by num_heads {num_heads}")
    E = embed_dim
    # The projections run on batch-first views (N, L, E): the layout the per-sample rules
    # want, and for batch_first modules the layout of the caller's tensors.
    qb, kb, vb = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)

    def seq_first(t: Tensor) -> Tensor:
        return t.transpose(0, 1)

    if not use_separate_proj_weight:
        if key.shape != value.shape:
            raise AssertionError(f"key shape {key.shape} does not match value shape {value.shape}")
        if in_proj_weight is None:
            raise AssertionError("use_separate_proj_weight is False but in_proj_weight is None")
        if key is value:
            if query is key:
                proj = seq_first(rec.linear(qb, in_proj_weight, None, in_proj_bias, None, path))
                proj = proj.unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
                q, k, v = proj[0], proj[1], proj[2]
            else:
                q = seq_first(rec.linear(qb, in_proj_weight, slice(0, E), in_proj_bias, slice(0, E), path))
                kv = seq_first(
                    rec.linear(kb, in_proj_weight, slice(E, 3 * E), in_proj_bias, slice(E, 3 * E), path)
                )
                kv = kv.unflatten(-1, (2, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
                k, v = kv[0], kv[1]
        else:
            q = seq_first(rec.linear(qb, in_proj_weight, slice(0, E), in_proj_bias, slice(0, E), path))
            k = seq_first(rec.linear(kb, in_proj_weight, slice(E, 2 * E), in_proj_bias, slice(E, 2 * E), path))
            v = seq_first(
                rec.linear(vb, in_proj_weight, slice(2 * E, 3 * E), in_proj_bias, slice(2 * E, 3 * E), path)
            )
    else:
        if key.shape[:2] != value.shape[:2]:
            raise AssertionError(
                f"key's sequence and batch dims {key.shape[:2]} do not match value's {value.shape[:2]}"
            )
        if q_proj_weight is None or k_proj_weight is None or v_proj_weight is None:
            raise AssertionError("use_separate_proj_weight is True but a projection weight is None")
        q = seq_first(rec.linear(qb, q_proj_weight, None, in_proj_bias, slice(0, E), path))
        k = seq_first(rec.linear(kb, k_proj_weight, None, in_proj_bias, slice(E, 2 * E), path))
        v = seq_first(rec.linear(vb, v_proj_weight, None, in_proj_bias, slice(2 * E, 3 * E), path))

    if attn_mask is not None:
        if attn_mask.dim() == 2:
            correct_2d_size = (tgt_len, src_len)
            if attn_mask.shape != correct_2d_size:
                raise RuntimeError(
                    f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be {correct_2d_size}."
                )
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() == 3:
            correct_3d_size = (bsz * num_heads, tgt_len, src_len)
            if attn_mask.shape != correct_3d_size:
                raise RuntimeError(
                    f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be {correct_3d_size}."
                )
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")

    if bias_k is not None and bias_v is not None:
        if static_k is not None or static_v is not None:
            raise AssertionError("bias cannot be added to static key or value.")
        k = torch.cat([k, rec.expand(bias_k, bias_k.repeat(1, bsz, 1), path, 1)])
        v = torch.cat([v, rec.expand(bias_v, bias_v.repeat(1, bsz, 1), path, 1)])
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))
    elif bias_k is not None or bias_v is not None:
        raise AssertionError("bias_k and bias_v must both be set or both be None")

    q = q.reshape(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    if static_k is None:
        k = k.reshape(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    else:
        k = static_k
    if static_v is None:
        v = v.reshape(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    else:
        v = static_v

    if add_zero_attn:
        zero_attn_shape = (bsz * num_heads, 1, head_dim)
        k = torch.cat([k, torch.zeros(zero_attn_shape, dtype=k.dtype, device=k.device)], dim=1)
        v = torch.cat([v, torch.zeros(zero_attn_shape, dtype=v.dtype, device=v.device)], dim=1)
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))

    src_len = k.size(1)
    if key_padding_mask is not None:
        if hasattr(F, "_check_key_padding_mask"):
            F._check_key_padding_mask(key_padding_mask, src_len, bsz)
        key_padding_mask = (
            key_padding_mask.view(bsz, 1, 1, src_len)
            .expand(-1, num_heads, -1, -1)
            .reshape(bsz * num_heads, 1, src_len)
        )
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask

    if not training:
        dropout_p = 0.0

    if need_weights:
        _B, _Nt, Eh = q.shape
        q_scaled = q * math.sqrt(1.0 / float(Eh))
        if is_causal and attn_mask is None:
            raise AssertionError("FIXME: is_causal not implemented for need_weights")
        if attn_mask is not None:
            attn_output_weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            attn_output_weights = torch.bmm(q_scaled, k.transpose(-2, -1))
        attn_output_weights = F.softmax(attn_output_weights, dim=-1)
        if dropout_p > 0.0:
            attn_output_weights = F.dropout(attn_output_weights, p=dropout_p)
        attn_output = torch.bmm(attn_output_weights, v)
        attn_output = (
            attn_output.view(bsz, num_heads, tgt_len, head_dim)
            .permute(0, 2, 1, 3)
            .reshape(bsz, tgt_len, embed_dim)
        )
        attn_output = seq_first(rec.linear(attn_output, out_proj_weight, None, out_proj_bias, None, path))
        attn_output_weights = attn_output_weights.view(bsz, num_heads, tgt_len, src_len)
        if average_attn_weights:
            attn_output_weights = attn_output_weights.mean(dim=1)
        return attn_output, attn_output_weights
    if attn_mask is not None:
        if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
    q = q.view(bsz, num_heads, tgt_len, head_dim)
    k = k.view(bsz, num_heads, src_len, head_dim)
    v = v.view(bsz, num_heads, src_len, head_dim)
    attn_output = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
    attn_output = attn_output.permute(0, 2, 1, 3).reshape(bsz, tgt_len, embed_dim)
    attn_output = seq_first(rec.linear(attn_output, out_proj_weight, None, out_proj_bias, None, path))
    return attn_output, None
