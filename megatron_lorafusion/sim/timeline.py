"""Draw simulated pipeline timelines (one panel per strategy) to a PNG with matplotlib."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_lorafusion.sim.simulator import Event, SimResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["draw_timelines", "timeline_figure"]

_COLOURS = 10  # tab10: adapters a and a + 10 share a colour
_IDLE_COLOUR = "grey"
_HATCHES = {"B": "//", "W": ".."}
_KINDS = (
    ("F", "forward"),
    ("B", "backward"),
    ("W", "deferred weight gradient"),
    ("O", "optimizer step"),
)


def _adapter_label(colour: int, labels: Sequence[int], names: Sequence[str] | None) -> str:
    """Legend text of one colour: the adapters drawn in it (at most three named)."""
    members = [a for a in labels if a % _COLOURS == colour]
    text = ", ".join(names[a] if names else f"adapter {a}" for a in members[:3])
    return text + (f" +{len(members) - 3}" if len(members) > 3 else "")


def _is_idle(event: Event) -> bool:
    """An idle microbatch's forward or backward (its optimizer steps are real work)."""
    return event.label < 0 and event.kind != "O"


def _legend_handles(
    results: Sequence[tuple[str, SimResult]], names: Sequence[str] | None, cmap
) -> list:
    """Patches for the adapter colours, then the operation kinds and idle microbatches."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    events = [e for _, r in results for e in r.events]
    labels = sorted({e.label for e in events if e.label >= 0})
    kinds = {e.kind for e in events}
    handles = [
        Patch(facecolor=cmap(c), label=_adapter_label(c, labels, names))
        for c in sorted({a % _COLOURS for a in labels})
    ]
    handles += [
        Patch(
            facecolor="black" if kind == "O" else "white",
            edgecolor="black",
            hatch=_HATCHES.get(kind),
            label=text,
        )
        for kind, text in _KINDS
        if kind in kinds
    ]
    if any(_is_idle(e) for e in events):
        handles.append(
            Line2D([], [], color=_IDLE_COLOUR, label="idle microbatch (tick under its stage)")
        )
    return handles


def timeline_figure(
    results: Sequence[tuple[str, SimResult]], adapter_names: Sequence[str] | None = None
) -> Figure:
    """A Gantt chart: rows are stages, bars are F (solid), B (hatched), O (black).

    Bars are coloured by the adapter of the microbatch's first sample; a grey tick under a
    stage's bars marks an idle microbatch's forward there. Panels share the time axis so
    makespans compare. The legend sits right of the panels, outside every axes, so it never
    hides a bar.

    Args:
        results: ``(title, simulation)`` pairs, one panel each.
        adapter_names: legend names by adapter id (default ``adapter <id>``).

    Returns:
        The figure (the caller saves and closes it).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        # One collection per (stage, colour, hatch): a bar per event took 0.9 ms, 23 s for
        # the 25,776 events of the demo job at S = 4.
        bars: dict[tuple[int, object, str | None], list[tuple[float, float]]] = {}
        for e in (e for e in result.events if not _is_idle(e)):
            colour = "black" if e.kind == "O" else cmap(e.label % _COLOURS)
            key = (e.stage, colour, _HATCHES.get(e.kind))
            bars.setdefault(key, []).append((e.start_ms, e.end_ms - e.start_ms))
        # White edges part neighbouring bars, but past ~500 operations a stage they wash out
        # the colours of a 14-inch panel; the hatch (white too) stays.
        edge = 0.2 if len(result.events) < 500 * result.num_stages else 0.0
        for (stage, colour, hatch), spans in bars.items():
            ax.broken_barh(
                spans,
                (stage - 0.34, 0.68),
                facecolors=colour,
                hatch=hatch,
                edgecolor="white",
                linewidth=edge,
            )
        # An idle microbatch takes (next to) no time: a tick in the strip under its stage's
        # bars marks each forward slot without hiding the bars around it.
        idle = [e for e in result.events if _is_idle(e) and e.kind == "F"]
        ax.vlines(
            [e.start_ms for e in idle],
            [e.stage + 0.36 for e in idle],
            [e.stage + 0.5 for e in idle],
            colors=_IDLE_COLOUR,
            linewidth=0.6,
        )
        ax.set_ylim(result.num_stages - 0.5, -0.5)  # stage 0 on top
        ax.set_yticks(range(result.num_stages), [f"stage {s}" for s in range(result.num_stages)])
        ax.set_xlim(0, horizon)
        ax.set_title(
            f"{title}: makespan {result.makespan_ms:.0f} ms, "
            f"bubble {100 * result.bubble_ratio:.1f}%",
            fontsize=9,
            loc="left",
        )
    axes[-1, 0].set_xlabel("time (ms)")
    fig.tight_layout()
    fig.legend(
        handles=_legend_handles(results, adapter_names, cmap),
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),  # outside the panels; savefig widens the canvas to it
        fontsize=8,
        frameon=False,
    )
    return fig


def draw_timelines(
    results: Sequence[tuple[str, SimResult]],
    path: str | Path,
    adapter_names: Sequence[str] | None = None,
) -> Path:
    """Write `timeline_figure` of ``results`` as a PNG.

    Args:
        results: ``(title, simulation)`` pairs, one panel each.
        path: PNG file to write.
        adapter_names: legend names by adapter id (default ``adapter <id>``).

    Returns:
        The path written.
    """
    path = Path(path)
    fig = timeline_figure(results, adapter_names)  # selects the Agg backend first
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
