"""What the writer threads do for a job: write a checkpoint shard, export a finished adapter.

`Saver` turns a job's staged rows into files on a `BackgroundWriter` thread, in order per
job: its checkpoints (`AdapterCheckpoints`), their rotation, and, once the job is finished,
its PEFT folder and ``done.json``. Every decision (what to save, when, what to export) is
the session's; this only writes. A problem that belongs to one adapter (its weights are
NaN or infinite) is recorded in ``failures`` for the session, never raised: the other
adapters train on. A disk problem (`writer.WriteError`) ends the run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_lorafusion.config import AdapterConfig, ModelConfig
from megatron_lorafusion.train.checkpoint import (
    TABLES,
    AdapterCheckpoints,
    CheckpointError,
    RowPacking,
    full_adapter_tensors,
    non_finite_tensors,
    rows_to_tensors,
    table_tensors,
)
from megatron_lorafusion.train.export import ExportError, write_peft_folder
from megatron_lorafusion.train.writer import BackgroundWriter, DeferredRows, HostRows

__all__ = ["SaveRequest", "Saver"]

logger = logging.getLogger(__name__)

_SHARD_WAIT_S = 600.0  # how long the exporter waits for the other shards of a checkpoint


@dataclass
class SaveRequest:
    """One job's rows staged after a step, and what to do with them.

    Attributes:
        name: the adapter.
        config: its config (the export's).
        step: its optimizer steps when the rows were copied.
        rows: the rows (weights, exp_avg, exp_avg_sq; an export without a checkpoint: the
            weights), packed by ``packing``: staged, or a finished job's still in the tables.
        packing: where its factors lie in the packed rows (`checkpoint.RowPacking`).
        sharding: per factor name, its TP split (`LoRAContext.sharding`).
        state: the job's state and identity at ``step`` (JSON).
        checkpoint: write a checkpoint of these rows.
        keep: steps rotation must keep (the best evaluation's).
        export_step: when the job is finished, the step to export (its best under early
            stopping; ``step``: these rows); None while it trains.
    """

    name: str
    config: AdapterConfig
    step: int
    rows: HostRows | DeferredRows
    packing: RowPacking
    sharding: dict
    state: dict
    checkpoint: bool = False
    keep: tuple[int, ...] = ()
    export_step: int | None = None


@dataclass
class Saver:
    """Writes checkpoints and exports of jobs on the writer threads.

    Args:
        writer: the background writer.
        model: the base model (the export's sizes and ``base_model_name_or_path``).
        stores: ``name -> AdapterCheckpoints`` of this shard.
        export_dir: ``name -> the PEFT folder``.
        exports: this rank writes exports (global rank 0).
        single_shard: TP = PP = 1: an export comes straight from the staged rows.
        on_exported: called (on the writer thread) with ``(name, folder)`` once exported.

    Attributes:
        failures: ``(name, message)`` of adapters whose weights could not be saved or
            exported (NaN or infinite), for the session to fail them.
        bytes_written: bytes of checkpoints and exports so far.
    """

    writer: BackgroundWriter
    model: ModelConfig
    stores: Callable[[str], AdapterCheckpoints]
    export_dir: Callable[[str], Path]
    exports: bool
    single_shard: bool
    on_exported: Callable[[str, Path], None] = lambda name, folder: None
    failures: list[tuple[str, str]] = field(default_factory=list)
    _failed: set[str] = field(default_factory=set)  # never written again
    _exporting: set[str] = field(default_factory=set)  # finished: its export is queued
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def submit(self, request: SaveRequest) -> None:
        """Queue ``request`` after the earlier saves of its job.

        A job's checkpoint still queued when its export is submitted is skipped: the export
        and ``done.json`` supersede it (a kill before they are written resumes the job from
        its checkpoint before), and the run's tail waits for less.
        """
        if request.export_step is not None:
            with self._lock:
                self._exporting.add(request.name)
        what = f"saving adapter {request.name!r} at step {request.step}"
        self.writer.submit(request.name, lambda: self._run(request), what)

    def _fail(self, name: str, message: str) -> None:
        logger.error("%s", message)
        with self._lock:
            self.failures.append((name, message))
            self._failed.add(name)

    def take_failures(self) -> list[tuple[str, str]]:
        """The failures recorded since the last call."""
        with self._lock:
            out, self.failures = self.failures, []
        return out

    def _run(self, request: SaveRequest) -> int:
        written = 0
        try:
            if request.name in self._failed:
                return 0  # an adapter that failed: its later rows are not worth keeping
            if request.export_step is None and request.name in self._exporting:
                return 0  # superseded by its export
            rows = request.rows.wait()
            tensors = rows_to_tensors(rows, request.packing)
            bad = []
            if not bool(torch.isfinite(rows[0]).all()):  # one pass; names the factor only then
                bad = non_finite_tensors(table_tensors(tensors, TABLES[0]), request.name)
            if bad:
                self._fail(
                    request.name,
                    f"adapter {request.name!r}: its weights became NaN or infinite by step "
                    f"{request.step} ({bad[0]}); not saved (its last checkpoint is kept; "
                    "lower its lr or set its max_grad_norm)",
                )
                return 0
            store = self.stores(request.name)
            if request.checkpoint:
                state = {**request.state, "sharding": request.sharding}
                written += store.save(request.step, tensors, state)
                store.rotate(request.keep)
                logger.info(
                    "saved checkpoint of adapter %s at step %d: %s",
                    request.name,
                    request.step,
                    store.step_folder(request.step),
                )
            if request.export_step is not None:
                written += self._export(request, store, tensors)
        finally:
            request.rows.release()
        return written

    def _export(self, request: SaveRequest, store: AdapterCheckpoints, tensors) -> int:
        """Write the finished job's PEFT folder (rank 0), then its ``done.json``."""
        if not self.exports:
            return 0
        step = request.export_step
        try:
            if self.single_shard and step == request.step:
                weights = table_tensors(tensors, TABLES[0])
            elif self.single_shard:
                weights = table_tensors(store.load(step)[0], TABLES[0])
            else:
                _wait_complete(store, step)
                weights = full_adapter_tensors(store.step_folder(step), request.name)
            folder = write_peft_folder(
                self.export_dir(request.name), request.config, weights, self.model
            )
        except (ExportError, CheckpointError) as err:
            self._fail(request.name, f"adapter {request.name!r}: not exported: {err}")
            return 0
        store.write_done({**request.state, "exported_step": step, "export": str(folder)})
        self.on_exported(request.name, folder)
        return sum(f.stat().st_size for f in folder.iterdir())


def _wait_complete(store: AdapterCheckpoints, step: int) -> None:
    """Wait until every shard committed ``step`` (the other ranks' writers run in parallel).

    Raises:
        CheckpointError: after `_SHARD_WAIT_S` seconds.
    """
    deadline = time.monotonic() + _SHARD_WAIT_S
    while not store.is_complete(step):
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"{str(store.step_folder(step))!r}: the other shards of step {step} did not "
                f"arrive within {_SHARD_WAIT_S:.0f} s"
            )
        time.sleep(0.2)
