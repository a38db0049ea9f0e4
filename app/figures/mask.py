"""Figures of a `mask` result: the kept fraction of each layer x module cell."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from compute.contract.results import TypedResult
from compute.jobs.mask import MaskResult

from . import keynumbers as kn
from .common import finite, heatmap_figure
from .layers import has_value, layer_module_heatmap
from .registry import figure, key_numbers, table
from .tables import OVERLAP_TITLE, overlap_table

TITLE = "Mask density by layer x module"


def mask_density_heatmap(r: TypedResult[Any]) -> go.Figure:
    """Kept fraction per (layer, module): the stored "mask_density" heatmap, else layer_stats
    (numel-weighted density)."""
    hm = r.heatmap("mask_density")
    if hm is not None:
        meta = {"zmin": 0.0, "zmax": None, "units": "density", **hm.meta}
        return heatmap_figure(hm.model_copy(update={"meta": meta}), TITLE)
    return layer_module_heatmap(r, value="density", log=False, title=TITLE)


@figure("mask", "mask_density", title=TITLE)
def mask_density(r: MaskResult) -> go.Figure | None:
    return mask_density_heatmap(r) if r.heatmap("mask_density") or has_value(r, "density") else None


table("mask", "overlap", title=OVERLAP_TITLE)(overlap_table)


# ---------------------------------------------------------------- key numbers


@key_numbers("mask")
def key_numbers_mask(r: MaskResult, out: dict[str, Any]) -> None:
    s = r.summary
    if finite(s.density) is not None:
        out["items"].append(kn.item("Kept fraction", kn.pct(s.density),
                                  f"selector {s.select}, asked {kn.pct(s.density_requested)}"))
    if finite(s.fisher_mass_kept) is not None:
        out["items"].append(kn.item("Fisher mass kept", kn.pct(s.fisher_mass_kept)))
