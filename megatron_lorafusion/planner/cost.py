"""Per-stage time of a microbatch: affine in tokens plus attention's quadratic term.

``forward_ms = fixed_ms + per_token_ms * T + attention_ms * sum_k L_k**2`` for a microbatch
of ``T`` computed tokens (tile padding included) made of sequences of lengths ``L_k`` (causal
attention within each sequence), ``backward_ms = backward_ratio * forward_ms``. The default
coefficients are a rough Llama-3-8B split over 4 stages on an H100-class GPU (8 layers per
stage, ~4 GFLOP/token and ~65 kFLOP/token² of attention at ~400 TFLOP/s); the bubble ratio
only depends on their ratios. `CostModel.from_profile` reads measured coefficients or fits
them to measured points.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

__all__ = ["CostModel"]


@dataclass(frozen=True)
class CostModel:
    """Coefficients of the per-stage cost model (all times in milliseconds).

    Attributes:
        fixed_ms: per-microbatch overhead of one stage's forward (launches, p2p setup).
        per_token_ms: forward time per computed token (GEMMs, LoRA, norms).
        attention_ms: forward time per squared sequence length (causal attention).
        backward_ratio: backward time / forward time (2.0: input and weight grads).
        optimizer_ms: one adapter's optimizer step on one stage.
        p2p_ms: activation or gradient transfer between neighbouring stages.
    """

    fixed_ms: float = 0.5
    per_token_ms: float = 0.01
    attention_ms: float = 1.6e-7
    backward_ratio: float = 2.0
    optimizer_ms: float = 0.2
    p2p_ms: float = 0.0

    def __post_init__(self) -> None:
        bad = [
            f"{f.name} must be >= 0, got {getattr(self, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) < 0
        ]
        if bad:
            raise ValueError("invalid CostModel: " + "; ".join(bad))

    def forward_ms(self, tokens: int, squared_lengths: int) -> float:
        """Forward time of one stage for ``tokens`` computed tokens (0 tokens: idle, free)."""
        if tokens == 0:
            return 0.0
        return self.fixed_ms + self.per_token_ms * tokens + self.attention_ms * squared_lengths

    @classmethod
    def from_profile(cls, path: str | Path) -> CostModel:
        """Load coefficients, or fit them to measurements, from a JSON file.

        The file holds either coefficient fields of this class (missing ones keep their
        defaults) or ``{"points": [{"tokens": T, "squared_lengths": Q, "forward_ms": F,
        "backward_ms": B}, ...]}`` measured on one stage; the fit is least squares of
        ``F`` on ``(1, T, Q)`` and the mean ``B / F``.

        Raises:
            ValueError: on unknown keys or too few points to fit.
        """
        data = json.loads(Path(path).read_text())
        if "points" not in data:
            names = {f.name for f in fields(cls)}
            unknown = sorted(set(data) - names)
            if unknown:
                raise ValueError(
                    f"{path}: unknown cost model keys {unknown}; known: {sorted(names)}"
                )
            return cls(**{k: float(v) for k, v in data.items()})
        return _fit(data["points"], path)


def _fit(points: list[dict], path: str | Path) -> CostModel:
    import numpy as np

    if len(points) < 3:
        raise ValueError(f"{path}: need at least 3 measured points to fit, got {len(points)}")
    design = np.array([[1.0, p["tokens"], p["squared_lengths"]] for p in points])
    fwd = np.array([p["forward_ms"] for p in points])
    coef, *_ = np.linalg.lstsq(design, fwd, rcond=None)
    ratio = float(np.mean([p["backward_ms"] / p["forward_ms"] for p in points]))
    fixed, per_token, attention = (max(0.0, float(c)) for c in coef)
    return CostModel(fixed, per_token, attention, ratio)
