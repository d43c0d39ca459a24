"""Microbatch planning for many adapters: grouping, MILP packing, merging, checks, simulation.

No torch and no Megatron here: `plan_microbatches` turns a `PlanProblem` into a verified
`Plan`; `BackgroundPlanner` does it chunk by chunk in a worker process; `simulate` and
`compare_strategies` measure a plan's pipeline bubbles (LoRAFusion, arXiv 2510.00206, §4).
"""

from megatron_lorafusion.planner.background import BackgroundPlanner, PlannerWorkerError
from megatron_lorafusion.planner.baselines import StrategyResult, compare_strategies
from megatron_lorafusion.planner.check import PlanError, PlanVerifier, check_plan
from megatron_lorafusion.planner.cost import CostModel
from megatron_lorafusion.planner.distributions import (
    DISTRIBUTIONS,
    adapter_lengths,
    load_lengths,
    sample_lengths,
)
from megatron_lorafusion.planner.greedy import plan_greedy
from megatron_lorafusion.planner.plan import iter_plan_chunks, plan_microbatches
from megatron_lorafusion.planner.policy import (
    LengthPolicyResult,
    apply_length_policy,
    max_sample_tokens,
)
from megatron_lorafusion.planner.simulator import Job, SimResult, simulate, simulate_flushed
from megatron_lorafusion.planner.types import Microbatch, Plan, PlanProblem, Sample, SolveReport

__all__ = [
    "DISTRIBUTIONS",
    "BackgroundPlanner",
    "CostModel",
    "Job",
    "LengthPolicyResult",
    "Microbatch",
    "Plan",
    "PlanError",
    "PlanProblem",
    "PlanVerifier",
    "PlannerWorkerError",
    "Sample",
    "SimResult",
    "SolveReport",
    "StrategyResult",
    "adapter_lengths",
    "apply_length_policy",
    "check_plan",
    "compare_strategies",
    "iter_plan_chunks",
    "load_lengths",
    "max_sample_tokens",
    "plan_greedy",
    "plan_microbatches",
    "sample_lengths",
    "simulate",
    "simulate_flushed",
]
