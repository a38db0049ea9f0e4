"""Stored figures drawn in the browser: one HTML block per view, drawn by the same local plotly.js
as the share page.

Why not one gr.Plot per figure: each Plot is a component that Gradio mounts and that lazily imports
its own Plotly bundle when the first value arrives, so a reopened result waited seconds between
its header and its figures. Here plotly.js is requested with the page (`head`, cached for a year
by the share router), and the figures arrive as Plotly JSON inside one HTML value that a small
observer draws as soon as it lands.
"""

from __future__ import annotations

import html
import json
from typing import Any

import gradio as gr

from app.share import PLOTLY_URL

PLOTLY_HEAD = f'<script src="{PLOTLY_URL}"></script>'  # the share page's copy, cached for a year
# Draw every not-yet-drawn `.fl-plot` under this component (on load and whenever its HTML value
# is replaced); waits for plotly.js if the view arrives before the script has run.
DRAW_JS = """
const draw = () => {
  const todo = element.querySelectorAll('.fl-plot[data-fig]:not([data-drawn])');
  if (!todo.length) { return; }
  if (!window.Plotly) { setTimeout(draw, 30); return; }
  todo.forEach((el) => {
    el.setAttribute('data-drawn', '1');
    const fig = JSON.parse(el.getAttribute('data-fig'));
    window.Plotly.newPlot(el, fig.data || [], fig.layout || {}, {responsive: true, displaylogo: false});
  });
};
new MutationObserver(draw).observe(element, {childList: true, subtree: true});
draw();
"""


def figures_html(figures: list[dict[str, Any]], prefix: str) -> str:
    """Stored figures ({name, title, figure}) as `<figure id='{prefix}-{i}'>` blocks."""
    out = []
    for i, f in enumerate(figures):
        data = html.escape(json.dumps(f["figure"], separators=(",", ":")), quote=True)
        out.append(f"<figure class='fl-fig' id='{prefix}-{i}' data-name='{html.escape(str(f.get('name', '')))}'>"
                   f"<div class='fl-plot' data-fig=\"{data}\"></div></figure>")
    return "".join(out)


def figures_box(elem_id: str, **kw: Any) -> gr.HTML:
    """The component that shows `figures_html(...)` values."""
    return gr.HTML("", elem_id=elem_id, head=PLOTLY_HEAD,
                   js_on_load=DRAW_JS, **kw)


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
