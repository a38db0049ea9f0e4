"""The figure API the UI, the API and the CLI import (a facade over app/figures).

Every function here takes a result dict as `GET /api/results/{token}` (or
`JobResult.to_dict()`) returns it, parses it into its typed result
(compute/contract/results.py) and calls the builder in app/figures/<kind>.py. What a result
shows, in which order, is the registry's (app/figures/registry.py): `result_figures` and
`result_tables` list it. New code should import from app.figures directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import plotly.graph_objects as go

from app.figures import diff, fisher, mask, retention, sweep, tables, tokens, train
from app.figures.common import (
    MAX_AXIS,
    MAX_CELLS,
    MAX_POINTS,
    Table,
    curves_figure,
    downsample,
    empty_figure,
    fmt,
    pool_matrix,
    share_colour_range,
)
from app.figures.common import heatmap_figure as _heatmap_figure
from app.figures.layers import layer_module_cells as _cells
from app.figures.layers import layer_module_heatmap as _lm_heatmap
from app.figures.layers import per_layer_bars as _bars
from app.figures.registry import entries, figures_for, tables_for
from compute.contract.results import HeatmapData, TypedResult
from compute.jobs.registry import KINDS, parse_result

__all__ = [
    "MAX_AXIS", "MAX_CELLS", "MAX_POINTS", "Table", "bound_scatter", "concentration_figure", "curves_figure",
    "downsample", "empty_figure", "exact_output_table", "fmt", "heatmap_figure", "layer_module_cells",
    "layer_module_heatmap", "layer_stats_table", "mask_density_heatmap", "overlap_table", "per_layer_bars",
    "pool_matrix", "result_figures", "result_tables", "retention_figure", "retention_table",
    "share_colour_range", "show_token", "summary_table", "sweep_auc_figure", "sweep_binade_figure",
    "sweep_sparsity_figure", "sweep_table", "token_bars", "token_choices", "token_counterfactual_figure",
    "token_similarity_heatmap", "training_curves", "update_sparsity_heatmap",
]

R = TypeVar("R")
Result = Mapping[str, Any] | TypedResult[Any]


def _from_dict(fn: Callable[..., R]) -> Callable[..., R]:
    """fn(typed result, ...) callable with a result dict."""
    @functools.wraps(fn)
    def wrapper(result: Result, *args: Any, **kwargs: Any) -> R:
        return fn(parse_result(result), *args, **kwargs)
    return wrapper


layer_module_cells = _from_dict(_cells)
layer_module_heatmap = _from_dict(_lm_heatmap)
per_layer_bars = _from_dict(_bars)
concentration_figure = _from_dict(fisher.concentration_figure)
exact_output_table = _from_dict(fisher.exact_output_table)
mask_density_heatmap = _from_dict(mask.mask_density_heatmap)
bound_scatter = _from_dict(train.bound_scatter)
training_curves = _from_dict(train.training_curves)
sweep_sparsity_figure = _from_dict(sweep.sweep_sparsity_figure)
sweep_auc_figure = _from_dict(sweep.sweep_auc_figure)
sweep_binade_figure = _from_dict(sweep.sweep_binade_figure)
sweep_table = _from_dict(sweep.sweep_table)
retention_figure = _from_dict(retention.retention_figure)
retention_table = _from_dict(retention.retention_table)
update_sparsity_heatmap = _from_dict(diff.update_sparsity_heatmap)
overlap_table = _from_dict(tables.overlap_table)
summary_table = _from_dict(tables.summary_table)
layer_stats_table = tables.layer_stats_table
token_bars = _from_dict(tokens.token_bars)
token_similarity_heatmap = _from_dict(tokens.token_similarity_heatmap)
token_counterfactual_figure = _from_dict(tokens.token_counterfactual_figure)
token_choices = _from_dict(tokens.token_choices)
show_token = tokens.show_token


def _kind(result: Result) -> Any:
    if isinstance(result, TypedResult):
        return result.kind
    return result.get("kind") or (result.get("job") or {}).get("kind")


def result_figures(result: Result) -> list[tuple[str, go.Figure]]:
    """(name, figure) pairs for everything this result can show, in the registry's order (none
    for a kind without a schema)."""
    return figures_for(result) if _kind(result) in KINDS else []


def result_tables(result: Result) -> list[tuple[str, Table]]:
    """(title, table) pairs with rows, in the registry's order."""
    return tables_for(result) if _kind(result) in KINDS else []


def heatmap_figure(hm: Mapping[str, Any] | HeatmapData, log: bool | None = None,
                   title: str | None = None) -> go.Figure:
    """Any heatmap dict drawn as stored; the title of its registered figure when it has one."""
    h = hm if isinstance(hm, HeatmapData) else HeatmapData.model_validate(dict(hm))
    known = next((e.title for kind in KINDS for e in entries(kind) if e.name == h.name), None)
    return _heatmap_figure(h, title or str(h.meta.get("title") or known or h.name.replace("_", " ")), log=log)
