import operator
import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest

from megatron_lorafusion.planner import (
    BackgroundPlanner,
    Plan,
    PlannerWorkerError,
    PlanProblem,
    check_plan,
    iter_plan_chunks,
)
from megatron_lorafusion.planner import background as background_module
from megatron_lorafusion.planner.policy import apply_length_policy
from megatron_lorafusion.sim.distributions import adapter_lengths


def _problem(samples=48):
    lengths = apply_length_policy(adapter_lengths("mix", 3, samples, seed=1), 2048, 16).lengths
    return PlanProblem(lengths, (8, 8, 8), 2048, 3, 16, seed=1)


def test_background_planner_matches_synchronous_chunks():
    problem = _problem()
    expected = list(iter_plan_chunks(problem, 2, "milp", 2.0))
    with BackgroundPlanner(
        problem, rounds_per_chunk=2, solver="milp", time_limit_s=2.0, max_chunks_ahead=1
    ) as planner:
        got = list(planner)
    assert got == expected
    merged = Plan(
        tuple(mb for c in got for mb in c.microbatches),
        problem.capacity,
        problem.tile_height,
        problem.num_adapters,
    )
    check_plan(merged, problem)


def test_background_planner_surfaces_worker_death():
    problem = _problem(samples=4000)
    planner = BackgroundPlanner(
        problem, rounds_per_chunk=1, solver="greedy", max_chunks_ahead=1, poll_s=0.05
    )
    try:
        next(planner)  # the worker is alive and blocked on the full queue
        os.kill(planner.pid, signal.SIGKILL)
        with pytest.raises(PlannerWorkerError, match=r"exited with code -9 \(killed by SIGKILL\)"):
            for _ in planner:
                pass
    finally:
        planner.close()


_ORPHAN_PARENT = textwrap.dedent("""
    import threading
    from megatron_lorafusion.planner import BackgroundPlanner, PlanProblem
    from megatron_lorafusion.sim.distributions import adapter_lengths
    from megatron_lorafusion.planner.policy import apply_length_policy

    lengths = apply_length_policy(adapter_lengths("mix", 3, 4000, seed=1), 2048, 16).lengths
    problem = PlanProblem(lengths, (8, 8, 8), 2048, 3, 16, seed=1)
    planner = BackgroundPlanner(problem, rounds_per_chunk=1, solver="greedy",
                                max_chunks_ahead=1, poll_s=0.05)
    print(planner.pid, flush=True)  # the worker soon blocks on its full queue
    threading.Event().wait()
""")


def test_background_planner_worker_dies_with_a_killed_parent():
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_PARENT], stdout=subprocess.PIPE)
    try:
        worker = int(parent.stdout.readline())
        handle = os.pidfd_open(worker)  # readable once the worker has exited
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    try:
        exited, _, _ = select.select([handle], [], [], 10.0)
    finally:
        os.close(handle)
    if not exited:
        os.kill(worker, signal.SIGKILL)
    assert exited, f"planner worker {worker} outlived its SIGKILLed parent by 10 s"


def _explode(*args, **kwargs):
    raise RuntimeError("solver exploded")


def test_background_planner_surfaces_worker_exception(monkeypatch):
    # fork start method so the monkeypatched function is what the worker runs.
    monkeypatch.setattr(background_module, "iter_plan_chunks", _explode)
    with BackgroundPlanner(_problem(), start_method="fork", poll_s=0.05) as planner:
        with pytest.raises(PlannerWorkerError, match="solver exploded"):
            next(planner)


class _UnloadableCost:
    """Pickles fine, fails to unpickle: rebuilding it in the worker divides by zero."""

    def __reduce__(self):
        return operator.truediv, (1, 0)


def test_background_planner_surfaces_a_worker_that_cannot_rebuild_its_job():
    # spawn: the child unpickles the job itself; this used to end it with a bare "exit code 1".
    with BackgroundPlanner(
        _problem(), solver="greedy", cost=_UnloadableCost(), poll_s=0.05
    ) as planner:
        with pytest.raises(PlannerWorkerError) as info:
            next(planner)
    message = str(info.value)
    assert "planner worker failed" in message, message
    assert "Traceback" in message, message
    assert "ZeroDivisionError: division by zero" in message, message


def test_background_planner_rejects_bad_queue_bound():
    with pytest.raises(ValueError, match="max_chunks_ahead must be >= 1"):
        BackgroundPlanner(_problem(), max_chunks_ahead=0)
