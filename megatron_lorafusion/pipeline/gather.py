"""Assemble each adapter's full (unsharded, all stages) weights on rank 0 for export.

Under pipeline parallelism a rank holds only its stage's layers; under tensor parallelism
only its shard of each factor (column-parallel linears shard B on N with the base weight's
partition stride, row-parallel linears shard A on H; DESIGN.md "LoRA wrapper"). Adapter
factors are small (rank x width), so one ``all_gather_object`` of every rank's CPU copies is
enough; rank 0 keeps data-parallel replica 0 and undoes the sharding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gather_adapter_states"]


def _shard_rule(wrapper) -> tuple[str, int]:
    """``(sharded factor, partition stride)``: ``("lora_B", stride)`` or ``("lora_A", 1)``."""
    from megatron_lorafusion.mcore import LoRAColumnParallelLinear

    if isinstance(wrapper, LoRAColumnParallelLinear):
        return "lora_B", int(getattr(wrapper.base.weight, "partition_stride", 1))
    return "lora_A", 1


def _unshard(shards: list[torch.Tensor], factor: str, stride: int) -> torch.Tensor:
    """Inverse of Megatron's strided split: full = chunks of ``TP·stride``, dealt round-robin."""
    if factor == "lora_A":  # row-parallel: A (r, H_local) along H
        return torch.cat(shards, dim=1)
    tp = len(shards)
    pieces = [s.chunk(stride, dim=0) for s in shards]  # per rank, its `stride` chunks
    return torch.cat([pieces[i % tp][i // tp] for i in range(tp * stride)], dim=0)


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
    rules = {name: _shard_rule(w) for name, w in lora.wrappers.items()}
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
            linear, factor = key.rsplit(".", 1)
            sharded, stride = all_rules[linear]
            if tp_size > 1 and factor == sharded:
                full[key] = _unshard(parts, factor, stride)
            else:
                full[key] = parts[0]
        merged.append(full)
    return merged
