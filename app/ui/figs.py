"""Stored figures drawn in the browser: the result view (app/render.py) is one HTML block whose
figures carry their Plotly JSON, drawn by the same local plotly.js and the same draw function as
the share page.

Why not one gr.Plot per figure: each Plot is a component that Gradio mounts and that lazily imports
its own Plotly bundle when the first value arrives, so a reopened result waited seconds between
its header and its figures. Here plotly.js is requested with the page (`head`, cached for a year
by the share router), and the figures arrive inside one HTML value that a small observer draws as
soon as it lands.
"""

from __future__ import annotations

from typing import Any

import gradio as gr

from app import render
from app.render import figures_html
from app.share import PLOTLY_URL

__all__ = ["PLOTLY_HEAD", "figures_box", "figures_html", "same_colour_range"]

# the share page's plotly.js (cached for a year) and the result view's styles, once per page
PLOTLY_HEAD = f'<script src="{PLOTLY_URL}"></script><style>{render.CSS}</style>'


def figures_box(elem_id: str, **kw: Any) -> gr.HTML:
    """The component that shows a result view or `figures_html(...)` values."""
    return gr.HTML("", elem_id=elem_id, js_on_load=render.COMPONENT_DRAW_JS, **kw)


def same_colour_range(left: list[dict[str, Any]], right: list[dict[str, Any]]) -> None:
    """Give figures of the same name on both sides one colour range (in place), so heatmap
    colours compare directly; only single-heatmap figures are changed."""
    rights = {f["name"]: f for f in right}
    for a in left:
        b = rights.get(a["name"])
        traces = [(f["figure"].get("data") or []) for f in (a, b)] if b else []
        if not traces or any(len(t) != 1 or t[0].get("type") != "heatmap" for t in traces):
            continue
        vals = [v for t in traces for row in (t[0].get("z") or []) for v in (row or [])
                if isinstance(v, int | float) and v == v]
        if vals:
            for t in traces:
                t[0].update(zmin=min(vals), zmax=max(vals), zauto=False)
