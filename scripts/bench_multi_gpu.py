"""Multi-GPU pipeline run: Megatron-style, mLoRA-style and our schedule on the same samples.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m scripts.bench_multi_gpu --pp 2

Every rank builds its stage of a Llama-3.1-8B-shaped model (random bf16 weights; ``--layers``
to shorten it) and four adapters (r = 16, dropout 0.1, every linear) with `train.build_run`,
and, per length distribution, the same samples (random tokens, lengths from
`sim.distributions`). Then it trains them three ways through the pipeline runner (NCCL),
each with fresh optimizers (`train.adapter_training`):

(a) Megatron-style: one adapter at a time, each global batch FFD-packed and run as its own
    pipeline (a flush per optimizer step);
(b) mLoRA-style: adapters round-robin, a fixed number of one adapter's samples per
    microbatch, each sample padded to the longest (no packing);
(c) ours: the planner's packed multi-adapter stream (greedy planner: PuLP is not on the GPU
    machine), no flush.

One untimed run of our stream comes first (Triton compiles and autotunes there). Printed
per strategy: useful tokens/s (padding not counted), each stage's measured bubble
(1 − busy / makespan, busy from the runner's CUDA-event times), peak memory, and
the simulator's predicted bubble and makespan for the same microbatches, with the cost model
of ``--cost-profile`` (the one-GPU per-layer profile by default).
"""

import argparse
import dataclasses
import os
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_lorafusion.config import MODEL_PRESETS, AdapterConfig, DatasetConfig, ModelConfig
from megatron_lorafusion.data import TokenizedSample, pack_microbatch
from megatron_lorafusion.mcore.parallel import destroy_model_parallel, init_model_parallel
from megatron_lorafusion.planner import CostModel, PlanProblem, plan_microbatches
from megatron_lorafusion.planner.round_robin import default_samples_per_microbatch
from megatron_lorafusion.sim import compare_strategies
from megatron_lorafusion.sim.baselines import megatron_microbatches, mlora_microbatches
from megatron_lorafusion.sim.commands import problem_from_args
from megatron_lorafusion.train import Run, adapter_training, build_run

REPO = Path(__file__).resolve().parents[1]
ADAPTERS = 4


class _Identity:
    """``orders[a][i] == i``: training order = dataset order."""

    def __getitem__(self, index: int) -> int:
        return index


def _datasets(problem, vocab: int, seed: int) -> list[list[TokenizedSample]]:
    rng = random.Random(seed)
    out = []
    for lengths in problem.lengths:
        rows = []
        for n in lengths:
            ids = tuple(rng.randrange(vocab) for _ in range(n))
            rows.append(TokenizedSample(ids, ids[1:] + (0,), (1,) * n))
        out.append(rows)
    return out


def _packed_make_batch(datasets, device):
    """Our packing: the samples back to back, no padding."""

    def make_batch(mb, index):
        return pack_microbatch(
            mb, datasets, [_Identity()] * len(datasets), ADAPTERS, device, dropout_seed=index
        )

    return make_batch


def _padded_make_batch(datasets, device):
    """mLoRA-style packing: every sample of a microbatch padded (loss mask 0) to the longest."""

    def make_batch(mb, index):
        longest = max(s.tokens for s in mb.samples)
        rows: list[dict[int, TokenizedSample]] = [{} for _ in datasets]
        for s in mb.samples:
            row = datasets[s.adapter][s.index]
            pad = (0,) * (longest - len(row.input_ids))
            rows[s.adapter][s.index] = TokenizedSample(
                row.input_ids + pad, row.labels + pad, row.loss_mask + pad
            )
        return pack_microbatch(
            mb, rows, [_Identity()] * len(datasets), ADAPTERS, device, dropout_seed=index
        )

    return make_batch


def _batch_tokens(problem: PlanProblem) -> list[list[int]]:
    """Per adapter, the tokens of each of its global batches (every token is trained)."""
    return [
        [
            sum(s.tokens for s in problem.global_batch(a, j))
            for j in range(problem.num_global_batches(a))
        ]
        for a in range(problem.num_adapters)
    ]


def _train(streams, make_batch, run: Run, adapters, problem: PlanProblem):
    """Run the streams (a drain after each) with fresh optimizers; (seconds, busy seconds)."""
    runs, optimizer = adapter_training(run.lora, adapters, _batch_tokens(problem))
    fresh = dataclasses.replace(run, runs=runs, optimizer=optimizer)
    _sync(run.device)
    dist.barrier()
    start = time.perf_counter()
    busy = 0.0
    for stream in streams:
        events = fresh.train(stream, make_batch, record_events=True)
        busy += sum(e.compute_s for e in events)
    _sync(run.device)
    dist.barrier()
    return time.perf_counter() - start, busy


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--samples", type=int, default=64, help="samples per adapter")
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=8192, help="tokens per microbatch")
    parser.add_argument("--lengths", nargs="+", default=["xsum", "heterogeneous"])
    parser.add_argument("--cost-profile", default=str(REPO / "docs/profiles/stage_cost_s2.json"))
    parser.add_argument("--preset", default="llama3.1-8b", help="model shape (tiny: CPU check)")
    parser.add_argument("--device", default="cuda", help="cpu: a gloo dry run of the script")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    init_model_parallel(1, args.pp, device, seed=0)
    rank = dist.get_rank()
    model_cfg = ModelConfig(
        **{
            **MODEL_PRESETS[args.preset],
            "num_layers": args.layers,
            "max_position_embeddings": args.capacity,
        }
    )
    adapters = [
        AdapterConfig(
            name=f"a{i}",
            rank=16,
            alpha=32,
            dropout=0.1,
            global_batch_size=args.global_batch_size,
            dataset=DatasetConfig(path="unused"),
        )
        for i in range(ADAPTERS)
    ]
    problems = {
        name: problem_from_args(
            argparse.Namespace(
                lengths=name,
                adapters=ADAPTERS,
                samples=args.samples,
                seed=0,
                capacity=args.capacity,
                tile_height=64,
                long_samples="truncate",
                global_batch_size=args.global_batch_size,
                stages=args.pp,
            )
        )[0]
        for name in args.lengths
    }
    run = build_run(
        model_cfg,
        adapters,
        _batch_tokens(problems[args.lengths[0]]),
        device=device,
        params_dtype=torch.bfloat16 if cuda else torch.float32,
    )
    cost = CostModel.from_profile(args.cost_profile)
    rows = []
    try:
        for dist_name, problem in problems.items():
            datasets = _datasets(problem, model_cfg.vocab_size, seed=1)
            plan = plan_microbatches(problem, "greedy")
            k = default_samples_per_microbatch(problem)
            sims = {r.name: r for r in compare_strategies(problem, plan, cost, k)}
            packed = _packed_make_batch(datasets, device)
            strategies = {  # mLoRA pads its samples; the others pack them
                "megatron": (megatron_microbatches(problem), packed),
                "mlora": ([mlora_microbatches(problem, k)], _padded_make_batch(datasets, device)),
                "ours": ([list(plan.microbatches)], packed),
            }
            useful = sum(map(sum, problem.lengths))
            if dist_name == args.lengths[0]:  # compile and autotune before anything is timed
                _train([list(plan.microbatches)], packed, run, adapters, problem)
            for name, (streams, make_batch) in strategies.items():
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                seconds, busy = _train(streams, make_batch, run, adapters, problem)
                bubbles = [None] * dist.get_world_size()
                dist.all_gather_object(bubbles, 1.0 - busy / seconds)
                peaks = [None] * dist.get_world_size()
                dist.all_gather_object(
                    peaks, torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
                )
                sim = sims[name]
                rows.append(
                    (
                        dist_name,
                        name,
                        useful / seconds,
                        bubbles,
                        max(peaks),
                        sim.sim.bubble_ratio,
                        sim.sim.makespan_ms / 1e3,
                        seconds,
                        sim.microbatches,
                    )
                )
    finally:
        if rank == 0:
            gpu = torch.cuda.get_device_name() if cuda else "CPU"
            print(
                f"# {gpu} x {dist.get_world_size()} | torch "
                f"{torch.__version__} | {args.preset} shape, {args.layers} layers, PP = "
                f"{args.pp}, {'bf16' if cuda else 'fp32'}, {ADAPTERS} adapters r=16 p=0.1, "
                f"{args.samples} samples per adapter, global batch "
                f"{args.global_batch_size}, capacity {args.capacity} | "
                f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}"
            )
            print(
                "| lengths | strategy | microbatches | useful tokens/s | measured bubble per "
                "stage % | simulated bubble % | run s | simulated s | peak GiB |"
            )
            print("|---|---|---|---|---|---|---|---|---|")
            for d, name, tps, bub, peak, sim_bub, sim_s, secs, mbs in rows:
                per_stage = " / ".join(f"{100 * b:.1f}" for b in bub)
                print(
                    f"| {d} | {name} | {mbs} | {tps:,.0f} | {per_stage} | "
                    f"{100 * sim_bub:.1f} | {secs:.2f} | {sim_s:.2f} | {peak:.1f} |"
                )
        destroy_model_parallel()


if __name__ == "__main__":
    main()
