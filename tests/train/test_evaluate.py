"""Evaluation and early stopping per adapter: one adapter stops (its remaining samples leave
the plan) and is exported with its best weights at once, the other trains on."""

import json

import torch
from eval_testing import eval_job
from safetensors.torch import load_file

from megatron_lorafusion.train.checkpoint import (
    TABLES,
    AdapterCheckpoints,
    Shard,
    table_tensors,
)
from megatron_lorafusion.train.export import write_peft_folder
from megatron_lorafusion.train.main import main

STEPS = 6


def _job(tmp_path, **train):
    # "wild" steps at lr 1.0: its eval loss rises after its first step, so it stops early.
    adapters = [
        {
            "task": "sort",
            "lr_schedule": "constant",
            "global_batch_size": 4,
            "early_stopping_patience": 0,
        },
        {
            "task": "add",
            "name": "wild",
            "lr": 1.0,
            "lr_schedule": "constant",
            "global_batch_size": 4,
            "early_stopping_patience": 1,
        },
    ]
    return eval_job(tmp_path, adapters, STEPS, seed=4, eval_every=1, **train)


def test_early_stopping_stops_one_adapter_and_exports_its_best(tmp_path):
    cfg = _job(tmp_path)
    losses = main(cfg)
    out = tmp_path / "out"
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = {
        name: [
            (r["step"], r["eval_loss"]) for r in lines if r["adapter"] == name and "eval_loss" in r
        ]
        for name in losses
    }
    assert [s for s, _ in evals["sort"]] == list(range(1, STEPS + 1)), evals["sort"]
    wild = evals["wild"]
    assert len(wild) < STEPS, f"wild must stop early, evaluated at {wild}"
    best_step, best_loss = min(wild, key=lambda e: e[1])
    assert all(loss >= best_loss for _, loss in wild[wild.index((best_step, best_loss)) :]), wild
    assert len(losses["wild"]) == len(wild), "no step after the evaluation that stopped it"
    stepped = [r["step"] for r in lines if r["adapter"] == "wild" and "loss" in r]
    assert stepped == list(range(1, len(wild) + 1)), f"no steps after the stop: {stepped}"
    assert len(losses["sort"]) == STEPS, "the other adapter trains all its steps"

    store = AdapterCheckpoints(out / "checkpoints" / "wild", "wild", Shard())
    assert best_step in store.steps(), "the best evaluation's checkpoint is kept"
    done = store.read_done()
    assert done["job"]["status"] == "stopped"
    assert done["exported_step"] == best_step
    best = table_tensors(store.load(best_step)[0], TABLES[0])
    write_peft_folder(tmp_path / "ref", cfg.adapters[1], best, cfg.model)
    exported = load_file(str(out / "adapters" / "wild" / "adapter_model.safetensors"))
    expected = load_file(str(tmp_path / "ref" / "adapter_model.safetensors"))
    assert exported.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(exported[key], value), f"exported {key} is not the best weights"


def test_a_kill_between_the_stop_checkpoint_and_the_export_resumes_to_the_export(tmp_path):
    """wild stops early at a step that also saves (save_every 1); a kill after that checkpoint
    and before the export (its done.json and PEFT folder gone) resumes to the export alone:
    no step more, status and weights as the uninterrupted run's."""
    cfg = _job(tmp_path, save_every=1)
    losses = main(cfg)
    out = tmp_path / "out"
    stopped_at = len(losses["wild"])
    assert stopped_at < STEPS, "wild must stop early"
    first = load_file(str(out / "adapters" / "wild" / "adapter_model.safetensors"))
    store = AdapterCheckpoints(out / "checkpoints" / "wild", "wild", Shard())
    assert store.steps()[0] == stopped_at, "the stop step saved a checkpoint"
    (out / "checkpoints" / "wild" / "done.json").unlink()
    for path in (out / "adapters" / "wild").iterdir():
        path.unlink()
    (out / "adapters" / "wild").rmdir()

    again = main(cfg)
    assert len(again["wild"]) == stopped_at, "no step after the one that stopped it"
    done = store.read_done()
    assert done["job"]["status"] == "stopped", done["job"]
    second = load_file(str(out / "adapters" / "wild" / "adapter_model.safetensors"))
    assert second.keys() == first.keys()
    for key, value in first.items():
        assert torch.equal(second[key], value), f"exported {key} differs from the first run's"
