"""Figures and tables of a `fisher` result: where the mass sits (layer x module), per layer,
how concentrated it is; the exact output-layer check."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from compute.contract.results import TypedResult
from compute.jobs.fisher import CONCENTRATION, FisherResult

from . import keynumbers as kn
from .common import Table, empty_figure, finite, fmt, heatmap_figure, layout, rows_table
from .layers import has_value, layer_module_heatmap, per_layer_bars
from .registry import figure, key_numbers, table


def _layer_module(r: FisherResult, value: str, title: str) -> go.Figure | None:
    """From the per-tensor rows (exact, parameter names in the hover); from the stored
    "fisher/<value>" heatmap when the result has no per-layer rows."""
    if has_value(r, value):
        return layer_module_heatmap(r, value)
    hm = r.heatmap(f"fisher/{value}")
    return heatmap_figure(hm, f"{title} (log colour scale)", log=True) if hm else None


@figure("fisher", "fisher_mean", title="Fisher mean by layer x module")
def fisher_mean(r: FisherResult) -> go.Figure | None:
    return _layer_module(r, "mean", "Fisher mean by layer x module")


@figure("fisher", "fisher_share", title="Fisher share of mass by layer x module")
def fisher_share(r: FisherResult) -> go.Figure | None:
    return _layer_module(r, "share", "Fisher share of mass by layer x module")


@figure("fisher", "per_layer", title="Fisher share per layer")
def per_layer(r: FisherResult) -> go.Figure | None:
    return per_layer_bars(r, "share") if has_value(r, "share") else None


@figure("fisher", "concentration", title="Concentration of the Fisher")
def concentration(r: FisherResult) -> go.Figure | None:
    return concentration_figure(r) if r.curve(CONCENTRATION) else None


def concentration_figure(r: FisherResult) -> go.Figure:
    """Share of Fisher mass (y) held by the top x fraction of coordinates; diagonal = uniform."""
    s = r.curve(CONCENTRATION)
    if not s:
        return empty_figure("no concentration curve in this result")
    xs, ys = s
    fig = go.Figure()
    fig.add_scatter(x=xs, y=ys, mode="lines+markers", name="Fisher",
                    hovertemplate="top %{x:.4g} of coordinates hold %{y:.4g} of the mass<extra></extra>")
    wide = min(xs) > 0 and max(xs) / max(min(xs), 1e-12) > 100
    # uniform: the top x of the coordinates hold x of the mass, y = x; drawn at log-spaced points
    # on a log axis (two end points (0, 0), (1, 1) there would show as a flat line at 1)
    ref = ([min(xs) * (1.0 / min(xs)) ** (i / 60) for i in range(61)] if wide else [0.0, 1.0])
    fig.add_scatter(x=ref, y=ref, mode="lines", name="uniform (y = x)", line={"dash": "dot", "color": "grey"},
                    hovertemplate="uniform: top %{x:.4g} hold %{y:.4g}<extra></extra>")
    fig.update_xaxes(title_text="fraction of coordinates (top by Fisher)", type="log" if wide else "linear")
    fig.update_yaxes(title_text="share of Fisher mass", range=[0, 1.02])
    gini = r.summary.gini
    return layout(fig, "Concentration of the Fisher" + (f" (Gini {fmt(gini)})" if gini is not None else ""))


@table("fisher", "exact_output", title="Exact output-layer check (Monte-Carlo vs closed form)")
def exact_output_table(r: TypedResult[Any]) -> Table:
    """Monte-Carlo vs exact output-layer Fisher (a correctness check), one row per parameter."""
    rows = r.summary.exact_output if isinstance(r, FisherResult) else None
    if not rows:
        return [], []
    return rows_table([{"param": k, **v.model_dump()} for k, v in rows.items()],
                      ("param", "relative_l1_error", "mc_mass", "exact_mass"))


# ---------------------------------------------------------------- key numbers


@key_numbers("fisher")
def key_numbers_fisher(r: FisherResult, out: dict[str, Any]) -> None:
    s = r.summary
    items = out["items"]
    if finite(s.top1_share) is not None:
        items.append(kn.item("Fisher mass in the top 1% of coordinates", kn.pct(s.top1_share), "uniform would be 1%"))
    if finite(s.top10_share) is not None:
        items.append(kn.item("Fisher mass in the top 10%", kn.pct(s.top10_share)))
    if finite(s.gini) is not None:
        gerr = finite(s.gini_error_bound)
        items.append(kn.item("Gini coefficient", kn.fmt(s.gini), "0 = uniform, 1 = one coordinate"
                             + (f"; within {gerr:.1g} (streaming histogram)" if gerr else "")))
    k, jac = finite(s.split_half_topk_percent), finite(s.split_half_jaccard)
    if jac is not None:
        hb = finite((s.split_half_precision or {}).get("half_error_bound"))
        items.append(kn.item(f"Split-half top-{kn.fmt(k)}% Jaccard", kn.fmt(jac), "two independent halves of the samples"
                             + (f"; each half within {hb:.1g} of a coordinate's total (16-bit difference)"
                                if hb else "")))
    if "split_half_jaccard" in s.model_fields_set:
        out["verdict"] = kn.jaccard_verdict(jac, k)
    if s.n_samples is not None:
        items.append(kn.item("Samples", kn.fmt(s.n_samples), str(s.estimator or "")))
    perr = s.precision_error or {}
    if finite(perr.get("relative_l1")) is not None:
        out["warnings"].append(
            f"Computed in {s.compute_dtype}: relative L1 error {kn.fmt(perr['relative_l1'])} against float32 "
            f"(worst tensor {kn.fmt(perr.get('worst_tensor_relative_l1'))}, "
            f"top-{kn.fmt(perr.get('topk_percent'))}% overlap {kn.fmt(perr.get('topk_jaccard'))}) on the same "
            f"{perr.get('rows')} completions; rerun with dtype float32 for the exact Fisher.")
    skipped = s.precision_error_skipped
    if skipped:
        out["warnings"].append(f"Computed in {s.compute_dtype}: its error against float32 was {skipped}.")
    errs = [e for v in (s.exact_output or {}).values() if (e := finite(v.relative_l1_error)) is not None]
    if errs:
        items.append(kn.item("Output layer: relative L1 error vs exact", kn.fmt(max(errs)),
                           "largest over the output-layer tensors"))
