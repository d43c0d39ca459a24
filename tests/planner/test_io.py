import pytest

from megatron_lorafusion.planner import PlanProblem, check_plan, plan_microbatches
from megatron_lorafusion.planner.io import load_plan, save_plan


def test_plan_json_round_trip(tmp_path):
    problem = PlanProblem([[5, 9, 3], [7]], [2, 1], capacity=16, num_stages=2, tile_height=4)
    plan = plan_microbatches(problem, "greedy")
    loaded = load_plan(save_plan(plan, tmp_path / "plan.json"))
    assert loaded == plan
    check_plan(loaded, problem)


def test_load_plan_rejects_other_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"format": "something"}')
    with pytest.raises(ValueError, match="plan format must be"):
        load_plan(path)
