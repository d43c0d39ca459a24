from megatron_lorafusion.planner import PlanProblem
from megatron_lorafusion.planner.grouping import group_adapters


def test_grouping_pairs_long_with_short_adapters():
    lengths = [[100] * 64, [1000] * 64, [200] * 64, [800] * 64]
    problem = PlanProblem(lengths, (32,) * 4, 4096, 4)
    groups = group_adapters(problem, range(4))
    assert sorted(groups) == [(0, 1), (2, 3)]


def test_grouping_one_group_without_pipeline_and_round_robin_when_tight():
    lengths = [[100] * 8] * 4
    assert group_adapters(PlanProblem(lengths, (4,) * 4, 4096, 1), range(4)) == [(0, 1, 2, 3)]
    tight = group_adapters(PlanProblem(lengths, (4,) * 4, 4096, 4), range(4))
    assert sorted(tight) == [(0,), (1,), (2,), (3,)]
