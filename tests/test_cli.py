"""The `lorafusion` command: exit status 2 and nothing written on bad input."""

import json
from pathlib import Path

import pytest
import yaml

from megatron_lorafusion.cli import main


def _job(tmp_path, **adapter):
    data = tmp_path / "a.jsonl"
    data.write_text('{"prompt": "p", "response": "r"}\n')
    job = {"adapters": [{"name": "a", "dataset": {"path": str(data)}, **adapter}],
           "train": {"steps": 1, "output_dir": str(tmp_path / "out")}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_cli_validate_accepts_good_job(tmp_path, capsys):
    assert main(["validate", str(_job(tmp_path))]) == 0
    assert "valid (1 adapters)" in capsys.readouterr().out


def test_cli_bad_config_exits_2_without_output_dir(tmp_path, capsys):
    status = main(["train", str(_job(tmp_path, rank=0))])
    assert status == 2
    assert "adapters.0.rank must be in [1, 256], got 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists(), "a failed validation must create nothing"


def test_cli_bad_data_row_exits_2_without_output_dir(tmp_path, capsys):
    path = _job(tmp_path)
    (tmp_path / "a.jsonl").write_text('{"prompt": "p", "response": "r"}\n{"prompt": 3}\n')
    assert main(["train", str(path)]) == 2
    assert "a.jsonl:2: adapter 'a': field 'prompt' must be a string" in capsys.readouterr().err
    assert not (tmp_path / "out").exists(), "a data error must create nothing"


def test_cli_synth_data_writes_jsonl(tmp_path):
    assert main(["synth-data", "--out-dir", str(tmp_path), "--tasks", "add", "--num", "5"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "add.jsonl").read_text().splitlines()]
    assert len(rows) == 5
    for row in rows:
        a, b = row["prompt"].removeprefix("add: ").strip().split("+")
        assert int(row["response"]) == int(a) + int(b), f"wrong sum in {row}"


def test_cli_synth_data_unknown_task_exits_2(tmp_path, capsys):
    assert main(["synth-data", "--out-dir", str(tmp_path), "--tasks", "fly"]) == 2
    assert "task must be one of" in capsys.readouterr().err


def test_cli_export_without_checkpoint_exits_2(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "x")]) == 2
    assert "neither a checkpoint folder nor a run folder" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def _files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_cli_train_into_a_foreign_folder_exits_2_and_keeps_its_files(tmp_path, capsys):
    path = _job(tmp_path)
    (tmp_path / "out" / "adapters" / "a").mkdir(parents=True)
    (tmp_path / "out" / "adapters" / "a" / "thesis.tex").write_text("years of work")
    before = _files(tmp_path / "out")
    assert main(["train", str(path)]) == 2
    assert "train.output_dir must be a new or empty folder or a lorafusion run" in (
        capsys.readouterr().err)
    assert _files(tmp_path / "out") == before, "the user's files must survive"
    with (tmp_path / "out" / "notes.txt").open("w") as f:
        f.write("mine")
    assert main(["train", str(path), "train.overwrite=true"]) == 0, "asked for: written"
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine", "other files stay"
    assert (tmp_path / "out" / "adapters" / "a" / "adapter_model.safetensors").is_file()


def test_cli_train_stops_on_a_non_finite_loss_and_exports_nothing(tmp_path, capsys):
    # A finite but absurd lr: Adam's first step moves every weight by ~1e30, the next
    # forward overflows: the run stops before stepping on the NaN, naming adapter and step.
    status = main(["train", str(_job(tmp_path, lr=1e30)), "train.steps=3",
                   "logging.progress_bar=false"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "error: adapter 'a': " in err, err
    assert "at step 2; training stopped before that step" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out" / "adapters").exists(), "no NaN weight may be exported"


def test_cli_export_never_overwrites_foreign_files(tmp_path, capsys):
    assert main(["train", str(_job(tmp_path))]) == 0
    run, out = str(tmp_path / "out"), tmp_path / "exported"
    (out / "a").mkdir(parents=True)
    (out / "a" / "my_own_model.bin").write_bytes(b"\x00mine")
    before = _files(out)
    assert main(["export", run, "--out", str(out)]) == 2
    assert "is not empty and was not written by lorafusion export" in capsys.readouterr().err
    assert _files(out) == before, "a foreign export folder must be left as it was"

    (out / "a" / "my_own_model.bin").unlink()
    (out / "a").rmdir()
    assert main(["export", run, "--out", str(out)]) == 0, "an empty folder is fine"
    assert main(["export", run, "--out", str(out)]) == 0, "our own export folder is replaced"
    assert (out / "a" / "adapter_model.safetensors").is_file()
    (out / "b").mkdir()
    (out / "b" / "notes.txt").write_text("mine")
    assert main(["export", run, "--out", str(out)]) == 0, "other folders are not touched"
    assert (out / "b" / "notes.txt").read_text() == "mine"

    (tmp_path / "file").write_text("x")
    capsys.readouterr()
    assert main(["export", run, "--out", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert "is a file; --out must name a folder" in err
    assert "Traceback" not in err


def test_cli_ctrl_c_during_train_is_one_line_exit_130(tmp_path, capsys, monkeypatch):
    import megatron_lorafusion.train.main as train_main

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_main, "main", interrupted)
    assert main(["train", str(_job(tmp_path))]) == 130
    err = capsys.readouterr().err
    assert err == ("interrupted: train stopped; rerun the same command to resume from its last "
                   "checkpoint\n")


def test_cli_checkpoint_with_pickled_object_exits_2_in_one_line(tmp_path, capsys):
    import torch

    from megatron_lorafusion.train.checkpoint import _sha256

    assert main(["train", str(_job(tmp_path))]) == 0
    (ckpt,) = sorted((tmp_path / "out" / "checkpoints").glob("ckpt_*"))
    shard = ckpt / "shard_tp0_pp0.pt"
    torch.save({"payload": _Payload()}, shard)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][shard.name] = {"bytes": shard.stat().st_size, "sha256": _sha256(shard)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))  # the hashes agree: only the
    capsys.readouterr()                                        # contents give it away
    for argv in (["train", str(tmp_path / "job.yaml")],
                 ["export", str(tmp_path / "out"), "--out", str(tmp_path / "x")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "holds more than tensors and plain data" in err, err
        assert len(err.strip().splitlines()) == 1, f"{argv[0]}: one line, got {err}"


class _Payload:
    """Any object a full pickle load would construct."""


def test_cli_export_refuses_a_damaged_newest_checkpoint_and_names_the_older(tmp_path, capsys):
    assert main(["train", str(_job(tmp_path)), "train.steps=2", "train.save_every=1"]) == 0
    older, newest = sorted((tmp_path / "out" / "checkpoints").glob("ckpt_*"))[-2:]
    shard = newest / "shard_tp0_pp0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["export", str(tmp_path / "out"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"the newest checkpoint '{newest}' is damaged" in err, err
    assert f"name it (--checkpoint {older.name}): '{older}'" in err, err
    assert not (tmp_path / "x").exists(), "nothing exported from an older checkpoint"
    assert main(["export", str(older), "--out", str(tmp_path / "x")]) == 0, "named: exported"
    assert main(["export", str(tmp_path / "out"), "--checkpoint", older.name, "--out",
                 str(tmp_path / "x")]) == 0, "picked by --checkpoint"


def test_cli_train_on_cuda_without_a_gpu_exits_2_naming_train_device(tmp_path, capsys,
                                                                      monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    path = _job(tmp_path)
    assert main(["train", str(path), "train.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert "train.device must be 'auto' or 'cpu' on a machine without CUDA, got 'cuda'" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists(), "a device problem must create nothing"


def test_cli_layout_larger_than_a_one_process_run_exits_2(tmp_path, capsys, monkeypatch):
    """Issue 17 case 11: parallel.tp/pp of 2 without torchrun is named, not a traceback."""
    from megatron_lorafusion.config import load_config
    from megatron_lorafusion.validation import launch_problems

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for key in ("parallel.tp=2", "parallel.pp=2"):
        assert main(["train", str(_job(tmp_path)), key]) == 2, key
        err = capsys.readouterr().err
        assert "parallel.tp × parallel.pp must divide the number of processes" in err
        assert "a one-process run" in err
        assert "Traceback" not in err
        # validate does not know how the job will be launched (torchrun or not): it passes
        assert main(["validate", str(_job(tmp_path)), key]) == 0, key
    assert not (tmp_path / "out").exists(), "a refused layout must create nothing"
    cfg = load_config(_job(tmp_path), ["parallel.tp=2"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launch_problems(cfg), "one process cannot hold tp 2"
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert not launch_problems(cfg), "4 processes hold tp 2"


def test_cli_chat_dataset_without_chat_template_exits_2_naming_adapter(tmp_path, capsys):
    """Issue 17 case 8: validate reports it (adapter, dataset, key, tokenizer); train creates
    nothing (no output_dir, no cache)."""
    from hf_testing import CHAT_TEMPLATE, save_tiny_tokenizer

    tok = tmp_path / "tok"
    save_tiny_tokenizer(tok)
    (tok / "chat_template.jinja").unlink()
    chats = tmp_path / "chats.jsonl"
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    chats.write_text(json.dumps({"messages": chat}) + "\n")
    path = _job(tmp_path, dataset={"path": str(chats), "messages_field": "messages"})
    job = yaml.safe_load(path.read_text())
    job["data"] = {"tokenizer": str(tok), "cache_dir": str(tmp_path / "cache")}
    path.write_text(yaml.safe_dump(job))
    expected = (
        f"adapters.0.dataset.messages_field needs a tokenizer with a chat template, got "
        f"data.tokenizer={str(tok)!r}, which has none (adapter 'a', dataset "
        f"{str(chats)!r})"
    )
    for command in ("validate", "train"):
        assert main([command, str(path)]) == 2, command
        err = capsys.readouterr().err
        assert expected in err, err
        assert "Traceback" not in err
    assert not (tmp_path / "out").exists(), "a chat dataset without a template creates nothing"
    assert not (tmp_path / "cache").exists(), "not even the tokenised-data cache"
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": CHAT_TEMPLATE})
    )
    assert main(["validate", str(path)]) == 0, "a template in tokenizer_config.json counts"


LONG = "é" * 300  # 600 bytes: over the 255 a file name may have


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (f"train.output_dir={LONG}", "train.output_dir must be a path of names of at most 255"),
        (f"data.cache_dir=new/{LONG}/sub", "data.cache_dir must be a path of names of at most 255"),
        ('data.cache_dir="a\\0b"', "data.cache_dir must be a path without NUL bytes"),
        (f"adapters.0.dataset.path={LONG}.jsonl", "adapters.0.dataset.path must be a path of"),
        (f"data.tokenizer={LONG}", "data.tokenizer must be a path of names of at most 255"),
        (f"train.resume={LONG}", "train.resume must be a path of names of at most 255"),
        (
            "train.output_dir=job.yaml/out",
            "train.output_dir must be a folder (or a new path), got 'job.yaml/out' ('job.yaml' "
            "is a file)",
        ),
        (
            "train.output_dir=/proc/run",
            "train.output_dir must be a folder on a file system that stores files, got "
            "'/proc/run' (proc)",
        ),
        (
            "data.cache_dir=/proc/cache",
            "data.cache_dir must be a folder on a file system that stores files, got "
            "'/proc/cache' (proc)",
        ),
    ],
)
def test_cli_unusable_path_exits_2_naming_the_key_and_creates_nothing(
    tmp_path, monkeypatch, capsys, override, message
):
    """Issue 17 case 11: paths the file system refuses are named by validate, not tracebacks
    of train's mkdir."""
    if "/proc" in override and not Path("/proc/self/mounts").is_file():
        pytest.skip("needs Linux's /proc")
    path = _job(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = _files(tmp_path), sorted(tmp_path.rglob("*"))
    for command in ("validate", "train"):
        assert main([command, str(path), override]) == 2, command
        err = capsys.readouterr().err
        assert message in err, err
        assert "Traceback" not in err
    assert (_files(tmp_path), sorted(tmp_path.rglob("*"))) == before, "nothing created"


@pytest.mark.parametrize("key", ["lr", "alpha", "weight_decay"])
def test_cli_adapter_number_beyond_fp32_exits_2_before_training(tmp_path, capsys, key):
    """Issue 17 case 11: 1e300 is finite but infinite in fp32; the run used to train one step
    and stop at export, its checkpoint holding infinite weights."""
    assert main(["train", str(_job(tmp_path)), f"adapters.0.{key}=1e300"]) == 2
    err = capsys.readouterr().err
    assert f"adapters.0.{key} must be <= 3.403e+38 (the largest fp32 number), got 1e+300" in err
    assert not (tmp_path / "out").exists(), "nothing trained, nothing created"
