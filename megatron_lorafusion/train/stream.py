"""`JobStream`: the planned microbatches of the running jobs, re-planned as jobs come and go.

The planner (`planner.BackgroundPlanner`, a worker process) packs the remaining samples of
the jobs in the plan; its microbatches name plan-local adapters and sample indices, which
the stream translates into table slots and training positions. When the set of jobs
changes (a job joins, stops early, fails or is cancelled), the stream re-plans at the next
chunk boundary: it takes one more chunk of the old plan (without the samples of jobs that
left), plans what remains after that chunk in the background while that chunk trains, and
switches (DESIGN.md "Adapters as jobs"). A job may be mid-global-batch at the switch; the
new plan starts that batch with the samples it has not trained yet (`PlanProblem.
batch_offsets`). Jobs that simply run out of samples leave no trace and cost no re-plan, so
a job whose adapters never change is planned exactly once, as a whole run.

With ``shortest_first`` (a server's ``policy: shortest``) only some of the jobs train at a
time: those with the fewest tokens left, at least two (the tail of one's global batch shares
a microbatch with the other's) and enough that one global batch of each fills
``shortest_first`` tokens (`planner.shortest.choose_shortest`). The others keep their rows
and wait; a job that ends lets the next shortest in, and a job that joins with fewer tokens
left than a training one takes its place (both at the next chunk boundary, as any join); a
training job overtaken by another's faster progress keeps its turn. Shortest-remaining-first
finishes short jobs sooner than sharing the GPU evenly (lower mean job completion time), and
filling the microbatches from several jobs keeps the throughput.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from megatron_lorafusion.planner import (
    BackgroundPlanner,
    Microbatch,
    Plan,
    PlanProblem,
    PlanVerifier,
    Sample,
)
from megatron_lorafusion.planner.shortest import Candidate, choose_shortest
from megatron_lorafusion.train.job import AdapterJob

__all__ = ["CUT", "JobStream"]

logger = logging.getLogger(__name__)

CUT = None
"""Yielded by `JobStream` where a pipelined run must drain (a plan switch: the bubble lemma
is checked per plan, so the first microbatches of the new plan must not overlap the old)."""


@dataclass
class _Cursor:
    """What a job has had yielded: every batch before ``batch``, and ``partial`` of it."""

    batch: int
    partial: set[int] = field(default_factory=set)

    def copy(self) -> _Cursor:
        return _Cursor(self.batch, set(self.partial))

    def take(self, positions: list[int], finishes: bool) -> None:
        self.partial.update(positions)
        if finishes:
            self.batch, self.partial = self.batch + 1, set()

    def remaining(self, job: AdapterJob) -> list[int]:
        """Training positions not yet yielded: the rest of this batch, then every later one."""
        gbs, total = job.global_batch_size, len(job.order)
        start, stop = self.batch * gbs, min((self.batch + 1) * gbs, total)
        return [p for p in range(start, stop) if p not in self.partial] + list(range(stop, total))


@dataclass
class _Planned:
    """One plan: its worker, problem and the map back to slots and positions."""

    chunks: Iterator[Plan]
    problem: PlanProblem
    jobs: list[AdapterJob]  # plan adapter p -> job (in slot order)
    positions: list[list[int]]  # plan adapter p, local sample index -> training position
    left: list[int]  # per plan adapter, samples not yet yielded
    verifier: PlanVerifier
    planner: BackgroundPlanner | None = None
    first: bool = True


class JobStream:
    """Iterate over the microbatches of the running jobs (slots and training positions).

    Args:
        capacity: tokens per microbatch (``planner.token_capacity``).
        num_stages: pipeline stages (the bubble lemma; idle microbatches stay at ``S > 1``).
        tile_height: kernel tile height of the planner.
        seed: ``train.seed`` (the planner's tie breaks).
        start_planner: ``problem -> iterator of Plan chunks`` (a `BackgroundPlanner`).
        on_plan: called with each new plan's first chunk and its problem (summaries, and the
            ranks' agreement on it).
        plans_in_process: ``samples -> bool``: whether ``start_planner`` plans a problem of
            that many samples in this process (no worker to hide the planning behind).
        shortest_first: train only the jobs with the fewest tokens left, at least two and
            enough that one global batch of each holds this many tokens; None: every job.

    Attributes:
        jobs: slot -> job, the jobs that should train; change it between runner calls only
            (every rank then changes it at the same point of the stream).
    """

    def __init__(
        self,
        *,
        capacity: int,
        num_stages: int,
        tile_height: int,
        seed: int,
        start_planner: Callable[[PlanProblem], Iterator[Plan]],
        on_plan: Callable[[Plan, PlanProblem], None] | None = None,
        plans_in_process: Callable[[int], bool] = lambda samples: False,
        shortest_first: int | None = None,
    ):
        self.capacity, self.num_stages, self.tile_height = capacity, num_stages, tile_height
        self.seed = seed
        self.start_planner = start_planner
        self.on_plan = on_plan
        self.plans_in_process = plans_in_process
        self.shortest_first = shortest_first
        self.jobs: dict[int, AdapterJob] = {}
        self._suffix_tokens: dict[str, list[int]] = {}  # job -> tokens from position p on
        self.replans = 0  # plans made (the first included)
        self._cursors: dict[str, _Cursor] = {}
        self._plan: _Planned | None = None
        self._next: _Planned | None = None  # planned while the old plan's last chunk runs
        self._switching = False

    def close(self) -> None:
        """Stop the planner workers."""
        for planned in (self._plan, self._next):
            if planned is not None and planned.planner is not None:
                planned.planner.close()
        self._plan = self._next = None

    # -- planning ---------------------------------------------------------------------------
    def _cursor(self, job: AdapterJob) -> _Cursor:
        if job.name not in self._cursors:
            self._cursors[job.name] = _Cursor(job.step)
        return self._cursors[job.name]

    def tokens_left(self, job: AdapterJob, cursor: _Cursor | None = None) -> int:
        """Tokens of ``job`` not yet yielded (past ``cursor``; default: the stream's)."""
        suffix = self._suffix_tokens.get(job.name)
        if suffix is None:
            tokens = [job.sample_tokens(p) for p in range(len(job.order))]
            suffix = list(itertools.accumulate(reversed(tokens), initial=0))[::-1]
            self._suffix_tokens[job.name] = suffix
        cursor = cursor or self._cursor(job)
        start = min(cursor.batch * job.global_batch_size, len(job.order))
        return suffix[start] - sum(job.sample_tokens(p) for p in cursor.partial)

    def training(self, cursors: Mapping[str, _Cursor] | None = None) -> dict[int, AdapterJob]:
        """Slot -> job of the jobs that train now (all of them, or see ``shortest_first``).

        ``cursors``: where the jobs stand (default: what the stream has yielded; a plan made
        ahead of a chunk passes the cursors after it).
        """
        if self.shortest_first is None:
            return self.jobs
        for name in set(self._suffix_tokens) - {job.name for job in self.jobs.values()}:
            del self._suffix_tokens[name]  # a job gone
        planned = set() if self._plan is None else {id(job) for job in self._plan.jobs}
        candidates = []
        for slot, job in self.jobs.items():
            left = self.tokens_left(job, (cursors or {}).get(job.name))
            batch = self._suffix_tokens[job.name][0] * job.global_batch_size / len(job.order)
            candidates.append(Candidate(slot, left, batch, id(job) in planned))
        return {slot: self.jobs[slot] for slot in choose_shortest(candidates, self.shortest_first)}

    def _problem(
        self, cursors: Mapping[str, _Cursor]
    ) -> tuple[PlanProblem, list[AdapterJob], list[list[int]]] | None:
        """The remaining samples of the jobs that should train, from ``cursors``."""
        jobs, positions, offsets = [], [], []
        training = self.training(cursors)
        for slot in sorted(training):
            job = training[slot]
            cursor = cursors.get(job.name) or _Cursor(job.step)
            left = cursor.remaining(job)
            if left:
                jobs.append(job)
                positions.append(left)
                offsets.append(len(cursor.partial))
        if not jobs:
            return None
        lengths = [
            [job.sample_tokens(p) for p in pos] for job, pos in zip(jobs, positions, strict=True)
        ]
        problem = PlanProblem(
            lengths,
            [job.global_batch_size for job in jobs],
            self.capacity,
            num_stages=self.num_stages,
            tile_height=self.tile_height,
            seed=self.seed,
            batch_offsets=offsets,
        )
        return problem, jobs, positions

    def _start(self, cursors: Mapping[str, _Cursor]) -> _Planned | None:
        found = self._problem(cursors)
        if found is None:
            return None
        problem, jobs, positions = found
        self.replans += 1
        chunks = self.start_planner(problem)
        planner = chunks if isinstance(chunks, BackgroundPlanner) else None
        return _Planned(
            iter(chunks),
            problem,
            jobs,
            positions,
            [len(p) for p in positions],
            PlanVerifier(problem, lemma=False),
            planner,
        )

    def _stale(self) -> bool:
        """The plan lacks a job that should train, or holds samples of one that should not."""
        planned = self._plan
        training = self.training()
        if planned is None:
            return bool(training)
        wanted = {id(job) for job in training.values()}
        in_plan = {id(job) for job in planned.jobs}
        leaving = any(
            id(job) not in wanted and left
            for job, left in zip(planned.jobs, planned.left, strict=True)
        )
        joining = any(
            id(job) not in in_plan and self._cursor(job).remaining(job) for job in training.values()
        )
        return leaving or joining

    def _chunk(self, planned: _Planned) -> list[Microbatch] | None:
        """The plan's next chunk, as the planner made it (plan-local ids), or None at its end."""
        chunk = next(planned.chunks, None)
        if chunk is None:
            planned.verifier.finish()
            return None
        if planned.first and self.on_plan is not None:
            self.on_plan(chunk, planned.problem)
        planned.first = False
        planned.verifier.feed(chunk.microbatches)
        return list(chunk.microbatches)

    def _translate(self, planned: _Planned, microbatch: Microbatch) -> Microbatch | None:
        """A plan microbatch in table slots and training positions.

        Without the samples of jobs that left; None for one left empty where idle
        microbatches do not count.
        """
        slot_of = {id(job): slot for slot, job in self.jobs.items()}
        slots = [slot_of.get(id(job)) for job in planned.jobs]  # None: left the plan
        samples = []
        for s in microbatch.samples:
            planned.left[s.adapter] -= 1
            if slots[s.adapter] is not None:
                position = planned.positions[s.adapter][s.index]
                samples.append(Sample(slots[s.adapter], position, s.tokens))
        finishes = tuple(sorted(slots[p] for p in microbatch.finishes if slots[p] is not None))
        if not samples and self.num_stages == 1:
            return None  # an emptied microbatch stays (idle) only where the lemma counts it
        return Microbatch(tuple(sorted(samples, key=_order)), finishes)

    def _advance(
        self, cursors: dict[str, _Cursor], planned: _Planned, chunk: list[Microbatch]
    ) -> None:
        """Move the jobs' cursors past ``chunk`` (plan microbatches of ``planned``)."""
        for mb in chunk:
            taken: dict[int, list[int]] = {}
            for s in mb.samples:
                taken.setdefault(s.adapter, []).append(planned.positions[s.adapter][s.index])
            for p in set(taken) | set(mb.finishes):
                job = planned.jobs[p]
                cursor = cursors.setdefault(job.name, _Cursor(job.step))
                cursor.take(taken.get(p, []), p in mb.finishes)

    def _samples_left(self) -> int:
        """Samples the jobs that should train have left (what a new plan would hold)."""
        return sum(len(self._cursor(job).remaining(job)) for job in self.training().values())

    # -- the stream ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Microbatch | None]:
        """Microbatches in slots and training positions; `CUT` where a plan switch drains."""
        last_plan = None  # the plan of the last microbatch yielded
        while True:
            if self._plan is None or self._stale():
                chunk, source = self._switch()
            else:
                chunk, source = self._chunk(self._plan), self._plan
                if chunk is None:  # this plan is done; another may still be wanted
                    self._plan = None
                    continue
            if chunk is None:
                return
            for planned_mb in chunk:
                if last_plan is not None and source is not last_plan and self.num_stages > 1:
                    yield CUT  # before translating: jobs may leave or join at the cut
                    last_plan = source
                self._advance(self._cursors, source, [planned_mb])
                microbatch = self._translate(source, planned_mb)
                if microbatch is None:
                    continue
                last_plan = source
                yield microbatch
            if self._switching:  # the chunk that hid the new plan's planning is done
                self._plan, self._next, self._switching = self._next, None, False

    def _switch(self) -> tuple[list[Microbatch] | None, _Planned | None]:
        """Re-plan for the current jobs: ``(chunk to run now, the plan it belongs to)``.

        Where the new plan needs a worker, the old plan's next chunk runs while the worker
        plans what remains after it; a plan made in this process is waited for (it takes
        less than a chunk, and a job that joins trains from the next microbatch on).
        ``(None, None)``: nothing is left to train.
        """
        old = self._plan
        chunk = None
        if old is not None and not self.plans_in_process(self._samples_left()):
            chunk = self._chunk(old)
        if old is not None and old.planner is not None:
            old.planner.close()
        if chunk is not None:
            after = {name: c.copy() for name, c in self._cursors.items()}
            self._advance(after, old, chunk)
            self._next, self._switching = self._start(after), True
            return chunk, old
        self._plan = self._start(self._cursors)
        if self._plan is None:
            return None, None
        logger.info("planning %d samples of %d jobs", sum(self._plan.left), len(self._plan.jobs))
        return self._chunk(self._plan) or [], self._plan


def _order(sample: Sample) -> tuple[int, int]:
    return sample.adapter, sample.index
