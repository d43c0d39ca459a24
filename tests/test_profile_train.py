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
