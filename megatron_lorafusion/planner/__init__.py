"""Microbatch planning for many adapters: grouping, MILP packing, merging, checks.

No torch and no Megatron here: `plan_microbatches` turns a `PlanProblem` into a verified
`Plan`; `BackgroundPlanner` does it chunk by chunk in a worker process; `simulate_makespan`
is the makespan estimate the planner chooses streams by (LoRAFusion, arXiv 2510.00206, §4).
The simulator, baselines and timelines that evaluate plans are `megatron_lorafusion.sim`.
"""

from megatron_lorafusion.planner.background import BackgroundPlanner, PlannerWorkerError
from megatron_lorafusion.planner.check import (
    BubbleLemma,
    LemmaError,
    PlanError,
    PlanVerifier,
    check_plan,
)
from megatron_lorafusion.planner.cost import CostModel
from megatron_lorafusion.planner.makespan import Job, plan_jobs, simulate_makespan, stream_jobs
from megatron_lorafusion.planner.plan import iter_plan_chunks, plan_greedy, plan_microbatches
from megatron_lorafusion.planner.policy import (
    LengthPolicyResult,
    apply_length_policy,
    max_sample_tokens,
)
from megatron_lorafusion.planner.types import Microbatch, Plan, PlanProblem, Sample, SolveReport

__all__ = [
    "BackgroundPlanner",
    "BubbleLemma",
    "CostModel",
    "Job",
    "LemmaError",
    "LengthPolicyResult",
    "Microbatch",
    "Plan",
    "PlanError",
    "PlanProblem",
    "PlanVerifier",
    "PlannerWorkerError",
    "Sample",
    "SolveReport",
    "apply_length_policy",
    "check_plan",
    "iter_plan_chunks",
    "max_sample_tokens",
    "plan_greedy",
    "plan_jobs",
    "plan_microbatches",
    "simulate_makespan",
    "stream_jobs",
]
