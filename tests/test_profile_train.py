"""`scripts.profile_train` on the CPU: the real training loop, timed by phase."""

import json

from scripts.profile_train import main


def test_times_the_training_loop_with_job_overrides(tmp_path, capsys):
    folder = tmp_path / "profile"
    args = ["--device", "cpu", "--preset", "tiny", "--samples", "16", "--max-seq-length", "256"]
    args += ["--warmup", "1", "--dir", str(folder), "--set", "train.recompute=none"]
    result = main([*args, "--slowest", "1"])
    slowest = capsys.readouterr().out.split("slowest timed microbatches")[1].splitlines()
    rows = [row.split(" | ") for row in slowest if row.startswith("| ") and row[2].isdigit()]
    assert len(rows) == 1, slowest
    assert float(rows[0][1]) > 0, slowest
    assert result["tokens_per_s"] > 0
    for phase in ("pack", "forward", "backward", "step"):
        assert result[f"host_{phase}_ms"] > 0, phase
    assert result["wall_ms"] > 0
    job = json.loads((folder / "run" / "job.json").read_text())
    assert job["train"]["recompute"] == "none", "the override reached the job"


def test_profiles_a_given_job_file_and_traces_every_microbatch(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    data = tmp_path / "a.jsonl"
    rows = [{"prompt": "x" * n, "response": "y" * 8} for n in range(40, 200, 10)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    job.write_text(
        json.dumps(
            {
                "model": {"preset": "tiny", "num_layers": 1},
                "adapters": [{"name": "solo", "dataset": {"path": str(data)}, "rank": 4}],
                "data": {"max_seq_length": 256},
                "planner": {"token_capacity": 512},
                "train": {"steps": 3, "device": "cpu", "precision": "fp32", "save_every": 0},
                "logging": {"progress_bar": False},
            }
        )
    )
    trace = tmp_path / "trace.jsonl"
    args = ["--device", "cpu", "--job", str(job), "--warmup", "1", "--trace", str(trace)]
    result = main([*args, "--dir", str(tmp_path / "profile")])
    capsys.readouterr()
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["microbatch"] for r in rows] == list(range(len(rows))), rows
    assert len(rows) >= 3, "three steps of one adapter: a microbatch each at least"
    assert all(r["tokens"] > 0 and r["wall_ms"] > 0 for r in rows), rows
    assert result["tokens_per_s"] > 0
    assert (
        json.loads((tmp_path / "profile" / "run" / "job.json").read_text())["adapters"][0]["name"]
        == "solo"
    ), "the given job ran, not the generated one"
