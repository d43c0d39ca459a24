"""Kill and resume: a run stopped after a checkpoint and resumed equals an uninterrupted run.

A damaged checkpoint (a shard truncated on disk) is skipped with a warning, and resume falls
back to the previous complete one.
"""

import json
import logging

import pytest
import torch
import yaml
from dist_testing import torchrun_train

from megatron_lorafusion.cli import main as cli_main
from megatron_lorafusion.config import load_config
from megatron_lorafusion.data import write_task
from megatron_lorafusion.train import resume
from megatron_lorafusion.train.checkpoint import (
    Checkpointer,
    checkpoint_problems,
    find_resume_checkpoint,
    full_adapter_tensors,
)
from megatron_lorafusion.train.main import main

# The resumed run recomputes the same fp32 operations in the same order (CPU); measured
# bit-identical, checked against the bound of 1e-6.
TOL = {torch.float32: dict(atol=1e-6, rtol=0.0)}


class _Stop(Exception):
    """Stands in for a crash right after a checkpoint is written."""


def _job(tmp_path, out: str, capacity: int = 96, adapter_keys=({}, {}), **train) -> object:
    adapters = []
    for (task, rank, gbs), keys in zip((("sort", 4, 4), ("add", 2, 6)), adapter_keys, strict=True):
        path = tmp_path / f"{task}.jsonl"
        if not path.exists():
            write_task(task, path, 40, seed=2)
        adapters.append(
            {
                "name": task,
                "rank": rank,
                "alpha": 8,
                "dropout": 0.1,
                "lr": 1e-2,
                "global_batch_size": gbs,
                "dataset": {"path": str(path)},
                **keys,
            }
        )
    job = {
        "model": {"preset": "tiny", "num_layers": 1},
        "adapters": adapters,
        "data": {"max_seq_length": 48},
        "planner": {"solver": "greedy", "token_capacity": capacity},
        "train": {
            "steps": 6,
            "device": "cpu",
            "output_dir": str(tmp_path / out),
            "save_every": 2,
            "keep_last": 0,
            **train,
        },
        "logging": {"progress_bar": False},
    }
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(job))
    return load_config(path)


def _stop_after_saves(monkeypatch, count: int) -> None:
    real_save = Checkpointer.save
    calls = []

    def save(self, *args, **kwargs):
        path = real_save(self, *args, **kwargs)
        calls.append(path)
        if len(calls) == count:
            raise _Stop(path)
        return path

    monkeypatch.setattr(Checkpointer, "save", save)


def _final_adapters(out):
    folder = find_resume_checkpoint(out / "checkpoints", "auto")
    return full_adapter_tensors(folder)


# Adapter 0 is DoRA with LoRA+ (magnitudes and B at 4 × lr), adapter 1 plain LoRA (issue 19).
_DORA_PLUS = ({"use_dora": True, "loraplus_lr_ratio": 4.0}, {})


def test_resume_after_stop_equals_uninterrupted_run(tmp_path, monkeypatch, caplog):
    full = main(_job(tmp_path, "full", resume="never", adapter_keys=_DORA_PLUS))
    full_tensors = _final_adapters(tmp_path / "full")

    with monkeypatch.context() as patch:
        _stop_after_saves(patch, 2)
        with pytest.raises(_Stop):
            main(_job(tmp_path, "cut", adapter_keys=_DORA_PLUS))
    saved = sorted((tmp_path / "cut" / "checkpoints").glob("ckpt_*"))
    assert len(saved) == 2, f"expected two checkpoints before the stop, got {saved}"
    steps = [json.loads((s / "manifest.json").read_text())["steps"] for s in saved]
    assert all(0 < n < 6 for n in steps[-1].values()), f"stopped mid-run: {steps}"

    shard = saved[-1] / "shard_tp0_pp0.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated on disk
    assert checkpoint_problems(saved[-1]), "a truncated shard must be detected"
    with caplog.at_level(logging.INFO, logger="megatron_lorafusion.train.checkpoint"):
        resumed = main(_job(tmp_path, "cut", adapter_keys=_DORA_PLUS))
    assert any(
        "skipping incomplete checkpoint" in r.getMessage() and saved[-1].name in r.getMessage()
        for r in caplog.records
    ), "the damaged checkpoint must be warned"
    assert f"resumed from {saved[0]}" in caplog.text, "resume falls back to the older checkpoint"

    assert resumed.keys() == full.keys()
    for name in full:
        torch.testing.assert_close(
            torch.tensor(resumed[name]),
            torch.tensor(full[name]),
            **TOL[torch.float32],
            msg=f"{name}: losses differ",
        )
    cut_tensors = _final_adapters(tmp_path / "cut")
    assert any(k.endswith("lora_magnitude") for k in cut_tensors["sort"]), "DoRA is checkpointed"
    for name, tensors in full_tensors.items():
        for key, value in tensors.items():
            torch.testing.assert_close(
                cut_tensors[name][key],
                value,
                **TOL[torch.float32],
                msg=f"{name} {key} differs after resume",
            )


def test_resume_explicit_damaged_checkpoint_is_refused(tmp_path):
    folder = tmp_path / "ckpt_00000004"
    folder.mkdir()
    with pytest.raises(ValueError, match="no manifest.json"):
        find_resume_checkpoint(tmp_path, str(folder))


def test_resume_with_another_plan_is_refused(tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        _stop_after_saves(patch, 1)
        with pytest.raises(_Stop):
            main(_job(tmp_path, "run"))
    # The same job whose plan comes out differently (as a MILP hitting its time limit would).
    monkeypatch.setattr(resume, "stream_digest", lambda digest, mb: digest.update(b"other"))
    with pytest.raises(RuntimeError, match="regenerated plan differs from the checkpointed one"):
        main(_job(tmp_path, "run"))


def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resume_with_changed_job_exits_2_naming_keys_and_writes_nothing(tmp_path, capsys):
    main(_job(tmp_path, "run", steps=2))
    run = tmp_path / "run"
    before = _snapshot(run)
    assert (run / "job.json").is_file(), "the finished run must hold its job.json"
    assert any(p.parts[0] == "adapters" for p in before), "the finished run must have exported"
    other = tmp_path / "other.jsonl"
    write_task("reverse", other, 40, seed=3)
    changes = {  # override -> the key named in the refusal
        "adapters.0.alpha=16": "adapters.0.alpha (8.0 -> 16.0)",
        "adapters.0.rank=8": "adapters.0.rank (4 -> 8)",
        "adapters.0.dropout=0.2": "adapters.0.dropout",
        "adapters.0.target_modules=[linear_qkv]": "adapters.0.target_modules",
        "adapters.1.lr=3e-2": "adapters.1.lr",
        "adapters.1.loraplus_lr_ratio=4": "adapters.1.loraplus_lr_ratio (1.0 -> 4.0)",
        "adapters.0.use_dora=true": "adapters.0.use_dora (False -> True)",
        "adapters.1.lr_schedule=linear": "adapters.1.lr_schedule",
        f"adapters.1.dataset.path={other}": "adapters.1.dataset.path",
        "train.seed=7": "train.seed",
        "train.steps=4": "train.steps (2 -> 4)",
        "model.init_seed=3": "model.init_seed",
        "planner.token_capacity=128": "planner.token_capacity",
    }
    for override, named in changes.items():
        status = cli_main(["train", str(tmp_path / "run.yaml"), "train.steps=2", override])
        err = capsys.readouterr().err
        assert status == 2, f"{override}: exit {status}, expected 2\n{err}"
        assert named in err, f"{override}: the refusal must name {named!r}:\n{err}"
        assert "train.resume: never" in err, f"{override}: the refusal must give the hint"
        assert "Traceback" not in err
        assert _snapshot(run) == before, f"{override}: a refused resume changed the run's files"


def test_resume_with_changed_logging_and_keep_last_continues(tmp_path, caplog):
    main(_job(tmp_path, "run", steps=2))
    with caplog.at_level(logging.INFO, logger="megatron_lorafusion.train.checkpoint"):
        main(
            load_config(
                tmp_path / "run.yaml", ["train.steps=2", "train.keep_last=5", "logging.log_every=3"]
            )
        )
    assert "resumed from" in caplog.text, "save and logging keys may change on resume"


def test_resume_may_change_recompute_but_not_steps():
    """Activation recompute changes memory, not results: a resume may switch it."""
    saved = {"train": {"recompute": "selective", "steps": 2}}
    assert resume.job_changes(saved, {"train": {"recompute": "full", "steps": 2}}) == []
    assert resume.job_changes(saved, {"train": {"recompute": "none", "steps": 4}}) == [
        "train.steps (2 -> 4)"
    ]


@pytest.mark.slow
def test_resume_tp2_under_torchrun_equals_uninterrupted_run(tmp_path):
    """TP = 2: drop the checkpoints after the first (as if killed there), rerun, same result."""
    import shutil

    cfg = _job(tmp_path, "tp2")  # writes the datasets and tp2.yaml
    raw = yaml.safe_load((tmp_path / "tp2.yaml").read_text())
    raw["parallel"] = {"tp": 2}
    (tmp_path / "tp2.yaml").write_text(yaml.safe_dump(raw))
    torchrun_train(tmp_path / "tp2.yaml", 2)
    root = tmp_path / "tp2" / "checkpoints"
    saved = sorted(root.glob("ckpt_*"))
    assert len(saved) >= 3, f"expected several checkpoints, got {saved}"
    manifest = json.loads((saved[-1] / "manifest.json").read_text())
    assert (manifest["tp"], sorted(manifest["files"])) == (
        2,
        ["job.json", "shard_tp0_pp0.pt", "shard_tp1_pp0.pt"],
    )
    full = full_adapter_tensors(saved[-1])
    for later in saved[1:]:
        shutil.rmtree(later)
    log = torchrun_train(
        tmp_path / "tp2.yaml", 2
    )  # resume: auto continues from the first checkpoint
    assert f"resumed from {saved[0]}" in log, "the rerun must resume, not start afresh"
    resumed = full_adapter_tensors(find_resume_checkpoint(root, "auto"))
    assert json.loads((find_resume_checkpoint(root, "auto") / "manifest.json").read_text())[
        "steps"
    ] == {a.name: 6 for a in cfg.adapters}
    for name, tensors in full.items():
        for key, value in tensors.items():
            torch.testing.assert_close(
                resumed[name][key],
                value,
                **TOL[torch.float32],
                msg=f"{name} {key} differs after a TP = 2 resume",
            )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("parallel", "nproc", "shards"),
    [
        ({"pp": 2}, 2, ["shard_tp0_pp0.pt", "shard_tp0_pp1.pt"]),
        ({}, 2, ["shard_tp0_pp0.pt", "shard_tp0_pp0_dp1.pt"]),
        (
            {"pp": 2},
            4,
            [
                "shard_tp0_pp0.pt",
                "shard_tp0_pp0_dp1.pt",
                "shard_tp0_pp1.pt",
                "shard_tp0_pp1_dp1.pt",
            ],
        ),
    ],
    ids=["pp2", "dp2", "pp2xdp2"],
)
def test_resume_pipelined_under_torchrun_equals_uninterrupted_run(
    tmp_path, parallel, nproc, shards
):
    """PP = 2, DP = 2 or both (pipelined runner): resumed from the first checkpoint, same result.

    The checkpoints after the first are deleted (as if the run had been killed right after
    it) and the job is launched again: it must resume there and reach the uninterrupted
    run's final checkpoint, every shard (each stage, each replica) equal.
    """
    import shutil

    from megatron_lorafusion.train.checkpoint import read_shard, shard_name

    _job(tmp_path, "run")  # writes the datasets and run.yaml
    raw = yaml.safe_load((tmp_path / "run.yaml").read_text())
    raw["model"]["num_layers"] = 2  # one layer per stage
    raw["parallel"] = parallel
    for adapter in raw["adapters"]:  # clipped: a pending step's norm never straddles a save
        adapter["max_grad_norm"] = 0.5
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    torchrun_train(tmp_path / "run.yaml", nproc)
    root = tmp_path / "run" / "checkpoints"
    saved = sorted(root.glob("ckpt_*"))
    assert len(saved) >= 3, f"expected several checkpoints, got {saved}"
    files = sorted(json.loads((saved[0] / "manifest.json").read_text())["files"])
    assert files == ["job.json", *shards], f"unexpected checkpoint files {files}"
    first = [read_shard(saved[0], name) for name in shards]
    assert any(entry["grads"] for shard in first for entry in shard["adapters"]), (
        "the first checkpoint must cut a global batch (accumulated gradients saved)"
    )
    full = {name: read_shard(saved[-1], name) for name in shards}
    full_tensors = full_adapter_tensors(saved[-1])
    for later in saved[1:]:
        shutil.rmtree(later)

    raw["train"].update(save_every=0, output_dir=str(tmp_path / "uncut"))
    (tmp_path / "uncut.yaml").write_text(yaml.safe_dump(raw))
    torchrun_train(
        tmp_path / "uncut.yaml", nproc
    )  # one segment: the cuts must not change the result
    uncut_folder = find_resume_checkpoint(tmp_path / "uncut" / "checkpoints", "auto")
    uncut = full_adapter_tensors(uncut_folder)
    for name, tensors in full_tensors.items():
        for key, value in tensors.items():
            torch.testing.assert_close(
                value,
                uncut[name][key],
                **TOL[torch.float32],
                msg=f"{name} {key}: the cut run differs from an uncut one",
            )
    last = shard_name(0, parallel.get("pp", 1) - 1)  # the stage computing the losses
    for entry, again in zip(
        full[last]["adapters"], read_shard(uncut_folder, last)["adapters"], strict=True
    ):
        torch.testing.assert_close(
            torch.tensor(entry["losses"]),
            torch.tensor(again["losses"]),
            **TOL[torch.float32],
            msg=f"{entry['name']}: the cut run's losses differ from uncut",
        )

    log = torchrun_train(tmp_path / "run.yaml", nproc)  # resume: auto, from the first checkpoint
    assert f"resumed from {saved[0]}" in log, "the rerun must resume, not start afresh"
    final = find_resume_checkpoint(root, "auto")
    assert final.name == saved[-1].name, f"the resumed run ended at {final}, not {saved[-1]}"
    for name, shard in full.items():
        resumed = read_shard(final, name)
        for entry, again in zip(shard["adapters"], resumed["adapters"], strict=True):
            torch.testing.assert_close(
                torch.tensor(again["losses"]),
                torch.tensor(entry["losses"]),
                **TOL[torch.float32],
                msg=f"{name} {entry['name']}: losses differ",
            )
            for key, value in entry["tensors"].items():
                torch.testing.assert_close(
                    again["tensors"][key],
                    value,
                    **TOL[torch.float32],
                    msg=f"{name} {entry['name']} {key} differs",
                )


def test_save_refuses_weights_that_became_infinite_and_keeps_the_last_good_checkpoint(
    tmp_path, monkeypatch
):
    """A step on finite gradients can still overflow a weight: the next save refuses (the
    adapter and its step named), writes nothing, and the older checkpoint stays the newest."""
    from megatron_lorafusion.train.optim import AdapterAdamW, DivergenceError

    real_step, steps = AdapterAdamW.step, []

    def overflowing_step(self, adapter_ids, **kwargs):
        before = len(steps)
        real_step(self, adapter_ids, **kwargs)
        steps.extend(adapter_ids)
        if before < 8 <= len(steps):  # the steps that reach the second save point (8 steps)
            with torch.no_grad():  # adapter 'add': one weight overflows, its gradients were fine
                next(iter(self.lora.adapter_tensors(1).values())).view(-1)[0] = float("inf")

    monkeypatch.setattr(AdapterAdamW, "step", overflowing_step)
    cfg = _job(tmp_path, "out")
    with pytest.raises(DivergenceError, match=r"adapter 'add': its weights became NaN or inf"):
        main(cfg)
    saved = sorted((tmp_path / "out" / "checkpoints").glob("ckpt_*"))
    assert saved, "the checkpoints before the overflow must stay"
    assert not any(p.name.endswith(".tmp") for p in saved), f"half-written: {saved}"
    newest = find_resume_checkpoint(tmp_path / "out" / "checkpoints", "auto")
    manifest = json.loads((newest / "manifest.json").read_text())
    assert sum(manifest["steps"].values()) < 8, f"a checkpoint after the overflow: {manifest}"
