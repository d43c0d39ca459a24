"""`scripts.bench_models` off the GPU: its data, its log reading, its correctness check.

The check runs here with the torch references in bf16 against fp32 (the GPU run puts the
fused kernels in the bf16 place); it must pass there and fail on a model missing a feature.
"""

import importlib
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # `scripts` is a package of the repo, not installed
    return importlib.import_module("scripts.bench_models")


def _line(stamp: str, adapter: str, step: int, rate_k: float) -> str:
    return (
        f"2026-12-02 01:10:{stamp} INFO megatron_lorafusion.pipeline.runner: adapter {adapter} "
        f"step {step} | loss 6.2 | lr 1.0e-05 | {rate_k:.1f}k tok/s\n"
    )


def test_steady_tokens_per_s_skips_the_warm_up_and_weights_intervals(bench):
    lines = [
        "2026-12-02 01:09:00,612 INFO megatron_lorafusion.train.main: plan (whole): ...\n",
        _line("20,000", "a0", 1, 0.5),  # compilation
        _line("28,000", "a1", 1, 4.0),  # the last adapter's first step: warm from here
        _line("29,000", "a0", 2, 10.0),  # 1 s at 10k
        _line("29,000", "a1", 2, 10.0),  # same group, same interval
        _line("32,000", "a0", 3, 20.0),  # 3 s at 20k
    ]
    rate, intervals = bench.steady_tokens_per_s(lines)
    assert intervals == 2
    assert rate == pytest.approx((1 * 10e3 + 3 * 20e3) / 4)
    assert bench.steady_tokens_per_s(lines[:3]) == (None, 0), "nothing after the warm-up"


def test_write_data_rows_fit_the_jobs_sample_length(bench, tmp_path):
    bench.write_data(tmp_path, adapters=2, rows=5)
    for name in ("a0.jsonl", "a1.jsonl"):
        rows = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        assert len(rows) == 5
        assert all(256 <= len(r["prompt"]) + len(r["response"]) <= 2048 for r in rows)


def test_family_check_passes_and_catches_a_missing_window(
    bench, megatron_single_process, monkeypatch
):
    from megatron_lorafusion.mcore import attention

    assert bench._check_family("gemma3", "cpu") <= bench.CHECK_TOL[torch.bfloat16]
    real = attention.VarlenCoreAttention.attend_packed

    def windowless_in_bf16(self, query, *args, **kwargs):
        if query.dtype == torch.bfloat16:
            monkeypatch.setattr(self, "window", None)
        return real(self, query, *args, **kwargs)

    monkeypatch.setattr(attention.VarlenCoreAttention, "attend_packed", windowless_in_bf16)
    assert bench._check_family("gemma3", "cpu") > bench.CHECK_TOL[torch.bfloat16]
