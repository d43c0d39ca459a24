from megatron_lorafusion.planner import PlanProblem, Sample, check_plan, plan_greedy
from megatron_lorafusion.planner._segment import Segment, load_of
from megatron_lorafusion.planner.greedy import pack_ffd


def test_pack_ffd_respects_release_with_idle_bins():
    items = tuple(Sample(0, i, 10) for i in range(2))
    bins = pack_ffd(Segment(items, (), {0: 3}, capacity=100, tile_height=1))
    assert [len(b) for b in bins] == [0, 0, 0, 2]


def test_pack_ffd_fills_the_carry_bin_first():
    carry = (Sample(1, 0, 50),)
    items = (Sample(0, 0, 40), Sample(0, 1, 30))
    bins = pack_ffd(Segment(items, carry, {}, capacity=100, tile_height=1))
    assert bins[0][0] == carry[0]
    assert load_of(bins[0], 1) == 90
    assert len(bins) == 2


def test_plan_greedy_is_valid_for_deep_pipelines():
    # Two adapters, S = 4: the lemma needs idle or interleaved microbatches.
    p = PlanProblem([[10] * 4, [10] * 4], [2, 2], capacity=20, num_stages=4, tile_height=1)
    plan = plan_greedy(p)
    check_plan(plan, p)
    assert plan.report.solver == "greedy"
