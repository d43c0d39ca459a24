"""A segment: one group's global batches of one round, packed into consecutive microbatches.

Shared by the greedy and the MILP packer. Bin ``b`` of a segment lands at plan position
``start + b``; bin 0 may already hold the previous segment's under-filled tail (the carry,
which is how tails merge into the next group's head), and ``release[a]`` is the first bin
adapter ``a`` may use so the bubble lemma holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lorafusion.planner.types import Sample


def padded(tokens: int, tile_height: int) -> int:
    """``tokens`` rounded up to a multiple of ``tile_height``."""
    return -(-tokens // tile_height) * tile_height


@dataclass(frozen=True)
class Segment:
    """What one packer call places.

    Attributes:
        items: samples to place (one or more adapters, one global batch each).
        carry: samples already in bin 0 (another group's tail); may be empty.
        release: adapter -> first bin index it may use (bubble lemma); missing means 0.
        capacity: tokens per microbatch, tile padding included.
        tile_height: tile height in tokens.
    """

    items: tuple[Sample, ...]
    carry: tuple[Sample, ...]
    release: dict[int, int]
    capacity: int
    tile_height: int

    def first_bin(self, adapter: int) -> int:
        """First bin ``adapter`` may use."""
        return self.release.get(adapter, 0)

    def carry_load(self) -> int:
        """Padded tokens of the carry in bin 0."""
        return load_of(self.carry, self.tile_height)

    def lower_bound(self) -> int:
        """A lower bound on the bins any packing of this segment needs, release bins included.

        Each adapter occupies at least its tokens padded once; the adapters released at bin
        ``t`` or later all sit in bins ``>= t``, so for every release ``t`` the segment needs
        ``t + ceil(their padded tokens / capacity)`` bins (``t = 0`` counts the carry too).
        """
        per_adapter: dict[int, int] = {}
        for s in self.items:
            per_adapter[s.adapter] = per_adapter.get(s.adapter, 0) + s.tokens
        load = {a: padded(n, self.tile_height) for a, n in per_adapter.items()}
        bound = max(1, -(-(self.carry_load() + sum(load.values())) // self.capacity))
        for t in {self.first_bin(a) for a in load} - {0}:
            later = sum(n for a, n in load.items() if self.first_bin(a) >= t)
            bound = max(bound, t + -(-later // self.capacity))
        return bound

    def min_total(self) -> int:
        """Fewest padded tokens the segment can occupy (each adapter padded once)."""
        per_adapter: dict[int, int] = {}
        for s in self.items:
            per_adapter[s.adapter] = per_adapter.get(s.adapter, 0) + s.tokens
        return self.carry_load() + sum(padded(n, self.tile_height) for n in per_adapter.values())


def drop_spare_idles(segment: Segment, bins: list[list[Sample]]) -> list[list[Sample]]:
    """Remove empty bins that no release constraint needs (they would be wasted slots).

    Bins at or after every adapter's release bin can shift one earlier without breaking a
    release, so an empty one there is dropped; empty bins before it are the idle
    microbatches the bubble lemma needs.
    """
    needed = max(
        [1 if segment.carry else 0] + [segment.first_bin(s.adapter) for s in segment.items]
    )
    kept = bins[:needed] + [b for b in bins[needed:] if b]
    return kept or [[]]


def load_of(samples: tuple[Sample, ...] | list[Sample], tile_height: int) -> int:
    """Padded tokens of ``samples`` placed in one microbatch."""
    per_adapter: dict[int, int] = {}
    for s in samples:
        per_adapter[s.adapter] = per_adapter.get(s.adapter, 0) + s.tokens
    return sum(padded(n, tile_height) for n in per_adapter.values())


def score(bins: list[list[Sample]], tile_height: int) -> tuple[int, int]:
    """What the packers minimise, lexicographically: (bins, padded load of the last bin)."""
    return len(bins), load_of(bins[-1], tile_height)
