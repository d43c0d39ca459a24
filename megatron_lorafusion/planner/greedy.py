"""Greedy first-fit-decreasing packing of a segment: the MILP's fallback and floor.

`pack_ffd` places a segment's samples largest first into the first bin (at or after the
adapter's release bin) with room, padding each adapter's part of a bin to the tile height,
and then moves the emptiest movable bin to the end so it can merge with the next group.
"""

from __future__ import annotations

from megatron_lorafusion.planner._segment import Segment, padded
from megatron_lorafusion.planner.types import Sample

__all__ = ["pack_ffd"]


class _Bin:
    """A bin with its per-adapter token counts, so adding a sample is O(1)."""

    __slots__ = ("load", "members", "per_adapter")

    def __init__(self, samples: tuple[Sample, ...], tile_height: int) -> None:
        self.members: list[Sample] = list(samples)
        self.per_adapter: dict[int, int] = {}
        for s in samples:
            self.per_adapter[s.adapter] = self.per_adapter.get(s.adapter, 0) + s.tokens
        self.load = sum(padded(n, tile_height) for n in self.per_adapter.values())

    def load_with(self, s: Sample, tile_height: int) -> int:
        cur = self.per_adapter.get(s.adapter, 0)
        return self.load - padded(cur, tile_height) + padded(cur + s.tokens, tile_height)

    def add(self, s: Sample, new_load: int) -> None:
        self.members.append(s)
        self.per_adapter[s.adapter] = self.per_adapter.get(s.adapter, 0) + s.tokens
        self.load = new_load


def pack_ffd(segment: Segment) -> list[list[Sample]]:
    """First-fit-decreasing with release bins and a carried bin 0.

    Args:
        segment: the samples, the carry already in bin 0, and the release bins.

    Returns:
        Bins in plan order; bin 0 holds the carry (if any); empty bins are idle microbatches
        forced by a release constraint; the last bin is the emptiest one that could move.
    """
    cap, tile = segment.capacity, segment.tile_height
    bins = [_Bin(segment.carry, tile)] if segment.carry else []
    for s in sorted(segment.items, key=lambda s: (-s.tokens, s.adapter, s.index)):
        first = segment.first_bin(s.adapter)
        for b in range(first, len(bins)):
            new_load = bins[b].load_with(s, tile)
            if new_load <= cap:
                bins[b].add(s, new_load)
                break
        else:
            while len(bins) < first:
                bins.append(_Bin((), tile))  # idle: nothing may run here yet
            fresh = _Bin((), tile)
            fresh.add(s, padded(s.tokens, tile))
            bins.append(fresh)
    # Only bins at or after every release bin can move without breaking a release.
    movable = max([1] + [segment.first_bin(s.adapter) for s in segment.items])
    if len(bins) - 1 > movable:
        emptiest = min(range(movable, len(bins)), key=lambda b: (bins[b].load, -b))
        bins.append(bins.pop(emptiest))
    return [b.members for b in bins]
