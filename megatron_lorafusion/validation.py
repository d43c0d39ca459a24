"""Cross-field rules of a job config: every rule checked once, every problem returned.

`config.load_config` calls `validate` after the keys and types are read; each problem reads
``<section>.<field> must be <rule>, got <value>``.
"""

from __future__ import annotations

from pathlib import Path

from megatron_lorafusion.config import (
    TARGET_MODULES,
    AdapterConfig,
    DataConfig,
    DatasetConfig,
    JobConfig,
)

__all__ = ["DATA_SUFFIXES", "PROMPT_TEMPLATES", "validate"]


def validate(cfg: JobConfig) -> list[str]:
    """Every cross-field rule of a job, checked once; returns the problems found."""
    p: list[str] = []
    m = cfg.model
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "num_query_groups", "vocab_size", "max_position_embeddings", "init_method_std"):
        if getattr(m, name) <= 0:
            p.append(f"model.{name} must be > 0, got {getattr(m, name)}")
    if m.num_attention_heads > 0 and m.hidden_size % m.num_attention_heads:
        p.append(f"model.hidden_size must be divisible by model.num_attention_heads "
                 f"({m.num_attention_heads}), got {m.hidden_size}")
    if m.num_query_groups > 0 and m.num_attention_heads % m.num_query_groups:
        p.append(f"model.num_query_groups must divide model.num_attention_heads "
                 f"({m.num_attention_heads}), got {m.num_query_groups}")
    if cfg.data.tokenizer == "byte" and m.vocab_size < 259:
        p.append(f"model.vocab_size must be >= 259 for the byte tokenizer, got {m.vocab_size}")
    if cfg.data.tokenizer != "byte" and not Path(cfg.data.tokenizer).is_dir():
        p.append(f"data.tokenizer must be 'byte' or an existing tokenizer folder, "
                 f"got {cfg.data.tokenizer!r}")
    if not cfg.adapters:
        p.append("adapters must list at least one adapter, got none")
    seen: set[str] = set()
    for i, a in enumerate(cfg.adapters):
        p.extend(_validate_adapter(a, f"adapters.{i}", seen))
        p.extend(_validate_dataset(a.dataset, cfg.data, f"adapters.{i}.dataset"))
    if cfg.data.max_seq_length <= 0:
        p.append(f"data.max_seq_length must be > 0, got {cfg.data.max_seq_length}")
    if cfg.data.max_seq_length > m.max_position_embeddings:
        p.append(f"data.max_seq_length must be <= model.max_position_embeddings "
                 f"({m.max_position_embeddings}), got {cfg.data.max_seq_length}")
    pl = cfg.planner
    if pl.tile_height <= 0:
        p.append(f"planner.tile_height must be > 0, got {pl.tile_height}")
    elif cfg.data.max_seq_length > 0:
        longest = -(-cfg.data.max_seq_length // pl.tile_height) * pl.tile_height
        if pl.token_capacity < longest:
            p.append(f"planner.token_capacity must hold one sample of data.max_seq_length "
                     f"({cfg.data.max_seq_length} tokens, {longest} with tile padding), "
                     f"got {pl.token_capacity}")
    if pl.time_limit_s <= 0:
        p.append(f"planner.time_limit_s must be > 0, got {pl.time_limit_s}")
    for name in ("tp", "pp"):
        if getattr(cfg.parallel, name) < 1:
            p.append(f"parallel.{name} must be >= 1, got {getattr(cfg.parallel, name)}")
    if cfg.parallel.defer_wgrad and cfg.parallel.pp == 1:
        p.append("parallel.defer_wgrad needs parallel.pp > 1 (one stage has no bubbles to "
                 "fill), got pp=1")
    if cfg.parallel.defer_wgrad and cfg.parallel.tp > 1 and cfg.parallel.sequence_parallel:
        p.append(f"parallel.defer_wgrad does not combine with parallel.sequence_parallel at "
                 f"tp={cfg.parallel.tp} (the deferred dA would need a TP all-reduce); set one "
                 "of them false")
    if cfg.parallel.tp >= 1 and m.vocab_size % cfg.parallel.tp:
        p.append(f"model.vocab_size must be divisible by parallel.tp ({cfg.parallel.tp}), "
                 f"got {m.vocab_size}")
    if m.rope_scaling_factor is not None and m.hf_path is None:
        p.append(f"model.rope_scaling_factor needs model.hf_path (random bases use plain RoPE), "
                 f"got {m.rope_scaling_factor}")
    if m.sliding_window is not None and cfg.data.max_seq_length > m.sliding_window:
        p.append(f"data.max_seq_length must be <= model.sliding_window ({m.sliding_window}) "
                 f"(longer samples would need windowed attention), got {cfg.data.max_seq_length}")
    t = cfg.train
    if (t.steps is None) == (t.epochs is None):
        p.append(f"train.steps or train.epochs must be set (exactly one), "
                 f"got steps={t.steps}, epochs={t.epochs}")
    for name in ("steps", "epochs"):
        if getattr(t, name) is not None and getattr(t, name) <= 0:
            p.append(f"train.{name} must be > 0, got {getattr(t, name)}")
    if t.save_every < 0:
        p.append(f"train.save_every must be >= 0, got {t.save_every}")
    if t.keep_last < 0:
        p.append(f"train.keep_last must be >= 0, got {t.keep_last}")
    if t.resume not in ("auto", "never") and not Path(t.resume).is_dir():
        p.append(f"train.resume must be 'auto', 'never' or an existing checkpoint folder, "
                 f"got {t.resume!r}")
    if not t.output_dir:
        p.append("train.output_dir must be a path, got ''")
    if cfg.logging.log_every <= 0:
        p.append(f"logging.log_every must be > 0, got {cfg.logging.log_every}")
    return p


def _validate_adapter(a: AdapterConfig, where: str, seen: set[str]) -> list[str]:
    p: list[str] = []
    if not a.name:
        p.append(f"{where}.name must be a non-empty string, got {a.name!r}")
    elif a.name in seen:
        p.append(f"{where}.name must be unique, got duplicate {a.name!r}")
    seen.add(a.name)
    if not 1 <= a.rank <= 256:
        p.append(f"{where}.rank must be in [1, 256], got {a.rank}")
    if a.alpha <= 0:
        p.append(f"{where}.alpha must be > 0, got {a.alpha}")
    if not 0.0 <= a.dropout < 1.0:
        p.append(f"{where}.dropout must be in [0, 1), got {a.dropout}")
    unknown = [t for t in a.target_modules if t not in TARGET_MODULES]
    if unknown or not a.target_modules:
        p.append(f"{where}.target_modules must be a non-empty subset of {list(TARGET_MODULES)}, "
                 f"got {a.target_modules}")
    if a.lr <= 0:
        p.append(f"{where}.lr must be > 0, got {a.lr}")
    if a.warmup_steps < 0:
        p.append(f"{where}.warmup_steps must be >= 0, got {a.warmup_steps}")
    if not 0.0 <= a.min_lr_ratio <= 1.0:
        p.append(f"{where}.min_lr_ratio must be in [0, 1], got {a.min_lr_ratio}")
    if a.weight_decay < 0:
        p.append(f"{where}.weight_decay must be >= 0, got {a.weight_decay}")
    if a.global_batch_size <= 0:
        p.append(f"{where}.global_batch_size must be > 0, got {a.global_batch_size}")
    return p


PROMPT_TEMPLATES = ("alpaca",)  # names registered in data/dataset.py
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")


def _validate_dataset(d: DatasetConfig, data: DataConfig, where: str) -> list[str]:
    p: list[str] = []
    local = Path(d.path).suffix in DATA_SUFFIXES or data.offline or Path(d.path).exists()
    if not d.path:
        p.append(f"{where}.path must name a data file or hub dataset, got ''")
    elif local and not Path(d.path).exists():
        p.append(f"{where}.path must be an existing file or folder, got {d.path!r} "
                 f"(not found from {Path.cwd()}"
                 + ("; data.offline forbids hub datasets)" if data.offline else ")"))
    if d.template is not None and d.template not in PROMPT_TEMPLATES and "{" not in d.template:
        p.append(f"{where}.template must be one of {list(PROMPT_TEMPLATES)} or a format string "
                 f"with {{field}} placeholders, got {d.template!r}")
    if d.messages_field is not None and data.tokenizer == "byte":
        p.append(f"{where}.messages_field needs a tokenizer with a chat template "
                 f"(data.tokenizer: a folder), got data.tokenizer='byte'")
    if d.messages_field is not None and d.template is not None:
        p.append(f"{where}.template must be unset with messages_field, got {d.template!r}")
    return p
