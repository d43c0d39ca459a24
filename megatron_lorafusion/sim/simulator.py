"""Discrete-event model of an ``S``-stage 1F1B pipeline running a stream of microbatches.

Each stage runs its operations in the fixed 1F1B order (``S - s - 1`` warm-up forwards,
then one-forward-one-backward, then the cool-down backwards). An operation starts when its
stage is free and its inputs are ready: the forward of the previous stage (or the backward
of the next stage, or this stage's forward for the last stage), plus, for a forward, the
optimizer step of every adapter it reads whose previous global batch stepped (per stage,
right after that microbatch's backward). A plan that breaks the bubble lemma deadlocks
here, and `simulate` says so. Flushes (Megatron-style) are separate `simulate` calls laid
end to end by `simulate_flushed`. `planner.makespan.simulate_makespan` computes the same
makespan in one pass, without events (what the planner compares candidate streams by).

With ``defer_wgrad = w > 0`` each backward is split zero-bubble style: the input-gradient
part ``(1 - w)·B`` runs in the 1F1B slot and the weight-gradient part ``W = w·B`` waits on
its stage until the stage would otherwise idle (it runs if it ends before the next
operation's inputs are ready), at most ``S`` of them pending (their saved inputs are held);
an optimizer step first runs the pending W of every microbatch that touched a stepping
adapter. Makespans with and without it say what deferring LoRA's weight gradients gains.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_lorafusion.planner.cost import CostModel
from megatron_lorafusion.planner.makespan import Job

__all__ = ["Event", "SimResult", "simulate", "simulate_flushed"]


@dataclass(frozen=True)
class Event:
    """One operation on one stage: ``"F"``, ``"B"``, ``"W"`` (deferred weight grads), ``"O"``."""

    stage: int
    job: int
    kind: str
    start_ms: float
    end_ms: float
    label: int


@dataclass(frozen=True)
class SimResult:
    """What a simulation measured.

    Attributes:
        makespan_ms: time from the first forward to the last operation.
        busy_ms: per stage, time spent computing (F, B and optimizer steps).
        events: every operation, for timelines.
        num_stages: ``S``.
    """

    makespan_ms: float
    busy_ms: tuple[float, ...]
    events: tuple[Event, ...]
    num_stages: int

    @property
    def bubble_ratio(self) -> float:
        """Idle fraction of the ``S x makespan`` stage-time."""
        if self.makespan_ms == 0:
            return 0.0
        return 1.0 - sum(self.busy_ms) / (self.num_stages * self.makespan_ms)

    @property
    def utilization(self) -> tuple[float, ...]:
        """Per stage, busy time / makespan."""
        if self.makespan_ms == 0:
            return tuple(0.0 for _ in self.busy_ms)
        return tuple(b / self.makespan_ms for b in self.busy_ms)


def _stage_order(stage: int, num_stages: int, jobs: Sequence[Job]) -> list[tuple[str, int]]:
    m = len(jobs)
    warmup = min(num_stages - stage - 1, m)
    order: list[tuple[str, int]] = [("F", i) for i in range(warmup)]

    def backward(i: int) -> None:
        order.append(("B", i))
        if jobs[i].steps:
            order.append(("O", i))

    for i in range(m - warmup):
        order.append(("F", warmup + i))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    return order


def _previous_steps(jobs: Sequence[Job]) -> list[list[int]]:
    """For each job, the jobs whose optimizer steps its forward must wait for."""
    last_step: dict[int, int] = {}
    deps: list[list[int]] = []
    for i, job in enumerate(jobs):
        deps.append(sorted({last_step[a] for a in job.adapters if a in last_step}))
        for a in job.steps:
            last_step[a] = i
    return deps


def simulate(
    jobs: Sequence[Job], num_stages: int, cost: CostModel, *, defer_wgrad: float = 0.0
) -> SimResult:
    """Run ``jobs`` through an ``S``-stage 1F1B pipeline with no flush.

    Args:
        jobs: microbatches in order.
        num_stages: ``S`` >= 1.
        cost: gives the optimizer-step and p2p times (job times are in the jobs).
        defer_wgrad: share ``w`` of each backward that is the weight-gradient pass, deferred
            into idle time (module docstring); 0 keeps it inside the backward.

    Returns:
        Makespan, per-stage busy time and every operation's interval.

    Raises:
        ValueError: if ``num_stages < 1``, ``defer_wgrad`` is outside ``[0, 1)`` or a job's
            ``stage_ms`` has another length.
        RuntimeError: if the schedule deadlocks (the stream breaks the bubble lemma).
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not 0.0 <= defer_wgrad < 1.0:
        raise ValueError(f"defer_wgrad must lie in [0, 1), got {defer_wgrad}")
    short = [i for i, job in enumerate(jobs) if job.stage_ms and len(job.stage_ms) != num_stages]
    if short:
        raise ValueError(f"jobs {short[:5]} give stage_ms for other than {num_stages} stages")
    orders = [_stage_order(s, num_stages, jobs) for s in range(num_stages)]
    deps = _previous_steps(jobs)
    end: dict[tuple[str, int, int], float] = {}  # (kind, stage, job) -> end time
    free = [0.0] * num_stages
    pos = [0] * num_stages
    busy = [0.0] * num_stages
    events: list[Event] = []
    pending: list[list[int]] = [[] for _ in range(num_stages)]  # deferred W, oldest first

    def run(s: int, kind: str, i: int, start: float, length: float) -> None:
        free[s] = end[kind, s, i] = start + length
        busy[s] += length
        if length > 0:
            events.append(Event(s, i, kind, start, start + length, jobs[i].label))

    def run_wgrad(s: int, i: int) -> None:
        pending[s].remove(i)
        run(s, "W", i, free[s], defer_wgrad * jobs[i].op_ms("B", s))

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(num_stages):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                ready = _ready_time(kind, s, i, num_stages, deps, end, cost)
                if ready is None:
                    break
                job = jobs[i]
                if kind == "O":  # the step needs every weight gradient of its adapters
                    for j in [j for j in pending[s] if set(jobs[j].adapters) & set(job.steps)]:
                        run_wgrad(s, j)
                while (
                    pending[s]
                    and free[s] + defer_wgrad * jobs[pending[s][0]].op_ms("B", s) <= ready
                ):
                    run_wgrad(s, pending[s][0])
                length = cost.optimizer_ms * len(job.steps) if kind == "O" else job.op_ms(kind, s)
                if kind == "B" and defer_wgrad > 0:
                    length *= 1.0 - defer_wgrad
                    pending[s].append(i)
                    if len(pending[s]) > num_stages:
                        run_wgrad(s, pending[s][0])
                run(s, kind, i, max(free[s], ready), length)
                pos[s] += 1
                remaining -= 1
                progressed = True
            if pos[s] == len(orders[s]):
                while pending[s]:
                    run_wgrad(s, pending[s][0])
        if not progressed:
            stuck = {s: orders[s][pos[s]] for s in range(num_stages) if pos[s] < len(orders[s])}
            raise RuntimeError(
                f"pipeline deadlock at {stuck} (stage: (op, microbatch)): a forward waits for an "
                "optimizer step scheduled after it; the stream breaks the bubble lemma"
            )
    return SimResult(max(free, default=0.0), tuple(busy), tuple(events), num_stages)


def _ready_time(
    kind: str,
    s: int,
    i: int,
    num_stages: int,
    deps: list[list[int]],
    end: dict[tuple[str, int, int], float],
    cost: CostModel,
) -> float | None:
    """When op ``kind`` of job ``i`` on stage ``s`` has its inputs, or None if not yet known."""
    needs: list[tuple[tuple[str, int, int], float]] = []
    if kind == "F":
        if s > 0:
            needs.append((("F", s - 1, i), cost.p2p_ms))
        needs.extend((("O", s, d), 0.0) for d in deps[i])
    elif kind == "B":
        if s < num_stages - 1:
            needs.append((("B", s + 1, i), cost.p2p_ms))
        else:
            needs.append((("F", s, i), 0.0))
    else:
        needs.append((("B", s, i), 0.0))
    t = 0.0
    for key, delay in needs:
        if key not in end:
            return None
        t = max(t, end[key] + delay)
    return t


def simulate_flushed(
    groups: Sequence[Sequence[Job]],
    num_stages: int,
    cost: CostModel,
    *,
    defer_wgrad: float = 0.0,
) -> SimResult:
    """Run each group as its own pipeline, one after the other (a flush between groups)."""
    offset, busy, events = 0.0, [0.0] * num_stages, []
    for group in groups:
        result = simulate(group, num_stages, cost, defer_wgrad=defer_wgrad)
        events.extend(
            Event(e.stage, e.job, e.kind, e.start_ms + offset, e.end_ms + offset, e.label)
            for e in result.events
        )
        busy = [b + r for b, r in zip(busy, result.busy_ms, strict=True)]
        offset += result.makespan_ms
    return SimResult(offset, tuple(busy), tuple(events), num_stages)
