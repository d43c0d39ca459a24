"""Hugging Face import: our GPTModel's logits equal transformers' for Llama, Qwen2 and Mistral.

TP = 2 (two gloo processes) loads each rank's shard only and still matches, vocab-sharded.
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
    batch = make_packed_batch([0] * len(samples), LENGTHS, 1, input_ids=torch.cat(samples)[None])
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


def test_hf_import_refuses_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    _, problems = hf_model_fields(tmp_path)
    assert problems == [
        "architecture must be one of ['LlamaForCausalLM', 'MistralForCausalLM', "
        "'Qwen2ForCausalLM'], got ['GPT2LMHeadModel']"
    ]


def test_hf_import_refuses_rope_scaling(megatron_single_process, tmp_path):
    from megatron_lorafusion.mcore import build_gpt_model

    save_tiny_hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    cfg = model_config(tmp_path)
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="rope type must be 'default' or 'llama3'"):
        build_gpt_model(cfg)


def _tp2_worker(rank: int, workdir: str) -> None:
    from megatron.core import parallel_state

    from megatron_lorafusion.mcore import build_gpt_model

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(workdir, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        parallel_state.initialize_model_parallel(2, 1)
        ref = torch.load(os.path.join(workdir, "ref.pt"))
        for kind in ("llama", "qwen2"):
            model = build_gpt_model(model_config(os.path.join(workdir, kind))).eval()
            ours = _our_logits(model, ref["samples"][kind])
            vocab = ours.shape[-1]
            torch.testing.assert_close(
                ours,
                ref["logits"][kind][:, rank * vocab : (rank + 1) * vocab],
                **TOL[torch.float32],
                msg=f"rank {rank}: {kind} logit shard differs at TP = 2",
            )
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
def test_hf_import_tp2_logits_match_transformers(tmp_path):
    ref = {"samples": {}, "logits": {}}
    for kind, tie in (("llama", False), ("qwen2", True)):
        hf = save_tiny_hf_model(kind, tmp_path / kind, tie=tie, shard=True)
        ref["samples"][kind] = _samples(hf.config.vocab_size)
        ref["logits"][kind] = hf_logits(hf, ref["samples"][kind])
    torch.save(ref, tmp_path / "ref.pt")
    # Errors inside a worker are raised here, with the worker's traceback.
    mp.spawn(_tp2_worker, args=(str(tmp_path),), nprocs=2, join=True)
