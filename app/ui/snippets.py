"""HTML snippets of the explorer (pure functions of their inputs: tested alone)."""

from __future__ import annotations

import html
from typing import Any
from urllib.parse import urlencode

from app import services


def esc(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def job_model(job: dict[str, Any]) -> str:
    spec = job.get("spec") or {}
    for k in ("model", "base", "fisher"):
        if spec.get(k):
            return str(spec[k])
    return ""


def job_label(job: dict[str, Any]) -> str:
    return f"#{job['id']} {job['kind']} {job_model(job)} ({job['status']})".replace("  ", " ")


def progress_html(job: dict[str, Any] | None) -> str:
    """A progress bar with data-status / data-progress attributes (tests wait on them)."""
    if job is None:
        return "<div class='fl-progress' data-status='none'><div class='fl-label'>no job selected</div></div>"
    status = job.get("status", "queued")
    frac = float(job.get("progress") or 0.0)
    if status == "succeeded":
        frac = 1.0
    pct = max(0.0, min(100.0, 100.0 * frac))
    msg = services.public_message(job.get("message"))  # one line; the traceback is operator-only
    out = (
        f"<div class='fl-progress' data-status='{esc(status)}' data-progress='{frac:.4f}' "
        f"data-job='{esc(job.get('id'))}'>"
        f"<div class='fl-bar'><div class='fl-fill fl-{esc(status)}' style='width:{pct:.1f}%'></div></div>"
        f"<div class='fl-label'><b>#{esc(job.get('id'))} {esc(job.get('kind'))}</b> "
        f"<span class='fl-status fl-{esc(status)}'>{esc(status)}</span> {pct:.0f}% &middot; {esc(msg)}</div>"
    )
    return out + "</div>"


def errors_html(errors: list[dict[str, str]], title: str = "Not submitted (nothing was queued)") -> str:
    items = "".join(f"<li><b>{esc(e.get('field'))}</b>: {esc(e.get('message'))}</li>" for e in errors)
    return f"<div class='fl-errors' role='alert'><b>{esc(title)}</b>:<ul>{items}</ul></div>"


def note_html(text: str, kind: str = "ok") -> str:
    return f"<div class='fl-note fl-note-{esc(kind)}'>{text}</div>"


def jobs_table_html(jobs: list[dict[str, Any]]) -> str:
    if not jobs:
        return "<div class='fl-note'>No jobs yet. Submit one in <b>New job</b>.</div>"
    rows = []
    for j in jobs:
        frac = 1.0 if j["status"] == "succeeded" else float(j.get("progress") or 0.0)
        rows.append(
            f"<tr data-job='{j['id']}' data-status='{esc(j['status'])}'>"
            f"<td>{j['id']}</td><td>{esc(j['kind'])}</td><td>{esc(job_model(j))}</td>"
            f"<td><span class='fl-status fl-{esc(j['status'])}'>{esc(j['status'])}</span></td>"
            f"<td><div class='fl-bar fl-bar-sm'><div class='fl-fill fl-{esc(j['status'])}' "
            f"style='width:{100 * frac:.0f}%'></div></div></td>"
            f"<td class='fl-msg'>{esc(j.get('message'))}</td><td>{esc((j.get('created_at') or '')[:19])}</td>"
            f"<td><a href='/?{urlencode({'tab': 'result', 'r': j['share_token']})}'>open</a> &middot; "
            f"<a href='/r/{esc(j['share_token'])}' target='_blank'>share</a></td></tr>"
        )
    return ("<table class='fl-jobs'><thead><tr><th>id</th><th>kind</th><th>model</th><th>status</th>"
            "<th>progress</th><th>message</th><th>created (UTC)</th><th></th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def downloads_html(result: dict[str, Any]) -> str:
    job = result.get("job") or {}
    token = esc(job.get("share_token"))
    links = [f"<a href='/api/results/{token}/stats.csv' download>stats CSV</a>",
             f"<a href='/api/results/{token}/stats.json' download>stats JSON</a>",
             f"<a href='/api/results/{token}' target='_blank'>raw JSON</a>"]
    for a in result.get("artifacts") or []:
        ext = "zip" if a.get("is_dir") else "safetensors"
        size = a.get("bytes") or 0
        links.append(f"<a href='/api/results/{token}/artifacts/{esc(a['kind'])}' download>"
                     f"{esc(a['kind'])} ({ext}, {size / 1e6:.2f} MB)</a>")
    return "<div class='fl-downloads'>Downloads: " + " &middot; ".join(links) + "</div>"


def spec_html(job: dict[str, Any]) -> str:
    spec = job.get("spec") or {}
    cells = " ".join(f"<span class='fl-kv'><b>{esc(k)}</b>={esc('none' if v is None else v)}</span>"
                     for k, v in spec.items())
    when = esc((job.get("finished_at") or job.get("created_at") or "")[:19])
    return f"<div class='fl-spec'><b>{esc(job.get('kind'))}</b> job #{esc(job.get('id'))} ({when} UTC): {cells}</div>"


def not_found_html(token: str) -> str:
    return note_html(f"No result found for <code>{esc(token)}</code>: the link may be mistyped, or "
                     "the result was deleted.", "error")


def tables_html(tables: list[dict[str, Any]]) -> str:
    """Stored tables ({title, headers, rows}) as plain HTML tables (one component, no grid widget
    to mount per table)."""
    out = []
    for t in tables:
        head = "".join(f"<th>{esc(h)}</th>" for h in t.get("headers") or [])
        rows = "".join("<tr>" + "".join(f"<td>{esc(_cell(v))}</td>" for v in row) + "</tr>"
                       for row in t.get("rows") or [])
        out.append(f"<div class='fl-table'><div class='fl-table-title'>{esc(t.get('title'))}</div>"
                   f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>")
    return "".join(out)


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v
