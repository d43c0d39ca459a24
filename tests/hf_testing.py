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


def save_tiny_hf_model(
    kind: str, folder, *, tie: bool = False, shard: bool = False, seed=0, llama3_rope: bool = False
):
    """Save a random ``LlamaForCausalLM``/``Qwen2ForCausalLM``/``MistralForCausalLM``; returns it.

    ``shard`` splits the weights over several files with an index (max 40 kB each);
    ``llama3_rope`` gives a Llama 3.1-style RoPE frequency scaling (head dim 16, base
    5000: the two lowest frequencies are scaled or smoothed).
    """
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    extra = {"rope_theta": 5000.0} if kind == "llama" else {}
    if llama3_rope:
        extra = {"rope_parameters": dict(LLAMA3_ROPE)}
    config = config_cls(**SIZES, tie_word_embeddings=tie, **extra)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if kind == "qwen2":  # biases start at zero; make them matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, 0.2)
    model.save_pretrained(str(folder), max_shard_size="40kB" if shard else "5GB")
    return model


def model_config(folder) -> ModelConfig:
    """Our `ModelConfig` of a saved checkpoint, as ``load_config`` builds it."""
    fields, problems = hf_model_fields(folder)
    assert not problems, problems
    return ModelConfig(hf_path=str(folder), **fields)


def hf_logits(model, samples: list[torch.Tensor]) -> torch.Tensor:
    """Logits (T, V) of each sample run alone through the transformers model, concatenated."""
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
