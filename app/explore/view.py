"""The tensor view: one tensor of a result opened from a heatmap cell or a table row, as JSON
(GET /api/results/{token}/tensor) and as the HTML block the explorer and the share page insert
under the figure that was clicked (GET /api/results/{token}/tensor/view).

Computed on demand (app/explore/tensors.py, overlay.py) and kept as JSON in the artifact store
next to the share figures (`<job id>/explore-tensor-<key>.json`): the key hashes the tensor's
name, the sha256 of the files it is read from and the code in app/explore/, so a second open of
the same tensor, in any process, reads that file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from pathlib import Path
from typing import Any

from app import render
from app.explore import overlay, tensors
from app.explore.sources import NotReadable, Source, cell_of, job_files, names_in_cell, open_source
from app.figures.store import finite_json

log = logging.getLogger("fisherlens.explore")

CODE_KEY = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.py")))
                          ).hexdigest()[:12]
TEMPLATE: dict[str, Any] = {}  # plotly_white's layout, filled on first use


def _template() -> dict[str, Any]:
    if not TEMPLATE:
        import plotly.io as pio

        TEMPLATE.update(pio.templates["plotly_white"].to_plotly_json())
    return TEMPLATE
_locks: dict[str, threading.Lock] = {}
_guard = threading.Lock()


def _lock(key: str) -> threading.Lock:
    with _guard:
        return _locks.setdefault(key, threading.Lock())


def cache_name(kind: str, key: str) -> str:
    return f"explore-{kind}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def cached(settings: Any, job_id: int, kind: str, key: str, build: Any) -> dict[str, Any]:
    """Read `<job id>/explore-<kind>-<hash>.json`, or build it once (per process and key) and
    store it; a store that cannot be written only costs a rebuild next time."""
    from storage.artifacts import ArtifactStoreUnavailable, open_store

    store = open_store(settings)
    name = cache_name(kind, key)
    rel = f"{int(job_id)}/{name}"

    def read() -> dict[str, Any] | None:
        try:
            data = store.read_bytes(rel)
            out = json.loads(data) if data is not None else None
        except (OSError, ValueError, ArtifactStoreUnavailable):
            return None
        return out if isinstance(out, dict) and out.get("key") == key else None

    hit = read()
    if hit is not None:
        return {**hit, "cached": True}
    with _lock(rel):
        hit = read()
        if hit is not None:
            return {**hit, "cached": True}
        out = {"key": key, **build()}
        try:
            store.save_bytes(job_id, name, json.dumps(finite_json(out), separators=(",", ":")).encode())
        except (OSError, ArtifactStoreUnavailable):
            log.exception("explore cache of job %s not stored", job_id)
        return {**out, "cached": False}


# ---------------------------------------------------------------- the numbers


def k_percent(kind: str, spec: dict[str, Any]) -> float:
    """The top-k percent the result was scored with (its TensorView's k_fields), else 1."""
    from app.explore.sources import tensor_view

    for key in tensor_view(kind).k_fields:
        v = spec.get(key)
        if isinstance(v, int | float) and v > 0:
            return float(v)
    return 1.0


def tensor_numbers(settings: Any, token: str, name: str) -> dict[str, Any]:
    """The tensor view's numbers of tensor `name` of the result `token` (cached)."""
    jf = job_files(settings, token)
    src = open_source(settings, jf)
    if name not in src.files:
        raise NotReadable(f"name: this result has no tensor {name!r} (it has {len(src.files)} tensors)")
    key = f"{CODE_KEY}|{src.sha}|{name}"

    def build() -> dict[str, Any]:
        return compute(src, name, k_percent(jf.kind, jf.spec))

    return {**cached(settings, jf.id, "tensor", key, build), "token": jf.share_token}


def compute(src: Source, name: str, k: float = 1.0) -> dict[str, Any]:
    """The numbers of one tensor of `src` (uncached; the benchmark and the tests call this)."""
    shape = src.shape(name)
    layer, module = cell_of(name)
    heads = tensors.heads_for(module, shape, src.config)
    out: dict[str, Any] = {
        "name": name, "layer": layer, "module": module, "kind": src.kind, "value": src.value,
        "log": src.log, "notes": list(src.notes),
        **tensors.tensor_stats(shape, src.reader(name), pool=src.pool, heads=heads),
    }
    fisher = src.fisher_reader(name)
    if fisher is not None:
        out["overlay"] = overlay.overlay_stats(name, shape, src.reader(name), fisher, k)
    return out


def cell_tensors(settings: Any, token: str, layer: str | None = None, module: str | None = None) -> dict[str, Any]:
    """The tensors of a result ({name, shape, layer, module}), those of one cell when `layer`
    and `module` are given (largest first), else all of them (file order)."""
    src = open_source(settings, job_files(settings, token))
    names = src.names() if layer is None else names_in_cell(src.names(), layer, module or "")
    shapes = {n: src.shape(n) for n in names}
    if layer is not None:
        names = sorted(names, key=lambda n: -math.prod(shapes[n]))
    rows = [{"name": n, "shape": list(shapes[n]), "layer": cell_of(n)[0], "module": cell_of(n)[1]} for n in names]
    return {"kind": src.kind, "value": src.value, "tensors": rows}


# ---------------------------------------------------------------- figures


def _label(b: list[int]) -> str:
    return str(b[0]) if b[0] == b[1] else f"{b[0]}..{b[1]}"


def _log(v: float | None) -> float | None:
    return math.log10(v) if v is not None and v > 0 else None


def _r(v: Any) -> Any:
    """A number rounded to 4 significant digits for a figure (the JSON API keeps them all)."""
    if isinstance(v, list):
        return [_r(x) for x in v]
    if isinstance(v, float):
        return float(f"{v:.4g}") if math.isfinite(v) else None
    return v


def figure_json(data: list[dict[str, Any]], title: str, height: int = 360, xaxis: dict[str, Any] | None = None,
         yaxis: dict[str, Any] | None = None, **layout: Any) -> dict[str, Any]:
    """Plotly figure JSON written directly (plotly's validation of 40k-cell maps costs seconds;
    these are the same keys it would write)."""
    return {"data": data, "layout": {
        "title": {"text": title, "x": 0.01, "xanchor": "left"}, "height": height,
        "margin": {"l": 70, "r": 30, "t": 50, "b": 60}, "template": _template(),
        "xaxis": {"automargin": True, **(xaxis or {})}, "yaxis": {"automargin": True, **(yaxis or {})}, **layout}}


def _axis(title: str, **kw: Any) -> dict[str, Any]:
    return {"title": {"text": title}, **kw}


def figures(v: dict[str, Any]) -> list[dict[str, Any]]:
    """The tensor view's Plotly figures ({name, title, figure}) from its numbers."""
    out: list[dict[str, Any]] = []
    m = v["map"]
    log = bool(v.get("log"))
    z = [[_log(x) if log else x for x in row] for row in m["z"]]
    xs, ys = [_label(b) for b in m["col_blocks"]], [_label(b) for b in m["row_blocks"]]
    unit = v["value"]
    rb, cb = m["row_blocks"][0], m["col_blocks"][0]
    block = f"{rb[1] - rb[0] + 1} x {cb[1] - cb[0] + 1}"
    how = "block max" if v["pool"] == "max" else "block mean"
    hm = {"type": "heatmap", "z": _r(z), "x": xs, "y": ys, "colorscale": "Viridis", "customdata": _r(m["z"]),
          "hoverongaps": False, "colorbar": {"title": {"text": f"log10 {unit}" if log else unit}},
          "hovertemplate": f"rows %{{y}}, columns %{{x}}<br>{how} {unit} = %{{customdata:.4g}}<extra></extra>"}
    title = f"{v['name']}: {unit}, {how} over {block} blocks" + (" (log colour)" if log else "")
    out.append({"name": "tensor_map", "title": title, "figure": figure_json(
        [hm], title, 520, _axis("input column", type="category"),
        _axis("output row", type="category", autorange="reversed"))})
    for axis, what in (("row_marginal", "output row"), ("col_marginal", "input column")):
        mg = v[axis]
        if not mg["mean_sum"]:
            continue
        sizes = {b[1] - b[0] + 1 for b in mg["blocks"]}
        tr = {"type": "scatter", "mode": "lines", "x": [b[0] for b in mg["blocks"]], "y": _r(mg["mean_sum"]),
              "name": what, "hovertemplate": f"{what} %{{x}}: sum %{{y:.4g}}<extra></extra>"}
        ytitle = f"sum of {unit}" + (" (mean over blocks)" if sizes != {1} else "")
        t = f"Sum of {unit} per {what}" + (f" (blocks of {max(sizes)})" if sizes != {1} else "")
        out.append({"name": axis, "title": t, "figure": figure_json(
            [tr], t, 300, _axis(f"{what} index"), _axis(ytitle, type="log" if log else "linear"))})
    if v.get("heads"):
        h = v["heads"]
        tr = {"type": "bar", "x": list(range(len(h["sum"]))), "y": _r(h["sum"]),
              "hovertemplate": "head %{x}: sum %{y:.4g}<extra></extra>"}
        t = f"Sum of {unit} per attention head ({h['what']}, split along the {h['axis']})"
        out.append({"name": "heads", "title": t, "figure": figure_json(
            [tr], t, 300, _axis(h["what"].rstrip("s"), dtick=1), _axis(f"sum of {unit}"))})
    hist = v["histogram"]
    if hist["counts"]:
        lo, step = hist["log10_lo"], hist["step"]
        tr = {"type": "bar", "x": [round(lo + (i + 0.5) * step, 4) for i in range(len(hist["counts"]))],
              "y": hist["counts"], "width": step,
              "hovertemplate": "log10 value %{x}: %{y} coordinates<extra></extra>"}
        t = (f"Histogram of log10 {unit} ({hist['zeros']:,} zeros"
             + (f", {hist['negative']:,} negative" if hist["negative"] else "") + " not shown)")
        out.append({"name": "histogram", "title": t, "figure": figure_json(
            [tr], t, 300, _axis(f"log10 {unit}"), _axis("coordinates"))})
    if v.get("overlay"):
        out += overlay_figures(v)
    return out


def overlay_figures(v: dict[str, Any]) -> list[dict[str, Any]]:
    """The overlays of a diff / series tensor on its Fisher: scatter, ROC, changed map with the
    top-k Fisher outline."""
    o = v["overlay"]
    out: list[dict[str, Any]] = []
    sc = o["scatter"]
    pts = [(f, d, r, c) for f, d, r, c in zip(sc["fisher"], sc["delta"], sc["row"], sc["column"], strict=True)
           if f is not None and d is not None and f > 0 and d > 0]
    tr = {"type": "scattergl", "mode": "markers", "x": _r([p[0] for p in pts]), "y": _r([p[1] for p in pts]),
          "marker": {"size": 4, "opacity": 0.5}, "customdata": [[p[2], p[3]] for p in pts],
          "hovertemplate": "row %{customdata[0]}, column %{customdata[1]}<br>F %{x:.3e}, |delta| %{y:.3e}<extra></extra>"}
    zero = len(sc["fisher"]) - len(pts)
    t = f"|delta| against F, {len(pts):,} sampled coordinates ({zero:,} with F = 0 or |delta| = 0 not on log axes)"
    out.append({"name": "overlay_scatter", "title": t, "figure": figure_json(
        [tr], t, 420, _axis("Fisher F", type="log"), _axis("|delta|", type="log"))})
    data = []
    for key, label in (("top_delta", f"top-{o['k_percent']:g}% |delta|"), ("changed", "changed (|delta| > 0)")):
        roc = o["roc"][key]
        if roc["fpr"]:
            auc = roc["auc"]
            data.append({"type": "scatter", "mode": "lines", "x": _r(roc["fpr"]), "y": _r(roc["tpr"]),
                         "name": f"{label}: AUC {render.significant(auc) if auc is not None else 'n/a'}"})
    data.append({"type": "scatter", "mode": "lines", "x": [0, 1], "y": [0, 1], "name": "chance",
                 "line": {"dash": "dot", "color": "grey"}})
    n = f"{o['sample']:,} sampled coordinates" if o["sampled"] else "all coordinates"
    t = f"ROC of the Fisher for the updated coordinates of this tensor ({n})"
    out.append({"name": "overlay_roc", "title": t, "figure": figure_json(
        data, t, 420, _axis("false positive rate", range=[0, 1]), _axis("true positive rate", range=[0, 1.02]),
        legend={"x": 0.98, "xanchor": "right", "y": 0.05, "yanchor": "bottom"})})
    m = v["map"]
    xs, ys = [_label(b) for b in m["col_blocks"]], [_label(b) for b in m["row_blocks"]]
    k = o["k_percent"] / 100.0
    dense = all(x is not None and x >= 0.999 for row in o["changed_map"] for x in row)
    base, what = ((o["delta_topk_map"], f"top-{o['k_percent']:g}% |delta| fraction") if dense
                  else (o["changed_map"], "changed fraction"))
    data = [{"type": "heatmap", "z": _r(base), "x": xs, "y": ys, "colorscale": "Blues", "reversescale": True,
             "zmin": 0, "zmax": 1, "colorbar": {"title": {"text": what}},
             "hovertemplate": f"rows %{{y}}, columns %{{x}}<br>{what} %{{z:.3f}}<extra></extra>", "name": what},
            {"type": "contour", "z": _r(o["fisher_topk_map"]), "x": xs, "y": ys, "showscale": False,
             "name": f"top-{o['k_percent']:g}% Fisher (block density > {o['k_percent']:g}%)",
             "contours": {"coloring": "lines", "start": k, "end": k, "size": 1.0},
             "line": {"color": "#e8590c", "width": 2}, "hoverinfo": "skip", "showlegend": True}]
    if dense:
        t = (f"Every coordinate changed: the top-{o['k_percent']:g}% |delta| per block, outlined where the "
             f"top-{o['k_percent']:g}% Fisher of this tensor is denser than uniform")
    else:
        t = (f"Changed coordinates per block, outlined where the top-{o['k_percent']:g}% Fisher of this tensor "
             "is denser than uniform")
    out.append({"name": "overlay_mask", "title": t, "figure": figure_json(
        data, t, 520, _axis("input column", type="category"), _axis("output row", type="category", autorange="reversed"),
        legend={"orientation": "h", "y": -0.15})})
    return out


def top_table(v: dict[str, Any]) -> str:
    rows = [[i + 1, t["row"], t["column"], t["value"]] for i, t in enumerate(v["top"])]
    return render.table_html(["rank", "row", "column", v["value"]], rows,
                             f"Top {len(rows)} coordinates by {v['value']}", elem_id="fl-tensor-top")


def summary_line(v: dict[str, Any]) -> str:
    layer = "outside the blocks" if v["layer"] is None else f"layer {v['layer']}"
    bits = [f"shape <b>{' x '.join(str(s) for s in v['shape'])}</b>", f"{layer}, module <b>{render.esc(v['module'])}</b>",
            f"sum {render.significant(v['sum'])}", f"mean {render.significant(v['mean'])}",
            f"max {render.significant(v['max'])}", f"zeros {v['histogram']['zeros']:,}"]
    if v.get("overlay"):
        o = v["overlay"]
        for key, lab in (("top_delta", f"top-{o['k_percent']:g}% |delta|"), ("changed", "changed")):
            a = o["roc"][key]["auc"]
            bits.append(f"Fisher AUC ({lab}) <b>{render.significant(a) if a is not None else 'n/a'}</b>")
    return "<p class='fl-meta' id='fl-tensor-summary'>" + " &middot; ".join(bits) + "</p>"


def view_html(v: dict[str, Any], cell: list[dict[str, Any]] | None = None) -> str:
    """The tensor view as one HTML block (drawn by render.DRAW_FN like every figure)."""
    name = render.esc(v["name"])
    others = ""
    if cell and len(cell) > 1:
        links = "".join(f"<li><a href='#' class='fl-open-tensor' data-name='{render.esc(c['name'])}'>"
                        f"{render.esc(c['name'])}</a> ({' x '.join(str(s) for s in c['shape'])})</li>" for c in cell)
        others = f"<details open><summary>{len(cell)} tensors in this cell</summary><ul>{links}</ul></details>"
    notes = "".join(f"<p class='fl-meta'>{render.esc(n)}</p>" for n in v.get("notes") or [])
    how = ("Block max pooling: each block shows its largest value." if v["pool"] == "max"
           else "Block mean pooling: each block shows the mean (for a mask: the kept fraction).")
    return (f"<section class='fl-tensor' id='fl-tensor' data-name='{name}' data-cached='{int(bool(v.get('cached')))}'>"
            f"<h2>Tensor {name} <button type='button' class='fl-tensor-close' aria-label='close'>close</button></h2>"
            f"{summary_line(v)}{others}{notes}<p class='fl-meta'>{how}</p>"
            f"{render.figures_html(figures(v), 'fl-tensor-fig')}{top_table(v)}</section>")
