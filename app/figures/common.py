"""Plotly helpers every figure module shares: number formatting, pooling of large matrices,
downsampling, the layout, a stored heatmap, curves with a metric menu, and (headers, rows) tables.

Pure functions (no torch, no I/O, no Gradio). Large axes are pooled (block means) so no figure
exceeds MAX_CELLS cells / MAX_POINTS points.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from typing import Any

import plotly.graph_objects as go

from compute.contract.results import HeatmapData

from .labels import name_layers

MAX_CELLS = 40_000  # heatmap cells a browser renders smoothly
MAX_AXIS = 200  # longest heatmap axis after pooling
MAX_POINTS = 3_000  # scatter points after downsampling
MODULE_ORDER = (
    "embed", "pos_embed", "q", "k", "v", "qkv", "o", "gate", "up", "down", "norm", "lm_head", "other",
)
COLORSCALE = "Viridis"
NO_LAYER = "-"  # compute's row label for parameters outside the blocks (renamed by labels.py)

Table = tuple[list[str], list[list[Any]]]  # (headers, rows) for gr.Dataframe / CSV
Curves = dict[str, dict[str, tuple[list[float], list[float]]]]  # metric -> run -> (xs, ys)


# ---------------------------------------------------------------- numbers


def finite(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def log10_or_none(v: Any) -> float | None:
    f = finite(v)
    return math.log10(f) if f is not None and f > 0 else None


def fmt(v: Any) -> str:
    """Exact-looking number for hover text and tables (4 significant digits, sci for tiny/huge)."""
    f = finite(v)
    if f is None:
        return "n/a" if v is None else str(v)
    if f == 0:
        return "0"
    if abs(f) < 1e-3 or abs(f) >= 1e5:
        return f"{f:.4e}"
    return f"{f:.4g}"


def _pool_groups(n: int, max_len: int) -> list[range]:
    """Split range(n) into at most max_len contiguous blocks of (nearly) equal size."""
    if n <= max_len:
        return [range(i, i + 1) for i in range(n)]
    size = math.ceil(n / max_len)
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def pool_matrix(
    z: Sequence[Sequence[Any]],
    x_labels: Sequence[str],
    y_labels: Sequence[str],
    max_axis: int = MAX_AXIS,
    max_cells: int = MAX_CELLS,
) -> tuple[list[list[float | None]], list[str], list[str]]:
    """Block-mean pooling of a matrix whose axes are too long (vocabulary, hidden size).

    z[i][j] belongs to y_labels[i], x_labels[j]; None/NaN cells are skipped in the means.
    Pooled labels read "first..last". Returns (z, x_labels, y_labels), unchanged when small.
    """
    ny, nx = len(z), len(z[0]) if z else 0
    max_x, max_y = min(max_axis, nx or 1), min(max_axis, ny or 1)
    while max_x * max_y > max_cells:  # shrink the longer axis first
        if max_x >= max_y:
            max_x = max(1, max_x // 2)
        else:
            max_y = max(1, max_y // 2)
    gx, gy = _pool_groups(nx, max_x), _pool_groups(ny, max_y)
    if len(gx) == nx and len(gy) == ny:
        return [[finite(v) for v in row] for row in z], list(x_labels), list(y_labels)

    def label(labels: Sequence[str], g: range) -> str:
        return str(labels[g[0]]) if len(g) == 1 else f"{labels[g[0]]}..{labels[g[-1]]}"

    out: list[list[float | None]] = []
    for ry in gy:
        row: list[float | None] = []
        for rx in gx:
            vals = [f for i in ry for j in rx if (f := finite(z[i][j])) is not None]
            row.append(sum(vals) / len(vals) if vals else None)
        out.append(row)
    return out, [label(x_labels, g) for g in gx], [label(y_labels, g) for g in gy]


def downsample(n: int, max_points: int = MAX_POINTS, seed: int = 0) -> list[int]:
    """Deterministic subset of range(n) (sorted indices), at most max_points long."""
    if n <= max_points:
        return list(range(n))
    return sorted(random.Random(seed).sample(range(n), max_points))


# ---------------------------------------------------------------- figure scaffolding


def log_colorbar(zlog: Iterable[Iterable[float | None]], title: str) -> dict[str, Any]:
    vals = [v for row in zlog for v in row if v is not None]
    if not vals:
        return {"title": {"text": title}}
    lo, hi = math.floor(min(vals)), math.ceil(max(vals))
    ticks = list(range(lo, hi + 1)) or [lo]
    ticks = ticks[:: max(1, len(ticks) // 8)]
    return {"title": {"text": title}, "tickvals": ticks, "ticktext": [f"1e{t}" for t in ticks]}


def empty_figure(message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, font={"size": 14}, x=0.5, y=0.5,
                       xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(height=240, margin={"l": 20, "r": 20, "t": 40, "b": 20})
    return fig


def layout(fig: go.Figure, title: str, height: int = 420) -> go.Figure:
    fig.update_layout(
        title={"text": title, "x": 0.01, "xanchor": "left"},
        height=height,
        margin={"l": 60, "r": 20, "t": 50, "b": 50},
        template="plotly_white",
    )
    return fig


def share_colour_range(a: go.Figure, b: go.Figure) -> None:
    """Give two single-heatmap figures one colour range (in place), so colours compare directly."""
    if len(a.data) != 1 or len(b.data) != 1 or a.data[0].type != "heatmap" or b.data[0].type != "heatmap":
        return
    vals = [v for fig in (a, b) for row in (fig.data[0].z or []) for v in row if finite(v) is not None]
    if not vals:
        return
    lo, hi = min(vals), max(vals)
    for fig in (a, b):
        fig.data[0].update(zmin=lo, zmax=hi, zauto=False)


# ---------------------------------------------------------------- a stored heatmap


def named_cells(trace: dict[str, Any]) -> dict[str, Any]:
    """A heatmap trace's arrays (x, y, z, customdata) with the "-" row (parameters outside the
    blocks) split into named rows ("embeddings", "final norm", "lm_head"); numbers unchanged."""
    return name_layers({"data": [{"type": "heatmap", **trace}]})["data"][0]


def _canonical_columns(hm: HeatmapData) -> HeatmapData:
    """Module-type columns in the canonical order (embed, q, k, v, ..., lm_head)."""
    x = list(hm.x_labels)
    if not x or not all(v in MODULE_ORDER for v in x):
        return hm
    order = sorted(range(len(x)), key=lambda j: MODULE_ORDER.index(x[j]))
    if order == list(range(len(x))):
        return hm
    return hm.model_copy(update={"x_labels": [x[j] for j in order],
                                 "z": [[row[j] for j in order] for row in hm.z]})


def _is_layer_axis(labels: Sequence[str], title: str) -> bool:
    return title == "layer" or (bool(labels) and all(str(v).isdigit() or v == NO_LAYER for v in labels))


def heatmap_figure(hm: HeatmapData, title: str, log: bool | None = None) -> go.Figure:
    """A stored heatmap (pooled when large). log=None -> meta "log" (default False).

    Axis titles from meta x_title/y_title (or x/y); layer rows read top-down, other y axes upward;
    meta zmin/zmax fix a linear colour range, meta colorscale picks the colours."""
    hm = _canonical_columns(hm)
    z, xl, yl = pool_matrix(hm.z, hm.x_labels, hm.y_labels)
    if not z or not z[0]:
        return empty_figure(f"{title}: empty")
    meta = hm.meta
    x_title = str(meta.get("x_title") or meta.get("x") or "")
    y_title = str(meta.get("y_title") or meta.get("y") or "")
    use_log = bool(meta.get("log", False)) if log is None else log
    zz = [[log10_or_none(v) for v in row] for row in z] if use_log else z
    unit = str(meta.get("units") or meta.get("value") or "value")
    cells = named_cells({"z": zz, "x": xl, "y": yl, "customdata": [[fmt(v) for v in row] for row in z]})
    trace = go.Heatmap(
        z=cells["z"], x=cells["x"], y=cells["y"], customdata=cells["customdata"],
        colorscale=meta.get("colorscale", COLORSCALE),
        colorbar=log_colorbar(zz, f"log10 {unit}") if use_log else {"title": {"text": unit}},
        hoverongaps=False,
        hovertemplate=f"{y_title or 'y'} %{{y}}, {x_title or 'x'} %{{x}}"
                      f"<br>{unit} = %{{customdata}}<extra></extra>",
    )
    if not use_log and meta.get("zmin") is not None:
        trace.update(zmin=meta["zmin"], zmax=meta.get("zmax"))
    fig = go.Figure(trace)
    fig.update_xaxes(title_text=x_title, type="category")
    fig.update_yaxes(title_text=y_title, type="category",
                     autorange="reversed" if _is_layer_axis(yl, y_title) else True)
    return layout(fig, title, height=max(300, min(900, 24 * len(yl) + 140)))


# ---------------------------------------------------------------- curves


def curves_figure(
    groups: Curves,
    title: str,
    x_title: str = "step",
    metric: str | None = None,
    log_x: bool = False,
    labels: dict[str, str] | None = None,
) -> go.Figure:
    """One line per run for the chosen metric; a dropdown switches metric when there are several."""
    if not groups:
        return empty_figure(f"no data for {title.lower()}")
    labels = labels or {}
    metrics = sorted(groups, key=lambda m: (m not in ("reward", "train_reward", "retention"), m))
    chosen = metric if metric in groups else metrics[0]
    fig = go.Figure()
    visibility: dict[str, list[bool]] = {m: [] for m in metrics}
    for m in metrics:
        for run, (xs, ys) in sorted(groups[m].items()):
            fig.add_scatter(x=xs, y=ys, mode="lines+markers" if len(xs) < 30 else "lines", name=run,
                            visible=(m == chosen), legendgroup=run,
                            hovertemplate=f"{run}<br>{x_title} %{{x}}: {labels.get(m, m)} %{{y:.4g}}<extra></extra>")
            for mm in metrics:
                visibility[mm].append(mm == m)
    if len(metrics) > 1:
        fig.update_layout(updatemenus=[{
            "buttons": [{"label": labels.get(m, m), "method": "update",
                         "args": [{"visible": visibility[m]}, {"yaxis.title.text": labels.get(m, m)}]}
                        for m in metrics],
            "direction": "down", "x": 1.0, "xanchor": "right", "y": 1.15, "yanchor": "top",
            "active": metrics.index(chosen),
        }])
    fig.update_xaxes(title_text=x_title, type="log" if log_x else "linear")
    if x_title == "step":
        integer_steps(fig)
    fig.update_yaxes(title_text=labels.get(chosen, chosen))
    return layout(fig, title)


STEP_TICKS = 12  # at most this many distinct steps get one tick each


def integer_steps(fig: go.Figure, **where: Any) -> None:
    """A step axis never shows 1.5: a tick at each step when there are few, else whole-number
    ticks ("d" format; Plotly's own spacing is then at least 1 apart)."""
    steps = sorted({float(x) for tr in fig.data for x in (getattr(tr, "x", None) or ()) if finite(x) is not None})
    if steps and len(steps) <= STEP_TICKS and all(s.is_integer() for s in steps):
        fig.update_xaxes(tickmode="array", tickvals=steps, ticktext=[str(int(s)) for s in steps], **where)
    elif steps:
        fig.update_xaxes(tickformat="d", **where)


# ---------------------------------------------------------------- tables


def cell(v: Any) -> Any:
    """A table cell: floats to 4 significant digits; lists and mappings stay structured (the
    renderer shows them as 'a 1 b 2' / '1, 2', never as Python text)."""
    if isinstance(v, float):
        return float(fmt(v)) if finite(v) is not None else None
    if isinstance(v, list | tuple):
        return [cell(x) for x in v]
    if isinstance(v, dict):
        return {str(k): cell(x) for k, x in v.items()}
    return v


def rows_table(rows: Any, preferred: Sequence[str] = ()) -> Table:
    """A table from a list of dicts, {"scope": {..}} or a flat dict; `preferred` columns first."""
    if isinstance(rows, dict):  # {"global": {...}, "q": {...}} or a flat dict of numbers
        if rows and all(isinstance(v, dict) for v in rows.values()):
            rows = [{"scope": k, **v} for k, v in rows.items()]
        else:
            rows = [{"metric": k, "value": v} for k, v in rows.items()]
    rows = [r for r in rows or [] if isinstance(r, dict)]
    if not rows:
        return [], []
    headers: list[str] = [h for h in preferred if any(h in r for r in rows)]
    for r in rows:
        headers += [k for k in r if k not in headers]
    return headers, [[cell(r.get(h)) for h in headers] for r in rows]
