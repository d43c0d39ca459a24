"""Megatron-Core glue: Llama/Qwen3/Gemma 3 `GPTModel`s, Hugging Face import, attention, LoRA.

The only subpackage (with ``pipeline``) that imports ``megatron.core``. Typical use::

    model = build_gpt_model(model_cfg)          # parallel state initialised by the caller
    lora = apply_lora(model, adapters, seed=1)  # before any DDP wrapping
    lora.layout = layout                        # before every forward
"""

from megatron_lorafusion.mcore.attention import (
    VarlenCoreAttention,
    attention_backend,
    set_attention_backend,
    sliding_causal_mask,
    varlen_causal_attention_ref,
)
from megatron_lorafusion.mcore.context import LoRAContext, apply_lora
from megatron_lorafusion.mcore.families import PostNormMLP, family_layer_spec
from megatron_lorafusion.mcore.flex import (
    document_causal_block_mask,
    varlen_causal_attention_flex,
)
from megatron_lorafusion.mcore.fp8 import (
    Fp8ColumnParallelLinear,
    Fp8RowParallelLinear,
    fp8_weight,
    materialize_fp8_model,
)
from megatron_lorafusion.mcore.hf_import import HFCheckpoint, hf_weight_source, load_hf_weights
from megatron_lorafusion.mcore.lora import LoRAColumnParallelLinear, LoRARowParallelLinear
from megatron_lorafusion.mcore.model import build_gpt_model, get_gpt_lora_layer_spec
from megatron_lorafusion.mcore.recompute import RECOMPUTE_MODES, RecomputedLayer, apply_recompute
from megatron_lorafusion.mcore.self_attention import PackedSelfAttention, PostNormSelfAttention
from megatron_lorafusion.mcore.wgrad import WgradQueue

__all__ = [
    "RECOMPUTE_MODES",
    "Fp8ColumnParallelLinear",
    "Fp8RowParallelLinear",
    "HFCheckpoint",
    "LoRAColumnParallelLinear",
    "LoRAContext",
    "LoRARowParallelLinear",
    "PackedSelfAttention",
    "PostNormMLP",
    "PostNormSelfAttention",
    "RecomputedLayer",
    "VarlenCoreAttention",
    "WgradQueue",
    "apply_lora",
    "apply_recompute",
    "attention_backend",
    "build_gpt_model",
    "document_causal_block_mask",
    "family_layer_spec",
    "fp8_weight",
    "get_gpt_lora_layer_spec",
    "hf_weight_source",
    "load_hf_weights",
    "materialize_fp8_model",
    "set_attention_backend",
    "sliding_causal_mask",
    "varlen_causal_attention_flex",
    "varlen_causal_attention_ref",
]
