"""Megatron's `SelfAttention` with a fused packed path, and Gemma 3's norm after it.

`PackedSelfAttention`'s packed path splits the fused QKV projection with one kernel that also
normalises (Qwen3, Gemma 3: per-head RMSNorm of q and k) and rotates q and k (`ops.qkv_rope`),
where Megatron copies the query heads out of the row, runs each norm as its own pass, RoPE
copies q and k again, and backward concatenates the gradients back into the row; every other
input takes Megatron's own path, which computes the same function.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp

from megatron_lorafusion.mcore import fused_base
from megatron_lorafusion.mcore.attention import VarlenCoreAttention
from megatron_lorafusion.mcore.fused_base import FrozenRMSNorm
from megatron_lorafusion.ops import qkv_rope, qkv_rope_ref

__all__ = ["PackedSelfAttention", "PostNormSelfAttention"]


def _frozen_norm(norm) -> bool:
    """True for a `FrozenRMSNorm` the fused split can apply (no weight gradient needed)."""
    return isinstance(norm, FrozenRMSNorm) and not norm.weight.requires_grad


class PackedSelfAttention(SelfAttention):
    """Megatron's `SelfAttention`; packed training input splits QKV with `ops.qkv_rope`.

    The packed path covers what our models build: THD input without an inference context,
    RoPE given to `VarlenCoreAttention` (``core_attention.rotary``), no q/k norms or frozen
    `FrozenRMSNorm` ones (applied inside the split, never skipped), no output gate, no
    core-attention recompute, and whole KV groups on each TP rank. Anything else runs
    ``SelfAttention.forward`` unchanged. Both paths compute the same function.
    """

    def _qk_norms(self) -> tuple[FrozenRMSNorm, FrozenRMSNorm] | None | bool:
        """The (q, k) norms the split applies: None without norms, False where it cannot."""
        norms = (self.q_layernorm, self.k_layernorm)
        if all(n is None or isinstance(n, IdentityOp) for n in norms):
            return None
        return norms if all(_frozen_norm(n) for n in norms) else False

    def _packed_path_applies(self, packed_seq_params, kwargs) -> bool:
        core = self.core_attention
        return (
            packed_seq_params is not None
            and packed_seq_params.qkv_format == "thd"
            and kwargs.get("key_value_states") is None
            and kwargs.get("inference_context") is None
            and kwargs.get("inference_params") is None
            and isinstance(core, VarlenCoreAttention)
            and core.rotary is not None
            and not self.config.attention_output_gate
            and self._qk_norms() is not False
            and not (self.checkpoint_core_attention and self.training)
            and self.config.num_query_groups >= self.world_size
        )

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **kwargs):
        """``(output, bias)`` of ``linear_proj``, as ``SelfAttention.forward``.

        Packed input: ``hidden_states`` ``[T, 1, H]``, output ``[T, 1, H]``.
        """
        packed_seq_params = kwargs.get("packed_seq_params")
        if not self._packed_path_applies(packed_seq_params, kwargs):
            return super().forward(hidden_states, attention_mask, **kwargs)
        mixed, _ = self.linear_qkv(hidden_states)  # [T, 1, ng·(np/ng + 2)·d]
        row = mixed.reshape(-1, mixed.shape[-1])  # (T, width): a view
        groups = self.num_query_groups_per_partition
        q_per_group = self.num_attention_heads_per_partition // groups
        head_dim = self.hidden_size_per_attention_head
        cos, sin = self.core_attention.rotary.packed_cos_sin(
            packed_seq_params.cu_seqlens_q, row.shape[0], row.dtype
        )
        norms = self._qk_norms()
        norm = {}
        if norms is not None:
            q_norm, k_norm = norms
            norm = dict(q_norm=q_norm.weight, k_norm=k_norm.weight, eps=q_norm.eps)
            if k_norm.eps != q_norm.eps:
                raise ValueError(f"q and k norms must share eps, got {q_norm.eps}, {k_norm.eps}")
        split = qkv_rope if fused_base.use_fused_kernels(row) else qkv_rope_ref
        query, key, value = split(row, cos, sin, groups, q_per_group, head_dim, **norm)
        out = self.core_attention.attend_packed(query, key, value, packed_seq_params)
        return self.linear_proj(out.unsqueeze(1))  # (T, np·d) -> [T, 1, np·d]


class PostNormSelfAttention(PackedSelfAttention):
    """`PackedSelfAttention` whose output is RMS-normalised before the residual add (Gemma 3).

    Gemma 3 normalises the attention block's output (its ``post_attention_layernorm``), which
    Megatron's `TransformerLayer` has no seam for; the norm is this module's
    ``post_layernorm`` (a `FrozenRMSNorm`), applied to ``linear_proj``'s output.
    """

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = FrozenRMSNorm(
            config, config.hidden_size, eps=config.layernorm_epsilon
        )

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **kwargs):
        """``(norm(output), None)``; ``linear_proj`` must have no separate bias."""
        out, bias = super().forward(hidden_states, attention_mask, **kwargs)
        if bias is not None:
            raise NotImplementedError("PostNormSelfAttention needs linear_proj without a bias")
        return self.post_layernorm(out), None
