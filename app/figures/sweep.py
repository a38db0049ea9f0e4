"""Figures and the table of a `sweep` result (learning rate x optimizer x precision)."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from compute.contract.results import PRECISIONS, TypedResult
from compute.jobs.sweep import SWEEP_METRICS, SweepPoint, SweepResult

from . import keynumbers as kn
from .common import Table, cell, empty_figure, finite, layout
from .registry import figure, key_numbers, stored_heatmap, table

SWEEP_COLUMNS = ("precision", "optimizer", "lr", "unchanged_common", "comparison_dtype", "unchanged_bf16",
                 "unchanged_bf16delta_atol_1e-05", "unchanged_atol_1e-05", "fisher_auc_changed",
                 "fisher_auc_changed_within_binades", "fisher_auc_gradient", "fisher_auc_abs_delta",
                 "reward_before", "reward_before_se", "reward_after", "reward_after_se")
METRIC_TITLES = {"unchanged_bf16": "Unchanged fraction (bf16)", "fisher_auc_changed": "Fisher AUC for 'changed'",
                 "fisher_auc_gradient": "Fisher AUC for the top-k of the summed squared gradient"}
Lines = dict[str, tuple[list[float], list[float | None]]]


def _points(r: TypedResult[Any]) -> list[SweepPoint]:
    return list(r.summary.points) if isinstance(r, SweepResult) else []


def _lines(points: list[SweepPoint], key: str) -> Lines:
    lines: Lines = {}
    for p in sorted(points, key=lambda p: p.lr):
        xs, ys = lines.setdefault(f"{p.optimizer} {p.precision}", ([], []))
        xs.append(p.lr)
        ys.append(finite(p.model_dump().get(key)))
    return lines


def _lines_figure(r: TypedResult[Any], keys: tuple[tuple[str, str, str], ...], y_title: str,
                  title: str, chance: bool) -> go.Figure:
    points = _points(r)
    if not points:
        return empty_figure("no sweep points in this result")
    fig = go.Figure()
    for key, dash, suffix in keys:
        for name, (xs, ys) in _lines(points, key).items():
            if all(y is None for y in ys):
                continue
            fig.add_scatter(x=xs, y=ys, mode="lines+markers", name=f"{name}: {suffix}", line={"dash": dash},
                            hovertemplate="lr %{x:.3g}<br>%{y:.4f}<extra>" + name + "</extra>")
    if chance:
        fig.add_hline(y=0.5, line={"dash": "dot", "color": "grey"}, annotation_text="chance")
    fig.update_xaxes(title_text="learning rate", type="log")
    fig.update_yaxes(title_text=y_title, range=[0, 1.02])
    return layout(fig, title)


def sweep_sparsity_figure(r: TypedResult[Any]) -> go.Figure:
    """Update sparsity (the headline policy, compute.contract.precision: unchanged in the lower of
    the base's and the checkpoint's stored precisions) against learning rate, one line per
    optimizer x precision; dotted: the published |delta_bf16| <= 1e-5 convention."""
    lead = (("unchanged_common", "solid", "unchanged (lower stored precision)")
            if any(p.unchanged_common is not None for p in _points(r))
            else ("unchanged_bf16", "solid", "bf16-equal"))  # results stored before the policy
    return _lines_figure(r, (lead,
                             ("unchanged_bf16delta_atol_1e-05", "dot", "|Δbf16| ≤ 1e-5")),
                         "fraction of coordinates unchanged", "Update sparsity vs learning rate x optimizer",
                         chance=False)


def sweep_auc_figure(r: TypedResult[Any]) -> go.Figure:
    """Initial Fisher's ROC-AUC against learning rate: for 'changed' (solid), for 'changed' within
    |w| binades (dash: net of the bf16-ULP effect) and for the top-k of sum g^2 (dot)."""
    return _lines_figure(r, (("fisher_auc_changed", "solid", "AUC changed"),
                             ("fisher_auc_changed_within_binades", "dash", "AUC changed within |w| binades"),
                             ("fisher_auc_gradient", "dot", "AUC top-k Σg²")),
                         "ROC-AUC of the initial Fisher", "Fisher AUC vs learning rate x optimizer", chance=True)


def sweep_binade_figure(r: TypedResult[Any]) -> go.Figure:
    """Fisher's AUC for 'changed' within each |w| binade (equal bf16 ULP), one line per point."""
    fig = go.Figure()
    for p in _points(r):
        bins = [b for b in p.fisher_auc_changed_by_binade or [] if finite(b.get("auc")) is not None
                and (finite(b.get("abs_w_lo")) or 0) > 0]
        if not bins:
            continue
        name = f"{p.optimizer} lr {p.lr:g} {p.precision}"
        fig.add_scatter(x=[b["abs_w_lo"] for b in bins], y=[b["auc"] for b in bins], mode="lines+markers",
                        name=name, customdata=[[b.get("n"), b.get("n_changed")] for b in bins],
                        hovertemplate="|w| in [%{x:.3g}, 2x)<br>AUC %{y:.4f}<br>n %{customdata[0]}, "
                                      "changed %{customdata[1]}<extra>" + name + "</extra>")
    if not fig.data:
        return empty_figure("no binade with both changed and unchanged coordinates")
    fig.add_hline(y=0.5, line={"dash": "dot", "color": "grey"}, annotation_text="chance")
    fig.update_xaxes(title_text="|w| (binade lower edge; equal bf16 ULP inside)", type="log")
    fig.update_yaxes(title_text="ROC-AUC of the initial Fisher for 'changed'", range=[0, 1.02])
    return layout(fig, "Fisher AUC within |w| bins (net of the bf16-ULP effect)")


@figure("sweep", "sweep_sparsity", title="Update sparsity vs learning rate x optimizer")
def sweep_sparsity(r: SweepResult) -> go.Figure | None:
    return sweep_sparsity_figure(r) if r.summary.points else None


@figure("sweep", "sweep_auc", title="Fisher AUC vs learning rate x optimizer")
def sweep_auc(r: SweepResult) -> go.Figure | None:
    return sweep_auc_figure(r) if r.summary.points else None


@figure("sweep", "sweep_binades", title="Fisher AUC within |w| bins")
def sweep_binades(r: SweepResult) -> go.Figure | None:
    return sweep_binade_figure(r) if r.summary.points else None


for _metric in SWEEP_METRICS:
    for _prec in PRECISIONS:
        stored_heatmap("sweep", f"sweep_{_metric}_{_prec}", title=f"{METRIC_TITLES[_metric]}, {_prec}: "
                                                                    "optimizer x learning rate")


@table("sweep", "sweep_points", title="Sweep points (lr x optimizer x precision)")
def sweep_table(r: TypedResult[Any]) -> Table:
    """One row per sweep point (empty for other results)."""
    rows = [p.model_dump() for p in _points(r)]
    cols = [c for c in SWEEP_COLUMNS if any(p.get(c) is not None for p in rows)]  # none: stored before
    return cols, [[cell(p.get(c)) for c in cols] for p in rows]


# ---------------------------------------------------------------- key numbers


@key_numbers("sweep")
def key_numbers_sweep(r: SweepResult, out: dict[str, Any]) -> None:
    pts = r.summary.points
    if not pts:
        return
    out["items"].append(kn.item("Points (lr x optimizer x precision)", str(len(pts))))
    out["table"] = {
        "title": "Unchanged fraction (in the lower stored precision) and Fisher AUC per point",
        "headers": ["precision", "optimizer", "lr", "unchanged", "compared in", "Fisher AUC changed",
                    "reward after (± SE)"],
        "rows": [[p.precision, p.optimizer, f"{p.lr:g}",
                  kn.pct(p.unchanged_common if p.unchanged_common is not None else p.unchanged_bf16),
                  p.comparison_dtype or ("bfloat16" if p.unchanged_common is None else "stored dtype"),
                  kn.fmt(p.fisher_auc_changed), kn.pct_se(p.reward_after, p.reward_after_se)] for p in pts],
    }
