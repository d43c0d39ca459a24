"""Per-adapter metrics of a tiny CPU run: metrics.jsonl lines and TensorBoard loss series."""

import json

import pytest
from eval_testing import eval_job

from megatron_lorafusion.train.main import main, prepare_problem
from megatron_lorafusion.train.metrics import job_summary, plan_summary, read_metrics

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
    runs = [r for r in lines if r["adapter"] is None]
    assert len(runs) == 1, f"one run-wide record at the end: {runs}"
    assert runs[0]["microbatches"] > 0, runs
    assert runs[0]["tokens_per_s"] > 0, runs
    assert 0 < runs[0]["fill"] <= 1, runs
    for key in ("startup_s", "first_step_s", "train_s", "train_tokens_per_s", "end_s"):
        assert runs[0][key] > 0, f"where the time went: {key} missing or 0 in {runs[0]}"
    assert "peak_gpu_gib" not in runs[0], "a CPU run records no GPU memory peak"
    phases = runs[0]["startup_phases_s"]  # in this process: no launch phase; CPU: no CUDA
    assert list(phases) == [
        "reading data",
        "importing Megatron",
        "process groups",
        "building the model",
        "resuming",
        "admitting (saves' staging memory pinned)",
        "planning and the first batch",
    ], phases
    assert all(v >= 0 for v in phases.values()), phases
    assert sum(phases.values()) == pytest.approx(runs[0]["startup_s"], abs=1e-3), phases

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for name, curve in losses.items():
        assert f"loss/{name}" in tags, tags
        assert f"eval_loss/{name}" in tags, tags
        values = [e.value for e in acc.Scalars(f"loss/{name}")]
        assert values == pytest.approx(curve), f"{name}: TensorBoard loss series differs"


def test_job_summary_and_plan_summary_name_the_job(tmp_path):
    from megatron_lorafusion.data import load_tokenizer
    from megatron_lorafusion.planner import plan_microbatches
    from megatron_lorafusion.train.main import make_jobs

    cfg = _job(tmp_path)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
    jobs = make_jobs(cfg, cfg.adapters, tokenizer)
    problem = prepare_problem(cfg, jobs)
    text = job_summary(cfg, jobs, world_size=1)
    assert "preset tiny" in text, text
    assert "tp 1 x pp 1 x dp 1" in text, text
    assert f"token capacity {cfg.planner.token_capacity}" in text, text
    assert str(cfg.train.output_dir) in text, text
    for a, adapter in enumerate(cfg.adapters):
        row = next(line for line in text.splitlines() if line.startswith(adapter.name))
        assert row.split()[1:] == [
            str(adapter.rank),
            f"{adapter.alpha:g}",
            f"{adapter.dropout:g}",
            f"{adapter.lr:.1e}",
            str(adapter.global_batch_size),
            str(len(problem.lengths[a])),
            str(STEPS),
        ], row
    plan = plan_microbatches(problem, solver="greedy")
    line = plan_summary(plan, problem, first_chunk=False)
    assert line.startswith(f"plan (whole): {len(plan.microbatches)} microbatches"), line
    assert "fill" in line, line
    assert "simulated bubble" in line, line
