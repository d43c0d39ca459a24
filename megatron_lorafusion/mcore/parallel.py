"""Process groups and per-microbatch Megatron arguments, behind one small seam.

`train` and `pipeline` call these instead of touching `megatron.core.parallel_state` or
`PackedSeqParams` themselves.
"""

from __future__ import annotations

import logging
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_lorafusion.ops import AdapterLayout

logger = logging.getLogger(__name__)


def init_model_parallel(
    tp: int, pp: int, device: torch.device, seed: int, timeout_s: float = 1800.0
) -> None:
    """Start torch.distributed (torchrun's env, or a one-process world) and Megatron's groups.

    Args:
        tp: tensor parallel size.
        pp: pipeline parallel size.
        device: ``cuda`` uses NCCL and the local GPU, ``cpu`` uses gloo.
        seed: seeds torch and, on CUDA, Megatron's model-parallel RNG tracker.
        timeout_s: timeout of every collective on the world and Megatron's groups, in
            seconds (Megatron's is rounded up to whole minutes); bounds how long a rank
            waits on a stuck peer.

    Raises:
        RuntimeError: when the world size is not a multiple of ``tp × pp``.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    else:
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=timeout_s),
        )
    world = dist.get_world_size()
    if world % (tp * pp):
        dist.destroy_process_group()
        raise RuntimeError(f"world size {world} is not a multiple of tp × pp = {tp} × {pp}")
    parallel_state.initialize_model_parallel(
        tp, pp, distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60))
    )
    torch.manual_seed(seed)
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    """Tear down Megatron's groups and torch.distributed (safe to call twice)."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def pipeline_and_data_ranks() -> tuple[list[int], list[int]]:
    """Global ranks of this rank's pipeline (stage order) and of its data-parallel group.

    Raises:
        RuntimeError: when Megatron's pipeline group is not in stage order.
    """
    pp_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    dp_ranks = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
    stage = parallel_state.get_pipeline_model_parallel_rank()
    if pp_ranks[stage] != dist.get_rank():
        raise RuntimeError(f"pipeline group {pp_ranks} is not in stage order (stage {stage})")
    return list(pp_ranks), list(dp_ranks)


def parallel_sizes() -> dict[str, int]:
    """Sizes and ranks: ``world``, ``rank``, ``tp``, ``pp``, ``dp``, ``*_rank`` of each."""
    return {
        "world": dist.get_world_size(),
        "rank": dist.get_rank(),
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
    }


def packed_seq_params(layout: AdapterLayout) -> PackedSeqParams:
    """Megatron's THD packed-sequence arguments for a microbatch's sample boundaries."""
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=layout.cu_seqlens,
        cu_seqlens_kv=layout.cu_seqlens,
        max_seqlen_q=layout.max_seqlen,
        max_seqlen_kv=layout.max_seqlen,
    )
