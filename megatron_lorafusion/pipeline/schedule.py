"""The multi-adapter 1F1B schedule without flush, as pure tables (no torch, no Megatron).

Stage ``s`` of ``S`` runs ``S - s - 1`` warm-up forwards, then one forward and one backward
in turn, then the cool-down backwards once the stream ends (Narayanan et al., SC'21, §2.2),
over the whole stream of plan microbatches with no flush between global batches
(LoRAFusion, arXiv 2510.00206, §4). After the backward of a microbatch that finishes
adapter ``a``'s global batch, the stage steps ``a``'s optimizer (an ``"O"`` action). Idle
plan microbatches keep their slot (they delay later forwards, which is what the bubble lemma
asks of them) and compute nothing.

The bubble lemma is checked on the table itself: a forward that reads adapter ``a`` must
come after the optimizer step of ``a``'s previous global batch on its stage; `check_lemma`
refuses any stream where it would not.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from megatron_lorafusion.planner import Microbatch, Plan, Sample

__all__ = [
    "Action",
    "LemmaError",
    "check_lemma",
    "checked",
    "data_parallel_share",
    "lemma_checked",
    "schedule",
    "stage_actions",
]


@dataclass(frozen=True)
class Action:
    """One operation of one stage.

    Attributes:
        stage: pipeline stage ``s`` in ``[0, S)``.
        microbatch: position of the microbatch in the plan stream.
        kind: ``"F"`` forward, ``"B"`` backward, ``"O"`` optimizer steps.
        adapters: adapters with samples in the microbatch (empty: an idle microbatch).
        finishes: adapters whose global batch the microbatch finishes; an ``"O"`` action
            steps exactly these.
    """

    stage: int
    microbatch: int
    kind: str
    adapters: tuple[int, ...] = ()
    finishes: tuple[int, ...] = ()


class LemmaError(ValueError):
    """A stream would start an adapter's next global batch before its optimizer step."""


def stage_actions(
    stage: int, num_stages: int, microbatches: Iterable[Microbatch]
) -> Iterator[Action]:
    """The 1F1B actions of one stage over a (possibly endless) stream of microbatches.

    Lazy: the action list for microbatch ``k`` is produced once ``k`` arrives, so the runner
    can execute a stream the background planner is still producing.

    Args:
        stage: this stage, in ``[0, num_stages)``.
        num_stages: ``S`` >= 1.
        microbatches: the plan's microbatches in order (idle ones included).

    Yields:
        ``F``/``B``/``O`` actions in execution order.

    Raises:
        ValueError: on a stage outside ``[0, S)``.
    """
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"stage must lie in [0, {num_stages}), got {stage}")
    warmup = num_stages - stage - 1
    pending: list[tuple[int, Microbatch]] = []  # forwarded, not yet backwarded (FIFO)

    def backward() -> Iterator[Action]:
        k, mb = pending.pop(0)
        yield Action(stage, k, "B", mb.adapters, tuple(mb.finishes))
        if mb.finishes:
            yield Action(stage, k, "O", mb.adapters, tuple(mb.finishes))

    for k, mb in enumerate(microbatches):
        yield Action(stage, k, "F", mb.adapters, tuple(mb.finishes))
        pending.append((k, mb))
        if len(pending) > warmup:
            yield from backward()
    while pending:
        yield from backward()


def schedule(num_stages: int, plan: Plan | Sequence[Microbatch]) -> list[Action]:
    """The whole table: every stage's actions, stage 0 first, each in execution order.

    Args:
        num_stages: ``S`` >= 1.
        plan: a `Plan` or its microbatches.

    Returns:
        Actions of stage 0, then stage 1, ...; within a stage, in execution order.

    Raises:
        LemmaError: when the stream breaks the bubble lemma (see `check_lemma`).
    """
    microbatches = plan.microbatches if isinstance(plan, Plan) else tuple(plan)
    table = [a for s in range(num_stages) for a in stage_actions(s, num_stages, microbatches)]
    check_lemma(table, num_stages)
    return table


def check_lemma(actions: Iterable[Action], num_stages: int) -> None:
    """Raise unless every forward reading adapter ``a`` follows ``a``'s previous step.

    On each stage, once the forward of the microbatch finishing ``a``'s global batch ``j``
    has run, no other forward may read ``a`` before that stage's ``"O"`` action for it: the
    forward would see weights from before step ``j`` (a wrong result, or a deadlock in a
    runner that waits for the step). Stage 0 is the strictest (``S - 1`` warm-up forwards),
    hence the lemma's ``S - 1`` microbatches between consecutive batches.

    Args:
        actions: actions of one or more stages, each stage's in execution order.
        num_stages: ``S``, for the message.

    Raises:
        LemmaError: naming the adapter, both microbatches, the stage and the gap found.
    """
    checker = _LemmaChecker(num_stages)
    for action in actions:
        checker.see(action)


def checked(actions: Iterable[Action], num_stages: int) -> Iterator[Action]:
    """Pass ``actions`` through, raising `LemmaError` before yielding a violating forward."""
    checker = _LemmaChecker(num_stages)
    for action in actions:
        checker.see(action)
        yield action


class _LemmaChecker:
    """Streaming form of `check_lemma` (per stage: adapter -> unstepped finishing mb)."""

    def __init__(self, num_stages: int) -> None:
        self._num_stages = num_stages
        self._unstepped: dict[tuple[int, int], int] = {}  # (stage, adapter) -> microbatch

    def see(self, action: Action) -> None:
        s, k = action.stage, action.microbatch
        if action.kind == "O":
            for a in action.finishes:
                self._unstepped.pop((s, a), None)
            return
        if action.kind != "F":
            return
        for a in action.adapters:
            f = self._unstepped.get((s, a))
            if f is not None and f != k:
                raise LemmaError(_lemma_message(a, k, s, f, self._num_stages))
        for a in action.finishes:
            self._unstepped[s, a] = k


def lemma_checked(microbatches: Iterable[Microbatch], num_stages: int) -> Iterator[Microbatch]:
    """Pass the stream through, raising `LemmaError` before a microbatch that breaks the lemma.

    Stage 0's table in closed form (the strictest stage): its forward of microbatch ``p``
    follows its step after the backward of ``p - S`` and precedes the backward of
    ``p - S + 1``, so adapter ``a`` may reappear at ``p`` after finishing a global batch at
    ``f`` only if ``p - f >= S``. Every rank runs this on the same stream and so refuses a
    plan at the same microbatch, before any rank computes with stale weights. It checks
    ``S + 1`` microbatches ahead of what it yields (stages run up to ``S - 1`` microbatches
    apart, and a stage's table peeks one ahead), so no rank is left waiting for an
    activation or gradient of a microbatch that a rank which already refused never sends.

    Raises:
        LemmaError: exactly when `check_lemma` would on the stage-0 table.
    """
    last_finish: dict[int, int] = {}
    ahead: collections.deque[Microbatch] = collections.deque()
    for p, mb in enumerate(microbatches):
        for a in mb.adapters:
            f = last_finish.get(a)
            if f is not None and p - f < num_stages:
                raise LemmaError(_lemma_message(a, p, 0, f, num_stages))
        for a in mb.finishes:
            last_finish[a] = p
        ahead.append(mb)
        if len(ahead) > num_stages + 1:
            yield ahead.popleft()
    yield from ahead


def _lemma_message(adapter: int, k: int, stage: int, f: int, num_stages: int) -> str:
    return (
        f"bubble lemma broken: adapter {adapter}'s microbatch {k} would start its forward on "
        f"stage {stage} before the optimizer step of the global batch finished by microbatch "
        f"{f}; with {num_stages} stages a 1F1B pipeline needs at least {num_stages - 1} "
        f"(S - 1) microbatches between them, found {k - f - 1}. Re-plan with "
        f"num_stages={num_stages} (the planner then interleaves other adapters or inserts "
        "idle microbatches)"
    )


def data_parallel_share(microbatch: Microbatch, dp_rank: int, dp_size: int) -> Microbatch:
    """The samples of ``microbatch`` that data-parallel rank ``dp_rank`` computes.

    Every DP replica runs the same microbatch stream, each on a disjoint subset of its
    samples, so every replica reaches each optimizer step at the same action and the
    gradient all-reduce is a plain sum (loss denominators count the whole global batch).
    Samples go longest first to the replica with the fewest tokens so far (ties: lowest
    rank), then each share keeps the plan's adapter-major order. A share may be empty (an
    idle microbatch for that replica); ``finishes`` is kept on every share.

    Args:
        microbatch: the plan's microbatch.
        dp_rank: this replica, in ``[0, dp_size)``.
        dp_size: data-parallel size >= 1.

    Returns:
        A `Microbatch` with this replica's samples (sorted as in the plan) and the same
        ``finishes``.

    Raises:
        ValueError: on a rank outside ``[0, dp_size)``.
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must lie in [0, {dp_size}), got {dp_rank}")
    if dp_size == 1:
        return microbatch
    load = [0] * dp_size
    owner: dict[int, int] = {}
    by_length = sorted(
        range(len(microbatch.samples)), key=lambda i: (-microbatch.samples[i].tokens, i)
    )
    for i in by_length:
        r = min(range(dp_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += microbatch.samples[i].tokens
    mine: tuple[Sample, ...] = tuple(
        s for i, s in enumerate(microbatch.samples) if owner[i] == dp_rank
    )
    return Microbatch(mine, microbatch.finishes)
