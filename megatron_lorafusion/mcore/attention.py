"""Attention for packed (THD) microbatches: causal within each sample, never across.

`VarlenCoreAttention` is a drop-in replacement for Megatron's local `DotProductAttention`
(which rejects packed sequences). For packed input it also applies RoPE (``rotary``, set by
the model builders), per token and without host syncs, in place of Megatron's per-sample THD
loop. `attention_backend` picks the kernel. On CUDA for fp16/bf16 without attention dropout:
torch's FlashAttention varlen kernels (``aten._flash_attention_forward``, in torch since 2.0,
FlashAttention-2 with grouped KV heads since 2.2), grouped KV heads passed as they are; where
torch lacks them, FlexAttention (torch >= 2.5) with a document-causal block mask built once
per microbatch. CPU, fp32 and attention dropout run each sample through
``F.scaled_dot_product_attention`` in a Python loop. Tested on torch 2.11 (CUDA) and 2.14.

`PackedSelfAttention` is Megatron's `SelfAttention` whose packed path splits the fused QKV
projection with one kernel that also rotates q and k (`ops.qkv_rope`), where Megatron copies
the query heads out of the row, RoPE copies q and k again, and backward concatenates the
gradients back into the row; every other input takes Megatron's own path.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.utils.weak import WeakIdKeyDictionary

from megatron_lorafusion.mcore import fused_base
from megatron_lorafusion.mcore.fused_base import apply_rope
from megatron_lorafusion.ops import qkv_rope, qkv_rope_ref

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

Backend = Literal["flash", "flex", "loop"]
_BACKENDS = ("flash", "flex", "loop")
# FlashAttention rejects fp32 (checked on torch 2.11, H200); flex is held to the same inputs.
_FAST_DTYPES = (torch.float16, torch.bfloat16)
_FLEX_BLOCK = 128  # FlexAttention's default sparse block: (T/128)² blocks per microbatch
# cu_seqlens tensor -> (tokens, BlockMask), an entry living as long as its tensor: every layer
# of a microbatch attends with the mask built for the first.
_BLOCK_MASKS = WeakIdKeyDictionary()


@functools.cache
def _flash_available(device: torch.device) -> bool:
    """Whether torch's FlashAttention varlen op exists and runs on ``device`` (sm80+)."""
    return hasattr(torch.ops.aten, "_flash_attention_forward") and (
        torch.cuda.get_device_capability(device) >= (8, 0)
    )


@functools.cache
def _flex_available() -> bool:
    """Whether torch ships FlexAttention (``torch.nn.attention.flex_attention``, >= 2.5)."""
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def attention_backend(
    device: torch.device, dtype: torch.dtype, dropout_p: float, prefer: str = "auto"
) -> Backend:
    """The kernel that attends a packed microbatch: ``flash``, ``flex`` or ``loop``.

    ``auto``: on CUDA with fp16/bf16 and no attention dropout, FlashAttention's varlen op
    where torch has it for this GPU, else FlexAttention; anything else runs the per-sample
    loop. ``flash`` or ``flex`` forces that kernel (benchmarks, tests); ``loop`` always runs.

    Args:
        device: device of the query.
        dtype: dtype of the query.
        dropout_p: attention-probability dropout of this call (0 in eval).
        prefer: ``auto`` or one of the backends.

    Returns:
        The backend to run.

    Raises:
        ValueError: ``prefer`` is not ``auto``, ``flash``, ``flex`` or ``loop``.
        RuntimeError: ``prefer`` names a backend that cannot run these inputs here.
    """
    if prefer not in ("auto", *_BACKENDS):
        raise ValueError(f"attention backend must be auto, flash, flex or loop, got {prefer!r}")
    if prefer == "loop":
        return "loop"
    fast = device.type == "cuda" and dtype in _FAST_DTYPES and dropout_p == 0.0
    if fast and prefer in ("auto", "flash") and _flash_available(device):
        return "flash"
    if fast and prefer in ("auto", "flex") and _flex_available():
        return "flex"
    if prefer == "auto":
        return "loop"
    if not fast:
        raise RuntimeError(
            f"attention backend {prefer!r} needs a CUDA fp16/bf16 query without attention "
            f"dropout, got {device.type} {dtype} with dropout {dropout_p}"
        )
    what = "FlashAttention varlen op for this GPU" if prefer == "flash" else "FlexAttention"
    raise RuntimeError(f"attention backend {prefer!r}: torch {torch.__version__} has no {what}")


class _FlashVarlenFunction(torch.autograd.Function):
    """Causal varlen FlashAttention (torch's kernels), grouped KV heads passed as they are.

    ``torch.nn.attention.varlen.varlen_attn`` of torch 2.11 refuses ``ng < np``; the kernels
    themselves take it, so k and v need no ``repeat_interleave`` (and their gradients no sum
    over the repeats): 1.66 against 1.80 ms per layer fwd + bwd at T = 8192, 32 query and 8
    KV heads of 128 on the H200 (device run 2 of the eighth session).
    """

    @staticmethod
    def forward(ctx, query, key, value, cu_seqlens, max_seqlen: int, scale: float):
        """(T, np, d) output of (T, np, d) ``query`` and (T, ng, d) ``key`` / ``value``."""
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            query,
            key,
            value,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            0.0,
            True,
            False,
            scale=scale,
        )
        ctx.save_for_backward(query, key, value, out, lse, cu_seqlens, rng_state, unused)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        """Gradients of query, key and value."""
        query, key, value, out, lse, cu_seqlens, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(),
            query,
            key,
            value,
            out,
            lse,
            cu_seqlens,
            cu_seqlens,
            ctx.max_seqlen,
            ctx.max_seqlen,
            0.0,
            True,
            rng_state,
            unused,
            scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


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


def _ordered_blocks(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, 1, n) counts and (1, 1, n, n) int32 indices, listed first, of a (n, n) block map."""
    counts = dense.sum(-1, dtype=torch.int32)
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts[None, None], indices.to(torch.int32)[None, None]


def document_causal_block_mask(cu_seqlens: torch.Tensor, tokens: int) -> BlockMask:
    """FlexAttention's ``BlockMask``: token q attends to token kv iff same sample and kv <= q.

    Built by block arithmetic on ``cu_seqlens`` (no ``T x T`` mask, no host sync) and
    cached for the ``cu_seqlens`` tensor, so the layers of one microbatch share it.

    Args:
        cu_seqlens: (S + 1,) int32 token offset of each sample (equal offsets: empty samples).
        tokens: ``T`` = ``cu_seqlens[-1]``, known on the host.

    Returns:
        The ``(T, T)`` block mask.
    """
    cached = _BLOCK_MASKS.get(cu_seqlens)
    if cached is not None and cached[0] == tokens:
        return cached[1]
    from torch.nn.attention.flex_attention import BlockMask

    blocks = -(-tokens // _FLEX_BLOCK)
    index = torch.arange(blocks * _FLEX_BLOCK, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # sample id of every token; the padding past T is one more sample, so tail blocks are
    # never full and mask_mod never indexes out of range
    doc = torch.searchsorted(cu_seqlens[1:], index, right=True, out_int32=True)
    first, last = doc[::_FLEX_BLOCK], doc[_FLEX_BLOCK - 1 :: _FLEX_BLOCK]  # (n,) per block
    block = torch.arange(blocks, device=doc.device)
    below = block[None, :] < block[:, None]  # [q block, kv block]: kv block entirely earlier
    # samples are contiguous and in order: an earlier kv block meets the q block's first
    # sample iff that is its last one, and is all one sample with the q block iff its first
    # sample is the q block's last
    full = below & (first[None, :] == last[:, None])
    touched = (below & (last[None, :] == first[:, None])) | torch.eye(
        blocks, dtype=torch.bool, device=doc.device
    )

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    mask = BlockMask.from_kv_blocks(
        *_ordered_blocks(touched & ~full),
        *_ordered_blocks(full),
        BLOCK_SIZE=_FLEX_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(tokens, tokens),
    )
    _BLOCK_MASKS[cu_seqlens] = (tokens, mask)
    return mask


@functools.cache
def _compiled_flex_attention():
    """``torch.compile``'d flex_attention: uncompiled, it materialises the scores.

    A second sequence length recompiles it with dynamic shapes (torch.compile's default).
    """
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def varlen_causal_attention_flex(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention inside each packed sample, one FlexAttention call (CUDA).

    Same arguments as `varlen_causal_attention_ref` without dropout; the block mask comes
    from `document_causal_block_mask`. Query head ``j`` reads KV group ``j // (np / ng)``.

    Returns:
        (T, np, d) attention output.
    """
    block_mask = document_causal_block_mask(cu_seqlens, query.shape[0])
    # (T, heads, d) -> (1, heads, T, d): views, no copies
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    out = _compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # (T, np, d)


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
        backend: packed input's kernel, as `attention_backend`'s ``prefer``: ``auto``
            (default) or a forced ``flash``, ``flex`` or ``loop`` (`set_attention_backend`).
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
        self.backend = "auto"

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
        if packed_seq_params is None:
            dropout_p = self.dropout_p if self.training else 0.0
            return self._forward_unpacked(query, key, value, attention_mask, dropout_p)
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(
                f"packed sequences must use qkv_format 'thd', got {packed_seq_params.qkv_format!r}"
            )
        if self.rotary is not None:
            cu_q = packed_seq_params.cu_seqlens_q
            cos, sin = self.rotary.packed_cos_sin(cu_q, query.shape[0], query.dtype)
            query, key = apply_rope(query, key, cos, sin)  # fused on CUDA, one pass each
        return self.attend_packed(query, key, value, packed_seq_params)

    def attend_packed(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        packed_seq_params: PackedSeqParams,
    ) -> torch.Tensor:
        """``(T, np·d)`` causal attention of packed, already rotated (T, heads, d) q, k, v."""
        cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
        if cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_q, cu_kv):
            raise NotImplementedError("self-attention needs cu_seqlens_q == cu_seqlens_kv")
        dropout_p = self.dropout_p if self.training else 0.0
        backend = attention_backend(query.device, query.dtype, dropout_p, self.backend)
        if backend == "flash":
            out = _FlashVarlenFunction.apply(
                *(_last_dim_dense(t) for t in (query, key, value)),
                cu_q,
                packed_seq_params.max_seqlen_q,
                self.softmax_scale,
            )
        elif backend == "flex":
            out = varlen_causal_attention_flex(
                *(_last_dim_dense(t) for t in (query, key, value)), cu_q, self.softmax_scale
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


def set_attention_backend(model: torch.nn.Module, backend: str) -> None:
    """Make every `VarlenCoreAttention` of ``model`` attend packed input with ``backend``.

    Args:
        model: a model built by `mcore.build_gpt_model` (or any module holding the layers).
        backend: ``auto``, ``flash``, ``flex`` or ``loop`` (`attention_backend`).

    Raises:
        ValueError: an unknown backend, or a model without `VarlenCoreAttention`.
    """
    if backend not in ("auto", *_BACKENDS):
        raise ValueError(f"attention backend must be auto, flash, flex or loop, got {backend!r}")
    cores = [m for m in model.modules() if isinstance(m, VarlenCoreAttention)]
    if not cores:
        raise ValueError(f"{type(model).__name__} has no VarlenCoreAttention to set")
    for core in cores:
        core.backend = backend


class PackedSelfAttention(SelfAttention):
    """Megatron's `SelfAttention`; packed training input splits QKV with `ops.qkv_rope`.

    The packed path covers what our models build: THD input without an inference context,
    RoPE given to `VarlenCoreAttention` (``core_attention.rotary``), no q/k norms, no output
    gate, no core-attention recompute, and whole KV groups on each TP rank. Anything else runs
    ``SelfAttention.forward`` unchanged. Both paths compute the same function.
    """

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
            and all(
                n is None or isinstance(n, IdentityOp) for n in (self.q_layernorm, self.k_layernorm)
            )
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
        split = qkv_rope if fused_base.use_fused_kernels(row) else qkv_rope_ref
        query, key, value = split(row, cos, sin, groups, q_per_group, head_dim)
        out = self.core_attention.attend_packed(query, key, value, packed_seq_params)
        return self.linear_proj(out.unsqueeze(1))  # (T, np·d) -> [T, 1, np·d]
