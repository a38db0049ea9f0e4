"""Figure defects of issue 25: the concentration curve's uniform reference on a log axis, step
axes that never tick at 1.5, one name for rows outside the blocks, a layer x module heatmap
marked for drill-down."""

from __future__ import annotations

import plotly.graph_objects as go
import pytest

from app import render
from app.figures.common import integer_steps
from app.figures.fisher import concentration_figure
from app.figures.labels import name_layers
from compute.contract.jobresult import JobResult, SeriesPoint
from compute.jobs import registry


def test_uniform_reference_is_y_equals_x_across_a_log_axis():
    res = JobResult(kind="fisher", summary={"gini": 0.5},
                    series=[SeriesPoint("concentration", x, y) for x, y in ((0.001, 0.2), (0.01, 0.5), (1.0, 1.0))])
    fig = concentration_figure(registry.parse_result(res.to_dict()))
    assert fig.layout.xaxis.type == "log"
    ref = next(t for t in fig.data if t.name.startswith("uniform"))
    assert len(ref.x) > 50 and ref.x[0] == pytest.approx(0.001) and ref.x[-1] == pytest.approx(1.0)
    assert list(ref.x) == list(ref.y) and 0 not in ref.x  # y = x, no point at 0 (off a log axis)


def test_step_axes_tick_at_whole_steps():
    fig = go.Figure(go.Scatter(x=[1, 2, 3], y=[0.1, 0.2, 0.3]))
    integer_steps(fig)
    assert list(fig.layout.xaxis.tickvals) == [1.0, 2.0, 3.0] and list(fig.layout.xaxis.ticktext) == ["1", "2", "3"]
    many = go.Figure(go.Scatter(x=list(range(40)), y=[0] * 40))
    integer_steps(many)
    assert many.layout.xaxis.tickformat == "d"


def test_series_groups_outside_the_blocks_are_named():
    fig = name_layers({"data": [{"type": "heatmap", "y": ["0/q", "-/norm", "-/embed"], "x": ["10"], "z": [[1], [2], [3]]}]})
    assert fig["data"][0]["y"] == ["0/q", "final norm", "embeddings"]


def test_layer_module_heatmaps_are_drillable_and_others_not():
    hm = {"data": [{"type": "heatmap"}], "layout": {"yaxis": {"title": {"text": "layer"}},
                                                     "xaxis": {"title": {"text": "module type"}}}}
    assert render.drillable(hm)
    assert not render.drillable({**hm, "data": [{"type": "bar"}]})
    assert "data-drill" in render.figures_html([{"name": "m", "title": "T", "figure": hm}])
