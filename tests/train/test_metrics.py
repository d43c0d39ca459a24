"""Per-adapter metrics of a tiny CPU run: metrics.jsonl lines and TensorBoard loss series."""

import json

import pytest
from eval_testing import eval_job

from megatron_lorafusion.train.main import main
from megatron_lorafusion.train.metrics import read_metrics

STEPS = 4


def _job(tmp_path, **train):
    adapters = [{"task": "sort", "global_batch_size": 4}, {"task": "add", "global_batch_size": 3}]
    return eval_job(tmp_path, adapters, STEPS, seed=3, **{"eval_every": 2, **train})


def test_metrics_jsonl_and_tensorboard_per_adapter(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses = main(_job(tmp_path))
    out = tmp_path / "out"
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for name, curve in losses.items():
        steps = [r for r in lines if r["adapter"] == name and "loss" in r]
        assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), f"{name}: {steps}"
        assert [r["loss"] for r in steps] == pytest.approx(curve), f"{name}: losses differ"
        for r in steps:
            for key in ("lr", "grad_norm", "tokens", "tokens_per_s"):
                assert r[key] > 0, f"{key} must be positive: {r}"
            assert r["gpu_mem_gib"] == 0.0, r
        evals = [r["step"] for r in lines if r["adapter"] == name and "eval_loss" in r]
        assert evals == [2, 4], f"{name}: eval_every=2 over {STEPS} steps, got {evals}"
    assert len(read_metrics(out)) == len(lines), "one run: no repeated records"

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for name, curve in losses.items():
        assert f"loss/{name}" in tags, tags
        assert f"eval_loss/{name}" in tags, tags
        values = [e.value for e in acc.Scalars(f"loss/{name}")]
        assert values == pytest.approx(curve), f"{name}: TensorBoard loss series differs"
