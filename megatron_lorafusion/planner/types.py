"""Plain data types of the planner: what it is asked (`PlanProblem`) and what it answers (`Plan`).

Pure Python, no torch and no Megatron: `data` turns a `Plan` into tensors, `pipeline` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """One training sample of one adapter.

    Attributes:
        adapter: dense adapter id in ``[0, A)``.
        index: position in the adapter's training order (epochs concatenated, shuffled);
            the adapter's global batch ``j`` holds indices ``[j·gbs, (j+1)·gbs)``.
        tokens: token count of the sample after truncation.
    """

    adapter: int
    index: int
    tokens: int


@dataclass(frozen=True)
class Microbatch:
    """Samples run together in one forward/backward, ordered adapter-major.

    Attributes:
        samples: the samples, sorted by adapter (an empty tuple is an idle microbatch).
        finishes: adapters whose current global batch ends with this microbatch; their
            optimizers step once its backward is done.
    """

    samples: tuple[Sample, ...]
    finishes: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        """Tokens in the microbatch, without tile padding."""
        return sum(s.tokens for s in self.samples)

    def padded_tokens(self, tile_height: int) -> int:
        """Tokens once each adapter's segment is padded to a multiple of ``tile_height``."""
        per_adapter: dict[int, int] = {}
        for s in self.samples:
            per_adapter[s.adapter] = per_adapter.get(s.adapter, 0) + s.tokens
        return sum(-(-n // tile_height) * tile_height for n in per_adapter.values())


@dataclass(frozen=True)
class PlanProblem:
    """What the planner packs.

    Attributes:
        lengths: per adapter, the token length of each sample in training order.
        global_batch_sizes: per adapter, samples per optimizer step.
        capacity: token capacity of one microbatch, tile padding included.
        num_stages: pipeline stages ``S`` (the bubble lemma needs ``S - 1`` microbatches
            of other work between consecutive global batches of one adapter).
        tile_height: kernel tile height in tokens; each adapter segment is padded to it.
        seed: seed for any randomised choice, so plans are reproducible.
    """

    lengths: tuple[tuple[int, ...], ...]
    global_batch_sizes: tuple[int, ...]
    capacity: int
    num_stages: int = 1
    tile_height: int = 1
    seed: int = 0

    @property
    def num_adapters(self) -> int:
        """``A``, adapters in the run."""
        return len(self.lengths)

    def num_global_batches(self, adapter: int) -> int:
        """Optimizer steps of ``adapter`` (the last global batch may be short)."""
        gbs = self.global_batch_sizes[adapter]
        return -(-len(self.lengths[adapter]) // gbs)

    def global_batch(self, adapter: int, step: int) -> list[Sample]:
        """Samples of global batch ``step`` of ``adapter``."""
        gbs = self.global_batch_sizes[adapter]
        stop = min((step + 1) * gbs, len(self.lengths[adapter]))
        return [Sample(adapter, i, self.lengths[adapter][i]) for i in range(step * gbs, stop)]


@dataclass(frozen=True)
class Plan:
    """An ordered stream of microbatches for all adapters of a run.

    Attributes:
        microbatches: in execution order.
        capacity: the token capacity the plan was made for.
        tile_height: the tile height padding was counted with.
        num_adapters: ``A``.
    """

    microbatches: tuple[Microbatch, ...]
    capacity: int
    tile_height: int
    num_adapters: int
