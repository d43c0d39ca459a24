"""The planner's entry point: group, pack per segment, merge tails, verify.

A *stream* walks rounds (global batch ``r`` of every adapter), and in each round the
adapter groups of `grouping` in order. Each group's samples of the round form a segment,
packed by first-fit-decreasing and, with ``solver="milp"``, improved by the two-stage MILP
of `milp`. A segment's last microbatch stays open and becomes bin 0 of the next segment
(tail merging); each adapter may only use bins at least ``S`` positions after its previous
global batch finished (bubble lemma), and empty bins forced that way are idle microbatches.
The MILP stream is compared with the pure-greedy stream from the same state and the one
with fewer microbatches is kept, so the MILP packing is never longer than the greedy one.

Makespan first: three streams of one-adapter microbatches of the same rounds are built too
(`CANDIDATES`: round-robin cut by first-fit-decreasing or as mLoRA cuts, and the
Megatron-style order without flushes) and the stream whose simulated makespan (`simulate`,
the given `CostModel`) is shortest is kept. The mLoRA-cut stream has the mLoRA-style
baseline's microbatches with tile padding instead of padding to the longest sample, so on a
whole plan ours is never slower than that baseline in the simulator, nor (checked on random
problems, docs/planner.md) than the flushed Megatron-style baseline. Per chunk
(`iter_plan_chunks`) the choice does not compose into that guarantee (docs/planner.md).

Every choice is deterministic (greedy packing, MILP work limits, simulated times), so a
problem and seed give the same plan in any process and on any machine load; the only
exception is a MILP solve that reaches its wall-clock safety limit (counted in
``SolveReport.time_limit_hits``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

from megatron_lorafusion.planner._segment import Segment
from megatron_lorafusion.planner.baselines import default_samples_per_microbatch, stream_jobs
from megatron_lorafusion.planner.check import PlanVerifier, check_plan
from megatron_lorafusion.planner.cost import CostModel
from megatron_lorafusion.planner.greedy import pack_ffd
from megatron_lorafusion.planner.grouping import group_adapters
from megatron_lorafusion.planner.round_robin import (
    one_at_a_time,
    packed_pieces,
    padded_pieces,
    round_robin,
)
from megatron_lorafusion.planner.simulator import simulate
from megatron_lorafusion.planner.types import Microbatch, Plan, PlanProblem, Sample, SolveReport

__all__ = [
    "CANDIDATES",
    "DEFAULT_SOLVER",
    "DEFAULT_TIME_LIMIT_S",
    "StreamState",
    "iter_plan_chunks",
    "plan_microbatches",
]

logger = logging.getLogger(__name__)

DEFAULT_SOLVER = "greedy"
"""Greedy by default: over 120 MILP runs (issue 18) the MILP saved at most 3 microbatches
(<= 1 %) and its makespan ranged 0.992-1.0035 of greedy's, at 40x the planning time; on the
bench (docs/planner.md) it never used fewer microbatches than greedy."""

DEFAULT_TIME_LIMIT_S = 0.1
"""Wall-clock safety limit of one MILP solve, model building included (the work limit is
`milp.NODE_LIMIT`); a solve that reaches it keeps the greedy bins. Unused by greedy."""

_NEVER = -(10**9)

CANDIDATES = ("round_robin", "round_robin_padded", "megatron")
"""Streams simulated against the packed one in every chunk (ties keep the packed stream):
round-robin cut by first-fit-decreasing, round-robin cut as mLoRA cuts (the mLoRA-style
baseline's microbatches at tile padding), and the Megatron-style baseline's microbatches in
its order without its flushes. Tried even when packing needs no idle microbatch: at S = 1
the packed stream was up to 9 % slower than Megatron-style on small random problems
(per-adapter tile padding of mixed microbatches, first-fit-decreasing not monotone)."""


@dataclass(frozen=True)
class StreamState:
    """Where a stream stands between chunks (picklable, so a worker can carry it).

    Attributes:
        position: microbatches emitted so far (the open tail sits at this position).
        carry: samples of the open tail microbatch (empty before the first segment).
        carry_finishes: adapters whose global batch completes in the open tail.
        last_finish: per adapter, position of the microbatch that finished its last batch.
        next_round: first round not planned yet.
    """

    position: int
    carry: tuple[Sample, ...]
    carry_finishes: tuple[int, ...]
    last_finish: tuple[int, ...]
    next_round: int

    @classmethod
    def start(cls, problem: PlanProblem) -> StreamState:
        """The state before anything is planned."""
        return cls(0, (), (), (_NEVER,) * problem.num_adapters, 0)


@dataclass
class _Counters:
    segments: int = 0
    milp_solves: int = 0
    milp_improved: int = 0
    time_limit_hits: int = 0
    bins_over_bound: int = 0
    max_solve_s: float = 0.0


def _num_rounds(problem: PlanProblem) -> int:
    return max(problem.num_global_batches(a) for a in range(problem.num_adapters))


def _microbatch(members: list[Sample], finishes: set[int]) -> Microbatch:
    return Microbatch(
        tuple(sorted(members, key=lambda s: (s.adapter, s.index))), tuple(sorted(finishes))
    )


def _pack(
    segment: Segment, solver: str, time_limit_s: float, seed: int, counters: _Counters
) -> list[list[Sample]]:
    bins = pack_ffd(segment)
    if solver == "milp":
        from megatron_lorafusion.planner.milp import pack_milp

        outcome = pack_milp(segment, bins, time_limit_s, seed)
        counters.milp_solves += outcome.solves
        counters.milp_improved += int(outcome.improved)
        counters.time_limit_hits += int(outcome.time_limit_hit)
        counters.max_solve_s = max(counters.max_solve_s, outcome.max_solve_s)
        bins = outcome.bins
    counters.segments += 1
    counters.bins_over_bound += len(bins) - segment.lower_bound()
    return bins


def _run_stream(
    problem: PlanProblem,
    state: StreamState,
    round_stop: int,
    solver: str,
    time_limit_s: float,
    counters: _Counters,
) -> tuple[list[Microbatch], StreamState]:
    """Plan rounds ``[state.next_round, round_stop)``; the last microbatch stays open."""
    out: list[Microbatch] = []
    position, carry, carry_fin = state.position, state.carry, set(state.carry_finishes)
    last_finish = list(state.last_finish)
    groups_cache: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for r in range(state.next_round, round_stop):
        active = tuple(a for a in range(problem.num_adapters) if r < problem.num_global_batches(a))
        if active not in groups_cache:
            groups_cache[active] = group_adapters(problem, active)
        for group in groups_cache[active]:
            items = tuple(s for a in group for s in problem.global_batch(a, r))
            release = {a: max(0, last_finish[a] + problem.num_stages - position) for a in group}
            segment = Segment(items, carry, release, problem.capacity, problem.tile_height)
            bins = _pack(segment, solver, time_limit_s, problem.seed, counters)
            last_bin = {
                s.adapter: b
                for b, members in enumerate(bins)
                for s in members
                if s.adapter in release
            }
            finishes: list[set[int]] = [set() for _ in bins]
            finishes[0] |= carry_fin
            for a, b in last_bin.items():
                finishes[b].add(a)
                last_finish[a] = position + b
            out.extend(_microbatch(m, f) for m, f in zip(bins[:-1], finishes[:-1], strict=True))
            position += len(bins) - 1
            carry, carry_fin = tuple(bins[-1]), finishes[-1]
    new_state = StreamState(
        position, carry, tuple(sorted(carry_fin)), tuple(last_finish), round_stop
    )
    return out, new_state


def _flush(state: StreamState) -> tuple[list[Microbatch], StreamState]:
    if not state.carry:
        return [], state
    tail = _microbatch(list(state.carry), set(state.carry_finishes))
    return [tail], replace(state, position=state.position + 1, carry=(), carry_finishes=())


def _round_robin_chunk(
    problem: PlanProblem, state: StreamState, round_stop: int, name: str, flush: bool
) -> tuple[list[Microbatch], StreamState]:
    """Rounds ``[state.next_round, round_stop)`` of one-adapter microbatches after the tail.

    Round-robin (``"round_robin"``, ``"round_robin_padded"``) or
    adapter by adapter (``"megatron"``, the Megatron-style baseline's order).
    """
    cap, tile = problem.capacity, problem.tile_height
    if name == "round_robin_padded":
        pieces = padded_pieces(default_samples_per_microbatch(problem), cap, tile)
    else:
        pieces = packed_pieces(cap, tile)
    order = one_at_a_time if name == "megatron" else round_robin
    out = [_microbatch(list(state.carry), set(state.carry_finishes))] if state.carry else []
    rr, last = order(
        problem, pieces, range(state.next_round, round_stop), state.position + len(out),
        state.last_finish,
    )
    out += rr
    if flush:
        return out, StreamState(state.position + len(out), (), (), tuple(last), round_stop)
    tail = out.pop()  # stays open, as the packed stream's last microbatch does
    return out, StreamState(state.position + len(out), tail.samples, tail.finishes,
                            tuple(last), round_stop)


def _makespan(problem: PlanProblem, mbs: list[Microbatch], state: StreamState,
              cost: CostModel, beat: float = math.inf) -> float:
    """Simulated makespan of the chunk, or ``inf`` when it cannot be below ``beat``.

    The bound: the last stage does all of its work (every F and B, every optimizer step)
    after the first microbatch's forward has passed the ``S - 1`` stages before it, and the
    last microbatch's backward then passes them again, so no 1F1B schedule of the jobs ends
    before ``work + (S - 1) * (F_first + B_last)`` (exact at ``S = 1``). A candidate whose
    bound is not below ``beat`` cannot be kept, so it is not simulated.
    """
    stream = mbs + [_microbatch(list(state.carry), set(state.carry_finishes))] * bool(state.carry)
    jobs = stream_jobs(stream, cost, problem.tile_height)
    if not jobs:
        return 0.0
    work = sum(j.forward_ms + j.backward_ms + cost.optimizer_ms * len(j.steps) for j in jobs)
    bound = work + (problem.num_stages - 1) * (jobs[0].forward_ms + jobs[-1].backward_ms)
    if bound >= beat:
        return math.inf
    return simulate(jobs, problem.num_stages, cost).makespan_ms


def _plan_chunk(
    problem: PlanProblem,
    state: StreamState,
    round_stop: int,
    solver: str,
    time_limit_s: float,
    cost: CostModel,
) -> tuple[list[Microbatch], StreamState, _Counters, str, int]:
    """One chunk: (microbatches, state, counters, chosen, greedy count).

    The packed stream (MILP or its greedy floor, fewer microbatches wins) is kept unless a
    stream of one-adapter microbatches of the same rounds (`CANDIDATES`) simulates faster.
    """
    flush = round_stop >= _num_rounds(problem)
    results = {}
    for name in ("greedy", "milp") if solver == "milp" else ("greedy",):
        counters = _Counters()
        mbs, new_state = _run_stream(problem, state, round_stop, name, time_limit_s, counters)
        if flush:
            tail, new_state = _flush(new_state)
            mbs += tail
        length = len(mbs) + (1 if new_state.carry else 0)
        results[name] = (mbs, new_state, counters, length)
    greedy_len = results["greedy"][3]
    chosen = "milp" if solver == "milp" and results["milp"][3] <= greedy_len else "greedy"
    mbs, new_state, counters, _ = results[chosen]
    if chosen == "greedy" and solver == "milp":
        milp_counters = results["milp"][2]
        counters = replace(milp_counters, milp_improved=0)
    best = _makespan(problem, mbs, new_state, cost)
    for name in CANDIDATES:
        rr_mbs, rr_state = _round_robin_chunk(problem, state, round_stop, name, flush)
        makespan = _makespan(problem, rr_mbs, rr_state, cost, best)
        if makespan < best:
            best, mbs, new_state, chosen = makespan, rr_mbs, rr_state, name
    return mbs, new_state, counters, chosen, greedy_len


def _check_args(solver: str, time_limit_s: float) -> None:
    if solver not in ("milp", "greedy"):
        raise ValueError(f"solver must be 'milp' or 'greedy', got {solver!r}")
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0 seconds, got {time_limit_s}")


def _report(
    solver: str,
    chosen: str,
    counters: _Counters,
    mbs: list[Microbatch],
    greedy_len: int,
    wall_s: float,
) -> SolveReport:
    return SolveReport(
        solver=solver,
        chosen=chosen,
        segments=counters.segments,
        milp_solves=counters.milp_solves,
        milp_improved=counters.milp_improved,
        time_limit_hits=counters.time_limit_hits,
        bins_over_bound=counters.bins_over_bound,
        microbatches=len(mbs),
        greedy_microbatches=greedy_len,
        idle_microbatches=sum(mb.is_idle for mb in mbs),
        wall_s=wall_s,
        max_solve_s=counters.max_solve_s,
    )


def plan_microbatches(
    problem: PlanProblem,
    solver: Literal["milp", "greedy"] = DEFAULT_SOLVER,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    *,
    cost: CostModel | None = None,
) -> Plan:
    """Plan every sample of ``problem`` into a verified stream of microbatches.

    Args:
        problem: lengths, global batch sizes, capacity, ``S``, tile height, seed.
        solver: ``"greedy"`` (first-fit-decreasing) or ``"milp"`` (two-stage MILP per
            segment, greedy as floor).
        time_limit_s: wall-clock safety limit of each MILP solve, in seconds.
        cost: cost model that picks between packed and round-robin streams when packing
            needs idle microbatches (default `CostModel()`).

    Returns:
        A plan that passed `check_plan`, with a `SolveReport` in ``plan.report``.

    Raises:
        ValueError: on a bad solver name or time limit (the problem validates itself).
    """
    _check_args(solver, time_limit_s)
    start = time.perf_counter()
    mbs, _, counters, chosen, greedy_len = _plan_chunk(
        problem, StreamState.start(problem), _num_rounds(problem), solver, time_limit_s,
        cost or CostModel(),
    )
    report = _report(solver, chosen, counters, mbs, greedy_len, time.perf_counter() - start)
    plan = Plan(tuple(mbs), problem.capacity, problem.tile_height, problem.num_adapters, report)
    check_plan(plan, problem)
    logger.info(
        "planned %d samples into %d microbatches (%d idle) with %s (kept %s; greedy %d): "
        "%d segments, %d MILP solves, %d improved, %d time-limit hits, %d over bound, %.3f s",
        sum(len(x) for x in problem.lengths),
        report.microbatches,
        report.idle_microbatches,
        solver,
        chosen,
        greedy_len,
        report.segments,
        report.milp_solves,
        report.milp_improved,
        report.time_limit_hits,
        report.bins_over_bound,
        report.wall_s,
    )
    return plan


def iter_plan_chunks(
    problem: PlanProblem,
    rounds_per_chunk: int = 4,
    solver: Literal["milp", "greedy"] = DEFAULT_SOLVER,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    *,
    cost: CostModel | None = None,
) -> Iterator[Plan]:
    """Plan ``problem`` a few rounds at a time, verifying each chunk as it is produced.

    The concatenated chunks form a valid plan of the whole problem (the tail of each chunk
    stays open and merges into the next); the greedy floor and the choice between packed
    and `CANDIDATES` streams apply per chunk, each chunk simulated alone, so unlike a whole
    `plan_microbatches` plan the concatenation can simulate slower than the better
    baseline (measured up to 5.5 % on small random problems; docs/planner.md).
    Deterministic for a problem (seed included) and ``rounds_per_chunk``, unless a MILP
    solve reaches its wall-clock safety limit.

    Args:
        problem: the whole problem.
        rounds_per_chunk: rounds (one global batch per active adapter) per chunk, >= 1.
        solver: ``"greedy"`` or ``"milp"``.
        time_limit_s: wall-clock safety limit of each MILP solve, in seconds.
        cost: cost model for the packed / round-robin choice (default `CostModel()`).

    Yields:
        Plans holding consecutive slices of the microbatch stream.

    Raises:
        ValueError: on bad arguments. PlanError: if a chunk breaks an invariant.
    """
    _check_args(solver, time_limit_s)
    if rounds_per_chunk < 1:
        raise ValueError(f"rounds_per_chunk must be >= 1, got {rounds_per_chunk}")
    verifier = PlanVerifier(problem)
    cost = cost or CostModel()
    state, total = StreamState.start(problem), _num_rounds(problem)
    while state.next_round < total:
        start = time.perf_counter()
        stop = min(total, state.next_round + rounds_per_chunk)
        mbs, state, counters, chosen, greedy_len = _plan_chunk(
            problem, state, stop, solver, time_limit_s, cost
        )
        verifier.feed(mbs)
        report = _report(solver, chosen, counters, mbs, greedy_len, time.perf_counter() - start)
        logger.info(
            "planned rounds up to %d: %d microbatches (%d idle) with %s (kept %s), "
            "%d MILP solves, %d time-limit hits, %.3f s",
            stop,
            report.microbatches,
            report.idle_microbatches,
            solver,
            chosen,
            report.milp_solves,
            report.time_limit_hits,
            report.wall_s,
        )
        yield Plan(tuple(mbs), problem.capacity, problem.tile_height, problem.num_adapters, report)
    verifier.finish()
