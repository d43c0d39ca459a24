"""Qwen3 and Gemma 3 end to end: train on a tiny checkpoint, export, reload with peft.

For a ``Qwen3ForCausalLM`` (head size 24, not hidden / heads), a tied ``Gemma3ForCausalLM``
(sliding window of 4 tokens on two of three layers, shorter than every sample) and a
``Gemma3ForConditionalGeneration`` (its text model; a vision tower beside it): two adapters
(fused targets with dropout, and per-projection ``all-linear``) train a few steps through
``train.main``; the CLI exports them with ``--merge``. PEFT loading each export gives our
logits, the merged checkpoint gives them too, and it equals PEFT's ``merge_and_unload``.
"""

import json

import pytest
import torch
import yaml
from hf_testing import exported_states, hf_logits, save_tiny_hf_model, trained_lora_logits

transformers = pytest.importorskip("transformers", reason="dev extra: transformers")
peft = pytest.importorskip("peft", reason="dev extra: peft")

# dtype -> tolerances of the same LoRA model in Megatron and in transformers/peft (issue 6).
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4)}
# merged weights: ours (W + s·B·A in fp32) against PEFT's merge_and_unload, both fp32
MERGE_TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6)}
LENGTHS, OWNERS = (9, 14, 11, 6), (0, 0, 1, 1)


def _fresh(base):
    config = transformers.AutoConfig.from_pretrained(str(base))
    model_cls = getattr(transformers, config.architectures[0])
    return model_cls.from_pretrained(str(base)).eval()


def _train_and_export(tmp_path, kind: str, tie: bool, monkeypatch):
    from megatron_lorafusion.cli import main as cli_main
    from megatron_lorafusion.config import load_config
    from megatron_lorafusion.data import write_task
    from megatron_lorafusion.train.main import main as train_main

    base = tmp_path / "base"
    save_tiny_hf_model(kind, base, tie=tie)
    adapters = []
    for task, rank, extra in (
        ("sort", 4, {"dropout": 0.1}),
        ("add", 2, {"target_modules": "all-linear"}),
    ):
        path = write_task(task, tmp_path / f"{task}.jsonl", 24, seed=1)
        adapters.append(
            {
                "name": task,
                "rank": rank,
                "alpha": 8,
                "lr": 2e-2,
                "global_batch_size": 4,
                "dataset": {"path": str(path)},
                **extra,
            }
        )
    job = {
        "model": {"hf_path": str(base)},
        "adapters": adapters,
        "data": {"tokenizer": "byte", "max_seq_length": 48},
        "planner": {"solver": "greedy", "token_capacity": 96},
        "train": {"steps": 3, "device": "cpu", "output_dir": str(tmp_path / "run")},
        "logging": {"progress_bar": False},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    cfg = load_config(tmp_path / "job.yaml")
    states = exported_states(monkeypatch)
    train_main(cfg)
    out = tmp_path / "x"
    assert cli_main(["export", str(tmp_path / "run"), "--out", str(out), "--merge"]) == 0
    return base, cfg, out, states


@pytest.mark.parametrize(("kind", "tie"), [("qwen3", False), ("gemma3", True), ("gemma3-mm", True)])
def test_trained_family_adapters_match_peft_merge_and_unload(tmp_path, kind, tie, monkeypatch):
    base, cfg, out, states = _train_and_export(tmp_path, kind, tie, monkeypatch)
    assert cfg.model.family == kind.removesuffix("-mm")
    ours = trained_lora_logits(cfg, states, LENGTHS, OWNERS)
    samples = [ours["ids"][sl] for sl in ours["slices"]]
    for a, adapter in enumerate(cfg.adapters):
        rows = [sl for sl, owner in zip(ours["slices"], OWNERS, strict=True) if owner == a]
        expected = torch.cat([ours["logits"][sl] for sl in rows])
        mine = [s for s, owner in zip(samples, OWNERS, strict=True) if owner == a]
        assert (expected - hf_logits(_fresh(base), mine)).abs().max() > 1e-3, (
            f"{kind} {adapter.name}: training must have moved the logits"
        )
        config = json.loads((out / adapter.name / "adapter_config.json").read_text())
        with_peft = peft.PeftModel.from_pretrained(_fresh(base), str(out / adapter.name)).eval()
        lora_modules = [n for n, _ in with_peft.named_modules() if n.endswith(".lora_A")]
        if kind == "gemma3-mm":  # the text model's projections only, not the vision tower's
            assert isinstance(config["target_modules"], str), config["target_modules"]
            assert lora_modules, "peft adapted no module"
            assert all(".language_model.layers." in n for n in lora_modules), lora_modules
        torch.testing.assert_close(
            hf_logits(with_peft, mine),
            expected,
            **TOL[torch.float32],
            msg=f"{kind} {adapter.name}: peft logits differ from ours",
        )
        merged = _fresh(out / f"{adapter.name}-merged")
        torch.testing.assert_close(
            hf_logits(merged, mine),
            expected,
            **TOL[torch.float32],
            msg=f"{kind} {adapter.name}: merged logits differ from ours",
        )
        unloaded = with_peft.merge_and_unload().state_dict()
        merged_state = merged.state_dict()
        assert unloaded.keys() == merged_state.keys()
        for name, tensor in unloaded.items():
            torch.testing.assert_close(
                merged_state[name],
                tensor,
                **MERGE_TOL[torch.float32],
                msg=f"{kind} {adapter.name}: --merge != merge_and_unload at {name}",
            )
