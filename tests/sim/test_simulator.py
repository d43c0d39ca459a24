import math
import random

import pytest

from megatron_lorafusion.planner import CostModel, Job, simulate_makespan
from megatron_lorafusion.sim import simulate, simulate_flushed

NO_STEP_COST = CostModel(optimizer_ms=0.0)


@pytest.mark.parametrize(("stages", "jobs"), [(1, 5), (2, 3), (4, 8), (4, 2)])
def test_simulate_uniform_jobs_match_1f1b_formula(stages, jobs):
    # Equal microbatches: makespan (M + S - 1)(f + b), bubble (S - 1) / (M + S - 1).
    result = simulate([Job(1.0, 2.0)] * jobs, stages, NO_STEP_COST)
    assert result.makespan_ms == pytest.approx((jobs + stages - 1) * 3.0)
    assert result.bubble_ratio == pytest.approx((stages - 1) / (jobs + stages - 1))
    assert len(result.utilization) == stages


def test_simulate_deadlocks_on_bubble_lemma_violation():
    # Adapter 0 steps after microbatch 0 and microbatch 1 reads it: needs S = 1.
    jobs = [Job(1.0, 2.0, (0,), (0,)), Job(1.0, 2.0, (0,), (0,))]
    simulate(jobs, 1, NO_STEP_COST)
    with pytest.raises(RuntimeError, match="bubble lemma"):
        simulate(jobs, 2, NO_STEP_COST)


def test_simulate_waits_for_optimizer_step():
    # S = 2, idle job between two batches of adapter 0: the second forward waits for the step.
    cost = CostModel(optimizer_ms=5.0)
    jobs = [Job(1.0, 2.0, (0,), (0,)), Job(0.0, 0.0), Job(1.0, 2.0, (0,), (0,))]
    result = simulate(jobs, 2, cost)
    step_end = max(e.end_ms for e in result.events if e.kind == "O" and e.job == 0 and e.stage == 0)
    second_fwd = min(e.start_ms for e in result.events if e.kind == "F" and e.job == 2)
    assert second_fwd >= step_end


def test_simulate_flushed_adds_makespans():
    one = simulate([Job(1.0, 2.0)] * 3, 2, NO_STEP_COST)
    both = simulate_flushed([[Job(1.0, 2.0)] * 3] * 2, 2, NO_STEP_COST)
    assert both.makespan_ms == pytest.approx(2 * one.makespan_ms)
    assert both.bubble_ratio == pytest.approx(one.bubble_ratio)


def test_simulate_per_stage_times_replace_the_shared_ones():
    # S = 2, stage 1 twice as slow: it is the bottleneck, stage 0 idles waiting for it.
    job = Job(9.0, 9.0, stage_ms=((1.0, 2.0), (2.0, 4.0)))
    result = simulate([job] * 3, 2, NO_STEP_COST)
    assert result.busy_ms == pytest.approx((9.0, 18.0))
    # Stage 0's first forward, then stage 1 runs back to back: 1 + 3 * (2 + 4), then B0 on 0.
    assert result.makespan_ms == pytest.approx(1.0 + 18.0 + 2.0)
    with pytest.raises(ValueError, match="stage_ms"):
        simulate([job], 3, NO_STEP_COST)


def test_simulate_deferred_wgrad_fills_the_cool_down():
    # S = 4, 8 equal microbatches, no steps: the weight-gradient share moves into idle time,
    # so the makespan drops and the busy time stays the same.
    jobs = [Job(1.0, 2.0, (0,))] * 8
    plain = simulate(jobs, 4, NO_STEP_COST)
    deferred = simulate(jobs, 4, NO_STEP_COST, defer_wgrad=0.25)
    assert simulate(jobs, 4, NO_STEP_COST, defer_wgrad=0.0).makespan_ms == plain.makespan_ms
    assert deferred.busy_ms == pytest.approx(plain.busy_ms)
    assert deferred.makespan_ms < plain.makespan_ms
    wgrads = [e for e in deferred.events if e.kind == "W"]
    assert len(wgrads) == 4 * 8, "every backward on every stage gets its W"
    assert all(e.end_ms - e.start_ms == pytest.approx(0.5) for e in wgrads)


def test_simulate_deferred_wgrad_runs_before_its_adapters_step():
    cost = CostModel(optimizer_ms=1.0)
    jobs = [Job(1.0, 2.0, (0,)), Job(1.0, 2.0, (1,), (1,)), Job(1.0, 2.0, (0,), (0,))]
    result = simulate(jobs, 2, cost, defer_wgrad=0.5)
    for stage in range(2):
        for job, adapter in ((1, 1), (2, 0)):
            step = next(
                e for e in result.events if e.kind == "O" and e.stage == stage and e.job == job
            )
            needed = [
                e
                for e in result.events
                if e.kind == "W" and e.stage == stage and adapter in jobs[e.job].adapters
            ]
            assert needed, "the stepping adapter's microbatches must have W events"
            assert all(e.end_ms <= step.start_ms for e in needed), (
                f"stage {stage}: adapter {adapter} steps before its weight gradients"
            )


def test_simulate_rejects_a_wgrad_share_outside_the_unit_interval():
    with pytest.raises(ValueError, match=r"defer_wgrad must lie in \[0, 1\), got 1.0"):
        simulate([Job(1.0, 2.0)], 1, NO_STEP_COST, defer_wgrad=1.0)


def _random_stream(seed: int) -> tuple[list[Job], int, CostModel]:
    """Jobs of up to 5 adapters with idles, steps, per-stage times; the lemma mostly kept."""
    rng = random.Random(seed)
    stages, adapters = rng.randint(1, 6), rng.randint(1, 5)
    cost = CostModel(optimizer_ms=rng.choice([0.0, 0.2, 1.3]), p2p_ms=rng.choice([0.0, 0.7]))
    per_stage = rng.random() < 0.3
    last_step: dict[int, int] = {}
    jobs = []
    for j in range(rng.randint(0, 30)):
        # Now and then an adapter whose last step is too recent: a lemma violation.
        ready = [
            a
            for a in range(adapters)
            if last_step.get(a, -stages) <= j - stages or rng.random() < 0.02
        ]
        if not ready or rng.random() < 0.15:
            jobs.append(Job(0.0, 0.0))
            continue
        used = tuple(sorted(rng.sample(ready, rng.randint(1, len(ready)))))
        steps = tuple(a for a in used if rng.random() < 0.4)
        last_step.update((a, j) for a in steps)
        fwd = rng.uniform(0.1, 5.0)
        stage_ms = (
            tuple((rng.uniform(0.1, 5.0), rng.uniform(0.1, 9.0)) for _ in range(stages))
            if per_stage
            else ()
        )
        jobs.append(Job(fwd, 2 * fwd, used, steps, used[0], stage_ms))
    return jobs, stages, cost


def test_simulate_makespan_equals_simulate_on_random_streams():
    deadlocks = 0
    for seed in range(1500):
        jobs, stages, cost = _random_stream(seed)
        try:
            expected = simulate(jobs, stages, cost).makespan_ms
        except RuntimeError:
            deadlocks += 1
            with pytest.raises(RuntimeError, match="bubble lemma"):
                simulate_makespan(jobs, stages, cost)
            continue
        got = simulate_makespan(jobs, stages, cost)
        assert got == expected, f"seed {seed}: {got} != {expected} (same floats expected)"
        assert simulate_makespan(jobs, stages, cost, beat=expected) == math.inf
        assert (
            simulate_makespan(jobs, stages, cost, beat=math.nextafter(expected, math.inf))
            == expected
        )
    assert 50 < deadlocks < 1000, f"{deadlocks} lemma violations: both kinds must be tested"


def test_simulate_makespan_rejects_no_stage():
    with pytest.raises(ValueError, match="num_stages must be >= 1, got 0"):
        simulate_makespan([Job(1.0, 2.0)], 0, NO_STEP_COST)
