"""Result tab: one job's progress, spec, share link, downloads and its STORED figures and tables
(app/figures/store.py: built once when first viewed, the same file the share page draws)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import gradio as gr

from app import auth, services
from app.figures.store import store_for
from app.share import key_section
from app.ui.common import job_choices
from app.ui.figs import figures_box, figures_html
from app.ui.snippets import (
    downloads_html,
    esc,
    not_found_html,
    note_html,
    progress_html,
    spec_html,
    tables_html,
)
from storage.models import FINAL_STATUSES

MAX_FIGS = 8  # figures shown in the result view (the share page shows them all)


@dataclass
class ResultTab:
    pick_row: Any
    pick: Any
    refresh: Any
    progress: Any
    spec: Any
    share: Any
    copy: Any
    reshare: Any
    cancel: Any
    rerun: Any
    downloads: Any
    note: Any
    figs: Any
    tables: Any


def build() -> ResultTab:
    """The result tab's components (inside its gr.Tab)."""
    with gr.Row(visible=True) as pick_row:
        pick = gr.Dropdown(label="result", choices=[], allow_custom_value=True, scale=4,
                           elem_id="result-pick", elem_classes=["fl-quiet"])
        refresh = gr.Button("Refresh list", size="sm", scale=1)
    progress = gr.HTML(progress_html(None), elem_id="fl-progress", elem_classes=["fl-quiet"])
    spec = gr.HTML(elem_classes=["fl-quiet"])
    with gr.Row():
        share = gr.Textbox(label="share link (anyone with it sees this result, read-only)",
                           interactive=False, buttons=["copy"], elem_id="fl-share-url", scale=5,
                           elem_classes=["fl-quiet"])
        copy = gr.Button("Copy link", size="sm", elem_id="fl-copy", scale=1)
        reshare = gr.Button("New link", size="sm", elem_id="fl-reshare", scale=1)
        cancel = gr.Button("Cancel job", size="sm", variant="stop", visible=False, scale=1)
        rerun = gr.Button("Re-run", size="sm", visible=False, scale=1)
    downloads = gr.HTML(visible=False, elem_classes=["fl-quiet"])
    note = gr.HTML()
    figs = figures_box("fl-figs", elem_classes=["fl-quiet"])
    tables = gr.HTML(elem_id="fl-tables", elem_classes=["fl-quiet"])
    return ResultTab(pick_row, pick, refresh, progress, spec, share, copy, reshare, cancel, rerun,
                     downloads, note, figs, tables)


def outputs(t: ResultTab, url_box: Any, sig: Any) -> list[Any]:
    """The components `result_view` updates, in its order."""
    return [t.progress, t.spec, t.share, t.downloads, t.cancel, t.rerun, t.note, t.figs, t.tables,
            url_box, sig, t.pick]


N_OUT = 12


# ---------------------------------------------------------------- handlers


def job_by_token(settings: Any, token: str) -> dict[str, Any] | None:
    """The job row of a share token (no result rows), if this user may read it."""
    from storage import repo

    with services.sessions(settings)() as s:
        job = repo.get_job_by_token(session=s, token=token)
        ok = job is not None and auth.can_read_result(settings, job)  # link off: owner only
        return repo.job_dict(job) if job is not None and ok else None


def stored_payload(settings: Any, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The stored figures, tables and key numbers of a succeeded job (built on first view)."""
    token = meta["share_token"]
    return store_for(settings).get(meta["id"], meta.get("finished_at"),
                                   lambda: services.result_by_token(settings, token))


def _missing(token: str, sig: str, force: bool) -> list[Any]:
    new_sig = f"{token}:missing"
    if new_sig == sig and not force:
        return [gr.skip()] * N_OUT
    return [not_found_html(token), "", "", gr.HTML(visible=False), gr.Button(visible=False),
            gr.Button(visible=False), "", "", "", gr.skip(), new_sig, gr.skip()]


def _figures(payload: dict[str, Any] | None) -> tuple[str, str, str]:
    """(key numbers + figures html, tables html, note) of a stored payload: the numbers a
    researcher came for first, as on the share page."""
    figures = (payload or {}).get("figures") or []
    tables = (payload or {}).get("tables") or []
    note = "" if figures or tables else note_html("This result has no figures or tables.")
    numbers = key_section((payload or {}).get("numbers") or {}) if payload else ""
    return numbers + figures_html(figures[:MAX_FIGS], "fl-fig"), tables_html(tables), note


def result_view(settings: Any, token: str, sig: str, readonly: bool, force: bool = False) -> list[Any]:
    """Updates for `outputs(...)`; gr.skip() everywhere when nothing changed since `sig`
    (`force`: redraw anyway)."""
    if not token:
        return [gr.skip()] * N_OUT
    meta = job_by_token(settings, token)  # light: the job row only
    if meta is None:
        return _missing(token, sig, force)
    status = meta["status"]
    final = status in FINAL_STATUSES
    new_sig = f"{token}:{status}:{meta.get('progress')}:{meta.get('message')}"
    if new_sig == sig and not force:
        return [gr.skip()] * N_OUT
    payload = stored_payload(settings, meta) if status == "succeeded" else None
    ok = status == "succeeded"
    head = [progress_html(meta), spec_html(meta), services.share_url(settings, token),
            gr.HTML(value=downloads_html({"job": meta, "artifacts": (payload or {}).get("artifacts") or []})
                    if ok else "", visible=ok),
            gr.Button(visible=not readonly and not final), gr.Button(visible=not readonly and final)]
    path = f"/r/{token}" if readonly else "/?" + urlencode({"tab": "result", "r": token})
    status_changed = not sig.startswith(f"{token}:{status}:")
    pick = result_choices(settings, token) if status_changed and not readonly else gr.skip()
    was_final = sig.startswith(f"{token}:") and sig.split(":")[1] in FINAL_STATUSES
    if not final:  # still running: progress only; figures appear once the result is stored
        return [*head, gr.skip(), "", "", path, new_sig, pick]
    if was_final and not force:
        return [*head, gr.skip(), gr.skip(), gr.skip(), path, new_sig, pick]
    figs, tables, note = _figures(payload) if ok else ("", "", "")
    return [*head, note, figs, tables, path, new_sig, pick]


def result_choices(settings: Any, token: str) -> Any:
    choices = job_choices(settings)
    return gr.Dropdown(choices=choices, value=token if token in {c[1] for c in choices} else None)


def pick_view(settings: Any, token: str | None, readonly: bool) -> list[Any]:
    """A result picked in the dropdown: the new view token and its view in one round trip (the
    token's change event then finds the view already drawn)."""
    return [token or "", *result_view(settings, token or "", "", readonly, force=True)]


def cancel_current(settings: Any, token: str) -> str:
    meta = job_by_token(settings, token) if token else None
    if meta is None:
        return note_html("no job selected", "error")
    try:
        services.cancel(settings, meta["id"])
    except LookupError as exc:
        return note_html(esc(exc), "error")
    return note_html(f"Cancel requested for job #{meta['id']}.")


def reshare_current(settings: Any, token: str) -> tuple[str, Any]:
    """The owner's "new share link": a new token; the old link answers 404 from now on."""
    meta = job_by_token(settings, token) if token else None
    if meta is None:
        return note_html("no job selected", "error"), gr.skip()
    try:
        job = services.set_sharing(settings, meta["id"], "new")
    except (LookupError, ValueError) as exc:
        return note_html(esc(exc), "error"), gr.skip()
    return note_html("New share link: the old one no longer opens this result."), job["share_token"]


def rerun_current(settings: Any, token: str) -> tuple[str, Any]:
    meta = job_by_token(settings, token) if token else None
    if meta is None:
        return note_html("no job selected", "error"), gr.skip()
    try:
        job = services.rerun(settings, meta["id"])
    except (LookupError, ValueError, RuntimeError) as exc:
        return note_html(esc(exc), "error"), gr.skip()
    return note_html(f"Re-running as job #{job['id']}."), job["share_token"]
