"""Triton kernels re-made in the CPU interpreter, for tests that run them without CUDA.

Triton decides between compiled and interpreted kernels when ``@triton.jit`` runs (at import),
so once anything imported Triton, the jit modules (Triton's own helpers, then ours) must be
reloaded with ``TRITON_INTERPRET=1`` for the kernels to run on the CPU. `importlib.reload`
re-executes a module in place, so functions imported earlier see the interpreted kernels.
"""

import importlib
import os

# triton.language's own @jit helpers (tl.zeros, tl.max, tl.cdiv, ...), re-made in interpreter
# mode and re-exported by reloading the package.
TRITON_MODULES = ("triton.language.standard", "triton.language.random", "triton.language")

KERNEL_MODULES = (  # dependency order: helpers first
    "megatron_lorafusion.ops._utils",
    "megatron_lorafusion.ops.adapter_adamw",
    "megatron_lorafusion.ops.row_norms",
    "megatron_lorafusion.ops.packed_factor",
    "megatron_lorafusion.ops.lora_dropout",
    "megatron_lorafusion.ops.lora_shrink",
    "megatron_lorafusion.ops.lora_expand",
    "megatron_lorafusion.ops.lora_wgrad",
    "megatron_lorafusion.ops.fp8_quant",
    "megatron_lorafusion.ops.lora_up_bwd",
    "megatron_lorafusion.ops.rms_norm",
    "megatron_lorafusion.ops.fp8_linear",
    "megatron_lorafusion.ops.lora_gemm",
    "megatron_lorafusion.ops.fused_lora_linear",
    "megatron_lorafusion.ops.linear_cross_entropy",
    "megatron_lorafusion.ops.swiglu",
    "megatron_lorafusion.ops.geglu",
    "megatron_lorafusion.ops.dora_scale",
    "megatron_lorafusion.ops.rope",
    "megatron_lorafusion.ops.qkv_rope",
)


def reload_interpreted() -> None:
    """Reload Triton's helpers and every kernel module with ``TRITON_INTERPRET=1``.

    The variable is restored afterwards (subprocesses started later must not inherit it); set
    it around each test that runs the kernels.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in TRITON_MODULES + KERNEL_MODULES:
            importlib.reload(importlib.import_module(name))
    finally:
        del os.environ["TRITON_INTERPRET"]
