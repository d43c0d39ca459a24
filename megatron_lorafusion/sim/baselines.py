"""The three strategies the simulator compares on the same samples (LoRAFusion §6).

(a) ``megatron``: one adapter at a time, each global batch packed into microbatches by
    first-fit-decreasing and run as its own pipeline (a flush per optimizer step).
(b) ``mlora``: adapters take turns microbatch by microbatch (round-robin), each microbatch up
    to a fixed number of one adapter's consecutive samples padded to the longest (no
    packing), cut earlier where the padded samples would exceed the token capacity; idle
    microbatches are added only where fewer than ``S`` adapters are left to separate batches.
    Its computed tokens are the padded samples rounded up to the tile height, as our kernels
    (which the GPU benchmark runs it on) compute them.
(c) ``ours``: the plan of `plan_microbatches`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lorafusion.planner._segment import Segment
from megatron_lorafusion.planner.cost import CostModel
from megatron_lorafusion.planner.greedy import pack_ffd
from megatron_lorafusion.planner.makespan import Job, plan_jobs, stream_jobs
from megatron_lorafusion.planner.round_robin import (
    default_samples_per_microbatch,
    padded_pieces,
    padded_tokens_of,
    round_robin,
)
from megatron_lorafusion.planner.types import Microbatch, Plan, PlanProblem
from megatron_lorafusion.sim.simulator import SimResult, simulate, simulate_flushed

__all__ = [
    "StrategyResult",
    "compare_strategies",
    "megatron_jobs",
    "megatron_microbatches",
    "mlora_jobs",
    "mlora_microbatches",
]


@dataclass(frozen=True)
class StrategyResult:
    """One strategy's simulation and token accounting.

    Attributes:
        name: ``"megatron"``, ``"mlora"`` or ``"ours"``.
        sim: the simulation.
        microbatches: microbatches run (idle ones included).
        useful_tokens: real sample tokens.
        computed_tokens: tokens the GPU computes (tile or sequence padding included).
        capacity: tokens per microbatch.
    """

    name: str
    sim: SimResult
    microbatches: int
    useful_tokens: int
    computed_tokens: int
    capacity: int

    @property
    def fill(self) -> float:
        """Computed tokens / (microbatches x capacity): how full microbatches are."""
        return self.computed_tokens / max(1, self.microbatches * self.capacity)

    @property
    def useful_fill(self) -> float:
        """Useful tokens / (microbatches x capacity)."""
        return self.useful_tokens / max(1, self.microbatches * self.capacity)


def megatron_microbatches(problem: PlanProblem) -> list[list[Microbatch]]:
    """Strategy (a) as runnable groups: per adapter and global batch, FFD-packed microbatches.

    Each group is one pipeline run (a flush after it); its last microbatch steps the adapter.
    """
    groups = []
    for a in range(problem.num_adapters):
        for j in range(problem.num_global_batches(a)):
            segment = Segment(
                tuple(problem.global_batch(a, j)), (), {}, problem.capacity, problem.tile_height
            )
            bins = pack_ffd(segment)
            groups.append(
                [
                    Microbatch(tuple(b), (a,) if k == len(bins) - 1 else ())
                    for k, b in enumerate(bins)
                ]
            )
    return groups


def megatron_jobs(problem: PlanProblem, cost: CostModel) -> list[list[Job]]:
    """Strategy (a): the jobs of `megatron_microbatches`, one group per global batch."""
    return [
        stream_jobs(group, cost, problem.tile_height) for group in megatron_microbatches(problem)
    ]


def mlora_microbatches(problem: PlanProblem, samples_per_microbatch: int) -> list[Microbatch]:
    """Strategy (b) as a runnable stream: round-robin microbatches of one adapter's samples.

    Each holds up to ``samples_per_microbatch`` consecutive samples of one adapter, fewer
    where padding them to the longest (the runner does, see `scripts/bench_multi_gpu.py`)
    would exceed the capacity; idle microbatches (no samples) are added only where fewer
    than ``S`` adapters are left to separate an adapter's global batches.
    """
    pieces = padded_pieces(samples_per_microbatch, problem.capacity, problem.tile_height)
    rounds = range(max(problem.num_global_batches(a) for a in range(problem.num_adapters)))
    return round_robin(problem, pieces, rounds)[0]


def mlora_jobs(
    problem: PlanProblem, cost: CostModel, samples_per_microbatch: int
) -> tuple[list[Job], int]:
    """Strategy (b): the jobs of `mlora_microbatches`, every sample padded to the longest.

    Returns:
        The jobs (idle ones included) and the computed tokens (samples padded to the
        longest, the total to the tile height).
    """
    jobs, computed = [], 0
    for mb in mlora_microbatches(problem, samples_per_microbatch):
        if mb.is_idle:
            jobs.append(Job(0.0, 0.0))
            continue
        longest = max(s.tokens for s in mb.samples)
        tokens = padded_tokens_of(mb.samples, problem.tile_height)
        fwd = cost.forward_ms(tokens, longest * longest * len(mb.samples))
        jobs.append(
            Job(fwd, fwd * cost.backward_ratio, mb.adapters, mb.finishes, mb.samples[0].adapter)
        )
        computed += tokens
    return jobs, computed


def compare_strategies(
    problem: PlanProblem, plan: Plan, cost: CostModel, samples_per_microbatch: int | None = None
) -> list[StrategyResult]:
    """Simulate (a) Megatron-style, (b) mLoRA-style and (c) ``plan`` on ``problem``'s samples.

    Args:
        problem: the samples and pipeline.
        plan: our plan of ``problem``.
        cost: the cost model.
        samples_per_microbatch: (b)'s fixed microbatch size; default: capacity / mean
            sample length (so an average microbatch holds about ``capacity`` real tokens).

    Returns:
        Results in the order megatron, mlora, ours.
    """
    useful = sum(sum(x) for x in problem.lengths)
    if samples_per_microbatch is None:
        samples_per_microbatch = default_samples_per_microbatch(problem)
    tile = problem.tile_height
    groups = megatron_jobs(problem, cost)
    mega_tokens = 0
    for a in range(problem.num_adapters):
        for j in range(problem.num_global_batches(a)):
            segment = Segment(tuple(problem.global_batch(a, j)), (), {}, problem.capacity, tile)
            mega_tokens += sum(Microbatch(tuple(b)).padded_tokens(tile) for b in pack_ffd(segment))
    mega = simulate_flushed(groups, problem.num_stages, cost)
    ml_jobs, ml_tokens = mlora_jobs(problem, cost, samples_per_microbatch)
    ml = simulate(ml_jobs, problem.num_stages, cost)
    ours = simulate(plan_jobs(plan, cost), problem.num_stages, cost)
    ours_tokens = sum(mb.padded_tokens(tile) for mb in plan.microbatches)
    cap = problem.capacity
    return [
        StrategyResult("megatron", mega, sum(len(g) for g in groups), useful, mega_tokens, cap),
        StrategyResult("mlora", ml, len(ml_jobs), useful, ml_tokens, cap),
        StrategyResult("ours", ours, len(plan.microbatches), useful, ours_tokens, cap),
    ]
