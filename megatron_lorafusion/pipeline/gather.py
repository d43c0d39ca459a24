"""Undo the tensor-parallel split of an adapter factor (checkpoints of TP runs read it).

Under tensor parallelism a rank holds only its shard of each factor (column-parallel linears
shard B on N with the base weight's partition stride, row-parallel linears shard A on H;
DESIGN.md "LoRA wrapper"; `LoRAContext.sharding` gives each factor's split). No Megatron
import here: `train.checkpoint` (and so ``lorafusion export``) reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["unshard_tp"]


def unshard_tp(shards: Sequence[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Undo Megatron's strided TP split of one tensor.

    The full tensor is cut along ``dim`` into ``TP·stride`` chunks dealt round-robin: rank
    ``r`` holds chunks ``r, r + TP, …`` (``stride`` of them, concatenated).

    Args:
        shards: per TP rank in order, its shard.
        dim: the split dimension (0: column-parallel B (N_local, R); 1: row-parallel A
            (R, H_local)).
        stride: the partition stride (1 unless the base weight interleaves, e.g. fused
            gate/up).

    Returns:
        The full tensor.
    """
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[r][j] for j in range(stride) for r in range(len(shards))], dim=dim)
