"""Planner benchmark: bubble ratio of three strategies, token fill, planning throughput.

Run: python -m scripts.bench_planner [--samples 256] [--solver greedy|milp] [--csv out.csv]

For 4 adapters, S = 4 stages, capacity 6144 tokens, tile height 64, global batch 32
samples per adapter, and each length distribution (XSum, CNN/DM, WikiSum, mix,
heterogeneous = one adapter of each), it plans with the chosen solver (default: the
planner's default), checks the plan, and simulates (a) Megatron-style (one adapter at a
time, flush per global batch), (b) mLoRA-style (round-robin, up to a fixed number of samples
per microbatch, padded, within the capacity) and (c) our plan. Then a pathological table
(issue 18: inputs where packing alone would need idle microbatches; ours is the chunked
stream training runs) and the planning throughput at 100,000 samples (whole plan and
chunks).
"""

import argparse
import os
import platform
import random
import statistics
import sys
import time

from megatron_lorafusion.planner import (
    CostModel,
    Plan,
    PlanProblem,
    check_plan,
    iter_plan_chunks,
    plan_microbatches,
)
from megatron_lorafusion.planner.bounds import plan_lower_bound
from megatron_lorafusion.planner.milp import NODE_LIMIT, available_solver
from megatron_lorafusion.planner.plan import DEFAULT_SOLVER, DEFAULT_TIME_LIMIT_S
from megatron_lorafusion.planner.policy import apply_length_policy
from megatron_lorafusion.sim import adapter_lengths, compare_strategies
from megatron_lorafusion.sim.commands import problem_from_args

DISTS = ("xsum", "cnn_dm", "wikisum", "mix", "heterogeneous")


def _warm_up() -> None:
    """Import PuLP/HiGHS and run one solve so start-up is not billed to the first row."""
    problem = PlanProblem([[700, 600, 500, 400, 300, 200, 100]] * 2, (7, 7), 1000, 1, 1)
    plan_microbatches(problem, "milp", time_limit_s=1.0)


def _bench_one(dist: str, args: argparse.Namespace) -> dict:
    problem, truncated = problem_from_args(
        argparse.Namespace(**vars(args), lengths=dist, long_samples="truncate")
    )
    n_samples = sum(len(x) for x in problem.lengths)
    times = []
    for _ in range(args.repeats):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        plan = plan_microbatches(problem, args.solver, args.time_limit)
        times.append((time.process_time() - cpu0, time.perf_counter() - wall0))
    check_plan(plan, problem)  # correctness before numbers
    cpu_s = statistics.median(t[0] for t in times)
    wall_s = statistics.median(t[1] for t in times)
    t0 = time.perf_counter()
    greedy = plan_microbatches(problem, "greedy")
    greedy_s = time.perf_counter() - t0
    results = {r.name: r for r in compare_strategies(problem, plan, CostModel())}
    ours = results["ours"]
    r = plan.report
    return {
        "dist": dist,
        "samples": n_samples,
        "truncated": sum(truncated),
        "mean_len": sum(map(sum, problem.lengths)) / n_samples,
        "bubble_a": results["megatron"].sim.bubble_ratio,
        "bubble_b": results["mlora"].sim.bubble_ratio,
        "bubble_c": ours.sim.bubble_ratio,
        "fill": ours.fill,
        "useful_fill": ours.useful_fill,
        "mbs": len(plan.microbatches),
        "idle": r.idle_microbatches,
        "greedy_mbs": len(greedy.microbatches),
        "ratio": len(plan.microbatches) / len(greedy.microbatches),
        "over_bound": r.bins_over_bound,
        "segments": r.segments,
        "solves": r.milp_solves,
        "improved": r.milp_improved,
        "limit_hits": r.time_limit_hits,
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "sps_core": n_samples / max(cpu_s, wall_s),
        "greedy_sps": n_samples / greedy_s,
        "speedup_vs_a": results["megatron"].sim.makespan_ms / ours.sim.makespan_ms,
    }


def _table(rows: list[dict]) -> str:
    head = (
        "| lengths | samples (trunc.) | mean tok | bubble (a) Megatron % | bubble (b) mLoRA % "
        "| bubble (c) ours % | fill % (tile pad incl.) | useful fill % | microbatches "
        "(idle) | vs greedy | over LB | MILP solves / improved / limit hits "
        "| plan s | samples/s/core | greedy samples/s | (a)/(c) makespan |"
    )
    sep = "|" + "|".join(["---"] + ["---:"] * (head.count("|") - 2)) + "|"
    lines = [head, sep]
    for r in rows:
        lines.append(
            f"| {r['dist']} | {r['samples']} ({r['truncated']}) | {r['mean_len']:.0f} "
            f"| {100 * r['bubble_a']:.2f} | {100 * r['bubble_b']:.2f} | {100 * r['bubble_c']:.2f} "
            f"| {100 * r['fill']:.2f} | {100 * r['useful_fill']:.2f} | {r['mbs']} ({r['idle']}) "
            f"| {r['ratio']:.3f} ({r['greedy_mbs']}) | {r['over_bound']} "
            f"| {r['solves']} / {r['improved']} / {r['limit_hits']} of {r['segments']} seg. "
            f"| {r['wall_s']:.3f} | {r['sps_core']:.0f} | {r['greedy_sps']:.0f} "
            f"| {r['speedup_vs_a']:.2f}x |"
        )
    return "\n".join(lines)


def _lengths(dist: str, adapters: int, samples: int, seed: int) -> list[list[int]]:
    if dist == "ones":
        return [[1] * samples for _ in range(adapters)]
    if dist == "pareto":  # x_m 200 tokens, alpha 1.2: most short, a few at the capacity
        rngs = [random.Random(f"pareto:{seed + a}") for a in range(adapters)]
        return [[int(200 * r.paretovariate(1.2)) for _ in range(samples)] for r in rngs]
    return adapter_lengths(dist, adapters, samples, seed)


def _pathological_cases(args: argparse.Namespace) -> list[tuple[str, PlanProblem]]:
    """(name, problem): the issue-18 inputs, capacity/tile as the main table."""
    cap, tile, seed = args.capacity, args.tile_height, args.seed

    def problem(dist, adapters, samples, gbs, stages=4, extra=None):
        lengths = _lengths(dist, adapters, samples, seed)
        if extra is not None:
            lengths = [extra] + lengths
        lengths = apply_length_policy(lengths, cap, tile).lengths
        gbs = gbs if isinstance(gbs, tuple) else (gbs,) * len(lengths)
        return PlanProblem(lengths, gbs, cap, stages, tile, seed)

    huge = adapter_lengths("xsum", 1, 1024, seed + 99)[0]
    return [
        ("4 adapters, global batch 1", problem("xsum", 4, 64, 1)),
        ("4 adapters, 1-token samples", problem("ones", 4, 256, 32)),
        ("64 adapters, global batch 4", problem("xsum", 64, 16, 4)),
        ("256 adapters, global batch 8", problem("xsum", 256, 16, 8)),
        ("1 x batch 1024 + 3 x batch 4", problem("xsum", 3, 64, (1024, 4, 4, 4), extra=huge)),
        ("1 adapter, S = 4", problem("xsum", 1, 256, 32, 4)),
        ("1 adapter, S = 8", problem("xsum", 1, 256, 32, 8)),
        ("2 adapters, S = 8", problem("xsum", 2, 256, 32, 8)),
        ("4 adapters, Pareto lengths", problem("pareto", 4, 256, 32)),
    ]


def _chunked(problem: PlanProblem, args: argparse.Namespace) -> Plan:
    """The stream training runs: `iter_plan_chunks` (4 rounds a chunk), concatenated."""
    chunks = list(iter_plan_chunks(problem, 4, args.solver, args.time_limit))
    mbs = tuple(mb for c in chunks for mb in c.microbatches)
    return Plan(mbs, problem.capacity, problem.tile_height, problem.num_adapters, chunks[0].report)


def _pathological_table(args: argparse.Namespace) -> tuple[str, bool]:
    head = (
        "| case | samples | microbatches (idle) | lower bound | kept | makespan s ours "
        "| Megatron-style | mLoRA-style | ours / min(baselines) | chunks = whole plan "
        "| plan s |"
    )
    lines = [head, "|---|" + "---:|" * (head.count("|") - 2)]
    ok = True
    for name, problem in _pathological_cases(args):
        t0 = time.perf_counter()
        plan = _chunked(problem, args)
        plan_s = time.perf_counter() - t0
        check_plan(plan, problem)
        same = plan == plan_microbatches(problem, args.solver, args.time_limit)
        res = {
            r.name: r.sim.makespan_ms / 1e3 for r in compare_strategies(problem, plan, CostModel())
        }
        best = min(res["megatron"], res["mlora"])
        ok &= res["ours"] <= best
        r = plan.report
        lines.append(
            f"| {name} | {sum(map(len, problem.lengths))} | {r.microbatches} "
            f"({r.idle_microbatches}) | {plan_lower_bound(problem)} | {r.chosen} "
            f"| {res['ours']:.2f} | {res['megatron']:.2f} | {res['mlora']:.2f} "
            f"| {res['ours'] / best:.3f} | {'yes' if same else 'no'} | {plan_s:.3f} |"
        )
    return "\n".join(lines), ok


def _throughput(args: argparse.Namespace, total: int = 100_000) -> str:
    per = total // args.adapters
    lengths = apply_length_policy(
        adapter_lengths("mix", args.adapters, per, args.seed), args.capacity, args.tile_height
    ).lengths
    problem = PlanProblem(
        lengths,
        (args.global_batch_size,) * args.adapters,
        args.capacity,
        args.stages,
        args.tile_height,
        args.seed,
    )
    cpu0, wall0 = time.process_time(), time.perf_counter()
    plan = plan_microbatches(problem, args.solver, args.time_limit)
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    n = per * args.adapters
    cpu0, wall0 = time.process_time(), time.perf_counter()
    first_s, mbs = None, 0
    for chunk in iter_plan_chunks(problem, 4, args.solver, args.time_limit):
        first_s = time.perf_counter() - wall0 if first_s is None else first_s
        mbs += len(chunk.microbatches)
    chunk_cpu_s, chunk_wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    return (
        f"throughput: {n} samples (mix, {args.adapters} adapters) planned with "
        f"{args.solver} in {wall_s:.2f} s wall / {cpu_s:.2f} s CPU: "
        f"{n / max(cpu_s, wall_s):.0f} samples/s per core (target >= 5000), "
        f"{len(plan.microbatches)} microbatches, kept {plan.report.chosen}; "
        f"as chunks (iter_plan_chunks, 4 rounds a chunk, what training runs): "
        f"{chunk_wall_s:.2f} s wall / {chunk_cpu_s:.2f} s CPU, "
        f"{n / max(chunk_cpu_s, chunk_wall_s):.0f} samples/s per core, first chunk after "
        f"{first_s:.2f} s, {mbs} microbatches"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--samples", type=int, default=256, help="samples per adapter")
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--capacity", type=int, default=6144)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--tile-height", type=int, default=64)
    parser.add_argument("--solver", choices=("greedy", "milp"), default=DEFAULT_SOLVER)
    parser.add_argument(
        "--time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT_S,
        help="wall-clock safety limit per MILP solve, s",
    )
    parser.add_argument(
        "--no-extra",
        action="store_true",
        help="skip the pathological table and the throughput line",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed planning runs (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", default=None, help="append rows to this CSV")
    args = parser.parse_args()

    import pulp

    cost = CostModel()
    cpu = platform.processor() or platform.machine()
    print(
        f"# planner bench: python {platform.python_version()}, pulp {pulp.__version__} "
        f"({available_solver()}, 1 thread), {os.cpu_count()} CPUs ({cpu})"
    )
    print(
        f"# A={args.adapters} adapters x {args.samples} samples, S={args.stages}, capacity "
        f"{args.capacity}, tile {args.tile_height}, global batch {args.global_batch_size}, "
        f"solver {args.solver} (MILP: {NODE_LIMIT} nodes, safety limit {args.time_limit} "
        f"s/solve), seed {args.seed}"
    )
    print(f"# cost model per stage (ms): {cost}")
    _warm_up()
    rows = [_bench_one(d, args) for d in DISTS]
    print(_table(rows))
    worst = max(r["bubble_c"] for r in rows)
    print(
        f"\nours: worst bubble {100 * worst:.2f}% (target <= 8%), min fill "
        f"{100 * min(r['fill'] for r in rows):.2f}% (target >= 97%), min planning "
        f"{min(r['sps_core'] for r in rows):.0f} samples/s/core (target >= 5000)"
    )
    if not args.no_extra:
        table, ok = _pathological_table(args)
        print("\npathological cases (issue 18), makespans simulated with the cost model above:")
        print(table)
        print(f"\nours <= min(baselines) on every row: {ok}")
        print(_throughput(args))
    if args.csv:
        new = not os.path.exists(args.csv)
        with open(args.csv, "a") as f:
            if new:
                f.write(",".join(rows[0]) + "\n")
            for r in rows:
                f.write(",".join(str(v) for v in r.values()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
