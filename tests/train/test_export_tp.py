"""Per-projection adapters trained at TP = 2 (torchrun, gloo) export what peft reproduces.

Each TP rank holds its query groups and [gate | up] halves of the stacked, block-diagonal B;
the checkpoint's shards merge into one block layout whose export peft loads onto the tiny
Llama, with our logits (the merged factors in our TP = 1 model) to 1e-4.
"""

import pytest
import torch
import yaml
from dist_testing import torchrun_train
from hf_testing import hf_logits, save_tiny_hf_model, trained_lora_logits
from test_export import LENGTHS, TOL_LOGITS, _fresh

from megatron_lorafusion.config import load_config
from megatron_lorafusion.data import write_task
from megatron_lorafusion.train.checkpoint import full_adapter_tensors

transformers = pytest.importorskip("transformers", reason="dev extra: transformers")
peft = pytest.importorskip("peft", reason="dev extra: peft")


@pytest.mark.slow
def test_tp2_per_projection_adapters_export_what_peft_reproduces(tmp_path):
    base = tmp_path / "base"
    save_tiny_hf_model("llama", base)
    adapters = []
    for task, keys in (
        ("sort", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
        ("add", dict(r=2, lora_alpha=4, target_modules=["up_proj", "gate_proj", "o_proj"])),
    ):
        path = write_task(task, tmp_path / f"{task}.jsonl", 24, seed=1)
        adapters.append(
            {
                "name": task,
                "lr": 2e-2,
                "global_batch_size": 3,
                "dataset": {"path": str(path)},
                **keys,
            }
        )
    job = {
        "model": {"hf_path": str(base)},
        "adapters": adapters,
        "data": {"tokenizer": "byte", "max_seq_length": 48},
        "planner": {"token_capacity": 96},
        "parallel": {"tp": 2},
        "train": {
            "steps": 2,
            "device": "cpu",
            "output_dir": str(tmp_path / "run"),
        },
        "logging": {"progress_bar": False},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    torchrun_train(tmp_path / "job.yaml")

    cfg = load_config(tmp_path / "job.yaml")
    newest = tmp_path / "run" / "checkpoints" / cfg.adapters[0].name / "step_00000002"
    assert sorted(p.name for p in newest.glob("*.json")) == [
        "shard_tp0_pp0.json",
        "shard_tp1_pp0.json",
    ], "one shard per TP rank"
    states = {  # a run of several shards keeps its last step's checkpoint: the export's source
        a.name: full_adapter_tensors(
            tmp_path / "run" / "checkpoints" / a.name / "step_00000002", a.name
        )
        for a in cfg.adapters
    }
    ours = trained_lora_logits(cfg, states, LENGTHS)
    samples = [ours["ids"][sl] for sl in ours["slices"]]
    for a, adapter in enumerate(cfg.adapters):
        mine = [s for s, owner in zip(samples, ours["owners"], strict=True) if owner == a]
        expected = torch.cat(
            [
                ours["logits"][sl]
                for sl, owner in zip(ours["slices"], ours["owners"], strict=True)
                if owner == a
            ]
        )
        assert (expected - hf_logits(_fresh(transformers, base), mine)).abs().max() > 1e-3, (
            f"{adapter.name}: training must have moved the logits"
        )
        with_peft = peft.PeftModel.from_pretrained(
            _fresh(transformers, base), str(tmp_path / "run" / "adapters" / adapter.name)
        ).eval()
        torch.testing.assert_close(
            hf_logits(with_peft, mine),
            expected,
            **TOL_LOGITS[torch.float32],
            msg=f"{adapter.name}: peft logits differ from ours (TP = 2)",
        )
