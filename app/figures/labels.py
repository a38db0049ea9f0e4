"""Name the rows outside the transformer blocks.

Compute stores parameters outside the blocks (embeddings, final norm, lm_head) under layer None,
shown as "-" on a layer axis. On a layer x module heatmap that row holds one cell per module, so
it is split into one named row per module ("embeddings", "final norm", "lm_head"); where the row
aggregates several modules (a layer x threshold heatmap) it is named for what it holds.
These functions rewrite Plotly figure JSON (dicts) and table cells; they never change a number.
"""

from __future__ import annotations

from typing import Any

NO_LAYER = "-"
MODULE_NAMES = {
    "embed": "embeddings",
    "pos_embed": "position embeddings",
    "norm": "final norm",
    "lm_head": "lm_head",
    "other": "other (outside the blocks)",
}
OUTSIDE = "outside the blocks (embeddings, final norm, lm_head)"
_ROW_ARRAYS = ("z", "customdata", "text", "hovertext")


def module_row_name(module: Any) -> str:
    """The row label of a module outside the blocks."""
    return MODULE_NAMES.get(str(module), f"{module} (outside the blocks)")


def layer_name(layer: Any, module: Any = None) -> str:
    """A layer for display: its number, or the name of what sits outside the blocks."""
    if layer is None or layer == NO_LAYER or layer == "":
        return module_row_name(module) if module not in (None, "") else OUTSIDE
    return str(layer)


def _split_row(trace: dict[str, Any], axis_y: bool) -> None:
    """Replace the "-" row (or column) of a heatmap by one named row per filled module cell."""
    labels = list(trace.get("y" if axis_y else "x") or [])
    other = list(trace.get("x" if axis_y else "y") or [])
    idx = labels.index(NO_LAYER)
    z = trace.get("z")
    if not isinstance(z, list) or not z:
        labels[idx] = OUTSIDE
        trace["y" if axis_y else "x"] = labels
        return
    by_module = all(str(m) in MODULE_NAMES or str(m) in _BLOCK_MODULES for m in other) and other

    def cells(arr: list[list[Any]]) -> list[Any]:
        return list(arr[idx]) if axis_y else [row[idx] for row in arr]

    row_z = cells(z)
    filled = [j for j, v in enumerate(row_z) if v is not None]
    if not by_module or not filled:
        labels[idx] = OUTSIDE
        trace["y" if axis_y else "x"] = labels
        return
    new_labels = labels[:idx] + [module_row_name(other[j]) for j in filled] + labels[idx + 1:]
    for key in _ROW_ARRAYS:
        arr = trace.get(key)
        if not isinstance(arr, list) or len(arr) == 0 or not isinstance(arr[0], list):
            continue
        blank = "" if key != "z" else None
        row = cells(arr)
        split = [[row[j] if jj == j else blank for jj in range(len(row))] for j in filled]
        if axis_y:
            trace[key] = arr[:idx] + split + arr[idx + 1:]
        else:
            trace[key] = [r[:idx] + [s[i] for s in split] + r[idx + 1:] for i, r in enumerate(arr)]
    trace["y" if axis_y else "x"] = new_labels


_BLOCK_MODULES = ("q", "k", "v", "qkv", "o", "gate", "up", "down")


def _name_bars(trace: dict[str, Any]) -> None:
    """A module's bars: its "-" bar becomes the module's name (embeddings, final norm, ...); a
    block module (q, up, ...) has nothing outside the blocks, so its zero-height "-" bar goes."""
    horizontal = trace.get("orientation") == "h"
    cat, val = ("y", "x") if horizontal else ("x", "y")
    cats, vals = trace.get(cat), trace.get(val)
    if not isinstance(cats, list) or NO_LAYER not in cats:
        return
    name = trace.get("name")
    if name in MODULE_NAMES:
        trace[cat] = [module_row_name(name) if c == NO_LAYER else c for c in cats]
        return
    keep = [i for i, c in enumerate(cats)
            if c != NO_LAYER or (isinstance(vals, list) and vals[i] not in (None, 0, 0.0))]
    for key in (cat, val, "customdata", "text", "hovertext"):
        arr = trace.get(key)
        if isinstance(arr, list) and len(arr) == len(cats):
            trace[key] = [arr[i] for i in keep]
    trace[cat] = [OUTSIDE if c == NO_LAYER else c for c in trace[cat]]


def group_name(label: Any) -> Any:
    """A "layer/module" group label (the series' layer x module rows): "-/norm" -> "final norm",
    "-/embed" -> "embeddings", the one naming of the rows outside the blocks; others unchanged."""
    if isinstance(label, str) and label.startswith(f"{NO_LAYER}/"):
        return module_row_name(label[len(NO_LAYER) + 1:])
    return label


def name_layers(fig: dict[str, Any]) -> dict[str, Any]:
    """Figure JSON with every "-" layer label replaced by a name (in place; also returned)."""
    for trace in fig.get("data") or []:
        kind = trace.get("type")
        for ax in ("x", "y"):  # "layer/module" groups outside the blocks ("-/norm")
            vals = trace.get(ax)
            if isinstance(vals, list) and any(isinstance(v, str) and v.startswith(f"{NO_LAYER}/") for v in vals):
                trace[ax] = [group_name(v) for v in vals]
        if kind == "heatmap":
            for axis_y in (True, False):
                if NO_LAYER in list(trace.get("y" if axis_y else "x") or []):
                    _split_row(trace, axis_y)
        elif kind == "bar":  # per-layer bars: one trace per module, x = layers
            _name_bars(trace)
        else:
            for ax in ("x", "y"):
                vals = trace.get(ax)
                if isinstance(vals, list) and NO_LAYER in vals:
                    trace[ax] = [OUTSIDE if v == NO_LAYER else v for v in vals]
    return fig


def name_layer_cells(headers: list[str], rows: list[list[Any]]) -> list[list[Any]]:
    """Table rows with empty/"-" layer cells named after the row's module (or what they hold);
    scope cells such as "layer -" likewise."""
    try:
        li = headers.index("layer")
    except ValueError:
        li = -1
    mi = headers.index("module") if "module" in headers else -1
    si = headers.index("scope") if "scope" in headers else -1
    out = []
    for row in rows:
        row = list(row)
        if li >= 0 and (row[li] is None or row[li] == NO_LAYER):
            row[li] = layer_name(None, row[mi] if mi >= 0 else None)
        if si >= 0 and isinstance(row[si], str) and row[si] == f"layer {NO_LAYER}":
            row[si] = f"layer: {OUTSIDE}"
        out.append(row)
    return out
