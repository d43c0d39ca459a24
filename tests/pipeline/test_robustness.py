"""Failures end the job with an error on every rank: bad plans, dead or raising ranks, configs."""

import multiprocessing
import os
import time

import pytest
import torch
import torch.multiprocessing as mp
from pipeline_testing import (
    ADAPTERS,
    config_worker,
    fault_worker,
    lemma_worker,
    make_job,
    stuck_worker,
)

from megatron_lorafusion.pipeline import LemmaError, schedule

COMM_TIMEOUT_S = 20.0  # the groups' timeout: the bound if a dead peer went unnoticed
JOIN_S = 90.0  # start-up (~10 s of imports per process on 2 cores) + timeout + slack
STUCK_TIMEOUT_S = 3.0  # the stuck peer's group timeout


def _refusals_worker(rank: int, world: int, workdir: str) -> None:
    """The three refusals, one gloo world after another in the same two processes (one
    start-up of the interpreters), each in its own folder: the stuck peer last, as its
    timed-out group is not used again."""
    config_worker(rank, world, os.path.join(workdir, "config"))
    lemma_worker(rank, world, os.path.join(workdir, "lemma"))
    stuck_worker(rank, world, os.path.join(workdir, "stuck"), STUCK_TIMEOUT_S)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """The folder of `_refusals_worker`'s outcomes (config/, lemma/, stuck/)."""
    workdir = tmp_path_factory.mktemp("refusals")
    for name in ("config", "lemma", "stuck"):
        (workdir / name).mkdir()
    # Errors inside a worker are raised here, with the worker's traceback.
    mp.spawn(_refusals_worker, args=(2, str(workdir)), nprocs=2, join=True)
    return workdir


def test_config_mismatch_is_refused_on_every_rank(refusals):
    for rank in range(2):
        message = (refusals / "config" / f"refused_{rank}.txt").read_text()
        assert "job config differs across ranks: ranks [1]" in message


def test_stuck_peer_fails_the_wait_after_the_group_timeout(refusals):
    timeout_s = STUCK_TIMEOUT_S
    waited, message = (refusals / "stuck" / "timed_out.txt").read_text().split(" ", 1)
    assert timeout_s <= float(waited) < 4 * timeout_s, f"waited {waited} s: {message}"
    assert "Timed out" in message or "timeout" in message.lower(), message


@pytest.mark.slow
def test_lemma_violation_is_refused_on_every_rank(refusals):
    job = make_job(1, ADAPTERS[:1])  # one adapter for one stage: its batches back to back
    with pytest.raises(LemmaError):
        schedule(2, job.microbatches)
    folder = refusals / "lemma"
    errors = [torch.load(folder / f"refused_{rank}.pt")["error"] for rank in range(2)]
    assert "bubble lemma broken" in errors[0], errors[0]
    assert errors[0] == errors[1], "every rank refuses at the same microbatch"


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "raise"])
def test_failed_rank_ends_every_rank_with_an_error(tmp_path, fault):
    world = 2
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=fault_worker, args=(r, world, str(tmp_path), fault, COMM_TIMEOUT_S))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_S
    try:
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        assert not hung, f"ranks {hung} still running {JOIN_S:.0f} s after the {fault}"
        codes = [p.exitcode for p in procs]
        assert all(code != 0 for code in codes), f"every rank must fail, exit codes {codes}"
        survivor = (tmp_path / "error_0.txt").read_text()
        assert "Error" in survivor, f"rank 0 must end with an exception, got:\n{survivor}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def test_a_failed_warm_up_leaves_no_gradient_and_no_deferred_work():
    """`warm_up_stage` raising in its backward: the table is zeroed and the queue emptied."""
    from types import SimpleNamespace

    from megatron_lorafusion.mcore import WgradQueue
    from megatron_lorafusion.pipeline import one_stage_groups, warm_up_stage
    from megatron_lorafusion.planner import Microbatch, Sample

    grads = torch.zeros(2, 5)
    queue = WgradQueue(max_pending=4)

    def forward(batch, input_tensor):
        grads.add_(1.0)  # what a backward accumulates before it fails
        queue.push(lambda: None)
        raise RuntimeError("backward failed")

    class NoStep:  # the optimizer must not be reached
        def warm_up(self, adapter_ids, *, losses):
            raise AssertionError("warm_up after a failure")

    microbatch = Microbatch((Sample(0, 0, 4),), finishes=(0,))
    batch = SimpleNamespace(layout=SimpleNamespace(num_tokens=4))
    with pytest.raises(RuntimeError, match="backward failed"):
        warm_up_stage(
            microbatch,
            forward,
            lambda share, index: batch,
            NoStep(),
            grads,
            one_stage_groups(),
            hidden_size=8,
            activation_dtype=torch.float32,
            device="cpu",
            wgrad_queue=queue,
        )
    assert torch.count_nonzero(grads) == 0, "a failed warm-up must leave no gradient"
    queue.seal([0])  # a pass only if the failed backward's work were still open
    assert not queue.run_oldest(), "a failed warm-up must leave no deferred pass"
