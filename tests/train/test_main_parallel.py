"""`torchrun ... -m megatron_lorafusion train` at DP = 2, TP = 2 and PP = 2 against one process.

One job, evaluated every step with early stopping, gradient clipping and dropout: DP = 2 and
TP = 2 (sequence parallelism on, the default: microbatches padded to even lengths,
Megatron's SP collectives on gloo) run the one-process plan; PP = 2 plans for two stages
(another stream) with full activation recompute. An adapter's training does not depend on
how its samples are packed (DESIGN.md "Every adapter on its own"), so every layout evaluates,
stops and exports as one process does, up to fp32 summation order.
"""

import json

import pytest
import torch
import yaml
from dist_testing import torchrun_train
from eval_testing import eval_job
from safetensors.torch import load_file

from megatron_lorafusion.config import load_config
from megatron_lorafusion.train.checkpoint import full_adapter_tensors
from megatron_lorafusion.train.export import write_peft_folder
from megatron_lorafusion.train.main import main

# dtype -> tolerances; DP only splits fp32 sums over samples.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5)}
# TP = 2 splits fp32 sums over H and vocab, PP = 2 packs other microbatches (another fp32
# summation order of each gradient); after 3 AdamW steps at lr 1e-2 (AdamW scales
# near-zero gradients up to ~lr) exports differ from one process by up to 4.2e-5 (TP, the
# same with and without sequence parallelism) and 1.2e-5 (PP). (Shared-plan TP equality
# at 1e-5 is `tests/pipeline/test_runner.py`'s, on a smaller model.)
TP_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4)}


def _exported(tmp_path, out: str, name: str) -> dict:
    return load_file(str(tmp_path / out / "adapters" / name / "adapter_model.safetensors"))


def _evals(out) -> dict[str, list[tuple[int, float]]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if "eval_loss" in r:
            evals.setdefault(r["adapter"], []).append((r["step"], r["eval_loss"]))
    return evals


@pytest.mark.slow
def test_torchrun_dp2_tp2_and_pp2_train_evaluate_and_export_as_one_process(tmp_path):
    """One job at DP = 2, TP = 2 (sequence parallel) and PP = 2 (full recompute, so each
    recomputed layer must restore its own microbatch's layout and dropout masks, which 1F1B
    interleaves) against one process: the same eval steps and losses, the same early stop,
    the same exports, gradient clipping and dropout included. PP = 2 also exports the best
    weights its two stages saved."""
    # "wild" steps at lr 1.0: its eval loss rises after its first step, so it stops early.
    adapters = [
        {"task": "sort", "lr_schedule": "constant", "global_batch_size": 4, "dropout": 0.1},
        {
            "task": "add",
            "name": "wild",
            "rank": 6,
            "lr": 1.0,
            "lr_schedule": "constant",
            "global_batch_size": 4,
            "dropout": 0.0,
            "early_stopping_patience": 1,
        },
        {"task": "upper", "rank": 8, "global_batch_size": 2, "dropout": 0.1},
    ]
    for adapter in (adapters[0], adapters[2]):
        adapter["max_grad_norm"] = 0.5  # clips: the norm spans every rank's factors
    eval_job(tmp_path, adapters, 4, seed=4, eval_every=1)
    raw = yaml.safe_load((tmp_path / "job.yaml").read_text())
    raw["model"] = {"preset": "tiny", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128}
    jobs = {}
    layouts = {
        "one": ({}, "selective"),
        "dp2": ({}, "selective"),
        "tp2": ({"tp": 2}, "selective"),
        "pp2": ({"pp": 2}, "full"),
    }
    for out, (parallel, recompute) in layouts.items():
        raw["train"]["output_dir"] = str(tmp_path / out)
        raw["train"]["recompute"] = recompute
        raw["parallel"] = parallel
        jobs[out] = tmp_path / f"{out}.yaml"
        jobs[out].write_text(yaml.safe_dump(raw))
    main(load_config(jobs["one"]))
    for out in ("dp2", "tp2", "pp2"):
        torchrun_train(str(jobs[out]))
    one = _evals(tmp_path / "one")
    assert len(one["wild"]) < 4, f"wild must stop early in one process: {one['wild']}"
    assert [s for s, _ in one["sort"]] == [1, 2, 3, 4], one["sort"]
    for out, tol in (("dp2", TOL), ("tp2", TP_TOL), ("pp2", TP_TOL)):
        evals = _evals(tmp_path / out)
        for name, expected in one.items():
            assert [s for s, _ in evals[name]] == [s for s, _ in expected], f"{out} {name}"
            assert [v for _, v in evals[name]] == pytest.approx(
                [v for _, v in expected], rel=tol[torch.float32]["rtol"]
            ), f"{name}: {out} eval losses != one process"
            theirs = _exported(tmp_path, out, name)
            ours = _exported(tmp_path, "one", name)
            assert theirs.keys() == ours.keys(), f"{out} {name}: keys differ"
            for key, value in ours.items():
                torch.testing.assert_close(
                    theirs[key],
                    value,
                    **tol[torch.float32],
                    msg=f"{name} {key}: {out} export != one process",
                )
    pp2 = _evals(tmp_path / "pp2")
    best_step = min(pp2["wild"], key=lambda e: e[1])[0]
    folder = tmp_path / "pp2" / "checkpoints" / "wild" / f"step_{best_step:08d}"
    assert sorted(p.name for p in folder.glob("*.json")) == [
        "shard_tp0_pp0.json",
        "shard_tp0_pp1.json",
    ], "each stage saves its part of the best step"
    best = full_adapter_tensors(folder, "wild")
    cfg = load_config(jobs["pp2"])
    write_peft_folder(tmp_path / "ref", cfg.adapters[1], best, cfg.model)
    expected = load_file(str(tmp_path / "ref" / "adapter_model.safetensors"))
    exported = _exported(tmp_path, "pp2", "wild")
    assert exported.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(exported[key], value), f"PP = 2 exported {key} is not the best"
