"""Per-adapter metrics of a run: ``<output_dir>/metrics.jsonl`` and TensorBoard event files.

One rank writes (the one that sees the losses: rank 0 of a one-stage run, the last stage's
first TP/DP rank of a pipelined one). Each optimizer step of an adapter appends one JSON line
``{"step", "adapter", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "gpu_mem_gib",
"time_s"}``, each evaluation one ``{"step", "adapter", "eval_loss"}`` line, and the same values
go to TensorBoard as ``loss/<adapter>``, ``lr/<adapter>``, ``eval_loss/<adapter>``, ...
(`torch.utils.tensorboard.SummaryWriter`, under ``<output_dir>/tensorboard/``). A resumed run
appends: readers keep the last record of each (adapter, step, kind) (`read_metrics`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["MetricsWriter", "read_metrics"]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _number(value: float) -> float | None:
    """JSON has no NaN: a missing value (a NaN loss on a non-last stage) is null."""
    return None if value is None or not math.isfinite(value) else float(value)


class MetricsWriter:
    """Writes per-adapter step and eval records (a no-op on ranks that do not write).

    Args:
        output_dir: the run's folder (``train.output_dir``).
        adapter_names: by adapter id.
        enabled: this rank writes.
        device: the model's device (GPU memory is read from it; 0 on CPU).
    """

    def __init__(
        self,
        output_dir: str | Path,
        adapter_names: Sequence[str],
        *,
        enabled: bool,
        device: torch.device | str = "cpu",
    ):
        self.names = list(adapter_names)
        self.enabled = enabled
        self.device = torch.device(device)
        self.start = time.perf_counter()
        self.tokens = [0] * len(self.names)  # trained tokens per adapter in this process
        self._file = None
        self._tb = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._file = (out / METRICS_FILE).open("a", encoding="utf-8")
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self._tb = SummaryWriter(str(out / TENSORBOARD_DIR))

    def _gpu_mem_gib(self) -> float:
        if self.device.type != "cuda":
            return 0.0
        return torch.cuda.max_memory_allocated(self.device) / 2**30

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a user may tail the file while the run goes on

    def log_step(
        self,
        adapter_id: int,
        step: int,
        *,
        loss: float,
        lr: float,
        grad_norm: float | None,
        tokens: int,
    ) -> None:
        """Record adapter ``adapter_id``'s optimizer step ``step`` (1-based).

        Args:
            adapter_id: the adapter.
            step: its optimizer steps so far.
            loss: per-token mean loss of the global batch.
            lr: learning rate of the step.
            grad_norm: gradient L2 norm before clipping (None when unknown on this rank).
            tokens: trained tokens of the global batch.
        """
        self.tokens[adapter_id] += tokens
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        name = self.names[adapter_id]
        record = {
            "step": step,
            "adapter": name,
            "loss": _number(loss),
            "lr": lr,
            "grad_norm": _number(grad_norm),
            "tokens": tokens,
            "tokens_per_s": self.tokens[adapter_id] / max(elapsed, 1e-9),
            "gpu_mem_gib": self._gpu_mem_gib(),
            "time_s": elapsed,
        }
        self._write(record)
        for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
            if record[key] is not None:
                self._tb.add_scalar(f"{key}/{name}", record[key], step)

    def log_eval(self, adapter_id: int, step: int, eval_loss: float) -> None:
        """Record adapter ``adapter_id``'s eval loss after its step ``step``."""
        if not self.enabled:
            return
        name = self.names[adapter_id]
        self._write(
            {
                "step": step,
                "adapter": name,
                "eval_loss": eval_loss,
                "time_s": time.perf_counter() - self.start,
            }
        )
        self._tb.add_scalar(f"eval_loss/{name}", eval_loss, step)

    def log_run(self, step: int, values: dict[str, float]) -> None:
        """Record run-wide values (``run/<key>`` in TensorBoard; an ``adapter: null`` line)."""
        if not self.enabled:
            return
        self._write({"step": step, "adapter": None, **values})
        for key, value in values.items():
            self._tb.add_scalar(f"run/{key}", value, step)

    def close(self) -> None:
        """Flush and close the files (safe to call twice)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl``; a resumed run's repeats keep the last one.

    Raises:
        FileNotFoundError: when the run has no metrics file.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (is {run_dir} a training run folder?)")
    latest: dict[tuple, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        kind = "eval" if "eval_loss" in record else "step"
        latest[(record.get("adapter"), record["step"], kind)] = record
    return list(latest.values())
