"""Multi-LoRA math: the torch reference path and (on CUDA) the fused Triton path.

Dimension letters used throughout `ops` (and the rest of the package):

- ``T``: tokens in one packed microbatch, grouped adapter-major.
- ``H``: hidden size, the linear layer's in-features.
- ``N``: the linear layer's out-features.
- ``R``: LoRA rank; packed tensors use ``R`` = the largest rank of the layer.
- ``A``: adapters in the run (dense ids ``0..A-1``).
- ``M``: microbatches.
"""

from megatron_lorafusion.ops._utils import (
    HostCopy,
    cached_device_params,
    copy_to_device,
    triton_usable,
)
from megatron_lorafusion.ops.adapter_adamw import adapter_adamw_, adapter_adamw_ref
from megatron_lorafusion.ops.dora_scale import (
    DoRAScaleFunction,
    dora_scale,
    dora_scale_ref,
    dora_weight_norm,
    dora_weight_norm_ref,
    weight_sq_norm,
)
from megatron_lorafusion.ops.fp8 import FP8_DTYPE, Fp8Weight, check_fp8_device, fp8_problem
from megatron_lorafusion.ops.fp8_linear import Fp8LinearFunction, fp8_linear, fp8_linear_ref
from megatron_lorafusion.ops.fp8_quant import (
    grad_col_scale,
    quantize_rows,
    quantize_rows_ref,
    quantize_weight,
)
from megatron_lorafusion.ops.fused_lora_linear import (
    LoRALinearFunction,
    fused_lora_linear,
    resolve_gemm,
)
from megatron_lorafusion.ops.geglu import GeGLUFunction, geglu, geglu_ref
from megatron_lorafusion.ops.layout import AdapterLayout
from megatron_lorafusion.ops.linear_cross_entropy import (
    LinearCrossEntropyFunction,
    linear_cross_entropy,
    linear_cross_entropy_ref,
)
from megatron_lorafusion.ops.lora_dropout import fused_dropout_keep_mask
from megatron_lorafusion.ops.lora_expand import lora_expand, lora_expand_ref
from megatron_lorafusion.ops.lora_linear import (
    dropout_keep_mask,
    lora_down_ref,
    lora_linear,
    lora_linear_ref,
    lora_up_ref,
)
from megatron_lorafusion.ops.lora_shrink import lora_shrink, lora_shrink_ref
from megatron_lorafusion.ops.lora_split import (
    LoRADownFunction,
    LoRAUpFunction,
    fused_lora_down,
    fused_lora_up,
    lora_down,
    lora_up,
)
from megatron_lorafusion.ops.lora_up_bwd import lora_up_bwd, lora_up_bwd_ref
from megatron_lorafusion.ops.lora_wgrad import lora_wgrad, lora_wgrad_ref
from megatron_lorafusion.ops.packed_factor import (
    PackedFactorsFunction,
    PackedSlotFunction,
    cast_table,
    cast_table_ref,
    packed_factors,
    packed_slot,
)
from megatron_lorafusion.ops.qkv_rope import QKVRoPEFunction, qkv_rope, qkv_rope_ref
from megatron_lorafusion.ops.rms_norm import (
    RMSNormFunction,
    rms_norm,
    rms_norm_ref,
    rms_norm_residual,
)
from megatron_lorafusion.ops.rope import RoPEFunction, rope, rope_ref
from megatron_lorafusion.ops.row_norms import row_squared_norms, row_squared_norms_ref
from megatron_lorafusion.ops.saved_input import InputRebuild
from megatron_lorafusion.ops.swiglu import SwiGLUFunction, swiglu, swiglu_fp8, swiglu_ref

__all__ = [
    "FP8_DTYPE",
    "AdapterLayout",
    "DoRAScaleFunction",
    "Fp8LinearFunction",
    "Fp8Weight",
    "GeGLUFunction",
    "HostCopy",
    "InputRebuild",
    "LinearCrossEntropyFunction",
    "LoRADownFunction",
    "LoRALinearFunction",
    "LoRAUpFunction",
    "PackedFactorsFunction",
    "PackedSlotFunction",
    "QKVRoPEFunction",
    "RMSNormFunction",
    "RoPEFunction",
    "SwiGLUFunction",
    "adapter_adamw_",
    "adapter_adamw_ref",
    "cached_device_params",
    "cast_table",
    "cast_table_ref",
    "check_fp8_device",
    "copy_to_device",
    "dora_scale",
    "dora_scale_ref",
    "dora_weight_norm",
    "dora_weight_norm_ref",
    "dropout_keep_mask",
    "fp8_linear",
    "fp8_linear_ref",
    "fp8_problem",
    "fused_dropout_keep_mask",
    "fused_lora_down",
    "fused_lora_linear",
    "fused_lora_up",
    "geglu",
    "geglu_ref",
    "grad_col_scale",
    "linear_cross_entropy",
    "linear_cross_entropy_ref",
    "lora_down",
    "lora_down_ref",
    "lora_expand",
    "lora_expand_ref",
    "lora_linear",
    "lora_linear_ref",
    "lora_shrink",
    "lora_shrink_ref",
    "lora_up",
    "lora_up_bwd",
    "lora_up_bwd_ref",
    "lora_up_ref",
    "lora_wgrad",
    "lora_wgrad_ref",
    "packed_factors",
    "packed_slot",
    "qkv_rope",
    "qkv_rope_ref",
    "quantize_rows",
    "quantize_rows_ref",
    "quantize_weight",
    "resolve_gemm",
    "rms_norm",
    "rms_norm_ref",
    "rms_norm_residual",
    "rope",
    "rope_ref",
    "row_squared_norms",
    "row_squared_norms_ref",
    "swiglu",
    "swiglu_fp8",
    "swiglu_ref",
    "triton_usable",
    "weight_sq_norm",
]
