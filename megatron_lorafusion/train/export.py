"""Write an adapter as a Hugging Face PEFT folder for the matching Llama-style model.

Megatron fuses projections that Hugging Face keeps apart; a LoRA on a fused linear is exactly
several LoRAs sharing one ``A``:
- ``linear_qkv`` → ``q_proj``/``k_proj``/``v_proj``: the output rows are grouped per query
  group as ``[q heads of the group | k | v]``, so ``B`` is split group by group;
- ``linear_fc1`` → ``gate_proj``/``up_proj``: rows are ``[gate | up]``;
- ``linear_proj`` → ``o_proj``; ``linear_fc2`` → ``down_proj``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_lorafusion.config import AdapterConfig, ModelConfig

_PREFIX = "base_model.model.model.layers"
_HF_TARGETS = {
    "linear_qkv": ("self_attn", ["q_proj", "k_proj", "v_proj"]),
    "linear_proj": ("self_attn", ["o_proj"]),
    "linear_fc1": ("mlp", ["gate_proj", "up_proj"]),
    "linear_fc2": ("mlp", ["down_proj"]),
}


def _split_b(module: str, lora_b: torch.Tensor, model: ModelConfig) -> list[torch.Tensor]:
    """Rows of a fused module's ``B`` (N, r), one block per Hugging Face module."""
    if module == "linear_qkv":
        head_dim = model.hidden_size // model.num_attention_heads
        per_group = model.num_attention_heads // model.num_query_groups
        grouped = lora_b.reshape(model.num_query_groups, (per_group + 2) * head_dim, -1)
        q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
        return [t.reshape(-1, lora_b.shape[1]) for t in (q, k, v)]  # (out, r) each
    if module == "linear_fc1":
        return list(lora_b.split(model.ffn_hidden_size, dim=0))
    return [lora_b]


def peft_state_dict(
    megatron_state: dict[str, torch.Tensor], model: ModelConfig
) -> dict[str, torch.Tensor]:
    """Map an adapter's full (unsharded) Megatron tensors to PEFT names.

    Args:
        megatron_state: ``decoder.layers.{i}.{self_attention|mlp}.{module}.lora_A`` (r, H_in)
            and ``...lora_B`` (N, r) tensors.
        model: the base model's sizes.

    Returns:
        ``base_model.model.model.layers.{i}.{self_attn|mlp}.{hf}.lora_{A|B}.weight`` tensors.

    Raises:
        ValueError: for a key that names no known LoRA module.
    """
    out: dict[str, torch.Tensor] = {}
    for key, tensor in megatron_state.items():
        parts = key.split(".")
        if len(parts) != 6 or parts[0:2] != ["decoder", "layers"] or parts[4] not in _HF_TARGETS:
            raise ValueError(f"adapter tensor {key!r} names no known LoRA module")
        layer, module, factor = parts[2], parts[4], parts[5]
        block, hf_names = _HF_TARGETS[module]
        if factor == "lora_A":
            pieces = [tensor] * len(hf_names)
        elif factor == "lora_B":
            pieces = _split_b(module, tensor, model)
        else:
            raise ValueError(f"adapter tensor {key!r} must end in lora_A or lora_B")
        for hf, piece in zip(hf_names, pieces, strict=True):
            name = f"{_PREFIX}.{layer}.{block}.{hf}.{factor}.weight"
            out[name] = piece.detach().to(torch.float32).contiguous().clone()
    return out


def peft_adapter_config(adapter: AdapterConfig) -> dict:
    """The ``adapter_config.json`` of ``adapter``."""
    targets = sorted({hf for m in adapter.target_modules for hf in _HF_TARGETS[m][1]})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "lora_dropout": adapter.dropout,
        "use_rslora": adapter.use_rslora,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def write_peft_folder(
    folder: str | Path,
    adapter: AdapterConfig,
    megatron_state: dict[str, torch.Tensor],
    model: ModelConfig,
) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` atomically.

    The files go to a temporary sibling folder first, which replaces ``folder`` only once
    complete, so a crash never leaves a half-written adapter.
    """
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(peft_state_dict(megatron_state, model), str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(
        json.dumps(peft_adapter_config(adapter), indent=2) + "\n", encoding="utf-8"
    )
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder
