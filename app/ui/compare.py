"""Compare tab: first what the two results have in common, computed (app/explore/compare.py:
overall top-k Jaccard, its random baseline and Spearman, then per layer x module, a difference
map, the shareable link /r/<a>/compare/<b>); below, the two stored results side by side, each
with its key numbers (app/render.py, as on the share page) and its stored figures
(app/figures/store.py); same-named heatmaps get one colour range."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import gradio as gr

from app import render
from app.ui.common import job_choices
from app.ui.figs import figures_box, figures_html, same_colour_range
from app.ui.result import job_by_token, stored_payload
from app.ui.snippets import esc, not_found_html, note_html, progress_html, spec_html

COMPARE_FIGS = 4  # figures per side
TITLE_WIDTH = 48  # characters per title line in a half-width figure
DEFAULT_K = 1.0


@dataclass
class CompareTab:
    a: Any
    b: Any
    k: Any
    button: Any
    computed: Any
    head_a: Any
    figs_a: Any
    head_b: Any
    figs_b: Any


def build() -> CompareTab:
    with gr.Row():
        a = gr.Dropdown(label="left result", allow_custom_value=True, elem_id="compare-a")
        b = gr.Dropdown(label="right result", allow_custom_value=True, elem_id="compare-b")
        k = gr.Number(value=DEFAULT_K, label="top-k % (for the Jaccard)", minimum=0.001, maximum=100,
                      elem_id="compare-k", scale=0, min_width=160)
        button = gr.Button("Compare", variant="primary", elem_id="compare-go")
    computed = figures_box("compare-computed")
    with gr.Row(elem_classes=["fl-compare-sides"]):
        with gr.Column(min_width=300, elem_classes=["fl-compare-side"]):
            head_a = gr.HTML(elem_id="compare-head-a")
            figs_a = figures_box("compare-figs-a", elem_classes=["fl-result"])
        with gr.Column(min_width=300, elem_classes=["fl-compare-side"]):
            head_b = gr.HTML(elem_id="compare-head-b")
            figs_b = figures_box("compare-figs-b", elem_classes=["fl-result"])
    return CompareTab(a, b, k, button, computed, head_a, figs_a, head_b, figs_b)


def outputs(t: CompareTab, url_box: Any) -> list[Any]:
    return [t.head_a, t.figs_a, t.head_b, t.figs_b, t.computed, url_box]


def _side(settings: Any, token: str | None) -> tuple[str, list[dict[str, Any]]]:
    """(header html, stored figures) of one side."""
    meta = job_by_token(settings, token) if token else None
    if meta is None:
        return (not_found_html(token) if token else note_html("Pick a result.")), []
    if meta["status"] != "succeeded":
        return spec_html(meta) + progress_html(meta), []
    payload = stored_payload(settings, meta) or {}
    head = f"<div class='fl-result'>{spec_html(meta)}{render.key_section(payload.get('numbers') or {})}</div>"
    return head, list(payload.get("figures") or [])[:COMPARE_FIGS]


def _copy(figs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the figures for a half-width column: long titles wrapped (never cut off), the
    slider of a multi-threshold heatmap below the axis title."""
    out = []
    for f in figs:
        layout = dict(f["figure"].get("layout") or {})
        title = layout.get("title")
        text = title.get("text") if isinstance(title, dict) else title
        if isinstance(text, str) and len(text) > TITLE_WIDTH:
            layout["title"] = {**(title if isinstance(title, dict) else {}), "text": _wrap(text),
                               "font": {"size": 14}}
            layout["margin"] = {**(layout.get("margin") or {}), "t": 80}
        if layout.get("sliders"):
            layout["sliders"] = [{**sl, "y": -0.18, "pad": {"t": 30}} for sl in layout["sliders"]]
            layout["margin"] = {**(layout.get("margin") or {}), "b": 150}
        out.append({**f, "figure": {**f["figure"], "layout": layout,
                                    "data": [dict(t) for t in f["figure"].get("data") or []]}})
    return out


def _wrap(text: str) -> str:
    """A title on lines of at most TITLE_WIDTH characters (Plotly breaks only at <br>)."""
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > TITLE_WIDTH:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "<br>".join([*lines, line])


def computed_html(settings: Any, a: str | None, b: str | None, k: float) -> str:
    """The computed comparison (app/explore/compare.py), or why there is none."""
    from app.explore.compare import compare_html, compare_numbers
    from app.explore.sources import NotReadable

    if not a or not b:
        return ""
    try:
        v = compare_numbers(settings, a, b, float(k))
    except (NotReadable, ValueError) as exc:
        return note_html(f"No computed comparison: {esc(exc)}", "error")
    return compare_html(v, f"/r/{a}/compare/{b}?k={float(k):g}")


def compare_view(settings: Any, a: str | None, b: str | None, k: float | None = DEFAULT_K) -> list[Any]:
    """Updates for `outputs(...)`: both headers and figures, the computed comparison, and the
    address bar."""
    k = DEFAULT_K if k is None else k
    (head_a, left), (head_b, right) = _side(settings, a), _side(settings, b)
    left, right = _copy(left), _copy(right)  # the shared colour range is set on copies only
    same_colour_range(left, right)
    url = "/?" + urlencode({"tab": "compare", "a": a or "", "b": b or "", "k": f"{float(k):g}"})
    return [head_a, figures_html(left, "compare-a-fig"), head_b, figures_html(right, "compare-b-fig"),
            computed_html(settings, a, b, k), url]


def compare_choices(settings: Any, a: str | None, b: str | None) -> tuple[Any, Any]:
    choices = job_choices(settings, succeeded_only=True)
    return gr.Dropdown(choices=choices, value=a or None), gr.Dropdown(choices=choices, value=b or None)
