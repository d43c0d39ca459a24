"""Build a Llama-like Megatron-Core `GPTModel` (RMSNorm, gated MLP, RoPE, GQA) on the local spec.

The local spec's core attention is swapped for `VarlenCoreAttention`, so packed (THD)
microbatches never attend across sample boundaries. ``model.family`` picks the layer
(`mcore.families`: Llama, Qwen3, Gemma 3); each layer's sliding window and RoPE base are set
after the build (`configure_layers`). Base weights are random from a seed or a Hugging Face
checkpoint's (`mcore.hf_import`), frozen; adapters are added afterwards with `apply_lora`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lorafusion.config import ModelConfig, attention_head_dim
from megatron_lorafusion.mcore.families import (
    embedding_scale,
    family_layer_spec,
    scale_word_embeddings,
)
from megatron_lorafusion.mcore.fp8 import (
    Fp8ColumnParallelLinear,
    Fp8RowParallelLinear,
    _new_parameter,
    _tensors,
    fp8_weight_bytes,
    materialize_fp8_model,
)
from megatron_lorafusion.mcore.fused_base import (
    Fp8ResidualRMSNorm,
    Fp8SwiGLU,
    FrozenRMSNorm,
    FusedSwiGLU,
    LoRAFusionGPTModel,
    fp8_bias_dropout_add,
)
from megatron_lorafusion.mcore.hf_import import check_hf_config, hf_weight_source, load_hf_weights
from megatron_lorafusion.ops import check_fp8_device


class _PortableRotaryEmbedding(RotaryEmbedding):
    """Megatron's RoPE with ``inv_freq`` as a (non-persistent) buffer that follows ``.to()``.

    The stock module keeps ``inv_freq`` as a plain attribute and moves it to
    ``torch.cuda.current_device()`` on first use, which fails on a CPU-only machine; its
    ``forward`` is also ``lru_cache``d, which would keep embeddings on a stale device after
    ``model.to(...)``. This subclass recomputes the (tiny) table on every call instead.

    Packed (THD) microbatches get no table from ``forward``: Megatron's THD RoPE loops over
    the samples in Python with a host sync each (``.tolist()``, ``.item()``), twice per layer.
    `VarlenCoreAttention` rotates q and k itself with `packed_cos_sin`, one table of every
    token's position inside its sample, computed once per microbatch for all layers.
    """

    def __init__(self, linear_factor: float | None = None, **kwargs):
        super().__init__(**kwargs)
        if self.rotary_interleaved or self.seq_len_interpolation_factor is not None:
            raise NotImplementedError("interleaved or interpolated RoPE is not supported")
        inv_freq = self.__dict__.pop("inv_freq")
        if linear_factor is not None:  # transformers' "linear" RoPE: positions / factor
            inv_freq = inv_freq / linear_factor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._packed_cache: tuple | None = None

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """(max_seq_len, 1, 1, head_dim) rotation angles of positions ``offset..``."""
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # (s, head_dim / 2)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    def forward(
        self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None
    ) -> torch.Tensor:
        """Rotation angles for ``max_seq_len`` positions (no context-parallel slicing)."""
        cp_group = cp_group if cp_group is not None else self.cp_group
        if cp_group is not None and cp_group.size() > 1:
            raise NotImplementedError("context parallelism is not supported")
        if packed_seq:
            return None  # the core attention applies `packed_cos_sin` instead
        return self.get_emb(max_seq_len, offset)

    def packed_cos_sin(
        self, cu_seqlens: torch.Tensor, tokens: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, 1, head_dim) cos and sin of each packed token's position in its sample.

        No host sync (``tokens`` is known on the host). Cached for the last ``cu_seqlens``
        tensor seen, so every layer of one forward shares one table.
        """
        cached = self._packed_cache
        if cached is not None and cached[0] is cu_seqlens and cached[1] == dtype:
            return cached[2]
        starts = cu_seqlens[:-1].long()
        lengths = cu_seqlens[1:].long() - starts
        index = torch.arange(tokens, device=cu_seqlens.device)
        positions = index - torch.repeat_interleave(starts, lengths, output_size=tokens)
        freqs = positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, head_dim)
        table = (torch.cos(emb).to(dtype), torch.sin(emb).to(dtype))
        self._packed_cache = (cu_seqlens, dtype, table)
        return table


def set_rotary_embedding(model: GPTModel, rotary: _PortableRotaryEmbedding) -> None:
    """Give the model its RoPE module and every layer's core attention the same one."""
    model.rotary_pos_emb = rotary
    for layer in model.decoder.layers:
        layer.self_attention.core_attention.rotary = rotary


def _sliding(model_cfg: ModelConfig, index: int) -> bool:
    """Whether global layer ``index`` (0-based) attends within ``model_cfg.sliding_window``."""
    if model_cfg.sliding_window is None:
        return False
    types = model_cfg.layer_types
    return types is None or types[index % len(types)] == "sliding_attention"


def _rotary(model_cfg: ModelConfig, config: TransformerConfig, cp_group, local: bool):
    """The RoPE module of the model's full-attention layers, or (``local``) sliding ones."""
    return _PortableRotaryEmbedding(
        kv_channels=config.kv_channels,
        rotary_percent=1.0,
        rotary_base=model_cfg.rope_local_theta if local else model_cfg.rope_theta,
        rope_scaling=model_cfg.rope_scaling_factor is not None and not local,
        rope_scaling_factor=model_cfg.rope_scaling_factor or 1.0,
        linear_factor=None if local else model_cfg.rope_linear_factor,
        use_cpu_initialization=True,
        cp_group=cp_group,
    )


def configure_layers(model: GPTModel, model_cfg: ModelConfig, config: TransformerConfig, cp_group):
    """Give every layer its sliding window and RoPE module, the model the full layers' RoPE.

    Gemma 3's sliding layers rotate with ``rope_local_theta`` (and no scaling), one module
    shared by those layers, so each microbatch builds two cos/sin tables, not one per layer.
    """
    rotary = _rotary(model_cfg, config, cp_group, local=False)
    set_rotary_embedding(model, rotary)
    local = None
    if model_cfg.rope_local_theta is not None and model_cfg.sliding_window is not None:
        local = _rotary(model_cfg, config, cp_group, local=True)
    for layer in model.decoder.layers:
        core = layer.self_attention.core_attention
        sliding = _sliding(model_cfg, layer.layer_number - 1)
        core.window = model_cfg.sliding_window if sliding else None
        if sliding and local is not None:
            core.rotary, core.local_rope = local, True


def _transformer_config(
    model_cfg: ModelConfig,
    tp_size: int,
    pp_size: int,
    params_dtype: torch.dtype,
    sequence_parallel: bool = False,
    fused_loss: bool = False,
) -> TransformerConfig:
    """Megatron config of a Llama-like decoder whose code paths all run on CPU.

    ``use_cpu_initialization`` allocates on the CPU (the GPU path needs the CUDA RNG
    tracker), or on the meta device under it (the FP8 and random bases), and
    ``perform_initialization=False`` leaves the weights to `_init_base_weights`. Every
    fusion is off because the fused kernels (bias+SwiGLU, RoPE, masked softmax, gradient
    accumulation) are CUDA-only. ``sequence_parallel`` takes effect only when ``tp_size > 1``
    (Megatron refuses it at TP = 1).

    Our own fused ops replace them on CUDA (`mcore.fused_base`): ``use_te_activation_func``
    only makes Megatron's MLP build ``MLPSubmodules.activation_func`` (`FusedSwiGLU`), nothing
    of Transformer Engine runs. ``cross_entropy_loss_fusion`` (Megatron's TE-free
    ``fused_vocab_parallel_cross_entropy``) is set with ``fused_loss``; it serves TP > 1, where
    our chunked loss does not apply. Bias-dropout-add stays unfused: with no bias and no
    dropout it is a single add.
    """
    return TransformerConfig(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        kv_channels=attention_head_dim(model_cfg),
        qk_layernorm=model_cfg.family != "llama",
        softmax_scale=(
            None
            if model_cfg.query_pre_attn_scalar is None
            else model_cfg.query_pre_attn_scalar**-0.5
        ),
        layernorm_epsilon=model_cfg.norm_epsilon,
        normalization="RMSNorm",
        gated_linear_unit=True,
        # FusedGeGLU computes tanh GELU; Megatron's check of use_te_activation_func admits
        # F.gelu (erf), which no code path of ours evaluates.
        activation_func=F.gelu if model_cfg.family == "gemma3" else F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_cfg.add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        sequence_parallel=sequence_parallel and tp_size > 1,
        pipeline_dtype=params_dtype,  # dtype of the hidden states passed between stages
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,
        use_te_activation_func=True,  # builds our FusedSwiGLU (no TE involved)
        cross_entropy_loss_fusion=fused_loss,
        cross_entropy_fusion_impl="native",
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def _name_seed(init_seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{init_seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63)


def _global_name_fn(model: GPTModel):
    """``local parameter name -> global name`` (a stage's layers by their model index)."""
    to_global = {
        str(i): str(layer.layer_number - 1) for i, layer in enumerate(model.decoder.layers)
    }

    def global_name(name: str) -> str:
        return re.sub(
            r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{to_global[m[1]]}.", name
        )

    return global_name


def _draw_matrix(
    model_cfg: ModelConfig, tp_rank: int, tp_size: int, global_name: str, param: torch.Tensor
) -> torch.Tensor:
    """This rank's shard of matrix ``global_name``, fp32 on the CPU (see `_init_base_weights`)."""
    if model_cfg.tie_word_embeddings and global_name == "output_layer.weight":
        global_name = "embedding.word_embeddings.weight"  # tied: the same draw
    scaled_std = model_cfg.init_method_std / math.sqrt(2.0 * model_cfg.num_layers)
    std = (
        scaled_std
        if global_name.endswith(("linear_proj.weight", "linear_fc2.weight"))
        else model_cfg.init_method_std
    )
    shape = list(param.shape)
    parallel = getattr(param, "tensor_model_parallel", False) and tp_size > 1
    if parallel:
        shape[param.partition_dim] *= tp_size
    generator = torch.Generator().manual_seed(_name_seed(model_cfg.init_seed, global_name))
    full = torch.randn(shape, generator=generator).mul_(std)  # in place: one fp32 copy held
    if parallel:
        chunks = full.chunk(tp_size * param.partition_stride, dim=param.partition_dim)
        full = torch.cat(chunks[tp_rank::tp_size], dim=param.partition_dim)
    return full


def _init_base_weights(model: GPTModel, model_cfg: ModelConfig, tp_rank: int, tp_size: int):
    """Give every parameter of a model allocated empty its random value (`_random_values`).

    Megatron's own CPU init draws all weights from one stream in build order, so a pipeline
    stage would get different weights than the same layers in a one-stage model. Here each
    weight is drawn whole (normal, std 0.02; ``linear_proj``/``linear_fc2`` scaled by
    1/sqrt(2·layers) as Megatron does) and this rank keeps its TP shard, split like
    Megatron's ``_initialize_affine_weight_cpu`` (chunks of ``partition_stride``). The model
    is therefore the same for every TP and PP size, and on every device: weights are drawn
    on the CPU, each with its own generator and so in parallel threads (one thread drew the
    8B preset in ~40 s), and copied to where the model lives. Norm weights are ones, biases
    zeros. With ``tie_word_embeddings`` the output layer gets the embedding's draw.
    """
    global_name = _global_name_fn(model)
    values = _random_values(model_cfg, tp_rank, tp_size)

    def fill(name: str, param: torch.Tensor) -> None:
        value = values(global_name(name), param)
        with torch.no_grad():
            param.copy_(value)

    params = list(model.named_parameters())
    with ThreadPoolExecutor(max_workers=min(len(params), os.cpu_count() or 1) or 1) as pool:
        for done in [pool.submit(fill, n, p) for n, p in params]:
            done.result()  # re-raises a draw's error here


def _allocate_empty(model: GPTModel, device: torch.device) -> None:
    """Give each meta parameter of ``model`` uninitialised memory on ``device``.

    ``Module.to_empty`` would drop the marks Megatron sets on a parameter (its tensor-parallel
    ``partition_dim`` and the like), which a TP shard's draw and the optimizer read; the new
    parameter takes them over, as the FP8 load's do (`mcore.fp8`).
    """
    for _, owner, attribute, param in _tensors(model):
        setattr(owner, attribute, _new_parameter(param, torch.empty_like(param, device=device)))


def _random_values(model_cfg: ModelConfig, tp_rank: int, tp_size: int):
    """The random base's values, by global name (`_init_base_weights`; a `mcore.fp8.ValueSource`).

    Matrices are drawn as there; norm weights are ones, as Megatron builds them, and biases
    zeros (Megatron leaves them uninitialised when it does not initialise).
    """

    def values(global_name: str, param: torch.Tensor) -> torch.Tensor:
        if param.dim() == 2:
            return _draw_matrix(model_cfg, tp_rank, tp_size, global_name, param)
        if global_name.endswith("norm.weight"):
            return torch.ones(param.shape)
        if global_name.endswith(".bias"):
            return torch.zeros(param.shape)
        raise KeyError(f"no random initialisation is defined for {global_name!r}")

    return values


def _build_fp8(
    model: GPTModel,
    model_cfg: ModelConfig,
    device: torch.device,
    params_dtype: torch.dtype,
    tp_group: torch.distributed.ProcessGroup,
) -> None:
    """Load a meta-built FP8 model (`mcore.fp8.materialize_fp8_model`): random or HF values.

    The backward's transposed e4m3 copy of each weight is kept when both copies take at most
    half the GPU's memory (Llama-3.1-8B: 2 × 7 GB), else each backward transposes its weight
    (Llama-3.1-70B: 2 × 68 GB would not fit); the numbers are the same either way.
    """
    tp_rank, tp_size = tp_group.rank(), tp_group.size()
    if model_cfg.hf_path is not None:
        values = hf_weight_source(model_cfg, tp_rank)
        workers = 4  # reads of checkpoint slices
    else:
        values = _random_values(model_cfg, tp_rank, tp_size)
        workers = os.cpu_count() or 1
    keep = device.type == "cuda" and 2 * fp8_weight_bytes(model) <= (
        torch.cuda.get_device_properties(device).total_memory // 2
    )
    materialize_fp8_model(
        model,
        values,
        _global_name_fn(model),
        device=device,
        dtype=params_dtype,
        tp_group=tp_group,
        keep_transposed=keep,
        workers=workers,
    )


def fp8_output_layer_fits(model_cfg: ModelConfig, tp_size: int) -> bool:
    """Whether an FP8 base's output layer is FP8: ``V / tp`` a multiple of 16 (its GEMMs')."""
    return model_cfg.vocab_size % (16 * tp_size) == 0


def get_gpt_lora_layer_spec(family: str = "llama", base_precision: str = "bf16") -> ModuleSpec:
    """The local GPT layer spec (RMSNorm) of ``family`` (`mcore.families.family_layer_spec`).

    `PackedSelfAttention` over `VarlenCoreAttention`. LoRA is not part of the spec:
    `apply_lora` wraps the built linears instead, so base weights can be loaded first. Norms
    are `ResidualRMSNorm` (sequence-parallel capable, fused on CUDA, handing the layer its
    residual); the MLP's activation module is `FusedSwiGLU` or `FusedGeGLU` (built by
    Megatron's MLP when the config sets ``use_te_activation_func``, as `_transformer_config`
    does). With ``base_precision="fp8"`` the four linears are `Fp8ColumnParallelLinear` /
    `Fp8RowParallelLinear`, the norms `Fp8ResidualRMSNorm` (they quantize qkv's and fc1's
    input as they write it, and proj's and fc2's incoming gradient, marked on the residual
    stream by `fp8_bias_dropout_add`) and SwiGLU is `Fp8SwiGLU` (it quantizes fc2's input and
    fc1's incoming gradient as it writes them).
    """
    spec = family_layer_spec(family)
    if base_precision != "fp8":
        return spec
    spec.submodules.input_layernorm = Fp8ResidualRMSNorm
    spec.submodules.pre_mlp_layernorm = Fp8ResidualRMSNorm
    spec.submodules.self_attn_bda = fp8_bias_dropout_add
    spec.submodules.mlp_bda = fp8_bias_dropout_add
    attention = spec.submodules.self_attention
    attention.submodules.linear_qkv = Fp8ColumnParallelLinear
    attention.submodules.linear_proj = Fp8RowParallelLinear
    mlp = spec.submodules.mlp  # functools.partial(<MLP builder>, submodules=...)
    activation = mlp.keywords["submodules"].activation_func
    submodules = dataclasses.replace(
        mlp.keywords["submodules"],
        linear_fc1=Fp8ColumnParallelLinear,
        linear_fc2=Fp8RowParallelLinear,
        activation_func=Fp8SwiGLU if activation is FusedSwiGLU else activation,
    )
    spec.submodules.mlp = functools.partial(
        mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules}
    )
    return spec


def _gpt_block_spec(
    config: TransformerConfig, family: str, base_precision: str = "bf16"
) -> TransformerBlockSubmodules:
    """This pipeline stage's decoder: `get_gpt_lora_layer_spec` layers, a `FrozenRMSNorm` last.

    Spelled out because Megatron's default final norm is its torch-norm fallback (see
    `FrozenRMSNorm`).
    """
    layer = get_gpt_lora_layer_spec(family, base_precision)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=FrozenRMSNorm
    )


def build_gpt_model(
    model_cfg: ModelConfig,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    sequence_parallel: bool = False,
) -> GPTModel:
    """Build this rank's frozen Llama-like `GPTModel`: random weights, or ``model.hf_path``'s.

    Megatron's parallel state must be initialised by the caller
    (``parallel_state.initialize_model_parallel``); TP and PP sizes and this rank's layers are
    taken from it at build time. With ``model_cfg.hf_path`` set, this rank's shard of the
    checkpoint is loaded (`mcore.hf_import`; Qwen2's q/k/v biases, Llama 3 RoPE scaling,
    Qwen3 and Gemma 3 included); otherwise every weight is drawn from a generator keyed by
    ``(model_cfg.init_seed, global parameter name)`` (`_init_base_weights`; the global RNG is
    left untouched), so the model is identical for any TP and PP size. The layer is
    ``model_cfg.family``'s (`mcore.families`), each layer's window and RoPE base set by
    `configure_layers`. Untied embeddings (a tied checkpoint gets two equal frozen copies),
    no dropout.

    With ``model_cfg.base_precision == "fp8"`` the decoder's linears are FP8
    (`mcore.fp8`): the model is built on the meta device and loaded one tensor at a time on
    ``device``, each linear weight quantized from its ``params_dtype`` values (the same values
    as the bf16 model's), so the bf16 model is never held. The output layer is FP8 too when
    its vocabulary shard ``V / tp`` is a multiple of 16 (the FP8 GEMMs' alignment), else it
    stays in ``params_dtype`` like the embeddings and norms. On CPU the FP8 linears run their
    torch reference.

    Args:
        model_cfg: sizes and seed (or checkpoint) of the model.
        pre_process: build the embedding (first pipeline stage).
        post_process: build the final norm and output layer (last pipeline stage).
        params_dtype: dtype of the frozen base weights.
        device: where the model lives.
        sequence_parallel: Megatron sequence parallelism (only when TP > 1): hidden states
            outside the TP linears are ``[T / tp, 1, H]``, and ``T`` must be a multiple of TP.

    Returns:
        The model, in train mode, with every parameter's ``requires_grad`` False.

    Raises:
        RuntimeError: when Megatron's model-parallel state is not initialised, or for an FP8
            base on a GPU without FP8 tensor cores (the message names it).
        ValueError: when ``model_cfg`` disagrees with the checkpoint's config.json.
        NotImplementedError: for a checkpoint architecture or feature the import lacks.
    """
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "build_gpt_model needs Megatron's parallel state: call "
            "parallel_state.initialize_model_parallel(tp, pp) first"
        )
    if model_cfg.hf_path is not None:
        check_hf_config(model_cfg)
    device = torch.device(device)
    fp8 = model_cfg.base_precision == "fp8"
    if fp8:
        check_fp8_device(device)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    config = _transformer_config(
        model_cfg,
        tp_size=pg_collection.tp.size(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        params_dtype=params_dtype,
        sequence_parallel=sequence_parallel,
        fused_loss=device.type == "cuda",
    )
    # FP8: built on the meta device (nothing allocated), then loaded tensor by tensor; the
    # random base: built there, then allocated and drawn where it lives (an 8B base's 16 GB
    # were allocated on the host and copied before its draws, 4.2 s on the H200).
    drawn = not fp8 and model_cfg.hf_path is None
    where = torch.device("meta") if fp8 or drawn else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]):  # in case a Megatron module draws anyway
        with where:
            model = LoRAFusionGPTModel(
                config=config,
                transformer_layer_spec=_gpt_block_spec(
                    config, model_cfg.family, model_cfg.base_precision
                ),
                vocab_size=model_cfg.vocab_size,
                max_sequence_length=model_cfg.max_position_embeddings,
                pre_process=pre_process,
                post_process=post_process,
                share_embeddings_and_output_weights=False,  # frozen: two equal copies are exact
                position_embedding_type="rope",
                rotary_base=model_cfg.rope_theta,
                pg_collection=pg_collection,
                fp8_output_layer=fp8 and fp8_output_layer_fits(model_cfg, pg_collection.tp.size()),
            )
        configure_layers(model, model_cfg, config, pg_collection.cp)
    scale = embedding_scale(model_cfg, params_dtype)
    if pre_process and scale is not None:
        scale_word_embeddings(model.embedding.word_embeddings, scale)
    model.requires_grad_(False)
    if fp8:
        _build_fp8(model, model_cfg, device, params_dtype, pg_collection.tp)
        return model.to(device)  # the rotary table
    tp_rank, tp_size = pg_collection.tp.rank(), pg_collection.tp.size()
    if model_cfg.hf_path is not None:
        load_hf_weights(model, model_cfg, tp_rank)
        return model.to(device)
    _allocate_empty(model, device)
    _init_base_weights(model, model_cfg, tp_rank, tp_size)
    return model.to(device)  # the rotary table
