"""`lorafusion report RUN` on a metrics file, and a quiet `lorafusion train` start."""

import json
import os
import subprocess
import sys

import yaml

from megatron_lorafusion.cli import main as cli_main
from megatron_lorafusion.data import write_task


def _records():
    rows = []
    for step, (a, b) in enumerate([(3.0, 5.0), (2.0, 4.5), (2.5, 4.0)], start=1):
        rows.append({"step": step, "adapter": "a", "loss": a, "tokens": 10})
        rows.append({"step": step, "adapter": "b", "loss": b, "tokens": 20})
    rows.append({"step": 2, "adapter": "a", "eval_loss": 2.2})
    rows.append({"step": 3, "adapter": "a", "loss": 1.5, "tokens": 10})  # a resumed repeat
    return rows


def test_report_prints_table_and_writes_png(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    assert cli_main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| a | 3 | 30 | 3.0000 | 1.5000 | 1.5000 | 2.2000 (2) |" in out, out
    assert "| b | 3 | 60 | 5.0000 | 4.0000 | 4.0000 | - |" in out, out
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "the curves must be a PNG"


def test_report_of_a_folder_without_metrics_fails(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_train_start_has_no_third_party_lines(tmp_path):
    path = write_task("sort", tmp_path / "sort.jsonl", 20, seed=1)
    job = {
        "model": {"preset": "tiny", "num_layers": 1},
        "adapters": [
            {"name": "s", "rank": 2, "global_batch_size": 2, "dataset": {"path": str(path)}}
        ],
        "data": {"max_seq_length": 32},
        "planner": {"solver": "greedy", "token_capacity": 64},
        "train": {"steps": 1, "device": "cpu", "output_dir": str(tmp_path / "out")},
        "logging": {"progress_bar": False},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    done = subprocess.run(
        [sys.executable, "-m", "megatron_lorafusion", "train", str(tmp_path / "job.yaml")],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines, "the package logs its progress"
    foreign = [line for line in lines if "megatron_lorafusion" not in line]
    assert not foreign, f"third-party lines on stderr: {foreign}"
    assert not [line for line in lines if "Warning" in line], lines
    staging = [line for line in lines if "saves: staged in up to" in line]
    assert staging, "the run says how much host memory its saves may take"
    assert "two saves of every adapter" in staging[0], staging
