"""Jobs tab: the user's jobs (admins: everyone's) with live status, open / cancel / re-run by id,
and the live workers' devices (what a queued job is checked against and priced by)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from app import services
from app.limits import size_text
from app.services.workers import rate_text
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
    workers: Any
    workers_refresh: Any


def build() -> JobsTab:
    with gr.Row():
        kind = gr.Dropdown([("all kinds", ""), *[(k, k) for k in NAMES]], value="", label="kind")
        status = gr.Dropdown([("any status", ""), *[(s, s) for s in JOB_STATUSES]], value="", label="status")
        owner = gr.Dropdown([("my jobs", "me"), ("all users", "all")], value="me", label="owner",
                            visible=False, elem_id="jobs-owner")
        # text, not gr.Number: a Number shows 0 before anything is typed, and job 0 does not exist
        job_id = gr.Textbox("", label="job id", placeholder="an id from the table, e.g. 12", elem_id="jobs-id")
        with gr.Column(min_width=120):
            open_ = gr.Button("Open", size="sm")
            cancel = gr.Button("Cancel", size="sm", variant="stop")
            rerun = gr.Button("Re-run", size="sm")
    msg = gr.HTML()
    table = gr.HTML(elem_id="fl-jobs", elem_classes=["fl-quiet"])
    with gr.Accordion("Workers: where queued jobs run", open=True):
        workers = gr.HTML(elem_id="fl-workers")
        workers_refresh = gr.Button("Refresh workers", size="sm", elem_id="fl-workers-refresh")
    return JobsTab(kind, status, owner, job_id, open_, cancel, rerun, msg, table, workers, workers_refresh)


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
    text = "" if job_id is None else str(job_id).strip().lstrip("#")
    if not text:
        return note_html("Give a job id.", "error"), gr.skip(), gr.skip()
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value.is_integer() or value < 1:  # no rounding: 1.5 is not job 2
        return note_html(f"job id: got {esc(job_id)}; give a whole number from the table (1 or more)",
                         "error"), gr.skip(), gr.skip()
    job_id = int(value)
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


def workers_view(settings: Any) -> str:
    """The live workers (services.workers: GET /api/workers) as a table, then what a queued job
    is checked against and priced by."""
    out = services.workers(settings)

    def size(n: Any) -> str:
        return "&ndash;" if n is None else esc(size_text(float(n)))

    rows = []
    for w in out["workers"]:
        cal = esc(rate_text(w["calibration"]).removesuffix(" per token-pass"))
        rows.append(f"<tr data-worker='{esc(w['name'])}'><td>{esc(w['name'])}</td><td>{esc(w['device'])}</td>"
                    f"<td>{esc(w['device_name'] or '')}</td><td>{size(w['free_bytes'])}</td>"
                    f"<td>{size(w['total_bytes'])}</td><td>{size(w['host_free_bytes'])}</td><td>{cal}</td>"
                    f"<td>{w['seen_seconds_ago']:.0f} s ago</td></tr>")
    table = ("<div class='fl-scroll'><table class='fl-jobs fl-workers'><thead><tr><th>worker</th><th>device</th>"
             "<th>name</th><th>free for a job</th><th>total</th><th>host RAM free</th>"
             "<th>seconds per token-pass</th><th>seen</th></tr></thead><tbody>" + "".join(rows)
             + "</tbody></table></div>") if rows else ""
    checked = out["checked_against"]
    lines = [f"A queued job on device <code>{esc(spec)}</code> is checked against "
             f"<b>{size(fig['free_bytes'])}</b> ({esc(fig['where'])})." for spec, fig in checked.items()]
    p = out["priced_by"]
    lines.append("Estimates are priced by " + ("THROUGHPUT (one constant)." if p is None else
                 f"{esc(rate_text(p))} ({esc(p['where'])})."))
    return table + note_html(esc(out["note"]) + ".", "warn" if not rows else "ok") + \
        "<p class='fl-meta'>" + "<br>".join(lines) + "</p>"
