"""Per-adapter evaluation and early stopping, in one process or across TP × PP × DP ranks.

Each adapter may hold out rows (``eval_dataset``, or ``eval_fraction`` of its training file).
Every ``train.eval_every`` of its optimizer steps (and at its last) its eval loss, the
per-token mean over all its held-out rows, is computed without gradients and with dropout
off, the rows of every adapter due at one microbatch packed together in microbatches of at
most ``planner.token_capacity`` tokens. With ``early_stopping_patience`` an adapter whose eval
loss has not improved for that many evaluations stops stepping (`AdapterAdamW.stopped`; its
samples still flow, their gradients are dropped) and its best weights are exported.

The loss sums come from a `LossSums` function: `one_stage_loss_sums` in one process (and on
each TP rank alike), `pipeline.forward_loss_sums` through the pipeline and DP replicas, which
a pipelined run calls at a drained cut of its stream (`cut_after`). Every rank gets the same
totals, so every rank takes the same early-stopping decision.

Early-stopping state is rebuilt on resume from ``metrics.jsonl`` (the evaluations up to the
restored step) and ``best/<adapter>.pt`` (the best weights, saved at each improvement; one
``best/<adapter>_tp<t>_pp<p>.pt`` per shard under TP or PP); the evaluations run before each
checkpoint, so a resumed run stops where an uninterrupted one does.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from megatron_lorafusion.config import ConfigError, JobConfig
from megatron_lorafusion.data import PackedBatch, TokenizedSample, load_adapter_dataset
from megatron_lorafusion.planner import Microbatch, Sample
from megatron_lorafusion.validation import held_out_rows, planned_samples_problems

__all__ = ["Evaluator", "LossSums", "one_stage_loss_sums", "split_eval_datasets"]

logger = logging.getLogger(__name__)

LossSums = Callable[[Sequence[Microbatch]], tuple[torch.Tensor, torch.Tensor]]
"""``eval microbatches -> (loss sums, trained tokens)``, each (A,) float64 CPU, the same on
every rank."""


def split_eval_datasets(
    cfg: JobConfig, datasets: list[list[TokenizedSample]], tokenizer
) -> tuple[list[list[TokenizedSample]], list[list[TokenizedSample]]]:
    """Per adapter its training rows and its eval rows (empty: no evaluation).

    ``eval_fraction`` holds out ``round(fraction × rows)`` rows (at least one, at most all but
    one) chosen by a generator seeded with ``(train.seed, adapter id)``.

    Raises:
        ConfigError: when the samples the run would plan (``train.epochs`` × these rows)
            pass `validation.MAX_SAMPLES` or this machine's free memory, before any is.
    """
    train, held = [], []
    for a, (adapter, rows) in enumerate(zip(cfg.adapters, datasets, strict=True)):
        if adapter.eval_dataset is not None:
            eval_adapter = replace(adapter, dataset=adapter.eval_dataset)
            train.append(rows)
            held.append(load_adapter_dataset(eval_adapter, cfg.data, tokenizer))
        elif count := held_out_rows(adapter.eval_fraction, len(rows)):
            chosen = set(
                random.Random(f"{cfg.train.seed}:eval:{a}").sample(range(len(rows)), count)
            )
            train.append([r for i, r in enumerate(rows) if i not in chosen])
            held.append([r for i, r in enumerate(rows) if i in chosen])
        else:
            train.append(rows)
            held.append([])
    # The rows are known only now: under train.epochs the plan's size too (issue 36).
    if problems := planned_samples_problems(cfg, [(len(rows), True) for rows in train]):
        raise ConfigError(problems)
    return train, held


def _pack(
    held: Sequence[Sequence[TokenizedSample]], adapter_ids: Sequence[int], capacity: int
) -> list[Microbatch]:
    """The eval rows of ``adapter_ids`` in order, cut into microbatches of <= capacity tokens."""
    microbatches, current, used = [], [], 0
    for a in sorted(adapter_ids):
        for i, row in enumerate(held[a]):
            if current and used + len(row) > capacity:
                microbatches.append(Microbatch(tuple(current)))
                current, used = [], 0
            current.append(Sample(a, i, len(row)))
            used += len(row)
    if current:
        microbatches.append(Microbatch(tuple(current)))
    return microbatches


def one_stage_loss_sums(
    forward: Callable[[PackedBatch], torch.Tensor],
    make_batch: Callable[[Microbatch], PackedBatch],
    num_adapters: int,
) -> LossSums:
    """`LossSums` of a one-stage model: ``forward(batch) -> (1, T)`` fp32 token losses."""

    @torch.no_grad()
    def loss_sums(microbatches: Sequence[Microbatch]) -> tuple[torch.Tensor, torch.Tensor]:
        sums = torch.zeros(num_adapters, dtype=torch.float64)
        counts = torch.zeros(num_adapters, dtype=torch.float64)
        for mb in microbatches:
            if mb.is_idle:  # nothing to evaluate (a plan's idle slot)
                continue
            batch = make_batch(mb)
            token_loss = (forward(batch) * batch.loss_mask)[0]  # (T,)
            rows = batch.layout.row_adapter(token_loss.device)
            per = torch.zeros(num_adapters, dtype=torch.float32, device=token_loss.device)
            per.index_add_(0, rows, token_loss.float())
            tokens = torch.zeros(num_adapters, dtype=torch.float32, device=token_loss.device)
            tokens.index_add_(0, rows, batch.loss_mask[0].float())
            sums += per.double().cpu()
            counts += tokens.double().cpu()
        return sums, counts

    return loss_sums


class Evaluator:
    """Eval losses and early stopping of every adapter of a run.

    Args:
        cfg: the job (eval_every, patience, token capacity, output folder).
        held: per adapter, its eval rows (`split_eval_datasets`).
        model: this rank's model (switched to eval mode while evaluating).
        loss_sums: the eval rows' loss sums (`one_stage_loss_sums`, or the pipeline's).
        lora: the adapters' `LoRAContext` (best weights are copied from it).
        optimizer: the adapters' `AdapterAdamW` (stopped adapters join ``stopped``).
        log_eval: called with ``(adapter id, step, eval loss)`` (the metrics writer).
        is_writer: this rank writes its shard of ``best/`` (DP replica 0).
        shard: ``(tp_rank, pp_rank)`` under TP or PP (names the best-weights files); None in
            a run of one shard.
    """

    def __init__(
        self,
        cfg: JobConfig,
        held: list[list[TokenizedSample]],
        model,
        loss_sums: LossSums,
        lora,
        optimizer,
        log_eval: Callable[[int, int, float], None],
        is_writer: bool,
        shard: tuple[int, int] | None = None,
    ):
        self.cfg, self.held, self.model, self.loss_sums = cfg, held, model, loss_sums
        self.lora, self.optimizer = lora, optimizer
        self.log_eval, self.is_writer, self.shard = log_eval, is_writer, shard
        self.best_dir = Path(cfg.train.output_dir) / "best"
        num = len(cfg.adapters)
        self.best = [math.inf] * num
        self.best_step = [0] * num
        self.bad = [0] * num
        self.best_states: dict[int, dict[str, torch.Tensor]] = {}
        self.due: set[int] = set()
        self.last_step: list[int] = [0] * num

    def enabled(self, a: int) -> bool:
        """Adapter ``a`` is evaluated (it has eval rows and train.eval_every > 0)."""
        return self.cfg.train.eval_every > 0 and bool(self.held[a])

    def is_due(self, a: int, step: int, total_steps: int) -> bool:
        """Adapter ``a`` is evaluated after its step ``step`` of ``total_steps``."""
        if not self.enabled(a) or a in self.optimizer.stopped:
            return False
        return step % self.cfg.train.eval_every == 0 or step == total_steps

    def on_step(self, a: int, step: int, total_steps: int) -> None:
        """Mark adapter ``a`` due after its step ``step`` of ``total_steps`` when scheduled."""
        if self.is_due(a, step, total_steps):
            self.due.add(a)
            self.last_step[a] = step

    def _best_path(self, a: int) -> Path:
        name = self.cfg.adapters[a].name
        if self.shard is None:
            return self.best_dir / f"{name}.pt"
        return self.best_dir / f"{name}_tp{self.shard[0]}_pp{self.shard[1]}.pt"

    def run_due(self) -> None:
        """Evaluate the due adapters together and apply early stopping."""
        if not self.due:
            return
        due, self.due = sorted(self.due), set()
        for a, loss in self.evaluate(due).items():
            step = self.last_step[a]
            logger.info(
                "adapter %s step %d | eval loss %.4f", self.cfg.adapters[a].name, step, loss
            )
            self.log_eval(a, step, loss)
            self._update(a, step, loss, save=True)

    @torch.no_grad()
    def evaluate(self, adapter_ids: Sequence[int]) -> dict[int, float]:
        """Per adapter, the per-token mean loss over its eval rows (no gradients, no dropout)."""
        was_training = self.model.training
        self.model.eval()
        try:
            sums, counts = self.loss_sums(
                _pack(self.held, adapter_ids, self.cfg.planner.token_capacity)
            )
        finally:
            self.model.train(was_training)
        return {a: float(sums[a] / max(counts[a].item(), 1.0)) for a in adapter_ids}

    def _update(self, a: int, step: int, loss: float, *, save: bool) -> None:
        patience = self.cfg.adapters[a].early_stopping_patience
        if loss < self.best[a]:
            self.best[a], self.best_step[a], self.bad[a] = loss, step, 0
            if patience > 0 and save:
                self.best_states[a] = {
                    n: t.cpu() for n, t in self.lora.adapter_state_dict(a).items()
                }
                if self.is_writer:
                    self.best_dir.mkdir(parents=True, exist_ok=True)
                    torch.save(
                        {"step": step, "eval_loss": loss, "state": self.best_states[a]},
                        self._best_path(a),
                    )
            return
        self.bad[a] += 1
        if patience > 0 and self.bad[a] >= patience and a not in self.optimizer.stopped:
            self.optimizer.stopped.add(a)
            logger.info(
                "adapter %s: early stop at step %d (%d evaluations without improving "
                "on %.4f at step %d)",
                self.cfg.adapters[a].name,
                step,
                self.bad[a],
                self.best[a],
                self.best_step[a],
            )

    def restore(self, records: Sequence[dict], steps: Sequence[int]) -> None:
        """Replay the evaluations of a resumed run (step <= its restored step per adapter)."""
        names = {ad.name: a for a, ad in enumerate(self.cfg.adapters)}
        evals = sorted(
            (r["step"], names[r["adapter"]], r["eval_loss"])
            for r in records
            if "eval_loss" in r and r.get("adapter") in names
        )
        for step, a, loss in evals:
            if step <= steps[a]:
                self._update(a, step, loss, save=False)
        for a, adapter in enumerate(self.cfg.adapters):
            path = self._best_path(a)
            if adapter.early_stopping_patience > 0 and self.best_step[a] and path.is_file():
                saved = torch.load(path, map_location="cpu", weights_only=True)
                if saved["step"] == self.best_step[a]:
                    self.best_states[a] = saved["state"]

    def export_state(self, a: int) -> dict[str, torch.Tensor] | None:
        """The weights to export for adapter ``a``: its best by eval under early stopping."""
        if self.cfg.adapters[a].early_stopping_patience > 0:
            return self.best_states.get(a)
        return None
