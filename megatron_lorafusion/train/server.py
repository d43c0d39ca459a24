"""`lorafusion serve`: one long-running trainer that LoRA jobs join and leave.

The base model is loaded once, with ``server.max_adapters`` rows of adapter tables allocated
at ``server.max_rank`` on every adapted linear (the memory model: those rows, the frozen
base and one microbatch of activations are all the server ever holds, so a job that finds a
free row always fits). Jobs arrive through the root's inbox (`inbox.ServerRoot`); between
segments rank 0 reads it and every rank admits the same jobs at the same point: a job takes
a free row (`LoRAContext.bind`: fresh factors drawn from its name), its data is read, it
resumes from its own checkpoints if it has any, and the planner takes its samples into its
next chunk. A job that ends (its steps or epochs, early stopping, a cancel, a failure) is
checkpointed and exported at once and frees its row for the queue. The same `Session`
trains `lorafusion train`'s jobs, so a served adapter and the same adapter trained by
``train`` (same seed, config and data) are the same weights.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time

import torch

from megatron_lorafusion.config import (
    FUSED_LINEARS,
    SHORTEST_FIRST_MICROBATCHES,
    AdapterConfig,
    ConfigError,
    JobConfig,
    job_from_dict,
)
from megatron_lorafusion.data import DataError, load_tokenizer
from megatron_lorafusion.inbox import FINISHED, ServerRoot
from megatron_lorafusion.ops.kernel_warmup import start_kernel_warmup
from megatron_lorafusion.train.checkpoint import AdapterCheckpoints, CheckpointError, Shard
from megatron_lorafusion.train.job import AdapterJob
from megatron_lorafusion.train.main import (
    _COMM_TIMEOUT_S,
    _DTYPES,
    _check_same_job,
    _collectives,
    _device,
    _eval_losses,
    _sequence_shards,
    _writes_metrics,
    make_jobs,
    plans_in_process,
    start_planner,
)
from megatron_lorafusion.train.metrics import MetricsWriter, ProgressBar
from megatron_lorafusion.train.recipe import Run, build_run
from megatron_lorafusion.train.resume import check_restorable, restore_job, shared_identity
from megatron_lorafusion.train.saving import Saver
from megatron_lorafusion.train.session import Session, SessionSettings
from megatron_lorafusion.train.stream import JobStream
from megatron_lorafusion.train.writer import WRITER_THREADS, BackgroundWriter, staging_pool

__all__ = ["serve"]

logger = logging.getLogger(__name__)

_CUT_EVERY = 16  # microbatches between inbox checks (a cut costs nothing at PP = 1)
_ROUNDS_PER_CHUNK = 1  # a job admitted mid-chunk joins the plan at the chunk's end
_WAITING = "waiting: jobs with fewer tokens left train first (policy: shortest)"


def _placeholders(cfg: JobConfig) -> list[AdapterConfig]:
    """The rows' shape at start-up: every fused linear at ``max_rank`` (jobs bind into them)."""
    s = cfg.server
    return [
        AdapterConfig(name=f"_row{i}", rank=s.max_rank, target_modules=list(FUSED_LINEARS))
        for i in range(s.max_adapters)
    ]


def _memory_model(run: Run, cfg: JobConfig) -> dict:
    """Bytes of the adapter rows: fp32 weights, gradients, both moments, plus the compute copy."""
    width = run.lora.weights.shape[1]
    itemsize = torch.empty(0, dtype=_DTYPES[cfg.train.precision]).element_size()
    per_row = width * (4 * 4 + itemsize)
    rows = cfg.server.max_adapters
    return {
        "row_bytes": per_row,
        "rows": rows,
        "adapter_bytes": per_row * rows,
        "capacity": (
            f"{rows} jobs at once, rank <= {cfg.server.max_rank}; adapter state "
            f"{per_row * rows / 2**30:.2f} GiB ({per_row / 2**20:.0f} MiB per job)"
        ),
    }


class _Server:
    """The serve loop's state on one rank: the queue, the running jobs, the root's files."""

    def __init__(self, cfg: JobConfig, run: Run, session: Session, sizes: dict, root: ServerRoot):
        self.cfg, self.run, self.session, self.sizes, self.root = cfg, run, session, sizes, root
        self.rank0 = sizes["rank"] == 0
        self.agree_min = _collectives(sizes, run.device)[0]
        self.tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
        self.queue: list[tuple[str, dict]] = []  # (name, job.json) in arrival order
        self.started: dict[str, tuple[float, int]] = {}  # name -> (time, step) at admission
        self.admitted_at: dict[str, float] = {}  # name -> wall-clock time (time.time())
        self.busy_s = 0.0  # time spent training (inside `Session.train`)
        self.metrics: dict[str, MetricsWriter] = {}
        self.finished: dict[str, str] = {}
        self.poll_due = False  # the last `pause` found news in the inbox
        self.next_poll = 0.0  # rank 0 reads the inbox again from then on
        self._warned_at = -60.0  # the last warning of a status file the disk refused

    # -- the root's files (rank 0 reads; every rank acts on what it broadcasts) -------------
    def restore(self) -> None:
        """After a restart: jobs that ran are queued first (they resume), queued ones stay.

        A job whose status says it ended but whose export never completed (no ``done.json``:
        the kill came while the writer had it queued) resumes too, to its export.

        Rank 0 reads the root and broadcasts what it found (another rank reading it could
        see a job that rank 0's first poll is moving in, and queue it twice).
        """
        found = None
        if self.rank0:
            running, queued, finished = [], [], {}
            for name, job, status in self.root.known_jobs():
                ended = status["status"] in FINISHED and status["status"] != "failed"
                exported = (self.root.job_dir(name) / "checkpoints" / "done.json").is_file()
                if status["status"] == "running" or (ended and not exported):
                    running.append((name, job))  # a kill came before its export: resumed
                elif status["status"] == "queued":
                    queued.append((name, job))
                else:
                    finished[name] = status["status"]
            found = (running + queued, finished)
        self.queue, self.finished = self.broadcast(found)

    def broadcast(self, value):
        """Rank 0's ``value`` (any picklable object) on every rank."""
        if self.sizes["world"] == 1:
            return value
        import torch.distributed as dist

        payload = [value]
        dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def poll(self) -> tuple[list[tuple[str, dict]], list[str]]:
        """New jobs and cancel requests, the same on every rank."""
        news = (self.root.take_submissions(), self.root.take_cancels()) if self.rank0 else None
        return self.broadcast(news)

    # -- admission ---------------------------------------------------------------------------
    def knows(self, name: str) -> bool:
        """Whether job ``name`` is queued, running or finished on this server already."""
        return (
            name in self.finished
            or name in self.session.known
            or any(queued == name for queued, _ in self.queue)
        )

    def admissible(self) -> int:
        """How many queued jobs may start now (the policy, given the free rows)."""
        free, running = len(self.session.free), len(self.session.jobs)
        policy = self.cfg.server.policy
        if policy in ("online", "shortest"):
            return free
        if policy == "fifo":
            return 1 if not running else 0
        return free if not running else 0  # batch: only an empty server takes the queue

    def admit(self, name: str, job: dict) -> None:
        """Start one job in a free row; a job the server cannot take fails with the reason.

        Every rank builds the job (its data read, its memory checked) and they agree on the
        outcome before any collective of its resume: a job one rank cannot take fails on
        every rank.
        """
        slot = self.session.free[0]
        self.session.settle_row(slot)  # its last job's final rows copied out first
        try:
            adapter = job_from_dict({"adapters": [job["adapter"]]}).adapters[0]
            train = self.cfg.train
            if job["steps"] or job["epochs"]:  # its own length, else the server's
                train = dataclasses.replace(train, steps=job["steps"], epochs=job["epochs"])
            cfg = dataclasses.replace(self.cfg, train=train, adapters=[adapter])
            self.run.lora.bind(slot, adapter, cfg.train.seed)
            aj = make_jobs(cfg, [adapter], self.tokenizer)[0]
            self.run.optimizer.bind(slot, adapter, aj.total_steps)
            self.run.runs[slot] = aj.run
            store = self.store(name)
            shared = shared_identity(cfg)
            check_restorable(aj, store, shared)  # what resuming it would refuse, on this shard
        except (
            DataError,
            ConfigError,
            CheckpointError,
            NotImplementedError,
            ValueError,
            OSError,
        ) as err:
            self.agree_min(0)
            self._fail(name, f"not admitted: {err}", slot)
            return
        if self.agree_min(1) == 0:
            self._fail(name, "not admitted: another rank could not take it (see its log)", slot)
            return

        def load(entry: dict) -> None:
            self.run.load_table(slot, entry["table"], entry["tensors"])

        outcome = restore_job(aj, store, load, shared, agree_min=self.agree_min)
        if self.sizes["dp_rank"] == 0:  # one writer per shard: its half-written saves
            try:
                store.clean_leftovers()
            except OSError as err:  # harmless leftovers: never a reason to split the ranks
                logger.warning("job %s: half-written checkpoint files left: %s", name, err)
        self.run.optimizer.steps[slot] = aj.step
        if outcome == "done":
            self.finished[name] = aj.status
            return
        self.session.admit(aj, slot, shared)
        if aj.finished:  # nothing was left to train: exported and retired at once
            return
        self.started[name] = (time.perf_counter(), aj.step)
        self.admitted_at[name] = time.time()
        self.metrics[name] = MetricsWriter(
            self.root.job_dir(name),
            enabled=_writes_metrics(self.sizes, self.run),
            device=self.run.device,
        )
        logger.info(
            "job %s: admitted into row %d (%s, %d steps)", name, slot, outcome, aj.total_steps
        )

    def _fail(self, name: str, reason: str, slot: int | None = None) -> None:
        logger.error("job %s: %s", name, reason)
        if slot is not None:  # a row it was bound to steps no more (it stays free)
            self.run.optimizer.stopped.add(slot)
        self.finished[name] = "failed"
        self._write_status(name, {"status": "failed", "reason": reason})

    def store(self, name: str) -> AdapterCheckpoints:
        """The job's checkpoints on this rank's shard."""
        s = self.sizes
        return AdapterCheckpoints(
            self.root.job_dir(name) / "checkpoints",
            name,
            Shard(s["tp_rank"], s["tp"], s["pp_rank"], s["pp"]),
            self.cfg.train.keep_last,
        )

    # -- status ------------------------------------------------------------------------------
    def _write_status(self, name: str, status: dict | None = None, info: dict | None = None):
        """Rank 0 writes a job's ``status.json`` (or ``server.json``: ``info``).

        Status files only report: one the disk refuses is a warning (at most one a minute),
        never an exception on rank 0 alone, which would leave the other ranks waiting in
        their next collective.
        """
        if not self.rank0:
            return
        try:
            if info is not None:
                self.root.write_server_info(info)
            else:
                self.root.write_status(name, status)
        except OSError as err:
            if time.perf_counter() - self._warned_at > 60.0:
                self._warned_at = time.perf_counter()
                logger.warning(
                    "server %s: could not write the status of %s (%s); training goes on, "
                    "statuses may be stale",
                    self.root.root,
                    name,
                    err,
                )

    def write_statuses(self) -> None:
        """Every running and queued job's ``status.json``, and the server's stats (rank 0)."""
        if not self.rank0:
            return
        info = self.root.server_info() or {}
        tokens = self.session.timing.tokens
        info["stats"] = {  # what the server did so far (the trace benchmark reads it)
            "tokens": tokens,
            "busy_s": self.busy_s,
            "tokens_per_busy_s": tokens / max(self.busy_s, 1e-9),
        }
        self._write_status("the server", info=info)
        training = self.session.stream.training()
        for slot, job in self.session.jobs.items():
            waiting = slot not in training and self.session.stream.tokens_left(job) > 0
            since, step0 = self.started.get(job.name, (time.perf_counter(), job.step))
            rate = (job.step - step0) / max(time.perf_counter() - since, 1e-9)
            eta = (job.total_steps - job.step) / rate if rate > 0 else None
            losses = [x for x in job.run.losses if x == x]
            self._write_status(
                job.name,
                {
                    "status": "running",
                    "step": job.step,
                    "total_steps": job.total_steps,
                    "loss": losses[-1] if losses else None,
                    "eval_loss": job.evals[-1][1] if job.evals else None,
                    "tokens": self.metrics[job.name].tokens.get(job.name, 0),
                    "eta_s": eta,
                    "slot": job.slot,
                    "started_at": self.admitted_at.get(job.name),
                    **({"reason": _WAITING} if waiting else {}),
                },
            )
        for position, (name, _) in enumerate(self.queue):
            self._write_status(
                name, {"status": "queued", "queue_position": position + 1, "step": 0}
            )

    def retired(self, job: AdapterJob) -> None:
        """A job left its row: its final status (its export is on its way)."""
        self.finished[job.name] = job.status
        writer, tokens = self.metrics.pop(job.name, None), None
        if writer is not None:
            tokens = writer.tokens.get(job.name, 0)
            writer.close()
        if self.rank0:
            losses = [x for x in job.run.losses if x == x]
            self._write_status(
                job.name,
                {
                    "status": job.status,
                    "step": job.step,
                    "total_steps": job.total_steps,
                    "loss": losses[-1] if losses else None,
                    "eval_loss": job.evals[-1][1] if job.evals else None,
                    "tokens": tokens,
                    "reason": job.reason,
                    "export": str(self.root.job_dir(job.name) / "adapter")
                    if job.status != "failed"
                    else None,
                    "started_at": self.admitted_at.get(job.name),
                    "finished_at": time.time(),
                },
            )
        reason = f" ({job.reason})" if job.reason else ""
        logger.info("job %s: %s after %d steps%s", job.name, job.status, job.step, reason)

    # -- the loop ----------------------------------------------------------------------------
    def row_wanted(self) -> bool:
        """A queued job would start in a row freed now (the same on every rank)."""
        return bool(self.queue) and self.cfg.server.policy in ("online", "shortest")

    def rank0_says(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank: a decision read from a clock must be one decision."""
        if self.sizes["world"] == 1:
            return flag
        return self.agree_min(int(flag) if self.rank0 else 1) == 1

    def pause(self) -> bool:
        """Whether training pauses before another segment.

        It does when a queued job can start, or when rank 0's clock passed ``next_poll`` and
        a submission or a cancel request waits (remembered in ``poll_due``). An inbox read
        with nothing new does not pause: rank 0 refreshes the status files and training goes
        on.
        """
        if self.row_wanted() and self.admissible() > 0:
            return True
        news = False
        if self.rank0 and time.perf_counter() >= self.next_poll:
            try:
                news = self.root.has_news()
            except OSError as err:  # read it at the next pause: never a split of the ranks
                logger.warning("server %s: the inbox cannot be read (%s)", self.root.root, err)
            if not news:
                self.write_statuses()
                self.next_poll = time.perf_counter() + self.cfg.server.poll_s
        self.poll_due = self.rank0_says(news)
        return self.poll_due

    def loop(self) -> None:
        """Admit, train, retire, until idle for ``server.idle_timeout_s`` (0: forever).

        The inbox is read every ``server.poll_s``; a queued job starts as soon as the policy
        lets it: training pauses when a job ends while another waits (`Session.row_wanted`).
        """
        s = self.cfg.server
        idle_since = self.next_poll = time.perf_counter()
        poll = True
        while True:
            if poll:
                news, cancels = self.poll()
                self.queue += [(name, job) for name, job in news if not self.knows(name)]
                for name in cancels:
                    self.cancel(name)
            starting = min(self.admissible(), len(self.queue))
            for _ in range(starting):
                self.admit(*self.queue.pop(0))
            if poll or starting:
                self.write_statuses()
            if poll:  # counted from here: slow admissions still leave time to train
                self.next_poll = time.perf_counter() + s.poll_s
            if not self.session.jobs:
                if not self.queue:  # else the next pass admits (an admission failed)
                    idle = time.perf_counter() - idle_since
                    if s.idle_timeout_s and self.rank0_says(idle > s.idle_timeout_s):
                        logger.info("no job for %.0f s: the server exits", s.idle_timeout_s)
                        return
                    time.sleep(min(s.poll_s, 1.0))
                poll = True
                continue
            start = time.perf_counter()
            self.poll_due = False
            self.session.train(until=self.pause)
            self.busy_s += time.perf_counter() - start
            idle_since = time.perf_counter()
            poll = not self.session.jobs or self.poll_due

    def cancel(self, name: str) -> None:
        """A cancel request: a queued job leaves the queue, a running one stops and exports."""
        for i, (queued, _) in enumerate(self.queue):
            if queued == name:
                self.queue.pop(i)
                self.finished[name] = "cancelled"
                self._write_status(
                    name, {"status": "cancelled", "reason": "cancelled before it started"}
                )
                return
        for job in list(self.session.jobs.values()):
            if job.name == name:
                self.session.cancel(job)
                return
        logger.warning("cancel of job %s: it is not queued or running", name)


def serve(cfg: JobConfig) -> None:
    """Run a server on ``cfg.server.root`` until idle for ``server.idle_timeout_s``.

    Raises:
        ServerBusyError: when another server holds the root.
        ConfigError: ``train.device: cuda`` without a CUDA device.
        WriteError: when the disk refuses a save.
    """
    from megatron_lorafusion.mcore.parallel import destroy_model_parallel, init_model_parallel

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    root = ServerRoot(cfg.server.root)
    if os.environ.get("RANK", "0") == "0":
        root.lock()  # before any GPU work: a second server on this root refuses at once
    device = _device(cfg)
    init_model_parallel(
        cfg.parallel.tp, cfg.parallel.pp, device, cfg.train.seed, timeout_s=_COMM_TIMEOUT_S
    )
    try:
        _serve(cfg, root, device)
    finally:
        destroy_model_parallel()


def _serve(cfg: JobConfig, root: ServerRoot, device: torch.device) -> None:
    from megatron_lorafusion.mcore.parallel import parallel_sizes

    sizes = parallel_sizes()
    _check_same_job(cfg, sizes)
    shards = _sequence_shards(cfg, device)
    rows = cfg.server.max_adapters
    warmup = start_kernel_warmup(device)  # Triton's per-process keys, while the model builds
    run = build_run(
        cfg.model,
        _placeholders(cfg),
        [[1]] * rows,
        device=device,
        params_dtype=_DTYPES[cfg.train.precision],
        seed=cfg.train.seed,
        sequence_shards=shards,
        recompute=cfg.train.recompute,
        defer_wgrad=cfg.parallel.defer_wgrad,
        track_grad_norms=True,
        comm_timeout_s=_COMM_TIMEOUT_S,
    )
    if warmup is not None:
        warmup.join()
    memory = _memory_model(run, cfg)
    if sizes["rank"] == 0:
        root.write_server_info(
            {
                "job": dataclasses.asdict(cfg),
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": time.time(),
                **memory,
            }
        )
    logger.info("server %s: %s", root.root, memory["capacity"])
    agree_flags = _collectives(sizes, device)[1]
    writer = BackgroundWriter(WRITER_THREADS)
    holder: dict[str, _Server] = {}
    saver = Saver(
        writer,
        cfg.model,
        lambda name: holder["server"].store(name),
        lambda name: root.job_dir(name) / "adapter",
        exports=sizes["rank"] == 0,
        single_shard=sizes["tp"] * sizes["pp"] == 1,
        on_exported=lambda name, folder: logger.info("job %s: exported to %s", name, folder),
    )
    stream = JobStream(
        capacity=cfg.planner.token_capacity,
        num_stages=cfg.parallel.pp,
        tile_height=cfg.planner.tile_height,
        seed=cfg.train.seed,
        start_planner=start_planner(cfg, _ROUNDS_PER_CHUNK),
        plans_in_process=plans_in_process,
        shortest_first=(
            SHORTEST_FIRST_MICROBATCHES * cfg.planner.token_capacity
            if cfg.server.policy == "shortest"
            else None
        ),
    )

    def metrics_of(job: AdapterJob) -> MetricsWriter:
        return holder["server"].metrics[job.name]

    session = Session(
        run,
        stream,
        SessionSettings(
            save_every=cfg.train.save_every,
            eval_every=cfg.train.eval_every,
            capacity=cfg.planner.token_capacity,
            seed=cfg.train.seed,
            log_every=cfg.logging.log_every,
            cut_every=_CUT_EVERY,
            pad_to_multiple=shards,
            writes=sizes["dp_rank"] == 0,
            single_shard=sizes["tp"] * sizes["pp"] == 1,
            cut_on_failure=sizes["world"] == 1,
            cut_on_pause=sizes["world"] == 1,
        ),
        saver=saver,
        staging=staging_pool(cfg.train.save_buffer_gib, pinned=device.type == "cuda"),
        eval_losses=_eval_losses(cfg, run, sizes),
        shared=shared_identity(cfg),
        metrics=metrics_of,
        bar=ProgressBar(0, 0, enabled=False),
        agree_flags=agree_flags,
        on_retire=lambda job: holder["server"].retired(job),
        on_segment=None,
        row_wanted=lambda: holder["server"].row_wanted(),
    )
    for slot in range(rows):  # no placeholder trains: every row waits for a job
        run.optimizer.stopped.add(slot)
    run.model.train()
    server = holder["server"] = _Server(cfg, run, session, sizes, root)
    server.restore()
    try:
        server.loop()
        session.finish()
        server.write_statuses()
    finally:
        stream.close()
        writer.close()
