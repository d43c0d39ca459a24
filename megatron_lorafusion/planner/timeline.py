"""Draw simulated pipeline timelines (one panel per strategy) to a PNG with matplotlib."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from megatron_lorafusion.planner.simulator import SimResult

__all__ = ["draw_timelines"]


def draw_timelines(results: Sequence[tuple[str, SimResult]], path: str | Path) -> Path:
    """Write a Gantt chart: rows are stages, bars are F (solid), B (hatched), O (black).

    Bars are coloured by adapter; panels share the time axis so makespans compare.

    Args:
        results: ``(title, simulation)`` pairs, one panel each.
        path: PNG file to write.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, axes = plt.subplots(
        len(results),
        1,
        figsize=(14, 1.2 + 0.45 * sum(r.num_stages for _, r in results)),
        sharex=True,
        squeeze=False,
    )
    cmap = plt.get_cmap("tab10")
    horizon = max((r.makespan_ms for _, r in results), default=1.0)
    for ax, (title, result) in zip(axes[:, 0], results, strict=True):
        for e in result.events:
            color = "black" if e.kind == "O" else cmap(e.label % 10) if e.label >= 0 else "grey"
            ax.barh(
                e.stage,
                e.end_ms - e.start_ms,
                left=e.start_ms,
                height=0.8,
                color=color,
                hatch="//" if e.kind == "B" else None,
                edgecolor="white",
                linewidth=0.2,
            )
        ax.set_yticks(range(result.num_stages), [f"stage {s}" for s in range(result.num_stages)])
        ax.invert_yaxis()
        ax.set_xlim(0, horizon)
        ax.set_title(
            f"{title}: makespan {result.makespan_ms:.0f} ms, "
            f"bubble {100 * result.bubble_ratio:.1f}%",
            fontsize=9,
            loc="left",
        )
    axes[-1, 0].set_xlabel("time (ms)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
