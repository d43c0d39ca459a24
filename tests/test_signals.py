"""Training runs stopped by signals: SIGTERM ends one cleanly (one line, exit 143, a rerun
resumes); after a SIGKILL of the run, or of torchrun's launcher, no process of it is left."""

import os
import select
import signal
import subprocess
import sys

import pytest
import yaml

from megatron_lorafusion.data import write_task
from megatron_lorafusion.train import AdapterCheckpoints, Shard


def _job(tmp_path, pp=1):
    data = tmp_path / "add.jsonl"
    write_task("add", data, 200)
    job = {
        "model": {"preset": "tiny"},
        "adapters": [{"name": "add", "dataset": {"path": str(data)}, "global_batch_size": 4}],
        "planner": {"solver": "greedy", "token_capacity": 256},
        "parallel": {"tp": 1, "pp": pp},
        "train": {"steps": 400, "save_every": 1, "output_dir": str(tmp_path / "run")},
        "logging": {"progress_bar": False},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _train(job, *overrides, nproc=1):
    launcher = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
        ]
        if nproc > 1
        else [sys.executable]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*launcher, "-m", "megatron_lorafusion", "train", str(job), *overrides],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _until_first_checkpoint(run) -> list[str]:
    """The run's stderr lines up to the one saying its first checkpoint is on disk."""
    lines = []
    for line in run.stderr:
        lines.append(line)
        if "saved checkpoint of adapter" in line:
            return lines
    raise AssertionError("the run ended before its first checkpoint:\n" + "".join(lines))


@pytest.mark.slow
@pytest.mark.parametrize(("pp", "nproc"), [(1, 1), (2, 2)])
def test_sigkill_leaves_no_process_of_the_run(tmp_path, pp, nproc):
    """SIGKILL of `lorafusion train`, or of torchrun with a PP = 2 gloo job mid-plan."""
    run = _train(_job(tmp_path, pp=pp), nproc=nproc)
    try:
        _until_first_checkpoint(run)
        left = _descendants(run.pid)  # ranks, planner workers, multiprocessing helpers
        handles = {pid: os.pidfd_open(pid) for pid in left}
    finally:
        run.kill()
        run.wait()
        run.stderr.close()
    assert left, "the run started no child process (planner worker)"
    alive = []
    for pid, handle in handles.items():
        if not select.select([handle], [], [], 10.0)[0]:
            alive.append(pid)
            os.kill(pid, signal.SIGKILL)
        os.close(handle)
    assert not alive, f"processes {alive} outlived the killed run by 10 s"


@pytest.mark.slow
def test_sigterm_ends_training_cleanly_and_a_rerun_resumes(tmp_path):
    job = _job(tmp_path)
    run = _train(job)
    try:
        _until_first_checkpoint(run)
        pidfds = [os.pidfd_open(pid) for pid in _descendants(run.pid)]
        run.send_signal(signal.SIGTERM)
        rest = run.stderr.read()
        assert run.wait(timeout=60) == 143, rest
    finally:
        run.kill()
        run.stderr.close()
    last = rest.strip().splitlines()[-1]
    assert last.startswith("terminated at step "), last
    assert last.endswith(
        ": train stopped; rerun the same command to resume from its last checkpoint"
    ), last
    assert "Traceback" not in rest, rest
    for fd in pidfds:  # every child process (the planner worker) has exited too
        assert select.select([fd], [], [], 10.0)[0], "a child outlived the terminated run"
        os.close(fd)
    store = AdapterCheckpoints(tmp_path / "run" / "checkpoints" / "add", "add", Shard())
    assert store.steps(), "no checkpoint left"
    store.load(store.steps()[0])  # the newest is complete and verifies
    again = _train(job, "train.steps=400")
    try:
        for line in again.stderr:
            if "adapter add: resumed at step" in line:
                break
        else:
            pytest.fail("the rerun did not resume from the checkpoint")
    finally:
        again.kill()
        again.wait()
        again.stderr.close()


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
        below = [child for child, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found
