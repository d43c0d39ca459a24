"""Resume each adapter from its own newest usable checkpoint.

A rerun of a job continues every adapter where its own checkpoints end: the newest one that
is complete (every shard committed) and verifies (size and SHA-256 of what is loaded);
a damaged one is skipped with a warning and an older one used. An adapter whose training
ended (``done.json``) is not trained again. A checkpoint trained with another config of
that adapter, or with other shared settings that change what it learns (`shared_identity`),
is refused, naming the adapter and the keys. An adapter new to the job starts fresh beside
the resumed ones; an adapter left out of the job is left on disk untouched.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from megatron_lorafusion.config import JobConfig
from megatron_lorafusion.train.checkpoint import (
    TABLES,
    AdapterCheckpoints,
    CheckpointError,
    table_tensors,
)
from megatron_lorafusion.train.job import AdapterJob

__all__ = ["check_restorable", "identity_changes", "restore_job", "shared_identity"]

logger = logging.getLogger(__name__)

# The job keys an adapter's training depends on besides its own config. Everything else
# (planner, where and how often it saves and logs, recompute, the device, DP) may change
# between a run and its resume: isolation makes the result independent of them.
_SHARED_DATA_EXCLUDED = ("cache_dir", "offline")


def shared_identity(cfg: JobConfig) -> dict[str, Any]:
    """The job-wide settings that change what an adapter learns (model, data, seed, steps)."""
    data = {k: v for k, v in asdict(cfg.data).items() if k not in _SHARED_DATA_EXCLUDED}
    train = cfg.train
    return {
        "model": asdict(cfg.model),
        "data": data,
        "train": {
            "seed": train.seed,
            "steps": train.steps,
            "epochs": train.epochs,
            "precision": train.precision,
            "eval_every": train.eval_every,
        },
        "parallel": {"tp": cfg.parallel.tp, "pp": cfg.parallel.pp},
    }


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(inner, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value
    return out


def identity_changes(saved: dict, current: dict) -> list[str]:
    """Keys whose values differ between two identities, as ``"<key> (<saved> -> <now>)"``."""
    old, new = _flatten(saved, "", {}), _flatten(json.loads(json.dumps(current)), "", {})
    missing = object()
    changes = []
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, missing), new.get(key, missing)
        if before != after:
            shown = ["(absent)" if v is missing else repr(v) for v in (before, after)]
            changes.append(f"{key} ({shown[0]} -> {shown[1]})")
    return changes


def _check_identity(job: AdapterJob, state: dict, shared: dict, where: str) -> None:
    """Refuse a checkpoint of another config of this adapter or other shared settings.

    Raises:
        CheckpointError: naming the adapter and every changed key.
    """
    saved = {"adapter": state.get("identity", {}), "job": state.get("shared", {})}
    current = {"adapter": job.identity(), "job": shared}
    changes = identity_changes(saved, current)
    if changes:
        raise CheckpointError(
            f"adapter {job.name!r}: {where} was trained with another config; resuming would "
            f"train or export the wrong adapter. Changed keys:\n  - "
            + "\n  - ".join(changes)
            + "\n(rename the adapter to train it anew beside the old one, set "
            "train.resume: never, or choose another train.output_dir)"
        )


def _checked_done(job: AdapterJob, store: AdapterCheckpoints, shared: dict) -> dict | None:
    """``job``'s ``done.json`` once its identity is checked, or None when it has none."""
    done = store.read_done()
    if done is not None:
        _check_identity(job, done, shared, f"{store.folder / 'done.json'}")
    return done


def check_restorable(job: AdapterJob, store: AdapterCheckpoints, shared: dict) -> None:
    """Raise what `restore_job` would raise for ``job``'s files on this shard.

    Reads only the small state files, with no collective: ranks agree on this first.

    Raises:
        CheckpointError: as `restore_job` does, for its ``done.json`` or any complete step.
    """
    if _checked_done(job, store, shared) is not None:
        return
    for step in store.steps():
        if store.is_complete(step):
            _check_identity(job, store.read_state(step), shared, str(store.step_folder(step)))


def restore_job(
    job: AdapterJob,
    store: AdapterCheckpoints,
    load: Callable[[dict], None],
    shared: dict,
    *,
    agree_min: Callable[[int], int] = lambda step: step,
) -> str:
    """Bring ``job`` to its newest usable checkpoint; returns what happened.

    Args:
        job: the adapter's job (fresh: step 0).
        store: its checkpoints on this shard.
        load: ``table name -> tensors`` mapping in, loads them into the job's row.
        shared: `shared_identity` of this run.
        agree_min: the smallest of the values every rank passes (a collective; the identity
            in one process): every rank resumes the adapter from the same step.

    Returns:
        ``"done"`` (its training ended: nothing to do), ``"resumed"`` or ``"fresh"``.

    Raises:
        CheckpointError: for a checkpoint of another config (named keys), a foreign one, or
            one written by another TP × PP layout.
    """
    done = _checked_done(job, store, shared)
    if done is not None:
        job.restore(done["job"])
        job.status = done["job"]["status"]
        return "done"
    bound = None
    while True:
        step, tensors, state = _newest_usable(job, store, shared, bound)
        agreed = agree_min(step)
        if agreed == 0:
            return "fresh"
        if step != agreed:  # another rank's newest usable is older: take that one here
            step, tensors, state = _newest_usable(job, store, shared, agreed + 1)
        if agree_min(int(step == agreed)) == 0:  # some rank cannot use it: look below
            bound = agreed
            continue
        for table in TABLES:
            load({"table": table, "tensors": table_tensors(tensors, table)})
        job.restore(state["job"])
        logger.info("adapter %s: resumed at step %d (%s)", job.name, step, store.step_folder(step))
        return "resumed"


def _newest_usable(
    job: AdapterJob, store: AdapterCheckpoints, shared: dict, below: int | None
) -> tuple[int, dict | None, dict | None]:
    """The newest checkpoint below ``below`` that is complete and verifies.

    Returns:
        ``(step, tensors, state)``, or ``(0, None, None)`` when there is none.
    """
    for step in store.steps():
        if below is not None and step >= below:
            continue
        folder = store.step_folder(step)
        if not store.is_complete(step):
            logger.warning("adapter %s: skipping incomplete checkpoint %s", job.name, folder)
            continue
        state = store.read_state(step)
        _check_identity(job, state, shared, str(folder))
        try:
            tensors, state = store.load(step)
        except CheckpointError as err:
            logger.warning("adapter %s: skipping damaged checkpoint: %s", job.name, err)
            continue
        return step, tensors, state
    return 0, None, None
