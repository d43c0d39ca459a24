"""Does deferring LoRA's weight-gradient pass (zero-bubble style) shorten our pipeline?

Run: python -m scripts.bench_zero_bubble [--samples 256 64] [--stages 2 4] [--shares 0.05 0.15]

For each length distribution, stage count and samples per adapter it plans 4 adapters
(greedy planner, capacity 6144, tile 64, global batch 32), then simulates the plan with the
weight-gradient share ``w`` of every backward kept inside it (``w = 0``) or deferred into
idle time (`simulate(..., defer_wgrad=w)`), once as one uncut stream and once cut into
``--drains`` pieces (a checkpoint drain each, the `train.save_every` case). It prints the
makespan gain of deferring, in percent. ``w`` is the measured share: 4.6–15 % on CPU
(`scripts/bench_lora_wgrad_share.py`, now in git history), about 5 % for an 8B layer on the
H200 (docs/pipeline.md).
"""

import argparse
import sys

from megatron_lorafusion.planner import CostModel, plan_microbatches, simulate_flushed
from megatron_lorafusion.planner.baselines import plan_jobs
from megatron_lorafusion.planner.commands import problem_from_args

DISTS = ("xsum", "cnn_dm", "wikisum", "mix", "heterogeneous")


def _chunks(jobs: list, pieces: int) -> list[list]:
    """``jobs`` cut into ``pieces`` runs of nearly equal length (a drain between runs)."""
    size = -(-len(jobs) // pieces)
    return [jobs[i:i + size] for i in range(0, len(jobs), size)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.05, 0.15])
    parser.add_argument("--drains", type=int, default=8, help="pieces of the cut stream")
    args = parser.parse_args()
    cost = CostModel()
    print(f"# cost model per stage (ms): {cost}; greedy plans, 4 adapters, capacity 6144")
    head = ["lengths", "S", "samples/adapter", "microbatches", "bubble % (w kept)"]
    for w in args.shares:
        head += [f"gain % w={w:g} uncut", f"gain % w={w:g} {args.drains} drains"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    best = 0.0
    for dist in DISTS:
        for stages in args.stages:
            for samples in args.samples:
                problem, _ = problem_from_args(argparse.Namespace(
                    lengths=dist, adapters=4, samples=samples, seed=0, capacity=6144,
                    tile_height=64, long_samples="truncate", global_batch_size=32,
                    stages=stages,
                ))
                jobs = plan_jobs(plan_microbatches(problem, "greedy"), cost)
                uncut, cut = [jobs], _chunks(jobs, args.drains)
                kept = simulate_flushed(uncut, stages, cost)
                kept_cut = simulate_flushed(cut, stages, cost)
                row = [dist, str(stages), str(samples), str(len(jobs)),
                       f"{100 * kept.bubble_ratio:.2f}"]
                for w in args.shares:
                    for groups, base in ((uncut, kept), (cut, kept_cut)):
                        deferred = sum(
                            simulate_flushed([g], stages, cost, defer_wgrad=w).makespan_ms
                            for g in groups
                        )
                        gain = 100 * (1 - deferred / base.makespan_ms)
                        best = max(best, gain)
                        row.append(f"{gain:.2f}")
                print("| " + " | ".join(row) + " |")
    print(f"\nlargest makespan gain from deferring: {best:.2f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
