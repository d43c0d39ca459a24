"""Sample-length generators shaped like XSum, CNN/DailyMail and WikiSum, and length files.

A sample is an instruction template (~20 tokens) + the document + the reference summary.
Published means (words), converted with ~1.3 subword tokens per word (Llama-style BPE):

- XSum (Narayan et al., EMNLP 2018, Table 1): documents 431.07 words, summaries 23.26
  words -> mean ~ 610 tokens. Log-normal, sigma 0.55 (our assumption; the paper gives
  no spread).
- CNN/DailyMail (See et al., ACL 2017, §4): articles 781 tokens, summaries 56 tokens
  (3.75 sentences) -> mean ~ 1110 tokens. Log-normal, sigma 0.5 (assumption).
- WikiSum (Cohen et al., ACL 2021; WikiHow articles with paragraph summaries): we had no
  verified length table at hand, so the shape is an assumption matching the LoRAFusion
  paper's description of it as the long, heavy-tailed dataset: 85% log-normal (median
  1300 tokens, sigma 0.6) + 15% Pareto tail (x_m 3000 tokens, alpha 1.5). Measured on
  20k draws: mean 2627, median 1505, p95 6622 tokens, 5.6% above 6144 before truncation.
- ``mix``: each sample drawn from one of the three above, uniformly.

Real lengths: `load_lengths` reads a file of integers (whitespace/comma separated, or a
JSON list); `adapter_lengths` resamples it per adapter with the seed.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

__all__ = ["DISTRIBUTIONS", "adapter_lengths", "load_lengths", "sample_lengths"]

DISTRIBUTIONS = ("xsum", "cnn_dm", "wikisum", "mix")
"""Names `sample_lengths` accepts; `adapter_lengths` also takes ``"heterogeneous"``."""

_TEMPLATE_TOKENS = 20
_TOKENS_PER_WORD = 1.3


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def _one(rng: random.Random, name: str) -> int:
    if name == "mix":
        name = rng.choice(DISTRIBUTIONS[:3])
    if name == "xsum":
        body = _lognormal(rng, (431.07 + 23.26) * _TOKENS_PER_WORD, 0.55)
    elif name == "cnn_dm":
        body = _lognormal(rng, (781 + 56) * _TOKENS_PER_WORD, 0.5)
    elif name == "wikisum":
        if rng.random() < 0.85:
            body = rng.lognormvariate(math.log(1300), 0.6)
        else:
            body = 3000 * rng.paretovariate(1.5)
    else:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {name!r}")
    return _TEMPLATE_TOKENS + max(1, int(body))


def sample_lengths(name: str, num_samples: int, seed: int) -> list[int]:
    """Draw ``num_samples`` token lengths from a named distribution.

    Args:
        name: one of `DISTRIBUTIONS`.
        num_samples: how many lengths.
        seed: RNG seed (same seed, same lengths).

    Raises:
        ValueError: on an unknown name or a negative count.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if name not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {name!r}")
    rng = random.Random(f"{name}:{seed}")
    return [_one(rng, name) for _ in range(num_samples)]


def load_lengths(path: str | Path) -> list[int]:
    """Read sample lengths (tokens) from a file.

    The file is a JSON list, or integers separated by whitespace or commas.

    Raises:
        ValueError: if the file holds no lengths or a value is not a positive integer.
    """
    text = Path(path).read_text()
    try:
        if text.lstrip().startswith("["):
            values = json.loads(text)
        else:
            values = text.replace(",", " ").split()
        lengths = [int(v) for v in values]
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: expected integer token lengths ({e})") from e
    if not lengths:
        raise ValueError(f"{path}: no lengths found")
    bad = [v for v in lengths if v < 1]
    if bad:
        raise ValueError(f"{path}: lengths must be >= 1 token, got {bad[0]}")
    return lengths


def adapter_lengths(spec: str, num_adapters: int, num_samples: int, seed: int) -> list[list[int]]:
    """Lengths for each adapter of a run.

    Args:
        spec: a name in `DISTRIBUTIONS` (every adapter draws from it), ``"heterogeneous"``
            (adapter ``i`` draws from ``DISTRIBUTIONS[i % 4]``), or a path to a length file
            (each adapter gets a seeded resample of it).
        num_adapters: adapters in the run.
        num_samples: samples per adapter.
        seed: base seed; adapter ``i`` uses ``seed + i``.

    Raises:
        ValueError: on an unknown name or a bad file.
    """
    if spec == "heterogeneous":
        return [
            sample_lengths(DISTRIBUTIONS[i % 4], num_samples, seed + i) for i in range(num_adapters)
        ]
    if spec in DISTRIBUTIONS:
        return [sample_lengths(spec, num_samples, seed + i) for i in range(num_adapters)]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"lengths must be one of {(*DISTRIBUTIONS, 'heterogeneous')} or a file, got {spec!r}"
        )
    pool = load_lengths(path)
    return [random.Random(seed + i).choices(pool, k=num_samples) for i in range(num_adapters)]
