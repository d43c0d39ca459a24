"""Hugging Face import: our GPTModel's logits equal transformers' for Llama, Qwen2, Mistral,
Qwen3 and Gemma 3 (text, and the text model of a multimodal checkpoint).

Qwen3 and Gemma 3 in several shapes: GQA ratios 1, 2, 4 and 6, head sizes other than
hidden / heads, tied and untied, sharded; Gemma 3 with a sliding window shorter than the
samples on some layers, another RoPE base there, linear RoPE scaling on the others. TP = 2
(two gloo processes) loads each rank's shard only and still matches, vocab-sharded.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hf_testing import hf_logits, model_config, save_tiny_hf_model
from mcore_testing import make_packed_batch, run_model

from megatron_lorafusion.hf_config import hf_model_fields

pytest.importorskip("transformers", reason="dev extra: transformers")

# dtype -> tolerances of two fp32 implementations of the same network (issue 6: 1e-4).
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4)}
LENGTHS = [7, 12, 5]


def _samples(vocab: int, seed: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in LENGTHS]


def _our_logits(model, samples) -> torch.Tensor:
    batch = _packed(samples)
    with torch.no_grad():
        return run_model(model, None, batch)[0]  # (T, V / tp)


@pytest.mark.parametrize(
    ("kind", "tie", "shard", "llama3_rope"),
    [
        ("llama", False, False, False),
        ("llama", False, False, True),
        ("qwen2", True, True, False),
        ("mistral", False, True, False),
    ],
    ids=["llama", "llama-rope-scaling", "qwen2-tied-sharded", "mistral-sharded"],
)
def test_hf_import_logits_match_transformers(
    megatron_single_process, tmp_path, kind, tie, shard, llama3_rope
):
    from megatron_lorafusion.mcore import build_gpt_model

    hf = save_tiny_hf_model(kind, tmp_path, tie=tie, shard=shard, llama3_rope=llama3_rope)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file(), "expected a sharded save"
    cfg = model_config(tmp_path)
    assert cfg.add_qkv_bias == (kind == "qwen2")
    assert cfg.tie_word_embeddings == tie
    assert cfg.rope_scaling_factor == (8.0 if llama3_rope else None)
    model = build_gpt_model(cfg).eval()
    samples = _samples(cfg.vocab_size)
    torch.testing.assert_close(
        _our_logits(model, samples),
        hf_logits(hf, samples),
        **TOL[torch.float32],
        msg=f"{kind}: logits differ from transformers",
    )


# kind -> (tie, shard, config overrides): GQA ratio np / ng and head size D per case
FAMILY_CASES = {
    "qwen3-gqa2-d24": ("qwen3", False, False, {}),
    "qwen3-mqa6-d16-tied-sharded": (
        "qwen3",
        True,
        True,
        dict(num_attention_heads=6, num_key_value_heads=1, head_dim=16),
    ),
    "qwen3-mha-d16": ("qwen3", False, False, dict(num_key_value_heads=4, head_dim=16)),
    "gemma3-gqa4-d32-window4-tied": ("gemma3", True, False, dict(num_key_value_heads=1)),
    "gemma3-gqa2-d16-untied-sharded": (
        "gemma3",
        False,
        True,
        dict(
            head_dim=16,
            sliding_window=6,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 5e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    "gemma3-multimodal": ("gemma3-mm", True, False, {}),
}


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_hf_import_qwen3_gemma3_logits_match_transformers(megatron_single_process, tmp_path, case):
    from megatron_lorafusion.mcore import build_gpt_model

    kind, tie, shard, overrides = FAMILY_CASES[case]
    hf = save_tiny_hf_model(kind, tmp_path, tie=tie, shard=shard, **overrides)
    cfg = model_config(tmp_path)
    assert (cfg.family, cfg.tie_word_embeddings) == (kind.removesuffix("-mm"), tie)
    assert cfg.hf_multimodal == (kind == "gemma3-mm")
    model = build_gpt_model(cfg).eval()
    samples = _samples(cfg.vocab_size)
    torch.testing.assert_close(
        _our_logits(model, samples),
        hf_logits(hf, samples),
        **TOL[torch.float32],
        msg=f"{case}: logits differ from transformers",
    )


def test_hf_import_gemma3_windows_and_local_rope_matter(megatron_single_process, tmp_path):
    """The case above is no accident: without its windows, or with the global RoPE on every
    layer, the same Gemma 3 model is far from transformers'."""
    from megatron_lorafusion.mcore import build_gpt_model

    hf = save_tiny_hf_model("gemma3", tmp_path, tie=True)
    cfg = model_config(tmp_path)
    assert cfg.sliding_window < min(LENGTHS), "the window must be shorter than the samples"
    samples = _samples(cfg.vocab_size)
    expected = hf_logits(hf, samples)
    for change in ("window", "rope"):
        model = build_gpt_model(cfg).eval()
        for layer in model.decoder.layers:
            core = layer.self_attention.core_attention
            if change == "window":
                core.window = None
            else:
                core.rotary, core.local_rope = model.rotary_pos_emb, False
        assert (_our_logits(model, samples) - expected).abs().max() > 1e-2, change


def test_hf_import_multimodal_reads_the_language_model_only(
    megatron_single_process, tmp_path, caplog
):
    from megatron_lorafusion.mcore import build_gpt_model

    save_tiny_hf_model("gemma3-mm", tmp_path, tie=True)
    with caplog.at_level("INFO", logger="megatron_lorafusion.mcore.hf_import"):
        build_gpt_model(model_config(tmp_path))
    (message,) = [r.getMessage() for r in caplog.records if "language model only" in r.message]
    assert "multi_modal_projector, vision_tower" in message


def test_hf_import_refuses_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    _, problems = hf_model_fields(tmp_path)
    assert problems == [
        "architecture must be one of ['Gemma3ForCausalLM', 'Gemma3ForConditionalGeneration', "
        "'LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM'], "
        "got ['GPT2LMHeadModel']"
    ]


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"architectures": ["Qwen3MoeForCausalLM"]}, "is not supported: a mixture-of-experts"),
        ({"architectures": ["Gemma2ForCausalLM"]}, "tanh soft-capping"),
        (
            {"architectures": ["Gemma3ForCausalLM"], "final_logit_softcapping": 30.0},
            "final_logit_softcapping must be null",
        ),
        (
            {"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True},
            "an encoder such as EmbeddingGemma",
        ),
        (
            {"architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu"},
            "hidden_act must be 'gelu_pytorch_tanh' for gemma3",
        ),
        (
            {
                "architectures": ["Qwen3ForCausalLM"],
                "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
            },
            "rope type must be 'default' or 'llama3'",
        ),
    ],
    ids=["qwen3-moe", "gemma2", "softcap", "bidirectional", "gelu-erf", "yarn"],
)
def test_hf_import_refuses_with_the_reason(tmp_path, config, reason):
    sizes = dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        vocab_size=300,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
    )
    (tmp_path / "config.json").write_text(json.dumps({**sizes, **config}))
    _, problems = hf_model_fields(tmp_path)
    assert len(problems) == 1
    assert reason in problems[0]


def test_hf_fields_read_gemma3_hub_style_configs(tmp_path):
    """A transformers 4.x Gemma 3 config.json (as on the hub) names few keys: the rest are
    transformers' defaults; RoPE comes as rope_theta, rope_local_base_freq, rope_scaling."""
    text = {
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "model_type": "gemma3_text",
        "num_attention_heads": 16,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    }
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(config))
    fields, problems = hf_model_fields(tmp_path)
    assert problems == []
    from megatron_lorafusion.config import MODEL_PRESETS

    preset = MODEL_PRESETS["gemma3-12b"]
    for key, value in preset.items():
        if key != "layer_types":
            assert fields[key] == value, key
    assert fields["layer_types"] == preset["layer_types"] * 8
    assert fields["hf_multimodal"] is True


def test_hf_import_refuses_rope_scaling(megatron_single_process, tmp_path):
    from megatron_lorafusion.mcore import build_gpt_model

    save_tiny_hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    cfg = model_config(tmp_path)
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="rope type must be 'default' or 'llama3'"):
        build_gpt_model(cfg)


# kind -> (tie, overrides) of the two-process cases: 2 KV heads, so TP = 2 splits them; Gemma
# 3 with 4 layers, so PP = 2's second stage holds global layers 2 (full) and 3 (sliding).
PARALLEL_CASES = {
    "llama": (False, {}),
    "qwen2": (True, {}),
    "qwen3": (False, {}),
    "gemma3": (
        True,
        dict(
            num_hidden_layers=4,
            layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"],
            num_key_value_heads=2,
        ),
    ),  # fmt: skip
}


def _packed(samples):
    return make_packed_batch([0] * len(samples), LENGTHS, 1, input_ids=torch.cat(samples)[None])


def _pp2_logits(model, samples, rank: int, hidden_size: int):
    """Stage ``rank`` of 2: the first sends its hidden states, the second returns logits."""
    batch = _packed(samples)
    with torch.no_grad():
        if rank == 0:
            dist.send(run_model(model, None, batch).contiguous(), 1)  # [T, 1, H]
            return None
        hidden = torch.empty(sum(LENGTHS), 1, hidden_size)
        dist.recv(hidden, 0)
        model.set_input_tensor(hidden)
        return run_model(model, None, batch)[0]


def _parallel_worker(rank: int, workdir: str) -> None:
    """TP = 2, then PP = 2, in one two-process world (one start-up of the two interpreters):
    Megatron's groups are made for each layout and destroyed after it."""
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(workdir, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        ref = torch.load(os.path.join(workdir, "ref.pt"))
        for tp, pp in ((2, 1), (1, 2)):
            parallel_state.initialize_model_parallel(tp, pp)
            try:
                _check_parallel_logits(rank, workdir, ref, tp, pp)
            finally:
                parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def _check_parallel_logits(rank: int, workdir: str, ref: dict, tp: int, pp: int) -> None:
    from megatron_lorafusion.mcore import build_gpt_model

    for kind in PARALLEL_CASES if tp > 1 else ("qwen3", "gemma3"):
        cfg = model_config(os.path.join(workdir, kind))
        stage = dict(pre_process=rank == 0 or pp == 1, post_process=rank == 1 or pp == 1)
        model = build_gpt_model(cfg, **stage).eval()
        samples, expected = ref["samples"][kind], ref["logits"][kind]
        if pp > 1:
            ours = _pp2_logits(model, samples, rank, cfg.hidden_size)
            if ours is None:
                continue
        else:
            ours = _our_logits(model, samples)
            vocab = ours.shape[-1]
            expected = expected[:, rank * vocab : (rank + 1) * vocab]
        torch.testing.assert_close(
            ours,
            expected,
            **TOL[torch.float32],
            msg=f"rank {rank}: {kind} logits differ at TP = {tp}, PP = {pp}",
        )


@pytest.mark.slow
def test_hf_import_tp2_and_pp2_logits_match_transformers(tmp_path):
    ref = {"samples": {}, "logits": {}}
    for kind, (tie, overrides) in PARALLEL_CASES.items():
        hf = save_tiny_hf_model(kind, tmp_path / kind, tie=tie, shard=True, **overrides)
        ref["samples"][kind] = _samples(hf.config.vocab_size)
        ref["logits"][kind] = hf_logits(hf, ref["samples"][kind])
    torch.save(ref, tmp_path / "ref.pt")
    # Errors inside a worker are raised here, with the worker's traceback.
    mp.spawn(_parallel_worker, args=(str(tmp_path),), nprocs=2, join=True)
