"""Checkpoint and resume a training run at consistent points of its plan stream.

`ResumeSession` ties `Checkpointer` to one run: it restores the newest complete checkpoint
(policy ``train.resume``), skips the plan microbatches already trained while checking that
the regenerated stream matches the one that was checkpointed, and saves after the
microbatch at which the adapters' optimizer steps pass a multiple of ``train.save_every``.

The pipelined runner (PP or DP > 1) has no flush, so its in-flight activations cannot be
saved; `ResumeSession.segments` cuts its stream at those same save points instead: each
segment runs as one pipelined stream (drained at its end) and is followed by a checkpoint.
The cuts depend only on the plan, so an interrupted and resumed run cuts where an
uninterrupted one does and computes the same thing.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from megatron_lorafusion.config import JobConfig, job_from_dict
from megatron_lorafusion.pipeline import AdapterRun
from megatron_lorafusion.planner import Microbatch
from megatron_lorafusion.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    find_resume_checkpoint,
)
from megatron_lorafusion.train.optim import AdapterAdamW, DivergenceError

__all__ = ["RESUMABLE_KEYS", "ResumeSession", "job_changes", "make_resume_session", "stream_digest"]

logger = logging.getLogger(__name__)

# Keys a resumed run may change: where and how often it saves, logs and caches, the device,
# and activation recompute (memory, not results: every mode computes the same gradients).
# Every other key changes what is trained or exported (or the plan), so a change refuses the
# resume.
RESUMABLE_KEYS = (
    "train.resume",
    "train.overwrite",
    "train.output_dir",
    "train.keep_last",
    "train.save_every",
    "train.device",
    "train.recompute",
    "data.cache_dir",
    "planner.time_limit_s",
    "logging",
)


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys of a JSON-like job; lists of mappings (adapters) by index."""
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(inner, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, inner in enumerate(value):
            _flatten(inner, f"{prefix}.{i}", out)
    else:
        out[prefix] = value
    return out


def job_changes(saved: dict, current: dict) -> list[str]:
    """Keys whose values differ between two jobs (``asdict`` form), outside `RESUMABLE_KEYS`.

    Returns:
        One ``"<key> (<saved> -> <current>)"`` per changed key, in key order.
    """
    old, new = _flatten(saved, "", {}), _flatten(current, "", {})
    missing = object()
    changes = []
    for key in sorted(old.keys() | new.keys()):
        if any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS):
            continue
        before, after = old.get(key, missing), new.get(key, missing)
        if before != after:
            show = [("(absent)" if v is missing else repr(v)) for v in (before, after)]
            changes.append(f"{key} ({show[0]} -> {show[1]})")
    return changes


def _check_same_job(folder: Path, current: dict) -> None:
    """Refuse to resume from ``folder`` when its job differs from ``current``.

    Raises:
        CheckpointError: listing every changed key, or when the saved job is unreadable.
    """
    hint = "set train.resume: never or another train.output_dir to start fresh"
    try:
        saved = asdict(job_from_dict(json.loads((folder / "job.json").read_text("utf-8"))))
    except (OSError, ValueError) as err:  # ConfigError included
        raise CheckpointError(
            f"checkpoint {str(folder)!r} holds no readable job.json ({err}); {hint}"
        ) from None
    changes = job_changes(saved, json.loads(json.dumps(current)))
    if changes:
        raise CheckpointError(
            f"checkpoint {str(folder)!r} was trained with another job; resuming would train "
            f"or export the wrong adapters. Changed keys:\n  - "
            + "\n  - ".join(changes)
            + f"\n({hint})"
        )


def stream_digest(digest: Any, microbatch: Microbatch) -> None:
    """Fold one microbatch (its samples and finishing adapters) into a hashlib SHA-256."""
    digest.update(repr((microbatch.samples, microbatch.finishes)).encode())


class ResumeSession:
    """Resume and checkpoint state of one run on this rank.

    Args:
        checkpointer: writes this rank's part of each checkpoint.
        runs: per adapter id, its `AdapterRun`.
        optimizer: the adapters' `AdapterAdamW` (its per-adapter states are checkpointed).
        lora: the `LoRAContext` of the adapters' parameters.
        save_every: save when the adapters' total optimizer steps pass a multiple of
            ``save_every × adapters`` (each adapter's steps, on average); 0: only at the end.
        any_rank: ``(A,) int32 flags -> the same flags or-ed over every rank`` in place (an
            all-reduce; the identity in a one-process run).
    """

    def __init__(
        self,
        checkpointer: Checkpointer,
        runs: Sequence[AdapterRun],
        optimizer: AdapterAdamW,
        lora,
        save_every: int,
        any_rank: Callable[[torch.Tensor], None] = lambda flags: None,
    ):
        self.any_rank = any_rank
        self.checkpointer = checkpointer
        self.runs = runs
        self.optimizer = optimizer
        self.lora = lora
        self.save_every = save_every
        self.position = 0
        self._consumed = 0
        self._expected: str | None = None
        self._digest = hashlib.sha256()
        self._stream_steps = 0  # optimizer steps due by the microbatches `segments` yielded
        self._adapter_steps: list[int] = []  # the same, per adapter
        self.at_save_point = False  # the last segment ended at a save point (or the end)

    def _mark(self, steps: int) -> int:
        """Save points passed after ``steps`` optimizer steps of all adapters."""
        if not self.save_every:
            return 0
        return steps // (self.save_every * len(self.runs))

    def restore(self, resume: str) -> int:
        """Load the checkpoint chosen by policy ``resume``; returns the next stream index.

        Raises:
            CheckpointError: for an explicitly named checkpoint that is damaged, one whose
                job differs from this run's (`job_changes`), or one that does not fit it.
        """
        folder = find_resume_checkpoint(self.checkpointer.root, resume)
        if folder is None:
            return 0
        _check_same_job(folder, self.checkpointer.job)
        self.position, self._expected = self.checkpointer.restore(
            folder, self.runs, self.optimizer, self.lora
        )
        return self.position

    def stream(self, microbatches: Iterable[Microbatch]) -> Iterator[Microbatch]:
        """The plan's microbatches after the restored position, digesting each one yielded.

        Raises:
            RuntimeError: when the regenerated stream's first ``position`` microbatches differ
                from those the checkpoint was trained on (another plan: e.g. a changed config
                or a MILP solve that hit its time limit differently).
        """
        for index, microbatch in enumerate(microbatches):
            stream_digest(self._digest, microbatch)
            self._consumed = index + 1
            if index + 1 == self.position and self._digest.hexdigest() != self._expected:
                raise RuntimeError(
                    f"the regenerated plan differs from the checkpointed one in its first "
                    f"{self.position} microbatches; resume needs the same data, config and a "
                    f"deterministic plan (planner.solver: greedy, or a MILP time limit the "
                    f"solver never reaches), or train.resume: never"
                )
            if index >= self.position:
                yield microbatch

    def segments(
        self,
        microbatches: Iterable[Microbatch],
        cut_after: Callable[[Sequence[int], Sequence[int]], bool] | None = None,
    ) -> Iterator[tuple[int, Iterator[Microbatch]]]:
        """The stream after the restored position, cut at the save points.

        A segment ends after the microbatch whose ``finishes`` bring the adapters' optimizer
        steps past a multiple of ``save_every × adapters``; once a segment has drained, every
        step of its microbatches is taken, so the checkpoint holds no half-done step.
        Consume each segment, then `save` when ``at_save_point``, before asking for the next;
        the next segment's first microbatch is read from the stream only then.

        Args:
            microbatches: the whole plan stream.
            cut_after: ``(finishing adapters, each adapter's steps after them) -> bool``: also
                end a segment there (an evaluation point).

        Yields:
            ``(first_index, segment)``: the stream index of the segment's first microbatch and
            an iterator over the segment's microbatches.
        """
        stream = self.stream(microbatches)
        self._stream_steps = sum(run.step for run in self.runs)  # finishes before `position`
        self._adapter_steps = [run.step for run in self.runs]
        while (first := next(stream, None)) is not None:
            yield self._consumed - 1, self._until_cut(first, stream, cut_after)

    def _until_cut(
        self, first: Microbatch, stream: Iterator[Microbatch], cut_after
    ) -> Iterator[Microbatch]:
        microbatch: Microbatch | None = first
        self.at_save_point = False
        while microbatch is not None:
            yield microbatch
            before = self._stream_steps
            self._stream_steps += len(microbatch.finishes)
            for a in microbatch.finishes:
                self._adapter_steps[a] += 1
            if self._mark(self._stream_steps) > self._mark(before):
                self.at_save_point = True
                return  # a save point: the caller drains, saves, then asks for more
            if (
                cut_after is not None
                and microbatch.finishes
                and cut_after(microbatch.finishes, self._adapter_steps)
            ):
                return  # the caller drains and evaluates
            microbatch = next(stream, None)
        self.at_save_point = True  # the end of the stream

    def save(self) -> Path:
        """Checkpoint every adapter after the microbatches the stream has yielded so far.

        Raises:
            DivergenceError: when an adapter's weights hold NaN or inf on any rank (a step on
                finite gradients can still overflow them); nothing is written, so the newest
                checkpoint stays the last good one.
        """
        bad = (~torch.isfinite(self.lora.weights.detach()).all(dim=1)).to(torch.int32)  # (A,)
        self.any_rank(bad)  # every rank reaches this save, so every rank refuses together
        if bad.any():
            run = self.runs[int(bad.nonzero()[0])]
            raise DivergenceError(
                f"adapter {run.name!r}: its weights became NaN or infinite by step {run.step}; "
                "the checkpoint was not written (lower its lr or set its max_grad_norm)"
            )
        self.position = self._consumed
        return self.checkpointer.save(
            self.position, self._digest.hexdigest(), self.runs, self.optimizer, self.lora
        )


def make_resume_session(
    cfg: JobConfig, sizes: dict[str, int], runs: Sequence[AdapterRun], optimizer: AdapterAdamW, lora
) -> ResumeSession:
    """The session of a run: checkpoints under ``<train.output_dir>/checkpoints``.

    Args:
        cfg: the job (copied into each checkpoint as ``job.json``).
        sizes: `parallel_sizes()` of this rank (``world``, ``rank``, ``tp``, ``tp_rank``, ...).
        runs: per adapter id, its `AdapterRun`.
        optimizer: the adapters' `AdapterAdamW`.
        lora: the `LoRAContext` of the adapters' parameters.
    """
    import torch.distributed as dist

    def barrier() -> None:
        if sizes["world"] > 1:
            dist.barrier()

    def any_rank(flags: torch.Tensor) -> None:
        if sizes["world"] > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)

    checkpointer = Checkpointer(
        Path(cfg.train.output_dir) / "checkpoints",
        asdict(cfg),
        tp_rank=sizes["tp_rank"],
        tp_size=sizes["tp"],
        pp_rank=sizes["pp_rank"],
        pp_size=sizes["pp"],
        dp_rank=sizes["dp_rank"],
        dp_size=sizes["dp"],
        coordinator=sizes["rank"] == 0,
        barrier=barrier,
        keep_last=cfg.train.keep_last,
    )
    return ResumeSession(checkpointer, runs, optimizer, lora, cfg.train.save_every, any_rank)
