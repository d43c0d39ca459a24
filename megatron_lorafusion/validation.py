"""Cross-field rules of a job config: every rule checked once, every problem returned.

`config.load_config` calls `validate` after the keys and types are read; each problem reads
``<section>.<field> must be <rule>, got <value>``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_lorafusion.adapter_types import adapter_type
from megatron_lorafusion.targets import TARGET_MODULES

if TYPE_CHECKING:  # config calls validate: a runtime import back would be a cycle
    from megatron_lorafusion.config import (
        AdapterConfig,
        DataConfig,
        DatasetConfig,
        JobConfig,
        ModelConfig,
    )

__all__ = [
    "DATA_SUFFIXES",
    "MAX_SAMPLES",
    "PLAN_BYTES_PER_SAMPLE",
    "PROMPT_TEMPLATES",
    "adapter_name_problem",
    "held_out_rows",
    "host_memory",
    "launch_problems",
    "planned_samples_problems",
    "validate",
]

# An adapter's name is a folder name under the run's and the export's folder: no separators,
# no ".." or hidden names (temporary folders start with "."), bounded length.
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""A model folder holding neither has no tokenizer that ``AutoTokenizer`` finds."""


def _has_chat_template(tokenizer: str) -> bool:
    """Whether ``AutoTokenizer`` finds a chat template in ``data.tokenizer``'s folder.

    It reads ``chat_template.jinja``, ``additional_chat_templates/*.jinja`` and the
    ``chat_template`` entry of ``tokenizer_config.json``; an unreadable config counts as a
    template here (loading the tokenizer reports it).
    """
    if tokenizer == "byte":
        return False
    folder = Path(tokenizer)
    if (folder / "chat_template.jinja").is_file() or any(
        (folder / "additional_chat_templates").glob("*.jinja")
    ):
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True
    return not isinstance(config, dict) or bool(config.get("chat_template"))


_NAME_MAX, _PATH_MAX = 255, 4096  # bytes: Linux's limits on one file name and on a path
_NO_STORAGE = (
    "proc",
    "sysfs",
    "cgroup",
    "cgroup2",
    "devpts",
    "debugfs",
    "tracefs",
    "securityfs",
    "configfs",
    "pstore",
    "bpf",
    "efivarfs",
)
"""Pseudo file systems: mkdir there fails (/proc answers ENOENT), whatever access says."""


def _path_problem(path: str, key: str) -> str | None:
    """Why ``path`` cannot name a file on this machine (NUL byte, name too long), or None."""
    if "\0" in path:
        return f"{key} must be a path without NUL bytes, got {path!r}"
    try:
        raw = os.fsencode(path)
    except UnicodeEncodeError as err:
        return f"{key} must be a path of valid text, got {path!r} ({err.reason})"
    longest = max(len(name) for name in raw.split(b"/"))
    if longest > _NAME_MAX or len(raw) >= _PATH_MAX:
        return (
            f"{key} must be a path of names of at most {_NAME_MAX} bytes ({_PATH_MAX} in "
            f"all), got {path!r} (a name of {longest} bytes, {len(raw)} in all)"
        )
    return None


def _exists(path: str | Path) -> bool:
    """``Path.exists``, False where the file system refuses to answer (a name too long)."""
    try:
        return Path(path).exists()
    except (OSError, ValueError):
        return False


def _is_dir(path: str | Path) -> bool:
    """``Path.is_dir``, False where the file system refuses to answer."""
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False


def _pseudo_file_system(folder: Path) -> str | None:
    """The type of the pseudo file system (`_NO_STORAGE`) holding ``folder``, or None."""
    try:
        mounts = Path("/proc/self/mounts").read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError):  # not Linux: nothing known
        return None
    target, point, kind = str(folder.resolve()), "", None
    for line in mounts:
        at, fs = line.split()[1:3]  # mount points with spaces (\040) never match: no harm
        if (target == at or target.startswith(at.rstrip("/") + "/")) and len(at) > len(point):
            point, kind = at, fs
    return kind if kind in _NO_STORAGE else None


def _folder_problem(path: str, key: str) -> str | None:
    """Why a run cannot make (or write in) the folder ``path``, or None.

    The nearest existing folder on the way must be a writable folder on a file system that
    stores files.
    """
    if (problem := _path_problem(path, key)) is not None:
        return problem
    at = Path(path)
    while not _exists(at) and at != at.parent:
        at = at.parent
    if not _is_dir(at):
        return f"{key} must be a folder (or a new path), got {path!r} ({str(at)!r} is a file)"
    if (fs := _pseudo_file_system(at)) is not None:
        return f"{key} must be a folder on a file system that stores files, got {path!r} ({fs})"
    if not os.access(at, os.W_OK | os.X_OK):
        return f"{key} must be a folder this process can write, got {path!r} ({str(at)!r} is not)"
    return None


def adapter_name_problem(name: object, where: str) -> str | None:
    """Why ``name`` is not a safe adapter (folder) name, or None when it is."""
    if isinstance(name, str) and _ADAPTER_NAME.fullmatch(name):
        return None
    return (
        f"{where} must be 1 to 100 letters, digits, '-', '_' or '.', not starting with "
        f"'.', got {name!r}"
    )


# Upper bounds far above any real job: they stop a typo (10**18) before it allocates or runs
# for hours. Model sizes cover Llama-3.1-405B several times over.
_MODEL_MAX = dict(
    num_layers=1024,
    hidden_size=1 << 17,
    ffn_hidden_size=1 << 19,
    num_attention_heads=1024,
    num_query_groups=1024,
    vocab_size=1 << 22,
    max_position_embeddings=1 << 24,
)
_SEED_MAX = 2**32 - 1  # numpy's and Philox's seed range
_MAX_STEPS = 10**7  # optimizer steps, epochs, warm-up, and every interval counted in steps
_FP32_MAX = 3.4028234663852886e38  # adapter weights, their scale and AdamW's state are fp32
MAX_SAMPLES = 10**8
"""Most samples one run may plan, summed over its adapters (``steps × global_batch_size``
or ``epochs × rows`` each): the run holds every planned sample in host memory
(`PLAN_BYTES_PER_SAMPLE`: ~100 GB at this cap) and plans them all before its first step
(greedy: 2.3-2.6 s per 100,000, ~40 minutes at this cap)."""
PLAN_BYTES_PER_SAMPLE = 1024
"""Host memory a planned sample takes, in bytes, rounded up from a measured ~660: ~190 in
the trainer (its place in the training order, its length, the plan check) and ~470 in the
planner worker while it plans the run (greedy, 400,000 samples)."""

GRAPH_PAD_TOKENS = 256
"""With ``train.cuda_graphs`` microbatches are padded to a multiple of this many tokens, so
their shapes repeat: one adapter's microbatches of 2k-8k tokens fall into ~20 shapes, for
~128 padding tokens each (~3 % of a 4.5k-token microbatch)."""


def graph_blockers(cfg: JobConfig) -> list[str]:
    """What in ``cfg`` keeps CUDA graphs off (``train.cuda_graphs``), one phrase each.

    The machine's part (a GPU with FlashAttention, one process) is `recipe.graphs_apply`'s.
    """
    t = cfg.train
    return [
        reason
        for reason, applies in (
            ("train.device is cpu", t.device == "cpu"),
            (f"parallel.tp is {cfg.parallel.tp}", cfg.parallel.tp > 1),
            (f"parallel.pp is {cfg.parallel.pp}", cfg.parallel.pp > 1),
            ("train.recompute is 'full'", t.recompute == "full"),
            (f"train.precision is '{t.precision}'", t.precision == "fp32"),
            ("an adapter uses DoRA", any(a.use_dora for a in cfg.adapters)),
            ("a server trains eagerly (lorafusion serve)", cfg.server is not None),
            (
                f"model.base_precision is '{cfg.model.base_precision}'",
                cfg.model.base_precision != "bf16",
            ),
            (
                f"planner.token_capacity {cfg.planner.token_capacity} is not a multiple "
                f"of {GRAPH_PAD_TOKENS} (microbatches are padded to one)",
                cfg.planner.token_capacity % GRAPH_PAD_TOKENS != 0,
            ),
        )
        if applies
    ]


def _non_finite(node: object, where: str) -> list[str]:
    """Every float field of a config tree that is NaN or infinite."""
    p = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            at = f"{where}.{f.name}" + ("" if i is None else f".{i}")
            if dataclasses.is_dataclass(item):
                p.extend(_non_finite(item, at))
            elif isinstance(item, float) and not math.isfinite(item):
                p.append(f"{at} must be a finite number, got {item}")
    return p


_LAYER_TYPES = ("full_attention", "sliding_attention")


def _validate_layers(m: ModelConfig) -> list[str]:
    """The head size, attention windows, RoPE variants and family of ``model``."""
    p = []
    if m.head_dim is not None and not (0 < m.head_dim <= 4096 and m.head_dim % 2 == 0):
        p.append(f"model.head_dim must be an even number in [2, 4096] (RoPE), got {m.head_dim}")
    if m.sliding_window is not None and m.sliding_window <= 0:
        p.append(f"model.sliding_window must be > 0 tokens, got {m.sliding_window}")
    if m.layer_types is not None:
        wrong = sorted({t for t in m.layer_types if t not in _LAYER_TYPES}, key=str)
        if wrong:
            p.append(f"model.layer_types must hold only {list(_LAYER_TYPES)}, got {wrong}")
        if not m.layer_types:
            p.append("model.layer_types must list at least one type (or be null), got []")
        if "sliding_attention" in m.layer_types and m.sliding_window is None:
            p.append("model.sliding_window must be set for sliding_attention layers, got None")
    for name in ("rope_local_theta", "rope_linear_factor", "query_pre_attn_scalar"):
        value = getattr(m, name)
        if value is not None and value <= 0:
            p.append(f"model.{name} must be > 0, got {value}")
    if m.rope_linear_factor is not None and m.rope_scaling_factor is not None:
        p.append(
            f"model.rope_linear_factor must be unset with model.rope_scaling_factor (one RoPE "
            f"scaling), got {m.rope_linear_factor}"
        )
    if m.hf_multimodal and (m.family != "gemma3" or m.hf_path is None):
        p.append(
            f"model.hf_multimodal must be false unless model.hf_path is a Gemma 3 checkpoint "
            f"(it is set from there), got true with family {m.family!r}"
        )
    return p


def _validate_numbers(cfg: JobConfig) -> list[str]:
    """Finite floats, positive and bounded sizes, seeds and step counts in range."""
    p = [q.removeprefix("job.") for q in _non_finite(cfg, "job")]
    m, t = cfg.model, cfg.train
    for name, top in _MODEL_MAX.items():
        if not 0 < getattr(m, name) <= top:
            p.append(f"model.{name} must be in [1, {top}], got {getattr(m, name)}")
    for name, value in (
        ("model.init_method_std", m.init_method_std),
        ("model.rope_theta", m.rope_theta),
    ):
        if value <= 0:
            p.append(f"{name} must be > 0, got {value}")
    if m.init_method_std > 1:
        p.append(f"model.init_method_std must be <= 1, got {m.init_method_std}")
    if not 0 < m.norm_epsilon < 1:
        p.append(f"model.norm_epsilon must be in (0, 1), got {m.norm_epsilon}")
    if m.rope_scaling_factor is not None and m.rope_scaling_factor <= 0:
        p.append(f"model.rope_scaling_factor must be > 0, got {m.rope_scaling_factor}")
    for name, value in (("model.init_seed", m.init_seed), ("train.seed", t.seed)):
        if not 0 <= value <= _SEED_MAX:
            p.append(f"{name} must be in [0, {_SEED_MAX}], got {value}")
    for name in ("steps", "epochs", "save_every", "keep_last", "eval_every"):
        if getattr(t, name) is not None and getattr(t, name) > _MAX_STEPS:
            p.append(f"train.{name} must be <= {_MAX_STEPS}, got {getattr(t, name)}")
    if cfg.logging.log_every > _MAX_STEPS:
        p.append(f"logging.log_every must be <= {_MAX_STEPS}, got {cfg.logging.log_every}")
    for i, a in enumerate(cfg.adapters):
        for name in ("lr", "alpha", "weight_decay"):
            if math.isfinite(getattr(a, name)) and getattr(a, name) > _FP32_MAX:
                p.append(
                    f"adapters.{i}.{name} must be <= {_FP32_MAX:.4g} (the largest fp32 "
                    f"number), got {getattr(a, name)}"
                )
        for name in ("warmup_steps", "early_stopping_patience"):
            if getattr(a, name) > _MAX_STEPS:
                p.append(f"adapters.{i}.{name} must be <= {_MAX_STEPS}, got {getattr(a, name)}")
        if a.global_batch_size > MAX_SAMPLES:
            p.append(
                f"adapters.{i}.global_batch_size must be <= {MAX_SAMPLES} (the samples a run "
                f"may plan), got {a.global_batch_size}"
            )
    if t.steps is not None and 0 < t.steps <= _MAX_STEPS:
        if all(0 < a.global_batch_size <= MAX_SAMPLES for a in cfg.adapters):
            p.extend(planned_samples_problems(cfg, [None] * len(cfg.adapters)))
    if cfg.planner.token_capacity > 1 << 24:
        p.append(f"planner.token_capacity must be <= {1 << 24}, got {cfg.planner.token_capacity}")
    if cfg.planner.time_limit_s > 3600:
        p.append(f"planner.time_limit_s must be <= 3600, got {cfg.planner.time_limit_s}")
    return p


def _fp8_problems(cfg: JobConfig) -> list[str]:
    """``model.base_precision: fp8``: widths its scaled GEMMs can take, no DoRA adapter."""
    m, tp = cfg.model, max(cfg.parallel.tp, 1)
    if m.base_precision != "fp8":
        return []
    p = []
    for name in ("hidden_size", "ffn_hidden_size"):
        if getattr(m, name) % (16 * tp):
            p.append(
                f"model.{name} must be a multiple of 16·parallel.tp = {16 * tp} with "
                f"model.base_precision: fp8 (FP8 GEMMs take 16-element multiples per "
                f"tensor-parallel shard), got {getattr(m, name)}"
            )
    head = m.head_dim or (m.hidden_size // m.num_attention_heads if m.num_attention_heads else 16)
    if head % 16:
        p.append(
            f"model.head_dim (or model.hidden_size / model.num_attention_heads: the head dim) "
            f"must be a multiple of 16 with model.base_precision: fp8, got {head}"
        )
    for i, a in enumerate(cfg.adapters):
        if a.use_dora:
            p.append(
                f"adapters.{i}.use_dora must be false with model.base_precision: fp8 (DoRA's "
                f"column norms read the full-precision base weight), got true"
            )
    return p


def validate(cfg: JobConfig) -> list[str]:
    """Every cross-field rule of a job, checked once; returns the problems found."""
    p: list[str] = _validate_numbers(cfg)
    m = cfg.model
    if m.head_dim is None and m.num_attention_heads > 0 and m.hidden_size % m.num_attention_heads:
        p.append(
            f"model.hidden_size must be divisible by model.num_attention_heads "
            f"({m.num_attention_heads}) unless model.head_dim is set, got {m.hidden_size}"
        )
    p.extend(_validate_layers(m))
    if m.num_query_groups > 0 and m.num_attention_heads % m.num_query_groups:
        p.append(
            f"model.num_query_groups must divide model.num_attention_heads "
            f"({m.num_attention_heads}), got {m.num_query_groups}"
        )
    if cfg.train.precision == "fp16":  # fp16 gradients underflow without a loss scale
        p.append(
            "train.precision must be 'bf16' or 'fp32' (fp16 would need dynamic loss scaling, "
            "which is not implemented; bf16 takes the same memory), got 'fp16'"
        )
    if cfg.data.tokenizer == "byte" and m.vocab_size < 259:
        p.append(f"model.vocab_size must be >= 259 for the byte tokenizer, got {m.vocab_size}")
    tokenizer = cfg.data.tokenizer
    if tokenizer != "byte" and (problem := _path_problem(tokenizer, "data.tokenizer")):
        p.append(problem)
    elif tokenizer != "byte" and not _is_dir(tokenizer):
        p.append(
            f"data.tokenizer must be 'byte' or an existing tokenizer folder, "
            f"got {cfg.data.tokenizer!r}"
        )
    elif cfg.data.tokenizer == m.hf_path and not any(
        (Path(m.hf_path) / f).is_file() for f in _TOKENIZER_FILES
    ):
        p.append(
            f"data.tokenizer must be a folder with {' or '.join(_TOKENIZER_FILES)} (it "
            f"defaults to model.hf_path), or 'byte' to train on byte ids, "
            f"got {cfg.data.tokenizer!r}"
        )
    if cfg.server is not None:
        p.extend(_validate_server(cfg))
    elif not cfg.adapters:
        p.append("adapters must list at least one adapter, got none")
    seen: set[str] = set()
    for i, a in enumerate(cfg.adapters):
        p.extend(_validate_adapter(a, f"adapters.{i}", seen))
        p.extend(adapter_type(a).problems(a, f"adapters.{i}", cfg.parallel.tp))
        p.extend(_validate_dataset(a.dataset, cfg.data, f"adapters.{i}.dataset", a.name))
        p.extend(_validate_eval(a, cfg, f"adapters.{i}"))
    if cfg.data.max_seq_length <= 0:
        p.append(f"data.max_seq_length must be > 0, got {cfg.data.max_seq_length}")
    if cfg.data.max_seq_length > m.max_position_embeddings:
        p.append(
            f"data.max_seq_length must be <= model.max_position_embeddings "
            f"({m.max_position_embeddings}), got {cfg.data.max_seq_length}"
        )
    pl = cfg.planner
    if pl.tile_height <= 0:
        p.append(f"planner.tile_height must be > 0, got {pl.tile_height}")
    elif cfg.data.max_seq_length > 0:
        longest = -(-cfg.data.max_seq_length // pl.tile_height) * pl.tile_height
        if pl.token_capacity < longest:
            p.append(
                f"planner.token_capacity must hold one sample of data.max_seq_length "
                f"({cfg.data.max_seq_length} tokens, {longest} with tile padding), "
                f"got {pl.token_capacity}"
            )
    if pl.time_limit_s <= 0:
        p.append(f"planner.time_limit_s must be > 0, got {pl.time_limit_s}")
    for name in ("tp", "pp"):
        if getattr(cfg.parallel, name) < 1:
            p.append(f"parallel.{name} must be >= 1, got {getattr(cfg.parallel, name)}")
    if cfg.parallel.defer_wgrad and cfg.parallel.pp == 1:
        p.append(
            "parallel.defer_wgrad needs parallel.pp > 1 (one stage has no bubbles to "
            "fill), got pp=1"
        )
    if cfg.parallel.defer_wgrad and cfg.parallel.tp > 1 and cfg.parallel.sequence_parallel:
        p.append(
            f"parallel.defer_wgrad does not combine with parallel.sequence_parallel at "
            f"tp={cfg.parallel.tp} (the deferred dA would need a TP all-reduce); set one "
            "of them false"
        )
    if cfg.parallel.tp >= 1 and m.vocab_size % cfg.parallel.tp:
        p.append(
            f"model.vocab_size must be divisible by parallel.tp ({cfg.parallel.tp}), "
            f"got {m.vocab_size}"
        )
    if m.rope_scaling_factor is not None and m.hf_path is None:
        p.append(
            f"model.rope_scaling_factor needs model.hf_path (random bases use plain RoPE), "
            f"got {m.rope_scaling_factor}"
        )
    p.extend(_fp8_problems(cfg))
    t = cfg.train
    if (t.steps is None) == (t.epochs is None):
        p.append(
            f"train.steps or train.epochs must be set (exactly one), "
            f"got steps={t.steps}, epochs={t.epochs}"
        )
    for name in ("steps", "epochs"):
        if getattr(t, name) is not None and getattr(t, name) <= 0:
            p.append(f"train.{name} must be > 0, got {getattr(t, name)}")
    if t.save_every < 0:
        p.append(f"train.save_every must be >= 0, got {t.save_every}")
    if t.keep_last < 0:
        p.append(f"train.keep_last must be >= 0, got {t.keep_last}")
    if t.eval_every < 0:
        p.append(f"train.eval_every must be >= 0, got {t.eval_every}")
    if t.save_buffer_gib is not None and not t.save_buffer_gib > 0:
        p.append(f"train.save_buffer_gib must be > 0 GiB, got {t.save_buffer_gib}")
    if t.cuda_graphs is True and (why_not := graph_blockers(cfg)):
        p.append(
            "train.cuda_graphs: true needs one process on a GPU with a bf16 base, without "
            f"full recompute or DoRA adapters, but {', '.join(why_not)} (set it to false "
            "or auto)"
        )
    if not t.output_dir:
        p.append("train.output_dir must be a path, got ''")
    elif cfg.server is None and (problem := _output_dir_problem(cfg)) is not None:
        p.append(problem)
    if cfg.logging.log_every <= 0:
        p.append(f"logging.log_every must be > 0, got {cfg.logging.log_every}")
    if cfg.data.cache_dir is not None and (
        problem := _folder_problem(cfg.data.cache_dir, "data.cache_dir")
    ):
        p.append(problem)
    return p


def planned_samples_problems(cfg: JobConfig, rows: Sequence[tuple[int, bool] | None]) -> list[str]:
    """The samples the run plans against `MAX_SAMPLES` and this machine's free memory.

    Under ``train.steps`` the count is known from the job; under ``train.epochs`` it is
    ``epochs × rows`` per adapter, so ``rows`` must say what the data holds: ``validate``
    (the CLI) passes what the first rows of each file told it, training the exact counts.

    Args:
        cfg: the job.
        rows: per adapter, ``(n, exact)``: the rows it trains on (``exact`` False: at least
            ``n``), or None when unknown. Read only under ``train.epochs``.

    Returns:
        One problem naming the keys and the adapter with the most samples, or none.
    """
    t = cfg.train
    if t.steps is not None:
        per = {i: (t.steps * a.global_batch_size, True) for i, a in enumerate(cfg.adapters)}
    elif t.epochs is not None:
        per = {i: (t.epochs * r[0], r[1]) for i, r in enumerate(rows) if r is not None}
    else:
        return []
    if not per:
        return []
    total = sum(n for n, _ in per.values())
    exact = len(per) == len(cfg.adapters) and all(e for _, e in per.values())
    top = max(per, key=lambda i: per[i][0])
    if t.steps is not None:
        what = f"train.steps × adapters.{top}.global_batch_size"
        got = f"{t.steps} × {cfg.adapters[top].global_batch_size}"
    else:
        what = f"train.epochs × the rows of adapters.{top}'s dataset"
        got = f"{t.epochs} × {'' if per[top][1] else 'at least '}{rows[top][0]} rows"
    if total > per[top][0]:
        got += f", and {total - per[top][0]}{'' if exact else ' or more'} samples of other adapters"
    if total > MAX_SAMPLES:
        return [
            f"{what} must be <= {MAX_SAMPLES} samples summed over the adapters (a run holds "
            f"every planned sample in host memory, ~{PLAN_BYTES_PER_SAMPLE} bytes apiece), "
            f"got {got}"
        ]
    free = host_memory()
    if free is not None and total * PLAN_BYTES_PER_SAMPLE > free[0]:
        return [
            f"{what} must fit in this machine's memory: {total} samples take "
            f"~{total * PLAN_BYTES_PER_SAMPLE / 2**30:.1f} GiB of host memory to plan "
            f"(~{PLAN_BYTES_PER_SAMPLE} bytes apiece), and {free[0] / 2**30:.1f} GiB is free "
            f"({free[1]}); got {got}"
        ]
    return []


def held_out_rows(fraction: float, rows: int) -> int:
    """Rows that ``eval_fraction`` holds out of ``rows`` for evaluation.

    ``round(fraction × rows)``, at least one and at most all but one; none of a single row
    or at fraction 0.
    """
    if fraction <= 0 or rows <= 1:
        return 0
    return min(max(round(fraction * rows), 1), rows - 1)


def host_memory() -> tuple[int, str] | None:
    """Host memory this process may still allocate, in bytes, and the limit that sets it.

    The least of: ``MemAvailable`` of ``/proc/meminfo``, the headroom under this process's
    cgroup v2 ``memory.max`` and under its address-space limit (``ulimit -v``, which
    counts mapped libraries too). None where none of them is known (not Linux).
    """
    found = []
    try:
        info = Path("/proc/meminfo").read_text(encoding="utf-8")
        if m := re.search(r"^MemAvailable:\s+(\d+) kB", info, re.MULTILINE):
            found.append((int(m.group(1)) << 10, "/proc/meminfo's MemAvailable"))
        own = Path("/proc/self/cgroup").read_text(encoding="utf-8")
        if m := re.search(r"^0::(/.*)$", own, re.MULTILINE):
            group = Path("/sys/fs/cgroup") / m.group(1).lstrip("/")
            top = (group / "memory.max").read_text(encoding="utf-8").strip()
            if top != "max":
                used = int((group / "memory.current").read_text(encoding="utf-8"))
                found.append((int(top) - used, "the cgroup's memory.max"))
    except (OSError, ValueError):  # not Linux, no cgroup v2, no memory controller
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        status = Path("/proc/self/status").read_text(encoding="utf-8")
        mapped = re.search(r"^VmSize:\s+(\d+) kB", status, re.MULTILINE)
        if soft != resource.RLIM_INFINITY and mapped:
            found.append((soft - (int(mapped.group(1)) << 10), "the address-space limit"))
    except (ImportError, OSError, ValueError):
        pass
    return min(found) if found else None


def launch_problems(cfg: JobConfig, environ: dict[str, str] | None = None) -> list[str]:
    """The layout against this launch: tp × pp must divide the world size.

    Kept out of `validate` (a job file is valid for some launch); the CLI checks it for the
    process it runs in, where ``WORLD_SIZE`` unset means a one-process run.
    """
    environ = os.environ if environ is None else environ
    text = environ.get("WORLD_SIZE", "1")
    try:
        world = int(text)
    except ValueError:
        return [f"WORLD_SIZE must be a positive integer (torchrun sets it), got {text!r}"]
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if world >= 1 and tp >= 1 and pp >= 1 and world % (tp * pp):
        run = "a one-process run" if world == 1 else f"WORLD_SIZE={world}"
        return [
            f"parallel.tp × parallel.pp must divide the number of processes ({run}), got "
            f"tp={tp}, pp={pp}; launch with torchrun --nproc-per-node <multiple of "
            f"{tp * pp}> or set parallel.tp=1 parallel.pp=1"
        ]
    return []


def _is_run_folder(out: Path) -> bool:
    """Whether ``out`` holds a run of ours: its job.json, or a checkpoints/ folder."""
    try:
        job = json.loads((out / "job.json").read_text(encoding="utf-8"))
        if isinstance(job, dict) and {"adapters", "train"} <= job.keys():
            return True
    except (OSError, ValueError):
        pass
    return (out / "checkpoints").is_dir()


def _output_dir_problem(cfg: JobConfig) -> str | None:
    """Why ``train.output_dir`` may not be written, or None.

    A run writes only into a new or empty folder, an earlier run of its own, or a folder that
    holds nothing but this job's inputs (the demo keeps its data under its run folder).
    """
    out = Path(cfg.train.output_dir)
    if _exists(out) and not out.is_dir():
        return f"train.output_dir must be a folder, got {str(out)!r} (a file)"
    if (problem := _folder_problem(cfg.train.output_dir, "train.output_dir")) is not None:
        return problem
    if not _exists(out):
        return None
    try:
        entries = sorted(out.iterdir())
    except OSError as err:
        return f"train.output_dir must be a readable folder, got {str(out)!r} ({err.strerror})"
    if not entries or _is_run_folder(out) or cfg.train.overwrite:
        return None
    named = [a.dataset.path for a in cfg.adapters]
    named += [cfg.data.cache_dir, cfg.data.tokenizer, cfg.model.hf_path]
    inputs = [Path(q).resolve() for q in named if q and "\0" not in q]  # NUL: named elsewhere
    foreign = [
        e.name
        for e in entries
        if not any(i == e.resolve() or e.resolve() in i.parents for i in inputs)
    ]
    if not foreign:
        return None
    return (
        f"train.output_dir must be a new or empty folder or a lorafusion run (job.json, "
        f"checkpoints/), got {str(out)!r}, which holds {foreign[:3]}"
        f"{' and more' if len(foreign) > 3 else ''}; choose another folder (or set "
        f"train.overwrite: true to write there anyway)"
    )


def _validate_adapter(a: AdapterConfig, where: str, seen: set[str]) -> list[str]:
    p: list[str] = []
    if (problem := adapter_name_problem(a.name, f"{where}.name")) is not None:
        p.append(problem)
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
        p.append(
            f"{where}.target_modules must be a non-empty subset of {list(TARGET_MODULES)}, "
            f"got {a.target_modules}"
        )
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
    if a.max_grad_norm < 0:
        p.append(f"{where}.max_grad_norm must be >= 0 (0 = no clipping), got {a.max_grad_norm}")
    if not 0 < a.loraplus_lr_ratio <= 1e4:
        p.append(
            f"{where}.loraplus_lr_ratio must be in (0, 1e4] (B's lr over A's; 1 = off), "
            f"got {a.loraplus_lr_ratio}"
        )
    return p


def _validate_server(cfg: JobConfig) -> list[str]:
    """A server's section: its root, sizes, and no adapters of its own (they are submitted)."""
    s = cfg.server
    p: list[str] = []
    if cfg.adapters:
        p.append(
            f"adapters must be empty in a server's job file (jobs join with lorafusion "
            f"submit --server {s.root or 'ROOT'} JOB.yaml), got {len(cfg.adapters)}"
        )
    if not s.root:
        p.append("server.root must be a folder path, got ''")
    elif (problem := _folder_problem(s.root, "server.root")) is not None:
        p.append(problem)
    if s.max_adapters < 1:
        p.append(f"server.max_adapters must be >= 1, got {s.max_adapters}")
    if not 1 <= s.max_rank <= 256:
        p.append(f"server.max_rank must be in [1, 256], got {s.max_rank}")
    if s.idle_timeout_s < 0:
        p.append(f"server.idle_timeout_s must be >= 0 seconds (0: never), got {s.idle_timeout_s}")
    if not s.poll_s > 0:
        p.append(f"server.poll_s must be > 0 seconds, got {s.poll_s}")
    return p


def _validate_eval(a: AdapterConfig, cfg: JobConfig, where: str) -> list[str]:
    """Evaluation and early-stopping rules of one adapter (issue 16)."""
    p: list[str] = []
    if not 0.0 <= a.eval_fraction < 1.0:
        p.append(f"{where}.eval_fraction must be in [0, 1), got {a.eval_fraction}")
    if a.eval_dataset is not None:
        p.extend(_validate_dataset(a.eval_dataset, cfg.data, f"{where}.eval_dataset", a.name))
        if a.eval_fraction > 0:
            p.append(
                f"{where}.eval_fraction must be 0 with eval_dataset (one eval source), "
                f"got {a.eval_fraction}"
            )
    if a.early_stopping_patience < 0:
        p.append(f"{where}.early_stopping_patience must be >= 0, got {a.early_stopping_patience}")
    elif a.early_stopping_patience > 0 and (
        cfg.train.eval_every <= 0 or (a.eval_dataset is None and a.eval_fraction == 0)
    ):
        p.append(
            f"{where}.early_stopping_patience needs evaluation (train.eval_every > 0 and "
            f"an eval_dataset or eval_fraction), got eval_every={cfg.train.eval_every}, "
            f"eval_fraction={a.eval_fraction}"
        )
    return p


PROMPT_TEMPLATES = ("alpaca",)  # names registered in data/templates.py
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")


class _AnyField(dict):
    """A row that has every field, as text: formatting with it finds a broken template."""

    def __missing__(self, key: str) -> str:
        return "text"


def _template_problem(template: str) -> str | None:
    """Why ``template`` cannot be filled from a row of text fields, or None."""
    try:
        fields = [n for _, n, _, _ in string.Formatter().parse(template) if n is not None]
        positional = [n for n in fields if n == "" or n.isdigit()]
        if positional:
            return f"positional placeholder {{{positional[0]}}}"
        template.format_map(_AnyField())
    except (ValueError, KeyError, IndexError, AttributeError, TypeError) as err:
        return str(err) or type(err).__name__
    return None


def _validate_dataset(d: DatasetConfig, data: DataConfig, where: str, name: str) -> list[str]:
    p: list[str] = []
    local = Path(d.path).suffix in DATA_SUFFIXES or data.offline or _exists(d.path)
    if not d.path:
        p.append(f"{where}.path must name a data file or hub dataset, got ''")
    elif (problem := _path_problem(d.path, f"{where}.path")) is not None:
        p.append(problem)
    elif local and not _exists(d.path):
        p.append(
            f"{where}.path must be an existing file or folder, got {d.path!r} "
            f"(not found from {Path.cwd()}"
            + ("; data.offline forbids hub datasets)" if data.offline else ")")
        )
    if local and _is_dir(d.path) and not any(f.is_file() for f in Path(d.path).rglob("*")):
        p.append(
            f"{where}.path must be a data file or a folder of data files, got "
            f"{d.path!r} (an empty folder)"
        )
    if d.template is not None and d.template not in PROMPT_TEMPLATES and "{" not in d.template:
        p.append(
            f"{where}.template must be one of {list(PROMPT_TEMPLATES)} or a format string "
            f"with {{field}} placeholders, got {d.template!r}"
        )
    elif d.template is not None and d.template not in PROMPT_TEMPLATES:
        if (problem := _template_problem(d.template)) is not None:
            p.append(
                f"{where}.template must be a format string with named {{field}} "
                f"placeholders ({{{{ and }}}} for braces), got {d.template!r} ({problem})"
            )
    tokenizer_named = data.tokenizer == "byte" or _is_dir(data.tokenizer)  # else reported
    if d.messages_field is not None and tokenizer_named and not _has_chat_template(data.tokenizer):
        p.append(
            f"{where}.messages_field needs a tokenizer with a chat template, got "
            f"data.tokenizer={data.tokenizer!r}, which has none (adapter {name!r}, "
            f"dataset {d.path!r}); use a tokenizer folder with chat_template.jinja or a "
            f"chat_template in tokenizer_config.json, or prompt_field/response_field"
        )
    if d.messages_field is not None and d.template is not None:
        p.append(f"{where}.template must be unset with messages_field, got {d.template!r}")
    return p
