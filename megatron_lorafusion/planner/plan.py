"""The planner's entry point: group, pack per segment, merge tails, verify.

A *stream* walks rounds (global batch ``r`` of every adapter), and in each round the
adapter groups of `grouping` in order. Each group's samples of the round form a segment,
packed by first-fit-decreasing and, with ``solver="milp"``, improved by the two-stage MILP
of `milp`. A segment's last microbatch stays open and becomes bin 0 of the next segment
(tail merging); each adapter may only use bins at least ``S`` positions after its previous
global batch finished (bubble lemma), and empty bins forced that way are idle microbatches.
The MILP stream is compared with the pure-greedy stream of the same rounds and the one
with fewer microbatches is kept, so the MILP packing is never longer than the greedy one.
`plan_greedy` runs the whole planner (grouping, release constraints, tail merging) with only
the first-fit-decreasing packer.

Makespan first: three streams of one-adapter microbatches of the whole run are built too
(`CANDIDATES`: round-robin cut by first-fit-decreasing or as mLoRA cuts, and the
Megatron-style order without flushes) and the stream whose simulated makespan
(`simulate_makespan`, the given `CostModel`) is shortest is kept. The mLoRA-cut stream has
the mLoRA-style baseline's microbatches with tile padding instead of padding to the longest
sample, so ours is never slower than that baseline in the simulator, nor (checked on random
problems, docs/planner.md) than the flushed Megatron-style baseline. The choice is made once
for the run: `iter_plan_chunks` cuts that one stream into chunks, because choices made per
chunk do not compose into the guarantee (docs/planner.md).

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
from megatron_lorafusion.planner.check import PlanVerifier, check_plan
from megatron_lorafusion.planner.cost import CostModel
from megatron_lorafusion.planner.greedy import pack_ffd
from megatron_lorafusion.planner.grouping import group_adapters
from megatron_lorafusion.planner.makespan import simulate_makespan, stream_jobs
from megatron_lorafusion.planner.round_robin import (
    Pieces,
    default_samples_per_microbatch,
    one_at_a_time,
    packed_pieces,
    padded_pieces,
    round_robin,
)
from megatron_lorafusion.planner.types import Microbatch, Plan, PlanProblem, Sample, SolveReport

__all__ = [
    "CANDIDATES",
    "DEFAULT_SOLVER",
    "DEFAULT_TIME_LIMIT_S",
    "iter_plan_chunks",
    "plan_greedy",
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
"""Whole-run streams simulated against the packed one (ties keep the packed stream):
round-robin cut by first-fit-decreasing, round-robin cut as mLoRA cuts (the mLoRA-style
baseline's microbatches at tile padding), and the Megatron-style baseline's microbatches in
its order without its flushes. Tried even when packing needs no idle microbatch: at S = 1
the packed stream was up to 9 % slower than Megatron-style on small random problems
(per-adapter tile padding of mixed microbatches, first-fit-decreasing not monotone)."""


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
    problem: PlanProblem, solver: str, time_limit_s: float, counters: _Counters
) -> list[Microbatch]:
    """The packed stream of every round.

    Each segment's last microbatch stays open for the next segment's samples; the last
    segment's closes the stream.
    """
    out: list[Microbatch] = []
    position, carry, carry_fin = 0, (), set()
    last_finish = [_NEVER] * problem.num_adapters
    groups_cache: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for r in range(_num_rounds(problem)):
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
    if carry:
        out.append(_microbatch(list(carry), carry_fin))
    return out


def _candidate_stream(problem: PlanProblem, name: str, ffd: Pieces) -> list[Microbatch]:
    """The whole run as one-adapter microbatches (`CANDIDATES`).

    Round-robin (``"round_robin"``: batches cut by ``ffd``; ``"round_robin_padded"``: cut as
    mLoRA cuts) or adapter by adapter (``"megatron"``, cut by ``ffd``: the Megatron-style
    baseline's microbatches in its order, idles instead of flushes).
    """
    if name == "round_robin_padded":
        pieces = padded_pieces(
            default_samples_per_microbatch(problem), problem.capacity, problem.tile_height
        )
    else:
        pieces = ffd
    order = one_at_a_time if name == "megatron" else round_robin
    return order(problem, pieces, range(_num_rounds(problem)))[0]


def _makespan(
    problem: PlanProblem, mbs: list[Microbatch], cost: CostModel, beat: float = math.inf
) -> float:
    """Simulated makespan of a stream, or ``inf`` when it cannot be below ``beat``.

    The bound: the last stage does all of its work (every F and B, every optimizer step)
    after the first microbatch's forward has passed the ``S - 1`` stages before it, and the
    last microbatch's backward then passes them again, so no 1F1B schedule of the jobs ends
    before ``work + (S - 1) * (F_first + B_last)`` (exact at ``S = 1``). A candidate whose
    bound is not below ``beat`` cannot be kept, so it is not simulated; a simulation stops
    once a stage is busy until ``beat``.
    """
    jobs = stream_jobs(mbs, cost, problem.tile_height)
    if not jobs:
        return 0.0
    work = sum(j.forward_ms + j.backward_ms + cost.optimizer_ms * len(j.steps) for j in jobs)
    bound = work + (problem.num_stages - 1) * (jobs[0].forward_ms + jobs[-1].backward_ms)
    if bound >= beat:
        return math.inf
    return simulate_makespan(jobs, problem.num_stages, cost, beat)


def _plan_stream(
    problem: PlanProblem, solver: str, time_limit_s: float, cost: CostModel
) -> tuple[list[Microbatch], _Counters, str, int]:
    """The whole run's stream: (microbatches, counters, chosen, greedy count).

    The packed stream (MILP or its greedy floor, fewer microbatches wins) is kept unless a
    stream of one-adapter microbatches of the whole run (`CANDIDATES`) simulates faster.
    """
    results = {}
    for name in ("greedy", "milp") if solver == "milp" else ("greedy",):
        counters = _Counters()
        results[name] = (_run_stream(problem, name, time_limit_s, counters), counters)
    greedy_len = len(results["greedy"][0])
    chosen = "milp" if solver == "milp" and len(results["milp"][0]) <= greedy_len else "greedy"
    mbs, counters = results[chosen]
    if chosen == "greedy" and solver == "milp":
        counters = replace(results["milp"][1], milp_improved=0)
    best = _makespan(problem, mbs, cost)
    ffd = packed_pieces(problem.capacity, problem.tile_height)  # shared: same batches, same cuts
    for name in CANDIDATES:
        candidate = _candidate_stream(problem, name, ffd)
        makespan = _makespan(problem, candidate, cost, best)
        if makespan < best:
            best, mbs, chosen = makespan, candidate, name
    return mbs, counters, chosen, greedy_len


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


def _plan(
    problem: PlanProblem, solver: str, time_limit_s: float, cost: CostModel
) -> tuple[list[Microbatch], SolveReport]:
    """The whole run's stream and its report, logged once."""
    start = time.perf_counter()
    mbs, counters, chosen, greedy_len = _plan_stream(problem, solver, time_limit_s, cost)
    report = _report(solver, chosen, counters, mbs, greedy_len, time.perf_counter() - start)
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
    return mbs, report


def _chunk_ends(problem: PlanProblem, mbs: list[Microbatch], rounds_per_chunk: int) -> list[int]:
    """Stream positions where chunks end (exclusive), never an empty chunk.

    Chunk ``k`` ends with the microbatch that finishes the last of the global batches of
    rounds ``< (k + 1) * rounds_per_chunk``; the last chunk runs to the end of the stream.
    """
    finished: list[list[int]] = [[] for _ in range(problem.num_adapters)]
    for position, mb in enumerate(mbs):
        for a in mb.finishes:
            finished[a].append(position)
    ends: list[int] = []
    for stop in range(rounds_per_chunk, _num_rounds(problem), rounds_per_chunk):
        end = 1 + max((f[min(stop, len(f)) - 1] for f in finished if f), default=-1)
        if end > (ends[-1] if ends else 0):
            ends.append(end)
    if not ends or ends[-1] < len(mbs):
        ends.append(len(mbs))
    return ends


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
        cost: cost model that picks between the packed and the `CANDIDATES` streams
            (default `CostModel()`).

    Returns:
        A plan that passed `check_plan`, with a `SolveReport` in ``plan.report``.

    Raises:
        ValueError: on a bad solver name or time limit (the problem validates itself).
    """
    _check_args(solver, time_limit_s)
    mbs, report = _plan(problem, solver, time_limit_s, cost or CostModel())
    plan = Plan(tuple(mbs), problem.capacity, problem.tile_height, problem.num_adapters, report)
    check_plan(plan, problem)
    return plan


def plan_greedy(problem: PlanProblem) -> Plan:
    """Plan with first-fit-decreasing only (no PuLP): `plan_microbatches(problem, "greedy")`.

    Raises:
        ValueError: if the problem is invalid (see `PlanProblem`).
    """
    return plan_microbatches(problem, solver="greedy")


def iter_plan_chunks(
    problem: PlanProblem,
    rounds_per_chunk: int = 4,
    solver: Literal["milp", "greedy"] = DEFAULT_SOLVER,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    *,
    cost: CostModel | None = None,
) -> Iterator[Plan]:
    """The plan of ``problem`` in chunks of a few rounds, each verified as it is yielded.

    The stream is chosen once for the whole run, then cut: the chunks concatenate to
    ``plan_microbatches(problem, solver, time_limit_s, cost=cost).microbatches`` bit for bit
    (unless a MILP solve reaches its wall-clock safety limit), so they keep its guarantee
    (never slower than the better baseline in the simulator). Choosing per chunk broke it
    (33 of 1,500 small random problems up to 7.0 % slower than mLoRA-style;
    docs/planner.md): the baseline's round-robin lets adapters with small global batches run
    ahead across rounds, which a candidate built per chunk of rounds cannot. The first chunk
    therefore comes after the whole plan is made (2.3-2.6 s for 100,000 samples, greedy).

    Args:
        problem: the whole problem.
        rounds_per_chunk: rounds (one global batch per active adapter) per chunk, >= 1: a
            chunk ends with the microbatch that completes its last round's global batches.
        solver: ``"greedy"`` or ``"milp"``.
        time_limit_s: wall-clock safety limit of each MILP solve, in seconds.
        cost: cost model for the choice of stream (default `CostModel()`).

    Yields:
        Plans holding consecutive slices of the microbatch stream; each carries the whole
        run's `SolveReport`.

    Raises:
        ValueError: on bad arguments. PlanError: if a chunk breaks an invariant.
    """
    _check_args(solver, time_limit_s)
    if rounds_per_chunk < 1:
        raise ValueError(f"rounds_per_chunk must be >= 1, got {rounds_per_chunk}")
    mbs, report = _plan(problem, solver, time_limit_s, cost or CostModel())
    verifier = PlanVerifier(problem)
    start = 0
    for end in _chunk_ends(problem, mbs, rounds_per_chunk):
        chunk = tuple(mbs[start:end])
        verifier.feed(chunk)
        yield Plan(chunk, problem.capacity, problem.tile_height, problem.num_adapters, report)
        start = end
    verifier.finish()
