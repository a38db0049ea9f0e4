"""Layer x module figures from a result's layer_stats (fisher, tokens, mask).

The aggregation itself is compute.lm.cells.aggregate (the one place it is done); this module
only picks the rows and draws the cells. Rows outside the blocks are stored under layer None,
drawn as "-" and renamed ("embeddings", "final norm", "lm_head") by labels.name_layers.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from compute.contract.results import TypedResult
from compute.lm.cells import aggregate

from .common import (
    COLORSCALE,
    MODULE_ORDER,
    NO_LAYER,
    empty_figure,
    finite,
    fmt,
    layout,
    log10_or_none,
    log_colorbar,
    named_cells,
)
from .labels import name_layers

Cells = dict[tuple[Any, str], dict[str, Any]]
HOVER_KEYS = ("mean", "share", "mass", "max", "density", "numel")


def layer_module_cells(r: TypedResult[Any]) -> Cells:
    """(layer, module) -> {mean, max, mass, share, numel, density, ..., params: [names]}.

    From the "tensor" rows (compute.lm.cells.aggregate: exact sums and numel-weighted means);
    "layer_module" rows fill the values the tensor rows cannot give, and are used alone when
    there are no tensor rows."""
    cells: Cells = {(k[0], str(k[1])): c for k, c in aggregate(r.stats("tensor")).items()}
    for row in r.stats("layer_module"):
        c = cells.setdefault((row.layer, row.module or "other"), {"params": []})
        for k, v in row.values.items():
            if k not in c and (f := finite(v)) is not None:
                c[k] = f
    return cells


def _layer_key(layer: Any) -> tuple[int, int]:
    return (1, 0) if layer is None else (0, int(layer))


def _module_key(module: str) -> tuple[int, str]:
    return (MODULE_ORDER.index(module), "") if module in MODULE_ORDER else (len(MODULE_ORDER), module)


def grid(cells: Cells) -> tuple[list[Any], list[str]]:
    layers = sorted({k[0] for k in cells}, key=_layer_key)
    modules = sorted({k[1] for k in cells}, key=_module_key)
    return layers, modules


def layer_label(layer: Any) -> str:
    return NO_LAYER if layer is None else str(layer)


def _hover_params(params: list[str], limit: int = 4) -> str:
    if not params:
        return "(aggregate)"
    shown = "<br>".join(params[:limit])
    return shown + (f"<br>... +{len(params) - limit} more" if len(params) > limit else "")


def _cell_matrix(cells: Cells, layers: list[Any], modules: list[str], value: str,
                 log: bool) -> tuple[list[list[float | None]], list[list[str]]]:
    z: list[list[float | None]] = []
    text: list[list[str]] = []
    for layer in layers:
        zrow: list[float | None] = []
        trow: list[str] = []
        for m in modules:
            c = cells.get((layer, m))
            if c is None:
                zrow.append(None)
                trow.append("")
                continue
            zrow.append(log10_or_none(c[value]) if log else finite(c[value]))
            nums = " ".join(f"{k}={fmt(c[k])}" for k in HOVER_KEYS if k in c)
            trow.append(f"{nums}<br>{_hover_params(c['params'])}")
        z.append(zrow)
        text.append(trow)
    return z, text


def layer_module_heatmap(r: TypedResult[Any], value: str = "mean", log: bool = True,
                         title: str | None = None) -> go.Figure:
    """Heatmap with y = layer, x = module type, colour = `value` (mean, share, mass, max, density).

    Log colour scale by default (z = log10(value); zero cells left blank); hover shows the exact
    numbers (mean, share, mass, max) and the parameter names in the cell."""
    cells = {k: c for k, c in layer_module_cells(r).items() if value in c}
    if not cells:
        return empty_figure(f"no per-layer '{value}' statistics in this result")
    layers, modules = grid(cells)
    z, text = _cell_matrix(cells, layers, modules, value, log)
    named = named_cells({"z": z, "x": modules, "y": [layer_label(v) for v in layers], "customdata": text})
    fig = go.Figure(go.Heatmap(
        **named, colorscale=COLORSCALE,
        colorbar=log_colorbar(z, f"log10 {value}") if log else {"title": {"text": value}},
        hoverongaps=False, hovertemplate="layer %{y}, module %{x}<br>%{customdata}<extra></extra>",
    ))
    fig.update_yaxes(title_text="layer", type="category", autorange="reversed")
    fig.update_xaxes(title_text="module type", type="category")
    scale = " (log colour scale)" if log else ""
    return layout(fig, title or f"Fisher {value} by layer x module{scale}",
                  height=max(300, 28 * len(named["y"]) + 140))


def per_layer_bars(r: TypedResult[Any], value: str = "share") -> go.Figure:
    """Bars: one per layer (parameters outside the blocks as '-'), stacked by module type."""
    cells = {k: c for k, c in layer_module_cells(r).items() if value in c}
    if not cells:
        return empty_figure(f"no per-layer '{value}' statistics in this result")
    layers, modules = grid(cells)
    fig = go.Figure()
    for m in modules:
        ys = [cells.get((layer, m), {}).get(value) for layer in layers]
        if all(y is None for y in ys):
            continue
        bar = {"type": "bar", "name": m, "x": [layer_label(v) for v in layers], "y": [0.0 if y is None else y for y in ys]}
        named = name_layers({"data": [bar]})["data"][0]  # "-" -> the module's name, or dropped
        fig.add_bar(name=m, x=named["x"], y=named["y"], hovertemplate=f"layer %{{x}}, {m}: %{{y:.4g}}<extra></extra>")
    fig.update_layout(barmode="stack", legend_title_text="module")
    fig.update_xaxes(title_text="layer", type="category")
    fig.update_yaxes(title_text=value)
    return layout(fig, f"Fisher {value} per layer")


def has_value(r: TypedResult[Any], value: str) -> bool:
    return any(value in c for c in layer_module_cells(r).values())
