"""Synthetic data written as JSONL: small tasks for demos and tests, and length-shaped rows.

Each task maps a random prompt to a deterministic response, so an adapter can learn it:
``reverse`` (reverse a letter string), ``sort`` (sort its letters), ``add`` (sum of two
integers) and ``upper`` (copy with a rule: upper-case the vowels). `write_lengths` writes rows
of given byte lengths (the benchmarks' XSum-like workloads, with the byte tokenizer one token
per byte).
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from pathlib import Path


def _letters(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(4, 24)))


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = _letters(rng)
    return f"reverse: {word}\n", word[::-1]


def _sort(rng: random.Random) -> tuple[str, str]:
    word = _letters(rng)
    return f"sort: {word}\n", "".join(sorted(word))


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 10 ** rng.randint(1, 6)), rng.randint(0, 10 ** rng.randint(1, 6))
    return f"add: {a}+{b}\n", str(a + b)


def _upper(rng: random.Random) -> tuple[str, str]:
    word = _letters(rng)
    return f"upper vowels: {word}\n", "".join(c.upper() if c in "aeiou" else c for c in word)


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "add": _add,
    "reverse": _reverse,
    "sort": _sort,
    "upper": _upper,
}


def write_task(task: str, path: str | Path, num_samples: int, seed: int = 0) -> Path:
    """Write ``num_samples`` rows ``{"prompt": ..., "response": ...}`` of ``task`` to ``path``.

    Raises:
        ValueError: for an unknown task or a non-positive sample count.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    if num_samples <= 0:
        raise ValueError(f"num_samples must be > 0, got {num_samples}")
    rng = random.Random(f"{task}:{seed}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for _ in range(num_samples):
            prompt, response = TASKS[task](rng)
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    tmp.replace(path)
    return path


def write_lengths(
    path: str | Path, lengths: list[int], prompt_share: float = 0.85, seed: int = 0
) -> Path:
    """Write one row per length: random lowercase text of that many bytes in all.

    The text is split ``prompt_share`` / the rest between prompt and response (each at
    least one byte).

    Raises:
        ValueError: for a length below 2 bytes or a share outside (0, 1).
    """
    if not 0 < prompt_share < 1:
        raise ValueError(f"prompt_share must be in (0, 1), got {prompt_share}")
    if any(n < 2 for n in lengths):
        raise ValueError(f"lengths must be >= 2 bytes, got {min(lengths)}")
    rng = random.Random(f"lengths:{seed}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for n in lengths:
            text = "".join(rng.choices(string.ascii_lowercase + " ", k=n))
            cut = min(max(round(n * prompt_share), 1), n - 1)
            f.write(json.dumps({"prompt": text[:cut], "response": text[cut:]}) + "\n")
    tmp.replace(path)
    return path
