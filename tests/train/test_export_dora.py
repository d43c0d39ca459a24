"""DoRA adapters (use_dora) export what PEFT loads, and PEFT reproduces our logits and grads.

On an imported tiny Llama / Qwen2 / Qwen3 / Gemma 3 (Qwen2's q/k/v biases stay outside
DoRA's scale, as in PEFT), DoRA adapters on the fused linears (one ``A`` shared by q, k and
v), on all-linear and on q/v, next to a plain LoRA q/v adapter, run in one packed
microbatch. Each export has exactly PEFT's DoRA keys (``lora_magnitude_vector`` per module)
and ``use_dora: true``; PEFT, loading it, gives our logits and the gradients of every A, B
and magnitude; the merged checkpoint gives our logits too. Dropout 0: with dropout PEFT also
drops the base term's input (docs/adapters.md).
"""

import json

import pytest
import torch
from hf_testing import save_tiny_hf_model
from test_export_projections import _fresh, _hf_targets, check_exports_against_peft

from megatron_lorafusion.config import AdapterConfig

transformers = pytest.importorskip("transformers", reason="dev extra: transformers")
peft = pytest.importorskip("peft", reason="dev extra: peft")

ADAPTERS = [
    AdapterConfig(name="dora", rank=4, alpha=8.0, use_dora=True),
    AdapterConfig(
        name="dora_all",
        rank=2,
        alpha=4.0,
        use_rslora=True,
        use_dora=True,
        target_modules=["all-linear"],
    ),
    AdapterConfig(
        name="dora_qv", rank=3, alpha=6.0, use_dora=True, target_modules=["q_proj", "v_proj"]
    ),
    AdapterConfig(name="lora_qv", rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"]),
]
OWNERS, LENGTHS = [0, 1, 1, 2, 3, 3], [8, 6, 9, 7, 5, 6]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3"])
def test_dora_matches_peft_logits_grads_and_merge(megatron_single_process, tmp_path, kind):
    def check_config(adapter, config):
        assert config["use_dora"] is adapter.use_dora, adapter.name

    check_exports_against_peft(tmp_path, kind, ADAPTERS, OWNERS, LENGTHS, check_config)


def test_train_main_mixed_lora_dora_loraplus_job_exports_what_peft_loads(tmp_path, monkeypatch):
    """One run on an imported tiny Llama (CPU): LoRA on q/v (PEFT's names), DoRA on all
    linears (with dropout), LoRA+ on the MLP; each export loads in peft with no missing or
    unexpected keys and gives our logits."""
    import yaml
    from hf_testing import exported_states, hf_logits, trained_lora_logits
    from safetensors.torch import load_file
    from test_export import TOL_LOGITS

    from megatron_lorafusion.config import load_config
    from megatron_lorafusion.data import write_task
    from megatron_lorafusion.train.main import main as train_main

    base = tmp_path / "base"
    save_tiny_hf_model("llama", base)
    adapters = []
    for task, keys in (
        ("sort", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
        (
            "add",
            dict(r=2, lora_alpha=4, lora_dropout=0.1, use_dora=True, target_modules="all-linear"),
        ),
        (
            "upper",
            dict(
                rank=3,
                alpha=6,
                loraplus_lr_ratio=16,
                target_modules=["gate_proj", "up_proj", "down_proj"],
            ),
        ),
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
        "train": {"steps": 3, "device": "cpu", "output_dir": str(tmp_path / "run")},
        "logging": {"progress_bar": False},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    cfg = load_config(tmp_path / "job.yaml")
    states = exported_states(monkeypatch)
    train_main(cfg)

    lengths, owners = (9, 7, 11, 6, 8, 5), (0, 0, 1, 1, 2, 2)
    ours = trained_lora_logits(cfg, states, lengths, owners)
    hf_base = _fresh(base)
    for a, adapter in enumerate(cfg.adapters):
        folder = tmp_path / "run" / "adapters" / adapter.name
        config = json.loads((folder / "adapter_config.json").read_text())
        assert (config["use_dora"], config["target_modules"]) == (
            adapter.use_dora,
            _hf_targets(adapter),
        ), adapter.name
        saved = load_file(str(folder / "adapter_model.safetensors"))
        model = peft.PeftModel.from_pretrained(_fresh(base), str(folder)).eval()
        loaded = peft.get_peft_model_state_dict(model)
        assert loaded.keys() == saved.keys(), f"{adapter.name}: missing or unexpected keys"
        for name, tensor in saved.items():
            torch.testing.assert_close(
                loaded[name], tensor, atol=0, rtol=0, msg=f"{adapter.name}: {name} changed on load"
            )
        assert all(saved[n].any() for n in saved if "lora_B" in n), f"{adapter.name}: B = 0"
        for n in (n for n in saved if n.endswith("lora_magnitude_vector")):
            module = n.removeprefix("base_model.model.").removesuffix(".lora_magnitude_vector")
            init = hf_base.get_submodule(module).weight.norm(dim=1)  # DoRA's m at step 0
            assert not torch.allclose(saved[n], init), f"{adapter.name}: {n} untrained"
        mine = [i for i, owner in enumerate(owners) if owner == a]
        expected = torch.cat([ours["logits"][ours["slices"][i]] for i in mine])
        samples = [ours["ids"][ours["slices"][i]] for i in mine]
        torch.testing.assert_close(
            hf_logits(model, samples),
            expected,
            **TOL_LOGITS[torch.float32],
            msg=f"{adapter.name}: peft logits differ from ours",
        )
