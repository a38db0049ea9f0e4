"""The one layer x module aggregation every reader uses: per-tensor rows grouped into
(layer, module type) cells, and the heatmaps drawn from them. Pure Python, no torch: the web
process (app/figures), the CLI and the engine (compute/fisher/statistics.py, the runners) all
import it. Layer indices and module types come from parameter names (compute.lm.naming)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from compute.contract.jobresult import Heatmap
from compute.lm.naming import MODULE_TYPES, layer_index, layer_label, module_type

# values that add up over the tensors of a cell; "max" takes the maximum; every other value is
# a per-coordinate quantity (mean, density, unchanged fraction): its numel-weighted mean.
ADDITIVE = frozenset({"mass", "numel", "share", "kept", "fisher_mass_kept", "num", "den"})
Cells = dict[tuple[Any, ...], dict[str, Any]]


def _get(row: Any, key: str, default: Any = None) -> Any:
    return row.get(key, default) if isinstance(row, Mapping) else getattr(row, key, default)


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def aggregate(rows: Iterable[Any], by: tuple[str, ...] = ("layer", "module")) -> Cells:
    """Group per-tensor rows by `by` (fields among "layer", "module") and combine their values.

    rows: LayerStat objects or their dicts ({"param", "layer", "module", "values"}); rows without
    a module count as "other". Per cell: additive values (ADDITIVE: mass, numel, share, kept, ...)
    summed; "max" the maximum; "mean" = sum(mass) / sum(numel) when every row has both, else
    like every other value: the numel-weighted mean when every row has numel, else the plain
    mean. "share" falls back to mass / total mass of all rows. "params": the rows' names.
    Cells come in layer order (None, i.e. embeddings / final norm / lm_head, last), then
    MODULE_TYPES order.
    """
    acc: dict[tuple[Any, ...], list[tuple[str, dict[str, float]]]] = {}
    for r in rows:
        key = tuple(_get(r, f) if f != "module" else (_get(r, f) or "other") for f in by)
        vals = {k: f for k, v in (_get(r, "values") or {}).items() if (f := _num(v)) is not None}
        acc.setdefault(key, []).append((str(_get(r, "param", "") or ""), vals))
    total_mass = sum(v.get("mass", 0.0) for items in acc.values() for _, v in items)
    cells = {key: _combine(items, total_mass) for key, items in acc.items()}
    return dict(sorted(cells.items(), key=lambda kv: _cell_order(kv[0], by)))


def _combine(items: list[tuple[str, dict[str, float]]], total_mass: float) -> dict[str, Any]:
    vals = [v for _, v in items]
    keys = list(dict.fromkeys(k for v in vals for k in v))
    out: dict[str, Any] = {"params": [p for p, _ in items if p]}
    numel = [v.get("numel") for v in vals]
    weighted = all(n is not None for n in numel) and sum(n or 0.0 for n in numel) > 0
    for k in keys:
        have = [v for v in vals if k in v]
        if k in ADDITIVE:
            out[k] = sum(v[k] for v in have)
        elif k == "max":
            out[k] = max(v[k] for v in have)
        elif weighted and len(have) == len(vals):
            out[k] = sum(v[k] * v["numel"] for v in have) / sum(v["numel"] for v in have)
        else:
            out[k] = sum(v[k] for v in have) / len(have)
    if all("mass" in v and "numel" in v for v in vals) and out.get("numel"):
        out["mean"] = out["mass"] / out["numel"]
    elif "mass" in out and "numel" in out and "mean" not in out:
        out["mean"] = out["mass"] / out["numel"] if out["numel"] else 0.0
    if "share" not in out and "mass" in out and total_mass > 0:
        out["share"] = out["mass"] / total_mass
    return out


def _cell_order(key: tuple[Any, ...], by: tuple[str, ...]) -> tuple[Any, ...]:
    out: list[Any] = []
    for f, v in zip(by, key, strict=True):
        if f == "layer":
            out += [v is None, v or 0]
        else:
            out += [_module_order(str(v)), str(v)]
    return tuple(out)


def cells_heatmap(name: str, cells: Cells, value: Callable[[dict[str, Any]], float | None],
                  meta: dict[str, Any] | None = None) -> Heatmap:
    """A layer x module Heatmap of aggregate() cells: z = value(cell); rows are the layers in
    order, then "-" (embeddings, final norm, lm_head); columns in MODULE_TYPES order."""
    layers = list(dict.fromkeys(k[0] for k in cells))  # cells come sorted
    modules = sorted({k[1] for k in cells}, key=_module_order)
    z = [[value(cells[(lay, m)]) if (lay, m) in cells else None for m in modules] for lay in layers]
    return Heatmap(name, modules, [layer_label(v) for v in layers], z,
                   {"x_title": "module type", "y_title": "layer", **(meta or {})})


def ratio_heatmap(name: str, counts: Mapping[str, tuple[float, float]],
                  meta: dict[str, Any] | None = None) -> Heatmap:
    """sum(num) / sum(den) per (layer, module) cell from per-parameter (num, den) pairs, e.g.
    (kept, numel) -> mask density."""
    cells = aggregate({"param": p, "layer": layer_index(p), "module": module_type(p),
                       "values": {"num": n, "den": d}} for p, (n, d) in counts.items())
    return cells_heatmap(name, cells, lambda c: c["num"] / c["den"] if c["den"] else None, meta)


def _module_order(m: str) -> int:
    return MODULE_TYPES.index(m) if m in MODULE_TYPES else len(MODULE_TYPES)
