"""`torchrun ... -m megatron_lorafusion train` at DP = 2, TP = 2 and PP = 2 against one process.

DP = 2 and TP = 2 (sequence parallelism on, the default: microbatches padded to even
lengths, Megatron's SP collectives on gloo) run the one-process plan, so their exported
weights must match, gradient clipping included (its norm spans the replicas' summed
gradients and the TP shards); PP = 2 plans for two stages (another stream), and since an
adapter's training does not depend on how its samples are packed (DESIGN.md "Every adapter on
its own"), it exports the same weights too, up to fp32 summation order. At PP = 2, full
activation recompute must export the weights of none.
Evaluation and early stopping run at DP = 2 and TP = 2 (equal to one process) and PP = 2.
"""

import json

import pytest
import torch
import yaml
from dist_testing import torchrun_train
from eval_testing import eval_job
from safetensors.torch import load_file

from megatron_lorafusion.config import load_config
from megatron_lorafusion.data import write_task
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


def _job(
    tmp_path, out: str, *, recompute: str = "selective", dropout: float = 0.0, **parallel
) -> str:
    adapters = []
    for i, (task, gbs) in enumerate({"sort": 3, "add": 4, "upper": 2}.items()):
        path = write_task(task, tmp_path / f"{task}.jsonl", 40, seed=1)
        adapters.append(
            {
                "name": task,
                "rank": 4 + 2 * i,
                "alpha": 8,
                "lr": 1e-2,
                "dropout": dropout,
                "global_batch_size": gbs,
                "dataset": {"path": str(path)},
                "max_grad_norm": 0.5,
            }
        )  # clips: norms span every rank's factors
    job = {
        "model": {"preset": "tiny", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128},
        "adapters": adapters,
        "data": {"max_seq_length": 48},
        "planner": {"token_capacity": 96, "solver": "greedy"},
        "parallel": parallel,
        "train": {
            "steps": 3,
            "device": "cpu",
            "output_dir": str(tmp_path / out),
            "recompute": recompute,
        },
        "logging": {"progress_bar": False},
    }
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def _exported(tmp_path, out: str, name: str) -> dict:
    return load_file(str(tmp_path / out / "adapters" / name / "adapter_model.safetensors"))


@pytest.mark.slow
def test_torchrun_dp2_tp2_and_pp2_train_and_export(tmp_path):
    expected = main(load_config(_job(tmp_path, "one")))
    torchrun_train(_job(tmp_path, "dp2"))
    torchrun_train(_job(tmp_path, "tp2", tp=2))
    torchrun_train(_job(tmp_path, "pp2", pp=2))
    for name in expected:
        one, dp2, tp2, pp2 = (
            _exported(tmp_path, out, name) for out in ("one", "dp2", "tp2", "pp2")
        )
        assert one.keys() == dp2.keys() == tp2.keys() == pp2.keys(), f"{name}: keys differ"
        for key, value in one.items():
            torch.testing.assert_close(
                dp2[key],
                value,
                **TOL[torch.float32],
                msg=f"{name} {key}: DP = 2 export != one process",
            )
            torch.testing.assert_close(
                tp2[key],
                value,
                **TP_TOL[torch.float32],
                msg=f"{name} {key}: TP = 2 (SP) export != one process",
            )
            torch.testing.assert_close(
                pp2[key],
                value,
                **TP_TOL[torch.float32],  # other microbatches: other fp32 summation order
                msg=f"{name} {key}: PP = 2 (another plan) export != one process",
            )


@pytest.mark.slow
def test_torchrun_pp2_full_recompute_exports_the_weights_of_none(tmp_path):
    """PP = 2 with LoRA dropout: in 1F1B, stage 0 runs the next microbatch's forward before a
    backward, so each recomputed layer must restore the layout (and dropout masks) of its
    own microbatch; full recompute then trains exactly what none trains."""
    for mode in ("none", "full"):
        torchrun_train(_job(tmp_path, mode, recompute=mode, dropout=0.1, pp=2))
    for name in ("sort", "add", "upper"):
        none, full = (_exported(tmp_path, mode, name) for mode in ("none", "full"))
        assert none.keys() == full.keys(), f"{name}: keys differ"
        for key, value in none.items():
            torch.testing.assert_close(
                full[key],
                value,
                atol=0,
                rtol=0,
                msg=f"{name} {key}: full recompute != none at PP = 2",
            )


def _evals(out) -> dict[str, list[tuple[int, float]]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if "eval_loss" in r:
            evals.setdefault(r["adapter"], []).append((r["step"], r["eval_loss"]))
    return evals


@pytest.mark.slow
def test_torchrun_dp2_tp2_and_pp2_evaluate_and_stop_early(tmp_path):
    """Eval and early stopping: DP = 2 and TP = 2 equal one process (same plan: same eval
    losses, same stop, same exports); PP = 2 evaluates every step through the pipeline and
    exports the best weights its stages saved."""
    # "wild" steps at lr 1.0: its eval loss rises after its first step, so it stops early
    # (one layer; test_evaluate's job).
    adapters = [
        {"task": "sort", "lr_schedule": "constant", "global_batch_size": 4, "dropout": 0.0},
        {
            "task": "add",
            "name": "wild",
            "lr": 1.0,
            "lr_schedule": "constant",
            "global_batch_size": 4,
            "dropout": 0.0,
            "early_stopping_patience": 1,
        },
    ]
    eval_job(tmp_path, adapters, 4, seed=4, eval_every=1)
    raw = yaml.safe_load((tmp_path / "job.yaml").read_text())
    jobs = {}
    for out, parallel in {"one": {}, "dp2": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}.items():
        raw["train"]["output_dir"] = str(tmp_path / out)
        raw["parallel"] = parallel
        raw["model"]["num_layers"] = parallel.get("pp", 1)  # one per stage
        jobs[out] = tmp_path / f"{out}.yaml"
        jobs[out].write_text(yaml.safe_dump(raw))
    main(load_config(jobs["one"]))
    for out in ("dp2", "tp2", "pp2"):
        torchrun_train(str(jobs[out]))
    one, pp2 = _evals(tmp_path / "one"), _evals(tmp_path / "pp2")
    assert len(one["wild"]) < 4, f"wild must stop early in one process: {one['wild']}"
    for out, tol in (("dp2", TOL), ("tp2", TP_TOL)):  # TP: best weights gathered from shards
        evals = _evals(tmp_path / out)
        for name, expected in one.items():
            assert [s for s, _ in evals[name]] == [s for s, _ in expected], f"{out} {name}"
            assert [v for _, v in evals[name]] == pytest.approx(
                [v for _, v in expected], rel=tol[torch.float32]["rtol"]
            ), f"{name}: {out} eval losses != one process"
            theirs = _exported(tmp_path, out, name)
            for key, value in _exported(tmp_path, "one", name).items():
                torch.testing.assert_close(
                    theirs[key],
                    value,
                    **tol[torch.float32],
                    msg=f"{name} {key}: {out} export != one process",
                )
    assert [s for s, _ in pp2["sort"]] == [1, 2, 3, 4], pp2["sort"]
    steps = [s for s, _ in pp2["wild"]]
    assert steps == list(range(1, len(steps) + 1)), f"wild at PP = 2: {pp2['wild']}"
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
