"""PEFT export: Hugging Face names and shapes, fused projections split, peft and merge agree."""

import json

import pytest
import torch
from model_testing import MCORE_MODEL as MODEL  # 4 heads of 16 in 2 groups
from safetensors.torch import load_file
from save_testing import every_checkpoint_written

from megatron_lorafusion.config import FUSED_LINEARS, AdapterConfig
from megatron_lorafusion.train import peft_state_dict, write_peft_folder

HEAD = MODEL.hidden_size // MODEL.num_attention_heads
QKV_OUT = (MODEL.num_attention_heads + 2 * MODEL.num_query_groups) * HEAD
# dtype -> tolerances of the same LoRA model in Megatron and in transformers/peft (issue 6).
TOL_LOGITS = {torch.float32: dict(atol=1e-4, rtol=1e-4)}
LENGTHS = (9, 14, 11, 6)  # samples of adapters 0, 0, 1, 1 in one packed microbatch


def _megatron_state(rank):
    state = {}
    outs = {
        "self_attention.linear_qkv": (MODEL.hidden_size, QKV_OUT),
        "self_attention.linear_proj": (MODEL.hidden_size, MODEL.hidden_size),
        "mlp.linear_fc1": (MODEL.hidden_size, 2 * MODEL.ffn_hidden_size),
        "mlp.linear_fc2": (MODEL.ffn_hidden_size, MODEL.hidden_size),
    }
    for layer in range(MODEL.num_layers):
        for module, (fan_in, fan_out) in outs.items():
            state[f"decoder.layers.{layer}.{module}.lora_A"] = torch.randn(rank, fan_in)
            state[f"decoder.layers.{layer}.{module}.lora_B"] = torch.randn(fan_out, rank)
    return state


def test_export_names_and_shapes():
    rank = 4
    out = peft_state_dict(_megatron_state(rank), MODEL, list(FUSED_LINEARS))
    prefix = "base_model.model.model.layers.1"
    shapes = {
        "self_attn.q_proj": (64, 64),
        "self_attn.k_proj": (32, 64),
        "self_attn.v_proj": (32, 64),
        "self_attn.o_proj": (64, 64),
        "mlp.gate_proj": (176, 64),
        "mlp.up_proj": (176, 64),
        "mlp.down_proj": (64, 176),
    }
    for module, (fan_out, fan_in) in shapes.items():
        assert out[f"{prefix}.{module}.lora_A.weight"].shape == (rank, fan_in), module
        assert out[f"{prefix}.{module}.lora_B.weight"].shape == (fan_out, rank), module
    assert len(out) == MODEL.num_layers * len(shapes) * 2


def test_export_splits_grouped_qkv_rows():
    state = _megatron_state(2)
    b = state["decoder.layers.0.self_attention.linear_qkv.lora_B"]
    out = peft_state_dict(state, MODEL, list(FUSED_LINEARS))
    q = out["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    k = out["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    # Group g's rows are [q head 2g | q head 2g+1 | k head g | v head g], 16 rows each.
    torch.testing.assert_close(q[16:32], b[16:32], msg="query head 1 sits in group 0")
    torch.testing.assert_close(q[32:48], b[64:80], msg="query head 2 opens group 1")
    torch.testing.assert_close(k[16:32], b[96:112], msg="key head 1 follows group 1's queries")


def test_export_folder_is_loadable_by_peft(tmp_path):
    transformers = pytest.importorskip("transformers", reason="dev extra: transformers")
    peft = pytest.importorskip("peft", reason="dev extra: peft")
    adapter = AdapterConfig(name="x", rank=4, alpha=8, dropout=0.1)
    folder = write_peft_folder(tmp_path / "x", adapter, _megatron_state(4), MODEL)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4
    assert config["lora_alpha"] == 8
    base = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=MODEL.vocab_size,
            hidden_size=MODEL.hidden_size,
            intermediate_size=MODEL.ffn_hidden_size,
            num_hidden_layers=MODEL.num_layers,
            num_attention_heads=MODEL.num_attention_heads,
            num_key_value_heads=MODEL.num_query_groups,
        )
    )
    model = peft.PeftModel.from_pretrained(base, str(folder))
    saved = load_file(str(folder / "adapter_model.safetensors"))
    loaded = peft.get_peft_model_state_dict(model)
    assert set(loaded) == set(saved), "peft must find every exported tensor, and no other"
    for name, tensor in saved.items():
        torch.testing.assert_close(loaded[name], tensor, msg=f"{name} changed on load")


def test_export_trained_adapters_match_peft_and_merged_logits(tmp_path, monkeypatch):
    """Train two adapters on an imported tiny Llama, export with the CLI, reload with peft."""
    transformers = pytest.importorskip("transformers", reason="dev extra: transformers")
    peft = pytest.importorskip("peft", reason="dev extra: peft")
    import yaml
    from hf_testing import exported_states, hf_logits, save_tiny_hf_model, trained_lora_logits

    from megatron_lorafusion.cli import main as cli_main
    from megatron_lorafusion.config import load_config
    from megatron_lorafusion.data import write_task
    from megatron_lorafusion.train.main import main as train_main

    base = tmp_path / "base"
    save_tiny_hf_model("llama", base)
    adapters = []
    for task, rank, targets in (("sort", 4, None), ("add", 2, ["linear_qkv", "linear_fc1"])):
        path = write_task(task, tmp_path / f"{task}.jsonl", 40, seed=1)
        adapters.append(
            {
                "name": task,
                "rank": rank,
                "alpha": 8,
                "dropout": 0.1,
                "lr": 2e-2,
                "global_batch_size": 4,
                "dataset": {"path": str(path)},
                **({"target_modules": targets} if targets else {}),
            }
        )
    job = {
        "model": {"hf_path": str(base)},
        "adapters": adapters,
        "data": {"tokenizer": "byte", "max_seq_length": 48},
        "planner": {"solver": "greedy", "token_capacity": 96},
        "train": {
            "steps": 4,
            "device": "cpu",
            "output_dir": str(tmp_path / "run"),
            "save_every": 2,
        },
        "logging": {"progress_bar": False},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    cfg = load_config(tmp_path / "job.yaml")
    states = exported_states(monkeypatch)
    every_checkpoint_written(monkeypatch)  # step 2's checkpoint is read below
    train_main(cfg)
    assert cli_main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "x"), "--merge"]) == 0
    newest = tmp_path / "run" / "checkpoints" / "add" / "step_00000002"
    assert (
        cli_main(["export", str(newest), "--out", str(tmp_path / "y"), "--adapters", "add"]) == 0
    ), "one checkpoint folder, one adapter"
    assert sorted(p.name for p in (tmp_path / "y").iterdir()) == [".lorafusion-export.json", "add"]

    ours = trained_lora_logits(cfg, states, LENGTHS)
    samples = [ours["ids"][sl] for sl in ours["slices"]]
    for a, adapter in enumerate(cfg.adapters):
        expected = torch.cat(
            [
                ours["logits"][sl]
                for sl, owner in zip(ours["slices"], ours["owners"], strict=True)
                if owner == a
            ]
        )
        mine = [s for s, owner in zip(samples, ours["owners"], strict=True) if owner == a]
        assert (expected - hf_logits(_fresh(transformers, base), mine)).abs().max() > 1e-3, (
            f"{adapter.name}: training must have moved the logits"
        )
        with_peft = peft.PeftModel.from_pretrained(
            _fresh(transformers, base), str(tmp_path / "x" / adapter.name)
        ).eval()
        torch.testing.assert_close(
            hf_logits(with_peft, mine),
            expected,
            **TOL_LOGITS[torch.float32],
            msg=f"{adapter.name}: peft logits differ from ours",
        )
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "x" / f"{adapter.name}-merged")
        ).eval()
        torch.testing.assert_close(
            hf_logits(merged, mine),
            expected,
            **TOL_LOGITS[torch.float32],
            msg=f"{adapter.name}: merged logits differ from ours",
        )


def _fresh(transformers, base):
    return transformers.LlamaForCausalLM.from_pretrained(str(base)).eval()


def test_export_refuses_non_finite_weights_and_writes_nothing(tmp_path):
    from megatron_lorafusion.train.export import ExportError

    state = _megatron_state(2)
    state["decoder.layers.1.mlp.linear_fc2.lora_B"][3, 1] = float("nan")
    with pytest.raises(ExportError, match="adapter 'x' has NaN or infinite weights"):
        write_peft_folder(tmp_path / "x", AdapterConfig(name="x", rank=2), state, MODEL)
    assert list(tmp_path.iterdir()) == [], "a refused export must write nothing"


def test_export_refuses_unsafe_adapter_name_of_an_old_run(tmp_path):
    """A job.json written before names were checked never becomes a path outside --out."""
    from dataclasses import asdict

    from megatron_lorafusion.config import JobConfig
    from megatron_lorafusion.train import export_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    job = asdict(JobConfig(adapters=[AdapterConfig(name="../../escape")]))
    (run / "job.json").write_text(json.dumps(job))
    with pytest.raises(ValueError, match=r"adapters\.0\.name must be 1 to 100 letters"):
        export_checkpoint(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not (tmp_path.parent / "escape").exists()
