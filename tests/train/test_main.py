"""Training end to end on the CPU: losses fall, checkpoints and PEFT folders are written."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from megatron_lorafusion.config import load_config
from megatron_lorafusion.data import write_task
from megatron_lorafusion.train import load_adapter_checkpoint
from megatron_lorafusion.train.main import main

REPO = Path(__file__).resolve().parents[2]


def _mean(values):
    return sum(values) / len(values)


def test_train_two_adapters_losses_fall_and_exports(tmp_path):
    tasks = {"sort": 4, "add": 8}
    adapters = []
    for task, rank in tasks.items():
        path = write_task(task, tmp_path / f"{task}.jsonl", 200, seed=1)
        adapters.append({"name": task, "rank": rank, "alpha": 16, "dropout": 0.1, "lr": 1e-2,
                         "global_batch_size": 8, "dataset": {"path": str(path)}})
    job = {"model": {"preset": "tiny", "num_layers": 1}, "adapters": adapters,
           "data": {"max_seq_length": 64}, "planner": {"token_capacity": 256},
           "train": {"steps": 30, "device": "cpu", "output_dir": str(tmp_path / "out"),
                     "save_every": 10},
           "logging": {"progress_bar": False}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    losses = main(load_config(tmp_path / "job.yaml"))

    for name, curve in losses.items():
        assert len(curve) == 30, f"{name} took {len(curve)} steps, expected 30"
        assert _mean(curve[-5:]) < 0.85 * _mean(curve[:5]), f"{name} loss did not fall: {curve}"
    out = tmp_path / "out"
    ckpt = load_adapter_checkpoint(out / "checkpoints" / "add" / "step_000020.pt")
    assert ckpt["step"] == 20
    assert ckpt["losses"] == pytest.approx(losses["add"][:20])
    config = json.loads((out / "adapters" / "sort" / "adapter_config.json").read_text())
    assert config["r"] == 4
    tensors = load_file(str(out / "adapters" / "add" / "adapter_model.safetensors"))
    b = tensors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    assert b.shape == (128, 8)
    assert torch.count_nonzero(b) > 0, "trained B must have moved away from zero"


@pytest.mark.slow
def test_train_demo_config_each_adapter_loss_falls_30_percent(tmp_path, monkeypatch):
    """The README's demo: four adapters, each loss at least 30% below its first steps."""
    monkeypatch.chdir(tmp_path)
    for task in ("reverse", "sort", "add", "upper"):
        write_task(task, tmp_path / "runs/demo/data" / f"{task}.jsonl", 2000)
    losses = main(load_config(REPO / "configs" / "demo.yaml", ["logging.progress_bar=false"]))
    for name, curve in losses.items():
        first, last = _mean(curve[:5]), _mean(curve[-5:])
        assert last < 0.7 * first, f"{name}: loss {first:.3f} -> {last:.3f}, less than 30% drop"
    for name in losses:
        assert (tmp_path / "runs/demo/adapters" / name / "adapter_model.safetensors").is_file()
