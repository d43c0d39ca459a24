"""What to do with samples longer than one microbatch: truncate them, or reject the run.

A sample must fit a microbatch alone once padded to the tile height, so the longest allowed
sample is ``capacity // tile_height * tile_height`` tokens (`PlanProblem.max_sample_tokens`).
Apply the policy to the lengths before building the `PlanProblem`; the data layer truncates
the token ids the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["LengthPolicyResult", "apply_length_policy", "max_sample_tokens"]

logger = logging.getLogger(__name__)


def max_sample_tokens(capacity: int, tile_height: int) -> int:
    """Longest sample (tokens) that fits a microbatch of ``capacity`` once tile-padded."""
    if tile_height < 1 or capacity < tile_height:
        raise ValueError(
            f"capacity must be >= tile_height >= 1, got capacity {capacity}, "
            f"tile_height {tile_height}"
        )
    return capacity // tile_height * tile_height


@dataclass(frozen=True)
class LengthPolicyResult:
    """Lengths after the policy.

    Attributes:
        lengths: per adapter, sample lengths in training order, each at most the limit.
        truncated: per adapter, how many samples were cut to the limit.
        limit: the longest allowed sample, in tokens.
    """

    lengths: tuple[tuple[int, ...], ...]
    truncated: tuple[int, ...]
    limit: int


def apply_length_policy(
    lengths: Sequence[Sequence[int]],
    capacity: int,
    tile_height: int,
    policy: Literal["truncate", "reject"] = "truncate",
) -> LengthPolicyResult:
    """Cut or refuse samples longer than a microbatch.

    Args:
        lengths: per adapter, token length of each sample in training order.
        capacity: tokens per microbatch, tile padding included.
        tile_height: the kernels' tile height in tokens.
        policy: ``"truncate"`` cuts long samples to the limit (and logs how many per
            adapter at WARNING); ``"reject"`` raises on the first one.

    Returns:
        The new lengths and per-adapter truncation counts.

    Raises:
        ValueError: under ``"reject"``, naming the adapter and sample; or on a bad policy.
    """
    if policy not in ("truncate", "reject"):
        raise ValueError(f"policy must be 'truncate' or 'reject', got {policy!r}")
    limit = max_sample_tokens(capacity, tile_height)
    out, counts = [], []
    for a, adapter_lengths in enumerate(lengths):
        cut = 0
        new = []
        for i, t in enumerate(adapter_lengths):
            if t > limit:
                if policy == "reject":
                    raise ValueError(
                        f"adapter {a} sample {i} has {t} tokens, more than the {limit} that fit "
                        f"one microbatch (capacity {capacity}, tile height {tile_height}); "
                        "use the 'truncate' policy or raise the capacity"
                    )
                cut += 1
                t = limit
            new.append(int(t))
        out.append(tuple(new))
        counts.append(cut)
    if any(counts):
        logger.warning(
            "truncated %d samples to %d tokens (per adapter: %s)", sum(counts), limit, counts
        )
    return LengthPolicyResult(tuple(out), tuple(counts), limit)
