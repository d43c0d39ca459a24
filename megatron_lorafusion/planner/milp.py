"""Two-stage MILP packing of a segment with PuLP (HiGHS or CBC).

Stage 1 minimises the microbatches of a segment; stage 2 fixes that count and makes the
last microbatch as empty as possible, so it merges well with the next group's head
(LoRAFusion §4, "adaptive batching"). Both stages respect the tile padding of each
adapter's part of a bin, the carried bin 0 and the per-adapter release bins (bubble lemma),
start from the greedy answer (warm start), and are skipped when the greedy answer already
meets the lower bound. The caller keeps the greedy answer when it is at least as good, so
the MILP is never worse than first-fit-decreasing.

Limits. Each solve stops after `NODE_LIMIT` branch-and-bound nodes (one HiGHS thread, fixed
seed): a work limit, so its answer is the same on any machine and load. ``time_limit_s`` is
a safety net on top, and it bounds the whole solve, model building included (building a
2,000-sample segment took seconds in PuLP): a solve that reaches it is abandoned and the
segment keeps its greedy bins (counted as a time-limit hit; only then can a plan depend on
the machine's speed).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass

from megatron_lorafusion.planner._segment import Segment, drop_spare_idles, load_of, score

__all__ = [
    "EXACT_ITEMS",
    "MAX_ASSIGNMENTS",
    "NODE_LIMIT",
    "TAIL_WINDOW",
    "MilpOutcome",
    "available_solver",
    "pack_milp",
    "tail_tolerance",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MilpOutcome:
    """Result of `pack_milp` for one segment.

    Attributes:
        bins: the best bins found (the initial ones if the MILP did not improve them).
        solves: PuLP solves run (0, 1 or 2).
        improved: True if the MILP beat the initial bins.
        time_limit_hit: True if a solve reached the wall-clock limit (its answer was dropped).
        status: last solver status string ("skipped" when no solve was needed).
        max_solve_s: longest solve in wall-clock seconds, model building included.
    """

    bins: list[list]
    solves: int
    improved: bool
    time_limit_hit: bool
    status: str
    max_solve_s: float = 0.0


NODE_LIMIT = 200
"""Branch-and-bound nodes per solve: the deterministic work limit. Over the bench's segments
the solves that improved on greedy did so at the root or within a few dozen nodes."""


@functools.cache
def available_solver() -> str:
    """Name of the PuLP solver used: HiGHS if installed, else CBC.

    Raises:
        ImportError: if PuLP or both solvers are missing (install ``pulp[highs]``).
    """
    try:
        import pulp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the MILP planner needs PuLP: pip install 'pulp[highs]'") from e
    names = pulp.listSolvers(onlyAvailable=True)
    for name in ("HiGHS", "PULP_CBC_CMD"):
        if name in names:
            return name
    raise ImportError(f"no MILP solver for PuLP (found {names}): pip install 'pulp[highs]'")


_banner_silenced = False


def _silence_highs_banner() -> None:
    """Send HiGHS's start-up banner to /dev/null (once per process).

    HiGHS prints it from C on its first instance, whatever ``msg`` says, which would spoil
    the JSON that `plan` writes on stdout.
    """
    global _banner_silenced
    if _banner_silenced:
        return
    _banner_silenced = True
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _solver(time_limit_s: float, seed: int, gap_abs: float):
    import pulp

    if available_solver() == "HiGHS":
        _silence_highs_banner()
        # One thread, a fixed seed and a node limit: the same answer on every run and machine
        # unless the wall-clock safety limit is reached first.
        return pulp.HiGHS(
            msg=False,
            timeLimit=time_limit_s,
            warmStart=True,
            threads=1,
            gapAbs=gap_abs,
            random_seed=seed,
            output_flag=False,
            mip_max_nodes=NODE_LIMIT,
        )
    return pulp.PULP_CBC_CMD(
        msg=False,
        timeLimit=time_limit_s,
        warmStart=True,
        threads=1,
        gapAbs=gap_abs,
        options=[f"randomSeed {seed}", f"maxNodes {NODE_LIMIT}"],
    )


def _start_up() -> None:
    """Import PuLP and start HiGHS once per process, before any solve's clock runs."""
    if available_solver() == "HiGHS":
        _silence_highs_banner()


class _OutOfTime(Exception):
    """Model building reached the solve's deadline."""


def _check(deadline: float) -> None:
    if time.perf_counter() > deadline:
        raise _OutOfTime


def _is_time_limit(status: str) -> bool:
    return "time" in status.lower()


def _solve(
    segment: Segment,
    initial: list[list],
    num_bins: int,
    stage: int,
    lower_bound: int,
    time_limit_s: float,
    seed: int,
    gap_abs: float,
) -> tuple[list[list] | None, str, bool]:
    """Build and solve one stage within ``time_limit_s`` (building included).

    Returns:
        (bins or None, status, time_limit_hit); bins are None when the solve found nothing
        or reached the wall-clock limit (an answer that depends on the machine is dropped).
    """
    _start_up()
    # Cyclic GC passes over a large heap while PuLP allocates 10^5-10^6 objects cost more
    # than the solve's limit (measured inside the test suite); refcounting frees them anyway.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _solve_within(
            segment, initial, num_bins, stage, lower_bound, time_limit_s, seed, gap_abs
        )
    finally:
        if collecting:
            gc.enable()


def _solve_within(
    segment: Segment,
    initial: list[list],
    num_bins: int,
    stage: int,
    lower_bound: int,
    time_limit_s: float,
    seed: int,
    gap_abs: float,
) -> tuple[list[list] | None, str, bool]:
    start = time.perf_counter()
    deadline = start + time_limit_s
    try:
        prob, x, y, u = _build(segment, initial, num_bins, stage, lower_bound, deadline)
    except _OutOfTime:
        return None, "TimeLimit (model building)", True
    built = time.perf_counter()
    # PuLP's export to HiGHS and its read-back of the answer cost about as much as building
    # (measured; 3x for margin), outside HiGHS's own clock: leave HiGHS what remains.
    remaining = deadline - built - 3 * (built - start)
    if remaining <= 0:
        return None, "TimeLimit (model building)", True
    stats = prob.solve(_solver(remaining, seed, gap_abs))
    status = str(getattr(stats, "status_str", "unknown"))
    if _is_time_limit(status):
        return None, status, True
    if not getattr(stats, "has_solution", False):
        return None, status, False
    bins: list[list] = [list(segment.carry) if b == 0 else [] for b in range(num_bins)]
    for (k, b), v in x.items():
        if (v.value() or 0) > 0.5:
            bins[b].append(segment.items[k])
    return drop_spare_idles(segment, bins), status, False


def _build(
    segment: Segment,
    initial: list[list],
    num_bins: int,
    stage: int,
    lower_bound: int,
    deadline: float,
):
    """The PuLP model of one stage, warm-started; raises `_OutOfTime` past ``deadline``."""
    import pulp

    cap, tile = segment.capacity, segment.tile_height
    items = list(segment.items)
    adapters = sorted({s.adapter for s in items})
    prob = pulp.LpProblem(f"segment_stage{stage}", pulp.LpMinimize)
    x: dict[tuple[int, int], object] = {}
    for k, s in enumerate(items):
        _check(deadline)
        for b in range(segment.first_bin(s.adapter), num_bins):
            x[k, b] = prob.add_variable(f"x_{k}_{b}", cat=pulp.LpBinary)
    y: dict[tuple[int, int], object] = {}
    for a in adapters:
        _check(deadline)
        for b in range(segment.first_bin(a), num_bins):
            y[a, b] = prob.add_variable(f"y_{a}_{b}", 0, cap // tile, cat=pulp.LpInteger)
    u = [None] + [prob.add_variable(f"u_{b}", cat=pulp.LpBinary) for b in range(1, num_bins)]
    room = [cap - (segment.carry_load() if b == 0 else 0) for b in range(num_bins)]
    bin_load = [
        _check(deadline) or pulp.lpSum(tile * y[a, b] for a in adapters if (a, b) in y)
        for b in range(num_bins)
    ]
    if stage == 1:
        prob += 1 + pulp.lpSum(u[1:])
        prob += 1 + pulp.lpSum(u[1:]) >= lower_bound
        for b in range(1, num_bins):
            prob += bin_load[b] <= room[b] * u[b]
            if b + 1 < num_bins:
                prob += u[b] >= u[b + 1]
        prob += bin_load[0] <= room[0]
    else:
        prob += bin_load[num_bins - 1]
        for b in range(num_bins):
            prob += bin_load[b] <= room[b]
    by_item: dict[int, list] = {}
    by_adapter_bin: dict[tuple[int, int], list] = {}
    for n, ((k, b), v) in enumerate(x.items()):
        if n % 1024 == 0:
            _check(deadline)
        by_item.setdefault(k, []).append(v)
        by_adapter_bin.setdefault((items[k].adapter, b), []).append(items[k].tokens * v)
    for k in range(len(items)):
        _check(deadline)
        prob += pulp.lpSum(by_item[k]) == 1
    for (a, b), yv in y.items():
        _check(deadline)
        prob += tile * yv >= pulp.lpSum(by_adapter_bin[a, b])
    _warm_start(segment, initial, items, x, y, u)
    _check(deadline)
    return prob, x, y, u


def _warm_start(segment: Segment, initial: list[list], items: list, x, y, u) -> None:
    """Give the solver the greedy bins as a first incumbent (when they fit the model)."""
    index = {(s.adapter, s.index): k for k, s in enumerate(items)}
    tile = segment.tile_height
    per_ab: dict[tuple[int, int], int] = {}
    chosen: set[tuple[int, int]] = set()
    for b, members in enumerate(initial):
        for s in members:
            k = index.get((s.adapter, s.index))
            if k is not None:
                chosen.add((k, b))
                per_ab[s.adapter, b] = per_ab.get((s.adapter, b), 0) + s.tokens
    if not all(key in x for key in chosen):
        return
    for key, v in x.items():
        v.setInitialValue(1 if key in chosen else 0)
    for (a, b), v in y.items():
        v.setInitialValue(-(-per_ab.get((a, b), 0) // tile))
    for b in range(1, len(u)):
        u[b].setInitialValue(1 if b < len(initial) else 0)


EXACT_ITEMS = 24
"""Segments with at most this many samples always get the full stage-1 solve."""

TAIL_WINDOW = 4
"""Stage 2 re-packs only the last ``TAIL_WINDOW`` bins (exactly, within that window): on the
whole segment HiGHS rarely proves stage 2 within 0.5 s on 64 samples (measured), on four
bins it takes a few milliseconds."""


def _solve_tail_window(
    segment: Segment, bins: list[list], time_limit_s: float, seed: int, tolerance: float
) -> tuple[list[list] | None, str, bool]:
    """Stage 2 on the last `TAIL_WINDOW` bins of ``bins``, the earlier bins kept as they are."""
    first = max(0, len(bins) - TAIL_WINDOW)
    window = bins[first:]
    carry = segment.carry if first == 0 else ()
    carried = {(s.adapter, s.index) for s in carry}
    items = tuple(s for b in window for s in b if (s.adapter, s.index) not in carried)
    release = {a: max(0, r - first) for a, r in segment.release.items()}
    sub = Segment(items, carry, release, segment.capacity, segment.tile_height)
    solved, status, hit = _solve(
        sub, window, len(window), 2, len(window), time_limit_s, seed, tolerance
    )
    if solved is None or len(solved) > len(window):
        return None, status, hit
    return bins[:first] + solved, status, hit


MAX_ASSIGNMENTS = 20_000
"""Segments whose model has more sample-to-bin variables are left to greedy (deterministic,
unlike a time limit): the bench's 128-sample segments have about 6,000; a 2,048-sample
segment of 256 adapters has 800,000 and took PuLP seconds to build."""


def _num_assignments(segment: Segment, num_bins: int) -> int:
    return sum(max(0, num_bins - segment.first_bin(s.adapter)) for s in segment.items)


def tail_tolerance(segment: Segment) -> int:
    """Tokens by which stage 2 may miss the emptiest possible tail: 1/16 of the capacity.

    Proving the exact optimum of stage 2 takes HiGHS over 0.5 s on 64-sample segments
    (measured), while a tail within 1/16 of a microbatch of the bound merges just as well.
    """
    return max(segment.tile_height, segment.capacity // 16)


def pack_milp(
    segment: Segment, initial: list[list], time_limit_s: float, seed: int = 0
) -> MilpOutcome:
    """Improve ``initial`` (greedy bins of ``segment``) with the two-stage MILP.

    Args:
        segment: the samples, carry and release bins.
        initial: a valid packing of ``segment`` (first-fit-decreasing), the floor.
        time_limit_s: wall-clock bound of each solve (model building included), in seconds;
            a solve that reaches it is dropped. The work limit is `NODE_LIMIT`.
        seed: solver seed, for reproducible answers.

    Returns:
        The better of ``initial`` and the MILP answer, with solve statistics.
    """
    best, solves, hit, status, longest = initial, 0, False, "skipped", 0.0
    if _num_assignments(segment, len(best)) > MAX_ASSIGNMENTS:
        return MilpOutcome(best, 0, False, False, "skipped (too large)")
    _start_up()
    lower = segment.lower_bound()
    # On big segments, stage 1 runs only when one bin fewer leaves some slack: at under 1/16
    # of a microbatch of slack in total, HiGHS never found nor disproved such a packing
    # within 0.25 s (5 of 5 64-sample WikiSum segments, measured). Small ones solve exactly.
    slack = (len(best) - 1) * segment.capacity - segment.min_total()
    worth_it = len(segment.items) <= EXACT_ITEMS or slack >= tail_tolerance(segment)
    if len(best) > lower and worth_it:
        start = time.perf_counter()
        bins, status, h = _solve(segment, best, len(best), 1, lower, time_limit_s, seed, 0.5)
        solves, hit, longest = solves + 1, hit or h, max(longest, time.perf_counter() - start)
        if bins is not None and score(bins, segment.tile_height) < score(best, segment.tile_height):
            best = bins
    n = len(best)
    tail_bound = max(0, segment.min_total() - (n - 1) * segment.capacity)
    tolerance, tail = tail_tolerance(segment), load_of(best[-1], segment.tile_height)
    # Only an under-filled tail (at most half a microbatch) is worth a solve: a fuller one
    # leaves little room for the next segment's bin 0 either way.
    if n > 1 and tail_bound + tolerance < tail <= segment.capacity // 2:
        start = time.perf_counter()
        bins, status, h = _solve_tail_window(segment, best, time_limit_s, seed, tolerance)
        solves, hit, longest = solves + 1, hit or h, max(longest, time.perf_counter() - start)
        if bins is not None and score(bins, segment.tile_height) < score(best, segment.tile_height):
            best = bins
    return MilpOutcome(best, solves, best is not initial, hit, status, longest)
