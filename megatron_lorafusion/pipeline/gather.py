"""Assemble each adapter's full (unsharded, all stages) weights on rank 0 for export.

Under pipeline parallelism a rank holds only its stage's layers; under tensor parallelism
only its shard of each factor (column-parallel linears shard B on N with the base weight's
partition stride, row-parallel linears shard A on H; DESIGN.md "LoRA wrapper";
`LoRAContext.sharding` gives each factor's split). Adapter factors are small (rank x width),
so one ``all_gather_object`` of every rank's CPU copies is enough; rank 0 keeps
data-parallel replica 0 and undoes the sharding with `unshard_tp`, which checkpoints use too.
No Megatron import here: `train.checkpoint` (and so ``lorafusion export``) reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["gather_adapter_states", "unshard_tp"]


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


def gather_adapter_states(
    lora,
    *,
    tp_rank: int,
    tp_size: int,
    dp_rank: int,
    local: list[dict[str, torch.Tensor] | None] | None = None,
) -> list[dict[str, torch.Tensor]] | None:
    """Every adapter's full state dict on global rank 0 (a collective over the world).

    Args:
        lora: this rank's `LoRAContext`.
        tp_rank: this rank's tensor-parallel rank.
        tp_size: tensor-parallel size.
        dp_rank: this rank's data-parallel rank (only replica 0 is kept).
        local: per adapter, this rank's factors to gather instead of the current ones (an
            early-stopped adapter's best); None entries (or None): the current weights.

    Returns:
        On rank 0, per adapter id, ``{"decoder.layers.{i}.<parent>.<linear>.lora_A|B": fp32
        CPU tensor}`` over all layers, unsharded; None on other ranks.
    """
    rules = lora.sharding()
    local = local or [None] * lora.num_adapters
    states = [
        {k: v.cpu() for k, v in (local[a] or lora.adapter_state_dict(a)).items()}
        for a in range(lora.num_adapters)
    ]
    payload = (tp_rank, dp_rank, rules, states)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, payload)
    if dist.get_rank() != 0:
        return None
    replica = [p for p in gathered if p[1] == 0]
    merged: list[dict[str, torch.Tensor]] = []
    for a in range(lora.num_adapters):
        shards: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for tp, _, _, rank_states in replica:
            for key, value in rank_states[a].items():
                shards.setdefault(key, []).append((tp, value))
        all_rules = {n: r for p in replica for n, r in p[2].items()}
        full = {}
        for key, parts in sorted(shards.items()):
            parts = [v for _, v in sorted(parts, key=lambda tv: tv[0])]
            split = all_rules[key]
            full[key] = parts[0] if split is None or tp_size == 1 else unshard_tp(parts, *split)
        merged.append(full)
    return merged
