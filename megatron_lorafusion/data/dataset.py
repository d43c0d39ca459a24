"""Per-adapter datasets: rows → token ids, labels and loss masks, cached on disk.

A row gives a prompt and a response (two fields, or a template filled from the row) or a chat
(rendered with the tokenizer's chat template). A sample of ``L`` tokens
``[bos] prompt response [eos]`` trains on ``L - 1`` positions: input ``ids[:-1]``, target
``ids[1:]``; by default only targets inside the response (and eos), or inside assistant turns,
count. Tokenised datasets are cached under ``data.cache_dir`` keyed by everything they depend
on, and reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megatron_lorafusion.config import AdapterConfig, DataConfig, DatasetConfig, JobConfig
from megatron_lorafusion.data._errors import DataError
from megatron_lorafusion.data.hf import RawRows, dataset_identity, read_first_rows, read_rows
from megatron_lorafusion.data.templates import PROMPT_TEMPLATES
from megatron_lorafusion.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from megatron_lorafusion.validation import held_out_rows, planned_samples_problems

logger = logging.getLogger(__name__)

__all__ = [
    "PROMPT_TEMPLATES",
    "DataError",
    "TokenizedSample",
    "load_adapter_dataset",
    "probe_adapter_dataset",
    "probe_job_datasets",
    "training_order",
]

_CACHE_VERSION = 2  # 2: truncation cuts the prompt first, samples without a trained token go


@dataclass(frozen=True)
class TokenizedSample:
    """One training sample.

    Attributes:
        input_ids: (L,) token ids fed to the model.
        labels: (L,) next-token targets.
        loss_mask: (L,) 1 where the target is trained on, else 0.
    """

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    loss_mask: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.input_ids)


class _BadRow(Exception):
    """A row that does not fit the dataset config; the message says why."""


def _text(row: dict, key: str) -> str:
    if key not in row:
        raise _BadRow(f"field {key!r} is missing")
    if not isinstance(row[key], str):
        raise _BadRow(f"field {key!r} must be a string, got {type(row[key]).__name__}")
    return row[key]


def _prompt(row: dict, d: DatasetConfig) -> str:
    if d.template is None:
        return _text(row, d.prompt_field)
    if d.template in PROMPT_TEMPLATES:
        with_input, without = PROMPT_TEMPLATES[d.template]
        template = with_input if row.get("input") else without
    else:
        template = d.template
    try:
        return template.format_map({k: v for k, v in row.items() if isinstance(v, str)})
    except KeyError as err:
        raise _BadRow(f"template field {err.args[0]!r} is missing or not a string") from None


def _chat(row: dict, d: DatasetConfig) -> list[dict]:
    messages = row.get(d.messages_field)
    if not isinstance(messages, list) or not messages:
        raise _BadRow(f"field {d.messages_field!r} must be a non-empty list of messages")
    for m in messages:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise _BadRow(f"each message must have string 'role' and 'content', got {m!r}")
    if not any(m["role"] == "assistant" for m in messages):
        raise _BadRow("the chat has no assistant turn to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _row_tokens(row, d: DatasetConfig, tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of one row and, per id, 1 where it belongs to the response."""
    if not isinstance(row, dict):
        raise _BadRow(f"a row must be an object, got {type(row).__name__}")
    if d.messages_field is not None:
        return tokenizer.chat(_chat(row, d))
    prompt, response = _prompt(row, d), _text(row, d.response_field)
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    prompt_ids = bos + tokenizer.encode(prompt)
    response_ids = tokenizer.encode(response) + [tokenizer.eos_id]
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


def _cache_path(adapter: AdapterConfig, data: DataConfig, tokenizer: Tokenizer) -> Path | None:
    if data.cache_dir is None:
        return None
    d = adapter.dataset
    key = {
        "version": _CACHE_VERSION,
        "source": dataset_identity(d),
        "dataset": dataclasses.asdict(d),
        "tokenizer": tokenizer.identity(),
        "policy": [data.max_seq_length, data.truncation, data.train_on_prompt, data.bad_rows],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return Path(data.cache_dir) / "tokenized" / f"{digest}.pt"


def _save_cache(path: Path, samples: list[TokenizedSample]) -> None:
    flat = {
        name: torch.tensor([t for s in samples for t in getattr(s, name)], dtype=torch.int64)
        for name in ("input_ids", "labels", "loss_mask")
    }
    flat["lengths"] = torch.tensor([len(s) for s in samples], dtype=torch.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save(flat, tmp)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one


def _load_cache(path: Path) -> list[TokenizedSample] | None:
    try:
        flat = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a damaged cache file is rebuilt, never trusted
        logger.warning("ignoring unreadable dataset cache %s: %r", path, err)
        return None
    columns = {name: flat[name].tolist() for name in ("input_ids", "labels", "loss_mask")}
    samples, start = [], 0
    for length in flat["lengths"].tolist():
        part = [tuple(columns[n][start : start + length]) for n in columns]
        samples.append(TokenizedSample(*part))
        start += length
    return samples


def _truncate(ids: list[int], trained: list[int], keep: int) -> tuple[list[int], list[int]]:
    """The last ``keep`` tokens' worth of a sample, cutting the prompt first.

    The prompt (every token before the first trained one) loses tokens from its left; only
    when the trained part alone is longer than ``keep`` is it cut from its right.
    """
    prompt = trained.index(1) if 1 in trained else len(ids)
    drop = min(len(ids) - keep, prompt)
    return ids[drop:][:keep], trained[drop:][:keep]


def _sample(
    ids: list[int], trained: list[int], data: DataConfig, where: str, name: str
) -> tuple[TokenizedSample, bool]:
    """Shift ids into (input, label), apply the truncation policy; returns (sample, was cut)."""
    cut = len(ids) - 1 > data.max_seq_length
    if cut:
        if data.truncation == "reject":
            raise DataError(
                f"{where}: adapter {name!r} sample has {len(ids) - 1} tokens, more than "
                f"data.max_seq_length={data.max_seq_length} (set data.truncation: truncate to "
                f"cut it)"
            )
        ids, trained = _truncate(ids, trained, data.max_seq_length + 1)
    mask = [1] * (len(ids) - 1) if data.train_on_prompt else trained[1:]
    return TokenizedSample(tuple(ids[:-1]), tuple(ids[1:]), tuple(mask)), cut


def load_adapter_dataset(
    adapter: AdapterConfig, data: DataConfig, tokenizer: Tokenizer | None = None
) -> list[TokenizedSample]:
    """Tokenise every row of ``adapter``'s dataset (or reuse the cached result).

    Args:
        adapter: names the dataset and its field mapping, template or chat field.
        data: truncation, loss, bad-row and cache policy.
        tokenizer: the run's tokenizer (default: the byte tokenizer).

    Raises:
        DataError: on a missing or unreadable file, an empty dataset, a malformed row (unless
            ``data.bad_rows: skip``), or (policy ``reject``) a sample longer than
            ``data.max_seq_length``; the message names file and row.
    """
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    cache = _cache_path(adapter, data, tokenizer)
    if cache is not None and cache.is_file():
        samples = _load_cache(cache)
        if samples is not None:
            logger.info(
                "adapter %r: %d tokenised samples from cache %s", adapter.name, len(samples), cache
            )
            return samples
    raw = read_rows(adapter.dataset, data)
    samples, truncated, skipped = _tokenized(raw, adapter, data, tokenizer)
    if not samples:
        raise DataError(
            f"adapter {adapter.name!r}: dataset {adapter.dataset.path!r} has no "
            f"usable rows ({skipped} skipped)"
        )
    if skipped:
        logger.warning(
            "adapter %r: skipped %d malformed rows of %s",
            adapter.name,
            skipped,
            adapter.dataset.path,
        )
    if truncated:
        logger.warning(
            "adapter %r: truncated %d of %d samples to %d tokens",
            adapter.name,
            truncated,
            len(samples),
            data.max_seq_length,
        )
    if cache is not None:
        _save_cache(cache, samples)
    return samples


def _tokenized(
    raw: RawRows, adapter: AdapterConfig, data: DataConfig, tokenizer: Tokenizer
) -> tuple[list[TokenizedSample], int, int]:
    """``(samples, truncated, skipped)`` of ``raw``'s rows under ``data``'s policies.

    Raises:
        DataError: for a malformed row (unless ``data.bad_rows: skip``) or a sample over
            ``data.max_seq_length`` under ``truncation: reject``, naming file and row.
    """
    samples: list[TokenizedSample] = []
    truncated, skipped = 0, raw.skipped
    for row, where in zip(raw.rows, raw.where, strict=True):
        try:
            ids, trained = _row_tokens(row, adapter.dataset, tokenizer)
        except _BadRow as err:
            if data.bad_rows == "error":
                raise DataError(
                    f"{where}: adapter {adapter.name!r}: {err} (set "
                    f"data.bad_rows: skip to skip such rows)"
                ) from None
            skipped += 1
            continue
        sample, cut = _sample(ids, trained, data, where, adapter.name)
        if not any(sample.loss_mask):  # it would train nothing and make a zero loss
            if data.bad_rows == "error":
                raise DataError(
                    f"{where}: adapter {adapter.name!r}: the sample has no trained "
                    f"token within data.max_seq_length={data.max_seq_length} "
                    f"(raise it, or set data.bad_rows: skip to skip such rows)"
                )
            skipped += 1
            continue
        samples.append(sample)
        truncated += cut
    return samples, truncated, skipped


PROBE_ROWS = 1000
"""Rows `probe_adapter_dataset` reads: a few milliseconds of JSON or CSV."""


def probe_adapter_dataset(
    adapter: AdapterConfig,
    data: DataConfig,
    tokenizer: Tokenizer | None = None,
    rows: int = PROBE_ROWS,
) -> tuple[int, bool] | None:
    """Read and tokenise the first ``rows`` rows of ``adapter``'s dataset as training would.

    A cheap check for ``lorafusion validate``: the same readers and row rules as
    `load_adapter_dataset`, so it raises the `DataError` that training would raise for
    those rows, and writes nothing (no cache).

    Returns:
        ``(usable rows, complete)``: ``complete`` when those are all the dataset's rows (else
        the count is a lower bound); None when the source is not read this way (a dataset
        folder, a hub name, a .json file over 4 MiB).

    Raises:
        DataError: naming file and row, as `load_adapter_dataset`.
    """
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    raw = read_first_rows(adapter.dataset, data, rows)
    if raw is None:
        return None
    samples, _, skipped = _tokenized(raw, adapter, data, tokenizer)
    if raw.complete and not samples:
        raise DataError(
            f"adapter {adapter.name!r}: dataset {adapter.dataset.path!r} has no "
            f"usable rows ({skipped} skipped)"
        )
    return len(samples), raw.complete


def probe_job_datasets(cfg: JobConfig) -> list[str]:
    """What training would refuse in the job's data, judged from the first rows of each file.

    Loads the tokenizer, probes every dataset and eval dataset (`probe_adapter_dataset`),
    then checks the samples the run would plan under ``train.epochs`` with the rows seen
    (`planned_samples_problems`). Writes nothing.

    Returns:
        At most one problem per adapter (the first its data shows), then the plan's size.
    """
    try:
        tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
    except (DataError, ImportError) as err:
        return [str(err)]
    problems, rows = [], []
    for adapter in cfg.adapters:
        try:
            seen = probe_adapter_dataset(adapter, cfg.data, tokenizer)
            if adapter.eval_dataset is not None:
                held = replace(adapter, dataset=adapter.eval_dataset)
                probe_adapter_dataset(held, cfg.data, tokenizer)
            elif seen is not None:  # eval_fraction's rows do not train
                seen = (seen[0] - held_out_rows(adapter.eval_fraction, seen[0]), seen[1])
        except DataError as err:
            problems.append(str(err))
            seen = None
        rows.append(seen)
    return problems + planned_samples_problems(cfg, rows)


def training_order(
    num_samples: int, total: int, seed: int, adapter_name: str, shuffle: bool
) -> list[int]:
    """Dataset rows in training order: ``total`` positions over as many epochs as needed.

    Each epoch is a fresh permutation seeded by ``(seed, adapter_name, epoch)``: the adapter's
    name, never its place in the job, so its data order is its own.
    """
    order: list[int] = []
    epoch = 0
    while len(order) < total:
        rows = list(range(num_samples))
        if shuffle:
            random.Random(f"{seed}:{adapter_name}:{epoch}").shuffle(rows)
        order.extend(rows)
        epoch += 1
    return order[:total]
