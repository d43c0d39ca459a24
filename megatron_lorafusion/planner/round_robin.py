"""Round-robin streams: adapters take turns, one microbatch of one adapter's samples each.

The mLoRA-style baseline (`sim.baselines`) is such a stream, and the planner builds the same kind
of stream as a candidate for every plan; it wins where packing would need idle microbatches
(few adapters, small global batches): spreading each adapter's global batch over
microbatches of its own lets the other adapters fill the ``S - 1`` slots the bubble lemma
asks for, where packing leaves them idle. Each adapter's global batch is cut into pieces by
one of two rules, both within the token capacity: `padded_pieces` (mLoRA: up to ``k``
consecutive samples, every sample padded to the longest, at most ``capacity`` tokens) or
`packed_pieces` (first-fit-decreasing bins).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron_lorafusion.planner._segment import Segment, padded
from megatron_lorafusion.planner.greedy import pack_ffd
from megatron_lorafusion.planner.types import Microbatch, PlanProblem, Sample

__all__ = [
    "Pieces",
    "default_samples_per_microbatch",
    "one_at_a_time",
    "packed_pieces",
    "padded_pieces",
    "padded_tokens_of",
    "round_robin",
]

Pieces = Callable[[list[Sample]], list[list[Sample]]]
"""Cuts one global batch (samples in order) into the microbatches of a round-robin stream."""


def padded_tokens_of(samples: Sequence[Sample], tile_height: int) -> int:
    """Tokens of one adapter's samples padded to the longest, then to the tile height."""
    return padded(max(s.tokens for s in samples) * len(samples), tile_height)


def padded_pieces(k: int, capacity: int, tile_height: int) -> Pieces:
    """The mLoRA rule: consecutive samples, at most ``k`` per piece.

    A piece also stays within ``capacity`` tokens once each sample is padded to the piece's
    longest and the total to the tile height (a sample always fits alone).
    """

    def cut(batch: list[Sample]) -> list[list[Sample]]:
        pieces: list[list[Sample]] = []
        for s in batch:
            last = pieces[-1] if pieces else None
            if last and len(last) < k and padded_tokens_of([*last, s], tile_height) <= capacity:
                last.append(s)
            else:
                pieces.append([s])
        return pieces

    return cut


def packed_pieces(capacity: int, tile_height: int) -> Pieces:
    """First-fit-decreasing bins of the batch alone (fewest microbatches of one adapter).

    Memoised per global batch (adapter and first sample), so streams that cut the same
    batches share one cut function and pack each batch once.
    """
    done: dict[tuple[int, int], list[list[Sample]]] = {}

    def cut(batch: list[Sample]) -> list[list[Sample]]:
        key = (batch[0].adapter, batch[0].index)
        if key not in done:
            bins = pack_ffd(Segment(tuple(batch), (), {}, capacity, tile_height))
            done[key] = [sorted(b, key=lambda s: s.index) for b in bins]
        return done[key]

    return cut


def round_robin(
    problem: PlanProblem,
    pieces: Pieces,
    rounds: range,
    position: int = 0,
    last_finish: Sequence[int] | None = None,
) -> tuple[list[Microbatch], list[int]]:
    """The round-robin stream of global batches ``rounds`` of every adapter.

    Adapters take turns in id order, one piece each; an adapter's pieces follow its global
    batches in order, the last piece of a batch finishing it. Idle microbatches are added
    only where the bubble lemma needs them (fewer than ``S`` other pieces since the adapter's
    previous optimizer step).

    Args:
        problem: the samples and ``S``.
        pieces: how a global batch is cut.
        rounds: the global batch indices to plan (an adapter without batch ``r`` skips it).
        position: plan position of the first microbatch returned.
        last_finish: per adapter, plan position of its last optimizer step (default: none).

    Returns:
        The microbatches and the updated ``last_finish`` (plan positions).
    """
    S = problem.num_stages
    last = list(last_finish) if last_finish is not None else [-S] * problem.num_adapters
    queues: list[list[tuple[list[Sample], bool]]] = []
    for a in range(problem.num_adapters):
        queue = []
        for j in rounds:
            if j < problem.num_global_batches(a):
                cut = pieces(problem.global_batch(a, j))
                queue += [(p, i == len(cut) - 1) for i, p in enumerate(cut)]
        queues.append(queue)
    stream: list[Microbatch] = []
    heads = [0] * problem.num_adapters
    while any(h < len(q) for h, q in zip(heads, queues, strict=True)):
        for a in range(problem.num_adapters):
            if heads[a] == len(queues[a]):
                continue
            samples, ends = queues[a][heads[a]]
            if heads[a] == 0 or queues[a][heads[a] - 1][1]:  # first piece of a global batch
                gap = position + len(stream) - last[a]
                stream += [Microbatch(())] * max(0, S - gap)  # idle: nothing else to run
            stream.append(Microbatch(tuple(samples), (a,) if ends else ()))
            if ends:
                last[a] = position + len(stream) - 1
            heads[a] += 1
    return stream, last


def one_at_a_time(
    problem: PlanProblem,
    pieces: Pieces,
    rounds: range,
    position: int = 0,
    last_finish: Sequence[int] | None = None,
) -> tuple[list[Microbatch], list[int]]:
    """The Megatron-style order as one stream: adapter by adapter, its global batches in turn.

    Adapter ``a``'s global batches ``rounds`` (cut by ``pieces``) follow one another, then
    adapter ``a + 1``'s; idle microbatches are added only where the bubble lemma needs them
    (``S - 1`` between two batches of one adapter, fewer after another adapter's batches).
    Run without a flush, this is the Megatron-style baseline's microbatches in its order.

    Args, Returns: as `round_robin`.
    """
    S = problem.num_stages
    last = list(last_finish) if last_finish is not None else [-S] * problem.num_adapters
    stream: list[Microbatch] = []
    for a in range(problem.num_adapters):
        for j in rounds:
            if j >= problem.num_global_batches(a):
                continue
            cut = pieces(problem.global_batch(a, j))
            stream += [Microbatch(())] * max(0, S - (position + len(stream) - last[a]))
            stream += [
                Microbatch(tuple(p), (a,) if i == len(cut) - 1 else ()) for i, p in enumerate(cut)
            ]
            last[a] = position + len(stream) - 1
    return stream, last


def default_samples_per_microbatch(problem: PlanProblem) -> int:
    """MLoRA's fixed microbatch size: capacity / mean sample length (about ``capacity`` tokens)."""
    useful = sum(sum(x) for x in problem.lengths)
    n_samples = sum(len(x) for x in problem.lengths)
    return max(1, round(problem.capacity * n_samples / useful))
