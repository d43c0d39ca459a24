"""The ``plan`` and ``simulate`` sub-commands; `megatron_lorafusion.cli` wires them in.

``plan`` builds a problem from a length distribution or file (or takes a job file's, which
the CLI builds: reading datasets needs torch), plans it, writes the plan as JSON and returns
a summary; ``simulate`` compares Megatron-style, mLoRA-style and our plan in the pipeline
simulator, writes a timeline PNG and a markdown table. Output goes through
the ``write`` callable (the current stdout by default), never ``print``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

from megatron_lorafusion.planner.check import check_plan
from megatron_lorafusion.planner.cost import CostModel
from megatron_lorafusion.planner.io import load_plan, save_plan
from megatron_lorafusion.planner.makespan import Job, plan_jobs
from megatron_lorafusion.planner.plan import DEFAULT_SOLVER, DEFAULT_TIME_LIMIT_S, plan_microbatches
from megatron_lorafusion.planner.policy import apply_length_policy
from megatron_lorafusion.planner.round_robin import default_samples_per_microbatch
from megatron_lorafusion.planner.types import Plan, PlanProblem
from megatron_lorafusion.sim.baselines import StrategyResult, compare_strategies, mlora_jobs
from megatron_lorafusion.sim.distributions import DISTRIBUTIONS, adapter_lengths
from megatron_lorafusion.sim.simulator import SimResult, simulate

__all__ = [
    "PlanRequest",
    "add_plan_arguments",
    "add_simulate_arguments",
    "format_strategy_table",
    "job_argument_problems",
    "problem_from_args",
    "request_from_args",
    "run_plan",
    "run_simulate",
]

Write = Callable[[str], object]


# The synthetic problem's defaults; None in the parsed arguments means "not given", so a
# flag given with --job (where the job sets it) is refused instead of silently ignored.
_DEFAULTS = {
    "lengths": "mix",
    "adapters": 4,
    "samples": 256,
    "global_batch_size": 32,
    "capacity": 6144,
    "stages": 4,
    "tile_height": 64,
    "seed": 0,
    "long_samples": "truncate",
    "solver": DEFAULT_SOLVER,
    "time_limit": DEFAULT_TIME_LIMIT_S,
}
# What the job file sets instead of each flag.
_JOB_KEYS = {
    "lengths": "its adapters' datasets",
    "adapters": "its adapters",
    "samples": "train.steps or train.epochs",
    "global_batch_size": "adapters.<i>.global_batch_size",
    "capacity": "planner.token_capacity",
    "stages": "parallel.pp",
    "tile_height": "planner.tile_height",
    "seed": "train.seed",
    "long_samples": "data.truncation",
    "solver": "planner.solver",
    "time_limit": "planner.time_limit_s",
}


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What to plan and how: from the synthetic length arguments or from a job file.

    Attributes:
        problem: the samples, global batches, capacity and stages.
        solver: ``"greedy"`` or ``"milp"``.
        time_limit_s: wall-clock limit of one MILP solve, in seconds.
        source: where the lengths came from, for the summary (``"xsum lengths"``,
            ``"job configs/demo.yaml"``).
        truncated: per adapter, samples cut to the capacity; None when the data layer cut
            them (a job's ``data.max_seq_length``, logged while tokenising).
        adapter_names: per adapter, its name (a job's), or None (``adapter <id>``).
    """

    problem: PlanProblem
    solver: str
    time_limit_s: float
    source: str
    truncated: tuple[int, ...] | None = None
    adapter_names: tuple[str, ...] | None = None


def _add_problem_arguments(parser: argparse.ArgumentParser) -> None:
    j = parser.add_argument_group("job (instead of the synthetic problem)")
    j.add_argument(
        "--job",
        default=None,
        metavar="FILE",
        help="YAML job file: plan its adapters' datasets, tokenised as `train` would, with "
        "its global batch sizes, steps or epochs, planner settings and parallel.pp stages",
    )
    j.add_argument(
        "overrides", nargs="*", help="dotted overrides of the job, e.g. planner.token_capacity=2048"
    )
    g = parser.add_argument_group("problem")
    g.add_argument(
        "--lengths",
        help=f"length source: one of {(*DISTRIBUTIONS, 'heterogeneous')}, or a file "
        "of integers (JSON list or whitespace/comma separated) (default mix)",
    )
    g.add_argument("--adapters", type=int, help="adapters A (default 4)")
    g.add_argument("--samples", type=int, help="samples per adapter (default 256)")
    g.add_argument(
        "--global-batch-size",
        type=int,
        help="samples per optimizer step, every adapter (default 32)",
    )
    g.add_argument(
        "--capacity", type=int, help="tokens per microbatch, tile padding included (default 6144)"
    )
    g.add_argument("--stages", type=int, help="pipeline stages S (default 4)")
    g.add_argument(
        "--tile-height",
        type=int,
        help="kernel tile height in tokens; each adapter segment is padded to it (default 64)",
    )
    g.add_argument("--seed", type=int, help="seed for lengths and solver (default 0)")
    g.add_argument(
        "--long-samples",
        choices=("truncate", "reject"),
        help="samples longer than a microbatch: cut them or fail (default truncate)",
    )
    s = parser.add_argument_group("solver")
    s.add_argument(
        "--solver", choices=("milp", "greedy"), help=f"packing algorithm (default {DEFAULT_SOLVER})"
    )
    s.add_argument(
        "--time-limit",
        type=float,
        help=f"wall-clock safety limit per MILP solve, s (default {DEFAULT_TIME_LIMIT_S})",
    )


def _given(args: argparse.Namespace, name: str) -> object:
    """The argument's value, or its default when it was not given (or is absent)."""
    value = getattr(args, name, None)
    return _DEFAULTS[name] if value is None else value


def job_argument_problems(args: argparse.Namespace) -> list[str]:
    """Flags that contradict ``--job`` (the job sets them), or overrides without one."""
    if args.job is None:
        return [f"dotted overrides {args.overrides} need --job FILE"] if args.overrides else []
    return [
        f"--{name.replace('_', '-')} does not apply with --job (the job sets it: {key})"
        for name, key in _JOB_KEYS.items()
        if getattr(args, name) is not None
    ]


def problem_from_args(args: argparse.Namespace) -> tuple[PlanProblem, tuple[int, ...]]:
    """Build the problem the arguments describe; also return per-adapter truncation counts.

    Arguments that are None or absent take the defaults of ``lorafusion plan``.

    Raises:
        ValueError: on a bad length source, a rejected long sample or an invalid problem.
    """
    adapters, capacity, tile = (_given(args, k) for k in ("adapters", "capacity", "tile_height"))
    raw = adapter_lengths(
        _given(args, "lengths"), adapters, _given(args, "samples"), _given(args, "seed")
    )
    fitted = apply_length_policy(raw, capacity, tile, _given(args, "long_samples"))
    problem = PlanProblem(
        fitted.lengths,
        (_given(args, "global_batch_size"),) * adapters,
        capacity,
        _given(args, "stages"),
        tile,
        _given(args, "seed"),
    )
    return problem, fitted.truncated


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    """The synthetic problem of the arguments, with their solver and time limit.

    Raises:
        ValueError: as `problem_from_args`.
    """
    problem, truncated = problem_from_args(args)
    return PlanRequest(
        problem,
        _given(args, "solver"),
        _given(args, "time_limit"),
        f"{_given(args, 'lengths')} lengths",
        truncated,
    )


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``lorafusion plan``."""
    _add_problem_arguments(parser)
    parser.add_argument("--output", default="plan.json", help="plan JSON to write")


def _adapters_line(names: tuple[str, ...], problem: PlanProblem) -> str:
    sizes = zip(names, problem.lengths, problem.global_batch_sizes, strict=True)
    return "adapters: " + ", ".join(
        f"{name} ({len(lengths)} samples, {gbs} per step)" for name, lengths, gbs in sizes
    )


def _summary(plan: Plan, request: PlanRequest) -> str:
    problem = request.problem
    mbs = plan.microbatches
    capacity = len(mbs) * problem.capacity
    padded = sum(mb.padded_tokens(problem.tile_height) for mb in mbs)
    useful = sum(mb.tokens for mb in mbs)
    r = plan.report
    cut = "" if request.truncated is None else f", truncated: {sum(request.truncated)}"
    lines = [
        f"samples: {sum(len(x) for x in problem.lengths)} in {problem.num_adapters} adapters "
        f"({request.source}{cut})",
        f"microbatches: {len(mbs)} ({sum(mb.is_idle for mb in mbs)} idle); "
        f"fill {100 * padded / capacity:.2f}% with tile padding, {100 * useful / capacity:.2f}% "
        "useful",
    ]
    if request.adapter_names is not None:
        lines.insert(1, _adapters_line(request.adapter_names, problem))
    if r is not None:
        lines.append(
            f"solver: {r.solver} (kept {r.chosen}; greedy {r.greedy_microbatches} "
            f"microbatches); {r.segments} segments, {r.milp_solves} MILP solves, "
            f"{r.milp_improved} improved, {r.time_limit_hits} time-limit hits, "
            f"{r.bins_over_bound} microbatches over the lower bound; {r.wall_s:.3f} s"
        )
    return "\n".join(lines) + "\n"


def run_plan(
    args: argparse.Namespace,
    write: Write | None = None,
    request: PlanRequest | None = None,
) -> int:
    """Plan, verify, write the JSON to ``args.output`` and a summary to ``write``.

    Args:
        args: the parsed ``plan`` arguments.
        write: receives the summary (default: the current ``sys.stdout``).
        request: what to plan (a job's, built by the CLI); default: `request_from_args`.

    Returns:
        The exit status (0).
    """
    request = request if request is not None else request_from_args(args)
    plan = plan_microbatches(request.problem, request.solver, request.time_limit_s)
    path = save_plan(plan, args.output)
    (write or sys.stdout.write)(_summary(plan, request) + f"wrote {path}\n")
    return 0


_COST_FIELDS = tuple(f.name for f in dataclasses.fields(CostModel))


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``lorafusion simulate``."""
    _add_problem_arguments(parser)
    parser.add_argument(
        "--plan",
        default=None,
        help="plan JSON from `plan` with the same problem arguments or job (default: plan now)",
    )
    parser.add_argument("--png", default="timeline.png", help="timeline image to write")
    t = parser.add_argument_group("a server's job trace (--trace: what-ifs at cluster scale)")
    t.add_argument(
        "--trace",
        action="store_true",
        help="simulate a trace of LoRA jobs arriving at one server under each policy "
        "(online, shortest = shortest remaining first, fifo = one at a time, batch = static "
        "batches; sim/trace.py; --capacity: tokens per microbatch, default 8192 here)",
    )
    t.add_argument("--jobs", type=int, default=32, help="jobs in the trace (default 32)")
    t.add_argument("--load", type=float, default=0.8, help="offered load / throughput (0.8)")
    t.add_argument(
        "--tokens-per-s", type=float, default=60000.0, help="server throughput R (60000)"
    )
    t.add_argument(
        "--alone-tokens-per-s", type=float, default=None, help="one job alone (default R)"
    )
    t.add_argument(
        "--served-tokens-per-s",
        type=float,
        default=None,
        help="the server's throughput while jobs join and leave (default R, which also sets "
        "the arrivals: what-ifs of a slower server on the same trace)",
    )
    t.add_argument(
        "--max-seq-length", type=int, default=2048, help="samples cut at this many tokens"
    )
    t.add_argument("--max-adapters", type=int, default=32, help="jobs at once (default 32)")
    t.add_argument("--size-scale", type=float, default=1.0, help="job sizes × this (1.0)")
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


# An idle microbatch costs nothing, so the simulator records no operation for it; drawn with
# one nanosecond per operation it gets events at the simulator's own times (shifting later
# ones by at most 1 ns each, far below the timeline's resolution), which the timeline marks.
_IDLE_MS = 1e-6


def _timelines(
    results: list[StrategyResult], problem: PlanProblem, plan: Plan, cost: CostModel, k: int
) -> list[tuple[str, SimResult]]:
    """The panels to draw: the strategies' simulations, their idle microbatches visible."""

    def visible(jobs: list[Job]) -> SimResult:
        jobs = [
            dataclasses.replace(j, forward_ms=_IDLE_MS, backward_ms=_IDLE_MS)
            if not j.adapters and not j.stage_ms
            else j
            for j in jobs
        ]
        return simulate(jobs, problem.num_stages, cost)

    streams = {  # Megatron-style runs have no idle microbatches
        "mlora": lambda: mlora_jobs(problem, cost, k)[0],
        "ours": lambda: plan_jobs(plan, cost),
    }
    return [(r.name, visible(streams[r.name]()) if r.name in streams else r.sim) for r in results]


def _run_trace(args: argparse.Namespace, write: Write) -> int:
    """``simulate --trace``: one trace, each policy's makespan and job completion times."""
    from megatron_lorafusion.sim.trace import (
        POLICIES,
        best_mean_jct,
        make_trace,
        simulate_trace,
        summarize,
    )

    jobs = make_trace(
        args.jobs,
        seed=args.seed or 0,
        load=args.load,
        tokens_per_s=args.tokens_per_s,
        size_scale=args.size_scale,
        max_length=args.max_seq_length,
    )
    served = args.served_tokens_per_s or args.tokens_per_s
    rows = [
        "| policy | makespan s | mean JCT s | p50 JCT s | p95 JCT s | mean queue s | busy |",
        "|---|---|---|---|---|---|---|",
    ]
    for policy in POLICIES:
        result = simulate_trace(
            jobs,
            policy,
            served,
            args.max_adapters,
            alone_tokens_per_s=args.alone_tokens_per_s or args.tokens_per_s,
            microbatch_tokens=args.capacity if args.capacity is not None else 8192,
        )
        s = summarize(result)
        rows.append(
            f"| {policy} | {s['makespan_s']:.0f} | {s['mean_jct_s']:.1f} | {s['p50_jct_s']:.1f} "
            f"| {s['p95_jct_s']:.1f} | {s['mean_queue_s']:.1f} | {100 * s['busy']:.0f}% |"
        )
    tokens = sum(j.tokens for j in jobs)
    write(
        f"trace: {len(jobs)} jobs, {tokens:,} tokens, last arrival at "
        f"{jobs[-1].arrival_s:.0f} s, offered load {args.load} of {args.tokens_per_s:,.0f} "
        f"tokens/s, {args.max_adapters} jobs at once\n" + "\n".join(rows) + "\n"
        f"no schedule beats a mean JCT of {best_mean_jct(jobs, args.tokens_per_s):.1f} s "
        "(shortest remaining first at the full rate)\n"
    )
    return 0


def run_simulate(
    args: argparse.Namespace,
    write: Write | None = None,
    request: PlanRequest | None = None,
) -> int:
    """Simulate the three strategies; write the table to ``write`` and the PNG to ``args.png``.

    Args:
        args: the parsed ``simulate`` arguments.
        write: receives the table (default: the current ``sys.stdout``).
        request: what to plan (a job's, built by the CLI); default: `request_from_args`.

    Returns:
        The exit status (0).

    Raises:
        PlanError: if ``--plan`` does not fit the problem the arguments describe.
    """
    from megatron_lorafusion.sim.timeline import draw_timelines

    if getattr(args, "trace", False):
        return _run_trace(args, write or sys.stdout.write)
    request = request if request is not None else request_from_args(args)
    problem = request.problem
    if args.plan:
        plan = load_plan(args.plan)
        check_plan(plan, problem)
    else:
        plan = plan_microbatches(problem, request.solver, request.time_limit_s)
    cost = _cost_from_args(args)
    k = (
        default_samples_per_microbatch(problem)
        if args.mlora_samples is None
        else args.mlora_samples
    )
    results = compare_strategies(problem, plan, cost, k)
    panels = _timelines(results, problem, plan, cost, k)
    path = draw_timelines(panels, args.png, request.adapter_names)
    (write or sys.stdout.write)(format_strategy_table(results) + f"wrote {path}\n")
    return 0
