import pytest

from megatron_lorafusion.planner import Microbatch, Plan, PlanError, PlanProblem, Sample, check_plan


def _plan(problem, mbs):
    return Plan(tuple(mbs), problem.capacity, problem.tile_height, problem.num_adapters)


@pytest.fixture
def problem():
    # Two adapters, one sample per global batch, two batches each, S = 2.
    return PlanProblem([[3, 4], [5, 6]], [1, 1], capacity=16, num_stages=2, tile_height=1)


def _mb(*samples, finishes=()):
    return Microbatch(tuple(Sample(*s) for s in samples), tuple(finishes))


def test_check_accepts_valid_interleaving(problem):
    check_plan(
        _plan(
            problem,
            [
                _mb((0, 0, 3), finishes=[0]),
                _mb((1, 0, 5), finishes=[1]),
                _mb((0, 1, 4), finishes=[0]),
                _mb((1, 1, 6), finishes=[1]),
            ],
        ),
        problem,
    )


def test_check_rejects_bubble_lemma_violation(problem):
    plan = _plan(
        problem,
        [_mb((0, 0, 3), (1, 0, 5), finishes=[0, 1]), _mb((0, 1, 4), (1, 1, 6), finishes=[0, 1])],
    )
    with pytest.raises(PlanError, match="bubble lemma needs 1"):
        check_plan(plan, problem)


def test_check_accepts_idle_microbatch_for_the_lemma(problem):
    plan = _plan(
        problem,
        [
            _mb((0, 0, 3), (1, 0, 5), finishes=[0, 1]),
            _mb(),
            _mb((0, 1, 4), (1, 1, 6), finishes=[0, 1]),
        ],
    )
    check_plan(plan, problem)


def test_check_rejects_capacity_overflow():
    p = PlanProblem([[9, 9]], [2], capacity=16, tile_height=1)
    with pytest.raises(PlanError, match="exceed the capacity 16"):
        check_plan(_plan(p, [_mb((0, 0, 9), (0, 1, 9), finishes=[0])]), p)


def test_check_counts_tile_padding_against_capacity():
    p = PlanProblem([[5], [5]], [1, 1], capacity=16, tile_height=8)
    check_plan(_plan(p, [_mb((0, 0, 5), (1, 0, 5), finishes=[0, 1])]), p)
    p3 = PlanProblem([[5], [5], [5]], [1, 1, 1], capacity=16, tile_height=8)
    with pytest.raises(PlanError, match="24 padded tokens"):
        check_plan(_plan(p3, [_mb((0, 0, 5), (1, 0, 5), (2, 0, 5), finishes=[0, 1, 2])]), p3)


def test_check_rejects_missing_and_duplicate_samples(problem):
    with pytest.raises(PlanError, match="adapter 1 sample 1 is missing"):
        check_plan(
            _plan(
                problem,
                [
                    _mb((0, 0, 3), finishes=[0]),
                    _mb((1, 0, 5), finishes=[1]),
                    _mb((0, 1, 4), finishes=[0]),
                ],
            ),
            problem,
        )
    with pytest.raises(PlanError, match="appears twice"):
        check_plan(_plan(problem, [_mb((0, 0, 3), finishes=[0]), _mb((0, 0, 3))]), problem)


def test_check_rejects_wrong_step_markers(problem):
    with pytest.raises(PlanError, match=r"finishes must be \[0\]"):
        check_plan(_plan(problem, [_mb((0, 0, 3))]), problem)
    p = PlanProblem([[3, 4]], [2], capacity=16)
    with pytest.raises(PlanError, match=r"finishes must be \[\]"):
        check_plan(_plan(p, [_mb((0, 0, 3), finishes=[0]), _mb((0, 1, 4), finishes=[0])]), p)


def test_check_rejects_wrong_token_count_and_order(problem):
    with pytest.raises(PlanError, match="the problem says 3"):
        check_plan(_plan(problem, [_mb((0, 0, 4), finishes=[0])]), problem)
    with pytest.raises(PlanError, match="sorted adapter-major"):
        check_plan(_plan(problem, [_mb((1, 0, 5), (0, 0, 3), finishes=[0, 1])]), problem)


def test_check_rejects_batches_out_of_order():
    p = PlanProblem([[1, 1, 1]], [1], capacity=4, num_stages=1)
    with pytest.raises(PlanError, match="starts global batch 1, but batch 0 comes first"):
        check_plan(_plan(p, [_mb((0, 1, 1), finishes=[0])]), p)
