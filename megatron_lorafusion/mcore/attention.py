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

A layer with a sliding window of ``W`` tokens (``window``: Mistral, Gemma 3's local layers)
lets token ``i`` of a sample attend to tokens ``j`` of the same sample with
``0 <= i - j < W`` (transformers' ``sliding_window`` rule), on every kernel: the loop masks
each sample's scores, FlashAttention takes ``window_size_left = W - 1``, FlexAttention's block
mask skips the blocks outside the window.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Literal

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lorafusion.mcore.flex import varlen_causal_attention_flex
from megatron_lorafusion.mcore.fused_base import apply_rope

Backend = Literal["flash", "flex", "loop"]
_BACKENDS = ("flash", "flex", "loop")
# FlashAttention rejects fp32 (checked on torch 2.11, H200); flex is held to the same inputs.
_FAST_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _flash_available(device: torch.device) -> bool:
    """Whether torch's FlashAttention varlen op exists and runs on ``device`` (sm80+)."""
    return hasattr(torch.ops.aten, "_flash_attention_forward") and (
        torch.cuda.get_device_capability(device) >= (8, 0)
    )


@functools.cache
def flash_window_available() -> bool:
    """Whether torch's FlashAttention op takes a sliding window (``window_size_left``)."""
    schema = str(torch.ops.aten._flash_attention_forward.default._schema)
    return "window_size_left" in schema


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
    def forward(ctx, query, key, value, cu_seqlens, max_seqlen: int, scale: float, window):
        """(T, np, d) output of (T, np, d) ``query`` and (T, ng, d) ``key`` / ``value``.

        ``window``: None, or the sliding window ``W`` (keys ``i - W < j <= i``).
        """
        ctx.window = (
            {} if window is None else dict(window_size_left=window - 1, window_size_right=0)
        )
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
            **ctx.window,
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
            **ctx.window,
        )
        return dq, dk, dv, None, None, None, None


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def sliding_causal_mask(
    tokens: int, window: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """(tokens, tokens) bool, True where query ``i`` may attend key ``j``: ``0 <= i - j < W``."""
    distance = torch.arange(tokens, device=device)[:, None] - torch.arange(tokens, device=device)
    return (distance >= 0) & (distance < window)


def varlen_causal_attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    dropout_p: float = 0.0,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention inside each packed sample, one SDPA call per sample (any device).

    Args:
        query: (T, np, d) queries of all samples, packed.
        key: (T, ng, d) keys; ``ng`` divides ``np`` (grouped-query attention).
        value: (T, ng, d) values.
        cu_seqlens: (S + 1,) int32 token offset of each sample.
        scale: softmax scale.
        dropout_p: attention-probability dropout.
        window: sliding window ``W`` in tokens (`sliding_causal_mask`), or None (causal).

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
        if window is None or window >= end - start:  # the window holds the whole sample
            o = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            mask = sliding_causal_mask(end - start, window, query.device)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=True
            )
        parts.append(o.transpose(0, 1))  # (T_s, np, d)
    if bounds[-1] != query.shape[0]:
        raise ValueError(f"cu_seqlens covers {bounds[-1]} tokens, query has {query.shape[0]}")
    return torch.cat(parts) if parts else torch.empty_like(query)


class VarlenCoreAttention(MegatronModule):
    """Core attention that keeps packed samples apart; Megatron's `DotProductAttention` seam.

    Packed input (``packed_seq_params.qkv_format == 'thd'``): query ``(T, np, d)``,
    key/value ``(T, ng, d)``, output ``(T, np·d)``; each sample attends causally to itself
    only (within ``window``). Unpacked input (``packed_seq_params`` None): query
    ``[s, b, np, d]``, output ``[s, b, np·d]``, causal (within ``window``), plus the boolean
    ``attention_mask`` (True = masked out) if given. Heads are those of this TP rank (taken
    from the tensors).

    Attributes:
        rotary: this layer's RoPE module (`mcore.model.configure_layers`); for packed input,
            q and k arrive unrotated (its ``forward`` gave Megatron no table) and are rotated
            here by position inside their sample. None: no RoPE.
        local_rope: True when ``rotary`` is not the model's own (Gemma 3's local layers): an
            unpacked input, which Megatron rotated with the model's, is refused.
        window: this layer's sliding window ``W`` in tokens (`sliding_causal_mask`), or None
            (causal over the whole sample); set per layer by the model builder, since
            Megatron's own ``window_size`` is one for all layers and Transformer Engine's.
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
        self.local_rope = False
        self.window: int | None = None
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
        longest = packed_seq_params.max_seqlen_q
        # a window holding every sample is plain causal attention (and its cheaper kernel)
        window = self.window if self.window is not None and self.window < longest else None
        if backend == "flash" and window is not None and not flash_window_available():
            if self.backend == "flash":
                raise RuntimeError(
                    f"attention backend 'flash': torch {torch.__version__}'s FlashAttention "
                    "op has no sliding window"
                )
            backend = "flex" if _flex_available() else "loop"  # exact, slower
        if backend == "flash":
            out = _FlashVarlenFunction.apply(
                *(_last_dim_dense(t) for t in (query, key, value)),
                cu_q,
                longest,
                self.softmax_scale,
                window,
            )
        elif backend == "flex":
            out = varlen_causal_attention_flex(
                *(_last_dim_dense(t) for t in (query, key, value)),
                cu_q,
                self.softmax_scale,
                window,
            )
        else:
            out = varlen_causal_attention_ref(
                query, key, value, cu_q, self.softmax_scale, dropout_p, window
            )
        return out.reshape(out.shape[0], -1)  # (T, np, d) -> (T, np·d)

    def _forward_unpacked(self, query, key, value, attention_mask, dropout_p) -> torch.Tensor:
        if self.local_rope:
            raise NotImplementedError(
                "this layer's RoPE base differs from the model's (Gemma 3's local layers), "
                "which Megatron applied to the unpacked input: pass packed (THD) input"
            )
        seq, batch, heads, head_dim = query.shape
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.window is not None and self.window < seq:
            allowed = sliding_causal_mask(seq, self.window, query.device)
            if attention_mask is not None:
                allowed = allowed & ~attention_mask.bool()  # Megatron masks: True = masked out
            o = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=allowed,
                dropout_p=dropout_p,
                scale=self.softmax_scale,
                enable_gqa=True,
            )
        elif attention_mask is None:
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
