"""What a Hugging Face checkpoint's ``config.json`` means for our `ModelConfig`.

Read when ``model.hf_path`` is set (by ``load_config``, and again by the importer in
``mcore/hf_import.py``), so the rules for what can be imported live in one place. Plain JSON:
no torch, no transformers. Keys a config.json leaves out take transformers' defaults of that
architecture (Gemma 3's hub configs omit most of them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["HF_ARCHITECTURES", "REFUSED_ARCHITECTURES", "hf_model_fields"]

HF_ARCHITECTURES = (
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_MOE = (
    "a mixture-of-experts model: expert routing and LoRA on expert linears are not "
    "implemented (dense checkpoints of the family are supported)"
)
REFUSED_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": _MOE,
    "Qwen2MoeForCausalLM": _MOE,
    "MixtralForCausalLM": _MOE,
    "Gemma2ForCausalLM": (
        "Gemma 2 caps attention scores and logits with tanh soft-capping, which is not "
        "implemented (Gemma3ForCausalLM is supported)"
    ),
    "GemmaForCausalLM": (
        "Gemma 1's layer (no q/k norms, no post-norms) is not implemented; Gemma 3's is"
    ),
    "Gemma3nForConditionalGeneration": (
        "Gemma 3n (per-layer embeddings, AltUp, LAuReL) is a different architecture from Gemma 3"
    ),
    "Gemma3nForCausalLM": (
        "Gemma 3n (per-layer embeddings, AltUp, LAuReL) is a different architecture from Gemma 3"
    ),
}
"""Architectures refused with the reason (the rest: not one of `HF_ARCHITECTURES`)."""

_FAMILY = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
}
# transformers 5's defaults of keys a config.json may omit (`Qwen3Config`, `Gemma3TextConfig`).
_DEFAULTS = {
    "qwen3": dict(head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6),
    "gemma3": dict(
        vocab_size=262208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        tie_word_embeddings=True,
    ),
}
_REQUIRED = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
)
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


def _gemma3_rope(hf: dict) -> tuple[dict[str, Any], list[str]]:
    """Global and local RoPE fields of a Gemma 3 text config.

    transformers 5 nests them per layer type; 4.x has rope_theta, rope_local_base_freq and
    rope_scaling.
    """
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        full = dict(params["full_attention"] or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e6)}
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 1e4)}
    problems = []
    full_kind = full.get("rope_type", full.get("type", "default"))
    if full_kind not in ("default", "linear"):
        problems.append(f"full-attention rope type must be 'default' or 'linear', got {full}")
    if local.get("rope_type", local.get("type", "default")) != "default":
        problems.append(f"sliding-attention rope type must be 'default', got {local}")
    fields = dict(
        rope_theta=float(full.get("rope_theta", 1e6)),
        rope_local_theta=float(local.get("rope_theta", 1e4)),
        rope_linear_factor=float(full["factor"]) if full_kind == "linear" else None,
    )
    return fields, problems


def _layer_types(hf: dict, family: str, arch: str) -> tuple[int | None, list[str] | None]:
    """``(sliding_window, layer_types)`` in `ModelConfig`'s form.

    The window is None where no layer slides; the types are None where every layer is alike.
    """
    layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not hf.get("use_sliding_window"):
        window = None
    types = hf.get("layer_types")
    if types is None and family == "gemma3":
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    elif types is None and arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if window is None or types is None:
        return window, None  # Mistral (no types): every layer slides
    if "sliding_attention" not in types:
        return None, None
    return window, None if set(types) == {"sliding_attention"} else list(types)


def _read(folder: str | Path) -> tuple[dict | None, list[str]]:
    path = Path(folder) / "config.json"
    try:
        found = path.is_file()
    except OSError as err:  # a name over 255 bytes: ENAMETOOLONG
        return None, [f"{str(path)!r} cannot be read ({err.strerror})"]
    if not found:
        return None, [f"{str(path)!r} does not exist"]
    try:
        return json.loads(path.read_text(encoding="utf-8")), []
    except json.JSONDecodeError as err:
        return None, [f"{str(path)!r} is not valid JSON: {err}"]


def _architecture(hf: dict) -> tuple[str | None, list[str]]:
    archs = hf.get("architectures") or [hf.get("model_type")]
    if len(archs) == 1 and archs[0] in REFUSED_ARCHITECTURES:
        return None, [
            f"architecture {archs[0]} is not supported: {REFUSED_ARCHITECTURES[archs[0]]}"
        ]
    if len(archs) != 1 or archs[0] not in HF_ARCHITECTURES:
        return None, [f"architecture must be one of {list(HF_ARCHITECTURES)}, got {archs}"]
    return archs[0], []


def _family_problems(text: dict, family: str) -> list[str]:
    """What a checkpoint of ``family`` has that the import does not implement."""
    problems = []
    activation = "gelu_pytorch_tanh" if family == "gemma3" else "silu"
    found = text.get("hidden_activation", text.get("hidden_act", activation))
    if found != activation:
        problems.append(f"hidden_act must be {activation!r} for {family}, got {found!r}")
    if text.get("attention_bias") or text.get("mlp_bias"):
        problems.append(
            "attention_bias and mlp_bias must be false (only Qwen2's q/k/v biases are supported)"
        )
    if family == "gemma3":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if text.get(key) is not None:
                problems.append(
                    f"{key} must be null (soft-capping is not implemented), got {text[key]}"
                )
        if text.get("use_bidirectional_attention"):
            problems.append(
                "use_bidirectional_attention must be false (an encoder such as EmbeddingGemma, "
                "not a causal LM to fine-tune), got true"
            )
    return problems


def _head_dim(text: dict, family: str, problems: list[str]) -> int | None:
    """The head size, None when it is hidden / heads (the Llama rule the importer assumed)."""
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    if family == "llama" and head_dim * heads != text["hidden_size"]:
        problems.append(
            f"head_dim must be hidden_size / num_attention_heads "
            f"({text['hidden_size'] // heads}), got {head_dim}"
        )
    return None if head_dim * heads == text["hidden_size"] else head_dim


def hf_model_fields(folder: str | Path) -> tuple[dict[str, Any], list[str]]:
    """`ModelConfig` fields of the Hugging Face checkpoint in ``folder`` (its ``config.json``).

    A ``Gemma3ForConditionalGeneration`` checkpoint gives its language model's fields (its
    ``text_config``); its vision tower is not imported (``hf_multimodal``).

    Args:
        folder: a local checkpoint folder.

    Returns:
        ``(fields, problems)``: the sizes and flags read, and every reason the checkpoint
        cannot be imported (unsupported architecture with its reason, activation, biases, RoPE
        scaling, soft-capping, head size); empty when it can.
    """
    hf, problems = _read(folder)
    if hf is None:
        return {}, problems
    arch, problems = _architecture(hf)
    if arch is None:
        return {}, problems
    family = _FAMILY[arch]
    multimodal = arch == "Gemma3ForConditionalGeneration"
    text = (hf.get("text_config") or {}) if multimodal else hf
    text = {**_DEFAULTS.get(family, {}), **text}
    if multimodal and "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    path = Path(folder) / "config.json"
    missing = [key for key in _REQUIRED if key not in text]
    if missing:
        return {}, [f"{str(path)!r} lacks {missing}"]
    problems = _family_problems(text, family)
    if family == "gemma3":
        rope, rope_problems = _gemma3_rope(text)
    else:
        theta, factor, rope_problems = _hf_rope(text)
        rope = dict(rope_theta=theta, rope_scaling_factor=factor)
    problems += rope_problems
    head_dim = _head_dim(text, family, problems)
    window, layer_types = _layer_types(text, family, arch)
    heads = text["num_attention_heads"]
    scalar = text.get("query_pre_attn_scalar") if family == "gemma3" else None
    fields = {
        **dict(
            num_layers=text["num_hidden_layers"],
            hidden_size=text["hidden_size"],
            ffn_hidden_size=text["intermediate_size"],
            num_attention_heads=heads,
            num_query_groups=text.get("num_key_value_heads") or heads,
            vocab_size=text["vocab_size"],
            max_position_embeddings=text["max_position_embeddings"],
            rope_theta=10000.0,
            rope_scaling_factor=None,
            norm_epsilon=float(text["rms_norm_eps"]),
            add_qkv_bias=arch == "Qwen2ForCausalLM",
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            sliding_window=window,
            family=family,
            head_dim=head_dim,
            layer_types=layer_types,
            rope_local_theta=None,
            rope_linear_factor=None,
            query_pre_attn_scalar=None if scalar is None else float(scalar),
            hf_multimodal=multimodal,
        ),
        **rope,
    }
    return fields, [f"{str(path)!r}: {q}" for q in problems]
