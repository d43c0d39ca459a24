"""`main(cfg)`: the one place that starts process groups, seeds, builds and trains.

Order matters for a clean failure: the config is validated and every dataset is read and
tokenised before any process group, model or output folder exists.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch

from megatron_lorafusion.config import JobConfig, adapter_scaling
from megatron_lorafusion.data import (
    ByteTokenizer,
    TokenizedSample,
    load_adapter_dataset,
    pack_microbatch,
    training_order,
)
from megatron_lorafusion.planner import BackgroundPlanner, Microbatch, PlanProblem, PlanVerifier
from megatron_lorafusion.train.checkpoint import save_adapter_checkpoint
from megatron_lorafusion.train.export import write_peft_folder
from megatron_lorafusion.train.loop import AdapterRun, run_plan
from megatron_lorafusion.train.optim import build_optimizer

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _device(cfg: JobConfig) -> torch.device:
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but no CUDA device is available")
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
    lengths = tuple(tuple(len(d[row]) for row in order)
                    for d, order in zip(datasets, orders, strict=True))
    gbs = tuple(a.global_batch_size for a in cfg.adapters)
    problem = PlanProblem(lengths, gbs, cfg.planner.token_capacity,
                          num_stages=cfg.parallel.pp, tile_height=cfg.planner.tile_height,
                          seed=cfg.train.seed)
    batch_tokens = [
        [sum(sum(d[order[i]].loss_mask) for i in range(j * g, min((j + 1) * g, len(order))))
         for j in range(problem.num_global_batches(a))]
        for a, (d, order, g) in enumerate(zip(datasets, orders, gbs, strict=True))
    ]
    return problem, orders, batch_tokens


def checked_stream(planner: BackgroundPlanner, problem: PlanProblem) -> Iterator[Microbatch]:
    """The planner's microbatches, each chunk verified before any of it runs.

    Raises:
        PlanError: when a chunk breaks capacity, coverage or the bubble lemma.
    """
    verifier = PlanVerifier(problem)
    for chunk in planner:
        verifier.feed(chunk.microbatches)
        yield from chunk.microbatches
    verifier.finish()


def main(cfg: JobConfig) -> dict[str, list[float]]:
    """Train every adapter of ``cfg`` together, then export each as a PEFT folder.

    Returns:
        Per adapter name, the mean loss of each optimizer step.

    Raises:
        DataError: on an unusable dataset (before anything is created).
        NotImplementedError: for pipeline or data parallel runs (not in this release).
    """
    tokenizer = ByteTokenizer()
    datasets = [load_adapter_dataset(a, cfg.data, tokenizer) for a in cfg.adapters]
    problem, orders, batch_tokens = prepare_problem(cfg, datasets)

    from megatron_lorafusion import mcore
    from megatron_lorafusion.mcore.parallel import (
        destroy_model_parallel,
        init_model_parallel,
        packed_seq_params,
        parallel_sizes,
    )

    device = _device(cfg)
    init_model_parallel(cfg.parallel.tp, cfg.parallel.pp, device, cfg.train.seed)
    try:
        sizes = parallel_sizes()
        if sizes["pp"] > 1 or sizes["dp"] > 1:
            raise NotImplementedError(
                f"pipeline and data parallel training need the multi-adapter pipeline "
                f"schedule, which this release lacks; got pp={sizes['pp']}, dp={sizes['dp']}"
            )
        model = mcore.build_gpt_model(cfg.model, params_dtype=_DTYPES[cfg.train.precision],
                                      device=device)
        lora = mcore.apply_lora(model, cfg.adapters, seed=cfg.train.seed)
        runs = []
        for a, adapter in enumerate(cfg.adapters):
            params = [p for _, p in lora.adapter_parameters(a)]
            optimizer, scheduler = build_optimizer(params, adapter, len(batch_tokens[a]))
            runs.append(AdapterRun(adapter.name, optimizer, scheduler, batch_tokens[a]))
        out = Path(cfg.train.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "job.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n", encoding="utf-8")
        is_writer = sizes["rank"] == 0

        def make_batch(microbatch: Microbatch, index: int):
            return pack_microbatch(microbatch, datasets, orders, len(cfg.adapters), device,
                                   dropout_seed=cfg.train.seed * 1_000_003 + index)

        def forward(batch) -> torch.Tensor:
            lora.layout = batch.layout
            loss = model(batch.input_ids, batch.position_ids, None, labels=batch.labels,
                         packed_seq_params=packed_seq_params(batch.layout))
            return loss.float()

        def on_step(a: int, run: AdapterRun) -> None:
            every = cfg.train.save_every
            if is_writer and every and run.step % every == 0:
                save_adapter_checkpoint(out / "checkpoints" / run.name, run.step,
                                        lora.adapter_state_dict(a), run.optimizer,
                                        run.scheduler, run.losses)

        model.train()
        with BackgroundPlanner(problem, solver=cfg.planner.solver,
                               time_limit_s=cfg.planner.time_limit_s) as planner:
            run_plan(checked_stream(planner, problem), forward, make_batch, runs,
                     on_step=on_step, progress_bar=cfg.logging.progress_bar and is_writer,
                     log_every=cfg.logging.log_every)
        if is_writer:
            for a, (adapter, run) in enumerate(zip(cfg.adapters, runs, strict=True)):
                save_adapter_checkpoint(out / "checkpoints" / adapter.name, run.step,
                                        lora.adapter_state_dict(a), run.optimizer,
                                        run.scheduler, run.losses)
                folder = write_peft_folder(out / "adapters" / adapter.name, adapter,
                                           lora.adapter_state_dict(a), cfg.model)
                logger.info("adapter %s (scale %.3g): %d steps, loss %.4f -> %.4f, exported to %s",
                            adapter.name, adapter_scaling(adapter), run.step, run.losses[0],
                            run.losses[-1], folder)
        return {run.name: run.losses for run in runs}
    finally:
        destroy_model_parallel()
