"""The plan verifier: capacity, every sample exactly once, the bubble lemma, step markers.

`check_plan` is what tests and the planner call on a plan; `PlanVerifier` checks a plan that
arrives in chunks (the background planner) with the same rules. `BubbleLemma` is the one
check of the lemma: the verifier runs it, and so does the pipeline runner on every rank
(`pipeline.schedule.lemma_checked`).
The bubble lemma (DESIGN.md, LoRAFusion §4): with 1F1B on ``S`` stages, stage 0 runs the
forward of microbatch ``m + S`` only after the backward of ``m``, so a microbatch of adapter
``a``'s global batch ``j + 1`` may sit at position ``p`` only if ``p >= f + S``, where ``f`` is
the position of the microbatch that finishes batch ``j``. Stage 0 is the strictest stage
(``S - 1`` warm-up forwards): a stream that passes at stage 0 passes on every stage's table.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_lorafusion.planner.types import Microbatch, Plan, PlanProblem

__all__ = ["BubbleLemma", "LemmaError", "PlanError", "PlanVerifier", "check_plan"]


class PlanError(ValueError):
    """A plan breaks an invariant; the message names the microbatch, adapter and sample."""


class LemmaError(PlanError):
    """A stream would start an adapter's next global batch before its optimizer step."""


class BubbleLemma:
    """The bubble lemma on a stream of microbatches, fed in order.

    Args:
        num_stages: ``S`` >= 1 of the pipeline that will run the stream.
    """

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self._last_finish: dict[int, int] = {}  # adapter -> position finishing its last batch

    def feed(self, position: int, microbatch: Microbatch) -> None:
        """Check the microbatch at ``position`` (positions increase by one per call).

        Raises:
            LemmaError: naming the adapter, both microbatches and the gap found, when
                ``position - f < S`` for an adapter it reads whose last global batch was
                finished by the microbatch at ``f``.
        """
        S = self.num_stages
        for a in microbatch.adapters:
            f = self._last_finish.get(a)
            if f is not None and position - f < S:
                raise LemmaError(
                    f"bubble lemma broken: adapter {a}'s microbatch {position} would start its "
                    f"forward on stage 0 before the optimizer step of the global batch "
                    f"finished by microbatch {f}; with {S} stages the bubble lemma needs "
                    f"{S - 1} (S - 1) microbatches between them, found {position - f - 1}. "
                    f"Re-plan with num_stages={S} (the planner then interleaves other adapters "
                    "or inserts idle microbatches)"
                )
        for a in microbatch.finishes:
            self._last_finish[a] = position


class PlanVerifier:
    """Incremental checker: feed microbatches in order, then call `finish`.

    Args:
        problem: the problem the plan claims to solve.
        lemma: check the bubble lemma for ``problem.num_stages``; a training run passes
            False, since the pipeline runner checks it on every rank (`BubbleLemma`).
    """

    def __init__(self, problem: PlanProblem, *, lemma: bool = True) -> None:
        self._problem = problem
        self._position = 0
        n = problem.num_adapters
        self._batch = [-1] * n  # global batch in progress per adapter (-1: none yet)
        self._seen_in_batch = [0] * n
        self._lemma = BubbleLemma(problem.num_stages) if lemma else None
        self._finished = [True] * n  # the batch in ``_batch`` got its marker
        self._seen: set[tuple[int, int]] = set()

    def _batch_size(self, adapter: int, batch: int) -> int:
        return len(self._problem.global_batch(adapter, batch))

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
            batch = p.batch_of(s.adapter, s.index)
            if batches.setdefault(s.adapter, batch) != batch:
                raise PlanError(
                    f"{where}: adapter {s.adapter} mixes global batches {batches[s.adapter]} "
                    f"and {batch}"
                )
        for a, batch in sorted(batches.items()):
            self._enter_batch(where, a, batch)
        if self._lemma is not None:
            self._lemma.feed(pos, mb)
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
