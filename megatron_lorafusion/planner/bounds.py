"""Lower bounds on the microbatches of any valid plan of a problem (for benchmarks and tests).

Two bounds, the larger holds:

- tokens: every global batch of adapter ``a`` occupies at least its tokens padded once to
  the tile height (splitting a batch over microbatches only adds padding), so the plan
  needs ``ceil(sum of those / capacity)`` microbatches;
- the bubble lemma: adapter ``a``'s global batch ``j`` spans at least
  ``ceil(padded tokens of the batch / capacity)`` positions and the next batch starts at
  least ``S`` positions after it finishes, so ``a`` alone needs
  ``sum_j ceil(.) + (n_a - 1)(S - 1)`` positions, idle or not.
"""

from __future__ import annotations

from megatron_lorafusion.planner._segment import padded
from megatron_lorafusion.planner.types import PlanProblem

__all__ = ["plan_lower_bound"]


def plan_lower_bound(problem: PlanProblem) -> int:
    """Fewest microbatches (idle ones included) any valid plan of ``problem`` can have."""
    cap, tile, S = problem.capacity, problem.tile_height, problem.num_stages
    total, lemma = 0, 0
    for a in range(problem.num_adapters):
        batches = problem.num_global_batches(a)
        loads = [
            padded(sum(s.tokens for s in problem.global_batch(a, j)), tile) for j in range(batches)
        ]
        total += sum(loads)
        lemma = max(lemma, sum(-(-n // cap) for n in loads) + (batches - 1) * (S - 1))
    return max(-(-total // cap), lemma)
