"""The `lorafusion` command: exit status 2 and nothing written on bad input."""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from save_testing import every_checkpoint_written

from megatron_lorafusion.cli import main


def _job(tmp_path, **adapter):
    data = tmp_path / "a.jsonl"
    data.write_text('{"prompt": "p", "response": "r"}\n')
    job = {
        "adapters": [{"name": "a", "dataset": {"path": str(data)}, **adapter}],
        "train": {"steps": 1, "output_dir": str(tmp_path / "out")},
    }
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
    assert "is neither a run folder (with job.json) nor a checkpoint folder" in (
        capsys.readouterr().err
    )
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
        capsys.readouterr().err
    )
    assert _files(tmp_path / "out") == before, "the user's files must survive"
    with (tmp_path / "out" / "notes.txt").open("w") as f:
        f.write("mine")
    assert main(["train", str(path), "train.overwrite=true"]) == 0, "asked for: written"
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine", "other files stay"
    assert (tmp_path / "out" / "adapters" / "a" / "adapter_model.safetensors").is_file()


def test_cli_train_stops_on_a_non_finite_loss_and_exports_nothing(tmp_path, capsys):
    # A finite but absurd lr: Adam's first step moves every weight by ~1e30, the next
    # forward overflows: the adapter fails before stepping on the NaN, adapter and step named.
    status = main(
        ["train", str(_job(tmp_path, lr=1e30)), "train.steps=3", "logging.progress_bar=false"]
    )
    err = capsys.readouterr().err
    assert status == 2, err
    assert "error: 1 of 1 adapters failed" in err, err
    assert "adapter 'a': loss nan at step 2; it stopped before that step" in err, err
    assert "Traceback" not in err, err
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
    assert err == (
        "interrupted: train stopped; rerun the same command to resume from its last checkpoint\n"
    )


def _unfinished(out, name: str) -> None:
    """Make adapter ``name`` of run ``out`` look stopped before its end (no export)."""
    (out / "checkpoints" / name / "done.json").unlink()
    shutil.rmtree(out / "adapters" / name)


def test_cli_checkpoint_that_is_not_safetensors_is_skipped_by_train_refused_by_export(
    tmp_path, capsys
):
    """A checkpoint file replaced by other bytes (its state file made to agree): train skips
    it with a warning and starts over; export refuses it, naming the file, in one line."""
    import hashlib

    # the step-2 checkpoint is superseded by the export: step 1's is left
    assert main(["train", str(_job(tmp_path)), "train.steps=2", "train.save_every=1"]) == 0
    out = tmp_path / "out"
    _unfinished(out, "a")
    for step in sorted((out / "checkpoints" / "a").glob("step_*")):
        path = step / "shard_tp0_pp0.safetensors"
        path.write_bytes(b"\x80\x04not a safetensors file")
        state = json.loads((step / "shard_tp0_pp0.json").read_text())
        state["file"] = {
            "name": path.name,
            "bytes": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        }
        (step / "shard_tp0_pp0.json").write_text(json.dumps(state))
    capsys.readouterr()
    assert main(["export", str(out), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "is not a safetensors file" in err, err
    assert len(err.strip().splitlines()) == 1, err
    rerun = ["train", str(tmp_path / "job.yaml"), "train.steps=2", "train.save_every=1"]
    assert main(rerun) == 0
    assert (out / "adapters" / "a" / "adapter_model.safetensors").is_file(), "trained anew"


def test_cli_export_refuses_a_damaged_newest_checkpoint_and_names_the_older(
    tmp_path, capsys, monkeypatch
):
    every_checkpoint_written(monkeypatch)
    assert main(["train", str(_job(tmp_path)), "train.steps=3", "train.save_every=1"]) == 0
    out = tmp_path / "out"
    _unfinished(out, "a")
    older, newest = sorted((out / "checkpoints" / "a").glob("step_*"))
    shard = newest / "shard_tp0_pp0.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["export", str(out), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"the newest checkpoint of adapter 'a', '{newest}', is damaged" in err, err
    assert "--checkpoint checkpoints/a/step_00000001" in err, err
    assert not (tmp_path / "x").exists(), "nothing exported from an older checkpoint"
    assert main(["export", str(older), "--out", str(tmp_path / "x")]) == 0, "named: exported"
    assert (
        main(
            [
                "export",
                str(out),
                "--checkpoint",
                "checkpoints/a/step_00000001",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 0
    ), "picked by --checkpoint"


def test_cli_train_on_cuda_without_a_gpu_exits_2_naming_train_device(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    path = _job(tmp_path)
    assert main(["train", str(path), "train.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert "train.device must be 'auto' or 'cpu' on a machine without CUDA, got 'cuda'" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists(), "a device problem must create nothing"


def test_cli_train_with_cuda_graphs_required_on_a_cpu_exits_2(tmp_path, capsys):
    path = _job(tmp_path)
    # bf16 passes the config's checks; the machine has no GPU (found at launch).
    assert main(["train", str(path), "train.cuda_graphs=true", "train.precision=bf16"]) == 2
    err = capsys.readouterr().err
    assert "train.cuda_graphs is true, but CUDA graphs cannot run: they need a GPU" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists(), "a refused job must create nothing"


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


def test_cli_version_prints_the_installed_version_and_exits_0(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"megatron_lorafusion {version('megatron_lorafusion')}\n"


def test_cli_version_falls_back_to_the_package_version(capsys, monkeypatch):
    import importlib.metadata

    import megatron_lorafusion

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"megatron_lorafusion {megatron_lorafusion.__version__}\n"


def test_cli_validate_print_round_trips_through_validate_and_train(tmp_path, capsys, monkeypatch):
    """validate --print: every default, the preset's sizes, absolute dataset paths; the file
    it prints resolves (validate) and trains (job.json) to the same job as the original."""
    from dataclasses import asdict

    from megatron_lorafusion.config import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text('{"prompt": "p", "response": "r"}\n')
    job = {
        "model": {"preset": "tiny"},
        "adapters": [{"name": "a", "dataset": {"path": "a.jsonl"}, "rank": 4}],
        "train": {"steps": 1, "output_dir": "out"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    overrides = ["adapters.0.lr=2e-4", "logging.progress_bar=false"]
    assert main(["validate", "job.yaml", *overrides, "--print"]) == 0
    text = capsys.readouterr().out
    resolved = load_config("job.yaml", overrides)
    printed = yaml.safe_load(text)
    assert printed == asdict(resolved), "every key, every default, nothing else"
    assert printed["model"]["num_layers"] == 2, "the preset's sizes are written out"
    assert printed["adapters"][0]["dataset"]["path"] == str(tmp_path / "a.jsonl")
    assert printed["adapters"][0]["lr"] == 2e-4, "overrides applied"
    (tmp_path / "resolved.yaml").write_text(text)
    assert load_config("resolved.yaml") == resolved
    assert main(["validate", "resolved.yaml", "--print"]) == 0
    again = capsys.readouterr().out
    assert again.replace("resolved.yaml", "job.yaml") == text, "printing is idempotent"
    assert main(["train", "resolved.yaml"]) == 0
    assert json.loads((tmp_path / "out" / "job.json").read_text()) == asdict(resolved)


@pytest.mark.parametrize(
    ("kind", "options"),
    [("mistral", {}), ("llama", {"llama3_rope": True}), ("qwen2", {"tie": True})],
)
def test_cli_validate_print_round_trips_an_hf_model_job(tmp_path, capsys, kind, options):
    """The sizes read from config.json (sliding window, RoPE scaling, tied embeddings) and
    the model folder as tokenizer are written out and agree with it when read back."""
    from dataclasses import asdict

    from hf_testing import save_tiny_hf_model, save_tiny_tokenizer

    from megatron_lorafusion.config import load_config

    save_tiny_hf_model(kind, tmp_path / "model", **options)
    save_tiny_tokenizer(tmp_path / "model")
    path = _job(tmp_path)
    job = yaml.safe_load(path.read_text())
    path.write_text(
        yaml.safe_dump(
            {**job, "model": {"hf_path": str(tmp_path / "model")}, "data": {"max_seq_length": 64}}
        )
    )
    assert main(["validate", str(path), "--print"]) == 0
    text = capsys.readouterr().out
    resolved = load_config(path)
    assert yaml.safe_load(text) == asdict(resolved)
    assert resolved.data.tokenizer == str(tmp_path / "model")
    (tmp_path / "resolved.yaml").write_text(text)
    assert load_config(tmp_path / "resolved.yaml") == resolved


def test_cli_validate_print_of_a_bad_job_exits_2_and_prints_no_yaml(tmp_path, capsys):
    assert main(["validate", str(_job(tmp_path, rank=0)), "--print"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "adapters.0.rank must be in [1, 256], got 0" in err


def _two_adapter_job(tmp_path):
    """Adapter a: 3 rows, 3 per step; b: 4 rows, half held out for evaluation; one epoch."""
    for name, rows in (("a", 3), ("b", 4)):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(
                json.dumps({"prompt": "p" * (5 * i + 1), "response": "r" * i}) + "\n"
                for i in range(1, rows + 1)
            )
        )
    job = {
        "adapters": [
            {"name": "a", "dataset": {"path": str(tmp_path / "a.jsonl")}, "global_batch_size": 3},
            {
                "name": "b",
                "dataset": {"path": str(tmp_path / "b.jsonl")},
                "global_batch_size": 2,
                "eval_fraction": 0.5,
            },
        ],
        "data": {"max_seq_length": 32},
        "planner": {"token_capacity": 64},
        "train": {"epochs": 1, "output_dir": str(tmp_path / "out")},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_cli_plan_job_plans_the_samples_train_would(tmp_path, capsys):
    """plan --job: the job's datasets tokenised by the data layer, its eval rows held out,
    its batch sizes, capacity and solver; the plan equals the one train runs."""
    from megatron_lorafusion.config import load_config
    from megatron_lorafusion.data import load_adapter_dataset
    from megatron_lorafusion.planner import plan_microbatches
    from megatron_lorafusion.planner.io import load_plan
    from megatron_lorafusion.train.main import make_jobs, prepare_problem

    path = _two_adapter_job(tmp_path)
    out = tmp_path / "plan.json"
    assert (
        main(["plan", "--job", str(path), "planner.token_capacity=48", "--output", str(out)]) == 0
    )
    text = capsys.readouterr().out
    assert f"samples: 5 in 2 adapters (job {path})" in text, text
    assert "adapters: a (3 samples, 3 per step), b (2 samples, 2 per step)" in text, text
    plan = load_plan(out)
    assert plan.capacity == 48, "the override reaches the planner"
    cfg = load_config(path, ["planner.token_capacity=48"])
    rows = [load_adapter_dataset(a, cfg.data) for a in cfg.adapters]
    planned = [
        sorted(s.tokens for mb in plan.microbatches for s in mb.samples if s.adapter == a)
        for a in range(2)
    ]
    assert planned[0] == sorted(len(r) for r in rows[0]), "every row of a, tokenised"
    assert len(planned[1]) == 2, "b's eval half is held out"
    assert set(planned[1]) <= {len(r) for r in rows[1]}
    problem = prepare_problem(cfg, make_jobs(cfg, cfg.adapters, None))
    assert plan == plan_microbatches(problem, cfg.planner.solver, cfg.planner.time_limit_s)


def test_cli_simulate_job_uses_its_pipeline_stages(tmp_path, capsys):
    path = _two_adapter_job(tmp_path)
    png = tmp_path / "t.png"
    assert main(["simulate", "--job", str(path), "parallel.pp=2", "--png", str(png)]) == 0
    table = capsys.readouterr().out
    ours = next(line for line in table.splitlines() if line.startswith("| (c) ours"))
    assert ours.rsplit("|", 2)[1].count("/") == 1, f"two stages' utilisation: {ours}"
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_cli_plan_job_with_a_bad_job_exits_2_like_validate(tmp_path, capsys, command):
    path = _job(tmp_path, rank=0)
    assert main(["validate", str(path)]) == 2
    expected = capsys.readouterr().err
    out = tmp_path / "plan.json"
    assert (
        main([command, "--job", str(path), "--output" if command == "plan" else "--png", str(out)])
        == 2
    )
    assert capsys.readouterr().err == expected
    assert not out.exists()
    assert main([command, "--job", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml' does not exist" in capsys.readouterr().err


def test_cli_plan_job_with_a_bad_data_row_exits_2_naming_file_and_line(tmp_path, capsys):
    path = _job(tmp_path)
    (tmp_path / "a.jsonl").write_text('{"prompt": "p", "response": "r"}\n{"prompt": 3}\n')
    assert main(["plan", "--job", str(path), "--output", str(tmp_path / "p.json")]) == 2
    assert "a.jsonl:2: adapter 'a': field 'prompt' must be a string" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_cli_plan_refuses_flags_the_job_sets_and_overrides_without_a_job(tmp_path, capsys):
    path = _job(tmp_path)
    assert main(["plan", "--job", str(path), "--capacity", "512", "--stages", "2"]) == 2
    err = capsys.readouterr().err
    assert "--capacity does not apply with --job (the job sets it: planner.token_capacity)" in err
    assert "--stages does not apply with --job (the job sets it: parallel.pp)" in err
    assert main(["plan", "planner.token_capacity=512"]) == 2
    assert "dotted overrides ['planner.token_capacity=512'] need --job FILE" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("notes.txt", "hello\n", "dataset file '{path}' has an unknown suffix"),
        ("/dev/null", None, "dataset '/dev/null' must be a data file or a folder, got a character"),
        ("job.json", "model:\n  preset: tiny\n", "{path}:1: not JSON (a JSON dataset starts with"),
        ("b.jsonl", "", "dataset file '{path}' is empty"),
        (
            "a.csv",
            "prompt,response\np,r\nq\n",
            "{path} row 2 (line 3): 1 field where the header has 2 (prompt, response): a field "
            "is missing (set data.bad_rows: skip to skip such rows)",
        ),
        (
            "b.jsonl",
            '{"prompt": "p", "response": "r"}\n{"prompt": 3}\n',
            "{path}:2: adapter 'a': field 'prompt' must be a string",
        ),
    ],
)
def test_cli_validate_reports_the_dataset_problems_train_would(
    tmp_path, capsys, name, content, message
):
    """Issue 36: a dataset that is not one (a .txt, /dev/null, YAML given as JSON, an empty
    file, a ragged CSV row) passed validate and failed train; both now exit 2 naming it."""
    path = name if content is None else tmp_path / name
    job = _job(tmp_path, dataset={"path": str(path)})
    if content is not None:
        path.write_text(content)
    before = sorted(tmp_path.rglob("*"))
    expected = f"error: {message.format(path=path)}"
    for command in ("validate", "train"):
        assert main([command, str(job)]) == 2, command
        out, err = capsys.readouterr()
        assert expected in err, f"{command}: {err}"
        assert "Traceback" not in err
        assert out == ""
    assert sorted(tmp_path.rglob("*")) == before, "nothing written"


def test_cli_ragged_csv_row_is_skipped_and_counted_with_bad_rows_skip(tmp_path, capsys, caplog):
    data = tmp_path / "a.csv"
    data.write_text("prompt,response\np,r\nq\n")
    job = _job(tmp_path, dataset={"path": str(data)})
    assert main(["validate", str(job), "data.bad_rows=skip"]) == 0
    with caplog.at_level("WARNING"):
        assert main(["train", str(job), "data.bad_rows=skip", "logging.progress_bar=false"]) == 0
    assert f"adapter 'a': skipped 1 malformed rows of {data}" in caplog.text


def _rows(path, count):
    path.write_text('{"prompt": "p", "response": "r"}\n' * count)


@pytest.mark.parametrize(
    ("overrides", "rows", "message"),
    [
        (
            [f"adapters.0.global_batch_size={10**9}"],
            1,
            "adapters.0.global_batch_size must be <= 100000000 (the samples a run may plan), "
            "got 1000000000",
        ),
        (
            [f"train.steps={10**7}", "adapters.0.global_batch_size=16"],
            1,
            "train.steps × adapters.0.global_batch_size must be <= 100000000 samples summed "
            "over the adapters",
        ),
        (
            ["train.steps=null", f"train.epochs={10**6}"],
            200,
            "train.epochs × the rows of adapters.0's dataset must be <= 100000000 samples "
            "summed over the adapters (a run holds every planned sample in host memory, ~1024 "
            "bytes apiece), got 1000000 × 200 rows",
        ),
    ],
)
def test_cli_huge_counts_exit_2_under_a_memory_limit(tmp_path, overrides, rows, message):
    """Issue 36: global_batch_size 1e9 validated, then train died of a MemoryError after 27 s
    building the training order. Both commands refuse before allocating (the job file's
    counts within 1 GiB of address space)."""
    from limits_testing import GiB, run_limited

    job = _job(tmp_path)
    _rows(tmp_path / "a.jsonl", rows)
    for command in ("validate", "train"):  # past the config, both import torch: 3-5 GiB mapped
        done = run_limited([command, str(job), *overrides], memory=(8 if rows > 1 else 1) * GiB)
        assert done.returncode == 2, f"{command}: {done.stderr}"
        assert message in done.stderr, f"{command}: {done.stderr}"
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists(), "nothing written"


def test_cli_plan_size_known_only_from_the_whole_dataset_is_checked_by_train(tmp_path):
    """validate reads the first 1,000 rows: 1,001 epochs of at least those pass it, and
    train, counting all 100,000, refuses before planning (under 8 GiB: torch is mapped)."""
    from limits_testing import GiB, run_limited

    job = _job(tmp_path)
    _rows(tmp_path / "a.jsonl", 100_000)
    overrides = ["train.steps=null", "train.epochs=1001", "logging.progress_bar=false"]
    checked = run_limited(["validate", str(job), *overrides], memory=8 * GiB)
    assert checked.returncode == 0, checked.stderr
    done = run_limited(["train", str(job), *overrides], memory=8 * GiB)
    assert done.returncode == 2, done.stderr
    assert (
        "train.epochs × the rows of adapters.0's dataset must be <= 100000000 samples summed "
        "over the adapters (a run holds every planned sample in host memory, ~1024 bytes "
        "apiece), got 1001 × 100000 rows"
    ) in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists(), "nothing written"
