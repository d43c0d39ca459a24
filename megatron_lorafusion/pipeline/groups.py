"""The process groups the pipeline runner talks over, made once at start-up with a timeout.

Activations (stage ``s`` → ``s + 1``) and gradients (``s + 1`` → ``s``) travel in two
separate groups, so each direction between two neighbours is one FIFO channel: under NCCL,
point-to-point ops of one communicator share one stream, and a send queued ahead of a
receive from the same peer could otherwise wait on each other across the two ranks. Every
group carries a timeout, so a rank whose peer died stops with an error instead of hanging.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

__all__ = [
    "PipelineGroups",
    "check_same_across_ranks",
    "make_pipeline_groups",
    "one_stage_groups",
]


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's place in the pipeline and its groups.

    Attributes:
        stage: pipeline stage ``s`` of this rank.
        num_stages: ``S``.
        dp_rank: data-parallel replica of this rank.
        dp_size: data-parallel size.
        prev_rank: global rank of stage ``s - 1`` of this pipeline (None on stage 0).
        next_rank: global rank of stage ``s + 1`` (None on the last stage).
        last_rank: global rank of the last stage of this pipeline.
        forward_group: the pipeline's ranks, carrying activations (None when ``S == 1``).
        backward_group: the pipeline's ranks, carrying activation gradients.
        dp_group: this stage's data-parallel replicas (adapter gradients, losses).
        norm_group: the pipeline's ranks, summing adapters' squared gradient norms over the
            stages (all-reduces issued in step order; None when ``S == 1``).
    """

    stage: int
    num_stages: int
    dp_rank: int
    dp_size: int
    prev_rank: int | None
    next_rank: int | None
    last_rank: int
    forward_group: dist.ProcessGroup | None
    backward_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    norm_group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        """Stage 0 (embeds tokens)."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Stage ``S - 1`` (computes the loss)."""
        return self.stage == self.num_stages - 1


def _groups_of_all_ranks(mine: list[int]) -> list[tuple[int, ...]]:
    """Every rank's list for one kind of group, deduplicated in a rank-independent order."""
    gathered: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tuple(mine))
    return sorted({g for g in gathered if g is not None})


def make_pipeline_groups(
    pp_ranks: list[int], dp_ranks: list[int], timeout_s: float
) -> PipelineGroups:
    """Create the runner's groups (a collective: every rank of the world calls it).

    Args:
        pp_ranks: global ranks of this rank's pipeline, stage order (Megatron's PP group).
        dp_ranks: global ranks of this rank's data-parallel group (Megatron's DP group).
        timeout_s: timeout of every operation on the new groups, in seconds.

    Returns:
        This rank's `PipelineGroups`.

    Raises:
        RuntimeError: when torch.distributed is not initialised or this rank is in neither
            list.
    """
    if not dist.is_initialized():
        raise RuntimeError("make_pipeline_groups needs torch.distributed initialised")
    rank = dist.get_rank()
    if rank not in pp_ranks or rank not in dp_ranks:
        raise RuntimeError(f"rank {rank} is not in its own groups pp={pp_ranks} dp={dp_ranks}")
    timeout = timedelta(seconds=timeout_s)
    forward_group = backward_group = norm_group = dp_group = None
    # new_group is collective over the world: every rank creates every group, same order.
    for ranks in _groups_of_all_ranks(pp_ranks):
        fwd, bwd, norm = (
            dist.new_group(list(ranks), timeout=timeout, use_local_synchronization=False)
            for _ in range(3)
        )
        if ranks == tuple(pp_ranks):
            forward_group, backward_group, norm_group = fwd, bwd, norm
    for ranks in _groups_of_all_ranks(dp_ranks):
        group = dist.new_group(list(ranks), timeout=timeout, use_local_synchronization=False)
        if ranks == tuple(dp_ranks):
            dp_group = group
    stage, num_stages = pp_ranks.index(rank), len(pp_ranks)
    return PipelineGroups(
        stage=stage,
        num_stages=num_stages,
        dp_rank=dp_ranks.index(rank),
        dp_size=len(dp_ranks),
        prev_rank=pp_ranks[stage - 1] if stage > 0 else None,
        next_rank=pp_ranks[stage + 1] if stage + 1 < num_stages else None,
        last_rank=pp_ranks[-1],
        forward_group=forward_group if num_stages > 1 else None,
        backward_group=backward_group if num_stages > 1 else None,
        dp_group=dp_group,
        norm_group=norm_group if num_stages > 1 else None,
    )


def one_stage_groups() -> PipelineGroups:
    """The `PipelineGroups` of a run with one stage and one replica (``PP = DP = 1``).

    No process group is needed (TP peers, if any, talk over Megatron's own groups), so
    torch.distributed need not be initialised.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    return PipelineGroups(
        stage=0,
        num_stages=1,
        dp_rank=0,
        dp_size=1,
        prev_rank=None,
        next_rank=None,
        last_rank=rank,
        forward_group=None,
        backward_group=None,
        dp_group=None,
    )


def check_same_across_ranks(payload: str, what: str) -> None:
    """Raise on every rank unless all ranks hold the same ``payload`` (e.g. a config's JSON).

    Only a SHA-256 digest travels. Call it right after start-up, before any work, so a rank
    launched with another config (or another plan) fails fast instead of deadlocking later.

    Raises:
        RuntimeError: listing which ranks disagree with rank 0.
    """
    digest = hashlib.sha256(payload.encode()).hexdigest()
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, digest)
    odd = [r for r, d in enumerate(gathered) if d != gathered[0]]
    if odd:
        raise RuntimeError(
            f"{what} differs across ranks: ranks {odd} disagree with rank 0 (sha256 "
            f"{str(gathered[0])[:12]}...); launch every rank with the same {what}"
        )
