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


SUMMARY_MAX_LIST = 16  # a list of up to this many numbers/words is one cell; longer ones are figures
SUMMARY_MAX_DICT = 60  # a mapping with more entries is a figure or table of its own, not summary rows


def summary_rows(summary: Mapping[str, Any], prefix: str = "") -> list[list[Any]]:
    """The summary as (dotted key, value) rows, nested mappings flattened ('bound.max_ratio'),
    never a raw dict: records by name (every value a mapping) are tables of their own; short lists of scalars become one cell ('0.01, 0.05'); lists of records
    and long series are left to the tables and figures that draw them; markdown (a copy of a
    table shown as a table) is left out."""
    rows: list[list[Any]] = []
    for k, v in summary.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            if v and all(isinstance(x, Mapping) for x in v.values()):
                continue  # records by name (per parameter, per scope): a table of its own
            if len(v) <= SUMMARY_MAX_DICT:
                rows += summary_rows(v, key + ".")
        elif isinstance(v, list | tuple):
            if len(v) <= SUMMARY_MAX_LIST and all(not isinstance(x, Mapping | list | tuple) for x in v):
                rows.append([key, ", ".join(str(cell(x)) for x in v)])
        elif isinstance(v, str) and ("\n" in v or k == "markdown"):
            continue
        else:
            rows.append([key, cell(v)])
    return rows


# summary keys that say how the run was made, not what it found: the collapsed settings table
SETTINGS_KEYS = ("settings", "conventions", "config")
SETTINGS_TITLE = "Settings of this run"  # app/render.py folds a table of this title away
GROUP_HEADERS = ["group", "quantity", "value"]  # app/render.py draws one card per group
UNITS = (("_bytes", "bytes"), ("_seconds", "s"), ("_s", "s"), ("_mb", "MB"), ("_percent", "%"), ("_ms", "ms"))
WORDS = {"auc": "AUC", "rms": "RMS", "topk": "top-k", "lr": "learning rate", "n": "number of", "pct": "%",
         "kl": "KL", "bf16": "bf16", "fp32": "fp32", "std": "std", "id": "id", "sq": "squared", "abs": "absolute"}


def quantity_label(key: str) -> str:
    """A summary key as a person reads it, with its unit: 'dense_bytes_total' -> 'Dense total
    (bytes)', 'mean_step_auc' -> 'Mean step AUC', 'n_params' -> 'Number of params'."""
    unit = ""
    base = key
    if base.startswith("seconds_"):
        base, unit = base[len("seconds_"):], "s"
    for suffix, u in UNITS if not unit else ():
        if base.endswith(suffix):
            base, unit = base[: -len(suffix)], u
            break
        if f"{suffix}_" in base:  # dense_bytes_total
            base, unit = base.replace(f"{suffix}_", "_", 1), u
            break
    words = [WORDS.get(w, w) for w in base.replace(".", " ").replace("%", " %").split("_") if w]
    text = " ".join(words).strip() or key
    text = text[0].upper() + text[1:]
    return f"{text} ({unit})" if unit else text


def _group_rows(summary: Mapping[str, Any], settings: bool) -> list[list[Any]]:
    """(group, quantity, value) rows: top-level scalars under "" and each nested mapping under
    its own label (its nested keys joined as words, never dotted); `settings`: only the
    SETTINGS_KEYS mappings, else everything but them."""
    rows: list[list[Any]] = []
    for k, v in summary.items():
        is_settings = k in SETTINGS_KEYS
        if is_settings != settings:
            continue
        if isinstance(v, Mapping):
            group = quantity_label(k)
            for key, value in summary_rows(v):
                rows.append([group, " / ".join(quantity_label(p) for p in str(key).split(".")), value])
        else:
            for key, value in summary_rows({k: v}):
                rows.append(["", quantity_label(str(key)), value])
    return rows


@table(EVERY_KIND, "summary", title="Summary")
def summary_table(r: TypedResult[Any]) -> Table:
    """Every scalar of the summary, labelled with its unit and grouped by the mapping it is in
    (one card per group, app/render.py); the run's settings are their own table."""
    return GROUP_HEADERS, _group_rows(r.raw_summary, settings=False)


@table(EVERY_KIND, "settings", title=SETTINGS_TITLE)
def settings_table(r: TypedResult[Any]) -> Table:
    """The settings / conventions the run recorded, folded away under the result."""
    return GROUP_HEADERS, _group_rows(r.raw_summary, settings=True)


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
