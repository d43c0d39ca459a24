"""`Session`: the one training loop of a set of adapter jobs.

It reads top to bottom: admit jobs into free rows of the adapter tables, train the planned
stream of their samples (`JobStream`) in segments, and after each segment evaluate the jobs
that are due, commit their saves and retire the finished ones. `lorafusion train` admits
every adapter of its job at the start and ends when the last is finished; `lorafusion
serve` admits jobs from its inbox between segments (`train.server`).

Each job saves on its own: right after one of its optimizer steps (every
``train.save_every`` of its steps, at an evaluation that improves under early stopping, and
at its end), a writer thread writes its rows (`saving.Saver`); the segment goes on. The rows
of a job that trains on are first copied to a staging buffer on a side stream; a finished
job's stay in the tables until the writer copies them (`writer.DeferredRows`), and its row
goes to no other job before. A job that finishes is exported at once, in the background. A
job whose loss or weights turn NaN fails alone: its last good checkpoint stays, the others
train on, and the run ends with exit status 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from megatron_lorafusion.data import pack_microbatch
from megatron_lorafusion.planner import Microbatch
from megatron_lorafusion.train.checkpoint import TABLES, RowPacking, row_packing
from megatron_lorafusion.train.evaluate import LossSums, eval_microbatches
from megatron_lorafusion.train.job import AdapterJob
from megatron_lorafusion.train.metrics import MetricsWriter, ProgressBar
from megatron_lorafusion.train.recipe import Run
from megatron_lorafusion.train.saving import Saver, SaveRequest
from megatron_lorafusion.train.stream import CUT, JobStream
from megatron_lorafusion.train.writer import DeferredRows, StagingPool

__all__ = ["Session", "SessionSettings", "Timing"]

logger = logging.getLogger(__name__)

_END = object()  # the stream ran out
PLANNING = "planning"  # the start-up phase before a warm-up (`Timing.record` names the last)


@dataclass(frozen=True)
class SessionSettings:
    """What the loop reads from the job file.

    Attributes:
        save_every: save each job every this many of its steps (0: only at its end).
        eval_every: evaluate each job with eval rows every this many of its steps.
        capacity: tokens per microbatch (eval microbatches too).
        seed: ``train.seed`` (dropout masks).
        log_every: log a job's loss every this many of its steps.
        cut_every: end a segment after this many microbatches (0: only where needed); a
            server checks its inbox between segments.
        pad_to_multiple: pad microbatches to this many tokens (sequence parallelism; training
            microbatches also to the CUDA graphs' `MicrobatchGraphs.pad_tokens` while those
            are active).
        writes: this rank writes checkpoints (data-parallel replica 0 of its shard).
        single_shard: TP = PP = 1.
        cut_on_failure: end a segment as soon as a job fails (one process: every rank must
            cut at the same microbatch, so a run of several ranks agrees on failures at its
            next cut instead).
        cut_on_pause: end a segment as soon as ``until`` (`Session.train`) says stop, read
            after every microbatch (one process, for the same reason: several ranks read it
            between segments only).
        warm_up: before the first microbatch, train it once and forget it (`Run.warm_up`), so
            its one-off costs (kernel loads, lazy CUDA set-up) land in start-up, not in it.
    """

    save_every: int
    eval_every: int
    capacity: int
    seed: int
    log_every: int = 1
    cut_every: int = 0
    pad_to_multiple: int = 1
    writes: bool = True
    single_shard: bool = True
    cut_on_failure: bool = True
    cut_on_pause: bool = False
    warm_up: bool = False


@dataclass
class _SharedLayout:
    """One layout's (rank, targets) save packing, shared by the jobs that have it."""

    packing: RowPacking  # its columns on the device (int32)
    host_columns: torch.Tensor  # the same columns on the host: `DeferredRows` gathers there
    jobs: int = 0  # jobs holding it; it is dropped with the last


@dataclass
class Timing:
    """Where a run's wall time went (seconds), for its last line and ``metrics.jsonl``.

    Training tokens/s counts the tokens packed between the first and the last confirmed
    optimizer step, so start-up and the first step (Triton compilation and autotuning on a
    cold cache) are left out.
    """

    start: float = field(default_factory=time.perf_counter)
    first_microbatch: float | None = None  # first microbatch packed
    first_step: float | None = None  # first optimizer step confirmed
    last_step: float | None = None
    tokens: int = 0  # tokens packed so far
    microbatches: int = 0  # microbatches packed so far
    tokens_at_first: int = 0
    tokens_at_last: int = 0
    eval_s: float = 0.0
    # start-up phase -> seconds, in order (`mark`); the last one runs to the first microbatch
    startup: dict[str, float] = field(default_factory=dict)
    _marked: float | None = None

    def mark(self, phase: str) -> None:
        """Start-up ``phase`` ended now (it began at the previous mark, or at ``start``)."""
        now = time.perf_counter()
        self.startup[phase] = now - (self.start if self._marked is None else self._marked)
        self._marked = now

    def step(self) -> None:
        """An optimizer step was confirmed now."""
        now = time.perf_counter()
        if self.first_step is None:
            self.first_step, self.tokens_at_first = now, self.tokens
        self.last_step, self.tokens_at_last = now, self.tokens

    def record(self) -> dict[str, float]:
        """The breakdown: start-up, first step, training time and tokens/s, evaluation."""
        now = time.perf_counter()
        first = self.first_microbatch or now
        out = {
            "microbatches": self.microbatches,
            "tokens_per_s": self.tokens / max(now - first, 1e-9),  # the whole loop's
            "startup_s": first - self.start,
            "wall_s": now - self.start,
            "eval_s": self.eval_s,
        }
        if self.startup:
            phases = dict(self.startup)
            last = "the first batch" if PLANNING in phases else "planning and the first batch"
            phases[last] = first - (self._marked or self.start)
            out["startup_phases_s"] = phases
        if self.first_step is not None:
            out["first_step_s"] = self.first_step - first
            out["train_s"] = self.last_step - self.first_step
            out["end_s"] = now - self.last_step  # after the last step: saves and exports
            steady = self.tokens_at_last - self.tokens_at_first
            if out["train_s"] > 0 and steady > 0:
                out["train_tokens_per_s"] = steady / out["train_s"]
        return out


class Session:
    """The training loop of a set of jobs on one `Run` (this rank's engine).

    Args:
        run: this rank's model, adapter tables, optimizer and runner.
        stream: plans the jobs' samples.
        settings: the job file's loop settings.
        saver: writes checkpoints and exports.
        staging: host buffers of saves.
        eval_losses: ``pack_eval -> LossSums`` of the run's model (a collective on a run of
            several ranks); ``pack_eval`` packs eval microbatches of slots (the session's).
        shared: `resume.shared_identity` of the run (recorded with every checkpoint).
        metrics: ``job -> its metrics writer``.
        bar: the progress bar.
        agree_flags: ``(A,) int32 flags -> or-ed over every rank`` in place (the identity in
            one process): failures become everyone's at a segment end.
        on_retire: called with each job once it is finished (a server frees its folder).
        on_segment: called with this rank's timed operations (`pipeline.ComputeEvent`) after
            each segment (a pipelined run's measured bubble); None: nothing is timed.
        row_wanted: whether a freed row would be taken at once (a server's queue waits):
            then the segment ends after the microbatch that ends a job's last global batch,
            so the job retires and its row is free at that point. Read at the same point of
            the stream on every rank, so it must give the same answer on every rank.
    """

    def __init__(
        self,
        run: Run,
        stream: JobStream,
        settings: SessionSettings,
        *,
        saver: Saver,
        staging: StagingPool,
        eval_losses: Callable[[Callable], LossSums],
        shared: dict,
        metrics: Callable[[AdapterJob], MetricsWriter],
        bar: ProgressBar,
        agree_flags: Callable[[torch.Tensor], None] = lambda flags: None,
        on_retire: Callable[[AdapterJob], None] = lambda job: None,
        on_segment: Callable[[list], None] | None = None,
        row_wanted: Callable[[], bool] = lambda: False,
    ):
        self.run, self.stream, self.settings = run, stream, settings
        self.saver, self.staging, self.shared = saver, staging, shared
        self.loss_sums = eval_losses(self._pack_eval)
        self.metrics, self.bar, self.agree_flags = metrics, bar, agree_flags
        self.on_retire, self.on_segment, self.row_wanted = on_retire, on_segment, row_wanted
        self.jobs: dict[int, AdapterJob] = {}  # slot -> running job
        self.known: dict[str, AdapterJob] = {}  # every job admitted, by name
        self.shared_of: dict[str, dict] = {}  # name -> the shared identity its saves record
        self.free = list(range(run.lora.num_adapters))
        self.timing = Timing()
        self._evals: list[tuple[AdapterJob, int]] = []  # (job, step) due at the segment end
        self._held: dict[str, SaveRequest] = {}  # saves waiting for their evaluation
        self._yielded_steps: dict[str, int] = {}  # steps whose batches the stream finished
        self._side = torch.cuda.Stream(run.device) if run.device.type == "cuda" else None
        # Finished jobs' rows go out on a stream of their own: a writer's whole-row copy
        # never delays a staged copy that a job's next step waits for.
        self._final_side = torch.cuda.Stream(run.device) if self._side is not None else None
        self._packings: dict[str, tuple] = {}  # name -> its layout's key
        self._layouts: dict[tuple, _SharedLayout] = {}  # by layout key
        self._sharding: dict | None = None
        self._failed_since_cut = False
        self._items: Iterator | None = None  # the stream's microbatches, across `train` calls
        self._until: Callable[[], bool] = lambda: False  # `train`'s
        self._warmed = not settings.warm_up
        self._unsaved: dict[int, DeferredRows] = {}  # row -> a finished job's rows to copy

    # -- admission and retirement ----------------------------------------------------------
    def admit(self, job: AdapterJob, slot: int | None = None, shared: dict | None = None) -> int:
        """Start training ``job`` in a free row of the tables (``slot``, or the first free).

        The row must already hold the job's factors (built for it, bound, or loaded).
        ``shared`` is the job's own `resume.shared_identity` where it differs from the
        session's (a served job of its own length); its checkpoints record it. A job with
        no step left (resumed from its last step's checkpoint, or from the one where it
        stopped early or was cancelled: a kill came before its export) is exported and
        retired at once, its status kept.
        """
        slot = self.free[0] if slot is None else slot
        self.free.remove(slot)
        ended = job.finished  # resumed where it stopped early or was cancelled
        job.slot = slot
        if not ended:
            job.status = "running"
        self.run.runs[slot] = job.run
        self.run.global_batch_sizes[slot] = job.global_batch_size  # its loss denominators
        if self.run.graphs is not None:  # captured with the row's previous adapter
            self.run.graphs.clear()
        self.jobs[slot] = job
        self.known[job.name] = job
        self.shared_of[job.name] = self.shared if shared is None else shared
        self.stream.jobs[slot] = job
        self._yielded_steps[job.name] = job.step
        if self.settings.writes:  # its staging memory, pinned now if it saves before its end
            evaluated = bool(job.held) and 0 < self.settings.eval_every < job.total_steps
            pin_now = bool(self.settings.save_every) or evaluated
            self.staging.add_job(self._save_numel(job, slot), pin_now=pin_now)
        if ended or job.step >= job.total_steps:  # resumed, killed before its export
            job.status = job.status if ended else "done"
            if self.settings.writes:
                self._commit(job, self._stage(job, slot, job.step, checkpoint=False, final=True))
            self._retire(job)
        return slot

    def cancel(self, job: AdapterJob) -> None:
        """Stop a running job between segments: checkpoint and export what it learned so far.

        A global batch it was in the middle of is dropped (its gradients never step).
        """
        job.status, job.reason = "cancelled", f"cancelled at step {job.step}"
        if self.settings.writes:
            self._commit(job, self._stage(job, job.slot, job.step, checkpoint=True, final=True))
        self._retire(job)

    def settle_row(self, slot: int) -> None:
        """Before row ``slot`` goes to another job: its last job's rows copied out.

        A final save the writer has not reached yet is copied here (`DeferredRows.settle`);
        the staged copies of its earlier saves are waited for on the GPU.
        """
        rows = self._unsaved.pop(slot, None)
        if rows is not None:
            rows.settle()
        self.run.optimizer.wait_fence(slot)

    def _retire(self, job: AdapterJob) -> None:
        slot = job.slot
        self.jobs.pop(slot, None)
        self.stream.jobs.pop(slot, None)
        self.run.optimizer.stopped.add(slot)  # its row steps no more, whatever flows
        self.free.append(slot)
        self.free.sort()
        held = self._held.pop(job.name, None)
        if held is not None and job.status == "failed":
            held.rows.release()
        if self.settings.writes:
            self.staging.remove_job(self._save_numel(job, slot))
        self._forget_packing(job)
        job.slot = None
        self.on_retire(job)

    # -- the loop --------------------------------------------------------------------------
    def train(self, until: Callable[[], bool] = lambda: False) -> None:
        """Train until every admitted job is finished, or ``until()`` says stop (a server).

        Raises:
            WriteError: when the disk refuses a save (earlier checkpoints stay usable).
        """
        self._until = until
        while self.jobs and not until():
            if self._items is None:  # kept across calls: a paused chunk goes on where it was
                self._items = iter(self.stream)
            segment = self._segment(self._items)
            if segment is None:
                self._items = None
                break
            events = self.run.train(
                segment,
                self._make_batch,
                on_step=self._on_step,
                on_refused=self._on_refused,
                log_every=self.settings.log_every,
                record_events=self.on_segment is not None,
            )
            if self.on_segment is not None:
                self.on_segment(events)
            self._after_segment()

    def _segment(self, items: Iterator) -> Iterator[Microbatch] | None:
        first = next(items, _END)
        while first is CUT:
            first = next(items, _END)
        if first is _END:
            return None
        if not self._warmed:
            self._warm_up(first)
        return self._until_cut(first, items)

    def _warm_up(self, first: Microbatch) -> None:
        """Train ``first`` once and forget it (`Run.warm_up`), timed as a start-up phase."""
        self._warmed = True
        self.timing.mark(PLANNING)
        start = time.perf_counter()
        if self.run.warm_up(first, lambda share, index: self._pack(share)):
            if self.run.device.type == "cuda":
                torch.cuda.synchronize(self.run.device)
            self.timing.mark("warming up (the first microbatch trained once, then dropped)")
            logger.info(
                "warm-up: the first microbatch trained once and dropped in %.2f s (its "
                "one-off costs: kernel loads, CUDA set-up)",
                time.perf_counter() - start,
            )

    def _until_cut(self, first: Microbatch, items: Iterator) -> Iterator[Microbatch]:
        """Microbatches up to the next cut.

        A plan switch, an evaluation, a job's last batch while a row is wanted, ``cut_every``,
        a pause (`SessionSettings.cut_on_pause`).
        """
        microbatch, count = first, 0
        while True:
            yield microbatch
            count += 1
            if self._cut_after(microbatch):
                return
            if self.settings.cut_every and count >= self.settings.cut_every:
                return
            if self._failed_since_cut and self.settings.cut_on_failure:
                return  # its samples leave the plan at once
            if self.settings.cut_on_pause and self._until():
                return
            microbatch = next(items, _END)
            if microbatch is _END or microbatch is CUT:
                return

    def _cut_after(self, microbatch: Microbatch) -> bool:
        """Whether the segment ends after ``microbatch``.

        It does when a job whose batch it finishes is evaluated then, or ends there while its
        row is wanted; decided from the plan, so every rank ends it at the same microbatch.
        """
        cut = False
        for slot in microbatch.finishes:
            job = self.jobs[slot]
            self._yielded_steps[job.name] += 1
            step = self._yielded_steps[job.name]
            cut |= job.eval_due(step, self.settings.eval_every)
            cut |= step == job.total_steps and self.row_wanted()
        return cut

    def _make_batch(self, microbatch: Microbatch, index: int):
        if self.timing.first_microbatch is None:
            self.timing.first_microbatch = time.perf_counter()
        self.timing.tokens += microbatch.tokens
        self.timing.microbatches += 1
        return self._pack(microbatch)

    def _pack(self, microbatch: Microbatch):
        """`pack_microbatch` of a training microbatch (this replica's share)."""
        slots = range(self.run.lora.num_adapters)
        pad = self.settings.pad_to_multiple
        if (graphs := self.run.graphs) is not None and graphs.active:
            pad = math.lcm(pad, graphs.pad_tokens)  # shapes that repeat
        return pack_microbatch(
            microbatch,
            [self.jobs[a].rows if a in self.jobs else [] for a in slots],
            [self.jobs[a].order if a in self.jobs else [] for a in slots],
            self.run.lora.num_adapters,
            self.run.device,
            dropout_seed=self.settings.seed,
            pad_to_multiple=pad,
            sample_key=lambda a, position: self.jobs[a].sample_key(position),
        )

    # -- a step ------------------------------------------------------------------------------
    def _on_step(self, slot: int, run) -> None:
        """Adapter ``slot`` stepped (its loss confirmed): log it, stage its save if one is due."""
        self.saver.writer.check()  # a full disk ends the run now, not at its end
        self._saver_failures()
        job = self.jobs[slot]
        if job.status == "failed":  # its weights could not be saved: it steps no more
            return
        step, tokens = job.step, run.batch_tokens[job.step - 1]
        self.timing.step()
        self.bar.step(tokens, {job.name: run.losses[-1]})
        optimizer = self.run.optimizer
        metrics = self.metrics(job)
        metrics.log_step(
            job.name,
            step,
            loss=run.losses[-1],
            lr=optimizer.last_lr[slot],
            grad_norm=optimizer.grad_norm(slot) if metrics.enabled else None,
            tokens=tokens,
        )
        final = step == job.total_steps
        evaluated = job.eval_due(step, self.settings.eval_every)
        saved = self.settings.save_every > 0 and step % self.settings.save_every == 0
        if evaluated:
            self._evals.append((job, step))
        if final and not evaluated:
            job.status = "done"
        if not (self.settings.writes and (final or evaluated or saved)):
            return
        # One shard exports its last step straight from the staged rows: no checkpoint then.
        last_export = final and self.settings.single_shard
        request = self._stage(job, slot, step, checkpoint=saved and not last_export, final=final)
        if evaluated:
            request.rows.hold(True)  # never waited for: only this thread releases it
            self._held[job.name] = request  # committed once its evaluation is in
        else:
            self._commit(job, request)

    def _stage(
        self, job: AdapterJob, slot: int, step: int, *, checkpoint: bool, final: bool = False
    ) -> SaveRequest:
        """``slot``'s rows on their way out to the writer.

        Copied now, on the side stream (the job's next step waits for the copy); or, for a
        job that will not train again (``final``), left in the tables for the writer to copy
        (`DeferredRows`; an export without a checkpoint takes the weights alone).
        """
        run = self.run
        tables = (run.lora.weights, run.optimizer.exp_avg, run.optimizer.exp_avg_sq)
        packing = self._packing(job, slot)
        if final:
            keep = tables if checkpoint or not self.settings.single_shard else tables[:1]
            ready = None
            if self._side is not None:
                ready = torch.cuda.Event()
                ready.record()
            columns = self._layouts[self._packings[job.name]].host_columns
            rows = DeferredRows(keep, slot, columns, ready, self._final_side)
            self._unsaved[slot] = rows
        else:
            rows = self.staging.copy_rows(tables, slot, packing.columns, self._side)
            run.optimizer.fence(slot, rows.done)
        if self._sharding is None:
            self._sharding = run.lora.sharding()
        return SaveRequest(
            job.name, job.config, step, rows, packing, self._sharding, {}, checkpoint=checkpoint
        )

    def _packing(self, job: AdapterJob, slot: int) -> RowPacking:
        """The job's `RowPacking`, its columns on the device (int32), shared by its layout.

        Jobs of one layout (rank, targets) share one copy of the columns, 4 bytes per value a
        save keeps (143 MB at Llama-3.1-8B, r 16, default targets), and the host's (8 bytes
        per value, for `DeferredRows`), freed when the last of them retires.
        """
        if job.name not in self._packings:
            slots = self.run.lora.adapter_slots(slot)
            masks = b"".join(s.live.numpy().tobytes() for s in slots if s.live is not None)
            shape = tuple((s.name, s.start, s.rows, s.cols, s.kind, s.rank) for s in slots)
            key = (shape, hashlib.sha1(masks).hexdigest())
            if key not in self._layouts:
                packing = row_packing(slots, self.run.lora.weights.shape[1])
                columns = packing.columns.to(self.run.device, torch.int32)
                self._layouts[key] = _SharedLayout(
                    dataclasses.replace(packing, columns=columns), packing.columns
                )
            self._layouts[key].jobs += 1
            self._packings[job.name] = key
        return self._layouts[self._packings[job.name]].packing

    def _save_numel(self, job: AdapterJob, slot: int) -> int:
        """Values of one save of ``job`` (its packed weights and moments)."""
        return len(TABLES) * self._packing(job, slot).width

    def _forget_packing(self, job: AdapterJob) -> None:
        key = self._packings.pop(job.name, None)
        if key is not None:
            self._layouts[key].jobs -= 1
            if not self._layouts[key].jobs:
                del self._layouts[key]  # saves still queued keep their own reference

    def _commit(self, job: AdapterJob, request: SaveRequest) -> None:
        """Hand ``request`` to the writer with the job's state now (its evaluation included)."""
        request.rows.hold(False)
        request.state = {
            "job": job.state(),
            "identity": job.identity(),
            "shared": self.shared_of[job.name],
        }
        request.keep = () if job.best is None else (job.best[0],)
        if job.finished and job.status != "failed":
            request.export_step = job.export_step() or request.step
            if not self.settings.single_shard and request.export_step == request.step:
                request.checkpoint = True  # the exporter assembles the shards from disk
        if request.checkpoint or request.export_step is not None:
            self.saver.submit(request)
            if request.checkpoint:
                job.saved_step = request.step
        else:
            request.rows.release()

    def _on_refused(self, slot: int, message: str) -> None:
        job = self.jobs[slot]
        job.status, job.reason = "failed", message
        self._failed_since_cut = True
        logger.error("%s", message)

    # -- between segments -------------------------------------------------------------------
    def _after_segment(self) -> None:
        """Check saves, agree on failures, evaluate what is due, commit, retire."""
        self.saver.writer.check()
        self._saver_failures()
        self._unsaved = {s: r for s, r in self._unsaved.items() if r.pending}
        self._failed_since_cut = False
        self._agree_failures()
        self._evaluate()
        for job in [j for j in self.jobs.values() if j.finished]:
            held = self._held.pop(job.name, None)
            if held is not None:
                held.rows.release()
            self._retire(job)

    def _agree_failures(self) -> None:
        """Every rank fails the jobs any rank failed (a refused step is seen where it is)."""
        flags = torch.zeros(self.run.lora.num_adapters, dtype=torch.int32)
        for slot, job in self.jobs.items():
            flags[slot] = int(job.status == "failed")
        flags = flags.to(self.run.device)
        self.agree_flags(flags)
        for slot in flags.nonzero().flatten().tolist():
            job = self.jobs[slot]
            if job.status != "failed":
                job.status = "failed"
                job.reason = job.reason or f"adapter {job.name!r} failed on another rank"
            self.run.optimizer.stopped.add(slot)

    def _evaluate(self) -> None:
        """Evaluate the due jobs together, then commit their held saves."""
        due = [(job, step) for job, step in self._evals if job.status != "failed"]
        self._evals = []
        if due:
            start = time.perf_counter()
            losses = self._eval_losses([job.slot for job, _ in due])
            self.timing.eval_s += time.perf_counter() - start
            for job, step in due:
                loss = losses[job.slot]
                logger.info("adapter %s step %d | eval loss %.4f", job.name, step, loss)
                self.metrics(job).log_eval(job.name, step, loss)
                improved = job.record_eval(step, loss)
                held = self._held.pop(job.name, None)
                if step == job.total_steps and job.status == "running":
                    job.status = "done"
                if job.status == "stopped":
                    logger.info("adapter %s: %s", job.name, job.reason)
                if held is not None:
                    best = improved and job.config.early_stopping_patience > 0
                    held.checkpoint = held.checkpoint or (best and not job.finished)
                    self._commit(job, held)

    @torch.no_grad()
    def _eval_losses(self, slots: Sequence[int]) -> dict[int, float]:
        model = self.run.model
        was_training = model.training
        model.eval()
        try:
            held = {slot: job.held for slot, job in self.jobs.items()}
            sums, counts = self.loss_sums(eval_microbatches(held, slots, self.settings.capacity))
        finally:
            model.train(was_training)
        return {a: float(sums[a] / max(counts[a].item(), 1.0)) for a in slots}

    def _saver_failures(self) -> None:
        """Fail the jobs whose weights could not be saved or exported (NaN or infinite)."""
        for name, message in self.saver.take_failures():
            job = self.known[name]
            job.status, job.reason = "failed", message
            self._failed_since_cut = True
            if job.slot is not None:
                self.run.optimizer.stopped.add(job.slot)

    def finish(self) -> None:
        """Wait for every save and export (the run's tail), then check them.

        Raises:
            WriteError: when the disk refused a save or export.
        """
        self.saver.writer.drain()
        self._saver_failures()

    def _pack_eval(self, microbatch: Microbatch):
        """Pack eval microbatch (slot, eval row) samples: no dropout in evaluation."""
        slots = range(self.run.lora.num_adapters)
        held = [self.jobs[a].held if a in self.jobs else [] for a in slots]
        return pack_microbatch(
            microbatch,
            held,
            [list(range(len(rows))) for rows in held],
            self.run.lora.num_adapters,
            self.run.device,
            dropout_seed=0,
            pad_to_multiple=self.settings.pad_to_multiple,
        )
