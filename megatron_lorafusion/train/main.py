"""`main(cfg)`: the one place that starts process groups, seeds, builds and trains.

Order matters for a clean failure: the config is validated and every dataset is read and
tokenised before any process group, model or output folder exists.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path

import torch

from megatron_lorafusion.config import ConfigError, JobConfig, adapter_scaling
from megatron_lorafusion.data import (
    TokenizedSample,
    load_adapter_dataset,
    load_tokenizer,
    pack_microbatch,
    training_order,
)
from megatron_lorafusion.lifetime import die_with_parent
from megatron_lorafusion.pipeline import AdapterRun
from megatron_lorafusion.planner import (
    BackgroundPlanner,
    Microbatch,
    Plan,
    PlanProblem,
    PlanVerifier,
)
from megatron_lorafusion.train.evaluate import (
    Evaluator,
    LossSums,
    one_stage_loss_sums,
    split_eval_datasets,
)
from megatron_lorafusion.train.export import check_finite_weights, write_peft_folder
from megatron_lorafusion.train.metrics import (
    MetricsWriter,
    ProgressBar,
    job_summary,
    plan_summary,
    read_metrics,
)
from megatron_lorafusion.train.optim import AdapterAdamW
from megatron_lorafusion.train.recipe import Run, build_run
from megatron_lorafusion.train.resume import make_resume_session

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _device(cfg: JobConfig) -> torch.device:
    if cfg.train.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def _samples_per_adapter(cfg: JobConfig, dataset_sizes: list[int]) -> list[int]:
    if cfg.train.steps is not None:
        return [cfg.train.steps * a.global_batch_size for a in cfg.adapters]
    return [cfg.train.epochs * n for n in dataset_sizes]


def prepare_problem(
    cfg: JobConfig, datasets: list[list[TokenizedSample]]
) -> tuple[PlanProblem, list[list[int]], list[list[int]]]:
    """Training orders, the planning problem and each global batch's trained-token count.

    Returns:
        ``(problem, orders, batch_tokens)``: ``orders[a][i]`` is the dataset row at training
        position ``i``; ``batch_tokens[a][j]`` the loss denominator of global batch ``j``.
    """
    totals = _samples_per_adapter(cfg, [len(d) for d in datasets])
    orders = [
        training_order(len(d), total, cfg.train.seed, a, cfg.data.shuffle)
        for a, (d, total) in enumerate(zip(datasets, totals, strict=True))
    ]
    lengths = tuple(
        tuple(len(d[row]) for row in order) for d, order in zip(datasets, orders, strict=True)
    )
    gbs = tuple(a.global_batch_size for a in cfg.adapters)
    problem = PlanProblem(
        lengths,
        gbs,
        cfg.planner.token_capacity,
        num_stages=cfg.parallel.pp,
        tile_height=cfg.planner.tile_height,
        seed=cfg.train.seed,
    )
    batch_tokens = [
        [
            sum(sum(d[order[i]].loss_mask) for i in range(j * g, min((j + 1) * g, len(order))))
            for j in range(problem.num_global_batches(a))
        ]
        for a, (d, order, g) in enumerate(zip(datasets, orders, gbs, strict=True))
    ]
    return problem, orders, batch_tokens


def checked_stream(
    planner: Iterable[Plan],
    problem: PlanProblem,
    agree: Callable[[str], None] | None = None,
    on_first: Callable[[Plan], None] | None = None,
) -> Iterator[Microbatch]:
    """The planner's microbatches, each chunk verified before any of it runs.

    Args:
        planner: the plan's chunks in order (a `BackgroundPlanner`).
        problem: what was planned.
        agree: called once, with the problem and the first chunk as text, before anything
            is yielded: every rank reads its first microbatch before any communication, so a
            collective there (`check_same_across_ranks`) stops ranks that planned other
            samples (other data behind the same path, another planner) before they train.
        on_first: called with the first chunk before anything is yielded (its summary).

    Raises:
        PlanError: when a chunk breaks capacity, coverage, batch order or step markers
            (the bubble lemma is the runner's check, on every rank, ``S + 1`` ahead).
    """
    verifier = PlanVerifier(problem, lemma=False)
    for index, chunk in enumerate(planner):
        if index == 0 and agree is not None:
            agree(repr((problem, chunk.microbatches)))
        if index == 0 and on_first is not None:
            on_first(chunk)
        verifier.feed(chunk.microbatches)
        yield from chunk.microbatches
    verifier.finish()


def _plans_agree(payload: str) -> None:
    """`checked_stream`'s check on a run of several ranks: every rank planned the same."""
    from megatron_lorafusion.pipeline import check_same_across_ranks

    check_same_across_ranks(payload, "plan (its samples' lengths and first microbatches)")


_COMM_TIMEOUT_S = 600.0  # a dead or stuck peer makes every rank fail within this time


def _check_same_job(cfg: JobConfig, sizes: dict[str, int]) -> None:
    """Refuse on every rank unless all ranks run the same job config (before any work)."""
    from megatron_lorafusion.pipeline import check_same_across_ranks

    if sizes["world"] > 1:
        check_same_across_ranks(json.dumps(asdict(cfg), sort_keys=True), "job config")


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


def _counted(stream: Iterable[Microbatch], counts: dict[str, float]) -> Iterator[Microbatch]:
    """The stream, adding its microbatches and their tokens to ``counts``."""
    for microbatch in stream:
        counts["microbatches"] += 1
        counts["tokens"] += microbatch.tokens
        yield microbatch


def _run_record(
    counts: dict[str, float], capacity: int, start: float, bubble: float | None = None
) -> dict[str, float]:
    """Run-wide metrics: tokens/s (planned tokens computed), microbatches, fill, bubble."""
    record = {
        "tokens_per_s": counts["tokens"] / max(time.perf_counter() - start, 1e-9),
        "microbatches": counts["microbatches"],
        "fill": counts["tokens"] / max(counts["microbatches"] * capacity, 1),
    }
    if bubble is not None:
        record["bubble"] = bubble
    return record


def _measured_bubble(events, groups, sizes: dict[str, int], device: torch.device) -> float:
    """Mean over stages of each stage's idle share of its span (a collective over the world).

    Each stage's first TP/DP rank contributes its own busy time and span (first operation's
    start to last operation's end, from `run_pipeline(record_events=True)`).
    """
    import torch.distributed as dist

    stages = torch.zeros(2, groups.num_stages, dtype=torch.float64)
    if events and sizes["tp_rank"] == 0 and groups.dp_rank == 0:
        stages[0, groups.stage] = sum(e.compute_s for e in events)
        stages[1, groups.stage] = max(e.end_s for e in events) - min(e.start_s for e in events)
    stages = stages.to(device)
    dist.all_reduce(stages)
    busy, span = stages.cpu()
    idle = [1.0 - b / t for b, t in zip(busy.tolist(), span.tolist(), strict=True) if t > 0]
    return sum(idle) / max(len(idle), 1)


def _run_stream(
    cfg: JobConfig,
    stream: Iterator[Microbatch],
    run: Run,
    make_batch,
    session,
    evaluator: Evaluator,
    metrics: MetricsWriter,
    sizes: dict[str, int],
    on_step=None,
) -> None:
    """Run the stream through the multi-adapter 1F1B runner (one process: ``PP = DP = 1``).

    Any PP × DP grid, TP inside. The stream is cut at the checkpoint points and after the
    microbatches that finish an evaluated step (`ResumeSession.segments`): each segment is
    one 1F1B stream, drained at its end (every DP all-reduce waited for, every due step
    taken), then the due adapters are evaluated through the pipeline (every stage holds
    their new weights, as one process does right after the step) and, at a save point, every
    rank saves its shard. Each cut costs one fill and drain of the pipeline, about
    ``(S - 1) × (t_F + t_B)`` of idle time per stage (none at ``S = 1``). A pipelined run
    also measures its bubble (a metrics record per segment).
    """
    runs, groups = run.runs, run.groups
    pipelined = groups.num_stages > 1 or groups.dp_size > 1

    def evaluated(finishes, steps) -> bool:
        return any(evaluator.is_due(a, steps[a], len(runs[a].batch_tokens)) for a in finishes)

    counts, start = {"microbatches": 0, "tokens": 0}, time.perf_counter()
    for first_index, segment in session.segments(stream, evaluated):
        events = run.train(
            _counted(segment, counts),
            make_batch,
            first_index=first_index,
            on_step=on_step,
            log_every=cfg.logging.log_every,
            record_events=pipelined,
        )
        if pipelined:  # a record per segment, with its measured bubble
            bubble = _measured_bubble(events, groups, sizes, run.device)
            metrics.log_run(
                sum(run.step for run in runs),
                _run_record(counts, cfg.planner.token_capacity, start, bubble),
            )
        evaluator.run_due()  # before the checkpoint
        if session.at_save_point:
            session.save()
    record = _run_record(counts, cfg.planner.token_capacity, start)
    if not pipelined:  # one run-wide record at the end
        metrics.log_run(sum(run.step for run in runs), record)
    logger.info(
        "trained %d microbatches at %.1fk tok/s, fill %.1f%%",
        record["microbatches"],
        record["tokens_per_s"] / 1e3,
        100 * record["fill"],
    )


def _eval_loss_sums(
    cfg: JobConfig,
    model,
    lora,
    groups,
    pack_eval,
    device: torch.device,
    shards: int,
    tp_rank: int,
) -> LossSums:
    """The eval rows' loss sums: the one-stage forward, or forward-only through the pipeline."""
    from megatron_lorafusion.pipeline import forward_loss_sums, gpt_stage_forward

    stage = gpt_stage_forward(model, lora, is_first=groups.is_first, is_last=groups.is_last)
    if groups.num_stages == 1 and groups.dp_size == 1:
        return one_stage_loss_sums(lambda batch: stage(batch, None), pack_eval, len(cfg.adapters))
    return lambda microbatches: forward_loss_sums(
        microbatches,
        stage,
        pack_eval,
        groups,
        num_adapters=len(cfg.adapters),
        hidden_size=cfg.model.hidden_size,
        activation_dtype=_DTYPES[cfg.train.precision],
        device=device,
        counts_once=tp_rank == 0,
        sequence_shards=shards,
    )


def _writes_metrics(sizes: dict[str, int], groups) -> bool:
    """The one rank that writes metrics: the first TP/DP rank of the stage with the losses."""
    return groups.is_last and sizes["dp_rank"] == 0 and sizes["tp_rank"] == 0


def _metrics_records(out: Path) -> list[dict]:
    try:
        return read_metrics(out)
    except FileNotFoundError:
        return []


def _step_hooks(
    metrics: MetricsWriter,
    evaluator: Evaluator,
    optimizer: AdapterAdamW,
    bar: ProgressBar,
    runs: list[AdapterRun],
) -> Callable[[int, AdapterRun], None]:
    """The runner's ``on_step``: metrics and bar per step, evaluations marked due."""

    def on_step(a: int, run: AdapterRun) -> None:
        bar.step(run.batch_tokens[run.step - 1], {r.name: r.losses[-1] for r in runs if r.losses})
        stopped = a in optimizer.stopped
        norm = None if stopped or not metrics.enabled else optimizer.grad_norm(a)
        metrics.log_step(
            a,
            run.step,
            loss=run.losses[-1],
            lr=0.0 if stopped else optimizer.last_lr[a],
            grad_norm=norm,
            tokens=run.batch_tokens[run.step - 1],
        )
        evaluator.on_step(a, run.step, len(run.batch_tokens))

    return on_step


def _full_adapter_states(
    lora, sizes: dict[str, int], local=None
) -> list[dict[str, torch.Tensor]] | None:
    """Under PP or TP, every adapter's whole factors on rank 0 (a collective); else None.

    ``local``: per adapter, this rank's factors to gather instead of the current ones.
    """
    if sizes["pp"] == 1 and sizes["tp"] == 1:
        return None
    from megatron_lorafusion.pipeline.gather import gather_adapter_states

    return gather_adapter_states(
        lora, tp_rank=sizes["tp_rank"], tp_size=sizes["tp"], dp_rank=sizes["dp_rank"], local=local
    )


def main(cfg: JobConfig) -> dict[str, list[float]]:
    """Train every adapter of ``cfg`` together, then export each as a PEFT folder.

    Returns:
        Per adapter name, the mean loss of each optimizer step.

    Raises:
        ConfigError: ``train.device: cuda`` without a CUDA device (before anything is created).
        DataError: on an unusable dataset (before anything is created).
        LemmaError: when the plan breaks the bubble lemma for ``parallel.pp`` stages.
    """
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
    datasets = [load_adapter_dataset(a, cfg.data, tokenizer) for a in cfg.adapters]
    datasets, held = split_eval_datasets(cfg, datasets, tokenizer)
    problem, orders, batch_tokens = prepare_problem(cfg, datasets)
    rank0 = os.environ.get("RANK", "0") == "0"  # torchrun's; a plain run is rank 0
    if rank0:  # the first screen, before the model is built (seconds on a real model)
        for line in job_summary(cfg, problem, int(os.environ.get("WORLD_SIZE", "1"))).splitlines():
            logger.info("%s", line)  # a record per line: every line names its logger
    # Planned while the model builds: the whole run is planned before its first chunk.
    planner = BackgroundPlanner(
        problem, solver=cfg.planner.solver, time_limit_s=cfg.planner.time_limit_s
    )
    try:
        return _train(cfg, datasets, held, problem, orders, batch_tokens, planner, rank0)
    finally:
        planner.close()


def _train(
    cfg: JobConfig,
    datasets,
    held,
    problem: PlanProblem,
    orders,
    batch_tokens,
    planner: BackgroundPlanner,
    rank0: bool,
) -> dict[str, list[float]]:
    """`main` once the data is read and the planner started: build, train, export."""
    from megatron_lorafusion.mcore.parallel import (
        destroy_model_parallel,
        init_model_parallel,
        parallel_sizes,
    )

    device = _device(cfg)
    shards = _sequence_shards(cfg, device)
    init_model_parallel(
        cfg.parallel.tp, cfg.parallel.pp, device, cfg.train.seed, timeout_s=_COMM_TIMEOUT_S
    )
    try:
        sizes = parallel_sizes()
        _check_same_job(cfg, sizes)
        built = build_run(
            cfg.model,
            cfg.adapters,
            batch_tokens,
            device=device,
            params_dtype=_DTYPES[cfg.train.precision],
            seed=cfg.train.seed,
            sequence_shards=shards,
            recompute=cfg.train.recompute,
            defer_wgrad=cfg.parallel.defer_wgrad,
            track_grad_norms=True,  # metrics.jsonl's grad_norm
            comm_timeout_s=_COMM_TIMEOUT_S,
        )
        model, lora, optimizer, runs, groups = (
            built.model,
            built.lora,
            built.optimizer,
            built.runs,
            built.groups,
        )
        out = Path(cfg.train.output_dir)
        is_writer = sizes["rank"] == 0

        def make_batch(microbatch: Microbatch, index: int):
            return pack_microbatch(
                microbatch,
                datasets,
                orders,
                len(cfg.adapters),
                device,
                dropout_seed=cfg.train.seed * 1_000_003 + index,
                pad_to_multiple=shards,
            )

        session = make_resume_session(cfg, sizes, runs, optimizer, lora)  # checkpoints, resume
        first = session.restore(cfg.train.resume)
        # Written only once the resume is accepted: a refused one leaves the run as it was.
        out.mkdir(parents=True, exist_ok=True)
        (out / "job.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n", encoding="utf-8")
        metrics = MetricsWriter(
            out,
            [a.name for a in cfg.adapters],
            device=device,
            enabled=_writes_metrics(sizes, groups),
        )
        held_orders = [list(range(len(rows))) for rows in held]

        def pack_eval(microbatch: Microbatch):
            return pack_microbatch(
                microbatch,
                held,
                held_orders,
                len(cfg.adapters),
                device,
                dropout_seed=0,
                pad_to_multiple=shards,
            )

        evaluator = Evaluator(
            cfg,
            held,
            model,
            _eval_loss_sums(cfg, model, lora, groups, pack_eval, device, shards, sizes["tp_rank"]),
            lora,
            optimizer,
            metrics.log_eval,
            is_writer=sizes["dp_rank"] == 0,
            shard=None if sizes["tp"] == sizes["pp"] == 1 else (sizes["tp_rank"], sizes["pp_rank"]),
        )
        if first:
            evaluator.restore(_metrics_records(out), [run.step for run in runs])
        bar = ProgressBar(
            sum(len(t) for t in batch_tokens),
            sum(run.step for run in runs),
            enabled=cfg.logging.progress_bar and _writes_metrics(sizes, groups),
        )
        on_step = _step_hooks(metrics, evaluator, optimizer, bar, runs)
        model.train()
        agree = None if sizes["world"] == 1 else _plans_agree

        def on_first(chunk: Plan) -> None:
            if rank0:
                steps = sum(len(mb.finishes) for mb in chunk.microbatches)
                first_chunk = steps < sum(len(t) for t in batch_tokens)
                for line in plan_summary(chunk, problem, first_chunk=first_chunk).splitlines():
                    logger.info("%s", line)

        try:
            _run_stream(
                cfg,
                checked_stream(planner, problem, agree, on_first),
                built,
                make_batch,
                session,
                evaluator,
                metrics,
                sizes,
                on_step,
            )
        except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: say where the run stopped
            steps = ", ".join(f"{run.name} {run.step}" for run in runs)
            raise type(stop)(f"step {min(run.step for run in runs)} ({steps})") from None
        finally:
            bar.close()
        metrics.close()
        session.save()  # every rank writes its shard (a no-op after a pipelined run's last)
        states = _full_adapter_states(lora, sizes)
        best = [evaluator.export_state(a) for a in range(len(cfg.adapters))]  # by eval
        if any(b is not None for b in best) and sizes["pp"] * sizes["tp"] > 1:  # every rank
            best = _full_adapter_states(lora, sizes, best) or best
        if is_writer:
            for a, adapter in enumerate(cfg.adapters):  # all or none: never a NaN weight out
                check_finite_weights(
                    adapter, lora.adapter_state_dict(a) if states is None else states[a]
                )
            for a, (adapter, run) in enumerate(zip(cfg.adapters, runs, strict=True)):
                folder = write_peft_folder(
                    out / "adapters" / adapter.name,
                    adapter,
                    best[a] or (lora.adapter_state_dict(a) if states is None else states[a]),
                    cfg.model,
                )
                logger.info(
                    "adapter %s (scale %.3g): %d steps, loss %.4f -> %.4f, exported to %s",
                    adapter.name,
                    adapter_scaling(adapter),
                    run.step,
                    run.losses[0],
                    run.losses[-1],
                    folder,
                )
        return {run.name: run.losses for run in runs}
    finally:
        destroy_model_parallel()
