import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_lorafusion.planner import Sample
from megatron_lorafusion.planner._segment import Segment, load_of, validate_bins
from megatron_lorafusion.planner.greedy import pack_ffd
from megatron_lorafusion.planner.milp import (
    EXACT_ITEMS,
    available_solver,
    pack_milp,
    tail_tolerance,
)

pytest.importorskip("pulp")


def _brute_force_bins(segment: Segment) -> int:
    """Fewest bins over every assignment of items to bins (small segments only)."""
    items = segment.items
    for n in range(1, len(items) + 4):
        for assignment in itertools.product(range(n), repeat=len(items)):
            bins = [list(segment.carry) if b == 0 else [] for b in range(n)]
            if any(
                b < segment.first_bin(s.adapter) for s, b in zip(items, assignment, strict=True)
            ):
                continue
            for s, b in zip(items, assignment, strict=True):
                bins[b].append(s)
            if all(load_of(b, segment.tile_height) <= segment.capacity for b in bins):
                return n
    raise AssertionError("no packing found")


@st.composite
def segments(draw):
    tile = draw(st.sampled_from([1, 8]))
    capacity = draw(st.integers(4 * tile, 64))
    limit = capacity // tile * tile
    n = draw(st.integers(1, 6))
    items = tuple(Sample(draw(st.integers(0, 1)), i, draw(st.integers(1, limit))) for i in range(n))
    carry_tokens = draw(st.integers(0, limit // 2))
    carry = (Sample(2, 0, carry_tokens),) if carry_tokens else ()
    release = {a: draw(st.integers(0, 2)) for a in (0, 1)}
    return Segment(items, carry, release, capacity, tile)


def test_solver_is_available():
    assert available_solver() in ("HiGHS", "PULP_CBC_CMD")


@settings(max_examples=25, deadline=None)
@given(segments())
def test_milp_matches_brute_force_bin_count(segment):
    greedy = pack_ffd(segment)
    outcome = pack_milp(segment, greedy, time_limit_s=2.0)
    validate_bins(segment, outcome.bins)
    best = _brute_force_bins(segment)
    assert len(outcome.bins) <= len(greedy)
    assert len(outcome.bins) >= best
    # Segments this small always get the exact stage-1 solve.
    assert len(segment.items) <= EXACT_ITEMS
    assert not outcome.time_limit_hit
    assert len(outcome.bins) == best


def test_milp_improves_a_bad_greedy_packing():
    # FFD: 6+5 | 4+3+2+2 | 2 (3 bins); optimum: 6+4+2 | 5+3+2+2 (2 bins, no slack).
    items = tuple(Sample(0, i, t) for i, t in enumerate([6, 5, 4, 3, 2, 2, 2]))
    segment = Segment(items, (), {}, capacity=12, tile_height=1)
    greedy = pack_ffd(segment)
    outcome = pack_milp(segment, greedy, time_limit_s=2.0)
    validate_bins(segment, outcome.bins)
    assert len(outcome.bins) == _brute_force_bins(segment) == 2
    assert len(greedy) >= len(outcome.bins)


def test_milp_empties_an_underfilled_tail():
    # FFD: 15+14 | 12+10+8 | 6+5 (tail 11); best: 15+12+5 | 14+10+8 | 6 (tail 6).
    items = tuple(Sample(0, i, t) for i, t in enumerate([6, 12, 15, 8, 10, 5, 14]))
    segment = Segment(items, (), {}, capacity=32, tile_height=1)
    greedy = pack_ffd(segment)
    outcome = pack_milp(segment, greedy, time_limit_s=2.0)
    validate_bins(segment, outcome.bins)
    assert len(outcome.bins) == len(greedy) == 3
    assert load_of(greedy[-1], 1) == 11
    assert load_of(outcome.bins[-1], 1) <= 6 + tail_tolerance(segment)
