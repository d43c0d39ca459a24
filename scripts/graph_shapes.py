"""How often CUDA graphs of microbatch shapes would replay, counted from the plan alone.

    python -m scripts.graph_shapes --global-batch 8 32

Plans `bench_train_cli`'s workload (XSum-like lengths, one token per byte plus one) as
`lorafusion train` does (greedy, 8192-token microbatches), pads each microbatch as
`train.cuda_graphs` does (`GRAPH_PAD_TOKENS`, a loss-free sample) and counts, for each way
of keying a shape and each capture threshold, the captures and replays `MicrobatchGraphs`
would make (a shape is captured at its ``capture_at``-th microbatch, replayed after). The
shipped key is ``tokens, sample bucket`` (`graphs.sample_bucket`, since the seventeenth
session; ``tokens, samples`` before). CPU only, seconds. The sixteenth session's device runs
4 and 5 (key ``tokens, samples``) replayed 217 and 203 microbatches at global batch 8
(capture at 2, 3) and 96 and 75 at 32, where this counts 217 and 200, 92 and 70.
"""

import argparse
from collections import Counter

from megatron_lorafusion.pipeline.graphs import sample_bucket
from megatron_lorafusion.planner import PlanProblem, plan_microbatches
from megatron_lorafusion.validation import GRAPH_PAD_TOKENS
from scripts.bench_train_cli import _lengths

KEYS = {
    "tokens, sample bucket": lambda tokens, samples: (tokens, sample_bucket(samples)),
    "tokens, samples": lambda tokens, samples: (tokens, samples),
    "tokens, samples / 4": lambda tokens, samples: (tokens, -(-samples // 4)),
    "tokens": lambda tokens, samples: tokens,
}


def _shapes(gbs: int, samples: int, capacity: int, max_seq_length: int) -> list[tuple[int, int]]:
    lengths = [min(n + 1, max_seq_length) for n in _lengths(samples, seed=1000)]
    lengths = lengths[: len(lengths) // gbs * gbs]
    plan = plan_microbatches(PlanProblem([lengths], [gbs], capacity, seed=1234), solver="greedy")
    shapes = []
    for mb in plan.microbatches:
        tokens = sum(s.tokens for s in mb.samples)
        pad = -tokens % GRAPH_PAD_TOKENS
        shapes.append((tokens + pad, len(mb.samples) + (pad > 0)))
    return shapes


def _count(keys: list, capture_at: int) -> tuple[int, int]:
    seen, graphs, replays = Counter(), set(), 0
    for key in keys:
        if key in graphs:
            replays += 1
            continue
        seen[key] += 1
        if seen[key] == capture_at:
            graphs.add(key)
    return len(graphs), replays


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--capacity", type=int, default=8192)
    parser.add_argument("--max-seq-length", type=int, default=2048)
    parser.add_argument("--capture-at", nargs="+", type=int, default=[2, 3])
    args = parser.parse_args(argv)
    rows = []
    print(
        "| global batch | microbatches | key | distinct shapes | capture at | captures | replays |"
    )
    print("|---|---|---|---|---|---|---|")
    for gbs in args.global_batch:
        shapes = _shapes(gbs, args.samples, args.capacity, args.max_seq_length)
        for name, key in KEYS.items():
            keys = [key(*shape) for shape in shapes]
            for capture_at in args.capture_at:
                captures, replays = _count(keys, capture_at)
                row = dict(gbs=gbs, microbatches=len(shapes), key=name, distinct=len(set(keys)))
                row.update(capture_at=capture_at, captures=captures, replays=replays)
                rows.append(row)
                print("| " + " | ".join(str(v) for v in row.values()) + " |")
    return rows


if __name__ == "__main__":
    main()
