"""`scripts.bench_train_cli` on the CPU: a cell from a local checkpoint it writes itself."""

import pytest

from megatron_lorafusion.config import MODEL_PRESETS
from megatron_lorafusion.hf_config import hf_model_fields
from scripts.bench_train_cli import main, write_random_base


def test_cells_from_a_local_checkpoint_of_the_preset(tmp_path, capsys):
    """``--from-checkpoint``: the preset's random checkpoint is written once, read as a
    Llama of the preset's sizes, and `lorafusion train` starts from it."""
    args = ["--device", "cpu", "--presets", "tiny", "--adapters", "2", "--samples", "16"]
    args += ["--max-seq-length", "256", "--min-steps", "1", "--runs-dir", str(tmp_path / "runs")]
    args += ["--from-checkpoint", str(tmp_path / "bases")]
    (row,) = main(args)
    assert "error" not in row, row
    assert row["preset"] == "tiny (checkpoint)"
    assert row["startup_phases_s"]["building the model"] > 0
    base = tmp_path / "bases" / "tiny"
    assert "wrote a random tiny checkpoint" in capsys.readouterr().out
    fields, problems = hf_model_fields(base)
    assert not problems, problems
    for key, value in MODEL_PRESETS["tiny"].items():
        if key in fields:
            assert fields[key] == value, key
    written = (base / "config.json").stat().st_mtime_ns
    (again,) = main(args)
    assert "error" not in again, again
    assert (base / "config.json").stat().st_mtime_ns == written, "an existing base is reused"
    assert "wrote a random" not in capsys.readouterr().out


def test_a_base_that_is_not_a_plain_llama_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'qwen3-8b' is not one"):
        write_random_base(tmp_path / "q", "qwen3-8b")
    assert not (tmp_path / "q").exists(), "nothing written"
