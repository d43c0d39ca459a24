"""Megatron-Core glue: a Llama-like `GPTModel`, Hugging Face import, attention, LoRA wrappers.

The only subpackage (with ``pipeline``) that imports ``megatron.core``. Typical use::

    model = build_gpt_model(model_cfg)          # parallel state initialised by the caller
    lora = apply_lora(model, adapters, seed=1)  # before any DDP wrapping
    lora.layout = layout                        # before every forward
"""

from megatron_lorafusion.mcore.attention import (
    PackedSelfAttention,
    VarlenCoreAttention,
    attention_backend,
    document_causal_block_mask,
    set_attention_backend,
    varlen_causal_attention_flex,
    varlen_causal_attention_ref,
)
from megatron_lorafusion.mcore.context import LoRAContext, apply_lora
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
    "RecomputedLayer",
    "VarlenCoreAttention",
    "WgradQueue",
    "apply_lora",
    "apply_recompute",
    "attention_backend",
    "build_gpt_model",
    "document_causal_block_mask",
    "fp8_weight",
    "get_gpt_lora_layer_spec",
    "hf_weight_source",
    "load_hf_weights",
    "materialize_fp8_model",
    "set_attention_backend",
    "varlen_causal_attention_flex",
    "varlen_causal_attention_ref",
]
