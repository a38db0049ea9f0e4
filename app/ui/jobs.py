"""Jobs tab: the user's jobs (admins: everyone's) with live status, and open / cancel / re-run
by id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from app import services
from app.ui.snippets import esc, jobs_table_html, note_html
from compute.jobs.registry import NAMES
from storage.models import JOB_STATUSES


@dataclass
class JobsTab:
    kind: Any
    status: Any
    owner: Any
    job_id: Any
    open: Any
    cancel: Any
    rerun: Any
    msg: Any
    table: Any


def build() -> JobsTab:
    with gr.Row():
        kind = gr.Dropdown([("all kinds", ""), *[(k, k) for k in NAMES]], value="", label="kind")
        status = gr.Dropdown([("any status", ""), *[(s, s) for s in JOB_STATUSES]], value="", label="status")
        owner = gr.Dropdown([("my jobs", "me"), ("all users", "all")], value="me", label="owner",
                            visible=False, elem_id="jobs-owner")
        job_id = gr.Number(None, label="job id", step=1)
        with gr.Column(min_width=120):
            open_ = gr.Button("Open", size="sm")
            cancel = gr.Button("Cancel", size="sm", variant="stop")
            rerun = gr.Button("Re-run", size="sm")
    msg = gr.HTML()
    table = gr.HTML(elem_id="fl-jobs", elem_classes=["fl-quiet"])
    return JobsTab(kind, status, owner, job_id, open_, cancel, rerun, msg, table)


# ---------------------------------------------------------------- handlers


def jobs_view(settings: Any, kind: str, status: str, last: str, owner: str = "me") -> tuple[Any, str]:
    """(table html or skip when unchanged, the html shown)."""
    jobs = services.list_jobs(settings, limit=50, kind=kind or None, status=status or None,
                              owner=owner or "me")  # my jobs; admins may pick all users
    out = jobs_table_html(jobs)
    return (gr.skip(), last) if out == last else (out, out)


def jobs_filtered(settings: Any, kind: str, status: str, owner: str = "me") -> tuple[Any, str]:
    """The table after a filter change (always redrawn)."""
    return jobs_view(settings, kind, status, "", owner)


def job_action(settings: Any, action: str, job_id: Any) -> tuple[str, Any, Any]:
    """Open / cancel / re-run job `job_id`: (message, view token, tabs)."""
    if job_id is None:
        return note_html("Give a job id.", "error"), gr.skip(), gr.skip()
    if not float(job_id).is_integer():  # no rounding: 1.5 is not job 2
        return note_html(f"job id: got {job_id}; give a whole number", "error"), gr.skip(), gr.skip()
    job_id = int(job_id)
    try:
        if action == "cancel":
            job = services.cancel(settings, job_id)
            return note_html(f"Cancel requested for job #{job_id} (now {esc(job['status'])})."), gr.skip(), gr.skip()
        if action == "rerun":
            job = services.rerun(settings, job_id)
            return note_html(f"Re-running job #{job_id} as #{job['id']}."), gr.skip(), gr.skip()
        found = services.get_job(settings, job_id)
        if found is None:
            raise LookupError(f"job: no job with id {job_id}")
        return note_html(f"Showing job #{job_id}."), found["share_token"], gr.Tabs(selected="result")
    except (LookupError, ValueError, RuntimeError) as exc:
        return note_html(esc(exc), "error"), gr.skip(), gr.skip()
