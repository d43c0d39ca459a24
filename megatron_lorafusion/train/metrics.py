"""Per-adapter metrics of a run: ``<output_dir>/metrics.jsonl`` and TensorBoard event files.

One rank writes (the one that sees the losses: rank 0 of a one-stage run, the last stage's
first TP/DP rank of a pipelined one). Each optimizer step of an adapter appends one JSON line
``{"step", "adapter", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "gpu_mem_gib",
"time_s"}``, each evaluation one ``{"step", "adapter", "eval_loss"}`` line, and the same values
go to TensorBoard as ``loss/<adapter>``, ``lr/<adapter>``, ``eval_loss/<adapter>``, ...
(`torch.utils.tensorboard.SummaryWriter`, under ``<output_dir>/tensorboard/``). A resumed run
appends: readers keep the last record of each (adapter, step, kind) (`read_metrics`).
Run-wide records (``"adapter": null``: tokens/s, microbatches, fill, measured bubble, where
the time went: start-up, the first step (Triton compilation), training, waits for saves, the
export tail; the peak GPU memory of a CUDA run) are written at the end
(`MetricsWriter.log_run`; pipelined runs also log each segment's measured bubble).

It also holds what a run says on its first screen (`job_summary`, `plan_summary`) and the
progress bar of every kind of run (`ProgressBar`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

if TYPE_CHECKING:
    from megatron_lorafusion.config import JobConfig
    from megatron_lorafusion.planner import Plan, PlanProblem
    from megatron_lorafusion.train.job import AdapterJob

__all__ = ["MetricsWriter", "ProgressBar", "job_summary", "plan_summary", "read_metrics"]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _number(value: float) -> float | None:
    """JSON has no NaN: a missing value (a NaN loss on a non-last stage) is null."""
    return None if value is None or not math.isfinite(value) else float(value)


class MetricsWriter:
    """Writes per-adapter step and eval records (a no-op on ranks that do not write).

    Args:
        output_dir: the run's folder (``train.output_dir``), or a served job's.
        enabled: this rank writes.
        device: the model's device (GPU memory is read from it; 0 on CPU).
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        enabled: bool,
        device: torch.device | str = "cpu",
    ):
        self.enabled = enabled
        self.device = torch.device(device)
        self.start = time.perf_counter()
        self.tokens: dict[str, int] = {}  # trained tokens per adapter in this process
        self._file = None
        self._tb = None
        self._write_failed = False
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
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()  # a user may tail the file while the run goes on
        except OSError as err:  # one rank writes metrics: never a reason to split the ranks
            if not self._write_failed:
                logger.warning("%s: a metrics record was not written (%s)", self._file.name, err)
            self._write_failed = True

    def log_step(
        self,
        name: str,
        step: int,
        *,
        loss: float,
        lr: float,
        grad_norm: float | None,
        tokens: int,
    ) -> None:
        """Record adapter ``name``'s optimizer step ``step`` (1-based).

        Args:
            name: the adapter.
            step: its optimizer steps so far.
            loss: per-token mean loss of the global batch.
            lr: learning rate of the step.
            grad_norm: gradient L2 norm before clipping (None when unknown on this rank).
            tokens: trained tokens of the global batch.
        """
        self.tokens[name] = self.tokens.get(name, 0) + tokens
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        record = {
            "step": step,
            "adapter": name,
            "loss": _number(loss),
            "lr": lr,
            "grad_norm": _number(grad_norm),
            "tokens": tokens,
            "tokens_per_s": self.tokens[name] / max(elapsed, 1e-9),
            "gpu_mem_gib": self._gpu_mem_gib(),
            "time_s": elapsed,
        }
        self._write(record)
        for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
            if record[key] is not None:
                self._tb.add_scalar(f"{key}/{name}", record[key], step)

    def log_eval(self, name: str, step: int, eval_loss: float) -> None:
        """Record adapter ``name``'s eval loss after its step ``step``."""
        if not self.enabled:
            return
        self._write(
            {
                "step": step,
                "adapter": name,
                "eval_loss": eval_loss,
                "time_s": time.perf_counter() - self.start,
            }
        )
        self._tb.add_scalar(f"eval_loss/{name}", eval_loss, step)

    def log_run(self, step: int, values: dict[str, float | dict[str, float]]) -> None:
        """Record run-wide values: an ``adapter: null`` line, and ``run/<key>`` in TensorBoard.

        A dict value (the start-up phases) is one TensorBoard scalar per entry,
        ``run/<key>/<name>``.
        """
        if not self.enabled:
            return
        self._write({"step": step, "adapter": None, **values})
        for key, value in values.items():
            for name, number in value.items() if isinstance(value, dict) else [("", value)]:
                self._tb.add_scalar(f"run/{key}/{name}" if name else f"run/{key}", number, step)

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


def job_summary(cfg: JobConfig, jobs: Sequence[AdapterJob], world_size: int) -> str:
    """The job on one screen: model, adapters, parallel layout, capacity, output folder."""
    m = cfg.model
    source = m.hf_path or (f"preset {m.preset}" if m.preset else "random weights")
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    lines = [
        f"model: {source} | {m.num_layers} layers, hidden {m.hidden_size}, ffn "
        f"{m.ffn_hidden_size}, {m.num_attention_heads} heads, vocab {m.vocab_size} | "
        f"{cfg.train.precision} on {cfg.train.device}",
        f"parallel: tp {tp} x pp {pp} x dp {max(world_size // (tp * pp), 1)} "
        f"({world_size} process{'es' if world_size > 1 else ''}) | token capacity "
        f"{cfg.planner.token_capacity} per microbatch | planner {cfg.planner.solver}",
        f"{'adapter':<16} {'rank':>4} {'alpha':>6} {'dropout':>7} {'lr':>8} {'batch':>5} "
        f"{'samples':>8} {'steps':>5}",
    ]
    for job in jobs:
        adapter = job.config
        steps = f"{job.step}/{job.total_steps}" if job.step else str(job.total_steps)
        lines.append(
            f"{adapter.name[:16]:<16} {adapter.rank:>4} {adapter.alpha:>6g} "
            f"{adapter.dropout:>7g} {adapter.lr:>8.1e} {adapter.global_batch_size:>5} "
            f"{len(job.order):>8} {steps:>5}"
        )
    lines.append(f"output: {cfg.train.output_dir}")
    return "\n".join(lines)


def plan_summary(plan: Plan, problem: PlanProblem, first_chunk: bool) -> str:
    """Microbatches, fill and the simulated bubble of a plan (or of its first chunk)."""
    from megatron_lorafusion.planner import CostModel, plan_jobs
    from megatron_lorafusion.sim import simulate

    mbs = plan.microbatches
    idle = sum(mb.is_idle for mb in mbs)
    fill = sum(mb.tokens for mb in mbs) / max(len(mbs) * problem.capacity, 1)
    bubble = simulate(plan_jobs(plan, CostModel()), problem.num_stages, CostModel()).bubble_ratio
    what = "first chunk" if first_chunk else "whole"
    return (
        f"plan ({what}): {len(mbs)} microbatches ({idle} idle), fill {100 * fill:.1f}%, "
        f"simulated bubble {100 * bubble:.1f}% at {problem.num_stages} "
        f"stage{'s' if problem.num_stages > 1 else ''}"
    )


class ProgressBar:
    """A tqdm bar over every adapter's optimizer steps, with tokens/s (ETA in steps).

    While the bar is shown, log records go through it (``tqdm.write``), so a log line never
    lands in the middle of a redraw.

    Args:
        total_steps: optimizer steps of all adapters in the run.
        done_steps: those already taken (a resumed run).
        enabled: this rank shows the bar (the rank that sees the losses).
    """

    def __init__(self, total_steps: int, done_steps: int, *, enabled: bool):
        self.total, self.done, self.enabled = total_steps, done_steps, enabled
        self.bar: tqdm | None = None  # drawn at the first step, below the start-up lines
        self.start = time.perf_counter()
        self.tokens = 0
        self._redirect = None  # logging through the bar while it is shown

    def add_total(self, steps: int) -> None:
        """More steps to go (a job joined a running server)."""
        self.total += steps
        if self.bar is not None:
            self.bar.total = self.total

    def step(self, tokens: int, losses: dict[str, float]) -> None:
        """One adapter stepped on a global batch of ``tokens`` trained tokens."""
        if self.bar is None:
            self.bar = tqdm(
                total=self.total,
                initial=self.done,
                desc="train",
                unit="step",
                disable=not self.enabled,
            )
            if self.enabled:
                self._redirect = logging_redirect_tqdm()
                self._redirect.__enter__()
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        postfix = {"tok/s": f"{rate / 1e3:.1f}k"}
        postfix.update({name: f"{loss:.3f}" for name, loss in losses.items()})
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        """Close the bar (logging goes back to its handlers)."""
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None
