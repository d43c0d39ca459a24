"""Plain data types of the planner: what it is asked (`PlanProblem`) and what it answers (`Plan`).

Pure Python, no torch and no Megatron: `data` turns a `Plan` into tensors, `pipeline` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    def is_idle(self) -> bool:
        """True for a no-op microbatch (no samples) kept only to honour the bubble lemma."""
        return not self.samples

    @property
    def adapters(self) -> tuple[int, ...]:
        """Adapters with samples in this microbatch, ascending."""
        return tuple(sorted({s.adapter for s in self.samples}))

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
        batch_offsets: per adapter, samples of its current global batch already trained
            before ``lengths[a][0]`` (``0 <= offset < gbs``): its first global batch here holds
            only the remaining ``gbs - offset`` samples. Empty: all 0. A run that re-plans its
            remaining samples (an adapter joined or left) mid-batch sets it.
    """

    lengths: tuple[tuple[int, ...], ...]
    global_batch_sizes: tuple[int, ...]
    capacity: int
    num_stages: int = 1
    tile_height: int = 1
    seed: int = 0
    batch_offsets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Accept lists from callers; store tuples so the problem is hashable and picklable.
        object.__setattr__(self, "lengths", tuple(tuple(int(t) for t in a) for a in self.lengths))
        gbs = tuple(int(g) for g in self.global_batch_sizes)
        object.__setattr__(self, "global_batch_sizes", gbs)
        object.__setattr__(self, "batch_offsets", tuple(int(o) for o in self.batch_offsets))
        errors = _problem_errors(self)
        if errors:
            raise ValueError("invalid PlanProblem: " + "; ".join(errors))

    @property
    def max_sample_tokens(self) -> int:
        """Longest sample that fits a microbatch on its own once padded to the tile height."""
        return self.capacity // self.tile_height * self.tile_height

    @property
    def num_adapters(self) -> int:
        """``A``, adapters in the run."""
        return len(self.lengths)

    def batch_offset(self, adapter: int) -> int:
        """Samples of ``adapter``'s first global batch trained before this problem."""
        return self.batch_offsets[adapter] if self.batch_offsets else 0

    def batch_of(self, adapter: int, index: int) -> int:
        """Global batch of sample ``index`` of ``adapter``."""
        return (index + self.batch_offset(adapter)) // self.global_batch_sizes[adapter]

    def num_global_batches(self, adapter: int) -> int:
        """Optimizer steps of ``adapter`` (the first and last global batch may be short)."""
        gbs = self.global_batch_sizes[adapter]
        return -(-(len(self.lengths[adapter]) + self.batch_offset(adapter)) // gbs)

    def global_batch(self, adapter: int, step: int) -> list[Sample]:
        """Samples of global batch ``step`` of ``adapter``."""
        gbs, offset = self.global_batch_sizes[adapter], self.batch_offset(adapter)
        start = max(step * gbs - offset, 0)
        stop = min((step + 1) * gbs - offset, len(self.lengths[adapter]))
        return [Sample(adapter, i, self.lengths[adapter][i]) for i in range(start, stop)]


def _problem_errors(p: PlanProblem) -> list[str]:
    """Every rule a `PlanProblem` breaks, as ``"<field> must be <rule>, got <value>"``."""
    errors: list[str] = []
    if p.tile_height < 1:
        errors.append(f"tile_height must be >= 1, got {p.tile_height}")
    if p.capacity < max(p.tile_height, 1):
        errors.append(f"capacity must be >= tile_height ({p.tile_height}) tokens, got {p.capacity}")
    if p.num_stages < 1:
        errors.append(f"num_stages must be >= 1, got {p.num_stages}")
    if not p.lengths:
        errors.append("lengths must list at least one adapter, got none")
    if len(p.global_batch_sizes) != len(p.lengths):
        errors.append(
            f"global_batch_sizes must have one entry per adapter ({len(p.lengths)}), "
            f"got {len(p.global_batch_sizes)}"
        )
    for a, gbs in enumerate(p.global_batch_sizes):
        if gbs < 1:
            errors.append(f"global_batch_sizes[{a}] must be >= 1, got {gbs}")
    if p.batch_offsets and len(p.batch_offsets) != len(p.lengths):
        errors.append(
            f"batch_offsets must be empty or have one entry per adapter ({len(p.lengths)}), "
            f"got {len(p.batch_offsets)}"
        )
    for a, (offset, gbs) in enumerate(zip(p.batch_offsets, p.global_batch_sizes, strict=False)):
        if not 0 <= offset < max(gbs, 1):
            errors.append(f"batch_offsets[{a}] must lie in [0, {gbs}), got {offset}")
    limit = p.max_sample_tokens if p.tile_height >= 1 and p.capacity >= p.tile_height else None
    for a, lengths in enumerate(p.lengths):
        if not lengths:
            errors.append(f"adapter {a} must have at least one sample, got none")
        for i, t in enumerate(lengths):
            if t < 1:
                errors.append(f"adapter {a} sample {i} must have >= 1 token, got {t}")
                break
            if limit is not None and t > limit:
                errors.append(
                    f"adapter {a} sample {i} must fit one microbatch ({limit} tokens once "
                    f"padded to tile height {p.tile_height}), got {t} tokens; truncate or "
                    "drop it first (see planner.apply_length_policy)"
                )
                break
    return errors


@dataclass(frozen=True)
class SolveReport:
    """How a plan was found, for logs and benchmarks.

    Attributes:
        solver: ``"milp"`` or ``"greedy"``, as asked.
        chosen: which stream was kept: ``"milp"``, the ``"greedy"`` floor, or a stream of
            one-adapter microbatches that simulated faster (``"round_robin"``,
            ``"round_robin_padded"``, ``"megatron"``; `plan.CANDIDATES`).
        segments: packed segments (one group's global batches of one round).
        milp_solves: PuLP solves run (segments where greedy missed the lower bound).
        milp_improved: segments where the MILP beat first-fit-decreasing.
        time_limit_hits: MILP solves that reached the wall-clock safety limit and kept the
            greedy bins (only these can make a plan vary run to run).
        bins_over_bound: microbatches above the per-segment lower bound, summed (0 = optimal).
        microbatches: microbatches in the plan, idle ones included.
        greedy_microbatches: microbatches of the greedy stream on the same problem.
        idle_microbatches: no-op microbatches inserted for the bubble lemma.
        wall_s: planning wall-clock time in seconds.
        max_solve_s: longest single MILP solve in seconds, model building included.
    """

    solver: str
    chosen: str
    segments: int
    milp_solves: int
    milp_improved: int
    time_limit_hits: int
    bins_over_bound: int
    microbatches: int
    greedy_microbatches: int
    idle_microbatches: int
    wall_s: float
    max_solve_s: float = 0.0


@dataclass(frozen=True)
class Plan:
    """An ordered stream of microbatches for all adapters of a run.

    Attributes:
        microbatches: in execution order.
        capacity: the token capacity the plan was made for.
        tile_height: the tile height padding was counted with.
        num_adapters: ``A``.
        report: how the plan was found (ignored by ``==``: it holds timings).
    """

    microbatches: tuple[Microbatch, ...]
    capacity: int
    tile_height: int
    num_adapters: int
    report: SolveReport | None = field(default=None, compare=False)
