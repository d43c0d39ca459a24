"""The multi-adapter 1F1B schedule without flush, as pure tables (no torch, no Megatron).

Stage ``s`` of ``S`` runs ``S - s - 1`` warm-up forwards, then one forward and one backward
in turn, then the cool-down backwards once the stream ends (Narayanan et al., SC'21, §2.2),
over the whole stream of plan microbatches with no flush between global batches
(LoRAFusion, arXiv 2510.00206, §4). After the backward of a microbatch that finishes
adapter ``a``'s global batch, the stage steps ``a``'s optimizer (an ``"O"`` action). Idle
plan microbatches keep their slot (they delay later forwards, which is what the bubble lemma
asks of them) and compute nothing.

A forward that reads adapter ``a`` must come after the optimizer step of ``a``'s previous
global batch on its stage (the bubble lemma): `lemma_checked` refuses a stream where it would
not, with the planner's one check of it (`planner.BubbleLemma`), far enough ahead that every
rank refuses before any waits on a peer.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from megatron_lorafusion.planner import BubbleLemma, LemmaError, Microbatch, Plan, Sample

__all__ = [
    "Action",
    "LemmaError",
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
        LemmaError: when the stream breaks the bubble lemma (see `lemma_checked`).
    """
    microbatches = plan.microbatches if isinstance(plan, Plan) else tuple(plan)
    microbatches = tuple(lemma_checked(microbatches, num_stages))
    return [a for s in range(num_stages) for a in stage_actions(s, num_stages, microbatches)]


def lemma_checked(microbatches: Iterable[Microbatch], num_stages: int) -> Iterator[Microbatch]:
    """Pass the stream through, raising `LemmaError` before a microbatch that breaks the lemma.

    The check is `planner.BubbleLemma`, stage 0's table in closed form (the strictest stage):
    its forward of microbatch ``p`` follows its step after the backward of ``p - S`` and
    precedes the backward of ``p - S + 1``, so adapter ``a`` may reappear at ``p`` after
    finishing a global batch at ``f`` only if ``p - f >= S``. Every rank runs this on the same
    stream and so refuses a plan at the same microbatch, before any rank computes with stale
    weights. It checks ``S + 1`` microbatches ahead of what it yields (stages run up to
    ``S - 1`` microbatches apart, and a stage's table peeks one ahead), so no rank is left
    waiting for an activation or gradient of a microbatch that a rank which already refused
    never sends.

    Raises:
        LemmaError: exactly when a forward on some stage's table would read an adapter
            before that stage's optimizer step of its previous global batch.
    """
    lemma = BubbleLemma(num_stages)
    ahead: collections.deque[Microbatch] = collections.deque()
    for p, mb in enumerate(microbatches):
        lemma.feed(p, mb)
        ahead.append(mb)
        if len(ahead) > num_stages + 1:
            yield ahead.popleft()
    yield from ahead


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
