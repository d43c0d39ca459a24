"""`simulate_trace`: a server shared by jobs in proportion to their global batches, by policy
(checked on hand-made traces whose completion times follow by hand), and `make_trace`."""

import pytest

from megatron_lorafusion.sim.trace import (
    POLICIES,
    TraceJob,
    best_mean_jct,
    make_trace,
    simulate_trace,
    summarize,
)


def _job(name: str, samples: int, arrival_s: float = 0.0) -> TraceJob:
    """Samples of 100 tokens, 10 per global batch (1,000 tokens a batch)."""
    return TraceJob(name, arrival_s, 8, 10, "xsum", (100,) * samples, 0)


def _jcts(policy: str, jobs: list[TraceJob]) -> list[float]:
    result = simulate_trace(jobs, policy, 1000.0, 8, microbatch_tokens=500)
    return [f - j.arrival_s for j, f in zip(jobs, result.finish_s, strict=True)]


def test_online_shares_the_server_and_shortest_trains_the_two_shortest_first():
    # 10k, 1k and 2k tokens at 1,000 tokens/s, all at 0 s.
    jobs = [_job("long", 100), _job("short", 10), _job("middle", 20)]
    # online: thirds until short ends (3 s), halves until middle ends (5 s), long alone.
    assert _jcts("online", jobs) == pytest.approx([13.0, 3.0, 5.0])
    # shortest: short and middle (two batches fill the two 500-token microbatches) share the
    # server, short ends at 2 s; middle and long until 4 s; long alone.
    assert _jcts("shortest", jobs) == pytest.approx([13.0, 2.0, 4.0])
    assert _jcts("fifo", jobs) == pytest.approx([10.0, 11.0, 13.0])


def test_every_policy_finishes_every_job_no_sooner_than_alone():
    jobs = make_trace(12, seed=1, load=0.8, tokens_per_s=5e4, size_scale=0.1)
    total = sum(j.tokens for j in jobs)
    for policy in POLICIES:
        result = simulate_trace(jobs, policy, 5e4, 4)
        for job, start, finish in zip(jobs, result.start_s, result.finish_s, strict=True):
            assert job.arrival_s <= start <= finish, (policy, job.name)
            assert finish - start >= job.tokens / 5e4 - 1e-9, (policy, job.name)
        s = summarize(result)
        assert s["makespan_s"] >= total / 5e4 - 1e-9, policy
        assert result.busy_s == pytest.approx(total / 5e4), policy


def test_best_mean_jct_runs_the_shortest_remaining_job_and_bounds_every_policy():
    # All at 0 s: short (1 s), then middle (2 s), then long (10 s): 1, 3 and 13 s.
    jobs = [_job("long", 100), _job("short", 10), _job("middle", 20)]
    assert best_mean_jct(jobs, 1000.0) == pytest.approx(17 / 3)
    # A short job arriving at 2 s preempts the long one: JCT 1 s; the long ends at 11 s.
    assert best_mean_jct([_job("long", 100), _job("short", 10, 2.0)], 1000.0) == pytest.approx(6)
    trace = make_trace(24, seed=3, load=0.9, tokens_per_s=5e4, size_scale=0.1)
    floor = best_mean_jct(trace, 5e4)
    for policy in POLICIES:
        assert summarize(simulate_trace(trace, policy, 5e4, 8))["mean_jct_s"] >= floor - 1e-9
