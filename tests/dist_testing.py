"""Multi-process helpers of the tests: one gloo world set-up and one torchrun launcher."""

import contextlib
import os
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


@contextlib.contextmanager
def gloo_world(
    rank: int = 0,
    world: int = 1,
    workdir: str | None = None,
    tp: int = 1,
    pp: int = 1,
    *,
    timeout_s: float = 60.0,
    megatron: bool = True,
):
    """A gloo world with Megatron's TP × PP groups, destroyed on exit (even on failure).

    Args:
        rank: this process's rank.
        world: processes in the world.
        workdir: where the FileStore lives (no ports); None: an in-memory store (world 1).
        tp: tensor-parallel size of Megatron's groups.
        pp: pipeline-parallel size.
        timeout_s: timeout of the world's collectives, in seconds.
        megatron: also create (and destroy) Megatron's model-parallel groups.

    Yields:
        Megatron's ``parallel_state`` (None when ``megatron`` is False).
    """
    if workdir is None:
        store = dist.HashStore()
    else:
        torch.set_num_threads(1)  # 2 shared cores: one thread per rank
        store = dist.FileStore(os.path.join(workdir, "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    parallel_state = None
    try:
        if megatron:
            from megatron.core import parallel_state

            parallel_state.initialize_model_parallel(tp, pp)
        yield parallel_state
    finally:
        if parallel_state is not None:
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def torchrun_train(
    job_yaml: str, nproc: int = 2, timeout_s: float = 300.0, command: str = "train"
) -> str:
    """``torchrun --nproc-per-node nproc -m megatron_lorafusion <command> job_yaml``; its
    stderr (``command``: ``train`` or ``serve``).

    Raises:
        AssertionError: when torchrun fails (with the end of its stderr).
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "megatron_lorafusion",
        command,
        str(job_yaml),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"torchrun failed:\n{done.stderr[-4000:]}"
    return done.stderr
