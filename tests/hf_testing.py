"""Helpers of the Hugging Face import/export tests: tiny random checkpoints saved locally."""

import torch

from megatron_lorafusion.config import ModelConfig
from megatron_lorafusion.hf_config import hf_model_fields

# Small but with every feature that matters: GQA (4 heads, 2 groups), 2 layers, a vocabulary
# divisible by TP = 2. std 0.2 instead of 0.02 so logits are far from uniform.
SIZES = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


# Qwen3 and Gemma 3 defaults of the tests: a head size that is not hidden / heads; Gemma 3
# with a window shorter than the tests' samples on two of three layers, its own query scale
# and a linear RoPE scaling on the global layer (Gemma 3 4B+ have factor 8).
SLIDING, FULL = "sliding_attention", "full_attention"
FAMILY_SIZES = {
    "qwen3": dict(head_dim=24),
    "gemma3": dict(
        head_dim=32,
        num_hidden_layers=3,
        sliding_window=4,
        layer_types=[SLIDING, SLIDING, FULL],
        query_pre_attn_scalar=20,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
}
TINY_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=7,
)


def _config(kind: str, tie: bool, llama3_rope: bool, overrides: dict):
    import transformers

    if kind == "gemma3-mm":  # Gemma3ForConditionalGeneration: text model + a tiny vision tower
        text = {**SIZES, **FAMILY_SIZES["gemma3"], "tie_word_embeddings": tie, **overrides}
        special = dict(image_token_index=299, boi_token_index=297, eoi_token_index=298)
        return transformers.Gemma3Config(
            text_config=text, vision_config=TINY_VISION, mm_tokens_per_image=4, **special
        ), transformers.Gemma3ForConditionalGeneration
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[kind]
    extra = {"rope_theta": 5000.0} if kind == "llama" else {}
    if llama3_rope:
        extra = {"rope_parameters": dict(LLAMA3_ROPE)}
    sizes = {**SIZES, **FAMILY_SIZES.get(kind, {}), **extra, **overrides}
    return config_cls(**sizes, tie_word_embeddings=tie), model_cls


def save_tiny_hf_model(
    kind: str,
    folder,
    *,
    tie: bool = False,
    shard: bool = False,
    seed=0,
    llama3_rope: bool = False,
    **overrides,
):
    """Save a random tiny checkpoint of ``kind``; returns the transformers model.

    ``kind``: llama, qwen2, mistral, qwen3, gemma3 (``Gemma3ForCausalLM``) or gemma3-mm
    (``Gemma3ForConditionalGeneration``, a tiny vision tower beside the text model).
    ``shard`` splits the weights over several files with an index (max 40 kB each);
    ``llama3_rope`` gives a Llama 3.1-style RoPE frequency scaling (head dim 16, base
    5000: the two lowest frequencies are scaled or smoothed); ``overrides`` replace config
    keys (of the text config for gemma3-mm). Qwen2's biases and the Qwen3 / Gemma 3 norm
    weights are drawn at random (they start at zero or one), so they matter.
    """
    config, model_cls = _config(kind, tie, llama3_rope, overrides)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if kind == "qwen2" and name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif kind.startswith("gemma3") and "norm" in name and "vision" not in name:
                param.normal_(0.0, 0.3)  # the norm scales by 1 + weight
            elif kind == "qwen3" and "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
    model.save_pretrained(str(folder), max_shard_size="40kB" if shard else "5GB")
    return model


def model_config(folder) -> ModelConfig:
    """Our `ModelConfig` of a saved checkpoint, as ``load_config`` builds it."""
    fields, problems = hf_model_fields(folder)
    assert not problems, problems
    return ModelConfig(hf_path=str(folder), **fields)


def hf_logits(model, samples: list[torch.Tensor]) -> torch.Tensor:
    """Logits (T, V) of each sample run alone through the transformers model, concatenated.

    (A multimodal Gemma 3 runs its language model: no image tokens in the samples.)
    """
    with torch.no_grad():
        return torch.cat([model(input_ids=ids[None]).logits[0] for ids in samples])


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tiny_tokenizer(folder):
    """Save a character-level fast tokenizer (printable ASCII + specials, ~105 ids) with a chat
    template; ``transformers.AutoTokenizer.from_pretrained(folder)`` loads it offline."""
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.add_special_tokens(specials)
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    return tok


def exported_states(monkeypatch) -> dict:
    """Record the Megatron-named factors each adapter is exported with (``name -> tensors``):
    the weights a one-process run ends with (its last step is exported straight from its
    rows, with no checkpoint)."""
    import megatron_lorafusion.train.saving as saving

    states, real = {}, saving.write_peft_folder

    def spy(folder, adapter, megatron_state, model):
        states[adapter.name] = {k: v.clone() for k, v in megatron_state.items()}
        return real(folder, adapter, megatron_state, model)

    monkeypatch.setattr(saving, "write_peft_folder", spy)
    return states


def trained_lora_logits(cfg, states, lengths, owners=(0, 0, 1, 1), seed=5) -> dict:
    """Our imported model with trained adapters (``states``: name -> Megatron-named factors,
    `exported_states`): logits of one packed microbatch of random samples ``lengths`` of
    adapters ``owners`` (adapter-major).

    Returns ``{"ids": (T,), "logits": (T, V), "slices": [slice per sample], "owners": ...}``.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_lorafusion.mcore import apply_lora, build_gpt_model
    from megatron_lorafusion.ops import AdapterLayout

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.model.vocab_size, (sum(lengths),), generator=generator)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        model = build_gpt_model(cfg.model)
        lora = apply_lora(model, cfg.adapters, seed=cfg.train.seed)
        for a, adapter in enumerate(cfg.adapters):
            lora.load_adapter_state_dict(a, states[adapter.name])
        model.eval()
        layout = AdapterLayout.from_samples(list(owners), list(lengths), len(cfg.adapters))
        lora.layout = layout
        cu = layout.cu_seqlens
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=max(lengths),
            max_seqlen_kv=max(lengths),
        )
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        with torch.no_grad():
            logits = model(ids[None], positions, None, packed_seq_params=params)[0]
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    bounds = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    slices = [slice(bounds[i], bounds[i + 1]) for i in range(len(lengths))]
    return {"ids": ids, "logits": logits, "slices": slices, "owners": list(owners)}
