"""What Qwen3 and Gemma 3 change in the Llama layer, as Megatron specs and built-module hooks.

Megatron-Core 0.19's local GPT spec has seams for some of it: ``qk_layernorm`` with the
spec's ``q_layernorm``/``k_layernorm`` (Qwen3's and Gemma 3's per-head RMSNorm, here
`FrozenRMSNorm`), ``kv_channels`` (a head size other than hidden / heads) and
``softmax_scale`` (Gemma 3's ``query_pre_attn_scalar``). What it lacks is ours:

- norms after attention and after the MLP (Gemma 3): `PostNormSelfAttention` and
  `PostNormMLP`, plugged in through the layer spec;
- GeGLU with tanh GELU (Gemma 3): `FusedGeGLU` as the MLP's activation module;
- embeddings scaled by sqrt(hidden) (Gemma 3): `scale_word_embeddings`, a hook on the built
  embedding;
- sliding windows on some layers and another RoPE base there (Gemma 3): per-layer attributes
  of `VarlenCoreAttention`, set by ``mcore.model.configure_layers``.

Gemma 3's RMSNorm scales by ``1 + weight``; the importer stores ``1 + weight`` in our norms'
weight (``mcore.hf_import``), so the norm modules are the plain ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_lorafusion.config import ModelConfig
from megatron_lorafusion.mcore.attention import VarlenCoreAttention
from megatron_lorafusion.mcore.fused_base import (
    FrozenRMSNorm,
    FusedGeGLU,
    FusedSwiGLU,
    ResidualRMSNorm,
)
from megatron_lorafusion.mcore.self_attention import PackedSelfAttention, PostNormSelfAttention

__all__ = ["PostNormMLP", "embedding_scale", "family_layer_spec", "scale_word_embeddings"]


class PostNormMLP(MLP):
    """Megatron's `MLP` whose output is RMS-normalised before the residual add (Gemma 3).

    The norm is Gemma 3's ``post_feedforward_layernorm``, here ``post_layernorm``, a
    `FrozenRMSNorm`.
    """

    def __init__(self, config, submodules, **kwargs):
        super().__init__(config, submodules, **kwargs)
        self.post_layernorm = FrozenRMSNorm(
            config, config.hidden_size, eps=config.layernorm_epsilon
        )

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        """``(norm(output), None)`` for ``[s, b, H]`` input; fc2 must have no bias."""
        out, bias = super().forward(hidden_states, *args, **kwargs)
        if bias is not None:
            raise NotImplementedError("PostNormMLP needs linear_fc2 without a bias")
        return self.post_layernorm(out), None


def family_layer_spec(family: str) -> ModuleSpec:
    """The decoder layer of ``family`` on Megatron's local spec (RMSNorm everywhere).

    Every family: `PackedSelfAttention` over `VarlenCoreAttention`, `ResidualRMSNorm` pre-norms.
    llama: `FusedSwiGLU`; qwen3: plus `FrozenRMSNorm` q/k norms (``config.qk_layernorm``);
    gemma3: q/k norms, `PostNormSelfAttention`, `PostNormMLP` and `FusedGeGLU`.

    Raises:
        ValueError: for an unknown family.
    """
    if family not in ("llama", "qwen3", "gemma3"):
        raise ValueError(f"family must be llama, qwen3 or gemma3, got {family!r}")
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    attention = spec.submodules.self_attention
    attention.module = PostNormSelfAttention if family == "gemma3" else PackedSelfAttention
    attention.submodules.core_attention = VarlenCoreAttention
    if family != "llama":
        attention.submodules.q_layernorm = FrozenRMSNorm
        attention.submodules.k_layernorm = FrozenRMSNorm
    spec.submodules.input_layernorm = ResidualRMSNorm
    spec.submodules.pre_mlp_layernorm = ResidualRMSNorm
    mlp = spec.submodules.mlp  # functools.partial(MLP.as_mlp_submodule, submodules=...)
    activation = FusedGeGLU if family == "gemma3" else FusedSwiGLU
    submodules = dataclasses.replace(mlp.keywords["submodules"], activation_func=activation)
    build = PostNormMLP.as_mlp_submodule if family == "gemma3" else mlp.func
    spec.submodules.mlp = functools.partial(
        build, *mlp.args, **{**mlp.keywords, "submodules": submodules}
    )
    return spec


def embedding_scale(model_cfg: ModelConfig, dtype: torch.dtype) -> float | None:
    """Gemma 3's factor on the word embeddings; None for the other families.

    sqrt(hidden), rounded to ``dtype`` as transformers rounds it.
    """
    if model_cfg.family != "gemma3":
        return None
    return torch.tensor(math.sqrt(model_cfg.hidden_size)).to(dtype).item()


def scale_word_embeddings(embedding: torch.nn.Module, scale: float) -> None:
    """Multiply the output of the built ``word_embeddings`` module by ``scale``, in place.

    A forward hook on the module (Megatron's `LanguageModelEmbedding` has no seam for it);
    the product is in the embeddings' dtype, as transformers' Gemma 3 computes it.
    """
    embedding.register_forward_hook(lambda module, inputs, out: out * scale)
