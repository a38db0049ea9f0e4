"""Small HTML snippets of the explorer (pure functions of their inputs: tested alone). The result
itself (key numbers, figures, tables, downloads, settings, progress bar) is app/render.py's, the
same renderer as the share page."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from app import render, services
from app.render import esc, kind_title

__all__ = ["esc", "errors_html", "job_label", "job_model", "jobs_table_html", "not_found_html", "note_html",
           "progress_html", "spec_html"]


def job_model(job: dict[str, Any]) -> str:
    spec = job.get("spec") or {}
    for k in ("model", "base", "fisher"):
        if spec.get(k):
            return str(spec[k])
    return ""


def _pct(v: Any) -> str:
    try:
        f = 100 * float(v)
    except (TypeError, ValueError):
        return str(v)
    return f"{f:.3g}%"


def job_about(job: dict[str, Any]) -> str:
    """What a job is about, in a few words, from the spec fields it has (no list of kinds):
    'arith-base', 'fisher selector, 5% of job:3', 'arith-base vs job:6', 'arith-base grpo, mask
    job:4', "arith-base '12+34='"."""
    spec = job.get("spec") or {}
    bits: list[str] = []
    if spec.get("base") and spec.get("tuned"):
        bits.append(f"{spec['base']} vs {spec['tuned']}")
    elif spec.get("model"):
        bits.append(str(spec["model"]))
    if spec.get("select") and spec.get("density") is not None:  # a mask
        bits.append(f"{spec['select']} selector, {_pct(spec['density'])}"
                    + (f" of {spec['fisher']}" if spec.get("fisher") else ""))
    if spec.get("algo"):
        bits.append(str(spec["algo"]))
    if spec.get("mask"):
        bits.append(f"mask {spec['mask']}")
    elif spec.get("mask_select"):
        bits.append(f"{spec['mask_select']} mask {_pct(spec.get('mask_density'))}")
    if spec.get("context"):
        bits.append(repr(str(spec["context"])[:30]))
    return " ".join(bits) if bits else job_model(job)


def job_label(job: dict[str, Any]) -> str:
    """'#4 Mask: fisher selector, 5% of job:3 (succeeded)'."""
    return f"#{job['id']} {kind_title(job['kind'])}: {job_about(job)} ({job['status']})"


def progress_html(job: dict[str, Any] | None) -> str:
    """The job's progress bar and one-line message (the traceback is operator-only)."""
    return render.progress_html(job, services.public_message(job.get("message")) if job else "")


def errors_html(errors: list[dict[str, str]], title: str = "Not submitted (nothing was queued)") -> str:
    items = "".join(f"<li><b>{esc(e.get('field'))}</b>: {esc(e.get('message'))}</li>" for e in errors)
    return f"<div class='fl-errors' role='alert'><b>{esc(title)}</b>:<ul>{items}</ul></div>"


def note_html(text: str, kind: str = "ok") -> str:
    return f"<div class='fl-note fl-note-{esc(kind)}'>{text}</div>"


def _when(v: Any) -> Any:
    from datetime import UTC, datetime

    if not v:
        return None
    try:
        t = datetime.fromisoformat(str(v).replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def span_text(seconds: float) -> str:
    """'42 s', '3 min 5 s', '2 h 4 min'."""
    s = max(0, int(round(seconds)))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {(s % 3600) // 60} min"


def duration_html(job: dict[str, Any], now: Any = None) -> str:
    """How long a job took (finished), has run so far and its ETA (running: the time left if it
    keeps its average pace, elapsed x (1 - progress) / progress; shown from 5% progress on), or
    has waited (queued)."""
    from datetime import UTC, datetime

    now = now or datetime.now(UTC)
    started, finished, created = _when(job.get("started_at")), _when(job.get("finished_at")), _when(job.get("created_at"))
    status = job.get("status")
    if finished and started:
        return span_text((finished - started).total_seconds())
    if status == "running" and started:
        elapsed = (now - started).total_seconds()
        frac = float(job.get("progress") or 0.0)
        eta = f", about {span_text(elapsed * (1 - frac) / frac)} left" if 0.05 <= frac < 1 else ""
        return f"{span_text(elapsed)} so far{eta}"
    if status == "queued" and created:
        return f"waiting {span_text((now - created).total_seconds())}"
    return ""


def jobs_table_html(jobs: list[dict[str, Any]]) -> str:
    if not jobs:
        return "<div class='fl-note'>No jobs yet. Submit one in <b>New job</b>.</div>"
    rows = []
    for j in jobs:
        frac = 1.0 if j["status"] == "succeeded" else float(j.get("progress") or 0.0)
        rows.append(
            f"<tr data-job='{j['id']}' data-status='{esc(j['status'])}'>"
            f"<td>{j['id']}</td><td>{esc(kind_title(j['kind']))}</td><td>{esc(job_about(j))}</td>"
            f"<td><span class='fl-status fl-{esc(j['status'])}'>{esc(j['status'])}</span></td>"
            f"<td><div class='fl-bar fl-bar-sm'><div class='fl-fill fl-{esc(j['status'])}' "
            f"style='width:{100 * frac:.0f}%'></div></div></td>"
            f"<td class='fl-msg' title='{esc(services.public_message(j.get('message')))}'>"
            f"{esc(services.public_message(j.get('message')))}</td><td class='fl-duration'>{esc(duration_html(j))}</td>"
            f"<td>{esc((j.get('created_at') or '')[:19])}</td>"
            f"<td><a href='/?{urlencode({'tab': 'result', 'r': j['share_token']})}'>open</a> &middot; "
            f"<a href='/r/{esc(j['share_token'])}' target='_blank'>share</a></td></tr>"
        )
    return ("<div class='fl-scroll'><table class='fl-jobs'><thead><tr><th>id</th><th>kind</th><th>about</th>"
            "<th>status</th><th>progress</th><th>message</th><th>duration</th><th>created (UTC)</th><th></th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table></div>")


def spec_html(job: dict[str, Any]) -> str:
    """One line: what the job is (kind, id, what it is about, when)."""
    return render.meta_line(job).replace("<p class='fl-meta'>", f"<p class='fl-meta'><b>{esc(render.title(job))}</b>: ", 1)


def not_found_html(token: str) -> str:
    return note_html(f"No result found for <code>{esc(token)}</code>: the link may be mistyped, or "
                     "the result was deleted.", "error")
