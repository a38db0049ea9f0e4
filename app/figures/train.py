"""Figures of a `train` result: the training curves, the first-step bound check (|g| against
sqrt(F)), and the stored heatmaps of the bound and of the gradient concentration."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from compute.contract import construction, precision
from compute.contract.results import TypedResult
from compute.jobs.train import (
    BOUND_HIST,
    BOUND_POINTS,
    CONCENTRATION_AUC,
    CONCENTRATION_TARGETS,
    EVAL_ACCURACY,
    TRAIN,
    TrainResult,
)

from . import keynumbers as kn
from .common import (
    MAX_POINTS,
    Table,
    curves_figure,
    downsample,
    empty_figure,
    finite,
    fmt,
    layout,
    rows_table,
)
from .registry import figure, key_numbers, stored_heatmap, table

HELDOUT_ACCURACY = "held-out accuracy (greedy)"
TARGET_TITLES = {"grad_sq_sum": "the run's summed squared gradient (top-k)",
                 "grad_abs_sum": "the run's summed |gradient| (top-k)",
                 "abs_delta": "the run's |weight change| (top-k)"}


def bound_constant(r: TypedResult[Any]) -> tuple[float | None, float | None]:
    """(sqrt(E[A^2]), fraction of coordinates where the bound holds) from summary "bound" (or
    the top level, where results stored before the bound sub-dict kept them)."""
    s = {**r.raw_summary, **(r.raw_summary.get("bound") or {})}
    c = finite(s.get("bound_constant") or s.get("bound_rms_advantage"))
    held = finite(s.get("bound_fraction_holds", s.get("bound_holds_fraction")))
    return c, held


def bound_holds_text(r: TypedResult[Any]) -> str | None:
    """"the bound fails for 5 of 1,234 coordinates (max ratio 1.423)" / "holds for all ...",
    from the summary's violation count (never a rounded fraction: 5 in a million reads 100%)."""
    s = {**r.raw_summary, **(r.raw_summary.get("bound") or {})}
    v, n = s.get("bound_violations"), s.get("bound_coordinates")
    if not isinstance(v, int) or isinstance(v, bool):
        _, held = bound_constant(r)
        return f"the bound holds for {100 * held:.4g}% of coordinates" if held is not None else None
    mx = finite(s.get("bound_max_ratio"))
    tail = f" (max ratio {fmt(mx)})" if mx is not None else ""
    of = f" of {n:,}" if isinstance(n, int) else ""
    if v == 0 and s.get("bound_rms_advantage") == 0:
        return "no test of the bound: every advantage of the first batch is 0 (g = 0)"
    if v == 0:
        return f"the bound holds for all{of} coordinates{tail}"
    return f"the bound fails for {v:,}{of} coordinates{tail}"


def bound_scatter(r: TypedResult[Any], max_points: int = MAX_POINTS) -> go.Figure:
    """|gradient| (y) against sqrt(Fisher) (x) per coordinate, downsampled, log-log, with the
    Cauchy-Schwarz bound line y = sqrt(E[A^2]) x when the summary gives the constant."""
    s = r.curve(BOUND_POINTS)
    if not s:
        return empty_figure("no bound check points in this result")
    xs, ys = s
    keep = downsample(len(xs), max_points)
    x, y = [xs[i] for i in keep], [ys[i] for i in keep]
    fig = go.Figure()
    fig.add_scattergl(x=x, y=y, mode="markers", name="coordinates", marker={"size": 4, "opacity": 0.5},
                      hovertemplate="sqrt(F)=%{x:.4e}<br>|g|=%{y:.4e}<extra></extra>")
    c, held = bound_constant(r)
    pos = [v for v in x if v > 0]
    if c is not None and pos:
        lo, hi = min(pos), max(pos)
        fig.add_scatter(x=[lo, hi], y=[c * lo, c * hi], mode="lines", name="bound sqrt(E[A^2]) sqrt(F)",
                        line={"dash": "dash", "color": "red"})
    fig.update_xaxes(title_text="sqrt(Fisher)", type="log")
    fig.update_yaxes(title_text="|gradient|", type="log")
    note = f" ({len(keep)} of {len(xs)} points)" if len(keep) < len(xs) else ""
    holds_text = bound_holds_text(r)
    extra = f"; {holds_text}" if holds_text else ""
    return layout(fig, f"Gradient vs Fisher bound{note}{extra}")


def training_curves(r: TypedResult[Any], metric: str | None = None) -> go.Figure:
    """The run's own curves ("train/<metric>"), one metric at a time with a menu; the held-out
    accuracy before and after training ("eval/accuracy") as one more metric."""
    groups = {m: {"this run": xy} for m, xy in r.curves(TRAIN).items()}
    if (ev := r.curve(EVAL_ACCURACY)) is not None:
        groups[HELDOUT_ACCURACY] = {"this run": ev}
    return curves_figure(groups, "Training curves", metric=metric)


@figure("train", "bound", title="Gradient vs Fisher bound")
def bound(r: TrainResult) -> go.Figure | None:
    return bound_scatter(r) if r.curve(BOUND_POINTS) else None


@figure("train", "training", title="Training curves")
def training(r: TrainResult) -> go.Figure | None:
    return training_curves(r) if r.curves(TRAIN) or r.curve(EVAL_ACCURACY) else None


stored_heatmap("train", BOUND_HIST, log=True,
               title="Coordinates by log10 |gradient| (rows) and log10 sqrt(Fisher) (columns)")
for _name, _target in zip(CONCENTRATION_AUC, CONCENTRATION_TARGETS, strict=True):
    stored_heatmap("train", _name, title=f"Initial Fisher as a predictor of {TARGET_TITLES[_target]}: ROC-AUC")


@table("train", "concentration", title="Concentration: the Fisher's top-k vs the run (whole model)")
def concentration_table(r: TypedResult[Any]) -> Table:
    """One row per target the Fisher's top-k is compared with (its per-layer and per-module
    values are the concentration heatmaps). A run trained inside a mask: over the coordinates
    inside it (compute.contract.construction), then the same over all coordinates, labelled."""
    conc = r.raw_summary.get("concentration")
    if not isinstance(conc, dict):
        return [], []
    scope = conc.get("scope") or construction.SCOPE_ALL
    rows = [{"target": TARGET_TITLES.get(t, t), "scope": scope, "top-k fraction": conc.get("fraction"),
             **conc[t]["global"]}
            for t in CONCENTRATION_TARGETS
            if isinstance(conc.get(t), dict) and isinstance(conc[t].get("global"), dict)]
    every = r.raw_summary.get("concentration_all_coordinates")
    if isinstance(every, dict):
        rows += [{"target": TARGET_TITLES.get(t, t), "scope": f"all coordinates: {every.get('label')}",
                  "top-k fraction": every.get("fraction"), **every[t]["global"]}
                 for t in CONCENTRATION_TARGETS
                 if isinstance(every.get(t), dict) and isinstance(every[t].get("global"), dict)]
    return rows_table(rows, ("target", "scope", "top-k fraction", "precision_at_k", "auc", "spearman",
                             "jaccard_lift"))


# ---------------------------------------------------------------- key numbers


@key_numbers("train")
def key_numbers_train(r: TrainResult, out: dict[str, Any]) -> None:
    s = r.summary
    items = out["items"]
    before, after = finite(s.accuracy_before), finite(s.accuracy_after)
    if before is not None and after is not None:
        n = (s.eval or {}).get("prompts")
        se_b, se_a = kn.binomial_se(before, n), kn.binomial_se(after, n)
        note = f"greedy, {n} held-out prompts" if n else "greedy, held-out prompts"
        if se_b is not None and se_a is not None:
            note += (f"; ± one binomial SE in points; the change's SE is at most "
                     f"{100 * (se_b ** 2 + se_a ** 2) ** 0.5:.2g} points (unpaired)")
        items.append(kn.item("Held-out accuracy before -> after",
                           f"{kn.pct_se(before, se_b)} -> {kn.pct_se(after, se_a)} ({'+' if after >= before else ''}"
                           f"{100 * (after - before):.3g} points)", note))
        if after <= before:
            out["warnings"].append("Training did not improve held-out accuracy.")
    if s.bound_skipped:
        out["warnings"].append(f"GRPO's bound check on the first batch was {s.bound_skipped}.")
    curve = r.curves(TRAIN).get("reward")
    if curve is not None and len(curve[0]) >= 2:
        (xs, ys) = curve
        items.append(kn.item("Sample reward, first -> last step", f"{kn.fmt(ys[0])} -> {kn.fmt(ys[-1])}",
                           f"steps {kn.fmt(xs[0])} and {kn.fmt(xs[-1])}"))
    if finite(s.trainable_fraction) is not None:
        items.append(kn.item("Trainable fraction (mask density)", kn.pct(s.trainable_fraction)))
    us = s.update_sparsity or {}
    if finite(us.get("unchanged_exact")) is not None:
        # both sides are the stored weights (the base cast to the checkpoint's dtype): the
        # headline policy (compute.contract.precision) names the precision they were compared in
        dt = us.get("stored_dtype")
        c = ({"rule": us["comparison_rule"], "comparison_dtype": us.get("comparison_dtype")}
             if us.get("comparison_rule") else None)
        if precision.is_exact(c):
            note = f"{dt} checkpoint vs the base stored alike" if dt else ""
        else:
            sd = us.get("stored_dtypes") or {}
            note = (f"base stored in {sd.get('base')}, checkpoint in {sd.get('checkpoint')}: the base cast "
                    f"to {us.get('comparison_dtype')}, then compared")
        items.append(kn.item(precision.unchanged_label(c, "Stored weights unchanged"),
                             kn.pct(us["unchanged_exact"]), note))
    _bound_item(r, out)


def _bound_item(r: TrainResult, out: dict[str, Any]) -> None:
    """Violations of |g| <= sqrt(E A^2) sqrt(F) against the independent Fisher: the same
    sentence as the bound figure's title (bound_holds_text)."""
    b = r.summary.bound or {}
    if "bound_violations" not in b:
        return
    text = bound_holds_text(r)
    if text:
        v = b["bound_violations"]
        note = [text, "Fisher from independent samples"]
        med = finite((b.get("bound_ratio_quantiles") or {}).get("p50"))
        if med is not None:
            note.append(f"median |g| / bound {kn.fmt(med)}")
        if (b.get("bound_groups") or 1) > 1:  # issue 30: the check in groups of coordinates
            rel = finite(b.get("bound_ratio_quantile_rel_error"))
            note.append(f"checked in {b['bound_groups']} groups of coordinates to fit the device"
                        + (f", its quantiles to ±{rel:.2g} relative" if rel else ""))
        out["items"].append(kn.item("Cauchy-Schwarz bound, first batch", f"{v:,} violations", "; ".join(note)))
