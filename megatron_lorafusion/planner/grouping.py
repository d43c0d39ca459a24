"""Adapter grouping: which adapters share a segment, so the bubble lemma holds cheaply.

A round packs global batch ``r`` of every active adapter, one group after another. Between
two global batches of an adapter in group ``g`` lie the other groups' segments; since each
segment shares its first microbatch with the previous segment's tail (merging), they give
about ``sum_{h != g} (M_h - 1)`` microbatches, where ``M_h`` is the expected microbatch count
of group ``h``'s batches. We pick the fewest groups (bigger segments pack better) for which
that is at least ``S`` for every group, assigning adapters sorted by mean sample length in
snake order so long-sample adapters share a group with short-sample ones (LoRAFusion §4).
What this estimate misses is caught by the per-adapter release bins of the packers.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_lorafusion.planner.types import PlanProblem

__all__ = ["group_adapters"]


def _snake(order: Sequence[int], num_groups: int) -> list[list[int]]:
    groups: list[list[int]] = [[] for _ in range(num_groups)]
    for i, a in enumerate(order):
        lap, pos = divmod(i, num_groups)
        groups[pos if lap % 2 == 0 else num_groups - 1 - pos].append(a)
    return groups


def group_adapters(problem: PlanProblem, active: Sequence[int]) -> list[tuple[int, ...]]:
    """Split the ``active`` adapters into ordered groups.

    Args:
        problem: gives each adapter's lengths, global batch size, the capacity and ``S``.
        active: adapters that still have global batches to run.

    Returns:
        Groups in segment order, each a sorted tuple of adapter ids. With ``S = 1`` or a
        single adapter there is one group; if no grouping separates batches well enough,
        each adapter is its own group (round-robin by global batch).
    """
    active = sorted(active)
    if problem.num_stages == 1 or len(active) <= 1:
        return [tuple(active)] if active else []
    mean = {a: sum(problem.lengths[a]) / len(problem.lengths[a]) for a in active}
    load = {
        a: sum(problem.lengths[a]) / problem.num_global_batches(a) / problem.capacity
        for a in active
    }
    order = sorted(active, key=lambda a: (-mean[a], a))
    for num_groups in range(2, len(active) + 1):
        groups = _snake(order, num_groups)
        group_load = [sum(load[a] for a in g) for g in groups]
        slack = [
            sum(gl - 1 for h, gl in enumerate(group_load) if h != g) for g in range(num_groups)
        ]
        if min(slack) >= problem.num_stages:
            return [tuple(sorted(g)) for g in groups]
    return [(a,) for a in order]
