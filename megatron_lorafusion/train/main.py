"""`main(cfg)`: the one place that starts process groups, builds and trains a job's adapters.

Order matters for a clean failure: the config is validated and every dataset is read and
tokenised before any process group, model or output folder exists, and every adapter's
checkpoint is checked before anything is written.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch

from megatron_lorafusion.config import AdapterConfig, ConfigError, JobConfig
from megatron_lorafusion.data import load_adapter_dataset, load_tokenizer, training_order
from megatron_lorafusion.lifetime import command_age_s, die_with_parent
from megatron_lorafusion.ops.kernel_warmup import start_kernel_warmup
from megatron_lorafusion.planner import BackgroundPlanner, Plan, PlanProblem, iter_plan_chunks
from megatron_lorafusion.train.checkpoint import AdapterCheckpoints, Shard
from megatron_lorafusion.train.evaluate import LossSums, one_stage_loss_sums, split_eval_rows
from megatron_lorafusion.train.job import AdapterJob
from megatron_lorafusion.train.metrics import MetricsWriter, ProgressBar, job_summary, plan_summary
from megatron_lorafusion.train.recipe import Run, build_run, graphs_apply
from megatron_lorafusion.train.resume import restore_job, shared_identity
from megatron_lorafusion.train.saving import Saver
from megatron_lorafusion.train.session import Session, SessionSettings, Timing
from megatron_lorafusion.train.stream import JobStream
from megatron_lorafusion.train.writer import WRITER_THREADS, BackgroundWriter, staging_pool
from megatron_lorafusion.validation import (
    GRAPH_PAD_TOKENS,
    graph_blockers,
    planned_samples_problems,
)

__all__ = ["JobsFailedError", "main", "make_jobs", "prepare_problem"]

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_COMM_TIMEOUT_S = 600.0  # a dead or stuck peer makes every rank fail within this time


class JobsFailedError(RuntimeError):
    """Adapters failed (diverged, or could not be saved); the others finished and exported."""


def make_jobs(cfg: JobConfig, adapters: Sequence[AdapterConfig], tokenizer) -> list[AdapterJob]:
    """Each adapter's job: its rows read and tokenised, eval rows held out, its order drawn.

    Raises:
        DataError: on an unusable dataset.
        ConfigError: when the samples these jobs plan (``train.epochs`` × their rows, known
            only now) pass `validation.MAX_SAMPLES` or the host's free memory, before any
            order is drawn (issue 36).
    """
    loaded = []
    for adapter in adapters:
        rows = load_adapter_dataset(adapter, cfg.data, tokenizer)
        loaded.append(split_eval_rows(adapter, rows, cfg.data, tokenizer, cfg.train.seed))
    view = replace(cfg, adapters=list(adapters))
    if problems := planned_samples_problems(view, [(len(rows), True) for rows, _ in loaded]):
        raise ConfigError(problems)
    jobs = []
    for adapter, (rows, held) in zip(adapters, loaded, strict=True):
        if cfg.train.steps is not None:
            total = cfg.train.steps * adapter.global_batch_size
        else:
            total = cfg.train.epochs * len(rows)
        order = training_order(len(rows), total, cfg.train.seed, adapter.name, cfg.data.shuffle)
        jobs.append(AdapterJob.create(adapter, rows, held, order, cfg.train.seed))
    return jobs


def prepare_problem(cfg: JobConfig, jobs: Sequence[AdapterJob]) -> PlanProblem:
    """The planning problem of every sample of ``jobs`` (``lorafusion plan --job``'s)."""
    return PlanProblem(
        [[job.sample_tokens(p) for p in range(len(job.order))] for job in jobs],
        [job.global_batch_size for job in jobs],
        cfg.planner.token_capacity,
        num_stages=cfg.parallel.pp,
        tile_height=cfg.planner.tile_height,
        seed=cfg.train.seed,
    )


def _device(cfg: JobConfig) -> torch.device:
    if cfg.train.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def _sequence_shards(cfg: JobConfig, device: torch.device) -> int:
    """TP size when sequence parallelism is on (each TP rank holds T / tp rows), else 1.

    CPU runs go without it: Megatron's sequence-parallel collectives allocate their outputs
    on the current CUDA device.
    """
    if not (cfg.parallel.sequence_parallel and cfg.parallel.tp > 1):
        return 1
    if device.type != "cuda":
        logger.info(
            "parallel.sequence_parallel: off on %s (Megatron's sequence-parallel "
            "collectives need CUDA); tp=%d runs without it",
            device,
            cfg.parallel.tp,
        )
        return 1
    return cfg.parallel.tp


_IN_PROCESS_SAMPLES = 4096  # smaller plans are made in the loop (~0.1 s), not in a worker


def plans_in_process(samples: int) -> bool:
    """Whether `start_planner` plans a problem of ``samples`` samples in this process."""
    return samples <= _IN_PROCESS_SAMPLES


def start_planner(cfg: JobConfig, rounds_per_chunk: int = 4):
    """``problem -> chunks`` of `JobStream`: a worker process for big problems, in-process else.

    A worker takes a process start (~1-2 s) before its first chunk, which a server would
    pay at every job that joins or leaves; a small problem is planned in this process faster.
    The stream sees a change of its jobs between chunks of ``rounds_per_chunk`` rounds (one
    global batch of every job each).
    """
    limits = {"solver": cfg.planner.solver, "time_limit_s": cfg.planner.time_limit_s}

    def start(problem: PlanProblem):
        if plans_in_process(sum(len(x) for x in problem.lengths)):
            return iter_plan_chunks(problem, rounds_per_chunk, **limits)
        return BackgroundPlanner(problem, rounds_per_chunk, **limits)

    return start


def _check_same_job(cfg: JobConfig, sizes: dict[str, int]) -> None:
    """Refuse on every rank unless all ranks run the same job config (before any work)."""
    from megatron_lorafusion.pipeline import check_same_across_ranks

    if sizes["world"] > 1:
        check_same_across_ranks(json.dumps(asdict(cfg), sort_keys=True), "job config")


def main(cfg: JobConfig) -> dict[str, list[float]]:
    """Train every adapter of ``cfg``; each is exported as a PEFT folder as soon as it is done.

    Returns:
        Per adapter name, the mean loss of each optimizer step.

    Raises:
        ConfigError: ``train.device: cuda`` without a CUDA device (before anything is created).
        DataError: on an unusable dataset (before anything is created).
        CheckpointError: a checkpoint of another config of an adapter, or a foreign one.
        WriteError: when the disk refuses a save (earlier checkpoints stay usable).
        JobsFailedError: after the others finished, when adapters failed (named).
    """
    timing = Timing()
    if (age := command_age_s()) is not None:  # torch's imports and ours, the config
        timing.startup["launch and imports"] = age
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank dies with its launcher
        die_with_parent(os.getppid())
    # Packed microbatches change shape every step; without expandable segments the caching
    # allocator's reserved memory grows with fragmentation (an 8B job held the whole card).
    # Read at the first CUDA allocation; a user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if cfg.train.device == "cuda" and not torch.cuda.is_available():  # before anything exists
        raise ConfigError(
            ["train.device must be 'auto' or 'cpu' on a machine without CUDA, got 'cuda'"]
        )
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
    jobs = make_jobs(cfg, cfg.adapters, tokenizer)
    timing.mark("reading data")
    rank0 = os.environ.get("RANK", "0") == "0"  # torchrun's; a plain run is rank 0
    if rank0:  # the first screen, before the model is built (seconds on a real model)
        for line in job_summary(cfg, jobs, int(os.environ.get("WORLD_SIZE", "1"))).splitlines():
            logger.info("%s", line)  # a record per line: every line names its logger
    device = _device(cfg)
    if device.type == "cuda":
        torch.cuda.init()
        timing.mark("starting CUDA")
    from megatron_lorafusion.mcore.parallel import destroy_model_parallel, init_model_parallel

    timing.mark("importing Megatron")
    init_model_parallel(
        cfg.parallel.tp, cfg.parallel.pp, device, cfg.train.seed, timeout_s=_COMM_TIMEOUT_S
    )
    timing.mark("process groups")
    try:
        return _train(cfg, jobs, device, timing)
    finally:
        destroy_model_parallel()


def _collectives(sizes: dict[str, int], device: torch.device):
    """``(agree_min, agree_flags)`` over every rank (identities in one process)."""
    import torch.distributed as dist

    def agree_min(value: int) -> int:
        if sizes["world"] == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def agree_flags(flags: torch.Tensor) -> None:
        if sizes["world"] > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)

    return agree_min, agree_flags


def _resume(cfg: JobConfig, jobs, stores, run: Run, agree_min) -> set[str]:
    """Every job at its own newest usable checkpoint (policy ``train.resume``).

    Returns:
        The names of the jobs that ended and were exported (``done.json``).
    """
    if cfg.train.resume == "never":
        return set()
    shared = shared_identity(cfg)
    exported = set()
    for slot, job in enumerate(jobs):

        def load(entry: dict, slot: int = slot) -> None:
            run.load_table(slot, entry["table"], entry["tensors"])

        if restore_job(job, stores[job.name], load, shared, agree_min=agree_min) == "done":
            exported.add(job.name)
        run.optimizer.steps[slot] = job.step
    return exported


def _eval_losses(cfg: JobConfig, run: Run, sizes: dict[str, int]):
    """``pack_eval -> LossSums``: one stage's forward, or forward only through the pipeline."""
    from megatron_lorafusion.pipeline import forward_loss_sums, gpt_stage_forward

    groups = run.groups
    stage = gpt_stage_forward(run.model, run.lora, is_first=groups.is_first, is_last=groups.is_last)
    num = run.lora.num_adapters

    def make(pack_eval) -> LossSums:
        if groups.num_stages == 1 and groups.dp_size == 1:
            return one_stage_loss_sums(lambda batch: stage(batch, None), pack_eval, num)
        return lambda microbatches: forward_loss_sums(
            microbatches,
            stage,
            pack_eval,
            groups,
            num_adapters=num,
            hidden_size=cfg.model.hidden_size,
            activation_dtype=_DTYPES[cfg.train.precision],
            device=run.device,
            counts_once=sizes["tp_rank"] == 0,
            sequence_shards=run.sequence_shards,
        )

    return make


def _bubble_records(run: Run, sizes: dict[str, int], metrics: MetricsWriter):
    """A pipelined run's ``on_segment``: each segment's measured bubble (a collective).

    The mean over stages of each stage's idle share of its span; each stage's first TP/DP
    rank contributes its busy time and span (first operation's start to last one's end).
    """
    import torch.distributed as dist

    groups = run.groups
    if groups.num_stages == 1 and groups.dp_size == 1:
        return None

    def on_segment(events) -> None:
        stages = torch.zeros(2, groups.num_stages, dtype=torch.float64)
        if events and sizes["tp_rank"] == 0 and groups.dp_rank == 0:
            stages[0, groups.stage] = sum(e.compute_s for e in events)
            stages[1, groups.stage] = max(e.end_s for e in events) - min(e.start_s for e in events)
        stages = stages.to(run.device)
        dist.all_reduce(stages)
        busy, span = stages.cpu()
        idle = [1.0 - b / t for b, t in zip(busy.tolist(), span.tolist(), strict=True) if t > 0]
        bubble = sum(idle) / max(len(idle), 1)
        metrics.log_run(sum(r.step for r in run.runs), {"bubble": bubble})

    return on_segment


def _writes_metrics(sizes: dict[str, int], run: Run) -> bool:
    """The one rank that writes metrics: the first TP/DP rank of the stage with the losses."""
    return run.groups.is_last and sizes["dp_rank"] == 0 and sizes["tp_rank"] == 0


def _on_plan(cfg: JobConfig, sizes: dict[str, int], rank0: bool):
    """The stream's ``on_plan``: ranks agree on the first plan; rank 0 summarises each."""
    seen = []

    def on_plan(chunk: Plan, problem: PlanProblem) -> None:
        if not seen and sizes["world"] > 1:
            from megatron_lorafusion.pipeline import check_same_across_ranks

            check_same_across_ranks(
                repr((problem, chunk.microbatches)), "plan (its samples and first microbatches)"
            )
        seen.append(problem)
        if rank0:
            steps = sum(len(mb.finishes) for mb in chunk.microbatches)
            total = sum(problem.num_global_batches(a) for a in range(problem.num_adapters))
            for line in plan_summary(chunk, problem, first_chunk=steps < total).splitlines():
                logger.info("%s", line)

    return on_plan


def _cuda_graphs(cfg: JobConfig, device: torch.device) -> bool:
    """Whether microbatches train through CUDA graphs (``train.cuda_graphs``).

    Raises:
        ConfigError: when they are asked for (``true``) and cannot run here (names the reason).
    """
    if cfg.train.cuda_graphs is False:
        return False
    dtype = _DTYPES[cfg.train.precision]
    why_not = ", ".join(graph_blockers(cfg)) or graphs_apply(
        device, cfg.train.recompute, dtype, cfg.adapters, cfg.model
    )
    if why_not and cfg.train.cuda_graphs is True:
        raise ConfigError([f"train.cuda_graphs is true, but CUDA graphs cannot run: {why_not}"])
    if why_not:
        if device.type == "cuda":
            logger.info("CUDA graphs: off (train.cuda_graphs: auto): %s", why_not)
        return False
    logger.info(
        "CUDA graphs: on (train.cuda_graphs: %s), microbatches padded to a multiple of %d tokens",
        cfg.train.cuda_graphs,
        GRAPH_PAD_TOKENS,
    )
    return True


def _train(cfg: JobConfig, jobs: list[AdapterJob], device: torch.device, timing: Timing):
    """`main` once the data is read and the groups exist: build, resume, train, export."""
    from megatron_lorafusion.mcore.parallel import parallel_sizes

    sizes = parallel_sizes()
    _check_same_job(cfg, sizes)
    shards = _sequence_shards(cfg, device)
    graphs = _cuda_graphs(cfg, device)
    warmup = start_kernel_warmup(device)  # Triton's per-process keys, while the model builds
    run = build_run(
        cfg.model,
        cfg.adapters,
        [job.run.batch_tokens for job in jobs],
        device=device,
        params_dtype=_DTYPES[cfg.train.precision],
        seed=cfg.train.seed,
        sequence_shards=shards,
        recompute=cfg.train.recompute,
        defer_wgrad=cfg.parallel.defer_wgrad,
        track_grad_norms=True,  # metrics.jsonl's grad_norm
        comm_timeout_s=_COMM_TIMEOUT_S,
        graphs_max_seqlen=max(cfg.data.max_seq_length, GRAPH_PAD_TOKENS) if graphs else None,
    )
    timing.mark("building the model")
    if warmup is not None:
        warmup.join()
        timing.mark("preparing Triton's kernels (beyond the build)")
    out = Path(cfg.train.output_dir)
    shard = Shard(sizes["tp_rank"], sizes["tp"], sizes["pp_rank"], sizes["pp"])
    stores = {
        job.name: AdapterCheckpoints(
            out / "checkpoints" / job.name, job.name, shard, cfg.train.keep_last
        )
        for job in jobs
    }
    agree_min, agree_flags = _collectives(sizes, device)
    exported = _resume(cfg, jobs, stores, run, agree_min)  # refusals leave the folder as is
    timing.mark("resuming")
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n", encoding="utf-8")
    writes = sizes["dp_rank"] == 0  # one writer per tensor/pipeline shard
    if writes:
        for store in stores.values():
            store.clean_leftovers()
    rank0 = sizes["rank"] == 0
    metrics = MetricsWriter(out, enabled=_writes_metrics(sizes, run), device=device)
    bar = ProgressBar(
        sum(job.total_steps for job in jobs),
        sum(job.step if not job.finished else job.total_steps for job in jobs),
        enabled=cfg.logging.progress_bar and _writes_metrics(sizes, run),
    )
    writer = BackgroundWriter(WRITER_THREADS)
    saver = Saver(
        writer,
        cfg.model,
        stores.__getitem__,
        lambda name: out / "adapters" / name,
        exports=rank0,
        single_shard=sizes["tp"] * sizes["pp"] == 1,
        on_exported=lambda name, folder: logger.info("adapter %s: exported to %s", name, folder),
    )
    stream = JobStream(
        capacity=cfg.planner.token_capacity,
        num_stages=cfg.parallel.pp,
        tile_height=cfg.planner.tile_height,
        seed=cfg.train.seed,
        start_planner=start_planner(cfg),
        on_plan=_on_plan(cfg, sizes, rank0),
        plans_in_process=plans_in_process,
    )
    settings = SessionSettings(
        save_every=cfg.train.save_every,
        eval_every=cfg.train.eval_every,
        capacity=cfg.planner.token_capacity,
        seed=cfg.train.seed,
        log_every=cfg.logging.log_every,
        pad_to_multiple=shards,
        writes=writes,
        single_shard=sizes["tp"] * sizes["pp"] == 1,
        cut_on_failure=sizes["world"] == 1,
        warm_up=device.type == "cuda",  # the one-off costs it moves are a GPU's
    )
    session = Session(
        run,
        stream,
        settings,
        saver=saver,
        staging=staging_pool(cfg.train.save_buffer_gib, pinned=device.type == "cuda"),
        eval_losses=_eval_losses(cfg, run, sizes),
        shared=shared_identity(cfg),
        metrics=lambda job: metrics,
        bar=bar,
        agree_flags=agree_flags,
        on_segment=_bubble_records(run, sizes, metrics),
    )
    session.timing = timing
    for slot, job in enumerate(jobs):
        if job.name not in exported:  # an ended job without its export gets it here
            session.admit(job, slot)
    timing.mark("admitting (saves' staging memory pinned)")
    if settings.writes:
        staging = session.staging
        size = staging.capacity / 2**30
        logger.info(
            "saves: staged in up to %s of host memory (train.save_buffer_gib%s)",
            f"{size:.1f} GiB" if size >= 1 else f"{size * 1024:.1f} MiB",
            ": two saves of every adapter, at most a quarter of this machine's memory"
            if staging.sized_to_jobs
            else "",
        )
    run.model.train()
    try:
        session.train()
        bar.close()
        session.finish()
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: say where the run stopped
        steps = ", ".join(f"{job.name} {job.step}" for job in jobs)
        raise type(stop)(f"step {min(job.step for job in jobs)} ({steps})") from None
    finally:
        bar.close()
        stream.close()
        writer.close()
    _report(session, jobs, metrics)
    return {job.name: job.run.losses for job in jobs}


def _report(session: Session, jobs: Sequence[AdapterJob], metrics: MetricsWriter) -> None:
    """The run's last lines: each adapter's outcome, where the time went; failures raised."""
    record = session.timing.record()
    capacity = session.settings.capacity
    record["fill"] = session.timing.tokens / max(record["microbatches"] * capacity, 1)
    record["replans"] = session.stream.replans
    record["saved_gb"] = session.saver.writer.bytes_written / 1e9
    record["save_wait_s"] = session.staging.waited_s  # training waiting for staging memory
    device = session.run.device
    if device.type == "cuda":
        record["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    graphs = session.run.graphs
    if graphs is not None:
        record["graph_replays"], record["graph_captures"] = graphs.replays, graphs.captures
    metrics.log_run(sum(job.step for job in jobs), record)
    metrics.close()
    for job in jobs:
        first = job.run.losses[0] if job.run.losses else float("nan")
        last = job.run.losses[-1] if job.run.losses else float("nan")
        logger.info(
            "adapter %s: %s after %d of %d steps, loss %.4f -> %.4f%s",
            job.name,
            job.status,
            job.step,
            job.total_steps,
            first,
            last,
            f" ({job.reason})" if job.reason else "",
        )
    rate = record.get("train_tokens_per_s", 0.0)
    logger.info(
        "training %.1fk tok/s over %.1f s | start-up %.1f s, first step %.1f s (Triton "
        "compilation on a cold cache), evaluation %.1f s, after the last step %.1f s "
        "(saves and exports) | wall %.1f s | %.1f GB saved, training waited %.1f s for it%s",
        rate / 1e3,
        record.get("train_s", 0.0),
        record["startup_s"],
        record.get("first_step_s", 0.0),
        record["eval_s"],
        record.get("end_s", 0.0),
        record["wall_s"],
        record["saved_gb"],
        record["save_wait_s"],
        f" | peak GPU memory {record['peak_gpu_gib']:.1f} GiB" if "peak_gpu_gib" in record else "",
    )
    phases = record.get("startup_phases_s", {})
    logger.info(
        "start-up %.1f s after launch: %s",
        sum(phases.values()),
        ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items()),
    )
    if graphs is not None:
        logger.info(
            "CUDA graphs: %d of %d microbatches replayed, %d shapes captured",
            graphs.replays,
            record["microbatches"],
            graphs.captures,
        )
    failed = [job for job in jobs if job.status == "failed"]
    if failed:
        raise JobsFailedError(
            f"{len(failed)} of {len(jobs)} adapters failed; the others finished and were "
            "exported (each failed adapter's last checkpoint is kept):\n  - "
            + "\n  - ".join(job.reason for job in failed)
        )
