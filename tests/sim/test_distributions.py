import statistics

import pytest

from megatron_lorafusion.sim import DISTRIBUTIONS, adapter_lengths, load_lengths, sample_lengths


@pytest.mark.parametrize(
    ("name", "low", "high"), [("xsum", 550, 670), ("cnn_dm", 1000, 1200), ("wikisum", 2000, 3300)]
)
def test_distribution_means_match_documented_statistics(name, low, high):
    assert low < statistics.mean(sample_lengths(name, 5000, seed=0)) < high


def test_wikisum_has_a_heavy_tail():
    lengths = sorted(sample_lengths("wikisum", 5000, seed=0))
    assert lengths[int(0.99 * len(lengths))] > 4 * lengths[len(lengths) // 2]


def test_distributions_are_deterministic_and_positive():
    for name in DISTRIBUTIONS:
        first = sample_lengths(name, 200, seed=3)
        assert first == sample_lengths(name, 200, seed=3)
        assert min(first) >= 1


def test_adapter_lengths_heterogeneous_and_from_file(tmp_path):
    het = adapter_lengths("heterogeneous", 4, 100, seed=0)
    assert statistics.mean(het[0]) < statistics.mean(het[2])
    path = tmp_path / "lengths.txt"
    path.write_text("12, 30\n400 7\n")
    assert load_lengths(path) == [12, 30, 400, 7]
    from_file = adapter_lengths(str(path), 2, 10, seed=0)
    assert all(v in (12, 30, 400, 7) for v in from_file[0] + from_file[1])


def test_load_lengths_rejects_bad_files(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("[1, -2]")
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        load_lengths(path)
    with pytest.raises(ValueError, match="lengths must be one of"):
        adapter_lengths("no_such_dataset", 1, 1, 0)
