"""Greedy first-fit-decreasing packing, one round of global batches at a time.

The simple packer of the walking skeleton and the fallback of the MILP planner.
"""

from __future__ import annotations

from megatron_lorafusion.planner.types import Microbatch, Plan, PlanProblem, Sample


def _pack_ffd(samples: list[Sample], capacity: int, tile_height: int) -> list[list[Sample]]:
    """First-fit-decreasing bins of padded size at most ``capacity``."""
    bins: list[list[Sample]] = []
    for sample in sorted(samples, key=lambda s: (-s.tokens, s.adapter, s.index)):
        for members in bins:
            if Microbatch(tuple(members + [sample])).padded_tokens(tile_height) <= capacity:
                members.append(sample)
                break
        else:
            bins.append([sample])
    return bins


def plan_greedy(problem: PlanProblem) -> Plan:
    """Pack round ``j`` = global batch ``j`` of every adapter, rounds in order.

    Each round is packed first-fit-decreasing; an adapter finishes its global batch on the
    last microbatch of the round that holds one of its samples.

    Raises:
        ValueError: if a sample does not fit the capacity on its own.
    """
    microbatches: list[Microbatch] = []
    rounds = max((problem.num_global_batches(a) for a in range(problem.num_adapters)), default=0)
    for step in range(rounds):
        samples = [
            s
            for a in range(problem.num_adapters)
            if step < problem.num_global_batches(a)
            for s in problem.global_batch(a, step)
        ]
        for s in samples:
            if -(-s.tokens // problem.tile_height) * problem.tile_height > problem.capacity:
                raise ValueError(
                    f"adapter {s.adapter} sample {s.index} has {s.tokens} tokens, "
                    f"more than the microbatch capacity {problem.capacity}"
                )
        bins = [sorted(b, key=lambda s: (s.adapter, s.index))
                for b in _pack_ffd(samples, problem.capacity, problem.tile_height)]
        last_bin = {s.adapter: i for i, b in enumerate(bins) for s in b}
        for i, members in enumerate(bins):
            finishes = tuple(sorted(a for a, last in last_bin.items() if last == i))
            microbatches.append(Microbatch(tuple(members), finishes))
    return Plan(tuple(microbatches), problem.capacity, problem.tile_height, problem.num_adapters)
