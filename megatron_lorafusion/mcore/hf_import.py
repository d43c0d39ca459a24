"""Import a Hugging Face Llama, Mistral, Qwen2, Qwen3 or Gemma 3 checkpoint into our `GPTModel`.

Each rank reads only the rows and columns of its own tensor-parallel shard, and only its
pipeline stage's layers, through lazy ``safetensors`` slices (sharded checkpoints with a
``model.safetensors.index.json`` included). Layout changes from Hugging Face to Megatron:
- ``q_proj``/``k_proj``/``v_proj`` → ``linear_qkv`` grouped per query group
  ``[q heads of group g | k_g | v_g]`` (weights and Qwen2's biases);
- ``gate_proj``/``up_proj`` → ``linear_fc1`` as ``[gate | up]`` of this rank's rows;
- tied embeddings become two equal frozen copies (embedding and output layer);
- Qwen3's and Gemma 3's ``q_norm``/``k_norm`` → ``self_attention.q_layernorm``/``k_layernorm``;
  Gemma 3's norms after attention and MLP → ``self_attention.post_layernorm`` and
  ``mlp.post_layernorm``, its pre-MLP norm (``pre_feedforward_layernorm``) →
  ``pre_mlp_layernorm``; Gemma 3 scales by ``1 + weight``, which is what its norms here store
  (added in fp32, as transformers computes it, then cast to the model's dtype).
All use non-interleaved RoPE (Hugging Face ``rotate_half``; Llama 3 and linear frequency
scaling included) and RMSNorm, so no permutation of the query/key rows is needed. A
``Gemma3ForConditionalGeneration`` checkpoint gives its language model; the vision tower and
projector are left unread (logged).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from megatron.core.models.gpt import GPTModel

from megatron_lorafusion.config import ModelConfig, attention_head_dim
from megatron_lorafusion.hf_config import hf_model_fields

__all__ = ["HFCheckpoint", "check_hf_config", "hf_weight_source", "load_hf_weights"]

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Megatron parameter (in a layer) -> Hugging Face tensor (in the layer), per family.
_PER_LAYER = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
}
_QK_NORMS = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_FAMILY_LAYER = {
    "llama": {**_PER_LAYER, "pre_mlp_layernorm.weight": "post_attention_layernorm.weight"},
    "qwen3": {
        **_PER_LAYER,
        **_QK_NORMS,
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    },
    "gemma3": {
        **_PER_LAYER,
        **_QK_NORMS,
        "self_attention.post_layernorm.weight": "post_attention_layernorm.weight",
        "pre_mlp_layernorm.weight": "pre_feedforward_layernorm.weight",
        "mlp.post_layernorm.weight": "post_feedforward_layernorm.weight",
    },
}
_EMBEDDING = "embed_tokens.weight"


class HFCheckpoint:
    """Lazy, sliced access to the tensors of a local safetensors checkpoint.

    Args:
        folder: holds ``model.safetensors``, or ``model.safetensors.index.json`` and the shard
            files it names.

    Attributes:
        text_prefix: the language model's name prefix (``model.``, or a multimodal
            checkpoint's ``language_model.model.``).
        lm_head: the name of the untied output layer's tensor.

    Raises:
        FileNotFoundError: when neither file is there.
        KeyError: when no tensor is an embedding (``...embed_tokens.weight``).
    """

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        self._open = safe_open
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.is_file():
            self.files = dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        elif single.is_file():
            with safe_open(str(single), framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(
                f"{str(self.folder)!r} holds neither model.safetensors nor "
                "model.safetensors.index.json"
            )
        self._handles: dict[str, object] = {}
        embeddings = sorted(n for n in self.files if n.endswith(_EMBEDDING))
        if not embeddings:
            raise KeyError(f"{str(self.folder)!r} holds no ...{_EMBEDDING} tensor")
        # "model." (CausalLM) or a multimodal checkpoint's language model: transformers 5
        # saves Gemma3ForConditionalGeneration's as "language_model.model.", some tools as
        # "model.language_model."
        self.text_prefix = embeddings[0].removesuffix(_EMBEDDING)
        head = self.text_prefix.removesuffix("model.") + "lm_head.weight"
        self.lm_head = head if head in self.files else "lm_head.weight"

    def foreign(self) -> list[str]:
        """Names of the tensors outside the language model (a vision tower, a projector)."""
        return sorted(
            n for n in self.files if not n.startswith(self.text_prefix) and n != self.lm_head
        )

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _slice(self, name: str):
        if name not in self.files:
            raise KeyError(f"tensor {name!r} is not in the checkpoint {str(self.folder)!r}")
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._open(str(self.folder / file), framework="pt")
        return self._handles[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of tensor ``name``, read from the header only."""
        return tuple(self._slice(name).get_shape())

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name`` (the whole tensor by default)."""
        return self._slice(name)[start:stop]

    def columns(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Columns ``start:stop`` of 2-D tensor ``name``."""
        return self._slice(name)[:, start:stop]


def _qkv_shard(
    ckpt: HFCheckpoint, prefix: str, suffix: str, m: ModelConfig, local_rows: int, tp_rank: int
) -> torch.Tensor:
    """This rank's query groups of ``linear_qkv``: per group ``[q heads | k | v]`` rows."""
    head_dim = attention_head_dim(m)
    per_group = m.num_attention_heads // m.num_query_groups
    group_rows = (per_group + 2) * head_dim
    groups_here = local_rows // group_rows
    pieces = []
    for g in range(tp_rank * groups_here, (tp_rank + 1) * groups_here):
        q = ckpt.rows(
            f"{prefix}.q_proj.{suffix}", g * per_group * head_dim, (g + 1) * per_group * head_dim
        )
        k = ckpt.rows(f"{prefix}.k_proj.{suffix}", g * head_dim, (g + 1) * head_dim)
        v = ckpt.rows(f"{prefix}.v_proj.{suffix}", g * head_dim, (g + 1) * head_dim)
        pieces += [q, k, v]
    return torch.cat(pieces, dim=0)


def _source(
    name: str, param: torch.Tensor, ckpt: HFCheckpoint, m: ModelConfig, tp_rank: int
) -> torch.Tensor:
    """The Hugging Face values of Megatron parameter ``name`` (global layer index) on this rank.

    Sharding follows Megatron: column-parallel rows and vocab rows are split in contiguous
    blocks per rank (``linear_fc1`` per half), row-parallel columns likewise. Gemma 3's norm
    weights come back as ``1 + weight`` (fp32).
    """
    rows, text = param.shape[0], ckpt.text_prefix
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        source = text + _EMBEDDING
        if name == "output_layer.weight" and not m.tie_word_embeddings:
            source = ckpt.lm_head
        return ckpt.rows(source, tp_rank * rows, (tp_rank + 1) * rows)
    if name == "decoder.final_layernorm.weight":
        return _norm(ckpt.rows(f"{text}norm.weight"), m)
    match = _LAYER.match(name)
    if match is None:
        raise KeyError(f"no Hugging Face tensor maps to Megatron parameter {name!r}")
    prefix, rest = f"{text}layers.{match[1]}", match[2]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return _qkv_shard(ckpt, f"{prefix}.self_attn", rest.rsplit(".", 1)[1], m, rows, tp_rank)
    if rest == "mlp.linear_fc1.weight":  # (2·F/tp, H): [gate rows | up rows] of this rank
        half = rows // 2
        return torch.cat(
            [
                ckpt.rows(f"{prefix}.mlp.{p}.weight", tp_rank * half, (tp_rank + 1) * half)
                for p in ("gate_proj", "up_proj")
            ]
        )
    table = _FAMILY_LAYER[m.family]
    if rest not in table:
        raise KeyError(f"no Hugging Face tensor maps to Megatron parameter {name!r}")
    source = f"{prefix}.{table[rest]}"
    if param.dim() == 2:  # row-parallel: this rank's input columns
        cols = param.shape[1]
        return ckpt.columns(source, tp_rank * cols, (tp_rank + 1) * cols)
    return _norm(ckpt.rows(source), m)


def _norm(weight: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    """A norm's weight as our RMSNorm multiplies by it: Gemma 3 stores ``scale - 1``."""
    return weight.float() + 1.0 if m.family == "gemma3" else weight


def load_hf_weights(model: GPTModel, model_cfg: ModelConfig, tp_rank: int) -> None:
    """Copy this rank's shard of every base weight from ``model_cfg.hf_path`` into ``model``.

    Args:
        model: a `GPTModel` (or pipeline stage) built for ``model_cfg``, before `apply_lora`.
        model_cfg: sizes matching the checkpoint (`hf_model_fields`), ``hf_path`` set.
        tp_rank: this rank's tensor-parallel rank.

    Raises:
        ValueError: when ``hf_path`` is unset or a checkpoint tensor has the wrong shape.
        KeyError: when the checkpoint lacks a tensor the model needs.
    """
    if model_cfg.hf_path is None:
        raise ValueError("load_hf_weights needs model.hf_path, got None")
    ckpt = HFCheckpoint(model_cfg.hf_path)
    ignored = ckpt.foreign()
    if ignored:
        kinds = sorted({n.split(".")[1 if n.startswith("model.") else 0] for n in ignored})
        logger.info(
            "%s: imported the language model only (text training); left %d tensors of %s unread",
            model_cfg.hf_path,
            len(ignored),
            ", ".join(kinds),
        )
    to_global = {
        str(i): str(layer.layer_number - 1) for i, layer in enumerate(model.decoder.layers)
    }
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        global_name = re.sub(
            r"^decoder\.layers\.(\d+)\.", lambda g: f"decoder.layers.{to_global[g[1]]}.", name
        )
        value = _source(global_name, param, ckpt, model_cfg, tp_rank)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"checkpoint tensors for {global_name} give shape {tuple(value.shape)} on TP "
                f"rank {tp_rank}, expected {tuple(param.shape)} (config.json and weights disagree?)"
            )
        with torch.no_grad():
            param.copy_(value.to(param.dtype))


def hf_weight_source(model_cfg: ModelConfig, tp_rank: int):
    """``(global name, parameter) -> this rank's checkpoint values`` (`mcore.fp8.ValueSource`).

    The FP8 base loads through it one tensor at a time (`mcore.fp8.materialize_fp8_model`);
    values come in the checkpoint's dtype, shaped as Megatron's parameter (sliced lazily).

    Raises:
        ValueError: when ``model_cfg.hf_path`` is unset.
    """
    if model_cfg.hf_path is None:
        raise ValueError("hf_weight_source needs model.hf_path, got None")
    ckpt = HFCheckpoint(model_cfg.hf_path)

    def values(global_name: str, param: torch.Tensor) -> torch.Tensor:
        return _source(global_name, param, ckpt, model_cfg, tp_rank)

    return values


def check_hf_config(model_cfg: ModelConfig) -> None:
    """Refuse a ``model_cfg`` that the checkpoint at ``model_cfg.hf_path`` cannot fill.

    Raises:
        ValueError: when ``hf_path`` is unset or ``model_cfg`` disagrees with its config.json.
        NotImplementedError: for an architecture or feature the import does not support.
    """
    if model_cfg.hf_path is None:
        raise ValueError("check_hf_config needs model.hf_path, got None")
    fields, problems = hf_model_fields(model_cfg.hf_path)
    if problems:
        raise NotImplementedError("cannot import the checkpoint:\n  - " + "\n  - ".join(problems))
    wrong = {k: (getattr(model_cfg, k), v) for k, v in fields.items() if getattr(model_cfg, k) != v}
    if wrong:
        raise ValueError(
            f"model config disagrees with {model_cfg.hf_path}/config.json (ours, theirs): {wrong}"
        )
