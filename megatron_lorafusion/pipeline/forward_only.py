"""Forward-only passes through the pipeline: per-adapter loss sums of eval microbatches.

Every rank of a ``PP × DP`` grid walks the same list of microbatches; each DP replica takes
its share of each (`data_parallel_share`), each stage receives its input hidden states,
runs its layers without gradients and sends the output on; the last stage adds each
adapter's masked token losses and trained-token counts. One all-reduce over the world then
gives every rank the totals (only the last stage's first TP rank contributes, so TP peers
are counted once), so every rank can take the same early-stopping decision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_lorafusion.pipeline.groups import PipelineGroups
from megatron_lorafusion.pipeline.runner import StageForward
from megatron_lorafusion.pipeline.schedule import data_parallel_share
from megatron_lorafusion.planner import Microbatch

if TYPE_CHECKING:
    from megatron_lorafusion.data import PackedBatch

__all__ = ["forward_loss_sums"]


@torch.no_grad()
def forward_loss_sums(
    microbatches: Sequence[Microbatch],
    forward: StageForward,
    make_batch: Callable[[Microbatch], PackedBatch],
    groups: PipelineGroups,
    *,
    num_adapters: int,
    hidden_size: int,
    activation_dtype: torch.dtype,
    device: torch.device | str,
    counts_once: bool,
    sequence_shards: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per adapter, the summed token loss and trained tokens of ``microbatches`` (all ranks).

    A collective: every rank of the world calls it with the same microbatches, after any
    training call has drained (no activation or gradient in flight).

    Args:
        microbatches: the eval rows' microbatches (the same list on every rank).
        forward: this stage's model forward (see `StageForward`).
        make_batch: packs a microbatch (this replica's share).
        groups: this rank's pipeline and data-parallel groups.
        num_adapters: ``A``.
        hidden_size: ``H`` of the activations passed between stages.
        activation_dtype: dtype of those activations.
        device: where receive buffers live (the model's device).
        counts_once: this rank adds its sums to the totals (the first TP rank; TP peers
            compute the same losses).
        sequence_shards: the TP size under sequence parallelism, else 1.

    Returns:
        ``(loss sums, token counts)``, each (A,) float64 on the CPU, summed over the job.
    """
    totals = torch.zeros(2, num_adapters, dtype=torch.float64, device=torch.device(device))
    sends = []
    for mb in microbatches:
        share = data_parallel_share(mb, groups.dp_rank, groups.dp_size)
        if share.is_idle:
            continue
        batch = make_batch(share)
        input_tensor = None
        if not groups.is_first:
            rows = batch.layout.num_tokens // sequence_shards
            input_tensor = torch.empty(
                rows, 1, hidden_size, dtype=activation_dtype, device=totals.device
            )
            dist.irecv(input_tensor, src=groups.prev_rank, group=groups.forward_group).wait()
        output = forward(batch, input_tensor)
        if not groups.is_last:
            output = output.contiguous()
            sends.append(
                (dist.isend(output, dst=groups.next_rank, group=groups.forward_group), output)
            )
            continue
        token_loss = (output * batch.loss_mask)[0]  # (T,)
        rows = batch.layout.row_adapter(token_loss.device)
        totals[0].index_add_(0, rows, token_loss.double())
        totals[1].index_add_(0, rows, batch.loss_mask[0].double())
    for work, _ in sends:
        work.wait()
    if not (groups.is_last and counts_once):
        totals.zero_()
    dist.all_reduce(totals)
    totals = totals.cpu()
    return totals[0], totals[1]
