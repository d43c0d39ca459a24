"""The ``plan`` and ``simulate`` sub-commands; `megatron_lorafusion.cli` wires them in.

``plan`` builds a problem from a length distribution or file, plans it, writes the plan as
JSON and returns a summary; ``simulate`` compares Megatron-style, mLoRA-style and our plan
in the pipeline simulator, writes a timeline PNG and a markdown table. Output goes through
the ``write`` callable (stdout by default), never ``print``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

from megatron_lorafusion.planner.baselines import StrategyResult, compare_strategies
from megatron_lorafusion.planner.check import check_plan
from megatron_lorafusion.planner.cost import CostModel
from megatron_lorafusion.planner.distributions import DISTRIBUTIONS, adapter_lengths
from megatron_lorafusion.planner.io import load_plan, save_plan
from megatron_lorafusion.planner.plan import DEFAULT_SOLVER, DEFAULT_TIME_LIMIT_S, plan_microbatches
from megatron_lorafusion.planner.policy import apply_length_policy
from megatron_lorafusion.planner.types import Plan, PlanProblem

__all__ = [
    "add_plan_arguments",
    "add_simulate_arguments",
    "format_strategy_table",
    "problem_from_args",
    "run_plan",
    "run_simulate",
]

Write = Callable[[str], object]


def _add_problem_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("problem")
    g.add_argument(
        "--lengths",
        default="mix",
        help=f"length source: one of {(*DISTRIBUTIONS, 'heterogeneous')}, or a file "
        "of integers (JSON list or whitespace/comma separated)",
    )
    g.add_argument("--adapters", type=int, default=4, help="adapters A (default 4)")
    g.add_argument("--samples", type=int, default=256, help="samples per adapter (default 256)")
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=32,
        help="samples per optimizer step, every adapter (default 32)",
    )
    g.add_argument(
        "--capacity",
        type=int,
        default=6144,
        help="tokens per microbatch, tile padding included (default 6144)",
    )
    g.add_argument("--stages", type=int, default=4, help="pipeline stages S (default 4)")
    g.add_argument(
        "--tile-height",
        type=int,
        default=64,
        help="kernel tile height in tokens; each adapter segment is padded to it",
    )
    g.add_argument("--seed", type=int, default=0, help="seed for lengths and solver")
    g.add_argument(
        "--long-samples",
        choices=("truncate", "reject"),
        default="truncate",
        help="samples longer than a microbatch: cut them or fail (default truncate)",
    )
    s = parser.add_argument_group("solver")
    s.add_argument("--solver", choices=("milp", "greedy"), default=DEFAULT_SOLVER)
    s.add_argument(
        "--time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT_S,
        help=f"wall-clock safety limit per MILP solve, s (default {DEFAULT_TIME_LIMIT_S})",
    )


def problem_from_args(args: argparse.Namespace) -> tuple[PlanProblem, tuple[int, ...]]:
    """Build the problem the arguments describe; also return per-adapter truncation counts.

    Raises:
        ValueError: on a bad length source, a rejected long sample or an invalid problem.
    """
    raw = adapter_lengths(args.lengths, args.adapters, args.samples, args.seed)
    fitted = apply_length_policy(raw, args.capacity, args.tile_height, args.long_samples)
    problem = PlanProblem(
        fitted.lengths,
        (args.global_batch_size,) * args.adapters,
        args.capacity,
        args.stages,
        args.tile_height,
        args.seed,
    )
    return problem, fitted.truncated


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``lorafusion plan``."""
    _add_problem_arguments(parser)
    parser.add_argument("--output", default="plan.json", help="plan JSON to write")


def _summary(plan: Plan, problem: PlanProblem, truncated: tuple[int, ...]) -> str:
    mbs = plan.microbatches
    capacity = len(mbs) * problem.capacity
    padded = sum(mb.padded_tokens(problem.tile_height) for mb in mbs)
    useful = sum(mb.tokens for mb in mbs)
    r = plan.report
    lines = [
        f"samples: {sum(len(x) for x in problem.lengths)} in {problem.num_adapters} adapters "
        f"(truncated: {sum(truncated)})",
        f"microbatches: {len(mbs)} ({sum(mb.is_idle for mb in mbs)} idle); "
        f"fill {100 * padded / capacity:.2f}% with tile padding, {100 * useful / capacity:.2f}% "
        "useful",
    ]
    if r is not None:
        lines.append(
            f"solver: {r.solver} (kept {r.chosen}; greedy {r.greedy_microbatches} "
            f"microbatches); {r.segments} segments, {r.milp_solves} MILP solves, "
            f"{r.milp_improved} improved, {r.time_limit_hits} time-limit hits, "
            f"{r.bins_over_bound} microbatches over the lower bound; {r.wall_s:.3f} s"
        )
    return "\n".join(lines) + "\n"


def run_plan(args: argparse.Namespace, write: Write = sys.stdout.write) -> int:
    """Plan, verify, write the JSON to ``args.output`` and a summary to ``write``.

    Returns:
        The exit status (0).
    """
    problem, truncated = problem_from_args(args)
    plan = plan_microbatches(problem, args.solver, args.time_limit)
    path = save_plan(plan, args.output)
    write(_summary(plan, problem, truncated) + f"wrote {path}\n")
    return 0


_COST_FIELDS = tuple(f.name for f in dataclasses.fields(CostModel))


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``lorafusion simulate``."""
    _add_problem_arguments(parser)
    parser.add_argument(
        "--plan",
        default=None,
        help="plan JSON from `plan` with the same problem arguments (default: plan now)",
    )
    parser.add_argument("--png", default="timeline.png", help="timeline image to write")
    parser.add_argument(
        "--mlora-samples",
        type=int,
        default=None,
        help="mLoRA-style samples per microbatch (default: capacity / mean length)",
    )
    c = parser.add_argument_group("cost model (ms per stage)")
    c.add_argument(
        "--cost-profile",
        default=None,
        help="JSON of coefficients or measured points (see CostModel.from_profile)",
    )
    defaults = CostModel()
    for name in _COST_FIELDS:
        c.add_argument(
            f"--{name.replace('_', '-')}",
            type=float,
            default=None,
            help=f"override (default {getattr(defaults, name)})",
        )


def _cost_from_args(args: argparse.Namespace) -> CostModel:
    base = CostModel.from_profile(args.cost_profile) if args.cost_profile else CostModel()
    overrides = {k: getattr(args, k) for k in _COST_FIELDS if getattr(args, k) is not None}
    return CostModel(**{**base.__dict__, **overrides})


def format_strategy_table(results: list[StrategyResult]) -> str:
    """Markdown table of simulated strategies."""
    names = {
        "megatron": "(a) Megatron-style, flush per step",
        "mlora": "(b) mLoRA-style, round-robin, padded",
        "ours": "(c) ours: grouped + MILP + merged",
    }
    rows = [
        "| strategy | microbatches | makespan ms | bubble % | fill % | useful fill % | "
        "stage utilization % |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        util = " / ".join(f"{100 * u:.0f}" for u in r.sim.utilization)
        rows.append(
            f"| {names.get(r.name, r.name)} | {r.microbatches} | "
            f"{r.sim.makespan_ms:.0f} | {100 * r.sim.bubble_ratio:.2f} | "
            f"{100 * r.fill:.1f} | {100 * r.useful_fill:.1f} | {util} |"
        )
    return "\n".join(rows) + "\n"


def run_simulate(args: argparse.Namespace, write: Write = sys.stdout.write) -> int:
    """Simulate the three strategies; write the table to ``write`` and the PNG to ``args.png``.

    Returns:
        The exit status (0).

    Raises:
        PlanError: if ``--plan`` does not fit the problem the arguments describe.
    """
    from megatron_lorafusion.planner.timeline import draw_timelines

    problem, _ = problem_from_args(args)
    if args.plan:
        plan = load_plan(args.plan)
        check_plan(plan, problem)
    else:
        plan = plan_microbatches(problem, args.solver, args.time_limit)
    results = compare_strategies(problem, plan, _cost_from_args(args), args.mlora_samples)
    path = draw_timelines([(r.name, r.sim) for r in results], args.png)
    write(format_strategy_table(results) + f"wrote {path}\n")
    return 0
