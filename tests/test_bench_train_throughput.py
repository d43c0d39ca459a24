"""The training-throughput benchmark's CPU dry run prints every row; its microbatch stream.

Timings are never asserted, only that each row that ran has a finite positive tokens/s.
"""

import csv
import gc
import importlib
import math
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    """The benchmark module, with the objects that exist before the test frozen out of the
    garbage collector until it ends: its ``gc.collect()`` between cells (for Megatron's
    reference cycles) still frees what the benchmark made, without walking the half million
    objects of everything the test process imported (0.45 s a collection, ~10 s of each dry
    run). Unfrozen, they are collected as before."""
    monkeypatch.syspath_prepend(str(REPO))  # `scripts` is a package of the repo, not installed
    module = importlib.import_module("scripts.bench_train_throughput")
    gc.freeze()
    try:
        yield module
    finally:
        gc.unfreeze()


def _tables(out: str) -> list[list[dict]]:
    """Each markdown table of ``out`` as a list of {header: cell} rows."""
    tables = []
    for block in out.split("\n\n"):
        lines = [
            [c.strip() for c in line.split("|")[1:-1]]
            for line in block.splitlines()
            if line.startswith("|")
        ]
        if lines:
            tables.append([dict(zip(lines[0], row, strict=True)) for row in lines[2:]])
    return tables


def _tokens_per_s(row: dict) -> float:
    return float(row["tokens/s"].replace(",", ""))


def test_bench_train_throughput_cpu_dry_run_prints_every_row(bench, tmp_path, capsys):
    out_csv = tmp_path / "bench.csv"
    argv = "--device cpu --shapes llama3.2-1b --layers 1 --tokens 256 --microbatches 2"
    bench.main(
        [*argv.split(), *"--ranks 4 8 --dropouts 0.1 --adapters 1 3 --csv".split(), str(out_csv)]
    )
    out = capsys.readouterr().out
    assert out.startswith("# CPU | torch "), out
    assert "| attention loop |" in out.splitlines()[0], "the CPU dry run attends with the loop"
    matrix, compare = _tables(out)

    cells = [(row["r"], row["adapters"]) for row in matrix]
    assert cells == [(r, a) for r in ("4", "8") for a in ("1", "3", "1, again", "PEFT, 1")], out
    for row in matrix:
        assert math.isfinite(_tokens_per_s(row)), row
        assert _tokens_per_s(row) > 0, row
        assert row["note"] == "", row
        if row["adapters"] == "3":
            assert float(row["ours / PEFT"]) > 0, row
        if row["adapters"] != "PEFT, 1":  # ours: the timed pass's mean loss
            assert math.isfinite(float(row["loss"])), row
    for r in ("4", "8"):  # × 1 adapter is against the mean of the two 1-adapter timings
        ones = [
            float(row["× 1 adapter"])
            for row in matrix
            if row["r"] == r and row["adapters"] in ("1", "1, again")
        ]
        assert len(ones) == 2, (r, ones)
        assert abs(sum(ones) - 2.0) <= 0.011, (r, ones)

    whats = ["ours", "ours base", "PEFT", "PEFT floor", "PEFT+Liger", "PEFT+Liger floor"]
    assert [row["what"] for row in compare] == whats, out
    for row in compare[:4]:
        assert math.isfinite(_tokens_per_s(row)), row
        assert _tokens_per_s(row) > 0, row
    for row in compare[4:]:  # Liger's Triton kernels cannot run on a CPU
        assert row["tokens/s"] == "", row
        assert "liger" in row["note"].lower(), row

    with out_csv.open() as f:
        rows = list(csv.DictReader(f))
    # 4 matrix cells and 2 again, ours and our floor, 3 PEFT cells (r 4, 8, 16) and a floor,
    # 2 Liger rows
    assert len(rows) == 14, rows
    assert all(float(r["tokens_s"]) > 0 for r in rows if r["what"] in ("ours", "ours again"))
    assert {r["attention"] for r in rows} == {"loop"}, rows


def test_bench_rounds_time_each_count_in_turn_and_keep_the_median(bench, capsys):
    argv = "--device cpu --shapes llama3.2-1b --layers 1 --tokens 256 --microbatches 2"
    extra = "--ranks 4 --dropouts 0.0 --adapters 1 2 --rounds 3 --no-compare --no-peers"
    bench.main([*argv.split(), *extra.split()])
    captured = capsys.readouterr()
    (matrix,) = _tables(captured.out)
    assert [row["adapters"] for row in matrix] == ["1", "2"], "no '1, again' with rounds"
    assert matrix[0]["× 1 adapter"] == "1.00", matrix
    logged = [line for line in captured.err.splitlines() if line.startswith("# round ")]
    order = [(line.split(",")[0], line.split(")")[0].rsplit(", ", 1)[1]) for line in logged]
    want = [(f"# round {k}", count) for k in (1, 2, 3) for count in ("1", "2")]
    assert order == want, logged
    for count in ("1", "2"):  # the printed cell is one of its rounds, the median one
        speeds = sorted(
            float(line.split("'tokens_s': ")[1].split(",")[0])
            for line in logged
            if line.split(")")[0].endswith(f", {count}")
        )
        row = next(r for r in matrix if r["adapters"] == count)
        assert abs(_tokens_per_s(row) - speeds[1]) <= 0.5, (row, speeds)


def test_bench_rounds_warm_up_fully_first_then_on_two_microbatches(bench, monkeypatch):
    seen, measure = [], bench._measure

    def recording(train, batches, args, warmup=None):
        seen.append(warmup)
        return measure(train, batches, args, warmup)

    monkeypatch.setattr(bench, "_measure", recording)
    argv = "--device cpu --shapes llama3.2-1b --layers 1 --tokens 256 --microbatches 2"
    bench.main([*argv.split(), *"--ranks 4 --dropouts 0.0 --adapters 1 2 --rounds 2".split()])
    # 2 counts x 2 rounds; then issue 15's cell, our floor, PEFT's floor, PEFT's matrix
    # cell and PEFT's cell of issue 15, all warmed up on every microbatch
    assert seen == [None, None, 2, 2, None, None, None, None, None], seen


def test_bench_median_row_skips_notes_and_falls_back_to_the_last(bench):
    rows = [
        {"tokens_s": 3.0},
        {"note": "CUDA OOM at 1.0 GiB"},
        {"tokens_s": 1.0},
        {"tokens_s": 2.0},
    ]
    assert bench._median_row(rows) == {"tokens_s": 2.0, "loss": None}
    two = [{"tokens_s": 5.0, "loss": 1.5}, {"tokens_s": 4.0, "loss": 2.5}]
    assert bench._median_row(two) == {"tokens_s": 4.0, "loss": 1.5}, "the first round's loss"
    notes = [{"note": "a"}, {"note": "b"}]
    assert bench._median_row(notes) == {"note": "b"}


def test_bench_microbatches_cover_every_adapter_adapter_major(bench):
    one, many = (bench._microbatches(8192, 2, a, vocab=100, device="cpu") for a in (1, 64))
    assert len(one) == 2
    assert len(many) > 2  # 2 x 8192 tokens hold fewer than 64 samples: the stream grows
    seen = set()
    for ids, pos, layout in many:
        assert ids.shape == pos.shape == (1, 8192)
        counts = layout.token_counts()
        assert sum(counts) == 8192
        seen |= {a for a, n in enumerate(counts) if n}
        starts = layout.cu_seqlens[:-1].long()
        assert torch.all(pos[0, starts] == 0), "positions restart at every sample"
    assert seen == set(range(64))
    for (_, _, a), (_, _, b) in zip(one, many, strict=False):  # same lengths, other order
        assert sorted(torch.diff(a.cu_seqlens).tolist()) == sorted(
            torch.diff(b.cu_seqlens).tolist()
        )


def test_bench_attention_option_forces_the_backend_on_cuda_only(bench):
    assert bench._parse_args(["--device", "cpu", "--attention", "flex"]).backend == "loop"
    assert bench._parse_args(["--attention", "flex"]).backend == "flex"
    assert bench._parse_args([]).backend == "flash"
    with pytest.raises(SystemExit):
        bench._parse_args(["--attention", "sdpa"])


def test_host_waits_charges_each_gap_to_the_frame_that_launched_the_next_kernel(bench):
    def x(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    trace = {
        "traceEvents": [
            x("python_function", "megatron_lorafusion/mcore/lora.py(10): forward", 0, 100),
            x("python_function", "megatron_lorafusion/ops/lora_shrink.py(5): launch", 40, 10),
            x("python_function", "megatron_lorafusion/train/optim.py(7): step", 200, 100),
            x("python_function", "torch/nn/modules/module.py(1): _call_impl", 41, 2),
            x("cuda_runtime", "cudaLaunchKernel", 1, 1, correlation=1),
            x("cuda_driver", "cuLaunchKernelEx", 42, 1, correlation=2),
            x("cuda_runtime", "cudaLaunchKernel", 210, 1, correlation=3),
            x("cuda_runtime", "cudaStreamSynchronize", 220, 30),
            x("cuda_runtime", "cudaMemcpyAsync", 230, 50),  # async: not a sync
            x("kernel", "gemm", 2, 20, correlation=1),
            x("kernel", "shrink", 60, 10, correlation=2),  # 38 us after gemm: a gap
            x("kernel", "adam", 72, 5, correlation=3),  # 2 us: below the threshold
        ]
    }
    out = bench.host_waits(trace, min_gap_us=5.0)
    idle, syncs = out.split("\n\n")
    assert idle.startswith("GPU idle 0.0 ms in 1 gaps > 5 us"), out
    assert "| ops/lora_shrink.py(5): launch | 0.04 | 1 |" in idle, out
    assert "| cudaStreamSynchronize in train/optim.py(7): step | 0.03 | 1 |" in syncs, out
    assert "cudaMemcpyAsync" not in syncs, out


def test_bench_train_throughput_cpu_dry_run_of_qwen3_and_gemma3_shapes(bench, capsys):
    """Issue 35's shapes: ours and transformers + PEFT on Qwen3 and Gemma 3 (their own
    transformers classes), Liger refused on the CPU."""
    argv = "--device cpu --shapes qwen3-8b gemma3-12b --layers 1 --tokens 64 --microbatches 1"
    bench.main([*argv.split(), "--no-matrix"])
    out = capsys.readouterr().out
    (compare,) = _tables(out)
    assert [row["model"] for row in compare] == ["qwen3-8b"] * 6 + ["gemma3-12b"] * 6, out
    for row in compare:
        if "Liger" in row["what"]:
            assert "liger" in row["note"].lower(), row
        else:
            assert _tokens_per_s(row) > 0, row
