"""The linears an adapter can target: Megatron's fused linears and Hugging Face's projections.

`config` builds ``target_modules`` from these names and re-exports them (the rest of the
package imports them from there); `validation` checks ``target_modules`` against
`TARGET_MODULES` without importing `config`, which imports it.
"""

__all__ = ["ALL_LINEAR", "FUSED_LINEARS", "PROJECTIONS", "TARGET_MODULES"]

FUSED_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Megatron's adaptable linears of a decoder layer, in layer-seed order."""
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""The Hugging Face projections each Megatron linear fuses, in the fused linear's row order."""
ALL_LINEAR = "all-linear"
TARGET_MODULES = (*FUSED_LINEARS, *(p for ps in PROJECTIONS.values() for p in ps), ALL_LINEAR)
"""Names ``target_modules`` accepts: ours (one LoRA per fused linear), Hugging Face's (one
LoRA per projection, as PEFT trains them) and PEFT's ``all-linear`` (every projection)."""
