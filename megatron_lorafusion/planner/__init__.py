"""Microbatch planning for many adapters: packing, grouping, checks (no torch, no Megatron)."""

from megatron_lorafusion.planner.greedy import plan_greedy
from megatron_lorafusion.planner.types import Microbatch, Plan, PlanProblem, Sample

__all__ = ["Microbatch", "Plan", "PlanProblem", "Sample", "plan_greedy"]
