"""Figures of a `tokens` result (the token explorer): the next tokens with their probability and
share of the position's Fisher, the similarity of their parameter sensitivities, the measured
Fisher against orthogonal sensitivities, and where the position's Fisher sits."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from compute.contract.results import TypedResult
from compute.jobs.tokens import SIMILARITY, TOKEN_SETS, TokenRow, TokensResult

from . import keynumbers as kn
from .common import empty_figure, finite, fmt, heatmap_figure, layout
from .layers import has_value, layer_module_heatmap
from .registry import figure, key_numbers

COLOURS = {"top": "#1f77b4", "random": "#ff7f0e", "low": "#2ca02c"}


def show_token(tok: str) -> str:
    """Visible form of a token (spaces and control characters made explicit)."""
    return repr(tok)[1:-1].replace(" ", "\u2423") if tok != "" else "(empty)"


def _rows(r: TypedResult[Any], which: str) -> list[TokenRow]:
    return list(getattr(r.summary, f"{which}_tokens", None) or []) if isinstance(r, TokensResult) else []


def token_bars(r: TypedResult[Any]) -> go.Figure:
    """Top next tokens (and random / low contrast tokens): probability and share of the Fisher."""
    if not _rows(r, "top"):
        return empty_figure("no token results")
    fig = go.Figure()
    for which in TOKEN_SETS:
        rows = _rows(r, which)
        if not rows:
            continue
        x = [show_token(t.token) if which == "top" else f"{show_token(t.token)} ({which})" for t in rows]
        fig.add_bar(x=x, y=[t.prob for t in rows], name=f"probability ({which})", marker_color=COLOURS[which],
                    hovertemplate="%{x}: p=%{y:.4g}<extra></extra>")
        if any(t.share is not None for t in rows):
            fig.add_bar(x=x, y=[t.share for t in rows], name=f"share of Fisher ({which})",
                        marker_color=COLOURS[which], marker_pattern_shape="/", opacity=0.6,
                        hovertemplate="%{x}: share=%{y:.4g}<extra></extra>")
    fig.update_layout(barmode="group")
    fig.update_xaxes(title_text="next token", type="category")
    fig.update_yaxes(title_text="probability / share")
    ctx = r.summary.context if isinstance(r, TokensResult) else None
    return layout(fig, "Next tokens" + (f" after {ctx[-40:]!r}" if isinstance(ctx, str) else ""))


def token_similarity_heatmap(r: TypedResult[Any], which: str = "top") -> go.Figure:
    """Cosine similarity of the tokens' parameter-sensitivity vectors ("similarity_<which>")."""
    hm = r.heatmap(SIMILARITY.get(which, ""))
    if hm is None:
        return empty_figure(f"no {which}-token similarity matrix")
    mean = hm.meta.get("mean_offdiag")
    meta = {"zmin": -1.0, "zmax": 1.0, "units": "cosine", "colorscale": "RdBu", "x_title": "token",
            "y_title": "token", **hm.meta}
    shown = hm.model_copy(update={"x_labels": [show_token(t) for t in hm.x_labels],
                                  "y_labels": [show_token(t) for t in hm.y_labels], "meta": meta})
    extra = f", mean off-diagonal {fmt(mean)}" if mean is not None else ""
    return heatmap_figure(shown, f"Sensitivity similarity ({which} tokens{extra})", log=False)


def _change(removed: Any, share: Any) -> str:
    """'removes 101.2 = 0.339 of F_orth' / 'adds 136.2 = 0.106 of F_orth' (never "removes -136.2")."""
    r, sh = finite(removed), finite(share)
    if r is None:
        return f"removes {fmt(removed)}"
    verb = "removes" if r >= 0 else "adds"
    tail = f" = {fmt(abs(sh))} of F_orth" if sh is not None else ""
    return f"{verb} {fmt(abs(r))}{tail}"


def _counterfactual_bars(sim: dict[str, Any]) -> tuple[list[str], list[Any], str]:
    k = sim.get("top_k")
    if sim.get("exact"):
        names = ["trace F (measured)", "F_orth (all tokens orthogonal)", f"F_orth (top-{k} orthogonal)"]
        vals = [sim.get("trace_f"), sim.get("trace_f_orth"), sim.get("trace_f_orth_top")]
        share = (f"similarity {_change(sim.get('removed'), sim.get('removed_share'))}; "
                 f"top-{k} pairs {_change(sim.get('removed_top'), sim.get('removed_top_share'))}")
        return names, vals, share
    names = ["trace F >= (covered tokens)", "F_orth >= (covered tokens)"]
    vals = [sim.get("trace_f_lower"), sim.get("trace_f_orth_lower")]
    share = (f"bounds (vocabulary not enumerated): removed <= {fmt(sim.get('removed_upper'))}, share <= "
             f"{fmt(sim.get('removed_share_upper'))}; top-{k} pairs remove {fmt(sim.get('removed_top'))}")
    return names, vals, share


def token_counterfactual_figure(r: TypedResult[Any]) -> go.Figure:
    """Measured trace F at this position against F_orth, the counterfactual where the tokens'
    sensitivities were mutually orthogonal (all tokens; only the top-k): the gap is what their
    similarity removes (docs/science.md section 5). Lower bounds, marked as such, when the vocabulary
    was not enumerated."""
    sim = (r.summary.similarity if isinstance(r, TokensResult) else None) or {}
    if not sim:
        return empty_figure("no orthogonal-counterfactual numbers in this result")
    names, vals, share = _counterfactual_bars(sim)
    fig = go.Figure(go.Bar(x=names, y=[finite(v) for v in vals], text=[fmt(v) for v in vals],
                           textposition="outside", marker_color=["#1f77b4", "#aaaaaa", "#cccccc"][: len(names)]))
    fig.update_yaxes(title_text="trace of the position Fisher")
    return layout(fig, f"Fisher vs orthogonal sensitivities: {share}")


def token_choices(r: TypedResult[Any]) -> list[tuple[str, str]]:
    """(label, token) pairs for clickable top tokens, most likely first."""
    rows = sorted(_rows(r, "top"), key=lambda t: -(finite(t.prob) or 0.0))
    return [(f"{show_token(t.token)}  p={fmt(t.prob)}", t.token) for t in rows]


@figure("tokens", "tokens", title="Next tokens")
def tokens(r: TokensResult) -> go.Figure | None:
    return token_bars(r) if r.summary.top_tokens else None


@figure("tokens", "fisher_counterfactual", title="Fisher vs orthogonal sensitivities")
def fisher_counterfactual(r: TokensResult) -> go.Figure | None:
    return token_counterfactual_figure(r) if r.summary.similarity else None


def _similarity(which: str) -> None:
    @figure("tokens", f"similarity_{which}", title=f"Sensitivity similarity ({which} tokens)")
    def build(r: TokensResult) -> go.Figure | None:
        return token_similarity_heatmap(r, which) if r.heatmap(SIMILARITY[which]) else None


for _which in TOKEN_SETS:
    _similarity(_which)


@figure("tokens", "fisher_share", title="This position's Fisher: share by layer x module")
def fisher_share(r: TokensResult) -> go.Figure | None:
    if not has_value(r, "share"):
        return None
    return layer_module_heatmap(r, "share", title="This position's Fisher: share by layer x module (log colour scale)")


# ---------------------------------------------------------------- key numbers


@key_numbers("tokens")
def key_numbers_tokens(r: TokensResult, out: dict[str, Any]) -> None:
    s = r.summary
    if s.top_tokens:
        best = max(s.top_tokens, key=lambda t: finite(t.prob) or 0.0)
        out["items"].append(kn.item("Most likely next token", repr(best.token), f"p = {kn.fmt(best.prob)}"))
    if finite(s.entropy) is not None:
        out["items"].append(kn.item("Next-token entropy", kn.fmt(s.entropy), "nats"))
    raw = r.raw_summary
    if s.scope:
        n = raw.get("n_params")
        out["items"].append(kn.item("Scope", s.scope, f"{int(n):,} parameters" if isinstance(n, int | float) else ""))
    if finite(s.fisher_trace) is not None:
        how = ("exact, whole vocabulary" if s.fisher_exact else
               f"over {raw.get('covered_tokens')} tokens covering {kn.pct(raw.get('covered_mass'))} of the probability")
        out["items"].append(kn.item("Fisher trace at this position", kn.fmt(s.fisher_trace), how))
    if finite(raw.get("top_prob_mass")) is not None:
        out["items"].append(kn.item(
            f"Top {len(s.top_tokens)} tokens", f"probability {kn.pct(raw.get('top_prob_mass'))}",
            f"share of the Fisher trace {kn.pct(raw.get('top_fisher_share'))}"))
    cos = [(name, raw.get(f"mean_cosine_{key}")) for name, key in (("top", "top"), ("random", "random"),
                                                                  ("low-probability", "low"))]
    if any(finite(v) is not None for _, v in cos):
        out["items"].append(kn.item("Mean off-diagonal cosine of sensitivities",
                                    ", ".join(f"{name} {kn.fmt(v)}" for name, v in cos if finite(v) is not None),
                                    "cosine of the per-token gradients g_i - g_bar within each set"))
    sim = s.similarity or {}
    if sim.get("exact"):
        out["items"].append(kn.item(
            "Similarity of the sensitivities", _change(sim.get("removed"), sim.get("removed_share")),
            f"trace F {kn.fmt(sim.get('trace_f'))} vs orthogonal sensitivities F_orth {kn.fmt(sim.get('trace_f_orth'))}; "
            f"the top-{sim.get('top_k')} pairs alone: {_change(sim.get('removed_top'), sim.get('removed_top_share'))}"))
    elif sim:
        out["items"].append(kn.item(
            "Similarity of the sensitivities", f"removes <= {kn.fmt(sim.get('removed_upper'))} (share <= {kn.pct(sim.get('removed_share_upper'))})",
            f"vocabulary not enumerated: bounds; trace F >= {kn.fmt(sim.get('trace_f_lower'))}, "
            f"F_orth >= {kn.fmt(sim.get('trace_f_orth_lower'))}"))
    if s.top_tokens:
        out["table"] = {"title": "Most likely next tokens",
                        "headers": ["rank", "token", "probability", "share of F", "p x |g - g_bar|^2"],
                        "rows": [[i + 1, repr(t.token), kn.fmt(t.prob), kn.pct(t.share), kn.fmt(t.contrib)]
                                 for i, t in enumerate(s.top_tokens)]}
