"""Training runs stopped by signals: SIGTERM ends one cleanly (one line, exit 143, a rerun
resumes); Ctrl-C, pressed twice at once, at start-up or during a save, ends it with one line
and exit 130 (issue 36); after a SIGKILL of the run, or of torchrun's launcher, no process of
it is left."""

import os
import re
import select
import signal
import subprocess
import sys

import pytest
import yaml

from megatron_lorafusion.data import write_task
from megatron_lorafusion.train import AdapterCheckpoints, Shard


def _job(tmp_path, pp=1):
    """A job long enough (4,400 samples) to be planned by a worker process."""
    data = tmp_path / "add.jsonl"
    write_task("add", data, 200)
    job = {
        "model": {"preset": "tiny"},
        "adapters": [{"name": "add", "dataset": {"path": str(data)}, "global_batch_size": 4}],
        "planner": {"solver": "greedy", "token_capacity": 256},
        "parallel": {"tp": 1, "pp": pp},
        "train": {"steps": 1100, "save_every": 1, "output_dir": str(tmp_path / "run")},
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
    again = _train(job)
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


_CTRL_C = "interrupted{}: train stopped; rerun the same command to resume from its last checkpoint"

# `lorafusion train` that presses Ctrl-C twice, as a terminal does (SIGINT to the whole
# process group, the planner worker included), at one point of the run: while the command's
# own modules import, just after the planner worker was started (its interpreter still
# booting), or just before the fifth checkpoint file is written by a writer thread (the
# worker, ahead of the run, blocked on its full queue). The line it writes first proves the
# point was reached.
_PRESS_CTRL_C = """
import importlib.abc, os, signal, sys, threading, time
when = sys.argv.pop(1)

def press():  # the second press 2 ms later: it reaches the worker as it handles the first
    sys.stderr.write(f"test: Ctrl-C twice {when}\\n")
    sys.stderr.flush()
    again = threading.Thread(target=lambda: (time.sleep(0.002), os.killpg(0, signal.SIGINT)))
    again.start()
    os.killpg(0, signal.SIGINT)

class Importing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if when == "while its modules import" and name == "megatron_lorafusion.config":
            sys.meta_path.remove(self)
            press()

def patch():
    from megatron_lorafusion.planner import background
    from megatron_lorafusion.train import checkpoint
    real_write, real_init = checkpoint.write_file, background.BackgroundPlanner.__init__
    writes = []
    def write(path, *args, **kwargs):
        if when == "during a save" and "checkpoints" in str(path):
            writes.append(path)
            if len(writes) == 5:
                press()
        return real_write(path, *args, **kwargs)
    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        if when == "while the planner worker starts":
            press()
    checkpoint.write_file, background.BackgroundPlanner.__init__ = write, init

sys.meta_path.insert(0, Importing())
if when != "while its modules import":
    patch()
sys.argv = ["lorafusion", *sys.argv[1:]]
from megatron_lorafusion.__main__ import run
raise SystemExit(run())
"""


def _own_group(argv: list[str]) -> subprocess.Popen:
    """The command in a process group of its own, as a shell runs a foreground job."""
    return subprocess.Popen(
        [sys.executable, *argv],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _group(pgid: int) -> list[int]:
    """Process ids of process group ``pgid``, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[3]) == pgid:
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _check_ended_alone(run: subprocess.Popen, err: str) -> None:
    """Exit 130, no traceback, and no process of the run's group left after 10 s."""
    left = {pid: os.pidfd_open(pid) for pid in _group(run.pid)}  # a worker ending with it
    assert run.wait(timeout=60) == 130, err
    assert "Traceback" not in err, err
    for pid, fd in left.items():
        assert select.select([fd], [], [], 10.0)[0], f"process {pid} outlived the run by 10 s"
        os.close(fd)


@pytest.mark.parametrize(
    ("when", "line"),
    [
        ("while its modules import", "interrupted: lorafusion stopped"),
        ("while the planner worker starts", _CTRL_C.format(r"( at step 0 \(add 0\))?")),
        ("during a save", _CTRL_C.format(r" at step \d+ \(add \d+\)")),
    ],
)
def test_ctrl_c_twice_at_start_up_or_during_a_save_ends_with_one_line_and_exit_130(
    tmp_path, when, line
):
    """Each used to end in a traceback: of the import (exit -2), or of the worker, which
    shares the terminal's process group (interrupted while blocked on its full queue). The
    worker now ignores Ctrl-C and ends with the run."""
    job = _job(tmp_path)
    run = _own_group(["-c", _PRESS_CTRL_C, when, "train", str(job), "logging.level=WARNING"])
    try:
        lines = run.stderr.read().splitlines()
        _check_ended_alone(run, "\n".join(lines))
    finally:
        run.kill()
        run.stderr.close()
    assert len(lines) == 2, lines
    assert lines[0] == f"test: Ctrl-C twice {when}", lines
    assert re.fullmatch(line, lines[1]), lines


def test_ctrl_c_again_while_the_run_exits_changes_nothing(tmp_path):
    """Ctrl-C, then at once again, then again once the line is printed (the interpreter
    exiting: its exit hooks used to raise, ending in exit -2 and a traceback)."""
    job = _job(tmp_path)
    run = _own_group(["-m", "megatron_lorafusion", "train", str(job)])
    lines = []
    try:
        for line in run.stderr:
            lines.append(line)
            if "saved checkpoint" in line:
                os.killpg(run.pid, signal.SIGINT)
                os.killpg(run.pid, signal.SIGINT)
            if line.startswith("interrupted"):
                os.killpg(run.pid, signal.SIGINT)
        _check_ended_alone(run, "".join(lines))
    finally:
        run.kill()
        run.stderr.close()
    assert sum(line.startswith("interrupted") for line in lines) == 1, lines
    assert re.fullmatch(_CTRL_C.format(r" at step \d+ \(add \d+\)"), lines[-1].strip()), lines
