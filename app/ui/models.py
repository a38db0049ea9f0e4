"""Models tab: the zoo, registered local folders and trained models; register a local folder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from app import api
from app.ui.snippets import errors_html, esc, note_html
from compute.contract.specs import SpecError

HEADERS = ["name", "source", "architecture", "n_params", "n_layers", "hidden_size", "vocab_size", "note", "path"]


@dataclass
class ModelsTab:
    table: Any
    path: Any
    name: Any
    button: Any
    msg: Any


def build() -> ModelsTab:
    table = gr.Dataframe(interactive=False, label="models")
    with gr.Row():
        path = gr.Textbox(label="register a local HF model folder",
                          placeholder="/path/inside/the/allowed/roots", scale=4)
        name = gr.Textbox(label="name (optional)", scale=2)
        button = gr.Button("Register", scale=1)
    msg = gr.HTML()
    gr.Markdown("Local folders must be inside the zoo or the allowed model roots, which the "
                "operator sets with `ALLOWED_MODEL_ROOTS=/a:/b`. Trained models need no "
                "registering: every model field accepts `job:N` of a succeeded train job.")
    return ModelsTab(table, path, name, button, msg)


def models_table(settings: Any) -> Any:
    rows = api.all_models(settings)
    return gr.Dataframe(value=[[r.get(h) for h in HEADERS] for r in rows] or [[None] * len(HEADERS)],
                        headers=HEADERS)


def register(settings: Any, path: str | None, name: str | None) -> tuple[str, Any]:
    try:
        m = api.register_local_model(settings, path or "", name)
    except SpecError as exc:
        return errors_html(exc.errors, "Not registered"), gr.skip()
    except PermissionError as exc:  # AUTH_REQUIRED: only admins register names
        return errors_html([{"field": "name", "message": str(exc)}], "Not registered"), gr.skip()
    return note_html(f"Registered <b>{esc(m['name'])}</b> ({esc(m['source'])})."), models_table(settings)
