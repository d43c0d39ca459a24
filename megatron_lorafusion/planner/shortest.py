"""Which jobs train under shortest-remaining-first (a server's ``policy: shortest``).

Pure Python: the server's `train.stream.JobStream` and the simulator (`sim.trace`) choose
with the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Candidate", "choose_shortest"]


@dataclass(frozen=True)
class Candidate:
    """A running job as the rule sees it.

    Attributes:
        key: the job's id (a table slot, a trace index; ties are broken by it).
        tokens_left: tokens it has not trained yet.
        batch_tokens: tokens of one of its global batches (its share of a round).
        training: it trained in the plan before this choice.
    """

    key: int
    tokens_left: float
    batch_tokens: float
    training: bool


def choose_shortest(candidates: Sequence[Candidate], tokens: float) -> list[int]:
    """Keys of the jobs that train now, fewest tokens left first.

    Walking the jobs by tokens left, a job is taken while fewer than two are taken or their
    global batches hold fewer than ``tokens``. Past that, a job that was training stays
    while no job that was waiting has been taken: only a newcomer with fewer tokens left
    pushes a training job out (a training job overtaken by another one's faster progress
    keeps its turn, so the set changes only when jobs join or end). Jobs with nothing left
    are skipped.
    """
    chosen, held, newcomer = [], 0.0, False
    ordered = sorted(
        (c for c in candidates if c.tokens_left > 0), key=lambda c: (c.tokens_left, c.key)
    )
    for c in ordered:
        if len(chosen) >= 2 and held >= tokens and (newcomer or not c.training):
            break
        chosen.append(c.key)
        held += c.batch_tokens
        newcomer = newcomer or not c.training
    return chosen
