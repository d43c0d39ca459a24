import pytest

from megatron_lorafusion.planner import apply_length_policy, max_sample_tokens


def test_policy_truncates_and_counts_per_adapter():
    result = apply_length_policy([[10, 100, 70], [5]], capacity=72, tile_height=16)
    assert result.limit == 64
    assert result.lengths == ((10, 64, 64), (5,))
    assert result.truncated == (2, 0)


def test_policy_reject_names_adapter_and_sample():
    with pytest.raises(ValueError, match="adapter 1 sample 2 has 100 tokens"):
        apply_length_policy([[1], [1, 2, 100]], capacity=64, tile_height=1, policy="reject")


def test_policy_rejects_bad_arguments():
    with pytest.raises(ValueError, match="policy must be"):
        apply_length_policy([[1]], 64, 1, policy="drop")
    with pytest.raises(ValueError, match="capacity must be >= tile_height"):
        max_sample_tokens(8, 16)
