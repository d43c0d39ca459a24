"""`scripts.graph_shapes`: the capture and replay counts of `MicrobatchGraphs`, from a plan."""

import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def shapes(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # `scripts` is a package of the repo, not installed
    return importlib.import_module("scripts.graph_shapes")


def test_a_shape_is_captured_at_its_nth_microbatch_and_replayed_after(shapes):
    keys = ["a", "b", "a", "a", "c", "b", "a", "b"]
    assert shapes._count(keys, 2) == (2, 3)  # a, b captured; a a b replayed
    assert shapes._count(keys, 3) == (2, 1)  # a captured at its third, b at its third


def test_coarser_keys_repeat_more(shapes):
    rows = shapes.main(["--global-batch", "32", "--samples", "512", "--capture-at", "3"])
    by_key = {r["key"]: r for r in rows}
    assert set(by_key) == set(shapes.KEYS)
    for r in rows:
        assert r["captures"] <= r["distinct"]
        assert r["replays"] + r["captures"] * 3 <= r["microbatches"]
    assert by_key["tokens"]["distinct"] <= by_key["tokens, samples"]["distinct"]
    assert by_key["tokens"]["replays"] >= by_key["tokens, samples"]["replays"]
