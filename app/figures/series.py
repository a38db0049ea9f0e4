"""Figures of a `series` result (a run folder of checkpoint-N): update sparsity over steps, layer x
module over steps, and the Fisher-predicted sync curve (what a values-only sync on the initial
Fisher's top-k support sends, and how much of each step's update it carries)."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from compute.contract import construction, precision
from compute.jobs.series import (
    CAPTURE_HEATMAP,
    FISHER,
    HEATMAP_PAIRS,
    SYNC,
    VS_BASE,
    VS_PREV,
    SeriesResult,
)

from . import keynumbers as kn
from .common import finite, integer_steps, layout
from .registry import figure, key_numbers, stored_heatmap, table

SPARSITY_LABELS = {
    "update_sparsity": "unchanged (exact)",
    "unchanged_bf16": "equal in bf16",
    "unchanged_atol": "|delta_fp32| <= atol",
    "unchanged_bf16delta_atol": "|delta_bf16| <= atol (published)",
}
PAIR_LABELS = {"vs_base": "vs base", "vs_prev": "step to step"}


def comparison_of(r: SeriesResult) -> dict[str, Any] | None:
    """The headline convention of a series (compute.contract.precision), from its summary."""
    s = r.summary
    if not s.comparison_rule:
        return None
    return {"rule": s.comparison_rule, "comparison_dtype": s.comparison_dtype, "comparison": s.comparison,
            "stored_dtypes": s.stored_dtypes or {}}


def _labels(r: SeriesResult) -> dict[str, str]:
    return {**SPARSITY_LABELS, "update_sparsity": precision.unchanged_units(comparison_of(r))
            .replace(" fraction", "")}


@figure("series", "sparsity", title="Update sparsity over steps")
def sparsity(r: SeriesResult) -> go.Figure | None:
    """One line per (pair, convention): the unchanged fraction at each checkpoint."""
    fig = go.Figure()
    labels = _labels(r)
    for fam, pair, dash in ((VS_BASE, "vs_base", "solid"), (VS_PREV, "vs_prev", "dot")):
        for key, (xs, ys) in r.curves(fam).items():
            if key == "unchanged_exact":  # the headline line is exact where both are stored alike;
                continue  # across precisions bit equality counts storage rounding (precision policy)
            fig.add_scatter(x=xs, y=ys, mode="lines+markers", line={"dash": dash},
                            name=f"{PAIR_LABELS[pair]}: {labels.get(key, key)}",
                            hovertemplate="step %{x}: %{y:.4f}<extra></extra>")
    if not fig.data:
        return None
    fig.update_xaxes(title_text="step")
    integer_steps(fig)
    fig.update_yaxes(title_text="unchanged fraction", range=[0, 1.02])
    atol = finite(r.summary.atol)
    return layout(fig, "Update sparsity over steps" + (f" (atol {atol:g})" if atol is not None else ""))


for _name, _pair in HEATMAP_PAIRS.items():
    # the stored heatmap's own title names its convention (compute.jobs.series._heatmaps)
    stored_heatmap("series", _name, title=f"Unchanged fraction by layer x module over steps "
                                          f"({PAIR_LABELS[_pair]})")
stored_heatmap("series", CAPTURE_HEATMAP,
               title="Share of each step's squared update on the Fisher support, by layer x module")


@figure("series", "sync", title="Sparse synchronisation per step")
def sync(r: SeriesResult) -> go.Figure | None:
    """Bytes per step of a dense sync, indices + values of the changed coordinates, and values
    only on the Fisher's fixed support (log scale); below, the share of the step's update that
    support carries (count and squared mass), with the Fisher's AUC for "changed"."""
    c = r.curves(SYNC)
    if "sparse_bytes" not in c:
        return None
    fisher = "support_bytes" in c
    fig = make_subplots(rows=2 if fisher else 1, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    conv = comparison_of(r)
    low = None if precision.is_exact(conv) else (conv or {}).get("comparison_dtype")
    names = {"dense_bytes": "dense (every value)",
             "sparse_bytes": "indices + values of changed" + (f" (in {low})" if low else ""),
             "sync_bytes": "cheaper of the two, per tensor",
             "support_bytes": "values on the Fisher support"}
    for key, label in names.items():
        if key in c:
            xs, ys = c[key]
            fig.add_scatter(x=xs, y=ys, mode="lines+markers", name=label, row=1, col=1,
                            hovertemplate="step %{x}: %{y:.4s} B<extra></extra>")
    fig.update_yaxes(type="log", title_text="bytes per step", row=1, col=1)
    if fisher:
        f = r.curves(FISHER)
        extra = {"captured_count_share": ("support captures: changed coordinates", c),
                 "captured_sq_share": ("support captures: squared update", c),
                 "auc_vs_prev": ("Fisher AUC for changed (step)", f)}
        for key, (label, src) in extra.items():
            if key in src:
                xs, ys = src[key]
                fig.add_scatter(x=xs, y=ys, mode="lines+markers", name=label, row=2, col=1,
                                hovertemplate="step %{x}: %{y:.4f}<extra></extra>")
        fig.update_yaxes(title_text="share / AUC", range=[0, 1.02], row=2, col=1)
    fig.update_xaxes(title_text="step", row=2 if fisher else 1, col=1)
    integer_steps(fig)
    k = finite(r.summary.support_percent)
    title = "Sparse sync per step" + (f": Fisher top-{k:g}% support" if k is not None and fisher else "")
    verdict = precision.sync_verdict(finite(r.summary.sparse_bytes_total), finite(r.summary.dense_bytes_total))
    if verdict and verdict["cheaper"] == "dense":  # never shown as a saving when it costs more
        title += f" ({verdict['text']})"
    return layout(fig, title, height=640 if fisher else 420)


@table("series", "points", title="Per checkpoint")
def points_table(r: SeriesResult) -> tuple[list[str], list[list[Any]]]:
    pts = r.summary.points or []
    if not pts:
        return [], []
    fisher = any("support_bytes" in p for p in pts)
    c = comparison_of(r)
    conv = "exact" if precision.is_exact(c) else f"in {c['comparison_dtype']}"  # type: ignore[index]
    headers = ["step", f"unchanged vs base ({conv})", f"unchanged step ({conv})", "|d_bf16|<=atol step",
               "sparse bytes", "dense bytes"]
    if fisher:
        headers += ["support bytes", "captured (count)", "captured (sq)", "AUC step"]
    rows = []
    for p in pts:
        row = [p.get("step"), kn.pct(p.get("vs_base_update_sparsity")), kn.pct(p.get("vs_prev_update_sparsity")),
               kn.pct(p.get("vs_prev_unchanged_bf16delta_atol")), kn.fmt(p.get("sparse_bytes")),
               kn.fmt(p.get("dense_bytes"))]
        if fisher:
            row += [kn.fmt(p.get("support_bytes")), kn.pct(p.get("captured_count_share")),
                    kn.pct(p.get("captured_sq_share")), kn.fmt(p.get("vs_prev_auc"))]
        rows.append(row)
    return headers, rows


@key_numbers("series")
def key_numbers_series(r: SeriesResult, out: dict[str, Any]) -> None:
    s = r.summary
    items = out["items"]
    n = len(s.steps or [])
    if n:
        items.append(kn.item("Checkpoints", str(n), f"steps {s.steps[0]} .. {s.steps[-1]}" if s.steps else ""))
    c = comparison_of(r)
    if finite(s.final_update_sparsity) is not None:
        note = f"bf16 convention |delta| <= {kn.fmt(s.atol)}: {kn.pct(s.final_unchanged_bf16delta_atol)}"
        if not precision.is_exact(c):
            sd = s.stored_dtypes or {}
            note = (f"base stored in {sd.get('base')}, checkpoints in {sd.get('checkpoint')}: compared at the "
                    f"lower precision (exact equality across precisions: {kn.pct(s.final_unchanged_exact)}); "
                    + note)
        items.append(kn.item(precision.unchanged_label(c, "Weights unchanged at the last checkpoint (vs base)"),
                             kn.pct(s.final_update_sparsity), note))
    if finite(s.mean_step_sparsity) is not None:
        items.append(kn.item("Unchanged per step (mean, step to step)", kn.pct(s.mean_step_sparsity),
                             f"bf16 convention: {kn.pct(s.mean_step_unchanged_bf16delta_atol)}"))
    dense, sparse = finite(s.dense_bytes_total), finite(s.sparse_bytes_total)
    verdict = precision.sync_verdict(sparse, dense)
    if verdict and dense:
        low = f", values in {s.comparison_dtype}" if not precision.is_exact(c) else ""
        if verdict["cheaper"] == "sparse":
            items.append(kn.item("Sparse sync (indices + values) vs dense", kn.pct(verdict["ratio"]),
                                 f"of the dense bytes, all steps together{low}"))
        else:
            items.append(kn.item("Sparse sync (indices + values) vs dense", f"{verdict['ratio']:.3g}x dense",
                                 f"dense is cheaper: sparse sync costs more than sending every value{low}"))
        sync = finite(s.sync_bytes_total)
        if sync is not None and sparse is not None and sync < sparse:  # some tensors are cheaper dense
            items.append(kn.item("Cheaper of sparse and dense per tensor vs dense", kn.pct(sync / dense),
                                 "each tensor and step sent the cheaper way"))
    support = finite(s.support_bytes_total)
    if dense and support is not None:
        items.append(kn.item("Fisher-support sync vs dense", kn.pct(support / dense),
                             f"carries {kn.pct(s.mean_captured_sq_share)} of each step's squared update and "
                             f"{kn.pct(s.mean_captured_count_share)} of its changed coordinates (means)"))
    if finite(s.mean_step_auc) is not None:
        sc = r.raw_summary.get("construction")  # compute.contract.construction
        note = "0.5 = chance"
        if sc and sc.get("trained_in_mask"):
            note += (f"; support, AUC and captured shares over the {kn.pct(sc.get('mask_density'))} of "
                     "coordinates inside the mask the run trained in (the rest cannot move)")
        items.append(kn.item(construction.scoped_label("Fisher AUC for the coordinates a step changes (mean)", sc),
                             kn.fmt(s.mean_step_auc), note))
    # the Fisher's verdict (its split-half check, or a note that it is unknown) comes from summary
    # "fisher_reliability", written by the runner (app.figures.keynumbers.key_numbers)
