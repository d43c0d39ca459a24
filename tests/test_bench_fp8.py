"""`scripts.bench_fp8`'s reading of a training run's metrics (CPU, no model)."""

import pytest

from scripts.bench_fp8 import steady_tokens_per_s


def _step(adapter, step, tokens, time_s):
    return {"adapter": adapter, "step": step, "tokens": tokens, "time_s": time_s, "loss": 1.0}


def test_steady_tokens_per_s_counts_what_follows_every_adapters_first_step():
    records = [
        _step("a", 1, 1000, 5.0),  # compilation
        _step("b", 1, 2000, 6.0),  # the last first step: warm from here
        _step("a", 2, 3000, 7.0),
        {"adapter": "a", "step": 2, "eval_loss": 2.0, "time_s": 7.5},  # no tokens
        _step("b", 2, 1000, 8.0),
    ]
    assert steady_tokens_per_s(records) == pytest.approx(4000 / 2.0)
    assert steady_tokens_per_s(records[:2]) is None, "nothing after the warm-up"
    assert steady_tokens_per_s(records[::2]) is None, "b's first step is missing"
