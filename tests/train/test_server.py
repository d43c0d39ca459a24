"""`lorafusion serve` on the CPU: jobs submitted while others train come out as `train` makes
them; a full server queues; cancel checkpoints and exports; a bad job is refused at submit,
one the server cannot take fails alone, one that diverges fails alone; a kill -9 and a
restart finish every job as an uninterrupted server does; two servers refuse one root."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from dist_testing import torchrun_train
from safetensors.torch import load_file

from megatron_lorafusion.cli import main as cli_main
from megatron_lorafusion.config import ConfigError, load_config
from megatron_lorafusion.data import write_task
from megatron_lorafusion.train.main import main as train_main

# Served and trained adapters pack their samples differently: fp32 summation order only.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5)}
SECTIONS = {
    "model": {"preset": "tiny", "num_layers": 1},
    "data": {"max_seq_length": 48},
    "planner": {"token_capacity": 96},
    "logging": {"progress_bar": False},
}
ADAPTERS = {  # name -> the job file entry
    "sort": {"rank": 4, "dropout": 0.1, "global_batch_size": 4, "steps": 6},
    "add": {"rank": 8, "dropout": 0.1, "global_batch_size": 3, "steps": 5},
    "upper": {
        "rank": 4,
        "global_batch_size": 4,
        "steps": 5,
        "target_modules": ["q_proj", "v_proj"],
    },
}


def _data(tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.jsonl"
    if not path.exists():
        write_task(name, path, 40, seed=3)
    return str(path)


def _entry(tmp_path, name: str, task: str | None = None, **keys) -> dict:
    """Job ``name`` on the synthetic task ``task`` (default: its name)."""
    return {
        "name": name,
        "alpha": 8,
        "lr": 1e-2,
        "dataset": {"path": _data(tmp_path, task or name)},
        **ADAPTERS.get(name, {}),
        **keys,
    }


def _server_yaml(tmp_path, sections: dict | None = None, **server) -> str:
    """The server's job file: the tests' sections, then ``sections``, then ``server`` keys."""
    job = {
        **SECTIONS,
        **(sections or {}),
        "train": {"steps": 4, "device": "cpu", "save_every": 2, "keep_last": 0},
        "server": {
            "root": str(tmp_path / "root"),
            "max_adapters": 2,
            "max_rank": 16,
            # Jobs are queued before the server starts (or while it trains), so it is never
            # idle before them: 1 s of idling ends it once they are done.
            "idle_timeout_s": 1,
            "poll_s": 0.3,
            **server,
        },
    }
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def _submit(tmp_path, *entries) -> None:
    path = tmp_path / f"job_{entries[0]['name']}.yaml"
    path.write_text(yaml.safe_dump({"adapters": list(entries)}))
    assert cli_main(["submit", "--server", str(tmp_path / "root"), str(path)]) == 0


def _serve(tmp_path, *overrides, code: str | None = None) -> subprocess.Popen:
    """``lorafusion serve`` in a child process (``code``: a ``python -c`` program in place of
    ``-m megatron_lorafusion``, taking the same arguments)."""
    run = ["-m", "megatron_lorafusion"] if code is None else ["-c", code]
    return subprocess.Popen(
        [sys.executable, *run, "serve", _server_yaml(tmp_path), *overrides],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _status(tmp_path, name: str) -> dict:
    try:
        return json.loads((tmp_path / "root" / "jobs" / name / "status.json").read_text())
    except (OSError, ValueError):
        return {"status": "submitted"}


def _wait(tmp_path, name: str, statuses, server, timeout_s: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = _status(tmp_path, name)
        if status["status"] in statuses:
            return status
        if server.poll() is not None:
            raise AssertionError(f"the server exited: {server.stderr.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"job {name} never reached {statuses}: {status}")


def _finish(server) -> str:
    err = server.stderr.read()
    assert server.wait(timeout=120) == 0, err[-3000:]
    server.stderr.close()
    return err


def _serve_all(tmp_path, entries: list[dict], *overrides, code: str | None = None) -> str:
    """Submit ``entries`` (queued in the inbox), start a server (`_serve` of ``overrides``
    and ``code``), wait until each job is done and the server has exited idle; its stderr."""
    _submit(tmp_path, *entries)
    server = _serve(tmp_path, *overrides, code=code)
    try:
        for entry in entries:
            assert _wait(tmp_path, entry["name"], {"done", "failed"}, server)["status"] == "done"
        return _finish(server)
    finally:
        server.kill()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(entry, model=None)``: the same adapter through `lorafusion train` (same
    seed, config and data), its exported tensors. Each (entry, data, model) trains once per
    module: several tests compare their served adapters with the same `train` run."""
    done = {}

    def train(entry: dict, model: dict | None = None) -> dict:
        entry = dict(entry)
        data = hashlib.sha256(Path(entry["dataset"]["path"]).read_bytes()).hexdigest()
        same = {**entry, "dataset": {**entry["dataset"], "path": data}}  # its rows, not its path
        key = json.dumps([same, model], sort_keys=True)
        if key not in done:
            folder = tmp_path_factory.mktemp(f"trained_{entry['name']}")
            steps = entry.pop("steps", 4)
            job = {
                **SECTIONS,
                **({"model": model} if model else {}),
                "adapters": [entry],
                "train": {"steps": steps, "device": "cpu", "output_dir": str(folder / "out")},
            }
            (folder / "job.yaml").write_text(yaml.safe_dump(job))
            train_main(load_config(folder / "job.yaml"))
            adapter = folder / "out" / "adapters" / entry["name"]
            done[key] = load_file(str(adapter / "adapter_model.safetensors"))
        return done[key]

    return train


def _served(tmp_path, name: str) -> dict:
    return load_file(
        str(tmp_path / "root" / "jobs" / name / "adapter" / "adapter_model.safetensors")
    )


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, **TOL[torch.float32], msg=f"{what}: {key}")


@pytest.mark.slow
def test_served_jobs_join_leave_and_equal_train(tmp_path, trained):
    """sort starts alone; add joins while it trains, upper (per-projection targets) while
    both do; each is exported as it ends, equal to `train` of that adapter alone. A job whose
    data is gone by admission, and one whose lr diverges, fail alone, reason named. sort is
    submitted to the running, idle server (the other tests queue their jobs before it starts):
    6 s of idling before it exits, time enough for the late submissions."""
    server = _serve(tmp_path, "server.idle_timeout_s=6")
    try:
        _wait_info(tmp_path, server)
        # sort trains long enough (~1 s on a fast CPU) for add to be admitted while it does
        sort = _entry(tmp_path, "sort", steps=60)
        add, upper = _entry(tmp_path, "add"), _entry(tmp_path, "upper")
        _submit(tmp_path, sort)
        _wait(tmp_path, "sort", {"running"}, server)
        _submit(
            tmp_path, add, _entry(tmp_path, "wild", "add", lr=1e30, global_batch_size=2, steps=4)
        )
        _submit(tmp_path, upper)
        gone = _entry(
            tmp_path,
            "gone",
            "add",
            rank=4,
            global_batch_size=2,
            steps=2,
            dataset={"path": str(tmp_path / "gone.jsonl")},
        )
        write_task("add", tmp_path / "gone.jsonl", 20, seed=1)
        _submit(tmp_path, gone)
        (tmp_path / "gone.jsonl").unlink()  # after submit, before the server reads it
        done = {n: _wait(tmp_path, n, {"done", "failed"}, server) for n in ("sort", "add", "upper")}
        assert all(d["status"] == "done" for d in done.values()), done
        assert done["add"]["started_at"] < done["sort"]["finished_at"], "add joined a running sort"
        failed = {n: _wait(tmp_path, n, {"done", "failed"}, server) for n in ("wild", "gone")}
        err = _finish(server)
    finally:
        server.kill()
    assert failed["wild"]["status"] == "failed", failed["wild"]
    assert "loss nan" in failed["wild"]["reason"] or "NaN" in failed["wild"]["reason"], failed
    assert failed["gone"]["status"] == "failed"
    assert "gone.jsonl" in failed["gone"]["reason"], failed["gone"]
    assert "Traceback" not in err, err[-3000:]
    for entry in (sort, add, upper):
        _assert_same(_served(tmp_path, entry["name"]), trained(entry), entry["name"])


@pytest.mark.slow
def test_shortest_first_trains_the_shortest_jobs_first_and_each_as_train_does(tmp_path, trained):
    """policy shortest, three jobs at once: one global batch of the two with the fewest
    tokens (add, then upper) fills the two 48-token microbatches asked, so sort waits in its
    row until one of them ends; each still comes out as `train` makes it."""
    entries = [_entry(tmp_path, n) for n in ("sort", "add", "upper")]
    err = _serve_all(
        tmp_path,
        entries,
        "server.policy=shortest",
        "server.max_adapters=3",
        "planner.token_capacity=48",
    )
    plans = re.findall(r"planning \d+ samples of (\d+) jobs", err)
    assert plans, err[-3000:]
    assert "3" not in plans, f"never all three at once: {plans}"
    for entry in entries:
        _assert_same(_served(tmp_path, entry["name"]), trained(entry), entry["name"])


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"pp": 2}, {"tp": 2}, {}], ids=["pp2", "tp2", "dp2"])
def test_a_server_of_two_ranks_queues_and_exports_as_train(tmp_path, trained, parallel):
    """`torchrun` PP = 2, TP = 2 or DP = 2 (gloo): three jobs wait in the inbox for a server
    of two rows, so one starts when the first ends: the segment ends at that job's last
    batch on both ranks and the third job takes its row then, while the other still trains
    (the inbox is not read while jobs train: ``poll_s`` 600). Every rank acts on rank 0's
    reads and clock (inbox, idle exit), and each export (assembled from both ranks' shards
    at PP and TP) equals `train` of its adapter alone."""
    model = {"preset": "tiny", "num_layers": 2}
    entries = [_entry(tmp_path, n) for n in ("sort", "add", "upper")]
    for entry in entries:
        _submit(tmp_path, entry)  # no server yet: queued in the inbox
    sections = {"model": model, "parallel": parallel}
    job = _server_yaml(tmp_path, sections, idle_timeout_s=1, poll_s=600)
    err = torchrun_train(job, command="serve")
    assert "Traceback" not in err, err[-3000:]
    started = {n: _status(tmp_path, n)["started_at"] for n in ("sort", "add", "upper")}
    finished = {n: _status(tmp_path, n)["finished_at"] for n in ("sort", "add", "upper")}
    first, last = sorted((finished["sort"], finished["add"]))
    assert first <= started["upper"] < last, (started, finished)
    for entry in entries:
        status = _status(tmp_path, entry["name"])
        assert status["status"] == "done", status
        assert status["step"] == entry["steps"], status
        # PP = 2 packs other microbatches, TP = 2 splits sums over H, DP = 2 over samples:
        # fp32 summation order only.
        torch.testing.assert_close(
            _served(tmp_path, entry["name"]),
            trained(entry, model),
            atol=1e-4,
            rtol=1e-4,
            msg=entry["name"],
        )


def _wait_info(tmp_path, server, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (tmp_path / "root" / "server.json").is_file():
        if server.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the server did not start: {server.stderr.read()[-3000:]}")
        time.sleep(0.2)


@pytest.mark.slow
def test_full_server_queues_cancel_exports_and_two_servers_refuse_one_root(tmp_path, capsys):
    long = _entry(tmp_path, "sort", steps=400)
    _submit(tmp_path, long, _entry(tmp_path, "add"))
    server = _serve(tmp_path, "server.max_adapters=1")
    try:
        _wait(tmp_path, "sort", {"running"}, server)
        assert _wait(tmp_path, "add", {"queued"}, server)["queue_position"] == 1
        second = _serve(tmp_path)
        assert second.wait(timeout=120) == 2, "a second server on the root must refuse"
        err = second.stderr.read()
        second.stderr.close()
        assert f"is held by another server (pid {server.pid}" in err, err
        _wait_step(tmp_path, "sort", 2, server)
        assert cli_main(["cancel", "--server", str(tmp_path / "root"), "sort"]) == 0
        status = _wait(tmp_path, "sort", {"cancelled"}, server)
        assert _wait(tmp_path, "add", {"done"}, server)["status"] == "done"
        _finish(server)
    finally:
        server.kill()
    folder = tmp_path / "root" / "jobs" / "sort"
    steps = sorted(p.name for p in (folder / "checkpoints").glob("step_*"))
    assert f"step_{status['step']:08d}" in steps, f"cancel checkpoints where it stopped: {steps}"
    assert (folder / "adapter" / "adapter_model.safetensors").is_file(), "and exports it"
    capsys.readouterr()
    assert cli_main(["status", "--server", str(tmp_path / "root")]) == 0
    table = capsys.readouterr().out
    assert "not running" in table, table
    assert "cancelled" in table, table
    assert cli_main(["cancel", "--server", str(tmp_path / "root"), "nobody"]) == 2


# The server with its writers slowed down: a finished job's rows wait in the tables 3 s
# before a writer copies them, and a copy the session makes first says so on stderr.
_SLOW_WRITERS = """
import sys, time
from megatron_lorafusion.cli import main
from megatron_lorafusion.train import writer
wait, settle = writer.DeferredRows.wait, writer.DeferredRows.settle
def slow_wait(self):
    time.sleep(3.0)
    return wait(self)
def loud_settle(self):
    if self._rows is None and not self._released:
        print("settled before its writer", file=sys.stderr, flush=True)
    settle(self)
writer.DeferredRows.wait, writer.DeferredRows.settle = slow_wait, loud_settle
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_row_goes_to_the_next_job_once_its_finished_jobs_rows_are_copied(tmp_path, trained):
    """One row; the writers take 3 s to reach a finished job's rows, so the next job is
    admitted into the row first: the session copies them out before the row is bound
    (`Session.settle_row`), and the first job's export is what `train` makes of it."""
    entries = [_entry(tmp_path, "sort"), _entry(tmp_path, "add")]
    err = _serve_all(tmp_path, entries, "server.max_adapters=1", code=_SLOW_WRITERS)
    assert "settled before its writer" in err, err[-3000:]
    for entry in entries:
        _assert_same(_served(tmp_path, entry["name"]), trained(entry), entry["name"])


def _wait_step(tmp_path, name: str, step: int, server) -> None:
    deadline = time.monotonic() + 240
    while _status(tmp_path, name).get("step", 0) < step:
        assert server.poll() is None, server.stderr.read()[-3000:]
        assert time.monotonic() < deadline, _status(tmp_path, name)
        time.sleep(0.2)


@pytest.mark.slow
def test_kill_9_of_the_server_then_restart_finishes_every_job_as_if_uninterrupted(
    tmp_path, trained
):
    entries = [_entry(tmp_path, "sort", steps=30), _entry(tmp_path, "add", steps=6)]
    _submit(tmp_path, *entries)
    server = _serve(tmp_path, "server.max_adapters=1")
    try:
        _wait_step(tmp_path, "sort", 3, server)  # sort runs (checkpointed at 2), add queued
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
        server.stderr.close()
    assert _status(tmp_path, "add")["status"] == "queued"
    half = tmp_path / "root" / "jobs" / "sort" / "checkpoints" / "step_00000029"
    half.mkdir()  # a save the kill cut short
    (half / ".shard_tp0_pp0.safetensors.tmp").write_bytes(b"\0" * 64)
    again = _serve(tmp_path, "server.max_adapters=1")
    try:
        for entry in entries:
            assert _wait(tmp_path, entry["name"], {"done"}, again)["status"] == "done"
        _finish(again)
    finally:
        again.kill()
    assert not half.exists(), "the half-written save is removed"
    for entry in entries:
        _assert_same(_served(tmp_path, entry["name"]), trained(entry), entry["name"])


def test_a_server_refuses_cuda_graphs_naming_why(tmp_path):
    with pytest.raises(ConfigError, match=r"a server trains eagerly \(lorafusion serve\)"):
        load_config(_server_yaml(tmp_path), ["train.cuda_graphs=true"])


def test_submit_refuses_a_bad_job_naming_every_problem_and_queues_nothing(tmp_path, capsys):
    root = tmp_path / "root"
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "adapters": [
                    {"name": "a", "rank": 0, "dataset": {"path": str(tmp_path / "none.jsonl")}},
                    {"name": "b", "dataset": {"path": _data(tmp_path, "sort")}, "steps": -1},
                ]
            }
        )
    )
    assert cli_main(["submit", "--server", str(root), str(bad)]) == 2
    err = capsys.readouterr().err
    assert "adapters.0.rank must be in [1, 256], got 0" in err, err
    assert "adapters.0.dataset.path must be an existing file" in err, err
    assert "adapters.1.steps must be a positive integer, got -1" in err, err
    assert not (root / "inbox").exists(), "a refused job is never queued"
    (root / "jobs" / "sort").mkdir(parents=True)  # a job of that name exists on the server
    (root / "server.json").write_text(  # a running server with max_rank 8, steps 4
        json.dumps({"job": {"train": {"steps": 4}, "server": {"root": str(root), "max_rank": 8}}})
    )
    again = tmp_path / "again.yaml"
    again.write_text(
        yaml.safe_dump(
            {
                "adapters": [
                    _entry(tmp_path, "sort", rank=16),
                    _entry(tmp_path, "x", "sort", use_dora=True),
                ]
            }
        )
    )
    assert cli_main(["submit", "--server", str(root), str(again)]) == 2
    err = capsys.readouterr().err
    assert "adapters.0.rank must be <= the server's max_rank 8" in err, err
    assert "adapters.1.use_dora must be false on a server" in err, err
    assert "Traceback" not in err


def test_a_submission_the_disk_refuses_stays_in_the_inbox(tmp_path, monkeypatch, caplog):
    """rank 0 alone reads the inbox: a file it cannot move is a warning and is read again
    later (an exception there would leave the other ranks in their next collective)."""
    from megatron_lorafusion import inbox

    root = inbox.ServerRoot(tmp_path / "root")
    root.inbox.mkdir(parents=True)
    (root.inbox / "0001-a.json").write_text(json.dumps({"adapter": {"name": "a"}}))
    real_write = inbox._write_json

    def full_disk(path, payload):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(inbox, "_write_json", full_disk)
    assert root.take_submissions() == []
    assert "not taken from the inbox now" in caplog.text
    assert (root.inbox / "0001-a.json").is_file(), "the submission is kept"
    monkeypatch.setattr(inbox, "_write_json", real_write)
    assert [name for name, _ in root.take_submissions()] == ["a"]
    assert not (root.inbox / "0001-a.json").exists()
    assert (root.job_dir("a") / "job.json").is_file()


def test_a_submission_whose_inbox_file_stays_is_taken_once(tmp_path, monkeypatch, caplog):
    """A file written to its job folder but not removed from the inbox (a failing unlink) is
    taken: each later read returns it again while it stays, and the server queues a name
    it knows (queued, running or finished, restored after a restart too) never again."""
    from types import SimpleNamespace

    from megatron_lorafusion import inbox
    from megatron_lorafusion.train.server import _Server

    root = inbox.ServerRoot(tmp_path / "root")
    root.inbox.mkdir(parents=True)
    path = root.inbox / "0001-a.json"
    path.write_text(json.dumps({"adapter": {"name": "a"}}))
    real_unlink = type(path).unlink

    def refuse(self, missing_ok=False):
        if self.parent == root.inbox:
            raise OSError(5, "Input/output error")
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(type(path), "unlink", refuse)
    assert [name for name, _ in root.take_submissions()] == ["a"]
    assert "taken, but left in the inbox" in caplog.text
    assert json.loads((root.job_dir("a") / "job.json").read_text()) == {"adapter": {"name": "a"}}
    assert [name for name, _ in root.take_submissions()] == ["a"], "returned while it stays"
    assert [name for name, _, _ in root.known_jobs()] == ["a"], "a restart queues it once"
    monkeypatch.setattr(type(path), "unlink", real_unlink)
    assert [name for name, _ in root.take_submissions()] == ["a"]
    assert not path.exists()
    assert root.take_submissions() == []

    server = SimpleNamespace(finished={"done": "done"}, session=SimpleNamespace(known={}))
    server.queue = [("a", {})]
    for name, known in (("a", True), ("done", True), ("new", False)):
        assert _Server.knows(server, name) is known, name
    server.session.known["running"] = object()
    assert _Server.knows(server, "running")


def test_the_inbox_has_news_only_when_a_submission_or_cancel_waits(tmp_path):
    from megatron_lorafusion import inbox

    root = inbox.ServerRoot(tmp_path / "root")
    assert not root.has_news(), "no folders yet"
    root.inbox.mkdir(parents=True)
    root.cancels.mkdir(parents=True)
    (root.inbox / ".0001-a.json.tmp").write_text("{")  # a submission still being written
    assert not root.has_news()
    (root.inbox / "0001-a.json").write_text("{}")
    assert root.has_news()
    (root.inbox / "0001-a.json").unlink()
    (root.cancels / "a").write_text("")
    assert root.has_news()


def test_a_status_file_the_disk_refuses_is_a_warning(tmp_path, caplog):
    from megatron_lorafusion.train.server import _Server

    class RefusingRoot:
        root = tmp_path

        def write_status(self, *args):
            raise OSError(28, "No space left on device")

        write_server_info = write_status

    server = _Server.__new__(_Server)  # only what `_write_status` reads
    server.rank0, server.root, server._warned_at = True, RefusingRoot(), -60.0
    server._write_status("a", {"status": "running"})
    server._write_status("the server", info={})
    assert caplog.text.count("could not write the status of") == 1, "one warning a minute"
    assert "could not write the status of a (" in caplog.text


def test_a_restart_resumes_a_job_that_ended_before_its_export(tmp_path):
    """status.json says done as the job leaves its row; a kill before the writer exported it
    leaves no done.json: the restart resumes it (to its export), and only it."""
    from megatron_lorafusion import inbox
    from megatron_lorafusion.train.server import _Server

    root = inbox.ServerRoot(tmp_path / "root")
    for name, status in (("cut", "done"), ("whole", "done"), ("late", "stopped")):
        root.job_dir(name).mkdir(parents=True)
        (root.job_dir(name) / "job.json").write_text(json.dumps({"adapter": {"name": name}}))
        root.write_status(name, {"status": status})
    (root.job_dir("whole") / "checkpoints").mkdir()
    (root.job_dir("whole") / "checkpoints" / "done.json").write_text("{}")
    server = _Server.__new__(_Server)  # only what `restore` reads
    server.rank0, server.root, server.sizes = True, root, {"world": 1}
    server.restore()
    assert sorted(name for name, _ in server.queue) == ["cut", "late"]
    assert server.finished == {"whole": "done"}
