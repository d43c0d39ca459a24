"""Evaluating plans: a pipeline simulator, the baselines, length distributions, timelines.

Builds on `megatron_lorafusion.planner` (never the other way round) and, like it, imports
no torch: `simulate` runs a stream of `Job`s through an ``S``-stage 1F1B model,
`compare_strategies` sets Megatron-style and mLoRA-style runs beside a plan (LoRAFusion,
arXiv 2510.00206, §6), `distributions` draws dataset-shaped sample lengths, `timeline`
draws the simulated stages (matplotlib), `commands` is the ``plan``/``simulate`` CLI.
"""

from megatron_lorafusion.sim.baselines import StrategyResult, compare_strategies
from megatron_lorafusion.sim.distributions import (
    DISTRIBUTIONS,
    adapter_lengths,
    load_lengths,
    sample_lengths,
)
from megatron_lorafusion.sim.simulator import Event, SimResult, simulate, simulate_flushed

__all__ = [
    "DISTRIBUTIONS",
    "Event",
    "SimResult",
    "StrategyResult",
    "adapter_lengths",
    "compare_strategies",
    "load_lengths",
    "sample_lengths",
    "simulate",
    "simulate_flushed",
]
