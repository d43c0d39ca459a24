"""A server's root folder: how jobs reach `lorafusion serve`, and how it tells what it does.

Everything goes through files, so any shell on any node that sees the folder (a shared
filesystem) can submit, watch and cancel, and no network port is opened:

- ``inbox/<time>-<name>.json``: a submitted job (written whole by an atomic rename); the
  server moves it to ``jobs/<name>/job.json`` when it reads it.
- ``cancel/<name>``: a cancel request, consumed by the server.
- ``jobs/<name>/status.json``: the job's status (queued, running, done, stopped,
  cancelled, failed), step, losses, tokens, ETA, queue position; the job's checkpoints,
  PEFT folder (``adapter/``) and metrics live beside it.
- ``server.json``: the server's job, capacity and memory model; ``server.lock``: held
  (``flock``) while a server runs, so a second server on the same root refuses to start.

No torch here: ``lorafusion submit`` and ``status`` answer at once.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from megatron_lorafusion.config import (
    ConfigError,
    JobConfig,
    JobSpec,
    fused_ranks,
    job_from_dict,
    load_submission,
)

__all__ = ["ServerBusyError", "ServerRoot", "submit_job"]

logger = logging.getLogger(__name__)

FINISHED = ("done", "stopped", "cancelled", "failed")
"""Statuses of a job that will not train again."""


class ServerBusyError(RuntimeError):
    """Another server holds this root."""


def _write_json(path: Path, payload: Any) -> None:
    """Write ``path`` whole or not at all (a hidden temporary sibling, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class ServerRoot:
    """The files of one server root (see the module docstring)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.inbox = self.root / "inbox"
        self.jobs = self.root / "jobs"
        self.cancels = self.root / "cancel"
        self._lock_fd: int | None = None

    def job_dir(self, name: str) -> Path:
        """A job's folder: ``jobs/<name>``."""
        return self.jobs / name

    # -- the server's side -----------------------------------------------------------------
    def lock(self) -> None:
        """Hold the root for this process (released when it exits, however it exits).

        Raises:
            ServerBusyError: naming the server that holds it.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / "server.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            info = self.server_info() or {}
            raise ServerBusyError(
                f"server root {str(self.root)!r} is held by another server (pid "
                f"{info.get('pid', '?')} on {info.get('host', '?')}); stop it or choose "
                "another server.root"
            ) from None
        self._lock_fd = fd

    def write_server_info(self, info: dict) -> None:
        """``server.json``: the server's job, pid, host and capacity."""
        _write_json(self.root / "server.json", info)

    def server_info(self) -> dict | None:
        """``server.json``, or None before a server started here."""
        return _read_json(self.root / "server.json")

    def server_job(self) -> JobConfig | None:
        """The job of the server that runs (or ran) here, or None."""
        info = self.server_info()
        if not info or "job" not in info:
            return None
        try:
            return job_from_dict(info["job"])
        except ConfigError:
            return None

    def take_submissions(self) -> list[tuple[str, dict]]:
        """New jobs in arrival order, each written to its folder, then removed from the inbox.

        A file that cannot be written to its folder now (a full or failing disk) stays in the
        inbox, with a warning, for the next read. One whose inbox file cannot be removed is
        taken all the same (its ``job.json`` says so) and returned again by each later read
        while the file stays: the server takes each name once.

        Returns:
            ``(name, job)`` per submitted job (``job.json``'s contents).
        """
        if not self.inbox.is_dir():
            return []
        taken = []
        for path in sorted(self.inbox.glob("*.json")):
            job = _read_json(path)
            if job is None:  # a half-written file of another writer: read it next time
                continue
            name = job["adapter"]["name"]
            moved = self.job_dir(name) / "job.json"
            if _read_json(moved) != job:  # else taken at an earlier read
                try:
                    _write_json(moved, job)
                except OSError as err:
                    logger.warning(
                        "%s: not taken from the inbox now (%s); tried again later", path, err
                    )
                    continue
            try:
                path.unlink(missing_ok=True)
            except OSError as err:
                logger.warning("%s: taken, but left in the inbox (%s)", path, err)
            taken.append((name, job))
        return taken

    def has_news(self) -> bool:
        """Whether a submission or a cancel request waits (names listed, nothing read)."""
        for folder, pattern in ((self.inbox, "*.json"), (self.cancels, "*")):
            if folder.is_dir() and next(folder.glob(pattern), None) is not None:
                return True
        return False

    def take_cancels(self) -> list[str]:
        """Names of the jobs asked to stop, each request consumed."""
        if not self.cancels.is_dir():
            return []
        names = []
        for path in sorted(self.cancels.iterdir()):
            names.append(path.name)
            try:
                path.unlink(missing_ok=True)
            except OSError as err:  # read again next time: a second cancel is a no-op
                logger.warning("%s: could not remove the cancel request (%s)", path, err)
        return names

    def write_status(self, name: str, status: dict) -> None:
        """``jobs/<name>/status.json``."""
        _write_json(self.job_dir(name) / "status.json", {"name": name, **status})

    def known_jobs(self) -> list[tuple[str, dict, dict]]:
        """Every job of the root, ``(name, job, status)``, in submission order."""
        if not self.jobs.is_dir():
            return []
        found = []
        for folder in self.jobs.iterdir():
            job = _read_json(folder / "job.json")
            if job is None:
                continue
            status = _read_json(folder / "status.json") or {"status": "queued"}
            found.append((folder.name, job, status))
        return sorted(found, key=lambda entry: entry[1].get("submitted", 0.0))

    # -- anyone's side ---------------------------------------------------------------------
    def submit(self, specs: list[JobSpec]) -> list[str]:
        """Put jobs in the inbox (each written whole); returns their names.

        Raises:
            ConfigError: when a name is taken by a job of this root (queued, running or
                finished); nothing is submitted then.
        """
        pending = {
            (_read_json(p) or {}).get("adapter", {}).get("name") for p in self.inbox.glob("*.json")
        } - {None}
        taken = [
            f"adapters.{i}.name {spec.adapter.name!r} is taken by a job of server root "
            f"{str(self.root)!r} ({self.status_of(spec.adapter.name)}); choose another name"
            for i, spec in enumerate(specs)
            if self.job_dir(spec.adapter.name).exists() or spec.adapter.name in pending
        ]
        if taken:
            raise ConfigError(taken)
        names = []
        for spec in specs:
            now = time.time()
            job = {
                "adapter": asdict(spec.adapter),
                "steps": spec.steps,
                "epochs": spec.epochs,
                "submitted": now,
            }
            _write_json(self.inbox / f"{now:.6f}-{spec.adapter.name}.json", job)
            names.append(spec.adapter.name)
        return names

    def status_of(self, name: str) -> str:
        """A job's status word (``submitted`` while it waits in the inbox)."""
        status = _read_json(self.job_dir(name) / "status.json")
        return status["status"] if status else "submitted"

    def cancel(self, name: str) -> str:
        """Ask the server to stop job ``name``; returns its status now.

        Raises:
            ValueError: for a name no job of this root has, or a job already finished.
        """
        status = self.status_of(name)
        in_inbox = any(
            (_read_json(p) or {}).get("adapter", {}).get("name") == name
            for p in self.inbox.glob("*.json")
        )
        if not self.job_dir(name).exists() and not in_inbox:
            raise ValueError(f"server root {str(self.root)!r} has no job named {name!r}")
        if status in FINISHED:
            raise ValueError(f"job {name!r} is already {status}")
        self.cancels.mkdir(parents=True, exist_ok=True)
        (self.cancels / name).touch()
        return status

    def status_table(self) -> str:
        """Every job of the root on one screen: status, step, losses, tokens, ETA, queue."""
        info = self.server_info()
        lines = []
        if info:
            alive = "running" if self._held() else "not running"
            lines.append(
                f"server {str(self.root)} ({alive}; pid {info.get('pid')} on "
                f"{info.get('host')}): {info.get('capacity', '')}"
            )
        else:
            lines.append(f"server {str(self.root)}: never started")
        lines.append(
            f"{'job':<20} {'status':<9} {'step':>11} {'loss':>8} {'eval':>8} "
            f"{'tokens':>10} {'ETA':>8} {'queue':>5}"
        )
        waiting = [(_read_json(p) or {}) for p in sorted(self.inbox.glob("*.json"))]
        for name, _, status in self.known_jobs():
            lines.append(_status_line(name, status))
        for job in waiting:
            name = job.get("adapter", {}).get("name", "?")
            lines.append(f"{name[:20]:<20} {'submitted':<9}")
        return "\n".join(lines)

    def _held(self) -> bool:
        """Whether a server holds the root now (its lock is taken)."""
        path = self.root / "server.lock"
        if not path.exists():
            return False
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)  # closing drops a lock this probe took
        return False


def submit_job(root: str | Path, job_file: str | Path) -> list[str]:
    """`lorafusion submit`: validate a job file against the server's job, queue its adapters.

    Everything the server would refuse is refused here (bad keys and values, a missing
    dataset, a rank above ``server.max_rank``, DoRA, a name already used on this root), so
    the server never sees a bad job.

    Returns:
        The queued jobs' names (their ids).

    Raises:
        ConfigError: listing every problem; nothing is submitted.
    """
    server_root = ServerRoot(root)
    server = server_root.server_job()
    specs = load_submission(job_file, server)
    problems = []
    if server is not None:
        limit = server.server.max_rank
        for i, spec in enumerate(specs):
            ranks = fused_ranks(spec.adapter)
            if max(ranks.values(), default=0) > limit:
                problems.append(
                    f"adapters.{i}.rank must be <= the server's max_rank {limit} on every "
                    f"linear (rank × projections), got {max(ranks.values())}"
                )
            if spec.adapter.use_dora:
                problems.append(
                    f"adapters.{i}.use_dora must be false on a server (its adapter tables "
                    "hold LoRA factors only; train DoRA with lorafusion train), got true"
                )
    if problems:
        raise ConfigError(problems)
    return server_root.submit(specs)


def _status_line(name: str, s: dict) -> str:
    def num(key: str, fmt: str) -> str:
        value = s.get(key)
        return format(value, fmt) if isinstance(value, int | float) else "-"

    step = f"{s.get('step', 0)}/{s.get('total_steps', '?')}"
    eta = s.get("eta_s")
    eta_text = "-" if eta is None else f"{eta / 60:.1f}m" if eta >= 60 else f"{eta:.0f}s"
    queue = s.get("queue_position")
    line = (
        f"{name[:20]:<20} {s.get('status', '?'):<9} {step:>11} {num('loss', '.4f'):>8} "
        f"{num('eval_loss', '.4f'):>8} {num('tokens', ','):>10} {eta_text:>8} "
        f"{'-' if queue is None else queue:>5}"
    )
    if s.get("reason"):
        line += f"  ({s['reason']})"
    return line
