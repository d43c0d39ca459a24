"""Per-adapter evaluation, in one process or across TP × PP × DP ranks.

Each adapter may hold out rows (``eval_dataset``, or ``eval_fraction`` of its training file).
Every ``train.eval_every`` of its optimizer steps (and at its last) its eval loss, the
per-token mean over all its held-out rows, is computed without gradients and with dropout
off, the rows of every adapter due at one point packed together in microbatches of at most
``planner.token_capacity`` tokens (`eval_microbatches`). Early stopping acts on these losses
(`AdapterJob.record_eval`).

The loss sums come from a `LossSums` function: `one_stage_loss_sums` in one process (and on
each TP rank alike), `pipeline.forward_loss_sums` through the pipeline and DP replicas, which
a pipelined run calls at a drained cut of its stream. Every rank gets the same totals, so
every rank takes the same early-stopping decision.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch

from megatron_lorafusion.config import AdapterConfig, DataConfig
from megatron_lorafusion.data import PackedBatch, TokenizedSample, load_adapter_dataset
from megatron_lorafusion.planner import Microbatch, Sample
from megatron_lorafusion.validation import held_out_rows

__all__ = ["LossSums", "eval_microbatches", "one_stage_loss_sums", "split_eval_rows"]

LossSums = Callable[[Sequence[Microbatch]], tuple[torch.Tensor, torch.Tensor]]
"""``eval microbatches -> (loss sums, trained tokens)``, each (A,) float64 CPU, the same on
every rank."""


def split_eval_rows(
    adapter: AdapterConfig,
    rows: list[TokenizedSample],
    data: DataConfig,
    tokenizer,
    seed: int,
) -> tuple[list[TokenizedSample], list[TokenizedSample]]:
    """An adapter's training rows and its eval rows (empty: no evaluation).

    ``eval_fraction`` holds out ``round(fraction × rows)`` rows (at least one, at most all but
    one) chosen by a generator seeded with ``(seed, adapter name)``.
    """
    if adapter.eval_dataset is not None:
        eval_adapter = replace(adapter, dataset=adapter.eval_dataset)
        return rows, load_adapter_dataset(eval_adapter, data, tokenizer)
    if count := held_out_rows(adapter.eval_fraction, len(rows)):
        chosen = set(random.Random(f"{seed}:eval:{adapter.name}").sample(range(len(rows)), count))
        return (
            [r for i, r in enumerate(rows) if i not in chosen],
            [r for i, r in enumerate(rows) if i in chosen],
        )
    return rows, []


def eval_microbatches(
    held: Mapping[int, Sequence[TokenizedSample]], slots: Sequence[int], capacity: int
) -> list[Microbatch]:
    """The eval rows of ``slots`` in order, cut into microbatches of <= capacity tokens.

    Args:
        held: slot -> its adapter's eval rows.
        slots: the adapters to evaluate.
        capacity: tokens per microbatch.
    """
    microbatches, current, used = [], [], 0
    for a in sorted(slots):
        for i, row in enumerate(held[a]):
            if current and used + len(row) > capacity:
                microbatches.append(Microbatch(tuple(current)))
                current, used = [], 0
            current.append(Sample(a, i, len(row)))
            used += len(row)
    if current:
        microbatches.append(Microbatch(tuple(current)))
    return microbatches


def one_stage_loss_sums(
    forward: Callable[[PackedBatch], torch.Tensor],
    make_batch: Callable[[Microbatch], PackedBatch],
    num_adapters: int,
) -> LossSums:
    """`LossSums` of a one-stage model: ``forward(batch) -> (1, T)`` fp32 token losses."""

    @torch.no_grad()
    def loss_sums(microbatches: Sequence[Microbatch]) -> tuple[torch.Tensor, torch.Tensor]:
        sums = torch.zeros(num_adapters, dtype=torch.float64)
        counts = torch.zeros(num_adapters, dtype=torch.float64)
        for mb in microbatches:
            if mb.is_idle:  # nothing to evaluate (a plan's idle slot)
                continue
            batch = make_batch(mb)
            token_loss = (forward(batch) * batch.loss_mask)[0]  # (T,)
            rows = batch.layout.row_adapter(token_loss.device)
            per = torch.zeros(num_adapters, dtype=torch.float32, device=token_loss.device)
            per.index_add_(0, rows, token_loss.float())
            tokens = torch.zeros(num_adapters, dtype=torch.float32, device=token_loss.device)
            tokens.index_add_(0, rows, batch.loss_mask[0].float())
            sums += per.double().cpu()
            counts += tokens.double().cpu()
        return sums, counts

    return loss_sums
