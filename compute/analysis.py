"""Statistics of a diagonal Fisher: where the mass sits, how concentrated it is, how stable.

Input everywhere: `fisher: dict[str, Tensor]` (name -> non-negative values of the param shape).
Outputs are plain floats / lists, and helpers turn them into compute.results rows.
"""

from __future__ import annotations

import math

import torch

from compute.naming import MODULE_TYPES, layer_index, layer_label, module_type
from compute.results import Heatmap, LayerStat, SeriesPoint

# share of mass in the top x fraction of coordinates, x on a log grid from 1e-5 to 1
CONCENTRATION_GRID = tuple(
    sorted({round(m * 10.0**e, 10) for e in range(-5, 0) for m in (1, 2, 5)} | {1.0})
)


def tensor_stats(fisher: dict[str, torch.Tensor]) -> list[dict]:
    """Per tensor: name, layer, module, numel, mean, max, mass (sum), share (mass / total mass)."""
    rows = []
    for name, f in fisher.items():
        f64 = f.detach().double()
        rows.append({
            "name": name, "layer": layer_index(name), "module": module_type(name),
            "numel": f.numel(), "mass": float(f64.sum()),
            "max": float(f64.max()) if f.numel() else 0.0,
        })
    total = sum(r["mass"] for r in rows)
    for r in rows:
        r["mean"] = r["mass"] / r["numel"] if r["numel"] else 0.0
        r["share"] = r["mass"] / total if total > 0 else 0.0
    return rows


def layer_module_stats(fisher: dict[str, torch.Tensor]) -> list[dict]:
    """Per (layer, module type): numel, mass, mean (mass / numel), max, share of total mass.

    Sorted by layer (None = embeddings, final norm, lm_head: last) then MODULE_TYPES order."""
    groups: dict[tuple[int | None, str], dict] = {}
    for r in tensor_stats(fisher):
        g = groups.setdefault((r["layer"], r["module"]), {
            "layer": r["layer"], "module": r["module"], "numel": 0, "mass": 0.0, "max": 0.0,
            "share": 0.0, "params": []})
        g["numel"] += r["numel"]
        g["mass"] += r["mass"]
        g["share"] += r["share"]
        g["max"] = max(g["max"], r["max"])
        g["params"].append(r["name"])
    out = list(groups.values())
    for g in out:
        g["mean"] = g["mass"] / g["numel"] if g["numel"] else 0.0
    out.sort(key=lambda g: (g["layer"] is None, g["layer"] or 0, _module_order(g["module"])))
    return out


def _module_order(m: str) -> int:
    return MODULE_TYPES.index(m) if m in MODULE_TYPES else len(MODULE_TYPES)


def _flat(fisher: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([f.detach().reshape(-1).float().cpu() for f in fisher.values()])


def concentration_curve(
    fisher: dict[str, torch.Tensor], grid: tuple[float, ...] = CONCENTRATION_GRID,
) -> list[tuple[float, float]]:
    """[(x, share of total mass in the top x fraction of all coordinates)] for x in grid.

    The top ceil(x * n) coordinates count (at least one). share is 0 when the total mass is 0."""
    flat = _flat(fisher)
    n = flat.numel()
    vals = flat.sort(descending=True).values.double()
    cum = vals.cumsum(0)  # (n,)
    total = float(cum[-1]) if n else 0.0
    out = []
    for x in grid:
        k = min(n, max(1, math.ceil(x * n - 1e-9)))
        out.append((float(x), float(cum[k - 1]) / total if total > 0 else 0.0))
    return out


def gini(values: torch.Tensor | dict[str, torch.Tensor]) -> float:
    """Gini coefficient of non-negative values: 0 = all equal, -> 1 = all mass on one coordinate.

    G = 2 sum_i i x_(i) / (n sum x) - (n + 1) / n, with x sorted ascending, i = 1..n."""
    flat = _flat(values) if isinstance(values, dict) else values.detach().reshape(-1).float().cpu()
    n = flat.numel()
    x = flat.sort().values.double()
    s = float(x.sum())
    if n == 0 or s <= 0:
        return 0.0
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(2 * (i * x).sum() / (n * s) - (n + 1) / n)


def topk_indices(fisher: dict[str, torch.Tensor], percent: float) -> torch.Tensor:
    """Flat indices (over the concatenation in dict order) of the top `percent`% coordinates."""
    if not 0 < percent <= 100:
        raise ValueError(f"topk_percent: got {percent!r}; accepted range: (0, 100]")
    flat = _flat(fisher)
    k = max(1, math.ceil(flat.numel() * percent / 100 - 1e-9))
    return flat.topk(k, sorted=False).indices


def topk_jaccard(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], percent: float) -> float:
    """Jaccard overlap |A ∩ B| / |A ∪ B| of the top-`percent`% coordinates of two Fishers.

    With a and b estimated from two independent halves of the samples, values near 1 mean the
    selected coordinates are stable (enough samples); near percent/100 means chance level."""
    if list(a) != list(b) or any(a[n].shape != b[n].shape for n in a):
        raise ValueError("fisher: the two Fishers must have the same parameter names and shapes")
    ia, ib = topk_indices(a, percent), topk_indices(b, percent)
    n = sum(t.numel() for t in a.values())
    ma = torch.zeros(n, dtype=torch.bool)
    mb = torch.zeros(n, dtype=torch.bool)
    ma[ia] = True
    mb[ib] = True
    union = int((ma | mb).sum())
    return int((ma & mb).sum()) / union if union else 1.0


def summary(fisher: dict[str, torch.Tensor]) -> dict:
    """Headline numbers: n_params, total mass, mean, max, gini, share of mass in top 1% / 10%."""
    rows = tensor_stats(fisher)
    n = sum(r["numel"] for r in rows)
    mass = sum(r["mass"] for r in rows)
    curve = dict(concentration_curve(fisher, (0.001, 0.01, 0.1)))
    return {
        "n_params": n, "total_mass": mass, "mean": mass / n if n else 0.0,
        "max": max((r["max"] for r in rows), default=0.0), "gini": gini(fisher),
        "top0.1%_share": curve[0.001], "top1%_share": curve[0.01], "top10%_share": curve[0.1],
    }


# ---- compute.results rows --------------------------------------------------------------------


def to_layer_stats(fisher: dict[str, torch.Tensor]) -> list[LayerStat]:
    """One LayerStat per tensor (group "tensor") and per (layer, module) (group "layer_module")."""
    out = [
        LayerStat(r["name"], r["module"], r["layer"],
                  {k: r[k] for k in ("mean", "max", "mass", "share", "numel")}, "tensor")
        for r in tensor_stats(fisher)
    ]
    out += [
        LayerStat("", g["module"], g["layer"],
                  {k: g[k] for k in ("mean", "max", "mass", "share", "numel")}, "layer_module")
        for g in layer_module_stats(fisher)
    ]
    return out


def to_heatmaps(fisher: dict[str, torch.Tensor], prefix: str = "fisher") -> list[Heatmap]:
    """Two layer x module-type heatmaps: mean Fisher and share of total mass.

    Rows: transformer layers in order, then "-" (embeddings, final norm, lm_head) if present."""
    groups = layer_module_stats(fisher)
    layers = sorted({g["layer"] for g in groups if g["layer"] is not None})
    y = [layer_label(v) for v in layers] + (["-"] if any(g["layer"] is None for g in groups) else [])
    x = [m for m in MODULE_TYPES if any(g["module"] == m for g in groups)]
    maps = []
    for key, units in (("mean", "mean Fisher per coordinate"), ("share", "share of total mass")):
        z: list[list[float | None]] = [[None] * len(x) for _ in y]
        for g in groups:
            z[y.index(layer_label(g["layer"]))][x.index(g["module"])] = g[key]
        maps.append(Heatmap(f"{prefix}/{key}", x, y, z, {"value": key, "units": units,
                                                         "x": "module type", "y": "layer"}))
    return maps


def to_series(fisher: dict[str, torch.Tensor], name: str = "concentration") -> list[SeriesPoint]:
    """The concentration curve as SeriesPoint(name, x = top fraction, value = share of mass)."""
    return [SeriesPoint(name, x, s) for x, s in concentration_curve(fisher)]
