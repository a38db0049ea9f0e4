"""Compare tab: two stored results side by side, each with its key numbers (app/render.py, as on
the share page) and its stored figures (app/figures/store.py), so layers carry their names
("embeddings", "final norm", "lm_head") exactly as on the share page; same-named heatmaps get one
colour range."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import gradio as gr

from app import render
from app.ui.common import job_choices
from app.ui.figs import figures_box, figures_html, same_colour_range
from app.ui.result import job_by_token, stored_payload
from app.ui.snippets import not_found_html, note_html, progress_html, spec_html

COMPARE_FIGS = 4  # figures per side


@dataclass
class CompareTab:
    a: Any
    b: Any
    button: Any
    head_a: Any
    figs_a: Any
    head_b: Any
    figs_b: Any


def build() -> CompareTab:
    with gr.Row():
        a = gr.Dropdown(label="left result", allow_custom_value=True, elem_id="compare-a")
        b = gr.Dropdown(label="right result", allow_custom_value=True, elem_id="compare-b")
        button = gr.Button("Compare", variant="primary")
    with gr.Row():
        with gr.Column(min_width=300):
            head_a = gr.HTML(elem_id="compare-head-a")
            figs_a = figures_box("compare-figs-a", elem_classes=["fl-result"])
        with gr.Column(min_width=300):
            head_b = gr.HTML(elem_id="compare-head-b")
            figs_b = figures_box("compare-figs-b", elem_classes=["fl-result"])
    return CompareTab(a, b, button, head_a, figs_a, head_b, figs_b)


def outputs(t: CompareTab, url_box: Any) -> list[Any]:
    return [t.head_a, t.figs_a, t.head_b, t.figs_b, url_box]


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
    return [{**f, "figure": {**f["figure"], "data": [dict(t) for t in f["figure"].get("data") or []]}}
            for f in figs]


def compare_view(settings: Any, a: str | None, b: str | None) -> list[Any]:
    """Updates for `outputs(...)`: both headers and figures, and the address bar."""
    (head_a, left), (head_b, right) = _side(settings, a), _side(settings, b)
    left, right = _copy(left), _copy(right)  # the shared colour range is set on copies only
    same_colour_range(left, right)
    url = "/?" + urlencode({"tab": "compare", "a": a or "", "b": b or ""})
    return [head_a, figures_html(left, "compare-a-fig"), head_b, figures_html(right, "compare-b-fig"), url]


def compare_choices(settings: Any, a: str | None, b: str | None) -> tuple[Any, Any]:
    choices = job_choices(settings, succeeded_only=True)
    return gr.Dropdown(choices=choices, value=a or None), gr.Dropdown(choices=choices, value=b or None)
