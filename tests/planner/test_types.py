import pytest

from megatron_lorafusion.planner import Microbatch, PlanProblem, Sample


def test_problem_rejects_capacity_below_tile_height():
    with pytest.raises(ValueError, match=r"capacity must be >= tile_height \(64\)"):
        PlanProblem([[10]], [1], capacity=32, num_stages=1, tile_height=64)


def test_problem_rejects_empty_adapter_naming_it():
    with pytest.raises(ValueError, match="adapter 1 must have at least one sample"):
        PlanProblem([[10], []], [1, 1], capacity=64)


def test_problem_rejects_negative_length_naming_sample():
    with pytest.raises(ValueError, match=r"adapter 0 sample 2 must have >= 1 token, got -5"):
        PlanProblem([[10, 3, -5]], [2], capacity=64)


def test_problem_rejects_sample_longer_than_capacity():
    with pytest.raises(ValueError, match="adapter 0 sample 1 must fit one microbatch"):
        PlanProblem([[10, 70]], [2], capacity=64, tile_height=16)


def test_problem_lists_every_error_at_once():
    with pytest.raises(ValueError, match="invalid PlanProblem") as info:
        PlanProblem([[1]], [0, 1], capacity=64, num_stages=0)
    message = str(info.value)
    for part in (
        "num_stages must be >= 1",
        "global_batch_sizes must have one entry",
        "global_batch_sizes[0] must be >= 1",
    ):
        assert part in message


def test_problem_stores_tuples_and_is_hashable():
    p = PlanProblem([[1, 2], [3]], [1, 1], capacity=8)
    assert p.lengths == ((1, 2), (3,))
    assert hash(p) == hash(PlanProblem(((1, 2), (3,)), (1, 1), capacity=8))


def test_microbatch_pads_each_adapter_segment_to_tile():
    mb = Microbatch((Sample(0, 0, 5), Sample(0, 1, 4), Sample(2, 0, 1)))
    assert mb.tokens == 10
    assert mb.padded_tokens(8) == 16 + 8
    assert mb.adapters == (0, 2)
    assert not mb.is_idle
    assert Microbatch(()).is_idle
