"""Result tab: one job's progress, share link and its STORED result, drawn by app/render.py (the
share page's renderer: key numbers first, warnings as banners, figures, tables, downloads,
settings) from app/figures/store.py's payload (built once when first viewed, the same file the
share page draws)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import gradio as gr

from app import auth, render, services
from app.figures.store import store_for
from app.ui.common import job_choices, submitted_html
from app.ui.figs import figures_box
from app.ui.snippets import esc, not_found_html, note_html, progress_html
from storage.models import FINAL_STATUSES

MAX_FIGS = 8  # figures shown in the result view (the share page shows them all)


@dataclass
class ResultTab:
    pick_row: Any
    pick: Any
    refresh: Any
    progress: Any
    share: Any
    copy: Any
    reshare: Any
    cancel: Any
    rerun: Any
    note: Any
    view: Any


def build() -> ResultTab:
    """The result tab's components (inside its gr.Tab)."""
    with gr.Row(visible=True, elem_id="result-pick-row") as pick_row:
        pick = gr.Dropdown(label="result", choices=[], allow_custom_value=True, scale=5,
                           elem_id="result-pick", elem_classes=["fl-quiet"])
        refresh = gr.Button("Refresh list", size="sm", scale=1, min_width=110)
    progress = gr.HTML(progress_html(None), elem_id="fl-progress", elem_classes=["fl-quiet"])
    with gr.Row(elem_classes=["fl-share-row"]):
        share = gr.Textbox(label="share link (anyone with it sees this result, read-only)",
                           interactive=False, buttons=["copy"], elem_id="fl-share-url", scale=5,
                           elem_classes=["fl-quiet"])
        copy = gr.Button("Copy link", size="sm", elem_id="fl-copy", scale=1, min_width=100)
        reshare = gr.Button("New link", size="sm", elem_id="fl-reshare", scale=1, min_width=100)
        cancel = gr.Button("Cancel job", size="sm", variant="stop", visible=False, scale=1, min_width=100)
        rerun = gr.Button("Re-run", size="sm", visible=False, scale=1, min_width=100)
    note = gr.HTML(visible=False)
    view = figures_box("fl-view", elem_classes=["fl-quiet"])
    return ResultTab(pick_row, pick, refresh, progress, share, copy, reshare, cancel, rerun, note, view)


def outputs(t: ResultTab, url_box: Any, sig: Any) -> list[Any]:
    """The components `result_view` updates, in its order."""
    return [t.progress, t.share, t.cancel, t.rerun, t.note, t.view, url_box, sig, t.pick]


N_OUT = 9
VIEW = 5  # index of the result view in `outputs(...)`


# ---------------------------------------------------------------- handlers


def job_by_token(settings: Any, token: str) -> dict[str, Any] | None:
    """The job row of a share token (no result rows), if this user may read it; its spec names
    references given by server path by label, as the share page does (app/figures/public.py):
    this tab also shows share links (`/?view=<token>`)."""
    from app.figures.public import public_job
    from storage import repo

    with services.sessions(settings)() as s:
        job = repo.get_job_by_token(session=s, token=token)
        ok = job is not None and auth.can_read_result(settings, job)  # link off: owner only
        return public_job(repo.job_dict(job), job.refs) if job is not None and ok else None


def stored_payload(settings: Any, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The stored figures, tables and key numbers of a succeeded job (built on first view)."""
    token = meta["share_token"]
    return store_for(settings).get(meta["id"], meta.get("finished_at"),
                                   lambda: services.result_by_token(settings, token))


def _missing(token: str, sig: str, force: bool) -> list[Any]:
    new_sig = f"{token}:missing"
    if new_sig == sig and not force:
        return [gr.skip()] * N_OUT
    return [not_found_html(token), "", gr.Button(visible=False), gr.Button(visible=False), _note(""), "",
            gr.skip(), new_sig, gr.skip()]


def _note(text: str) -> Any:
    """The note line under the share link, hidden when empty (no blank gap above the result)."""
    return gr.HTML(value=text, visible=bool(text))


def view_html(payload: dict[str, Any] | None, meta: dict[str, Any]) -> str:
    """The result as the share page shows it (app/render.py), the first MAX_FIGS figures."""
    if payload is None:
        return note_html("The rows of this result are gone from the database.", "error")
    return render.result_html(payload, meta, max_figures=MAX_FIGS)


def result_view(settings: Any, token: str, sig: str, readonly: bool, force: bool = False,
                base_url: str | None = None) -> list[Any]:
    """Updates for `outputs(...)`; gr.skip() everywhere when nothing changed since `sig`
    (`force`: redraw anyway). `base_url`: where the browser reached us (share links use it when
    PUBLIC_URL is not set)."""
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
    link = services.share_url(settings, token, base_url) if meta.get("shared", True) else SHARE_OFF
    head = [progress_html(meta), link,
            gr.Button(visible=not readonly and not final), gr.Button(visible=not readonly and final)]
    path = f"/r/{token}" if readonly else "/?" + urlencode({"tab": "result", "r": token})
    status_changed = not sig.startswith(f"{token}:{status}:")
    pick = result_choices(settings, token) if status_changed and not readonly else gr.skip()
    was_final = sig.startswith(f"{token}:") and sig.split(":")[1] in FINAL_STATUSES
    if not final:  # still running: progress only; the result appears once it is stored
        waiting = note_html("The result appears here when the job has finished.") if status_changed else gr.skip()
        return [*head, _note(""), waiting, path, new_sig, pick]
    if was_final and not force:
        return [*head, gr.skip(), gr.skip(), path, new_sig, pick]
    if status != "succeeded":
        return [*head, _note(""), "", path, new_sig, pick]
    return [*head, _note(""), view_html(stored_payload(settings, meta), meta), path, new_sig, pick]


def submitted_view(settings: Any, token: str, sig: str) -> list[Any]:
    """Updates for (the live line of the last submitted job, its signature): redrawn when the
    job's status, progress or message changed, so "queued" never outlives the job."""
    meta = job_by_token(settings, token) if token else None
    if meta is None:
        return [gr.skip(), sig]
    new_sig = f"{token}:{meta['status']}:{meta.get('progress')}:{meta.get('message')}"
    if new_sig == sig:
        return [gr.skip(), sig]
    return [submitted_html(meta), new_sig]


def base_of(request: gr.Request | None) -> str | None:
    """scheme://host the browser reached us by (share links when PUBLIC_URL is not set)."""
    if request is None:
        return None
    try:
        headers = {str(k).lower(): str(v) for k, v in dict(request.headers).items()}
        url = str(getattr(request, "url", "") or "")
    except Exception:  # noqa: BLE001 - no headers (a direct call): the configured PUBLIC_URL
        return None
    return services.base_url(headers, "https" if url.startswith("https:") else "http")


def follow(settings: Any, token: str, sig: str, readonly: bool, request: gr.Request) -> list[Any]:
    """The view token changed (a submitted job, the picker, re-run, new link): its view, unless
    already shown."""
    return result_view(settings, token, sig, readonly, base_url=base_of(request))


def result_choices(settings: Any, token: str | None = None) -> Any:
    """The picker: every job this user may see, newest first, the shown one selected."""
    choices = job_choices(settings)
    return gr.Dropdown(choices=choices, value=token if token in {c[1] for c in choices} else None)


def pick_view(settings: Any, token: str | None, readonly: bool, request: gr.Request) -> list[Any]:
    """A result picked in the dropdown: the new view token and its view in one round trip (the
    token's change event then finds the view already drawn)."""
    return [token or "", *result_view(settings, token or "", "", readonly, force=True,
                                      base_url=base_of(request))]


SHARE_OFF = "share link off (a shared server's default): press New link to turn one on"
READONLY = "this is the read-only view of a share link: only the result's owner can change it"


def cancel_current(settings: Any, token: str, readonly: bool = False) -> Any:
    if readonly:
        return _note(note_html(READONLY, "error"))
    meta = job_by_token(settings, token) if token else None
    if meta is None:
        return _note(note_html("no job selected", "error"))
    try:
        services.cancel(settings, meta["id"])
    except LookupError as exc:
        return _note(note_html(esc(exc), "error"))
    return _note(note_html(f"Cancel requested for job #{meta['id']}."))


def reshare_current(settings: Any, token: str, readonly: bool = False) -> tuple[Any, Any]:
    """The owner's "new share link": a new token; the old link answers 404 from now on. Never
    from the read-only view of a share link (`readonly`): a link's reader cannot rotate it."""
    if readonly:
        return _note(note_html(READONLY, "error")), gr.skip()
    meta = job_by_token(settings, token) if token else None
    if meta is None:
        return _note(note_html("no job selected", "error")), gr.skip()
    try:
        job = services.set_sharing(settings, meta["id"], "new")
    except (LookupError, ValueError) as exc:
        return _note(note_html(esc(exc), "error")), gr.skip()
    return _note(note_html("New share link: the old one no longer opens this result.")), job["share_token"]


def rerun_current(settings: Any, token: str, readonly: bool = False) -> tuple[Any, Any]:
    if readonly:
        return _note(note_html(READONLY, "error")), gr.skip()
    meta = job_by_token(settings, token) if token else None
    if meta is None:
        return _note(note_html("no job selected", "error")), gr.skip()
    try:
        job = services.rerun(settings, meta["id"])
    except (LookupError, ValueError, RuntimeError) as exc:
        return _note(note_html(esc(exc), "error")), gr.skip()
    return _note(note_html(f"Re-running as job #{job['id']}.")), job["share_token"]
