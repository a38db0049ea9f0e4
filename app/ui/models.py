"""Models tab: the zoo, registered local folders and trained models; register a local folder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from app import api, render, services
from app.ui.snippets import errors_html, esc, note_html
from compute.contract.specs import SpecError

HEADERS = ["name", "source", "architecture", "n_params", "n_layers", "hidden_size", "vocab_size", "note", "path"]
SHAPE = ("architecture", "n_params", "n_layers", "hidden_size", "vocab_size")  # a trained model keeps its base's


def params_text(n: object) -> str:
    """108800 -> '108.8k', 134515008 -> '134.5M' (the exact count in the cell's title)."""
    if not isinstance(n, int | float) or isinstance(n, bool):
        return ""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


def model_rows(settings: Any) -> list[dict[str, Any]]:
    """Every model a job field accepts, trained ones filled in from the model they were trained
    from (same architecture and sizes: training changes weights, not shapes)."""
    rows = api.all_models(settings)
    by_ref = {r["ref"]: r for r in rows}
    specs = {t["ref"]: t.get("spec") or {} for t in services.trained_models(settings)}
    for r in rows:
        spec = specs.get(r["ref"])
        if r.get("source") != "job" or spec is None:
            continue
        base = by_ref.get(spec.get("model")) or {}
        r.update({k: base.get(k) for k in SHAPE if r.get(k) is None})
        how = " ".join(str(spec[k]) for k in ("algo", "optimizer") if spec.get(k))
        mask = f", mask {spec['mask']}" if spec.get("mask") else ""
        r["source"] = f"trained ({r['ref']})"
        r["note"] = r.get("note") or f"{how} from {spec.get('model')}{mask}, {spec.get('steps', '?')} steps"
    return rows


def table_html(rows: list[dict[str, Any]]) -> str:
    cells = [[r.get("label") or r.get("name"), r.get("source"), r.get("architecture"), params_text(r.get("n_params")),
              r.get("n_layers"), r.get("hidden_size"), r.get("vocab_size"), r.get("note"), r.get("path")]
             for r in rows]
    return f"<div class='fl-result'>{render.table_html(HEADERS, cells, elem_id='fl-models')}</div>"


@dataclass
class ModelsTab:
    table: Any
    path: Any
    name: Any
    button: Any
    msg: Any


def build() -> ModelsTab:
    table = gr.HTML(elem_id="fl-models-box")
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


def models_table(settings: Any) -> str:
    return table_html(model_rows(settings))


def register(settings: Any, path: str | None, name: str | None) -> tuple[str, Any]:
    try:
        m = api.register_local_model(settings, path or "", name)
    except SpecError as exc:
        return errors_html(exc.errors, "Not registered"), gr.skip()
    except PermissionError as exc:  # AUTH_REQUIRED: only admins register names
        return errors_html([{"field": "name", "message": str(exc)}], "Not registered"), gr.skip()
    return note_html(f"Registered <b>{esc(m['name'])}</b> ({esc(m['source'])})."), models_table(settings)
