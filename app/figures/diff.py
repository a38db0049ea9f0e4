"""Figures of a `diff` result: which weights a training run left unchanged (per layer x module,
per threshold) and how well the Fisher predicts the ones that moved."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from compute.contract import construction
from compute.contract.results import HeatmapData, TypedResult
from compute.jobs.diff import (
    FISHER_VS_DELTA,
    THRESHOLD_PROFILE,
    UNCHANGED_SERIES,
    UPDATE_SPARSITY,
    DiffResult,
    DiffSummary,
)

from . import keynumbers as kn
from .common import (
    COLORSCALE,
    curves_figure,
    empty_figure,
    finite,
    fmt,
    layout,
    named_cells,
    pool_matrix,
)
from .registry import figure, key_numbers, stored_heatmap, table
from .tables import OVERLAP_TITLE, overlap_table

UNCHANGED_LABELS = {"atol": "unchanged (|delta_fp32| <= atol)",
                    "atol_bf16delta": "unchanged (|delta_bf16| <= atol, published convention)",
                    "rel_rms": "unchanged (|delta| <= t x rms)"}
OVERLAP_TITLES = {"fisher_vs_delta_jaccard_lift": "Top-k Fisher vs top-k |delta|: Jaccard / random baseline",
                  "fisher_vs_delta_auc": "Fisher as a predictor of top-k |delta|: ROC-AUC",
                  "fisher_vs_delta_precision_at_k": "Top-k Fisher vs top-k |delta|: precision@k"}


def _threshold_key(h: HeatmapData) -> tuple[int, float, str]:
    if h.meta.get("headline"):  # the convention the key numbers lead with comes first
        return (-1, 0.0, "")
    t = finite(h.meta.get("threshold"))
    return (0, t, "") if t is not None else (1, 0.0, h.name)


def _slider(labels: list[str]) -> dict[str, Any]:
    steps = [{"label": lab, "method": "update",
              "args": [{"visible": [j == i for j in range(len(labels))]},
                       {"title.text": f"Update sparsity: unchanged by {lab}"}]}
             for i, lab in enumerate(labels)]
    return {"active": 0, "currentvalue": {"prefix": "threshold: "}, "steps": steps, "pad": {"t": 40}}


def update_sparsity_heatmap(r: TypedResult[Any]) -> go.Figure:
    """Fraction of unchanged coordinates per layer x module, one frame per threshold with a slider
    (the "update_sparsity_<threshold>" heatmaps, ordered by meta "threshold")."""
    hms = sorted(r.heatmaps_in(UPDATE_SPARSITY), key=_threshold_key)
    if not hms:
        return empty_figure("no update-sparsity heatmaps in this result")
    fig = go.Figure()
    labels = []
    for i, h in enumerate(hms):
        z, xl, yl = pool_matrix(h.z, h.x_labels, h.y_labels)
        t = h.meta.get("threshold")
        label = str(h.meta.get("threshold_label") or (t if t is not None else UPDATE_SPARSITY.part(h.name)))
        labels.append(label)
        cells = named_cells({"z": z, "x": xl, "y": yl, "customdata": [[fmt(v) for v in row] for row in z]})
        fig.add_heatmap(
            **cells, zmin=0.0, zmax=1.0, colorscale=COLORSCALE, visible=(i == 0), name=label,
            colorbar={"title": {"text": "unchanged fraction"}},
            hovertemplate=f"{label}<br>layer %{{y}}, module %{{x}}<br>unchanged = %{{customdata}}<extra></extra>",
        )
    if len(hms) > 1:
        fig.update_layout(sliders=[_slider(labels)])
    fig.update_xaxes(title_text="module type", type="category")
    fig.update_yaxes(title_text="layer", type="category", autorange="reversed")
    return layout(fig, f"Update sparsity: unchanged by {labels[0]}", height=max(360, 24 * len(hms[0].y_labels) + 200))


def unchanged_figure(r: TypedResult[Any]) -> go.Figure:
    """Unchanged fraction of all coordinates against the threshold, one line per convention."""
    runs = {name.split("/", 1)[1]: c for name in UNCHANGED_SERIES if (c := r.curve(name))}
    return curves_figure({run: {run: xy} for run, xy in runs.items()}, "Unchanged fraction by threshold",
                         x_title="threshold", log_x=True, labels=UNCHANGED_LABELS)


@figure("diff", "update_sparsity", title="Update sparsity by layer x module")
def update_sparsity(r: DiffResult) -> go.Figure | None:
    return update_sparsity_heatmap(r) if r.heatmaps_in(UPDATE_SPARSITY) else None


@figure("diff", "unchanged_curve", title="Unchanged fraction by threshold")
def unchanged_curve(r: DiffResult) -> go.Figure | None:
    return unchanged_figure(r) if any(r.curve(n) for n in UNCHANGED_SERIES) else None


for _name in FISHER_VS_DELTA:
    stored_heatmap("diff", _name, title=OVERLAP_TITLES[_name])
stored_heatmap("diff", THRESHOLD_PROFILE, title="Unchanged fraction by layer and threshold")


table("diff", "overlap", title=OVERLAP_TITLE)(overlap_table)


# ---------------------------------------------------------------- key numbers


THRESHOLD_NAMES = {"exact": "exactly equal", "bf16": "equal after casting both to bf16",
                   "below_half_ulp": "|delta| < half a bf16 ULP of |base weight|"}
BF16_DELTA = "bf16delta_atol_"


def _threshold_name(lab: str) -> str:
    if lab in THRESHOLD_NAMES:
        return THRESHOLD_NAMES[lab]
    if lab.startswith("atol_"):
        return f"|delta| <= {lab[5:]}"
    if lab.startswith("rel_"):
        return f"|delta| <= {lab[4:]} x rms(base tensor)"
    return lab.replace("_", " ")


def _exact_comparison(s: DiffSummary) -> bool:
    return (s.comparison or "exact").startswith("exact")


def _common_name(s: DiffSummary) -> str:
    return f"equal in {s.comparison_dtype} (the lower stored precision)"


def _unchanged_table(s: DiffSummary) -> dict[str, Any] | None:
    """Unchanged fraction at each threshold: one row per threshold; a second column when the
    summary also has the bf16-checkpoint convention (|bf16(tuned) - bf16(base)| <= a)."""
    unchanged = s.unchanged()
    if "common" in unchanged:  # the headline convention leads the table too
        unchanged = {"common": unchanged.pop("common"), **unchanged}
    bf16 = {lab[len(BF16_DELTA):]: v for lab, v in unchanged.items() if lab.startswith(BF16_DELTA)}
    rows: list[list[str]] = []
    for lab, v in unchanged.items():
        if lab.startswith(BF16_DELTA):
            continue  # shown next to the float32 row of the same atol
        if lab == "common" and _exact_comparison(s):
            continue  # the same numbers as the "exactly equal" row
        name = _common_name(s) if lab == "common" else _threshold_name(lab)
        if lab == "exact" and not _exact_comparison(s):  # the precision policy: a counter-number
            name = "exactly equal across precisions (storage rounding counts as a change)"
        row = [name, kn.pct(v)]
        if bf16:
            row.append(kn.pct(bf16[lab[5:]]) if lab.startswith("atol_") and lab[5:] in bf16 else "")
        rows.append(row)
    if not rows:
        return None
    headers = ["threshold", "unchanged"]
    if bf16:
        headers = ["threshold", "unchanged (float32 delta)", "unchanged (both loaded in bf16)"]
    return {"title": "Unchanged fraction by threshold", "headers": headers, "rows": rows}


@key_numbers("diff")
def key_numbers_diff(r: DiffResult, out: dict[str, Any]) -> None:
    s = r.summary
    items = out["items"]
    if finite(s.unchanged_common) is not None and not _exact_comparison(s):
        sd = s.stored_dtypes or {}
        items.append(kn.item(f"Weights unchanged, compared in {s.comparison_dtype}", kn.pct(s.unchanged_common),
                             f"base stored in {sd.get('base')}, tuned in {sd.get('tuned')}: compared at the "
                             f"lower precision (exact equality across precisions: {kn.pct(s.unchanged_exact)})"))
    elif finite(s.unchanged_exact) is not None:
        note = (f"both stored in {s.comparison_dtype}; every threshold in the table below"
                if s.comparison_dtype else "every threshold in the table below")
        items.append(kn.item("Weights exactly unchanged", kn.pct(s.unchanged_exact), note))
    sc = r.raw_summary.get("construction")  # compute.contract.construction: trained inside a mask
    inside = ""
    if sc and sc.get("trained_in_mask"):
        inside = (f"; over the {kn.pct(sc.get('mask_density'))} of coordinates inside the mask the model was "
                  f"trained in (the rest cannot move; over all coordinates the AUC {sc.get('all_coordinates')})")
    if finite(s.auc) is not None:
        k = (s.overlap_settings or {}).get("topk_percent") or next(
            (row.get("k_percent") for row in s.overlap or [] if row.get("k_percent")), None)
        top = f"top-{kn.fmt(k)}%" if k is not None else "top-k"
        items.append(kn.item(construction.scoped_label(f"Fisher AUC for the {top} |delta| coordinates", sc),
                             kn.fmt(s.auc), "0.5 = chance, 1 = the Fisher ranks them all first" + inside))
    if finite(s.changed_auc) is not None:
        items.append(kn.item(construction.scoped_label("Fisher AUC for changed-at-all coordinates", sc),
                             kn.fmt(s.changed_auc), "0.5 = chance" + inside))
    if "auc" not in s.model_fields_set:
        items.append(kn.item("Fisher AUC", "not computed", "the diff was run without a Fisher"))
    out["table"] = _unchanged_table(s)
