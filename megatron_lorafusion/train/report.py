"""`lorafusion report RUN`: a per-adapter summary table and loss/eval curves of a finished run.

Reads the records of ``metrics.jsonl`` (`train.metrics.read_metrics`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["AdapterSummary", "format_table", "plot_curves", "summarize"]


@dataclass(frozen=True)
class AdapterSummary:
    """One adapter's run in numbers (losses are per-token means; NaN where none)."""

    adapter: str
    steps: int
    tokens: int
    first_loss: float
    last_loss: float
    best_loss: float
    best_eval_loss: float
    best_eval_step: int | None


def _series(records: Sequence[dict[str, Any]], name: str, key: str) -> list[tuple[int, float]]:
    points = [
        (r["step"], r[key]) for r in records if r.get("adapter") == name and r.get(key) is not None
    ]
    return sorted(points)


def _names(records: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["adapter"] for r in records if r.get("adapter") is not None))


def summarize(records: Sequence[dict[str, Any]]) -> list[AdapterSummary]:
    """Per adapter (in order of first appearance), its `AdapterSummary`."""
    out = []
    for name in _names(records):
        losses = [v for _, v in _series(records, name, "loss")]
        evals = _series(records, name, "eval_loss")
        best_eval = min(evals, key=lambda e: e[1]) if evals else (None, math.nan)
        steps = [r for r in records if r.get("adapter") == name and "loss" in r]
        out.append(
            AdapterSummary(
                adapter=name,
                steps=max((r["step"] for r in steps), default=0),
                tokens=sum(r.get("tokens", 0) for r in steps),
                first_loss=losses[0] if losses else math.nan,
                last_loss=losses[-1] if losses else math.nan,
                best_loss=min(losses) if losses else math.nan,
                best_eval_loss=best_eval[1],
                best_eval_step=best_eval[0],
            )
        )
    return out


def format_table(rows: Sequence[AdapterSummary]) -> str:
    """A markdown table: adapter, steps, tokens, first/last/best loss, best eval loss (step)."""
    lines = [
        "| adapter | steps | tokens | first loss | last loss | best loss | best eval loss (step) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        best_eval = (
            "-" if r.best_eval_step is None else f"{r.best_eval_loss:.4f} ({r.best_eval_step})"
        )
        lines.append(
            f"| {r.adapter} | {r.steps} | {r.tokens} | {r.first_loss:.4f} | {r.last_loss:.4f} "
            f"| {r.best_loss:.4f} | {best_eval} |"
        )
    return "\n".join(lines)


def plot_curves(records: Sequence[dict[str, Any]], png: str | Path) -> Path:
    """Write a PNG of each adapter's training loss (line) and eval loss (markers) by step."""
    import matplotlib

    matplotlib.use("Agg")  # no display; a file only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for i, name in enumerate(_names(records)):
        colour = f"C{i % 10}"
        train = _series(records, name, "loss")
        if train:
            ax.plot(*zip(*train, strict=True), color=colour, lw=1.2, label=f"{name} train")
        evals = _series(records, name, "eval_loss")
        if evals:
            ax.plot(
                *zip(*evals, strict=True),
                color=colour,
                ls="--",
                marker="o",
                ms=4,
                label=f"{name} eval",
            )
    ax.set_xlabel("optimizer step of the adapter")
    ax.set_ylabel("loss (per-token mean, nats)")
    ax.set_title("Loss per adapter")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
