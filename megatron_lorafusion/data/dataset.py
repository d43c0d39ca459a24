"""Per-adapter datasets: JSONL prompt/response rows → token ids, labels and loss masks.

A sample of ``L`` tokens ``[bos] prompt response [eos]`` trains on ``L - 1`` positions: input
``ids[:-1]``, target ``ids[1:]``; by default only targets inside the response (and eos) count.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

from megatron_lorafusion.config import AdapterConfig, DataConfig
from megatron_lorafusion.data.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A dataset row or file that cannot be used; the message names file and row."""


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


def _read_row(line: str, where: str, cfg: AdapterConfig) -> tuple[str, str]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg})") from err
    fields = (cfg.dataset.prompt_field, cfg.dataset.response_field)
    if not isinstance(row, dict) or any(not isinstance(row.get(f), str) for f in fields):
        raise DataError(f"{where}: a row must be an object with string fields {list(fields)}")
    return row[fields[0]], row[fields[1]]


def load_adapter_dataset(
    adapter: AdapterConfig, data: DataConfig, tokenizer: ByteTokenizer
) -> list[TokenizedSample]:
    """Tokenise every row of ``adapter``'s JSONL file, applying the truncation policy.

    Raises:
        DataError: on a missing or empty file, a malformed row, or (policy ``reject``) a
            sample longer than ``data.max_seq_length``; the message names file and line.
    """
    path = Path(adapter.dataset.path)
    if not path.is_file():
        raise DataError(f"adapter {adapter.name!r}: dataset file {str(path)!r} not found")
    samples: list[TokenizedSample] = []
    truncated = 0
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            prompt, response = _read_row(line, where, adapter)
            prompt_ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
            ids = prompt_ids + tokenizer.encode(response) + [tokenizer.eos_id]
            if len(ids) - 1 > data.max_seq_length:
                if data.truncation == "reject":
                    raise DataError(
                        f"{where}: adapter {adapter.name!r} sample has {len(ids) - 1} tokens, "
                        f"more than data.max_seq_length={data.max_seq_length} "
                        f"(set data.truncation: truncate to cut it)"
                    )
                ids = ids[: data.max_seq_length + 1]
                truncated += 1
            first_trained = 0 if data.train_on_prompt else len(prompt_ids) - 1
            mask = tuple(int(i >= first_trained) for i in range(len(ids) - 1))
            samples.append(TokenizedSample(tuple(ids[:-1]), tuple(ids[1:]), mask))
    if not samples:
        raise DataError(f"adapter {adapter.name!r}: dataset file {str(path)!r} has no rows")
    if truncated:
        logger.warning("adapter %r: truncated %d of %d samples to %d tokens",
                       adapter.name, truncated, len(samples), data.max_seq_length)
    return samples


def training_order(
    num_samples: int, total: int, seed: int, adapter_id: int, shuffle: bool
) -> list[int]:
    """Dataset rows in training order: ``total`` positions over as many epochs as needed.

    Each epoch is a fresh permutation seeded by ``(seed, adapter_id, epoch)``.
    """
    order: list[int] = []
    epoch = 0
    while len(order) < total:
        rows = list(range(num_samples))
        if shuffle:
            random.Random(f"{seed}:{adapter_id}:{epoch}").shuffle(rows)
        order.extend(rows)
        epoch += 1
    return order[:total]
