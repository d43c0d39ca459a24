"""Check the planner's pipeline simulator against a measured PP = 2 CPU run.

    python -m scripts.calibrate_simulator [--samples 24] [--capacity 512] [--json out.json]

Plans a stream for 3 adapters with ``S = 2``, runs it on two gloo processes with the
pipeline runner (one CPU thread each), and records every forward, backward and optimizer
step. The simulator then gets the measured per-microbatch times and the mean
optimizer-step time, and predicts each stage's idle time; the script prints
prediction vs measurement as a fraction of the measured makespan, once with each stage's
own measured times and once with their mean over stages (the cost model's assumption).
"""

import argparse
import json
import os
import random
import tempfile
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_lorafusion.config import AdapterConfig, ModelConfig
from megatron_lorafusion.data import TokenizedSample, pack_microbatch
from megatron_lorafusion.planner import CostModel, Job, PlanProblem, plan_microbatches, simulate

MODEL = ModelConfig(num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                    num_query_groups=2, vocab_size=260, max_position_embeddings=512, init_seed=1)
ADAPTERS = [
    AdapterConfig(name="short", rank=8, alpha=16.0, lr=1e-3, global_batch_size=8),
    AdapterConfig(name="mixed", rank=16, alpha=16.0, lr=1e-3, global_batch_size=4),
    AdapterConfig(name="long", rank=4, alpha=8.0, lr=1e-3, global_batch_size=2),
]
LENGTHS = {"short": (16, 64), "mixed": (16, 256), "long": (128, 384)}


def _data(samples: int, seed: int):
    rng = random.Random(seed)
    datasets = []
    for adapter in ADAPTERS:
        lo, hi = LENGTHS[adapter.name]
        rows = []
        for _ in range(samples):
            n = rng.randint(lo, hi)
            ids = tuple(rng.randrange(MODEL.vocab_size) for _ in range(n))
            rows.append(TokenizedSample(ids, ids[1:] + (0,), (1,) * n))
        datasets.append(rows)
    return datasets


def _plan(datasets, capacity: int, seed: int):
    problem = PlanProblem([[len(r) for r in d] for d in datasets],
                          [a.global_batch_size for a in ADAPTERS], capacity, num_stages=2,
                          seed=seed)
    return plan_microbatches(problem, solver="greedy").microbatches


def _batch_tokens(datasets):
    return [[sum(sum(r.loss_mask) for r in d[j * a.global_batch_size:
                                             (j + 1) * a.global_batch_size])
             for j in range(-(-len(d) // a.global_batch_size))]
            for d, a in zip(datasets, ADAPTERS, strict=True)]


def _worker(rank: int, workdir: str, samples: int, capacity: int, seed: int) -> None:
    from megatron.core import parallel_state

    from megatron_lorafusion.mcore import apply_lora, build_gpt_model
    from megatron_lorafusion.mcore.parallel import pipeline_and_data_ranks
    from megatron_lorafusion.pipeline import (
        gpt_stage_forward,
        make_pipeline_groups,
        run_pipeline,
    )
    from megatron_lorafusion.train import AdapterAdamW, AdapterRun

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(workdir, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        parallel_state.initialize_model_parallel(1, 2)
        groups = make_pipeline_groups(*pipeline_and_data_ranks(), timeout_s=300)
        datasets = _data(samples, seed)
        microbatches = _plan(datasets, capacity, seed)
        tokens = _batch_tokens(datasets)
        model = build_gpt_model(MODEL, pre_process=groups.is_first,
                                post_process=groups.is_last).train()
        lora = apply_lora(model, ADAPTERS, seed=seed)
        optimizer = AdapterAdamW(lora, ADAPTERS, [len(t) for t in tokens])
        runs = [AdapterRun(adapter.name, t) for adapter, t in zip(ADAPTERS, tokens, strict=True)]
        orders = [list(range(len(d))) for d in datasets]

        def make_batch(mb, index):
            return pack_microbatch(mb, datasets, orders, len(ADAPTERS), "cpu", dropout_seed=index)

        forward = gpt_stage_forward(model, lora, is_first=groups.is_first, is_last=groups.is_last)
        dist.barrier()
        events = run_pipeline(microbatches, forward, make_batch, runs, optimizer, lora.grads,
                              groups,
                              global_batch_sizes=[a.global_batch_size for a in ADAPTERS],
                              hidden_size=MODEL.hidden_size, activation_dtype=torch.float32,
                              device="cpu", record_events=True)
        with open(os.path.join(workdir, f"events_{rank}.json"), "w") as f:
            json.dump([asdict(e) for e in events], f)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _measured(events_by_stage):
    start = min(e["start_s"] for evs in events_by_stage for e in evs)
    end = max(e["end_s"] for evs in events_by_stage for e in evs)
    busy = [sum(e["compute_s"] for e in evs) * 1e3 for evs in events_by_stage]
    return (end - start) * 1e3, busy


def _predicted(microbatches, events_by_stage, p2p_ms: float, per_stage: bool):
    """Simulate with the measured times: per stage, or their mean over stages."""
    times: dict[tuple[int, str, int], float] = {}
    optimizer = []
    for s, evs in enumerate(events_by_stage):
        for e in evs:
            if e["kind"] == "O":
                optimizer.append(e["compute_s"] * 1e3)
            else:
                times[s, e["kind"], e["microbatch"]] = e["compute_s"] * 1e3
    stages = range(len(events_by_stage))
    jobs = []
    for k, mb in enumerate(microbatches):
        pairs = tuple((times.get((s, "F", k), 0.0), times.get((s, "B", k), 0.0)) for s in stages)
        mean_f = sum(f for f, _ in pairs) / len(pairs)
        mean_b = sum(b for _, b in pairs) / len(pairs)
        jobs.append(Job(mean_f, mean_b, mb.adapters, tuple(mb.finishes),
                        mb.adapters[0] if mb.adapters else -1,
                        stage_ms=pairs if per_stage else ()))
    cost = CostModel(optimizer_ms=sum(optimizer) / max(len(optimizer), 1), p2p_ms=p2p_ms)
    return simulate(jobs, len(events_by_stage), cost)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=24, help="samples per adapter")
    parser.add_argument("--capacity", type=int, default=512, help="tokens per microbatch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--p2p-ms", type=float, default=0.0, help="simulated transfer time")
    parser.add_argument("--json", help="write the measurement and prediction here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_worker, args=(workdir, args.samples, args.capacity, args.seed), nprocs=2)
        events = []
        for rank in range(2):
            with open(os.path.join(workdir, f"events_{rank}.json")) as f:
                events.append(json.load(f))
    microbatches = _plan(_data(args.samples, args.seed), args.capacity, args.seed)
    makespan, busy = _measured(events)
    idle = [makespan - b for b in busy]
    print(f"microbatches {len(microbatches)} (idle {sum(mb.is_idle for mb in microbatches)}), "
          f"S = 2, torch {torch.__version__}, CPU, 1 thread per stage")
    print("| simulator fed | stage | busy ms | idle ms measured | idle ms simulated "
          "| abs error / makespan |")
    print("|---|---|---|---|---|---|")
    report = {"makespan_ms": makespan, "busy_ms": busy, "idle_ms": idle, "events": events}
    for label, per_stage in (("per-stage times", True), ("mean of stages", False)):
        sim = _predicted(microbatches, events, args.p2p_ms, per_stage)
        idle_sim = [sim.makespan_ms - b for b in sim.busy_ms]
        errors = [abs(p - m) / makespan for p, m in zip(idle_sim, idle, strict=True)]
        for s in range(2):
            print(f"| {label} | {s} | {busy[s]:.0f} | {idle[s]:.0f} | {idle_sim[s]:.0f} | "
                  f"{100 * errors[s]:.1f}% |")
        report[label] = {"sim_makespan_ms": sim.makespan_ms, "sim_idle_ms": idle_sim,
                         "idle_error_of_makespan": errors}
        print(f"makespan measured {makespan:.0f} ms, simulated ({label}) "
              f"{sim.makespan_ms:.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
