"""What a Hugging Face checkpoint's ``config.json`` means for our `ModelConfig`.

Read when ``model.hf_path`` is set (by ``load_config``, and again by the importer in
``mcore/hf_import.py``), so the rules for what can be imported live in one place. Plain JSON:
no torch, no transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["HF_ARCHITECTURES", "hf_model_fields"]

HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


# The Llama 3 RoPE scaling Megatron implements (`RotaryEmbedding._apply_scaling`): only the
# factor is a parameter there.
_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _hf_rope(hf: dict) -> tuple[float, float | None, list[str]]:
    """RoPE base and Llama 3 scaling factor of a transformers 4.x or 5.x config."""
    scaling = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    theta = float(scaling.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return theta, None, []
    if kind == "llama3" and all(scaling.get(k) == v for k, v in _LLAMA3_ROPE.items()):
        return theta, float(scaling["factor"]), []
    return (
        theta,
        None,
        [
            f"rope type must be 'default' or 'llama3' with {_LLAMA3_ROPE}, "
            f"got {kind!r} with {scaling}"
        ],
    )


def hf_model_fields(folder: str | Path) -> tuple[dict[str, Any], list[str]]:
    """`ModelConfig` fields of the Hugging Face checkpoint in ``folder`` (its ``config.json``).

    Args:
        folder: a local checkpoint folder.

    Returns:
        ``(fields, problems)``: the sizes and flags read, and every reason the checkpoint
        cannot be imported (unsupported architecture, activation, biases, RoPE scaling, head
        size); empty when it can.
    """
    path = Path(folder) / "config.json"
    try:
        found = path.is_file()
    except OSError as err:  # a name over 255 bytes: ENAMETOOLONG
        return {}, [f"{str(path)!r} cannot be read ({err.strerror})"]
    if not found:
        return {}, [f"{str(path)!r} does not exist"]
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        return {}, [f"{str(path)!r} is not valid JSON: {err}"]
    archs = hf.get("architectures") or [hf.get("model_type")]
    if len(archs) != 1 or archs[0] not in HF_ARCHITECTURES:
        return {}, [f"architecture must be one of {list(HF_ARCHITECTURES)}, got {archs}"]
    required = (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
    )
    missing = [key for key in required if key not in hf]
    if missing:
        return {}, [f"{str(path)!r} lacks {missing}"]
    heads = hf["num_attention_heads"]
    theta, rope_factor, problems = _hf_rope(hf)
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act must be 'silu', got {hf['hidden_act']!r}")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        problems.append(
            "attention_bias and mlp_bias must be false (only Qwen2's q/k/v biases are supported)"
        )
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        problems.append(
            f"head_dim must be hidden_size / num_attention_heads "
            f"({hf['hidden_size'] // heads}), got {head_dim}"
        )
    is_qwen2 = archs[0] == "Qwen2ForCausalLM"
    window = hf.get("sliding_window")
    if is_qwen2 and not hf.get("use_sliding_window", False):
        window = None
    fields = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf["max_position_embeddings"],
        rope_theta=theta,
        rope_scaling_factor=rope_factor,
        norm_epsilon=float(hf["rms_norm_eps"]),
        add_qkv_bias=is_qwen2,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=window,
    )
    return fields, [f"{str(path)!r}: {q}" for q in problems]
