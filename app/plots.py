"""Plot builders: pure functions from a stored result dict to Plotly figures and small tables.

A result dict is what `GET /api/results/{token}` returns (and `JobResult.to_dict()` minus the job):
{"kind", "summary", "layer_stats": [{param, module, layer, values, group}],
 "heatmaps": [{name, x_labels, y_labels, z, meta}], "series": [{name, step, value}]}.
No torch, no I/O, no Gradio: these run in the web process and in unit tests.

Names the builders recognise (compute runners may emit any subset; missing parts are skipped):
- layer_stats group "tensor" (one row per parameter) and/or "layer_module" (aggregates), values
  among mean, max, mass, share, numel, density (mask kept fraction), ...
- series "concentration" (step = fraction of coordinates, value = share of Fisher mass);
  "bound" (step = sqrt(Fisher), value = |gradient|, one point per coordinate);
  "<metric>/<run>" (e.g. "reward/full", "reward/fisher-0.05") -> training curves, one line per run.
- heatmaps: any; those whose name starts with "update_sparsity" or "sparsity" and whose meta
  has "threshold" become one figure with a threshold slider; meta {"log": true} -> log colours.
- summary: "overlap" (dict or list of rows), "retention" (list of rows), "top_tokens" /
  "random_tokens" (list of {token, prob, share}), "context".
Large axes are pooled (block means) so no figure exceeds MAX_CELLS cells / MAX_POINTS points.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import plotly.graph_objects as go

MAX_CELLS = 40_000  # heatmap cells a browser renders smoothly
MAX_AXIS = 200  # longest heatmap axis after pooling
MAX_POINTS = 3_000  # scatter points after downsampling
MODULE_ORDER = (
    "embed", "pos_embed", "q", "k", "v", "qkv", "o", "gate", "up", "down", "norm", "lm_head", "other",
)
COLORSCALE = "Viridis"
NO_LAYER = "-"  # row label for parameters outside the blocks (embeddings, final norm, lm_head)

Table = tuple[list[str], list[list[Any]]]  # (headers, rows) for gr.Dataframe / CSV


# ---------------------------------------------------------------- numeric helpers


def _finite(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def log10_or_none(v: Any) -> float | None:
    f = _finite(v)
    return math.log10(f) if f is not None and f > 0 else None


def fmt(v: Any) -> str:
    """Exact-looking number for hover text and tables (4 significant digits, sci for tiny/huge)."""
    f = _finite(v)
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
        return [[_finite(v) for v in row] for row in z], list(x_labels), list(y_labels)

    def label(labels: Sequence[str], g: range) -> str:
        return str(labels[g[0]]) if len(g) == 1 else f"{labels[g[0]]}..{labels[g[-1]]}"

    out: list[list[float | None]] = []
    for ry in gy:
        row: list[float | None] = []
        for rx in gx:
            vals = [f for i in ry for j in rx if (f := _finite(z[i][j])) is not None]
            row.append(sum(vals) / len(vals) if vals else None)
        out.append(row)
    return out, [label(x_labels, g) for g in gx], [label(y_labels, g) for g in gy]


def downsample(n: int, max_points: int = MAX_POINTS, seed: int = 0) -> list[int]:
    """Deterministic subset of range(n) (sorted indices), at most max_points long."""
    if n <= max_points:
        return list(range(n))
    return sorted(random.Random(seed).sample(range(n), max_points))


def _log_colorbar(zlog: Iterable[Iterable[float | None]], title: str) -> dict[str, Any]:
    vals = [v for row in zlog for v in row if v is not None]
    if not vals:
        return {"title": {"text": title}}
    lo, hi = math.floor(min(vals)), math.ceil(max(vals))
    ticks = list(range(lo, hi + 1)) or [lo]
    step = max(1, len(ticks) // 8)
    ticks = ticks[::step]
    return {
        "title": {"text": title},
        "tickvals": ticks,
        "ticktext": [f"1e{t}" for t in ticks],
    }


def empty_figure(message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, font={"size": 14}, x=0.5, y=0.5,
                       xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(height=240, margin={"l": 20, "r": 20, "t": 40, "b": 20})
    return fig


def _layout(fig: go.Figure, title: str, height: int = 420) -> go.Figure:
    fig.update_layout(
        title={"text": title, "x": 0.01, "xanchor": "left"},
        height=height,
        margin={"l": 60, "r": 20, "t": 50, "b": 50},
        template="plotly_white",
    )
    return fig


# ---------------------------------------------------------------- layer x module aggregation


def _layer_sort_key(layer: Any) -> tuple[int, int]:
    return (1, 0) if layer is None else (0, int(layer))


def _module_sort_key(module: str) -> tuple[int, str]:
    return (MODULE_ORDER.index(module), "") if module in MODULE_ORDER else (len(MODULE_ORDER), module)


def layer_module_cells(result: dict[str, Any]) -> dict[tuple[Any, str], dict[str, Any]]:
    """(layer, module) -> {mean, max, mass, share, numel, density, params: [names]}.

    From "tensor" rows when present (exact: mean = sum(mass)/sum(numel) when both are known,
    share = sum of shares or mass/total mass); "layer_module" rows fill values the tensor rows
    cannot give and are used alone when there are no tensor rows.
    """
    rows = result.get("layer_stats") or []
    tensors = [r for r in rows if r.get("group", "tensor") == "tensor"]
    aggregates = [r for r in rows if r.get("group") == "layer_module"]
    cells: dict[tuple[Any, str], dict[str, Any]] = {}
    total_mass = sum(_finite(r["values"].get("mass")) or 0.0 for r in tensors)
    acc: dict[tuple[Any, str], dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    for r in tensors:
        key = (r.get("layer"), r.get("module") or "other")
        a = acc[key]
        a["params"].append(r.get("param", ""))
        for k, v in (r.get("values") or {}).items():
            if (f := _finite(v)) is not None:
                a[k].append(f)
    for key, a in acc.items():
        c: dict[str, Any] = {"params": list(a["params"])}
        numel, mass, mean = a.get("numel"), a.get("mass"), a.get("mean")
        if mass and numel and len(mass) == len(numel) and sum(numel) > 0:
            c["mean"] = sum(mass) / sum(numel)
        elif mean and numel and len(mean) == len(numel) and sum(numel) > 0:
            c["mean"] = sum(m * n for m, n in zip(mean, numel, strict=True)) / sum(numel)
        elif mean:
            c["mean"] = sum(mean) / len(mean)
        if mass:
            c["mass"] = sum(mass)
        if a.get("share"):
            c["share"] = sum(a["share"])
        elif mass and total_mass > 0:
            c["share"] = sum(mass) / total_mass
        if a.get("max"):
            c["max"] = max(a["max"])
        if numel:
            c["numel"] = sum(numel)
        if a.get("density"):
            d = a["density"]
            if numel and len(numel) == len(d) and sum(numel) > 0:
                c["density"] = sum(x * n for x, n in zip(d, numel, strict=True)) / sum(numel)
            else:
                c["density"] = sum(d) / len(d)
        for k, vals in a.items():  # any other numeric value: mean over tensors
            if k not in c and k != "params" and vals:
                c[k] = sum(vals) / len(vals)
        cells[key] = c
    for r in aggregates:
        key = (r.get("layer"), r.get("module") or "other")
        c = cells.setdefault(key, {"params": []})
        for k, v in (r.get("values") or {}).items():
            if k not in c and (f := _finite(v)) is not None:
                c[k] = f
    return cells


def _grid(cells: dict[tuple[Any, str], dict[str, Any]]) -> tuple[list[Any], list[str]]:
    layers = sorted({k[0] for k in cells}, key=_layer_sort_key)
    modules = sorted({k[1] for k in cells}, key=_module_sort_key)
    return layers, modules


def _layer_label(layer: Any) -> str:
    return NO_LAYER if layer is None else str(layer)


def _hover_params(params: list[str], limit: int = 4) -> str:
    if not params:
        return "(aggregate)"
    shown = "<br>".join(params[:limit])
    return shown + (f"<br>... +{len(params) - limit} more" if len(params) > limit else "")


def layer_module_heatmap(
    result: dict[str, Any], value: str = "mean", log: bool = True, title: str | None = None
) -> go.Figure:
    """Heatmap with y = layer, x = module type, colour = `value` (mean, share, mass, max, density).

    Log colour scale by default (z = log10(value); zero cells left blank); hover shows the exact
    numbers (mean, share, mass, max) and the parameter names in the cell.
    """
    cells = layer_module_cells(result)
    cells = {k: c for k, c in cells.items() if value in c}
    if not cells:
        return empty_figure(f"no per-layer '{value}' statistics in this result")
    layers, modules = _grid(cells)
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
            v = c[value]
            zrow.append(log10_or_none(v) if log else _finite(v))
            nums = " ".join(
                f"{k}={fmt(c[k])}" for k in ("mean", "share", "mass", "max", "density", "numel") if k in c
            )
            trow.append(f"{nums}<br>{_hover_params(c['params'])}")
        z.append(zrow)
        text.append(trow)
    colorbar = _log_colorbar(z, f"log10 {value}") if log else {"title": {"text": value}}
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=modules,
            y=[_layer_label(layer) for layer in layers],
            customdata=text,
            colorscale=COLORSCALE,
            colorbar=colorbar,
            hoverongaps=False,
            hovertemplate="layer %{y}, module %{x}<br>%{customdata}<extra></extra>",
        )
    )
    fig.update_yaxes(title_text="layer", type="category", autorange="reversed")
    fig.update_xaxes(title_text="module type", type="category")
    scale = " (log colour scale)" if log else ""
    return _layout(fig, title or f"Fisher {value} by layer x module{scale}",
                   height=max(300, 28 * len(layers) + 140))


def per_layer_bars(result: dict[str, Any], value: str = "share") -> go.Figure:
    """Bars: one per layer (non-layer parameters as '-'), stacked by module type."""
    cells = {k: c for k, c in layer_module_cells(result).items() if value in c}
    if not cells:
        return empty_figure(f"no per-layer '{value}' statistics in this result")
    layers, modules = _grid(cells)
    fig = go.Figure()
    for m in modules:
        ys = [cells.get((layer, m), {}).get(value) for layer in layers]
        if all(y is None for y in ys):
            continue
        fig.add_bar(
            name=m,
            x=[_layer_label(layer) for layer in layers],
            y=[0.0 if y is None else y for y in ys],
            hovertemplate=f"layer %{{x}}, {m}: %{{y:.4g}}<extra></extra>",
        )
    fig.update_layout(barmode="stack", legend_title_text="module")
    fig.update_xaxes(title_text="layer", type="category")
    fig.update_yaxes(title_text=value)
    return _layout(fig, f"Fisher {value} per layer")


# ---------------------------------------------------------------- series


def series_by_name(result: dict[str, Any]) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {}
    for p in result.get("series") or []:
        xs, ys = out.setdefault(p["name"], ([], []))
        xs.append(float(p["step"]))
        ys.append(float(p["value"]))
    for name, (xs, ys) in out.items():
        order = sorted(range(len(xs)), key=xs.__getitem__)
        out[name] = ([xs[i] for i in order], [ys[i] for i in order])
    return out


def concentration_figure(result: dict[str, Any]) -> go.Figure:
    """Share of Fisher mass (y) held by the top x fraction of coordinates; diagonal = uniform."""
    s = series_by_name(result).get("concentration")
    if not s:
        return empty_figure("no concentration curve in this result")
    xs, ys = s
    fig = go.Figure()
    fig.add_scatter(x=xs, y=ys, mode="lines+markers", name="Fisher",
                    hovertemplate="top %{x:.4g} of coordinates hold %{y:.4g} of the mass<extra></extra>")
    fig.add_scatter(x=[0, 1], y=[0, 1], mode="lines", name="uniform", line={"dash": "dot", "color": "grey"})
    fig.update_xaxes(title_text="fraction of coordinates (top by Fisher)", type="log"
                     if min(x for x in xs) > 0 and max(xs) / max(min(xs), 1e-12) > 100 else "linear")
    fig.update_yaxes(title_text="share of Fisher mass", range=[0, 1.02])
    summ = result.get("summary") or {}
    gini = summ.get("gini")
    title = "Concentration of the Fisher" + (f" (Gini {fmt(gini)})" if gini is not None else "")
    return _layout(fig, title)


def _split_curve_name(name: str) -> tuple[str, str] | None:
    if "/" not in name:
        return None
    metric, run = name.split("/", 1)
    return metric, run


Curves = dict[str, dict[str, tuple[list[float], list[float]]]]  # metric -> run -> (xs, ys)


def curve_groups(result: dict[str, Any], prefixes: Sequence[str] | None = None) -> Curves:
    """Series named "<metric>/<run>" grouped as metric -> run -> (xs, ys), for the given metric
    prefixes (all when None). "bound/*" points are never curves."""
    groups: Curves = defaultdict(dict)
    for name, xy in series_by_name(result).items():
        parts = _split_curve_name(name)
        if not parts or parts[0] == "bound" or (prefixes is not None and parts[0] not in prefixes):
            continue
        groups[parts[0]][parts[1]] = xy
    return dict(groups)


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
    fig.update_yaxes(title_text=labels.get(chosen, chosen))
    return _layout(fig, title)


def training_curves(result: dict[str, Any], metric: str | None = None) -> go.Figure:
    """Series named "<metric>/<run>": one line per run (mask) for `metric` (default: first,
    preferring "reward"); a dropdown switches metric when there are several.

    A train job's own curves are "train/<metric>" (one run): shown one metric at a time."""
    groups = curve_groups(result)
    if set(groups) <= {"train", "eval"} and "train" in groups:
        groups = {k: {"this run": xy} for k, xy in groups["train"].items()}
        return curves_figure(groups, "Training curves", metric=metric)
    groups = {m: g for m, g in groups.items() if m not in ("retention", "heldout", "unchanged", "eval")}
    return curves_figure(groups, "Training curves (one line per mask)", metric=metric,
                         labels={"train_reward": "sample reward"})


def bound_scatter(result: dict[str, Any], max_points: int = MAX_POINTS) -> go.Figure:
    """|gradient| (y) against sqrt(Fisher) (x) per coordinate, downsampled, log-log, with the
    Cauchy-Schwarz bound line y = sqrt(E[A^2]) x when the summary gives the constant."""
    named = series_by_name(result)
    s = named.get("bound") or named.get("bound/|grad|")
    if not s:
        return empty_figure("no bound check points in this result")
    xs, ys = s
    keep = downsample(len(xs), max_points)
    x = [xs[i] for i in keep]
    y = [ys[i] for i in keep]
    fig = go.Figure()
    fig.add_scattergl(x=x, y=y, mode="markers", name="coordinates", marker={"size": 4, "opacity": 0.5},
                      hovertemplate="sqrt(F)=%{x:.4e}<br>|g|=%{y:.4e}<extra></extra>")
    summ = {**(result.get("summary") or {}), **((result.get("summary") or {}).get("bound") or {})}
    c = _finite(summ.get("bound_constant") or summ.get("bound_rms_advantage"))
    pos = [v for v in x if v > 0]
    if c is not None and pos:
        lo, hi = min(pos), max(pos)
        fig.add_scatter(x=[lo, hi], y=[c * lo, c * hi], mode="lines", name="bound sqrt(E[A^2]) sqrt(F)",
                        line={"dash": "dash", "color": "red"})
    fig.update_xaxes(title_text="sqrt(Fisher)", type="log")
    fig.update_yaxes(title_text="|gradient|", type="log")
    note = f" ({len(keep)} of {len(xs)} points)" if len(keep) < len(xs) else ""
    held = _finite(summ.get("bound_holds_fraction", summ.get("bound_fraction_holds")))
    extra = f"; the bound holds for {100 * held:.4g}% of coordinates" if held is not None else ""
    return _layout(fig, f"Gradient vs Fisher bound{note}{extra}")


# ---------------------------------------------------------------- heatmaps


HEATMAP_TITLES = {
    "fisher/mean": "Fisher mean by layer x module",
    "fisher/share": "Fisher share of mass by layer x module",
    "fisher_vs_delta_jaccard_lift": "Top-k Fisher vs top-k |delta|: Jaccard / random baseline",
    "fisher_vs_delta_auc": "Fisher as a predictor of top-k |delta|: ROC-AUC",
    "fisher_vs_delta_precision_at_k": "Top-k Fisher vs top-k |delta|: precision@k",
    "threshold_profile": "Unchanged fraction by layer and threshold",
    "bound_log_hist": "Coordinates by log10 |gradient| (rows) and log10 sqrt(Fisher) (columns)",
    "retention": "Retention by selector and density (mean over seeds)",
}


def heatmap_title(hm: dict[str, Any]) -> str:
    meta = hm.get("meta") or {}
    name = hm.get("name", "heatmap")
    return meta.get("title") or HEATMAP_TITLES.get(name) or name.replace("_", " ").replace("/", ": ")


def _canonical_columns(hm: dict[str, Any]) -> dict[str, Any]:
    """Module-type columns in the canonical order (embed, q, k, v, ..., lm_head)."""
    x = list(hm.get("x_labels") or [])
    if not x or not all(v in MODULE_ORDER for v in x):
        return hm
    order = sorted(range(len(x)), key=lambda j: MODULE_ORDER.index(x[j]))
    if order == list(range(len(x))):
        return hm
    z = [[row[j] for j in order] for row in hm.get("z") or []]
    return {**hm, "x_labels": [x[j] for j in order], "z": z}


def _is_layer_axis(labels: Sequence[str], title: str) -> bool:
    return title == "layer" or (bool(labels) and all(str(v).isdigit() or v == NO_LAYER for v in labels))


def heatmap_figure(hm: dict[str, Any], log: bool | None = None, title: str | None = None) -> go.Figure:
    """Any stored heatmap (pooled when large). log=None -> meta.get("log", False).

    Axis titles from meta x_title/y_title (or x/y); layer rows read top-down, other y axes upward."""
    hm = _canonical_columns(hm)
    z, xl, yl = pool_matrix(hm.get("z") or [], hm.get("x_labels") or [], hm.get("y_labels") or [])
    if not z or not z[0]:
        return empty_figure(f"heatmap {hm.get('name', '')} is empty")
    meta = hm.get("meta") or {}
    x_title = str(meta.get("x_title") or meta.get("x") or "")
    y_title = str(meta.get("y_title") or meta.get("y") or "")
    use_log = bool(meta.get("log", False)) if log is None else log
    zz = [[log10_or_none(v) for v in row] for row in z] if use_log else z
    exact = [[fmt(v) for v in row] for row in z]
    unit = str(meta.get("units") or meta.get("value") or "value")
    colorbar = _log_colorbar(zz, f"log10 {unit}") if use_log else {"title": {"text": unit}}
    trace = go.Heatmap(
        z=zz, x=xl, y=yl, customdata=exact, colorscale=meta.get("colorscale", COLORSCALE),
        colorbar=colorbar, hoverongaps=False,
        hovertemplate=f"{y_title or 'y'} %{{y}}, {x_title or 'x'} %{{x}}"
                      f"<br>{unit} = %{{customdata}}<extra></extra>",
    )
    if not use_log and meta.get("zmin") is not None:
        trace.update(zmin=meta["zmin"], zmax=meta.get("zmax"))
    fig = go.Figure(trace)
    fig.update_xaxes(title_text=x_title, type="category")
    fig.update_yaxes(title_text=y_title, type="category",
                     autorange="reversed" if _is_layer_axis(yl, y_title) else True)
    return _layout(fig, title or heatmap_title(hm), height=max(300, min(900, 24 * len(yl) + 140)))


def mask_density_heatmap(result: dict[str, Any]) -> go.Figure:
    """Kept fraction of each (layer, module) cell: a stored "*density*" heatmap, else layer_stats."""
    for hm in result.get("heatmaps") or []:
        if "density" in hm.get("name", "") and not _is_sparsity(hm):
            meta = {"zmin": 0.0, "zmax": None, "units": "density", **(hm.get("meta") or {})}
            return heatmap_figure({**hm, "meta": meta}, title="Mask density by layer x module")
    fig = layer_module_heatmap(result, value="density", log=False, title="Mask density by layer x module")
    return fig


def _is_sparsity(hm: dict[str, Any]) -> bool:
    name = hm.get("name", "")
    return name.startswith(("update_sparsity", "sparsity", "unchanged")) or "threshold" in (hm.get("meta") or {})


def update_sparsity_heatmap(result: dict[str, Any]) -> go.Figure:
    """Fraction of unchanged coordinates per layer x module, one frame per threshold with a slider.

    Uses heatmaps that carry meta["threshold"] (or are named update_sparsity*/sparsity*)."""
    hms = [h for h in result.get("heatmaps") or [] if _is_sparsity(h)]
    if not hms:
        return empty_figure("no update-sparsity heatmaps in this result")

    def thr_key(h: dict[str, Any]) -> tuple[int, float, str]:
        t = _finite((h.get("meta") or {}).get("threshold"))
        return (0, t, "") if t is not None else (1, 0.0, h.get("name", ""))

    hms.sort(key=thr_key)
    fig = go.Figure()
    labels = []
    for i, h in enumerate(hms):
        z, xl, yl = pool_matrix(h["z"], h["x_labels"], h["y_labels"])
        meta = h.get("meta") or {}
        t = meta.get("threshold")
        label = str(meta.get("threshold_label") or (t if t is not None else h.get("name", f"#{i}")))
        labels.append(label)
        fig.add_heatmap(
            z=z, x=xl, y=yl, zmin=0.0, zmax=1.0, colorscale=COLORSCALE, visible=(i == 0), name=label,
            customdata=[[fmt(v) for v in row] for row in z],
            colorbar={"title": {"text": "unchanged fraction"}},
            hovertemplate=f"{label}<br>layer %{{y}}, module %{{x}}<br>unchanged = %{{customdata}}<extra></extra>",
        )
    steps = [{"label": lab, "method": "update",
              "args": [{"visible": [j == i for j in range(len(hms))]},
                       {"title.text": f"Update sparsity: unchanged by {lab}"}]}
             for i, lab in enumerate(labels)]
    if len(hms) > 1:
        fig.update_layout(sliders=[{"active": 0, "currentvalue": {"prefix": "threshold: "},
                                    "steps": steps, "pad": {"t": 40}}])
    fig.update_xaxes(title_text="module type", type="category")
    fig.update_yaxes(title_text="layer", type="category", autorange="reversed")
    ny = len(hms[0]["y_labels"])
    return _layout(fig, f"Update sparsity: unchanged by {labels[0]}", height=max(360, 24 * ny + 200))


# ---------------------------------------------------------------- tables


def _rows_table(rows: Any, preferred: Sequence[str] = ()) -> Table:
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
    return headers, [[_cell(r.get(h)) for h in headers] for r in rows]


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        return float(fmt(v)) if _finite(v) is not None else None
    if isinstance(v, list | dict):
        return str(v)
    return v


def overlap_table(result: dict[str, Any]) -> Table:
    """Fisher-vs-update overlap metrics (precision@k, AUC, Jaccard vs its random baseline...)."""
    summ = result.get("summary") or {}
    rows = summ.get("overlap")
    if rows is None and isinstance(summ.get("overlap_with_fisher_topk"), dict):
        rows = summ["overlap_with_fisher_topk"]
    if rows is None:
        rows = [{"param": r.get("param"), "layer": r.get("layer"), "module": r.get("module"), **r["values"]}
                for r in result.get("layer_stats") or [] if r.get("group") == "overlap"]
    if rows is None or rows == []:
        keys = [k for k in summ if any(s in k for s in ("precision", "auc", "jaccard", "spearman"))
                and not k.startswith("split_half") and not isinstance(summ[k], list | dict)]
        rows = [{"metric": k, "value": summ[k]} for k in keys]
    return _rows_table(rows, ("scope", "metric", "k_percent", "precision_at_k", "auc", "jaccard",
                              "jaccard_random", "spearman", "value"))


def _ci_bars(rows: list[dict[str, Any]], center: str, ci: str) -> dict[str, Any]:
    """Asymmetric Plotly error bars from [lo, hi] intervals (missing ends drawn as 0 length)."""
    up, down = [], []
    for r in rows:
        c, iv = _finite(r.get(center)), r.get(ci)
        lo = _finite(iv[0]) if isinstance(iv, list | tuple) and len(iv) == 2 else None
        hi = _finite(iv[1]) if isinstance(iv, list | tuple) and len(iv) == 2 else None
        up.append(hi - c if c is not None and hi is not None else 0.0)
        down.append(c - lo if c is not None and lo is not None else 0.0)
    return {"type": "data", "symmetric": False, "array": up, "arrayminus": down, "visible": True}


def retention_figure(result: dict[str, Any]) -> go.Figure:
    """Retention (ratio of means) against density, one line per selector, with bootstrap intervals
    over seeds and prompts. When full training did not beat the base beyond its error there is no
    ratio to show: the figure shows held-out rewards with their intervals and says why."""
    summ = result.get("summary") or {}
    rows = [r for r in summ.get("rows") or [] if isinstance(r, dict) and _finite(r.get("density")) is not None]
    if not rows:
        return curves_figure({m: g for m, g in curve_groups(result).items() if m in ("retention", "heldout")},
                             "Retention by mask density", x_title="density",
                             metric="retention", log_x=True, labels={"heldout": "held-out reward"})
    conf = f"{float(summ.get('confidence') or 0.95):.0%}"
    legacy = "retention" not in rows[0]  # results stored before intervals existed: mean +- std
    valid = summ.get("retention_valid", True) is not False
    metric = "retention" if valid else "reward_mean"
    if legacy:
        metric = "retention_mean"
    fig = go.Figure()
    by_sel: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_sel[str(r.get("selector"))].append(r)
    for sel, rs in by_sel.items():
        rs.sort(key=lambda r: float(r["density"]))
        if legacy:
            bars: dict[str, Any] = {"type": "data", "visible": True,
                                    "array": [_finite(r.get("retention_std")) or 0.0 for r in rs]}
        else:
            bars = _ci_bars(rs, metric, "retention_ci" if valid else "reward_ci")
        fig.add_scatter(
            x=[float(r["density"]) for r in rs], y=[_finite(r.get(metric)) for r in rs],
            error_y=bars, mode="lines+markers", name=sel,
            customdata=[[fmt(r.get("reward_mean")), str(r.get("retention_ci")), str(r.get("retentions"))]
                        for r in rs],
            hovertemplate=f"{sel} @ density %{{x}}<br>%{{y:.4g}} ({conf} CI %{{customdata[1]}})"
                          "<br>held-out reward %{customdata[0]}<br>per seed %{customdata[2]}<extra></extra>",
        )
    fig.update_xaxes(title_text="mask density (fraction of coordinates trained)", type="log")
    if valid:
        fig.add_hline(y=1.0, line_dash="dot", line_color="grey", annotation_text="full training")
        fig.add_hline(y=0.0, line_dash="dot", line_color="grey", annotation_text="base")
        fig.update_yaxes(title_text="retention = (masked - base) / (full - base)")
        title = (f"Retention by mask density (ratio of means; {conf} bootstrap CI over seeds and prompts)"
                 if not legacy else "Retention by mask density (mean +- spread over seeds)")
        return _layout(fig, title)
    for name, raw in (("base", summ.get("base_reward")), ("full training", summ.get("full_reward_mean"))):
        if (y := _finite(raw)) is not None:
            fig.add_hline(y=y, line_dash="dot", line_color="grey", annotation_text=f"{name} {fmt(y)}")
    fig.update_yaxes(title_text=f"held-out reward ({conf} CI)")
    fig.add_annotation(text="No retention: " + str(summ.get("warning") or "full training did not beat the base"),
                       xref="paper", yref="paper", x=0.0, y=1.0, xanchor="left", yanchor="bottom",
                       showarrow=False, font={"color": "#b00020"}, align="left")
    return _layout(fig, "No retention shown: full training did not beat the base beyond its error", height=460)


def retention_table(result: dict[str, Any]) -> Table:
    """One row per (selector, density): held-out reward with its interval, retention (ratio of
    means) with bootstrap intervals over seeds and prompts, and per-seed (paired) retentions."""
    summ = result.get("summary") or {}
    rows = summ.get("retention") or summ.get("rows") or []

    def cell(v: Any) -> Any:
        if isinstance(v, list | tuple) and len(v) <= 16 and all(x is None or isinstance(x, int | float) for x in v):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return v

    # intervals and the paired per-seed retentions are shown; per-seed rewards are left out
    rows = [{k: cell(v) for k, v in r.items() if not isinstance(v, dict) and k != "rewards"}
            for r in rows if isinstance(r, dict)]
    if rows and summ.get("base_reward") is not None:
        rows = [{"selector": "(base, no training)", "reward_mean": summ["base_reward"],
                 "reward_se": summ.get("base_se")},
                {"selector": "(full training)", "density": 1.0, "reward_mean": summ.get("full_reward_mean"),
                 "reward_std": summ.get("full_reward_std"), "reward_se": summ.get("full_se"),
                 "retention": 1.0 if summ.get("retention_valid", True) is not False else None}, *rows]
    return _rows_table(rows, ("selector", "density", "actual_density", "reward_mean", "reward_ci", "reward_se",
                              "reward_std", "retention", "retention_ci", "retention_ci_seeds",
                              "retention_ci_prompts", "retentions", "retention_mean", "retention_std"))


def summary_table(result: dict[str, Any]) -> Table:
    """Flat scalar entries of the summary (nested objects shown as text)."""
    summ = result.get("summary") or {}
    rows: list[list[Any]] = []
    for k, v in summ.items():
        if isinstance(v, dict) and k not in ("settings", "overlap_settings") and len(v) <= 40:
            rows += [[f"{k}.{kk}", _cell(vv)] for kk, vv in v.items()
                     if not isinstance(vv, list | dict) or len(str(vv)) < 200]
        elif not isinstance(v, list | dict) or len(str(v)) < 200:
            rows.append([k, _cell(v)])
    return ["key", "value"], rows


def exact_output_table(result: dict[str, Any]) -> Table:
    """Monte-Carlo vs exact output-layer Fisher (a correctness check), one row per parameter."""
    rows = (result.get("summary") or {}).get("exact_output")
    if not isinstance(rows, dict) or not rows:
        return [], []
    return _rows_table([{"param": k, **v} for k, v in rows.items() if isinstance(v, dict)],
                       ("param", "relative_l1_error", "mc_mass", "exact_mass"))


def layer_stats_table(result: dict[str, Any]) -> Table:
    """Every layer_stats row flattened: group, param, layer, module, then each value key."""
    rows = result.get("layer_stats") or []
    keys: list[str] = []
    for r in rows:
        keys += [k for k in (r.get("values") or {}) if k not in keys]
    headers = ["group", "param", "layer", "module", *keys]
    out = [[r.get("group", "tensor"), r.get("param", ""), r.get("layer"), r.get("module"),
            *[(r.get("values") or {}).get(k) for k in keys]] for r in rows]
    return headers, out


# ---------------------------------------------------------------- token explorer


def _token_rows(result: dict[str, Any], key: str) -> list[dict[str, Any]]:
    rows = (result.get("summary") or {}).get(key) or []
    return [r for r in rows if isinstance(r, dict)]


def show_token(tok: str) -> str:
    """Visible form of a token (spaces and control characters made explicit)."""
    return repr(tok)[1:-1].replace(" ", "\u2423") if tok != "" else "(empty)"


def token_bars(result: dict[str, Any]) -> go.Figure:
    """Top next tokens (and random contrast tokens): probability and share of the Fisher."""
    top = _token_rows(result, "top_tokens")
    rnd = _token_rows(result, "random_tokens")
    low = _token_rows(result, "low_tokens")
    if not top:
        return empty_figure("no token results")
    fig = go.Figure()
    for rows, label, colour in ((top, "top", "#1f77b4"), (rnd, "random", "#ff7f0e"), (low, "low", "#2ca02c")):
        if not rows:
            continue
        x = [f"{show_token(r.get('token', ''))} ({label})" if label != "top" else show_token(r.get("token", ""))
             for r in rows]
        fig.add_bar(x=x, y=[r.get("prob") for r in rows], name=f"probability ({label})",
                    marker_color=colour, hovertemplate="%{x}: p=%{y:.4g}<extra></extra>")
        if any("share" in r for r in rows):
            fig.add_bar(x=x, y=[r.get("share") for r in rows], name=f"share of Fisher ({label})",
                        marker_color=colour, marker_pattern_shape="/", opacity=0.6,
                        hovertemplate="%{x}: share=%{y:.4g}<extra></extra>")
    fig.update_layout(barmode="group")
    fig.update_xaxes(title_text="next token", type="category")
    fig.update_yaxes(title_text="probability / share")
    ctx = (result.get("summary") or {}).get("context")
    return _layout(fig, "Next tokens" + (f" after {ctx[-40:]!r}" if isinstance(ctx, str) else ""))


def token_similarity_heatmap(result: dict[str, Any], which: str = "top") -> go.Figure:
    """Cosine similarity of the tokens' parameter-sensitivity vectors (stored heatmap named
    'similarity_<which>' or containing 'similarity' and <which>)."""
    cands = [h for h in result.get("heatmaps") or [] if "similarity" in h.get("name", "")]
    pick = [h for h in cands if which in h.get("name", "")] or (cands if which == "top" else [])
    if not pick:
        return empty_figure(f"no {which}-token similarity matrix")
    hm = pick[0]
    mean = (hm.get("meta") or {}).get("mean_offdiag")
    hm = {**hm, "x_labels": [show_token(t) for t in hm.get("x_labels", [])],
          "y_labels": [show_token(t) for t in hm.get("y_labels", [])]}
    meta = {"zmin": -1.0, "zmax": 1.0, "units": "cosine", "colorscale": "RdBu", "x_title": "token",
            "y_title": "token", **(hm.get("meta") or {})}
    extra = f", mean off-diagonal {fmt(mean)}" if mean is not None else ""
    return heatmap_figure({**hm, "meta": meta}, log=False,
                          title=f"Sensitivity similarity ({which} tokens{extra})")


def token_counterfactual_figure(result: dict[str, Any]) -> go.Figure:
    """Measured trace F at this position against F_orth, the counterfactual where the tokens'
    sensitivities were mutually orthogonal (all tokens; only the top-k): the gap is what their
    similarity removes (SCIENCE.md section 5). Lower bounds, marked as such, when the vocabulary
    was not enumerated."""
    sim = (result.get("summary") or {}).get("similarity") or {}
    if not sim:
        return empty_figure("no orthogonal-counterfactual numbers in this result")
    k = sim.get("top_k")
    exact = bool(sim.get("exact"))
    if exact:
        names = ["trace F (measured)", "F_orth (all tokens orthogonal)", f"F_orth (top-{k} orthogonal)"]
        vals = [sim.get("trace_f"), sim.get("trace_f_orth"), sim.get("trace_f_orth_top")]
        share = (f"similarity removes {fmt(sim.get('removed'))} = {fmt(sim.get('removed_share'))} of F_orth; "
                 f"top-{k} pairs {fmt(sim.get('removed_top'))} = {fmt(sim.get('removed_top_share'))}")
    else:
        names = ["trace F >= (covered tokens)", "F_orth >= (covered tokens)"]
        vals = [sim.get("trace_f_lower"), sim.get("trace_f_orth_lower")]
        share = (f"bounds (vocabulary not enumerated): removed <= {fmt(sim.get('removed_upper'))}, share <= "
                 f"{fmt(sim.get('removed_share_upper'))}; top-{k} pairs remove {fmt(sim.get('removed_top'))}")
    fig = go.Figure(go.Bar(x=names, y=[_finite(v) for v in vals], text=[fmt(v) for v in vals],
                           textposition="outside", marker_color=["#1f77b4", "#aaaaaa", "#cccccc"][: len(names)]))
    fig.update_yaxes(title_text="trace of the position Fisher")
    return _layout(fig, f"Fisher vs orthogonal sensitivities: {share}")


def token_choices(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, token) pairs for clickable top tokens, most likely first."""
    rows = sorted(_token_rows(result, "top_tokens"), key=lambda r: -(_finite(r.get("prob")) or 0.0))
    return [(f"{show_token(r.get('token', ''))}  p={fmt(r.get('prob'))}", str(r.get("token", "")))
            for r in rows]


def share_colour_range(a: go.Figure, b: go.Figure) -> None:
    """Give two single-heatmap figures one colour range (in place), so colours compare directly."""
    if len(a.data) != 1 or len(b.data) != 1 or a.data[0].type != "heatmap" or b.data[0].type != "heatmap":
        return
    vals = [v for fig in (a, b) for row in (fig.data[0].z or []) for v in row if _finite(v) is not None]
    if not vals:
        return
    lo, hi = min(vals), max(vals)
    for fig in (a, b):
        fig.data[0].update(zmin=lo, zmax=hi, zauto=False)


# ---------------------------------------------------------------- what a result view shows


# ---------------------------------------------------------------- sweeps (lr x optimizer x precision)


def _sweep_points(result: dict[str, Any]) -> list[dict[str, Any]]:
    summ = result.get("summary") or {}
    return list(summ.get("points") or result.get("points") or [])


def _sweep_lines(points: list[dict[str, Any]], key: str) -> dict[str, tuple[list[float], list[float | None]]]:
    lines: dict[str, tuple[list[float], list[float | None]]] = {}
    for p in sorted(points, key=lambda p: float(p.get("lr") or 0)):
        name = f"{p.get('optimizer')} {p.get('precision')}"
        xs, ys = lines.setdefault(name, ([], []))
        xs.append(float(p.get("lr") or 0))
        ys.append(_finite(p.get(key)))
    return lines


def sweep_sparsity_figure(result: dict[str, Any]) -> go.Figure:
    """Update sparsity (fraction of coordinates unchanged in bf16) against learning rate, one line
    per optimizer x precision; dotted: the published |delta_bf16| <= 1e-5 convention."""
    points = _sweep_points(result)
    if not points:
        return empty_figure("no sweep points in this result")
    fig = go.Figure()
    for key, dash, suffix in (("unchanged_bf16", "solid", "bf16-equal"),
                              ("unchanged_bf16delta_atol_1e-05", "dot", "|Δbf16| ≤ 1e-5")):
        for name, (xs, ys) in _sweep_lines(points, key).items():
            fig.add_scatter(x=xs, y=ys, mode="lines+markers", name=f"{name}: {suffix}", line={"dash": dash},
                            hovertemplate="lr %{x:.3g}<br>unchanged %{y:.4f}<extra>" + name + "</extra>")
    fig.update_xaxes(title_text="learning rate", type="log")
    fig.update_yaxes(title_text="fraction of coordinates unchanged", range=[0, 1.02])
    return _layout(fig, "Update sparsity vs learning rate x optimizer")


def sweep_auc_figure(result: dict[str, Any]) -> go.Figure:
    """Initial Fisher's ROC-AUC against learning rate: for 'changed' (solid), for 'changed' within
    |w| binades (dash: net of the bf16-ULP effect) and for the top-k of sum g^2 (dot)."""
    points = _sweep_points(result)
    if not points:
        return empty_figure("no sweep points in this result")
    fig = go.Figure()
    for key, dash, suffix in (("fisher_auc_changed", "solid", "AUC changed"),
                              ("fisher_auc_changed_within_binades", "dash", "AUC changed within |w| binades"),
                              ("fisher_auc_gradient", "dot", "AUC top-k Σg²")):
        for name, (xs, ys) in _sweep_lines(points, key).items():
            if all(y is None for y in ys):
                continue
            fig.add_scatter(x=xs, y=ys, mode="lines+markers", name=f"{name}: {suffix}", line={"dash": dash},
                            hovertemplate="lr %{x:.3g}<br>AUC %{y:.4f}<extra>" + name + "</extra>")
    fig.add_hline(y=0.5, line={"dash": "dot", "color": "grey"}, annotation_text="chance")
    fig.update_xaxes(title_text="learning rate", type="log")
    fig.update_yaxes(title_text="ROC-AUC of the initial Fisher", range=[0, 1.02])
    return _layout(fig, "Fisher AUC vs learning rate x optimizer")


def sweep_binade_figure(result: dict[str, Any]) -> go.Figure:
    """Fisher's AUC for 'changed' within each |w| binade (equal bf16 ULP), one line per point."""
    points = _sweep_points(result)
    fig = go.Figure()
    for p in points:
        bins = [b for b in p.get("fisher_auc_changed_by_binade") or [] if _finite(b.get("auc")) is not None
                and (_finite(b.get("abs_w_lo")) or 0) > 0]
        if not bins:
            continue
        name = f"{p.get('optimizer')} lr {float(p.get('lr') or 0):g} {p.get('precision')}"
        fig.add_scatter(x=[b["abs_w_lo"] for b in bins], y=[b["auc"] for b in bins], mode="lines+markers",
                        name=name, customdata=[[b.get("n"), b.get("n_changed")] for b in bins],
                        hovertemplate="|w| in [%{x:.3g}, 2x)<br>AUC %{y:.4f}<br>n %{customdata[0]}, "
                                      "changed %{customdata[1]}<extra>" + name + "</extra>")
    if not fig.data:
        return empty_figure("no binade with both changed and unchanged coordinates")
    fig.add_hline(y=0.5, line={"dash": "dot", "color": "grey"}, annotation_text="chance")
    fig.update_xaxes(title_text="|w| (binade lower edge; equal bf16 ULP inside)", type="log")
    fig.update_yaxes(title_text="ROC-AUC of the initial Fisher for 'changed'", range=[0, 1.02])
    return _layout(fig, "Fisher AUC within |w| bins (net of the bf16-ULP effect)")


def result_figures(result: dict[str, Any]) -> list[tuple[str, go.Figure]]:
    """(title, figure) pairs for everything this result can show, most informative first.

    Shown figures only: builders that have nothing to draw are left out."""
    kind = result.get("kind") or (result.get("job") or {}).get("kind")
    names = series_by_name(result)
    heatmaps = result.get("heatmaps") or []
    figs: list[tuple[str, go.Figure]] = []
    has_stats = any(r.get("values") for r in result.get("layer_stats") or [])
    cells = layer_module_cells(result) if has_stats else {}
    has = {k for c in cells.values() for k in c}
    shown: set[str] = set()  # stored heatmaps already drawn by a specific builder
    if kind == "sweep":
        figs += [("sweep_sparsity", sweep_sparsity_figure(result)), ("sweep_auc", sweep_auc_figure(result)),
                 ("sweep_binades", sweep_binade_figure(result))]
        figs += [(f"heatmap:{h.get('name', '')}", heatmap_figure(h)) for h in heatmaps]
        return figs
    if kind == "tokens":
        figs.append(("tokens", token_bars(result)))
        if (result.get("summary") or {}).get("similarity"):
            figs.append(("fisher_counterfactual", token_counterfactual_figure(result)))
        for which in ("top", "random", "low"):
            if any(h.get("name") == f"similarity_{which}" for h in heatmaps) or (
                    which == "top" and any("similarity" in h.get("name", "") for h in heatmaps)):
                figs.append((f"similarity_{which}", token_similarity_heatmap(result, which)))
        if "share" in has:
            figs.append(("fisher_share", layer_module_heatmap(
                result, "share", title="This position's Fisher: share by layer x module (log colour scale)")))
        return figs
    if kind in ("fisher", None) or ("mean" in has and kind not in ("mask", "diff", "train")):
        if "mean" in has:
            figs.append(("fisher_mean", layer_module_heatmap(result, "mean")))
            shown.add("fisher/mean")
        if "share" in has:
            figs.append(("fisher_share", layer_module_heatmap(result, "share")))
            figs.append(("per_layer", per_layer_bars(result, "share")))
            shown.add("fisher/share")
    if "concentration" in names:
        figs.append(("concentration", concentration_figure(result)))
    if any("density" in h.get("name", "") and not _is_sparsity(h) for h in heatmaps) or (
            kind == "mask" and "density" in has):
        figs.append(("mask_density", mask_density_heatmap(result)))
    if any(_is_sparsity(h) for h in heatmaps):
        figs.append(("update_sparsity", update_sparsity_heatmap(result)))
    if "bound" in names or "bound/|grad|" in names:
        figs.append(("bound", bound_scatter(result)))
    groups = curve_groups(result)
    if kind == "retention":
        if (result.get("summary") or {}).get("rows") or any(m in ("retention", "heldout") for m in groups):
            figs.append(("retention_curve", retention_figure(result)))
    if kind == "diff":
        unchanged = {m: g for m, g in groups.items() if m == "unchanged"}
        if unchanged:
            by_kind = {run: {run: xy} for run, xy in unchanged["unchanged"].items()}
            figs.append(("unchanged_curve", curves_figure(
                by_kind, "Unchanged fraction by threshold", x_title="threshold", log_x=True,
                labels={"atol": "unchanged (|delta_fp32| <= atol)",
                        "atol_bf16delta": "unchanged (|delta_bf16| <= atol, published convention)",
                        "rel_rms": "unchanged (|delta| <= t x rms)"})))
    elif any(m not in ("retention", "heldout", "unchanged") for m in groups):
        figs.append(("training", training_curves(result)))
    for h in heatmaps:  # anything else stored: a generic heatmap
        name = h.get("name", "")
        if _is_sparsity(h) or "density" in name or "similarity" in name or name in shown:
            continue
        log = True if name == "bound_log_hist" else None
        figs.append((f"heatmap:{name}", heatmap_figure(h, log=log)))
    return figs


SWEEP_COLUMNS = ("precision", "optimizer", "lr", "unchanged_bf16", "unchanged_exact",
                 "unchanged_bf16delta_atol_1e-05", "unchanged_atol_1e-05", "fisher_auc_changed",
                 "fisher_auc_changed_within_binades", "fisher_auc_gradient", "fisher_auc_abs_delta",
                 "reward_before", "reward_after")


def sweep_table(result: dict[str, Any]) -> Table:
    """One row per sweep point (empty for other results)."""
    points = _sweep_points(result) if result.get("kind") == "sweep" else []
    return list(SWEEP_COLUMNS), [[_cell(p.get(c)) for c in SWEEP_COLUMNS] for p in points]


def result_tables(result: dict[str, Any]) -> list[tuple[str, Table]]:
    """(title, table) pairs: overlap, retention, summary (non-empty only)."""
    out = []
    for title, table in (("Sweep points (lr x optimizer x precision)", sweep_table(result)),
                         ("Retention", retention_table(result)),
                         ("Overlap (Fisher vs update)", overlap_table(result)),
                         ("Exact output-layer check (Monte-Carlo vs closed form)", exact_output_table(result)),
                         ("Summary", summary_table(result))):
        if table[1]:
            out.append((title, table))
    return out
