import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_lorafusion.planner import (
    PlanError,
    PlanProblem,
    check_plan,
    iter_plan_chunks,
    plan_microbatches,
)
from megatron_lorafusion.planner.distributions import adapter_lengths
from megatron_lorafusion.planner.policy import apply_length_policy

FAST = 0.05  # seconds per MILP solve: tests check validity, not optimality under time limits


@st.composite
def problems(draw, max_adapters: int = 4, max_samples: int = 12) -> PlanProblem:
    tile = draw(st.sampled_from([1, 4, 16]))
    capacity = draw(st.integers(tile, 12 * tile + 40))
    limit = capacity // tile * tile
    num_adapters = draw(st.integers(1, max_adapters))
    lengths = [
        draw(st.lists(st.integers(1, limit), min_size=1, max_size=max_samples))
        for _ in range(num_adapters)
    ]
    gbs = [draw(st.integers(1, 6)) for _ in range(num_adapters)]
    stages = draw(st.integers(1, 4))
    return PlanProblem(lengths, gbs, capacity, stages, tile, draw(st.integers(0, 3)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_plan_greedy_passes_verifier(problem):
    plan = plan_microbatches(problem, "greedy")
    check_plan(plan, problem)
    assert plan.report.microbatches == len(plan.microbatches)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_plan_milp_passes_verifier_and_never_loses_to_greedy(problem):
    milp = plan_microbatches(problem, "milp", time_limit_s=FAST)
    greedy = plan_microbatches(problem, "greedy")
    check_plan(milp, problem)
    assert len(milp.microbatches) <= len(greedy.microbatches)
    assert milp.report.greedy_microbatches == len(greedy.microbatches)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.integers(1, 3))
def test_plan_chunks_concatenate_to_a_valid_plan(problem, rounds_per_chunk):
    chunks = list(iter_plan_chunks(problem, rounds_per_chunk, "greedy"))
    merged = chunks[0].__class__(
        tuple(mb for c in chunks for mb in c.microbatches),
        problem.capacity,
        problem.tile_height,
        problem.num_adapters,
    )
    check_plan(merged, problem)


def test_plan_is_deterministic_for_a_seed():
    lengths = apply_length_policy(adapter_lengths("mix", 3, 40, seed=5), 2048, 16).lengths
    problem = PlanProblem(lengths, (8, 8, 8), 2048, 3, 16, seed=5)
    first = plan_microbatches(problem, "milp", time_limit_s=2.0)
    again = plan_microbatches(problem, "milp", time_limit_s=2.0)
    assert first.report.time_limit_hits == 0
    assert first == again


def test_plan_one_adapter_gets_idle_microbatches():
    problem = PlanProblem([[10] * 4], [2], capacity=20, num_stages=3, tile_height=1)
    plan = plan_microbatches(problem, "greedy")
    check_plan(plan, problem)
    assert [mb.is_idle for mb in plan.microbatches] == [False, True, True, False]


def test_plan_reaches_high_fill_on_realistic_lengths():
    lengths = apply_length_policy(adapter_lengths("xsum", 4, 128, seed=0), 6144, 64).lengths
    problem = PlanProblem(lengths, (32,) * 4, 6144, 4, 64)
    plan = plan_microbatches(problem, "greedy")
    padded = sum(mb.padded_tokens(64) for mb in plan.microbatches)
    assert padded / (len(plan.microbatches) * 6144) > 0.95
    assert not any(mb.is_idle for mb in plan.microbatches)


def test_plan_rejects_bad_solver_and_time_limit():
    problem = PlanProblem([[1]], [1], capacity=4)
    with pytest.raises(ValueError, match="solver must be 'milp' or 'greedy'"):
        plan_microbatches(problem, "cplex")
    with pytest.raises(ValueError, match="time_limit_s must be > 0"):
        plan_microbatches(problem, "milp", time_limit_s=0)


def test_plan_checked_against_another_problem_fails():
    problem = PlanProblem([[3, 4]], [1], capacity=8)
    other = PlanProblem([[3, 5]], [1], capacity=8)
    with pytest.raises(PlanError):
        check_plan(plan_microbatches(problem, "greedy"), other)
