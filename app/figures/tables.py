"""Tables every kind shows after its own: Fisher-vs-update overlap, the flat summary, and the
layer_stats download (CSV)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from compute.contract.results import TypedResult

from .common import Table, cell, rows_table
from .registry import EVERY_KIND, table

OVERLAP_COLUMNS = ("scope", "metric", "k_percent", "precision_at_k", "auc", "jaccard", "jaccard_random",
                   "spearman", "value")


OVERLAP_TITLE = "Overlap (Fisher vs update)"  # registered by app/figures/diff.py and mask.py


def overlap_table(r: TypedResult[Any]) -> Table:
    """Fisher-vs-update overlap metrics (precision@k, AUC, Jaccard vs its random baseline...):
    a diff's "overlap" rows, a mask's "overlap_with_fisher_topk"."""
    s = r.raw_summary
    rows = s.get("overlap")
    if rows is None and isinstance(s.get("overlap_with_fisher_topk"), dict):
        rows = s["overlap_with_fisher_topk"]
    return rows_table(rows, OVERLAP_COLUMNS)


@table(EVERY_KIND, "summary", title="Summary")
def summary_table(r: TypedResult[Any]) -> Table:
    """Flat scalar entries of the summary (nested objects shown as text)."""
    rows: list[list[Any]] = []
    for k, v in r.raw_summary.items():
        if isinstance(v, dict) and k not in ("settings", "overlap_settings") and len(v) <= 40:
            rows += [[f"{k}.{kk}", cell(vv)] for kk, vv in v.items()
                     if not isinstance(vv, list | dict) or len(str(vv)) < 200]
        elif not isinstance(v, list | dict) or len(str(v)) < 200:
            rows.append([k, cell(v)])
    return ["key", "value"], rows


def layer_stats_table(result: Mapping[str, Any]) -> Table:
    """Every stored layer_stats row flattened (the stats CSV download): group, param, layer,
    module, then each value key. Values as stored (an int count stays an int)."""
    rows = [r for r in result.get("layer_stats") or [] if isinstance(r, Mapping)]
    keys: list[str] = []
    for r in rows:
        keys += [k for k in (r.get("values") or {}) if k not in keys]
    headers = ["group", "param", "layer", "module", *keys]
    return headers, [[r.get("group", "tensor"), r.get("param", ""), r.get("layer"), r.get("module"),
                      *[(r.get("values") or {}).get(k) for k in keys]] for r in rows]
