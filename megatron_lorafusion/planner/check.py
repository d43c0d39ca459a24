"""The plan verifier: capacity, every sample exactly once, the bubble lemma, step markers.

`check_plan` is what tests and the training loop call before running a plan; `PlanVerifier`
checks a plan that arrives in chunks (the background planner) with the same rules.
The bubble lemma (DESIGN.md, LoRAFusion §4): with 1F1B on ``S`` stages, stage 0 runs the
forward of microbatch ``m + S`` only after the backward of ``m``, so a microbatch of adapter
``a``'s global batch ``j + 1`` may sit at position ``p`` only if ``p >= f + S``, where ``f`` is
the position of the microbatch that finishes batch ``j``.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_lorafusion.planner.types import Microbatch, Plan, PlanProblem

__all__ = ["PlanError", "PlanVerifier", "check_plan"]


class PlanError(ValueError):
    """A plan breaks an invariant; the message names the microbatch, adapter and sample."""


class PlanVerifier:
    """Incremental checker: feed microbatches in order, then call `finish`.

    Args:
        problem: the problem the plan claims to solve.
    """

    def __init__(self, problem: PlanProblem) -> None:
        self._problem = problem
        self._position = 0
        n = problem.num_adapters
        self._batch = [-1] * n  # global batch in progress per adapter (-1: none yet)
        self._seen_in_batch = [0] * n
        self._finish_pos = [-(10**18)] * n  # position of the last finished batch
        self._finished = [True] * n  # the batch in ``_batch`` got its marker
        self._seen: set[tuple[int, int]] = set()

    def _batch_size(self, adapter: int, batch: int) -> int:
        p = self._problem
        gbs = p.global_batch_sizes[adapter]
        return min(gbs, len(p.lengths[adapter]) - batch * gbs)

    def feed(self, microbatches: Iterable[Microbatch]) -> None:
        """Check the next microbatches of the plan.

        Raises:
            PlanError: on the first broken invariant.
        """
        for mb in microbatches:
            self._check_one(mb)
            self._position += 1

    def _check_one(self, mb: Microbatch) -> None:
        p, pos = self._problem, self._position
        where = f"microbatch {pos}"
        keys = [(s.adapter, s.index) for s in mb.samples]
        if keys != sorted(keys):
            raise PlanError(f"{where}: samples must be sorted adapter-major, got {keys[:8]}")
        padded = mb.padded_tokens(p.tile_height)
        if padded > p.capacity:
            raise PlanError(f"{where}: {padded} padded tokens exceed the capacity {p.capacity}")
        batches: dict[int, int] = {}
        for s in mb.samples:
            self._check_sample(where, s.adapter, s.index, s.tokens)
            batch = s.index // p.global_batch_sizes[s.adapter]
            if batches.setdefault(s.adapter, batch) != batch:
                raise PlanError(
                    f"{where}: adapter {s.adapter} mixes global batches {batches[s.adapter]} "
                    f"and {batch}"
                )
        for a, batch in sorted(batches.items()):
            self._enter_batch(where, a, batch)
        for s in mb.samples:
            self._seen_in_batch[s.adapter] += 1
        completes = {
            a for a in batches if self._seen_in_batch[a] == self._batch_size(a, self._batch[a])
        }
        if set(mb.finishes) != completes or len(mb.finishes) != len(set(mb.finishes)):
            raise PlanError(
                f"{where}: finishes must be {sorted(completes)} (adapters whose global batch "
                f"completes here), got {list(mb.finishes)}"
            )
        for a in completes:
            self._finished[a] = True
            self._finish_pos[a] = pos

    def _check_sample(self, where: str, adapter: int, index: int, tokens: int) -> None:
        p = self._problem
        if not 0 <= adapter < p.num_adapters:
            raise PlanError(f"{where}: adapter id {adapter} not in [0, {p.num_adapters})")
        if not 0 <= index < len(p.lengths[adapter]):
            raise PlanError(f"{where}: adapter {adapter} has no sample {index}")
        if tokens != p.lengths[adapter][index]:
            raise PlanError(
                f"{where}: adapter {adapter} sample {index} has {tokens} tokens, the problem "
                f"says {p.lengths[adapter][index]}"
            )
        if (adapter, index) in self._seen:
            raise PlanError(f"{where}: adapter {adapter} sample {index} appears twice")
        self._seen.add((adapter, index))

    def _enter_batch(self, where: str, a: int, batch: int) -> None:
        if batch == self._batch[a]:
            if self._finished[a]:
                raise PlanError(
                    f"{where}: adapter {a} global batch {batch} continues after its optimizer step"
                )
            return
        if batch != self._batch[a] + 1:
            raise PlanError(
                f"{where}: adapter {a} starts global batch {batch}, but batch "
                f"{self._batch[a] + 1} comes first"
            )
        if not self._finished[a]:
            raise PlanError(
                f"{where}: adapter {a} starts global batch {batch} before batch "
                f"{self._batch[a]} finished"
            )
        gap = self._position - self._finish_pos[a]
        if gap < self._problem.num_stages:
            raise PlanError(
                f"{where}: adapter {a} starts global batch {batch} only {gap - 1} microbatches "
                f"after batch {batch - 1} finished; the bubble lemma needs "
                f"{self._problem.num_stages - 1} (S - 1) in between"
            )
        self._batch[a], self._seen_in_batch[a], self._finished[a] = batch, 0, False

    def finish(self) -> None:
        """Check that every sample was placed.

        Raises:
            PlanError: if a sample is missing.
        """
        p = self._problem
        for a, lengths in enumerate(p.lengths):
            for i in range(len(lengths)):
                if (a, i) not in self._seen:
                    raise PlanError(f"adapter {a} sample {i} is missing from the plan")


def check_plan(plan: Plan, problem: PlanProblem) -> None:
    """Raise unless ``plan`` is a valid schedule of ``problem``.

    Checks: plan metadata matches the problem; each microbatch is sorted adapter-major and
    fits the capacity with tile padding; every sample appears exactly once with its true
    length; each adapter's global batches come in order, never two in one microbatch;
    ``finishes`` marks exactly the microbatch that completes each global batch; and the
    bubble lemma (``S - 1`` microbatches between consecutive global batches of an adapter).

    Raises:
        PlanError: (a ValueError) naming the first broken invariant.
    """
    if (plan.capacity, plan.tile_height, plan.num_adapters) != (
        problem.capacity,
        problem.tile_height,
        problem.num_adapters,
    ):
        raise PlanError(
            "plan was made for (capacity, tile_height, adapters) = "
            f"{(plan.capacity, plan.tile_height, plan.num_adapters)}, problem has "
            f"{(problem.capacity, problem.tile_height, problem.num_adapters)}"
        )
    verifier = PlanVerifier(problem)
    verifier.feed(plan.microbatches)
    verifier.finish()
