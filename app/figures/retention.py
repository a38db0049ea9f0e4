"""Figures and the table of a `retention` result: held-out reward kept by masked training,
relative to full training, per selector and density."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import plotly.graph_objects as go

from compute.contract.results import TypedResult
from compute.jobs.retention import HELDOUT, RETENTION, TRAIN_REWARD, RetentionResult, RetentionRow

from . import keynumbers as kn
from .common import Table, curves_figure, finite, fmt, layout, rows_table
from .registry import figure, key_numbers, stored_heatmap, table

TABLE_COLUMNS = ("selector", "density", "actual_density", "reward_mean", "reward_ci", "reward_se",
                 "reward_std", "retention", "retention_ci", "retention_ci_seeds",
                 "retention_ci_prompts", "retentions", "retention_mean", "retention_std")


def _ci_bars(rows: list[RetentionRow], center: str, ci: str) -> dict[str, Any]:
    """Asymmetric Plotly error bars from [lo, hi] intervals (missing ends drawn as 0 length)."""
    up, down = [], []
    for r in rows:
        d = r.model_dump()
        c, iv = finite(d.get(center)), d.get(ci)
        lo = finite(iv[0]) if isinstance(iv, list | tuple) and len(iv) == 2 else None
        hi = finite(iv[1]) if isinstance(iv, list | tuple) and len(iv) == 2 else None
        up.append(hi - c if c is not None and hi is not None else 0.0)
        down.append(c - lo if c is not None and lo is not None else 0.0)
    return {"type": "data", "symmetric": False, "array": up, "arrayminus": down, "visible": True}


def _from_series(r: TypedResult[Any]) -> go.Figure:
    groups = {m: c for m, fam in (("retention", RETENTION), ("heldout", HELDOUT)) if (c := r.curves(fam))}
    return curves_figure(groups, "Retention by mask density", x_title="density", metric="retention",
                         log_x=True, labels={"heldout": "held-out reward"})


def _add_selector_lines(fig: go.Figure, rows: list[RetentionRow], metric: str, legacy: bool, valid: bool,
                        conf: str) -> None:
    by_sel: dict[str, list[RetentionRow]] = defaultdict(list)
    for row in rows:
        by_sel[row.selector].append(row)
    for sel, rs in by_sel.items():
        rs.sort(key=lambda row: float(row.density or 0.0))
        if legacy:
            bars: dict[str, Any] = {"type": "data", "visible": True,
                                    "array": [finite(row.retention_std) or 0.0 for row in rs]}
        else:
            bars = _ci_bars(rs, metric, "retention_ci" if valid else "reward_ci")
        fig.add_scatter(
            x=[row.density for row in rs], y=[finite(row.model_dump().get(metric)) for row in rs],
            error_y=bars, mode="lines+markers", name=sel,
            customdata=[[fmt(row.reward_mean), str(row.retention_ci), str(row.retentions)] for row in rs],
            hovertemplate=f"{sel} @ density %{{x}}<br>%{{y:.4g}} ({conf} CI %{{customdata[1]}})"
                          "<br>held-out reward %{customdata[0]}<br>per seed %{customdata[2]}<extra></extra>",
        )


def retention_figure(r: TypedResult[Any]) -> go.Figure:
    """Retention (ratio of means) against density, one line per selector, with bootstrap intervals
    over seeds and prompts. When full training did not beat the base beyond its error there is no
    ratio to show: the figure shows held-out rewards with their intervals and says why."""
    if not isinstance(r, RetentionResult):
        return _from_series(r)
    s = r.summary
    rows = [row for row in s.rows if finite(row.density) is not None]
    if not rows:
        return _from_series(r)
    conf = f"{float(s.confidence or 0.95):.0%}"
    legacy = "retention" not in rows[0].model_fields_set  # stored before intervals: mean +- std
    valid = s.retention_valid is not False
    metric = "retention_mean" if legacy else "retention" if valid else "reward_mean"
    fig = go.Figure()
    _add_selector_lines(fig, rows, metric, legacy, valid, conf)
    fig.update_xaxes(title_text="mask density (fraction of coordinates trained)", type="log")
    if valid:
        fig.add_hline(y=1.0, line_dash="dot", line_color="grey", annotation_text="full training")
        fig.add_hline(y=0.0, line_dash="dot", line_color="grey", annotation_text="base")
        fig.update_yaxes(title_text="retention = (masked - base) / (full - base)")
        title = (f"Retention by mask density (ratio of means; {conf} bootstrap CI over seeds and prompts)"
                 if not legacy else "Retention by mask density (mean +- spread over seeds)")
        return layout(fig, title)
    for name, raw in (("base", s.base_reward), ("full training", s.full_reward_mean)):
        if (y := finite(raw)) is not None:
            fig.add_hline(y=y, line_dash="dot", line_color="grey", annotation_text=f"{name} {fmt(y)}")
    fig.update_yaxes(title_text=f"held-out reward ({conf} CI)")
    fig.add_annotation(text="No retention: " + str(s.warning or "full training did not beat the base"),
                       xref="paper", yref="paper", x=0.0, y=1.0, xanchor="left", yanchor="bottom",
                       showarrow=False, font={"color": "#b00020"}, align="left")
    return layout(fig, "No retention shown: full training did not beat the base beyond its error", height=460)


def _table_cell(v: Any) -> Any:
    if isinstance(v, list | tuple) and len(v) <= 16 and all(x is None or isinstance(x, int | float) for x in v):
        return "[" + ", ".join(fmt(x) for x in v) + "]"
    return v


@table("retention", "retention", title="Retention")
def retention_table(r: TypedResult[Any]) -> Table:
    """One row per (selector, density): held-out reward with its interval, retention (ratio of
    means) with bootstrap intervals over seeds and prompts, and per-seed (paired) retentions;
    first the base and full-training rows."""
    s = r.raw_summary
    stored = s.get("retention") or s.get("rows") or []
    # intervals and the paired per-seed retentions are shown; per-seed rewards are left out
    rows = [{k: _table_cell(v) for k, v in row.items() if not isinstance(v, dict) and k != "rewards"}
            for row in stored if isinstance(row, dict)]
    if rows and s.get("base_reward") is not None:
        rows = [{"selector": "(base, no training)", "reward_mean": s["base_reward"], "reward_se": s.get("base_se")},
                {"selector": "(full training)", "density": 1.0, "reward_mean": s.get("full_reward_mean"),
                 "reward_std": s.get("full_reward_std"), "reward_se": s.get("full_se"),
                 "retention": 1.0 if s.get("retention_valid", True) is not False else None}, *rows]
    return rows_table(rows, TABLE_COLUMNS)


@figure("retention", "retention_curve", title="Retention by mask density")
def retention_curve(r: RetentionResult) -> go.Figure | None:
    return retention_figure(r) if r.summary.rows or r.curves(RETENTION) or r.curves(HELDOUT) else None


@figure("retention", "training", title="Training curves (one line per mask)")
def training(r: RetentionResult) -> go.Figure | None:
    runs = r.curves(TRAIN_REWARD)
    return curves_figure({"train_reward": runs}, "Training curves (one line per mask)",
                         labels={"train_reward": "sample reward"}) if runs else None


stored_heatmap("retention", "retention", title="Retention by selector and density (mean over seeds)")


# ---------------------------------------------------------------- key numbers


def _retention_warning(r: RetentionResult, out: dict[str, Any]) -> None:
    s = r.summary
    base, full, spread = finite(s.base_reward), finite(s.full_reward_mean), finite(s.full_reward_std)
    if s.retention_valid is False and s.warning:  # compute.studies.retention's own test
        out["warnings"].append(f"No retention reported: {s.warning}")
    elif base is not None and full is not None:
        if full <= base:
            out["warnings"].append(
                f"Full training did not beat the base model (full {kn.fmt(full)} <= base {kn.fmt(base)}): "
                "retention = (masked - base) / (full - base) has no meaning here.")
        elif spread is not None and full - base <= spread:
            out["warnings"].append(
                f"Full training beat the base by {kn.fmt(full - base)}, within one seed spread "
                f"({kn.fmt(spread)}): retention ratios are noisy.")


def _ci(v: Any) -> str:
    return f"[{kn.fmt(v[0])}, {kn.fmt(v[1])}]" if isinstance(v, list) and len(v) == 2 else "n/a"


def _retention_table(rows: list[RetentionRow], confidence: float | None) -> dict[str, Any]:
    if rows and "retention_ci" in rows[0].model_fields_set:  # ratio of means with bootstrap intervals
        conf = f"{float(confidence or 0.95):.0%}"
        return {
            "headers": ["selector", "density", f"held-out reward [{conf} CI]", "retention",
                        f"{conf} CI (seeds + prompts)"],
            "rows": [[row.selector, kn.fmt(row.density), f"{kn.fmt(row.reward_mean)} {_ci(row.reward_ci)}",
                      kn.fmt(row.retention), _ci(row.retention_ci)] for row in rows],
        }
    return {
        "title": "Retention by selector and density (mean +- spread over seeds)",
        "headers": ["selector", "density", "held-out reward", "retention", "retention of means"],
        "rows": [[row.selector, kn.fmt(row.density), f"{kn.fmt(row.reward_mean)} +- {kn.fmt(row.reward_std)}",
                  f"{kn.fmt(row.retention_mean)} +- {kn.fmt(row.retention_std)}", kn.fmt(row.retention_of_means)]
                 for row in rows],
    }


@key_numbers("retention")
def key_numbers_retention(r: RetentionResult, out: dict[str, Any]) -> None:
    s = r.summary
    base, full, spread = finite(s.base_reward), finite(s.full_reward_mean), finite(s.full_reward_std)
    if base is not None:
        out["items"].append(kn.item("Base model held-out reward", kn.fmt_se(base, r.raw_summary.get("base_se")),
                                    "± one standard error" if finite(r.raw_summary.get("base_se")) is not None
                                    else ""))
    if full is not None:
        se = finite(r.raw_summary.get("full_se"))
        note = f"{len(s.full_rewards or [])} seeds" + ("; ± the spread (std) across seeds" if spread is not None else "")
        if se is not None:
            note += f"; standard error of the mean {kn.fmt(se)}"
        out["items"].append(kn.item("Full training held-out reward",
                                  kn.fmt(full) + (f" ± {kn.fmt(spread)}" if spread is not None else ""), note))
    _retention_warning(r, out)
    out["table"] = _retention_table(list(s.rows), s.confidence)
