"""Job config loading: every shipped YAML validates; each bad input gets a named error."""

from pathlib import Path

import pytest
import yaml

from megatron_lorafusion.config import MODEL_PRESETS, ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]


def _job(tmp_path, **sections):
    data = tmp_path / "a.jsonl"
    data.write_text('{"prompt": "p", "response": "r"}\n')
    job = {
        "model": {"preset": "tiny"},
        "adapters": [{"name": "a", "dataset": {"path": str(data)}}],
        "train": {"steps": 2, "output_dir": str(tmp_path / "out")},
    }
    job.update(sections)
    return job


def _write(tmp_path, job):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _errors(tmp_path, job, overrides=None):
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, job), overrides)
    return "\n".join(info.value.problems)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_config_shipped_yaml_parses(path, tmp_path, monkeypatch):
    """Shipped jobs parse; their dataset files are made by `synth-data`, so stub them here."""
    raw = yaml.safe_load(path.read_text())
    monkeypatch.chdir(tmp_path)
    for adapter in raw.get("adapters", []):  # a server's job has none
        Path(adapter["dataset"]["path"]).parent.mkdir(parents=True, exist_ok=True)
        Path(adapter["dataset"]["path"]).write_text('{"prompt": "p", "response": "r"}\n')
    cfg = load_config(path)
    assert [a.name for a in cfg.adapters] == [a["name"] for a in raw.get("adapters", [])]
    assert (cfg.server is not None) == ("server" in raw)


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "jobs").glob("*.yaml")), ids=str)
def test_config_shipped_submissions_validate_against_the_demo_server(path, tmp_path, monkeypatch):
    from megatron_lorafusion.config import load_submission

    raw = yaml.safe_load(path.read_text())
    monkeypatch.chdir(tmp_path)
    for adapter in raw["adapters"]:
        Path(adapter["dataset"]["path"]).parent.mkdir(parents=True, exist_ok=True)
        Path(adapter["dataset"]["path"]).write_text('{"prompt": "p", "response": "r"}\n')
    server = load_config(REPO / "configs" / "serve_demo.yaml")
    specs = load_submission(path, server)
    assert [s.adapter.name for s in specs] == [a["name"] for a in raw["adapters"]]
    assert all((s.steps is None) != (s.epochs is None) for s in specs), "each has a length"


def test_config_valid_job_loads_with_preset_and_override(tmp_path):
    cfg = load_config(_write(tmp_path, _job(tmp_path)), ["adapters.0.rank=4", "train.steps=7"])
    assert cfg.model.hidden_size == MODEL_PRESETS["tiny"]["hidden_size"], "preset sets sizes"
    assert cfg.adapters[0].rank == 4, "override of a list item applies"
    assert cfg.train.steps == 7, "override of a section key applies"


def test_config_unknown_key_suggests_the_right_one(tmp_path):
    job = _job(tmp_path)
    job["adapters"][0]["rnak"] = 4
    assert "adapters.0.rnak is not a known key; did you mean 'rank'?" in _errors(tmp_path, job)


def test_config_wrong_type_is_named(tmp_path):
    job = _job(tmp_path)
    job["adapters"][0]["rank"] = "eight"
    assert "adapters.0.rank must be of type int, got 'eight'" in _errors(tmp_path, job)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("rank", 0, "adapters.0.rank must be in [1, 256], got 0"),
        ("rank", -3, "adapters.0.rank must be in [1, 256], got -3"),
        ("dropout", 1.0, "adapters.0.dropout must be in [0, 1), got 1.0"),
        ("dropout", -0.1, "adapters.0.dropout must be in [0, 1), got -0.1"),
    ],
)
def test_config_bad_adapter_value_is_named(tmp_path, key, value, message):
    job = _job(tmp_path)
    job["adapters"][0][key] = value
    assert message in _errors(tmp_path, job)


def test_config_duplicate_adapter_names_rejected(tmp_path):
    job = _job(tmp_path)
    job["adapters"].append(dict(job["adapters"][0]))
    assert "adapters.1.name must be unique, got duplicate 'a'" in _errors(tmp_path, job)


def test_config_missing_dataset_file_is_named(tmp_path):
    job = _job(tmp_path)
    job["adapters"][0]["dataset"]["path"] = "nowhere.jsonl"
    assert (
        "adapters.0.dataset.path must be an existing file or folder, got 'nowhere.jsonl'"
        in _errors(tmp_path, job)
    )


def test_config_capacity_below_one_sample_rejected(tmp_path):
    job = _job(tmp_path, data={"max_seq_length": 300}, planner={"token_capacity": 256})
    assert "planner.token_capacity must hold one sample of data.max_seq_length" in _errors(
        tmp_path, job
    )


def test_config_fp16_training_is_refused_without_loss_scaling(tmp_path):
    errors = _errors(tmp_path, _job(tmp_path), ["train.precision=fp16"])
    assert "train.precision must be 'bf16' or 'fp32'" in errors
    assert "dynamic loss scaling" in errors
    load_config(_write(tmp_path, _job(tmp_path)), ["train.precision=bf16"])  # bf16 stays


def test_config_capacity_counts_tile_padding(tmp_path):
    job = _job(
        tmp_path, data={"max_seq_length": 200}, planner={"token_capacity": 200, "tile_height": 64}
    )
    assert "(200 tokens, 256 with tile padding), got 200" in _errors(tmp_path, job)


def test_config_reports_every_problem_at_once(tmp_path):
    job = _job(tmp_path)
    job["adapters"][0].update(rank=0, dropout=2.0)
    job["train"]["steps"] = -1
    problems = _errors(tmp_path, job).splitlines()
    assert len(problems) == 3, f"expected three problems, got {problems}"


def test_config_float_without_dot_is_read_as_float(tmp_path):
    cfg = load_config(_write(tmp_path, _job(tmp_path)), ["adapters.0.lr=1e-2"])
    assert cfg.adapters[0].lr == 0.01


def test_config_bad_override_is_named(tmp_path):
    assert "override 'train.steps' must look like section.key=value" in _errors(
        tmp_path, _job(tmp_path), ["train.steps"]
    )


def _hf_config_folder(folder):
    import json

    hf = {
        "architectures": ["Qwen2ForCausalLM"],
        "num_hidden_layers": 3,
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "tie_word_embeddings": True,
    }
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    return folder


def test_config_hf_path_sets_sizes_and_refuses_conflicts(tmp_path):
    _hf_config_folder(tmp_path / "m")
    job = _job(tmp_path, model={"hf_path": str(tmp_path / "m")}, data={"tokenizer": "byte"})
    cfg = load_config(_write(tmp_path, job))
    assert (cfg.model.num_layers, cfg.model.num_query_groups, cfg.model.rope_theta) == (3, 2, 1e6)
    assert cfg.model.add_qkv_bias, "Qwen2 has q/k/v biases"
    assert cfg.model.tie_word_embeddings
    job["model"]["hidden_size"] = 128
    assert (
        "model.hidden_size must match the checkpoint's config.json (96) or be left out, got 128"
    ) in _errors(tmp_path, job)


def test_config_hf_path_brings_its_own_tokenizer_and_byte_only_when_asked(tmp_path):
    from hf_testing import save_tiny_tokenizer

    from megatron_lorafusion.data import load_tokenizer
    from megatron_lorafusion.data.tokenizer import HFTokenizer

    folder = _hf_config_folder(tmp_path / "m")
    job = _job(tmp_path, model={"hf_path": str(folder)})
    assert (
        f"data.tokenizer must be a folder with tokenizer.json or tokenizer_config.json "
        f"(it defaults to model.hf_path), or 'byte' to train on byte ids, "
        f"got {str(folder)!r}"
    ) in _errors(tmp_path, job), "no silent byte fallback"
    save_tiny_tokenizer(folder)
    cfg = load_config(_write(tmp_path, job))
    assert cfg.data.tokenizer == str(folder), "unset tokenizer: the model's own folder"
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.encode("hi") != list(b"hi"), "the model's vocabulary, not byte ids"
    job["data"] = {"tokenizer": "byte"}
    assert load_config(_write(tmp_path, job)).data.tokenizer == "byte", "byte when asked"


def test_config_hf_path_refuses_unsupported_architecture(tmp_path):
    import json

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    errors = _errors(tmp_path, _job(tmp_path, model={"hf_path": str(tmp_path / "m")}))
    assert "model.hf_path: architecture must be one of ['Gemma3ForCausalLM', " in errors
    assert "got ['GPT2LMHeadModel']" in errors


def test_config_data_options_are_checked(tmp_path):
    job = _job(tmp_path, data={"tokenizer": str(tmp_path / "nope"), "offline": True})
    job["adapters"][0]["dataset"] = {
        "path": "owner/hub-set",
        "template": "vicuna",
        "messages_field": "messages",
    }
    errors = _errors(tmp_path, job)
    assert "data.tokenizer must be 'byte' or an existing tokenizer folder" in errors
    assert (
        "adapters.0.dataset.path must be an existing file or folder, got 'owner/hub-set'" in errors
    )
    assert "data.offline forbids hub datasets" in errors
    assert "adapters.0.dataset.template must be one of ['alpaca'] or a format string" in errors
    assert "adapters.0.dataset.template must be unset with messages_field" in errors


def test_config_sequence_parallel_defaults_on_and_must_be_bool(tmp_path):
    cfg = load_config(_write(tmp_path, _job(tmp_path, parallel={"tp": 2})))
    assert cfg.parallel.sequence_parallel is True, "on by default (no effect at tp = 1)"
    off = load_config(_write(tmp_path, _job(tmp_path)), ["parallel.sequence_parallel=false"])
    assert off.parallel.sequence_parallel is False, "the override turns it off"
    job = _job(tmp_path, parallel={"tp": 2, "sequence_parallel": "yes"})
    assert "parallel.sequence_parallel must be of type bool, got 'yes'" in _errors(tmp_path, job)
    job = _job(tmp_path, parallel={"sequence_paralel": True})
    assert (
        "parallel.sequence_paralel is not a known key; did you mean 'sequence_parallel'?"
        in _errors(tmp_path, job)
    )


def test_config_defer_wgrad_needs_several_stages(tmp_path):
    job = _job(tmp_path, parallel={"pp": 1, "defer_wgrad": True})
    assert "parallel.defer_wgrad needs parallel.pp > 1" in _errors(tmp_path, job)
    job = _job(tmp_path, parallel={"pp": 2, "defer_wgrad": True})
    assert load_config(_write(tmp_path, job)).parallel.defer_wgrad


@pytest.mark.parametrize(
    "name",
    ["../../escape", "..", ".", "/", "a/b", "/tmp/x", "a\x00b", "x" * 101, ".hidden", "", "a b"],
)
def test_config_unsafe_adapter_name_rejected(tmp_path, name):
    job = _job(tmp_path)
    job["adapters"][0]["name"] = name
    assert (
        f"adapters.0.name must be 1 to 100 letters, digits, '-', '_' or '.', not starting "
        f"with '.', got {name!r}"
    ) in _errors(tmp_path, job)


def test_config_safe_adapter_names_accepted(tmp_path):
    job = _job(tmp_path)
    job["adapters"][0]["name"] = "my-adapter_1.v2"
    job["adapters"].append({**job["adapters"][0], "name": "x" * 100})
    assert [a.name for a in load_config(_write(tmp_path, job)).adapters] == [
        "my-adapter_1.v2",
        "x" * 100,
    ]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("adapters.0.alpha=.nan", "adapters.0.alpha must be a finite number, got nan"),
        ("adapters.0.lr=.inf", "adapters.0.lr must be a finite number, got inf"),
        (
            "adapters.0.weight_decay=.inf",
            "adapters.0.weight_decay must be a finite number, got inf",
        ),
        ("model.rope_theta=.nan", "model.rope_theta must be a finite number, got nan"),
        ("model.rope_theta=0", "model.rope_theta must be > 0, got 0.0"),
        ("model.norm_epsilon=-1", "model.norm_epsilon must be in (0, 1), got -1.0"),
        ("model.init_method_std=1e300", "model.init_method_std must be <= 1, got 1e+300"),
        ("planner.time_limit_s=.inf", "planner.time_limit_s must be a finite number, got inf"),
        (f"train.seed={2**70}", f"train.seed must be in [0, 4294967295], got {2**70}"),
        ("model.init_seed=-1", "model.init_seed must be in [0, 4294967295], got -1"),
        (f"model.hidden_size={10**18}", f"model.hidden_size must be in [1, 131072], got {10**18}"),
        (f"model.vocab_size={10**9}", f"model.vocab_size must be in [1, 4194304], got {10**9}"),
        (f"train.steps={10**9}", f"train.steps must be <= 10000000, got {10**9}"),
        (
            f"adapters.0.global_batch_size={10**9}",
            "adapters.0.global_batch_size must be <= 100000000 (the samples a run may plan), "
            "got 1000000000",
        ),
        (
            f"adapters.0.global_batch_size={6 * 10**7}",  # train.steps is 2
            "train.steps × adapters.0.global_batch_size must be <= 100000000 samples summed "
            "over the adapters (a run holds every planned sample in host memory, ~1024 bytes "
            "apiece), got 2 × 60000000",
        ),
        (f"train.keep_last={10**9}", "train.keep_last must be <= 10000000, got 1000000000"),
        (f"train.eval_every={10**9}", "train.eval_every must be <= 10000000, got 1000000000"),
        (f"logging.log_every={10**9}", "logging.log_every must be <= 10000000, got 1000000000"),
        (
            f"adapters.0.early_stopping_patience={10**9}",
            "adapters.0.early_stopping_patience must be <= 10000000, got 1000000000",
        ),
        (f"planner.token_capacity={10**18}", "planner.token_capacity must be <= 16777216"),
    ],
)
def test_config_non_finite_or_out_of_range_number_rejected(tmp_path, override, message):
    assert message in _errors(tmp_path, _job(tmp_path), [override])


def test_config_output_dir_must_be_new_empty_or_a_run(tmp_path):
    job = _job(tmp_path)
    out = tmp_path / "out"
    out.write_text("not a folder")
    assert f"train.output_dir must be a folder, got {str(out)!r} (a file)" in _errors(tmp_path, job)
    out.unlink()
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    assert (
        f"train.output_dir must be a new or empty folder or a lorafusion run (job.json, "
        f"checkpoints/), got {str(out)!r}, which holds ['thesis.tex']"
    ) in _errors(tmp_path, job)
    (out / "job.json").write_text('{"adapters": [], "train": {}}')
    assert load_config(_write(tmp_path, job)).train.output_dir == str(out), "a run of ours"


def test_config_output_dir_holding_only_the_jobs_data_is_accepted(tmp_path):
    job = _job(tmp_path)
    data = tmp_path / "out" / "data" / "a.jsonl"  # the demo's layout: data under the run
    data.parent.mkdir(parents=True)
    data.write_text('{"prompt": "p", "response": "r"}\n')
    job["adapters"][0]["dataset"]["path"] = str(data)
    assert load_config(_write(tmp_path, job)).adapters[0].dataset.path == str(data)


def test_config_duplicate_yaml_key_names_key_and_both_lines(tmp_path):
    path = _write(tmp_path, _job(tmp_path))
    text = path.read_text()
    path.write_text(text.replace("  steps: 2\n", "  steps: 1\n  steps: 2\n"))
    line = path.read_text().splitlines().index("  steps: 2") + 1
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [
        f"job file {str(path)!r}, line {line}: duplicate key 'steps' (first on line {line - 1})"
    ]
    path.write_text(text + "train: {steps: 3}\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'train' \(first on line \d+\)"):
        load_config(path)


def test_config_yaml_syntax_and_encoding_errors_name_file_and_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model:\n  preset: tiny\n train: [\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems[0].startswith(f"job file {str(path)!r}, line 3: ")
    assert "<unicode string>" not in info.value.problems[0]
    path.write_bytes("model: {preset: tiny}\n# caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [f"job file {str(path)!r}, line 2: not UTF-8 text (byte 0xe9)"]
    for depth in (100, 5000):  # ours at 64 levels; libyaml's own limit at 1,000
        path.write_text("a: " + "[" * depth + "]" * depth + "\n")
        with pytest.raises(ConfigError, match="nested too deeply|exceeded maximum nesting"):
            load_config(path)


def test_config_override_that_is_not_yaml_is_named(tmp_path):
    errors = _errors(tmp_path, _job(tmp_path), ["train.steps=\t3: [x"])
    assert "override 'train.steps=\\t3: [x': the value is not valid YAML" in errors


def test_config_relative_paths_resolve_to_absolute_ones(tmp_path, monkeypatch):
    from hf_testing import save_tiny_tokenizer

    save_tiny_tokenizer(_hf_config_folder(tmp_path / "m"))
    (tmp_path / "a.jsonl").write_text('{"prompt": "p", "response": "r"}\n')
    job = {
        "model": {"hf_path": "m"},
        "adapters": [
            {"name": "a", "dataset": {"path": "a.jsonl"}, "eval_dataset": {"path": "a.jsonl"}}
        ],
        "train": {"steps": 2, "output_dir": str(tmp_path / "out")},
    }
    path = _write(tmp_path, job)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(path)
    monkeypatch.chdir(tmp_path / "m")  # later reads from another folder name the same files
    assert cfg.model.hf_path == str(tmp_path / "m")
    assert cfg.data.tokenizer == str(tmp_path / "m"), "the default follows the resolved model"
    assert cfg.adapters[0].dataset.path == str(tmp_path / "a.jsonl")
    assert cfg.adapters[0].eval_dataset.path == str(tmp_path / "a.jsonl")
    job["adapters"][0]["dataset"] = {"path": "owner/hub-set"}
    job["adapters"][0].pop("eval_dataset")
    job["model"]["hf_path"] = str(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    assert load_config(_write(tmp_path, job)).adapters[0].dataset.path == "owner/hub-set", (
        "a hub name is not a path"
    )


def test_config_model_problem_does_not_hide_other_problems(tmp_path):
    """Issue 17 case 8: a bad head_dim (or a wrong type) is listed beside rank=0."""
    import json

    folder = _hf_config_folder(tmp_path / "m")
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "head_dim": 7}))
    job = _job(tmp_path, model={"hf_path": str(folder)}, data={"tokenizer": "byte"})
    job["adapters"][0]["rank"] = 0
    job["train"]["seed"] = "x"
    errors = _errors(tmp_path, job)
    assert "config.json': head_dim must be" in errors
    assert "adapters.0.rank must be in [1, 256], got 0" in errors
    assert "train.seed must be of type int, got 'x'" in errors
    assert "train.seed must be in" not in errors, "a defaulted key is not checked again"


def test_config_dataset_folder_must_hold_files(tmp_path):
    """A folder of split files is a dataset; an empty folder is refused by name."""
    (tmp_path / "split").mkdir()
    (tmp_path / "split" / "train.jsonl").write_text('{"prompt": "p", "response": "r"}\n')
    job = _job(tmp_path)
    job["adapters"][0]["dataset"]["path"] = str(tmp_path / "split")
    load_config(_write(tmp_path, job))
    (tmp_path / "empty").mkdir()
    job["adapters"][0]["dataset"]["path"] = str(tmp_path / "empty")
    assert (
        f"adapters.0.dataset.path must be a data file or a folder of data files, got "
        f"'{tmp_path / 'empty'}' (an empty folder)"
    ) in _errors(tmp_path, job)


@pytest.mark.parametrize(
    "template", ["{", "}", "{0}", "{}", "{prompt!x}", "{prompt:d}", "{prompt.upper.x}"]
)
def test_config_broken_template_is_named(tmp_path, template):
    job = _job(tmp_path)
    job["adapters"][0]["dataset"]["template"] = template + " {response}"
    assert "adapters.0.dataset.template must be a format string with named {field}" in _errors(
        tmp_path, job
    )


def test_config_good_template_with_escaped_braces_loads(tmp_path):
    job = _job(tmp_path)
    job["adapters"][0]["dataset"]["template"] = "{{json}}: {prompt}"
    assert load_config(_write(tmp_path, job)).adapters[0].dataset.template == "{{json}}: {prompt}"


def test_config_cache_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "cache").write_text("x")
    job = _job(tmp_path, data={"cache_dir": str(tmp_path / "cache")})
    assert "data.cache_dir must be a folder (or a new path)" in _errors(tmp_path, job)
    job = _job(tmp_path, data={"cache_dir": str(tmp_path / "cache" / "sub")})
    assert "data.cache_dir must be a folder (or a new path)" in _errors(tmp_path, job)
    job = _job(tmp_path, data={"cache_dir": str(tmp_path / "new" / "sub")})
    assert load_config(_write(tmp_path, job)).data.cache_dir == str(tmp_path / "new" / "sub")


def test_config_recompute_defaults_to_selective_and_is_checked(tmp_path):
    assert load_config(_write(tmp_path, _job(tmp_path))).train.recompute == "selective"
    full = load_config(_write(tmp_path, _job(tmp_path)), ["train.recompute=full"])
    assert full.train.recompute == "full"
    job = _job(tmp_path)
    job["train"]["recompute"] = "partial"
    assert "train.recompute must be one of 'none', 'selective', 'full', got 'partial'" in _errors(
        tmp_path, job
    )


def test_config_peft_names_set_our_keys_and_the_resolved_job_holds_ours(tmp_path):
    """A PEFT-style adapter (issue 19: it gave 14 errors, and 'r' was read as a typo of 'lr')."""
    import dataclasses

    job = _job(tmp_path)
    job["adapters"][0].update(
        r=16, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "v_proj"]
    )
    cfg = load_config(_write(tmp_path, job))
    adapter = cfg.adapters[0]
    assert (adapter.rank, adapter.alpha, adapter.dropout) == (16, 32.0, 0.05)
    assert adapter.target_modules == ["q_proj", "v_proj"]
    resolved = dataclasses.asdict(cfg)["adapters"][0]
    assert {"r", "lora_alpha", "lora_dropout"}.isdisjoint(resolved), "ours win in job.json"
    job["adapters"][0]["target_modules"] = "all-linear"  # PEFT's bare string
    assert load_config(_write(tmp_path, job)).adapters[0].target_modules == ["all-linear"]


def test_config_peft_name_and_ours_together_is_named(tmp_path):
    job = _job(tmp_path)
    job["adapters"][0].update(r=4, rank=8, lora_alpha=8)
    assert (
        "adapters.0.r and rank set the same value ('r' is PEFT's name for "
        "'rank'): give one, got r=4, rank=8"
    ) in _errors(tmp_path, job)


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        (
            "q_proj",
            "'q_proj' is a target module (inside the fused linear_qkv): list it in "
            "adapters.0.target_modules",
        ),
        ("linear_fc1", "'linear_fc1' is a target module: list it in adapters.0.target_modules"),
        ("modules_to_save", "only LoRA factors are trained here; drop it"),
        ("lora_r", "write 'rank' (or PEFT's 'r')"),
        ("lora_alph", "did you mean 'lora_alpha'?"),
    ],
)
def test_config_unknown_adapter_key_gets_a_peft_aware_hint(tmp_path, key, hint):
    job = _job(tmp_path)
    job["adapters"][0][key] = 1
    assert f"adapters.0.{key} is not a known key; {hint}" in _errors(tmp_path, job)


def test_config_target_modules_outside_an_adapter_are_pointed_there(tmp_path):
    job = _job(
        tmp_path,
        train={
            "steps": 2,
            "output_dir": str(tmp_path / "out"),
            "target_modules": ["q_proj"],
            "down_proj": 1,
        },
    )
    errors = _errors(tmp_path, job)
    assert (
        "train.target_modules is not a known key; target_modules belongs to each adapter: "
        "adapters.<i>.target_modules"
    ) in errors
    assert (
        "train.down_proj is not a known key; 'down_proj' is a target module (inside the "
        "fused linear_fc2): list it in adapters.<i>.target_modules"
    ) in errors


@pytest.mark.parametrize(
    ("targets", "rank", "message"),
    [
        (
            ["linear_qkv", "q_proj"],
            8,
            "adapters.0.target_modules must name each projection once, "
            "got 'q_proj' in both 'linear_qkv' and 'q_proj'",
        ),
        (
            ["all-linear", "o_proj"],
            8,
            "adapters.0.target_modules must name each projection once, "
            "got 'o_proj' in both 'all-linear' and 'o_proj'",
        ),
        (
            ["q_proj", "qkv"],
            8,
            "adapters.0.target_modules must be a non-empty subset of "
            "['linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2', 'q_proj'",
        ),
        (
            ["all-linear"],
            100,
            "adapters.0.rank must be <= 85 with target_modules ['all-linear']: "
            "3 projections of linear_qkv each get rank-r factors",
        ),
        (["gate_proj", "up_proj"], 129, "adapters.0.rank must be <= 128 with target_modules"),
    ],
)
def test_config_bad_targets_are_named(tmp_path, targets, rank, message):
    job = _job(tmp_path)
    job["adapters"][0].update(target_modules=targets, rank=rank)
    assert message in _errors(tmp_path, job)


def test_config_fused_rank_limit_counts_projections_of_one_linear(tmp_path):
    job = _job(tmp_path)
    job["adapters"][0].update(target_modules=["q_proj", "v_proj", "up_proj"], rank=128)
    assert load_config(_write(tmp_path, job)).adapters[0].rank == 128, "2 x 128 <= 256"


def test_config_dora_and_loraplus_keys_load(tmp_path):
    job = _job(tmp_path)
    job["adapters"][0].update(use_dora=True, loraplus_lr_ratio=16)
    adapter = load_config(_write(tmp_path, job)).adapters[0]
    assert (adapter.use_dora, adapter.loraplus_lr_ratio) == (True, 16.0)


def test_config_dora_above_tp_one_is_refused_naming_the_adapter(tmp_path):
    job = _job(tmp_path, parallel={"tp": 2})
    job["adapters"][0]["use_dora"] = True
    assert (
        "adapters.0.use_dora must be false with parallel.tp > 1 (adapter 'a'): DoRA supports "
        "tp = 1 only"
    ) in _errors(tmp_path, job)


@pytest.mark.parametrize("ratio", [0, -2.0])
def test_config_loraplus_ratio_must_be_positive(tmp_path, ratio):
    job = _job(tmp_path)
    job["adapters"][0]["loraplus_lr_ratio"] = ratio
    assert (
        f"adapters.0.loraplus_lr_ratio must be in (0, 1e4] (B's lr over A's; 1 = off), "
        f"got {float(ratio)}"
    ) in _errors(tmp_path, job)


@pytest.mark.parametrize("preset", ["qwen3-8b", "gemma3-12b"])
def test_config_qwen3_gemma3_presets_load_and_override_layers(tmp_path, preset):
    """The presets validate; Gemma 3's six-layer pattern repeats over any layer count."""
    cfg = load_config(_write(tmp_path, _job(tmp_path, model={"preset": preset})))
    assert cfg.model.family == preset.split("-")[0]
    assert cfg.model.head_dim in (128, 256)
    for layers in (12, 2):
        job = _job(tmp_path, model={"preset": preset, "num_layers": layers})
        assert load_config(_write(tmp_path, job)).model.num_layers == layers


def test_config_model_family_fields_are_checked(tmp_path):
    model = {
        "preset": "tiny",
        "hidden_size": 130,  # not a multiple of 4 heads: fine with head_dim
        "head_dim": 31,
        "layer_types": ["sliding_attention", "global"],
        "rope_linear_factor": 0.0,
        "rope_scaling_factor": 8.0,
        "hf_multimodal": True,
    }
    errors = _errors(tmp_path, _job(tmp_path, model=model))
    assert "model.head_dim must be an even number in [2, 4096] (RoPE), got 31" in errors
    assert "model.hidden_size must be divisible" not in errors
    assert "model.layer_types must hold only ['full_attention', 'sliding_attention']" in errors
    assert "model.sliding_window must be set for sliding_attention layers, got None" in errors
    assert "model.rope_linear_factor must be > 0, got 0.0" in errors
    assert "model.rope_linear_factor must be unset with model.rope_scaling_factor" in errors
    assert "model.hf_multimodal must be false unless model.hf_path is a Gemma 3" in errors
    empty = {"preset": "tiny", "sliding_window": 8, "layer_types": []}
    errors = _errors(tmp_path, _job(tmp_path, model=empty))
    assert "model.layer_types must list at least one type (or be null), got []" in errors


def test_config_fp8_base_precision_is_checked(tmp_path):
    assert load_config(_write(tmp_path, _job(tmp_path))).model.base_precision == "bf16"
    fp8 = load_config(_write(tmp_path, _job(tmp_path)), ["model.base_precision=fp8"])
    assert fp8.model.base_precision == "fp8"
    job = _job(tmp_path, model={"preset": "tiny", "base_precision": "fp4"})
    assert "model.base_precision must be one of 'bf16', 'fp8', got 'fp4'" in _errors(tmp_path, job)
    job = _job(tmp_path, model={"preset": "tiny", "base_precision": "fp8", "hidden_size": 136})
    job["adapters"][0]["use_dora"] = True
    errors = _errors(tmp_path, job, ["parallel.tp=2", "model.num_attention_heads=8"])
    assert "model.hidden_size must be a multiple of 16·parallel.tp = 32 with" in errors
    assert "model.ffn_hidden_size must be a multiple of 16·parallel.tp = 32" not in errors
    assert "the head dim) must be a multiple of 16 with model.base_precision: fp8, got 17" in errors
    assert "adapters.0.use_dora must be false with model.base_precision: fp8" in errors


def test_config_llama70b_preset_is_llama_3_1_70b(tmp_path):
    job = _job(tmp_path, model={"preset": "llama3.1-70b", "base_precision": "fp8"})
    model = load_config(_write(tmp_path, job)).model
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size) == (80, 8192, 28672)
    assert (model.num_attention_heads, model.num_query_groups) == (64, 8)
    assert (model.vocab_size, model.rope_theta) == (128256, 500000.0)


def test_config_plan_larger_than_free_memory_is_refused_naming_the_limit(tmp_path, monkeypatch):
    """Issue 36: below the fixed cap, the run's planned samples must fit this machine."""
    from megatron_lorafusion import validation

    monkeypatch.setattr(validation, "host_memory", lambda: (1 << 30, "the test's limit"))
    overrides = ["train.steps=1000", "adapters.0.global_batch_size=2000"]
    assert _errors(tmp_path, _job(tmp_path), overrides) == (
        "train.steps × adapters.0.global_batch_size must fit in this machine's memory: 2000000 "
        "samples take ~1.9 GiB of host memory to plan (~1024 bytes apiece), and 1.0 GiB is "
        "free (the test's limit); got 1000 × 2000"
    )


def test_config_cuda_graphs_true_names_what_stops_them(tmp_path):
    job = _job(tmp_path)
    job["train"].update(cuda_graphs=True, device="cpu", recompute="full", precision="fp32")
    job["parallel"] = {"tp": 2}
    job["planner"] = {"token_capacity": 1000}
    assert (
        "train.cuda_graphs: true needs one process on a GPU with a bf16 base, without full "
        "recompute or DoRA adapters, but train.device is cpu, parallel.tp is 2, "
        "train.recompute is 'full', train.precision is 'fp32', planner.token_capacity 1000 "
        "is not a multiple of 256 (microbatches are padded to one) (set it to false or auto)"
    ) in _errors(tmp_path, job)
    for value in (False, "auto"):  # the same job: auto turns them off where they cannot run
        job["train"]["cuda_graphs"] = value
        assert load_config(_write(tmp_path, job)).train.cuda_graphs == value
    del job["train"]["cuda_graphs"]
    assert load_config(_write(tmp_path, job)).train.cuda_graphs == "auto", "auto by default"
    for value in ("yes", 0, 1):  # 0 == False in Python: not a YAML false
        job["train"]["cuda_graphs"] = value
        assert f"train.cuda_graphs must be one of 'auto', true, false, got {value!r}" in _errors(
            tmp_path, job
        )


def test_config_save_buffer_gib_is_a_size_or_null_sized_to_the_job(tmp_path):
    job = _job(tmp_path)
    job["train"]["save_buffer_gib"] = "auto"
    assert "train.save_buffer_gib must be null or of type float, got 'auto'" in _errors(
        tmp_path, job
    )
    job["train"]["save_buffer_gib"] = 0
    assert "train.save_buffer_gib must be > 0 GiB, got 0.0" in _errors(tmp_path, job)
    job["train"]["save_buffer_gib"] = None
    assert load_config(_write(tmp_path, job)).train.save_buffer_gib is None
    job["train"]["save_buffer_gib"] = 2
    assert load_config(_write(tmp_path, job)).train.save_buffer_gib == 2.0
