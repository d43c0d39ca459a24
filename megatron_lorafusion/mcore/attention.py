"""Core attention for packed (THD) microbatches: causal within each sample, never across.

A drop-in replacement for Megatron's local `DotProductAttention` (which rejects packed
sequences). For packed input it also applies RoPE (``rotary``, set by the model builders),
per token and without host syncs, in place of Megatron's per-sample THD loop (the fused
`ops.rope` on CUDA, straight from the strided q/k views of the QKV split). CUDA uses
``torch.nn.attention.varlen.varlen_attn`` for fp16/bf16 when available (15× faster than the
per-sample loop on an H200, see shared/notes/stack.md); otherwise (CPU, fp32, attention
dropout) each sample runs through ``F.scaled_dot_product_attention`` in a Python loop.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lorafusion.mcore.fused_base import apply_rope

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # torch < 2.10 has no varlen attention
    _varlen_attn = None

# varlen_attn runs FlashAttention, which rejects fp32 (checked on torch 2.11, H200).
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)


def _repeat_kv(t: torch.Tensor, groups_per_head: int) -> torch.Tensor:
    """(T, ng, d) -> (T, np, d): query head j reads KV group j // groups_per_head (Megatron's)."""
    return t if groups_per_head == 1 else t.repeat_interleave(groups_per_head, dim=1)


def varlen_causal_attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention inside each packed sample, one SDPA call per sample (any device).

    Args:
        query: (T, np, d) queries of all samples, packed.
        key: (T, ng, d) keys; ``ng`` divides ``np`` (grouped-query attention).
        value: (T, ng, d) values.
        cu_seqlens: (S + 1,) int32 token offset of each sample.
        scale: softmax scale.
        dropout_p: attention-probability dropout.

    Returns:
        (T, np, d) attention output.
    """
    parts = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        # (T_s, heads, d) -> (heads, T_s, d): SDPA wants heads before tokens
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        o = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=True
        )
        parts.append(o.transpose(0, 1))  # (T_s, np, d)
    if bounds[-1] != query.shape[0]:
        raise ValueError(f"cu_seqlens covers {bounds[-1]} tokens, query has {query.shape[0]}")
    return torch.cat(parts) if parts else torch.empty_like(query)


class VarlenCoreAttention(MegatronModule):
    """Core attention that keeps packed samples apart; Megatron's `DotProductAttention` seam.

    Packed input (``packed_seq_params.qkv_format == 'thd'``): query ``(T, np, d)``,
    key/value ``(T, ng, d)``, output ``(T, np·d)``; each sample attends causally to itself
    only. Unpacked input (``packed_seq_params`` None): query ``[s, b, np, d]``, output
    ``[s, b, np·d]``, causal, plus the boolean ``attention_mask`` (True = masked out) if given.
    Heads are those of this TP rank (taken from the tensors).

    Attributes:
        rotary: the model's RoPE module (`mcore.model.set_rotary_embedding`); for packed
            input, q and k arrive unrotated (its ``forward`` gave Megatron no table) and are
            rotated here by position inside their sample. None: no RoPE.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        **kwargs,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("VarlenCoreAttention does not support context parallelism")
        if attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError(
                f"VarlenCoreAttention is causal only, got attn_mask_type={attn_mask_type}"
            )
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise NotImplementedError(
                "VarlenCoreAttention supports vanilla softmax without sliding windows, got "
                f"softmax_type={config.softmax_type!r}, window_size={config.window_size}"
            )
        self.layer_number = max(1, layer_number)
        self.attention_type = attention_type
        head_dim = config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.rotary: torch.nn.Module | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Attention output: ``(T, np·d)`` when packed, ``[s, b, np·d]`` otherwise."""
        if attention_bias is not None:
            raise NotImplementedError("VarlenCoreAttention does not take an attention_bias")
        dropout_p = self.dropout_p if self.training else 0.0
        if packed_seq_params is None:
            return self._forward_unpacked(query, key, value, attention_mask, dropout_p)
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(
                f"packed sequences must use qkv_format 'thd', got {packed_seq_params.qkv_format!r}"
            )
        cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
        if cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_q, cu_kv):
            raise NotImplementedError("self-attention needs cu_seqlens_q == cu_seqlens_kv")
        if self.rotary is not None:
            cos, sin = self.rotary.packed_cos_sin(cu_q, query.shape[0], query.dtype)
            query, key = apply_rope(query, key, cos, sin)  # fused on CUDA, one pass each
        groups = query.shape[1] // key.shape[1]
        if (
            query.is_cuda
            and _varlen_attn is not None
            and query.dtype in _VARLEN_DTYPES
            and dropout_p == 0.0
        ):
            # varlen_attn has no GQA on every torch we run (2.11 on the H200): repeat K/V.
            out = _varlen_attn(
                query,
                _repeat_kv(key, groups),
                _repeat_kv(value, groups),
                cu_q,
                cu_q,
                packed_seq_params.max_seqlen_q,
                packed_seq_params.max_seqlen_q,
                scale=self.softmax_scale,
                window_size=(-1, 0),  # causal
            )
        else:
            out = varlen_causal_attention_ref(
                query, key, value, cu_q, self.softmax_scale, dropout_p
            )
        return out.reshape(out.shape[0], -1)  # (T, np, d) -> (T, np·d)

    def _forward_unpacked(self, query, key, value, attention_mask, dropout_p) -> torch.Tensor:
        seq, batch, heads, head_dim = query.shape
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if attention_mask is None:
            o = F.scaled_dot_product_attention(
                q,
                k,
                v,
                dropout_p=dropout_p,
                is_causal=True,
                scale=self.softmax_scale,
                enable_gqa=True,
            )
        else:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=query.device).tril()
            allowed = causal & ~attention_mask.bool()  # Megatron masks: True = masked out
            o = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=allowed,
                dropout_p=dropout_p,
                scale=self.softmax_scale,
                enable_gqa=True,
            )
        return o.permute(2, 0, 1, 3).reshape(seq, batch, heads * head_dim)  # [s, b, np·d]
