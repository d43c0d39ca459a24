"""Per-adapter resume: each adapter continues from its own newest usable checkpoint and ends
where an uninterrupted run ends (fp32, up to summation order: a resumed run packs its
microbatches differently), with another token capacity too; a damaged checkpoint is skipped;
a changed adapter is refused by name; a new adapter starts fresh, a removed one is left on
disk; one adapter's divergence or a full disk end the run cleanly (exit 2)."""

import errno
import json
import logging
import os
import random
import select
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from dist_testing import torchrun_train
from safetensors.torch import load_file
from save_testing import every_checkpoint_written

from megatron_lorafusion.cli import main as cli_main
from megatron_lorafusion.config import load_config
from megatron_lorafusion.data import load_tokenizer, write_task
from megatron_lorafusion.train import writer as writer_module
from megatron_lorafusion.train.checkpoint import AdapterCheckpoints, CheckpointError, Shard
from megatron_lorafusion.train.main import JobsFailedError, main, make_jobs
from megatron_lorafusion.train.resume import check_restorable, shared_identity
from megatron_lorafusion.train.writer import WriteError

# A resumed run plans its remaining samples anew (other microbatches, other fp32 summation
# order of the gradients); measured up to 2.7e-6 relative on these jobs after 6 AdamW steps.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5)}

_ADAPTERS = {"sort": (4, 4), "add": (2, 6), "upper": (6, 3)}  # rank, global batch


def _job(tmp_path, out: str, names=("sort", "add"), adapter_keys=None, **train) -> str:
    adapters = []
    for i, name in enumerate(names):
        path = tmp_path / f"{name}.jsonl"
        if not path.exists():
            write_task(name, path, 40, seed=2)
        rank, gbs = _ADAPTERS[name]
        adapters.append(
            {
                "name": name,
                "rank": rank,
                "alpha": 8,
                "dropout": 0.1,
                "lr": 1e-2,
                "global_batch_size": gbs,
                "dataset": {"path": str(path)},
                **((adapter_keys or {}).get(i, {})),
            }
        )
    job = {
        "model": {"preset": "tiny", "num_layers": 1},
        "adapters": adapters,
        "data": {"max_seq_length": 48},
        "planner": {"solver": "greedy", "token_capacity": 96},
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
    return str(path)


def _exports(out) -> dict[str, dict[str, torch.Tensor]]:
    return {
        folder.name: load_file(str(folder / "adapter_model.safetensors"))
        for folder in sorted((out / "adapters").iterdir())
    }


def _interrupt(out, name: str, after_step: int) -> None:
    """Make ``name`` look killed right after its checkpoint of ``after_step``."""
    folder = out / "checkpoints" / name
    for step in folder.glob("step_*"):
        if int(step.name.removeprefix("step_")) > after_step:
            shutil.rmtree(step)
    (folder / "done.json").unlink()
    shutil.rmtree(out / "adapters" / name)


def _assert_same(got, want, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: adapters differ"
    for name, tensors in want.items():
        assert got[name].keys() == tensors.keys(), f"{what} {name}: keys differ"
        for key, value in tensors.items():
            torch.testing.assert_close(
                got[name][key], value, **TOL[torch.float32], msg=f"{what}: {name} {key}"
            )


_DORA_PLUS = {0: {"use_dora": True, "loraplus_lr_ratio": 4.0}}  # adapter 0; adapter 1 LoRA


def test_resume_continues_each_adapter_and_equals_the_uninterrupted_run(
    tmp_path, caplog, monkeypatch
):
    full = main(load_config(_job(tmp_path, "full", adapter_keys=_DORA_PLUS)))
    job = _job(tmp_path, "cut", adapter_keys=_DORA_PLUS)
    with monkeypatch.context() as patch:
        every_checkpoint_written(patch)
        main(load_config(job))
    out = tmp_path / "cut"
    _interrupt(out, "sort", after_step=4)
    _interrupt(out, "add", after_step=2)
    newest = out / "checkpoints" / "sort" / "step_00000004" / "shard_tp0_pp0.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # damaged on disk
    with caplog.at_level(logging.INFO, logger="megatron_lorafusion.train"):
        # Another token capacity packs other microbatches: isolation keeps the result.
        resumed = main(load_config(job, ["planner.token_capacity=128"]))
    assert "skipping damaged checkpoint" in caplog.text
    assert "step_00000004" in caplog.text
    assert "adapter sort: resumed at step 2" in caplog.text, "falls back past the damaged one"
    assert "adapter add: resumed at step 2" in caplog.text
    for name in full:
        torch.testing.assert_close(
            torch.tensor(resumed[name]), torch.tensor(full[name]), **TOL[torch.float32]
        )
    _assert_same(_exports(out), _exports(tmp_path / "full"), "resumed export")
    assert any("lora_magnitude_vector" in k for k in _exports(out)["sort"]), "DoRA exported"


def test_resume_of_a_finished_run_trains_nothing(tmp_path, caplog):
    job = _job(tmp_path, "run", steps=2)
    main(load_config(job))
    before = _exports(tmp_path / "run")
    caplog.clear()  # the first run's lines, where an earlier test left INFO on
    with caplog.at_level(logging.INFO, logger="megatron_lorafusion.train"):
        main(load_config(job, ["logging.log_every=3", "train.keep_last=5"]))
    assert "adapter sort:" in caplog.text, "the rerun's lines are captured"
    assert "exported to" not in caplog.text, "done adapters are neither trained nor exported"
    _assert_same(_exports(tmp_path / "run"), before, "a rerun of a finished run")


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("adapters.1.lr=0.02", "adapter 'add'"),
        ("train.seed=7", "job.train.seed (1234 -> 7)"),
    ],
)
def test_resume_with_a_changed_setting_exits_2_naming_it_and_writes_nothing(
    tmp_path, capsys, override, named
):
    job = _job(tmp_path, "run", steps=2)
    main(load_config(job))
    out = tmp_path / "run"
    files = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert cli_main(["train", job, override]) == 2
    err = capsys.readouterr().err
    assert named in err, err
    assert "Changed keys" in err, err
    assert "Traceback" not in err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == files, "nothing may change"


def test_check_restorable_refuses_what_resume_refuses_reading_only_state_files(tmp_path):
    """A server's ranks agree on `check_restorable` before `restore_job`'s collectives: it
    passes the adapter's own checkpoints, done or cut back, and refuses another config's."""
    job = _job(tmp_path, "run", steps=4)
    main(load_config(job))
    store = AdapterCheckpoints(tmp_path / "run" / "checkpoints" / "sort", "sort", Shard())

    def check(*overrides: str) -> None:
        cfg = load_config(job, list(overrides))
        tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
        sort = make_jobs(cfg, cfg.adapters, tokenizer)[0]
        check_restorable(sort, store, shared_identity(cfg))

    check()  # done: its done.json
    with pytest.raises(CheckpointError, match="rank"):
        check("adapters.0.rank=8")
    _interrupt(tmp_path / "run", "sort", after_step=2)
    check()  # cut back: its step-2 state file
    with pytest.raises(CheckpointError, match="rank"):
        check("adapters.0.rank=8")


def test_resume_adds_a_new_adapter_and_leaves_a_removed_one(tmp_path, caplog):
    out = tmp_path / "run"
    main(load_config(_job(tmp_path, "run", names=("sort", "add"))))
    _interrupt(out, "sort", after_step=2)
    kept = {p: p.read_bytes() for p in (out / "checkpoints" / "add").rglob("*") if p.is_file()}
    job = _job(tmp_path, "run", names=("sort", "upper"))
    with caplog.at_level(logging.INFO, logger="megatron_lorafusion.train"):
        losses = main(load_config(job))
    assert "adapter sort: resumed at step 2" in caplog.text
    assert len(losses["upper"]) == 6, "the new adapter trains all its steps"
    assert (out / "adapters" / "upper" / "adapter_model.safetensors").is_file()
    now = {p: p.read_bytes() for p in (out / "checkpoints" / "add").rglob("*") if p.is_file()}
    assert now == kept, "the removed adapter's files are left as they were"


def test_one_diverging_adapter_fails_alone_and_keeps_its_last_checkpoint(tmp_path, monkeypatch):
    """Adapter 'add''s weights overflow after its step 3 (its gradients were finite): it fails,
    named; 'sort' trains on and is exported; the run ends with exit status 2."""
    from megatron_lorafusion.train.optim import AdapterAdamW

    real_step = AdapterAdamW.step

    def overflowing_step(self, adapter_ids, **kwargs):
        stepped = real_step(self, adapter_ids, **kwargs)
        if 1 in stepped and self.steps[1] == 3:
            with torch.no_grad():
                next(iter(self.lora.adapter_tensors(1).values())).view(-1)[0] = float("inf")
        return stepped

    monkeypatch.setattr(AdapterAdamW, "step", overflowing_step)
    job = _job(tmp_path, "run")
    with pytest.raises(JobsFailedError, match=r"(?s)1 of 2 adapters failed.*adapter 'add'"):
        main(load_config(job, ["train.save_every=1"]))
    out = tmp_path / "run"
    assert (out / "adapters" / "sort" / "adapter_model.safetensors").is_file()
    assert not (out / "adapters" / "add").exists(), "a failed adapter is not exported"
    steps = sorted(p.name for p in (out / "checkpoints" / "add").glob("step_*"))
    assert steps == ["step_00000001", "step_00000002"], f"last good checkpoints: {steps}"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    add_steps = [r["step"] for r in records if r["adapter"] == "add" and "loss" in r]
    assert add_steps == [1, 2, 3], f"no step is recorded after the overflow: {add_steps}"


def test_a_full_disk_ends_the_run_naming_the_file_and_a_rerun_finishes(
    tmp_path, monkeypatch, capsys
):
    full = _exports_of(tmp_path, "full")
    job = _job(tmp_path, "run")
    real_fsync = writer_module.os.fsync
    calls = []

    def fsync(fd):
        calls.append(fd)
        if len(calls) > 4:  # the first checkpoint of each adapter is written, then the disk fills
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(writer_module.os, "fsync", fsync)
    with pytest.raises(WriteError, match=r"could not write .*\([\d,]+ bytes\): No space left"):
        main(load_config(job))
    monkeypatch.setattr(writer_module.os, "fsync", real_fsync)
    assert cli_main(["train", job]) == 0, capsys.readouterr().err
    _assert_same(_exports(tmp_path / "run"), full, "after a full disk")


def _exports_of(tmp_path, out: str):
    main(load_config(_job(tmp_path, out)))
    return _exports(tmp_path / out)


@pytest.mark.slow
def test_resume_under_torchrun_equals_the_uninterrupted_run(tmp_path):
    """TP = 2 x PP = 2: every shard writes its part; sort, cut back to its step-2
    checkpoints, resumes there and ends where it ended; add, killed after its last step's
    checkpoint but before its export, is exported from it by the rerun."""
    parallel, nproc = {"tp": 2, "pp": 2}, 4
    path = _job(tmp_path, "run")
    raw = yaml.safe_load(open(path).read())
    raw["model"]["num_layers"] = 2  # one layer per stage
    raw["parallel"] = parallel
    open(path, "w").write(yaml.safe_dump(raw))
    torchrun_train(path, nproc)
    out = tmp_path / "run"
    full = _exports(out)
    shards = sorted(p.name for p in (out / "checkpoints" / "sort" / "step_00000002").iterdir())
    tp, pp = parallel.get("tp", 1), parallel.get("pp", 1)
    assert len(shards) == 2 * tp * pp, f"one tensor and one state file per shard: {shards}"
    _interrupt(out, "sort", after_step=2)
    _interrupt(out, "add", after_step=6)
    log = torchrun_train(path, nproc)
    assert "adapter sort: resumed at step 2" in log, "the rerun must resume, not start afresh"
    assert "adapter add: resumed at step 6" in log, log[-3000:]
    _assert_same(_exports(out), full, f"resumed under {parallel}")


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (children, their children, ...), from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


@pytest.mark.slow
def test_kill_9_at_random_points_then_rerun_until_done_equals_the_uninterrupted_run(tmp_path):
    """SIGKILL after a random number of saves, rerun, again, until a run finishes: every
    adapter equals the uninterrupted run, and no process of a killed run is left."""
    names = ("sort", "add", "upper")
    main(load_config(_job(tmp_path, "full", names=names, steps=8)))
    job = _job(tmp_path, "run", names=names, steps=8, save_every=1)
    rng, env = random.Random(5), {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(10):
        run = subprocess.Popen(
            [sys.executable, "-m", "megatron_lorafusion", "train", job],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        wanted, saves = rng.randint(1, 8), 0
        for line in run.stderr:
            saves += "saved checkpoint" in line
            if saves >= wanted:
                break
        if run.poll() is None and saves >= wanted:
            children = {pid: os.pidfd_open(pid) for pid in _descendants(run.pid)}
            run.send_signal(signal.SIGKILL)
            run.wait()
            for pid, fd in children.items():
                alive = not select.select([fd], [], [], 10.0)[0]
                os.close(fd)
                if alive:
                    os.kill(pid, signal.SIGKILL)
                assert not alive, f"process {pid} outlived the killed run by 10 s"
        else:
            rest = run.stderr.read()
            assert run.wait() == 0, rest
            run.stderr.close()
            break
        run.stderr.close()
    else:
        pytest.fail("no rerun finished the job")
    _assert_same(_exports(tmp_path / "run"), _exports(tmp_path / "full"), "after kill -9s")
