"""Statistics of a diagonal Fisher: where the mass sits, how concentrated it is, how stable.
The layer x module aggregation they are tabled with is compute.lm.cells (torch-free).

Input everywhere: `fisher: dict[str, Tensor]` (name -> non-negative values of the param shape).
Outputs are plain floats / lists, and helpers turn them into compute.contract.jobresult rows.
No torch import at module level: `aggregate` and `cells_heatmap` are pure Python, imported by
the web process (app/figures) and the CLI; the tensor functions import torch when called.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from compute.contract.jobresult import Heatmap, LayerStat, SeriesPoint
from compute.lm.cells import aggregate, cells_heatmap
from compute.lm.naming import layer_index, module_type

if TYPE_CHECKING:
    import torch

# share of mass in the top x fraction of coordinates, x on a log grid from 1e-5 to 1
CONCENTRATION_GRID = tuple(
    sorted({round(m * 10.0**e, 10) for e in range(-5, 0) for m in (1, 2, 5)} | {1.0})
)
def tensor_stats(fisher: dict[str, torch.Tensor]) -> list[dict]:
    """Per tensor: name, layer, module, numel, mean, max, mass (sum), share (mass / total mass)."""
    rows: list[dict[str, Any]] = []
    for name, f in fisher.items():
        # float64 sums over chunks: a float64 copy of the largest tensor (a 49k-row embedding is
        # half of a 50M model) was the job's peak (issue 30, benchmarks/peak_stacks.py)
        v = f.detach().reshape(-1)
        mass = sum(float(v[o:o + CHUNK].double().sum()) for o in range(0, v.numel(), CHUNK))
        rows.append({
            "name": name, "layer": layer_index(name), "module": module_type(name),
            "numel": f.numel(), "mass": mass,
            "max": float(v.max()) if f.numel() else 0.0,
        })
    total = sum(r["mass"] for r in rows)
    for r in rows:
        r["mean"] = r["mass"] / r["numel"] if r["numel"] else 0.0
        r["share"] = r["mass"] / total if total > 0 else 0.0
    return rows


def layer_module_stats(fisher: dict[str, torch.Tensor]) -> list[dict]:
    """Per (layer, module type): numel, mass, mean (mass / numel), max, share of total mass.

    Sorted by layer (None = embeddings, final norm, lm_head: last) then MODULE_TYPES order."""
    rows = [{"param": r["name"], "layer": r["layer"], "module": r["module"],
             "values": {k: r[k] for k in ("numel", "mass", "max", "share")}} for r in tensor_stats(fisher)]
    return [{"layer": layer, "module": module, **c} for (layer, module), c in aggregate(rows).items()]


# Memory (issue 30): a Fisher is as large as the model, so every statistic over all coordinates
# holds at most ONE float32 copy of the values (4 bytes per parameter: a numpy array sorted or
# partitioned in place, no int64 indices) plus chunk- or tensor-sized temporaries; sums are float64
# over chunks of CHUNK values. Measured before: a full torch sort (values + int64 indices) and
# float64 copies of the sorted values, cumsum and ranks, about 40 bytes per parameter at the peak.
CHUNK = 1 << 20


def _flat(fisher: dict[str, torch.Tensor]) -> torch.Tensor:
    import torch

    return torch.cat([f.detach().reshape(-1).float().cpu() for f in fisher.values()])


def flat_values(fisher: Mapping[str, Any]) -> Any:
    """All values as one float32 numpy array (dict order): the single full-size copy."""
    import numpy as np

    n = sum(int(f.numel()) for f in fisher.values())
    out = np.empty(n, dtype=np.float32)
    o = 0
    for f in fisher.values():
        k = int(f.numel())
        out[o:o + k] = f.detach().reshape(-1).float().cpu().numpy()
        o += k
    return out


def sorted_values(fisher: Mapping[str, Any] | Any) -> Any:
    """The values in ascending order (float32 numpy, sorted in place: 4 bytes per parameter).
    Pass it to concentration_curve / gini / summary to sort once."""
    if isinstance(fisher, Mapping):
        x = flat_values(fisher)
    else:
        x = fisher.detach().reshape(-1).float().cpu().numpy().copy()
    x.sort()
    return x


def _sum64(x: Any) -> float:
    import numpy as np

    return float(sum(np.sum(x[o:o + CHUNK], dtype=np.float64) for o in range(0, len(x), CHUNK)))


def concentration_curve(
    fisher: dict[str, torch.Tensor] | None = None, grid: tuple[float, ...] = CONCENTRATION_GRID,
    sorted_: Any = None,
) -> list[tuple[float, float]]:
    """[(x, share of total mass in the top x fraction of all coordinates)] for x in grid.

    The top ceil(x * n) coordinates count (at least one). share is 0 when the total mass is 0.
    `sorted_`: sorted_values(fisher), when the caller already has it."""
    s = sorted_values(fisher) if sorted_ is None else sorted_
    n = len(s)
    total = _sum64(s)
    ks = {x: min(n, max(1, math.ceil(x * n - 1e-9))) for x in grid}
    top: dict[int, float] = {}
    acc, done = 0.0, 0  # sum of the largest `done` values
    for k in sorted(set(ks.values())):
        acc += _sum64(s[n - k:n - done])
        done = k
        top[k] = acc
    return [(float(x), top[ks[x]] / total if total > 0 else 0.0) for x in grid]


def gini(values: torch.Tensor | dict[str, torch.Tensor] | None = None, sorted_: Any = None) -> float:
    """Gini coefficient of non-negative values: 0 = all equal, -> 1 = all mass on one coordinate.

    G = 2 sum_i i x_(i) / (n sum x) - (n + 1) / n, with x sorted ascending, i = 1..n."""
    import numpy as np

    x = sorted_values(values) if sorted_ is None else sorted_
    n = len(x)
    s = _sum64(x)
    if n == 0 or s <= 0:
        return 0.0
    ix = 0.0
    for o in range(0, n, CHUNK):
        c = x[o:o + CHUNK]
        ix += float(np.dot(np.arange(o + 1, o + 1 + len(c), dtype=np.float64), c.astype(np.float64)))
    return float(2 * ix / (n * s) - (n + 1) / n)


def topk_indices(fisher: dict[str, torch.Tensor], percent: float) -> torch.Tensor:
    """Flat indices (over the concatenation in dict order) of the top `percent`% coordinates."""
    if not 0 < percent <= 100:
        raise ValueError(f"topk_percent: got {percent!r}; accepted range: (0, 100]")
    flat = _flat(fisher)
    k = max(1, math.ceil(flat.numel() * percent / 100 - 1e-9))
    return flat.topk(k, sorted=False).indices


_SIGN = 1 << 31


def _order_keys(chunk: torch.Tensor) -> torch.Tensor:
    """float32 values -> int64 keys in [0, 2^32) with the same order (IEEE bits, the negative
    ones' magnitude bits flipped; -0.0 counted as 0.0)."""
    import torch

    bits = (chunk.float() + 0.0).contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) + _SIGN


def _chunks(fisher: Mapping[str, Any]) -> Iterable[torch.Tensor]:
    for f in fisher.values():
        v = f.detach().reshape(-1)
        for o in range(0, v.numel(), CHUNK):
            yield v[o:o + CHUNK]


def topk_threshold(fisher: Mapping[str, Any], k: int) -> tuple[float, int]:
    """(t, g): the k-th largest value t over all coordinates and the number g of values > t.

    Streaming radix select (issue 30): two passes over the tensors in chunks of CHUNK values, a
    65,536-bin histogram of the high 16 bits of an order-preserving integer key, then of the low
    16 bits inside the bin that holds the k-th largest. Exact, and no copy of all the values
    (a float32 copy of every coordinate was 4 bytes/param on top of the two half sums)."""
    import struct

    import torch

    n = sum(int(f.numel()) for f in fisher.values())
    k = min(max(k, 1), n)
    hist = torch.zeros(1 << 16, dtype=torch.int64)
    for c in _chunks(fisher):
        hist += torch.bincount((_order_keys(c) >> 16).cpu(), minlength=1 << 16)
    above_hi = torch.flip(torch.cumsum(torch.flip(hist, (0,)), 0), (0,))  # count with high bits >= b
    hi = int((above_hi >= k).nonzero().max())
    above = int(above_hi[hi] - hist[hi])  # strictly higher bins
    low = torch.zeros(1 << 16, dtype=torch.int64)
    for c in _chunks(fisher):
        key = _order_keys(c)
        sel = key[(key >> 16) == hi]
        if sel.numel():
            low += torch.bincount((sel & 0xFFFF).cpu(), minlength=1 << 16)
    above_lo = torch.flip(torch.cumsum(torch.flip(low, (0,)), 0), (0,)) + above
    lo = int((above_lo >= k).nonzero().max())
    g = int(above_lo[lo] - low[lo])
    kth = ((hi << 16) | lo) - _SIGN
    bits = kth if kth >= 0 else kth ^ 0x7FFFFFFF
    t = struct.unpack("<f", struct.pack("<i", bits))[0]
    return float(t), g


def topk_masks(fisher: Mapping[str, Any], percent: float) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, bool mask) of the top `percent`% coordinates, one tensor at a time: the values
    above the k-th largest, and of the values equal to it the first ones in dict order, so
    exactly k coordinates are selected."""
    import torch

    if not 0 < percent <= 100:
        raise ValueError(f"topk_percent: got {percent!r}; accepted range: (0, 100]")
    n = sum(int(f.numel()) for f in fisher.values())
    k = max(1, math.ceil(n * percent / 100 - 1e-9))
    t, g = topk_threshold(fisher, k)
    ties = k - g  # values equal to t still to take, in order
    for name, f in fisher.items():
        v = f.detach().reshape(-1).float()
        m = v > t
        if ties > 0:
            eq = v == t
            ne = int(eq.sum())
            if ne <= ties:
                m |= eq
                ties -= ne
            elif ne:
                take = eq & (torch.cumsum(eq, 0, dtype=torch.int32) <= ties)
                m |= take
                ties = 0
        yield name, m.reshape(f.shape)


def topk_jaccard(a: Mapping[str, Any], b: Mapping[str, Any], percent: float) -> float:
    """Jaccard overlap |A ∩ B| / |A ∪ B| of the top-`percent`% coordinates of two Fishers.

    With a and b estimated from two independent halves of the samples, values near 1 mean the
    selected coordinates are stable (enough samples); near percent/100 means chance level.
    A positive scale of either side does not change its top-k set, so un-normalised sums serve.
    Memory: one float32 copy at a time plus tensor-sized masks."""
    if list(a) != list(b) or any(a[n].shape != b[n].shape for n in a):
        raise ValueError("fisher: the two Fishers must have the same parameter names and shapes")
    inter = union = 0
    for (_, ma), (_, mb) in zip(topk_masks(a, percent), topk_masks(b, percent), strict=True):
        inter += int((ma & mb).sum())
        union += int((ma | mb).sum())
    return inter / union if union else 1.0


def summary(fisher: dict[str, torch.Tensor], sorted_: Any = None) -> dict:
    """Headline numbers: n_params, total mass, mean, max, gini, share of mass in top 1% / 10%.
    `sorted_`: sorted_values(fisher), when the caller already has it."""
    s = sorted_values(fisher) if sorted_ is None else sorted_
    rows = tensor_stats(fisher)
    n = sum(r["numel"] for r in rows)
    mass = sum(r["mass"] for r in rows)
    curve = dict(concentration_curve(grid=(0.001, 0.01, 0.1), sorted_=s))
    return {
        "n_params": n, "total_mass": mass, "mean": mass / n if n else 0.0,
        "max": max((r["max"] for r in rows), default=0.0), "gini": gini(sorted_=s),
        "top0.1%_share": curve[0.001], "top1%_share": curve[0.01], "top10%_share": curve[0.1],
    }


# ---- compute.contract.jobresult rows --------------------------------------------------------------------


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
    cells = {(g["layer"], g["module"]): g for g in layer_module_stats(fisher)}
    return [cells_heatmap(f"{prefix}/{key}", cells, operator.itemgetter(key),
                          {"value": key, "units": units, "x": "module type", "y": "layer"})
            for key, units in (("mean", "mean Fisher per coordinate"), ("share", "share of total mass"))]


def to_series(fisher: dict[str, torch.Tensor], name: str = "concentration",
              sorted_: Any = None) -> list[SeriesPoint]:
    """The concentration curve as SeriesPoint(name, x = top fraction, value = share of mass)."""
    return [SeriesPoint(name, x, s) for x, s in concentration_curve(fisher, sorted_=sorted_)]
