"""The simulated timeline's legend: what it lists, and that it hides no bar."""

import pytest

from megatron_lorafusion.planner import CostModel, Job
from megatron_lorafusion.sim import simulate
from megatron_lorafusion.sim.timeline import draw_timelines, timeline_figure

IDLE = 1e-6  # ms: as `lorafusion simulate` draws an idle microbatch


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def _sim(num_adapters=2, idle=True, stages=3):
    jobs = [Job(4.0, 8.0, (a,), (a,), a) for a in range(num_adapters)]
    if idle:
        jobs.insert(1, Job(IDLE, IDLE))
    return simulate(jobs, stages, CostModel(optimizer_ms=1.0))


def _legend_texts(fig):
    (legend,) = fig.legends
    return [t.get_text() for t in legend.get_texts()]


def test_timeline_legend_lists_adapters_operations_and_idle_microbatches():
    fig = timeline_figure([("ours", _sim()), ("other", _sim(idle=False))], ["alpaca", "chat"])
    assert _legend_texts(fig) == [
        "alpaca",
        "chat",
        "forward",
        "backward",
        "optimizer step",
        "idle microbatch (tick under its stage)",
    ]


def test_timeline_legend_leaves_out_what_no_panel_shows():
    fig = timeline_figure([("ours", _sim(idle=False))])
    assert _legend_texts(fig) == ["adapter 0", "adapter 1", "forward", "backward", "optimizer step"]


def test_timeline_legend_groups_adapters_that_share_a_colour():
    texts = _legend_texts(timeline_figure([("ours", _sim(num_adapters=45, idle=False))]))
    assert texts[0] == "adapter 0, adapter 10, adapter 20 +2", "tab10 has ten colours"
    assert texts[4] == "adapter 4, adapter 14, adapter 24 +2"
    assert texts[9] == "adapter 9, adapter 19, adapter 29 +1"
    assert texts[10] == "forward"


@pytest.mark.parametrize("panels", [1, 3])
def test_timeline_legend_overlaps_no_panel(panels):
    fig = timeline_figure([(f"p{i}", _sim(num_adapters=12)) for i in range(panels)])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent(renderer)), "the legend covers a panel"
        assert not box.overlaps(ax.get_tightbbox(renderer)), "the legend covers a label"


def test_draw_timelines_writes_the_legend_into_the_png(tmp_path):
    from matplotlib.image import imread

    path = draw_timelines([("ours", _sim())], tmp_path / "sub" / "t.png", ["a", "b"])
    height, width, _ = imread(path).shape
    assert width > 14 * 110, "the canvas is widened to hold the legend beside the panels"
    assert height > 100
