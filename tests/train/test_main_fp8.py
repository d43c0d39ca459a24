"""A job with ``model.base_precision: fp8`` on the CPU: it runs the fake-quant reference of
the FP8 linears (the path the kernels are checked against) and its adapters learn."""

import importlib
import json

import yaml

from megatron_lorafusion.config import load_config
from megatron_lorafusion.data import write_task
from megatron_lorafusion.train.main import main

# The module (the package re-exports a function of the same name).
fp8_linear_module = importlib.import_module("megatron_lorafusion.ops.fp8_linear")


def _mean(values):
    return sum(values) / len(values)


def test_train_fp8_base_on_cpu_runs_the_reference_and_learns(tmp_path, monkeypatch):
    calls = []
    reference = fp8_linear_module.fp8_linear_ref

    def counted(*args, **kwargs):
        calls.append(1)
        return reference(*args, **kwargs)

    monkeypatch.setattr(fp8_linear_module, "fp8_linear_ref", counted)
    path = write_task("sort", tmp_path / "sort.jsonl", 200, seed=1)
    job = {
        "model": {"preset": "tiny", "num_layers": 1, "base_precision": "fp8"},
        "adapters": [
            {
                "name": "sort",
                "rank": 8,
                "alpha": 16,
                "lr": 1e-2,
                "global_batch_size": 8,
                "dataset": {"path": str(path)},
            }
        ],
        "data": {"max_seq_length": 64},
        "planner": {"token_capacity": 256},
        "train": {"steps": 20, "device": "cpu", "output_dir": str(tmp_path / "out")},
        "logging": {"progress_bar": False},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    losses = main(load_config(tmp_path / "job.yaml"))["sort"]
    assert calls, "the FP8 linears must run their torch reference on CPU"
    assert len(losses) == 20
    assert _mean(losses[-5:]) < 0.85 * _mean(losses[:5]), f"loss did not fall: {losses}"
    resolved = json.loads((tmp_path / "out" / "job.json").read_text())
    assert resolved["model"]["base_precision"] == "fp8"
