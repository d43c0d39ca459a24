"""A training run stopped by SIGTERM: one line, exit 143, no process left, and a rerun resumes."""

import os
import select
import signal
import subprocess
import sys

import pytest
import yaml

from megatron_lorafusion.data import write_task
from megatron_lorafusion.train import checkpoint_problems


def _job(tmp_path):
    data = tmp_path / "add.jsonl"
    write_task("add", data, 200)
    job = {"model": {"preset": "tiny"},
           "adapters": [{"name": "add", "dataset": {"path": str(data)}, "global_batch_size": 4}],
           "planner": {"solver": "greedy", "token_capacity": 256},
           "train": {"steps": 400, "save_every": 1, "output_dir": str(tmp_path / "run")},
           "logging": {"progress_bar": False}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _train(job, *overrides):
    return subprocess.Popen([sys.executable, "-m", "megatron_lorafusion", "train", str(job),
                             *overrides], stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigterm_ends_training_cleanly_and_a_rerun_resumes(tmp_path):
    job = _job(tmp_path)
    run = _train(job)
    lines = []
    try:
        for line in run.stderr:  # the first checkpoint is on disk once this line is logged
            lines.append(line)
            if "saved checkpoint" in line:
                break
        assert any("saved checkpoint" in line for line in lines), "".join(lines)
        pidfds = [os.pidfd_open(int(pid)) for pid in _children(run.pid)]
        run.send_signal(signal.SIGTERM)
        rest = run.stderr.read()
        assert run.wait(timeout=60) == 143, rest
    finally:
        run.kill()
        run.stderr.close()
    assert rest.strip().splitlines()[-1] == (
        "terminated: train stopped; rerun the same command to resume from its last checkpoint")
    assert "Traceback" not in rest, rest
    for fd in pidfds:  # every child process (the planner worker) has exited too
        assert select.select([fd], [], [], 10.0)[0], "a child outlived the terminated run"
        os.close(fd)
    complete = [c for c in (tmp_path / "run" / "checkpoints").glob("ckpt_*")
                if not c.name.endswith(".tmp")]  # a save cut short stays a .tmp, never used
    assert complete, "no checkpoint left"
    assert not [p for c in complete for p in checkpoint_problems(c)], "a damaged checkpoint"
    again = _train(job, "train.steps=400")
    try:
        for line in again.stderr:
            if "resumed from" in line:
                break
        else:
            pytest.fail("the rerun did not resume from the checkpoint")
    finally:
        again.kill()
        again.wait()
        again.stderr.close()


def _children(pid: int) -> list[str]:
    """Process ids whose parent is ``pid`` (from /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(entry)
    return children
