"""Token explorer tab: a context -> the top next tokens, their parameter-sensitivity similarity
and share of the Fisher (a `tokens` job), drawn from its stored figures; clicking a token extends
the context and runs again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from app import plots, render, services
from app.ui import forms
from app.ui.common import do_submit
from app.ui.figs import figures_box, figures_html
from app.ui.formtab import field_input
from app.ui.result import job_by_token, stored_payload
from app.ui.snippets import errors_html, esc, progress_html
from compute.contract.specs import SpecError
from compute.jobs.tokens import KIND

TOKENS = KIND.name  # the job kind this tab submits
FIELDS = ("model", "context", "top_k", "layer", "random_k")


@dataclass
class TokensTab:
    inputs: list[Any]  # FIELDS, in order
    model: Any
    context: Any
    button: Any
    msg: Any
    progress: Any
    choice: Any
    figs: Any


def build() -> TokensTab:
    gr.Markdown("Type a context: the worker computes the top next tokens, the similarity of "
                "their parameter-sensitivity vectors, and each token's share of the Fisher "
                "(random tokens for contrast). Click a token to extend the context.")
    with gr.Row():
        inputs = [field_input(TOKENS, n, value="12+34=" if n == "context" else None) for n in FIELDS]
    button = gr.Button("Explore", variant="primary", elem_id="tokens-submit")
    msg = gr.HTML()
    progress = gr.HTML(elem_id="tokens-progress", elem_classes=["fl-quiet"])
    choice = gr.Radio(label="next tokens: click one to extend the context", visible=False,
                      elem_id="tokens-choice")
    figs = figures_box("tokens-figs")
    return TokensTab(inputs, inputs[0], inputs[1], button, msg, progress, choice, figs)


def poll_outputs(t: TokensTab, sig: Any) -> list[Any]:
    return [t.progress, t.choice, t.figs, sig]


# ---------------------------------------------------------------- handlers


def run_tokens(settings: Any, *values: Any) -> tuple[str, Any, str]:
    """Updates for (message, token job's share token, its poll signature)."""
    try:
        data = forms.form_data(TOKENS, list(FIELDS), values)
    except SpecError as exc:
        return errors_html(exc.errors), gr.skip(), ""
    context = values[FIELDS.index("context")]
    if isinstance(context, str) and context:
        data["context"] = context  # keep leading/trailing spaces: they are tokens
    job, msg = do_submit(settings, TOKENS, data)
    if job is None:
        return msg, gr.skip(), ""
    return msg, job["share_token"], ""


def poll_tokens(settings: Any, token: str, sig: str) -> list[Any]:
    """Updates for `poll_outputs(...)`: progress, the clickable tokens, the figures, sig."""
    meta = job_by_token(settings, token) if token else None
    if meta is None:
        return [gr.skip()] * 4
    new_sig = f"{token}:{meta['status']}:{meta.get('progress')}"
    if new_sig == sig:
        return [gr.skip()] * 4
    if meta["status"] != "succeeded":
        return [progress_html(meta), gr.skip(), gr.skip(), new_sig]
    res = services.result_by_token(settings, token)
    payload = stored_payload(settings, meta) or {}
    choices = plots.token_choices(res) if res else []
    link = services.share_url(settings, token, None)
    share = (f"<p class='fl-meta' id='tokens-share'>Share this result: <a href='{esc(link)}' target='_blank'>"
             f"{esc(link)}</a></p>")
    return [progress_html(meta) + share + render.downloads_html(meta, payload.get("artifacts") or []),
            gr.Radio(choices=choices, value=None, visible=bool(choices)),
            f"<div class='fl-result'>{render.key_section(payload.get('numbers') or {})}"
            f"{figures_html(payload.get('figures') or [], 'tokens-fig')}</div>", new_sig]


def extend_context(context: str | None, token: str | None) -> Any:
    if token is None:
        return gr.skip()
    return (context or "") + str(token)
