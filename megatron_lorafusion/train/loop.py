"""The single-stage training loop: run a plan's microbatches, step each adapter on its own.

Each adapter's loss is the per-token mean over its own global batch: every microbatch adds
``sum(token losses of adapter a) / (trained tokens in a's current global batch)`` to the
objective, and adapter ``a`` steps right after the backward of the microbatch that finishes
its global batch (`Microbatch.finishes`), whatever the other adapters do; all adapters that
finish at one microbatch step together in one fused launch (`AdapterAdamW.step`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from megatron_lorafusion.data import PackedBatch
from megatron_lorafusion.ops import copy_to_device
from megatron_lorafusion.planner import Microbatch
from megatron_lorafusion.train.optim import AdapterAdamW

logger = logging.getLogger(__name__)


@dataclass
class AdapterRun:
    """One adapter's training state inside the loop (its optimizer state is `AdapterAdamW`'s).

    Attributes:
        name: adapter name (for logs).
        batch_tokens: trained tokens of each of its global batches (the loss denominators).
        losses: mean loss of each finished global batch, appended by the loop.
        pending_loss: loss accumulated so far in the unfinished global batch.
    """

    name: str
    batch_tokens: list[int]
    losses: list[float] = field(default_factory=list)
    pending_loss: float = 0.0

    @property
    def step(self) -> int:
        """Optimizer steps taken so far."""
        return len(self.losses)


def run_plan(
    microbatches: Iterable[Microbatch],
    forward: Callable[[PackedBatch], torch.Tensor],
    make_batch: Callable[[Microbatch, int], PackedBatch],
    adapters: Sequence[AdapterRun],
    optimizer: AdapterAdamW,
    *,
    on_step: Callable[[int, AdapterRun], None] | None = None,
    progress_bar: bool = True,
    log_every: int = 1,
    first_index: int = 0,
    on_microbatch: Callable[[int], None] | None = None,
) -> None:
    """Train through a stream of planned microbatches.

    Args:
        microbatches: the plan's microbatches in order (already checked).
        forward: runs the model on a batch and returns per-token loss [1, T] (fp32).
        make_batch: packs a microbatch (and its position in the stream) into tensors.
        adapters: per adapter id, its losses and loss denominators; updated in place.
        optimizer: steps every adapter (their shared `AdapterAdamW`).
        on_step: called after adapter ``a`` steps, with ``(a, run)`` (checkpointing).
        progress_bar: show a tqdm bar.
        log_every: log a line every this many steps of the slowest adapter.
        first_index: stream index of the first microbatch given (a resumed run skips the rest).
        on_microbatch: called with the stream index after each microbatch and the optimizer
            steps it triggers (a consistent point for checkpoints).
    """
    num_adapters = len(adapters)
    tokens_seen = 0  # computed tokens since the last log line, over the time since it
    start = time.perf_counter()
    last_logged = 0
    pending: torch.Tensor | None = None
    total_steps = sum(len(run.batch_tokens) for run in adapters)
    bar = tqdm(
        total=total_steps,
        initial=sum(run.step for run in adapters),
        desc="train",
        unit="step",
        disable=not progress_bar,
    )
    for index, microbatch in enumerate(microbatches, start=first_index):
        if not microbatch.samples:
            continue
        batch = make_batch(microbatch, index)
        token_loss = forward(batch) * batch.loss_mask  # (1, T)
        rows = batch.layout.row_adapter(token_loss.device)
        per_adapter = torch.zeros(num_adapters, dtype=torch.float32, device=token_loss.device)
        per_adapter.index_add_(0, rows, token_loss[0].float())
        current = [run.batch_tokens[min(run.step, len(run.batch_tokens) - 1)] for run in adapters]
        denominators = copy_to_device(
            torch.tensor([max(n, 1) for n in current], dtype=torch.float32), token_loss.device
        )
        adapter_losses = per_adapter / denominators  # (A,) share of each adapter's batch loss
        adapter_losses.sum().backward()
        if pending is None:  # each adapter's loss so far in its global batch, on the device
            pending = copy_to_device(
                torch.tensor([run.pending_loss for run in adapters], dtype=torch.float64),
                token_loss.device,
            )
        pending += adapter_losses.detach()
        tokens_seen += batch.layout.num_tokens
        if microbatch.finishes:  # read back only here: a sync per microbatch stalls the GPU
            values, pending = pending.tolist(), None
            optimizer.check_losses({a: values[a] for a in microbatch.finishes})
        optimizer.step(microbatch.finishes)
        if microbatch.finishes:
            for a in microbatch.finishes:
                adapters[a].losses.append(values[a])
                values[a] = 0.0
            for run, value in zip(adapters, values, strict=True):
                run.pending_loss = value
        for a in microbatch.finishes:
            if on_step is not None:
                on_step(a, adapters[a])
            bar.update(1)
        bar.set_postfix({run.name: f"{run.losses[-1]:.3f}" for run in adapters if run.losses})
        slowest = min(run.step for run in adapters)
        if slowest >= last_logged + log_every:
            last_logged = slowest
            now = time.perf_counter()
            losses = " ".join(f"{r.name} {r.losses[-1]:.4f}" for r in adapters)
            logger.info(
                "step %d | loss %s | lr %s | %.1fk tok/s",
                slowest,
                losses,
                " ".join(f"{optimizer.lr(a):.1e}" for a in range(num_adapters)),
                tokens_seen / max(now - start, 1e-9) / 1e3,
            )
            tokens_seen, start = 0, now  # the next line's rate is its own window's
        if on_microbatch is not None:  # saves only after microbatches with steps
            on_microbatch(index)
    if pending is not None:
        for run, value in zip(adapters, pending.tolist(), strict=True):
            run.pending_loss = value
    bar.close()
