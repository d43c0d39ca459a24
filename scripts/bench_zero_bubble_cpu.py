"""Measured on CPU: a PP = 2 gloo run with LoRA's weight gradients deferred or not.

Run: python -m scripts.bench_zero_bubble_cpu [--hidden 256] [--samples 24] [--repeats 3]

Two processes (one thread each) train 4 adapters of a 4-layer model through the
multi-adapter 1F1B runner; rank 0 prints the median wall time of the whole run with
``defer_wgrad`` off and on (alternating, after one warm-up run of each) and the simulator's
prediction for the same plan from the measured stage times. Companion of
`scripts.bench_zero_bubble` (simulator only).
"""

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_lorafusion.config import AdapterConfig, ModelConfig

ADAPTER_COUNT = 4
GLOBAL_BATCH = 4


def _worker(rank: int, workdir: str, args: argparse.Namespace) -> None:
    from megatron.core import parallel_state

    from megatron_lorafusion.data import TokenizedSample, pack_microbatch
    from megatron_lorafusion.mcore import WgradQueue, apply_lora, build_gpt_model
    from megatron_lorafusion.mcore.parallel import pipeline_and_data_ranks
    from megatron_lorafusion.pipeline import gpt_stage_forward, make_pipeline_groups, run_pipeline
    from megatron_lorafusion.planner import PlanProblem, plan_microbatches
    from megatron_lorafusion.train import AdapterRun, build_optimizer

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(workdir, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(1, 2)
    model_cfg = ModelConfig(num_layers=4, hidden_size=args.hidden, ffn_hidden_size=args.hidden * 3,
                            num_attention_heads=4, num_query_groups=2, vocab_size=512,
                            max_position_embeddings=512)
    adapters = [AdapterConfig(name=f"a{a}", rank=16, alpha=32.0, global_batch_size=GLOBAL_BATCH)
                for a in range(ADAPTER_COUNT)]
    rng = random.Random(0)
    datasets = []
    for _ in adapters:
        rows = []
        for _ in range(args.samples):
            n = rng.randint(32, 320)
            ids = tuple(rng.randrange(512) for _ in range(n))
            rows.append(TokenizedSample(ids, ids[1:] + (0,), (1,) * n))
        datasets.append(rows)
    orders = [list(range(args.samples))] * ADAPTER_COUNT
    problem = PlanProblem([[len(r.input_ids) for r in d] for d in datasets],
                          [GLOBAL_BATCH] * ADAPTER_COUNT, 1024, num_stages=2, seed=0)
    plan = plan_microbatches(problem, "greedy")
    groups = make_pipeline_groups(*pipeline_and_data_ranks(), 120.0)
    model = build_gpt_model(model_cfg, pre_process=groups.is_first,
                            post_process=groups.is_last).train()
    lora = apply_lora(model, adapters, seed=1)
    forward = gpt_stage_forward(model, lora, is_first=groups.is_first, is_last=groups.is_last)
    params = [[p for _, p in lora.adapter_parameters(a)] for a in range(ADAPTER_COUNT)]
    steps = args.samples // GLOBAL_BATCH
    batch_tokens = [[sum(len(d[i].input_ids) for i in range(j * GLOBAL_BATCH,
                                                            (j + 1) * GLOBAL_BATCH))
                     for j in range(steps)] for d in datasets]

    def make_batch(mb, index):
        return pack_microbatch(mb, datasets, orders, ADAPTER_COUNT, "cpu", dropout_seed=index)

    def one_run(defer: bool) -> float:
        runs = []
        for a, adapter in enumerate(adapters):
            optimizer, scheduler = build_optimizer(params[a], adapter, steps)
            runs.append(AdapterRun(adapter.name, optimizer, scheduler, batch_tokens[a]))
        lora.wgrad_queue = WgradQueue(max_pending=2) if defer else None
        dist.barrier()
        start = time.perf_counter()
        run_pipeline(plan.microbatches, forward, make_batch, runs, params, groups,
                     global_batch_sizes=[GLOBAL_BATCH] * ADAPTER_COUNT,
                     hidden_size=args.hidden, activation_dtype=torch.float32, device="cpu",
                     wgrad_queue=lora.wgrad_queue)
        dist.barrier()
        return time.perf_counter() - start

    times: dict[bool, list[float]] = {False: [], True: []}
    for k in range(2 * (args.repeats + 1)):
        defer = bool(k % 2)
        elapsed = one_run(defer)
        if k >= 2:
            times[defer].append(elapsed)
    if rank == 0:
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"# CPU PP = 2 (gloo, 1 thread per rank), H = {args.hidden}, 4 layers, "
              f"{ADAPTER_COUNT} adapters x {args.samples} samples, r = 16, "
              f"{len(plan.microbatches)} microbatches, median of {args.repeats}")
        print("| defer_wgrad | run s (median) | runs s |")
        print("|---|---|---|")
        for flag in (False, True):
            print(f"| {flag} | {statistics.median(times[flag]):.3f} | "
                  + ", ".join(f"{t:.3f}" for t in times[flag]) + " |")
        print(f"\nmeasured gain of deferring: {100 * (1 - on / off):.2f} %")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--samples", type=int, default=24, help="samples per adapter")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_worker, args=(workdir, args), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
