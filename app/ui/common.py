"""Handlers shared by several tabs. Every handler takes `settings` first (bound with
functools.partial when wired) and otherwise only its Gradio inputs; nothing is kept between
calls (per-user state lives in gr.State)."""

from __future__ import annotations

import logging
from typing import Any

import gradio as gr

from app import api, auth, services
from app.ui.snippets import errors_html, esc, job_label, note_html, progress_html
from compute.contract.specs import SpecError

log = logging.getLogger(__name__)

TASKS = ["arithmetic", "arithmetic-add", "arithmetic-mul"]
MODEL_FIELDS = ("model", "base", "tuned", "teacher")  # fields that take a model reference
NONE_CHOICE = ("(none)", "")


def model_names(settings: Any) -> list[tuple[str, str]]:
    """(label, ref) for every model dropdown: zoo names, registered folders and trained models
    ('#6 train arith-base grpo masked' -> job:6), as any model field accepts them."""
    try:
        return [(m.get("label") or m["name"], m["ref"]) for m in api.all_models(settings)]
    except Exception:  # noqa: BLE001 - a broken zoo folder must not break the page
        log.warning("listing models failed", exc_info=True)
        return []


def model_dropdown(models: list[tuple[str, str]], value: Any, optional: bool) -> Any:
    """Fresh choices for one model dropdown, keeping what is selected; optional ones (teacher,
    tuned, a mask's model) start at '(none)', required ones at the first model."""
    chosen = chosen_model(models, value, optional)
    return gr.Dropdown(choices=[NONE_CHOICE, *models] if optional else models, value=chosen)


def chosen_model(models: list[tuple[str, str]], value: Any, optional: bool) -> Any:
    """What a model dropdown shows after a refresh: the selection, else '(none)' / the first."""
    if optional:
        return value or ""
    return value or (models[0][1] if models else None)


def job_choices(settings: Any, kind: str | None = None, succeeded_only: bool = False) -> list[tuple[str, str]]:
    jobs = services.list_jobs(settings, limit=100, kind=kind or None,
                              status="succeeded" if succeeded_only else None)
    return [(job_label(j), j["share_token"]) for j in jobs]


def ref_choices(settings: Any, kind: str) -> list[tuple[str, str]]:
    """'(none)' and the succeeded jobs of `kind` as job:N references."""
    jobs = services.list_jobs(settings, limit=100, kind=kind, status="succeeded")
    return [NONE_CHOICE] + [(job_label(j), f"job:{j['id']}") for j in jobs]


def do_submit(settings: Any, kind: str, data: dict[str, Any],
              confirm: bool = True) -> tuple[dict[str, Any] | None, str]:
    """Submit through the one validation path (services.submit); (job, message html). The
    message of a queued job is empty: its live status line says more (and never goes stale);
    a reused result says so, which stays true. A job above the confirmation threshold is
    app.limits.ConfirmationRequired (raised: the form shows its confirmation step)."""
    from app.limits import ConfirmationRequired

    try:
        job = services.submit(settings, kind, data, confirm=confirm)
    except ConfirmationRequired:
        raise
    except SpecError as exc:
        return None, errors_html(exc.errors)
    except Exception as exc:  # noqa: BLE001 - shown to the user, never a traceback
        return None, note_html(f"Could not submit: {esc(exc)}", "error")
    if job.get("reused"):
        return job, note_html(f"Job #{job['id']} is the stored result of an identical job (nothing recomputed).")
    return job, ""


def submitted_html(job: dict[str, Any] | None) -> str:
    """The live line of the last job submitted from the forms: its progress, and a link to it."""
    if job is None:
        return ""
    link = f"<a href='/?tab=result&r={esc(job['share_token'])}'>open the result</a>"
    return f"<div class='fl-submitted'><span>Last submitted:</span>{progress_html(job)}{link}</div>"


def submit_and_show(settings: Any, kind: str, data: dict[str, Any],
                    confirm: bool = True) -> tuple[Any, Any, Any, Any]:
    """Updates for (message, view token, tabs, submitted token): the new job is shown in the
    result tab, and followed by the live line above the forms. `confirm` False: a job above the
    confirmation threshold raises app.limits.ConfirmationRequired (the job forms' step)."""
    job, msg = do_submit(settings, kind, data, confirm)
    if job is None:
        return msg, gr.skip(), gr.skip(), gr.skip()
    return msg, job["share_token"], gr.Tabs(selected="result"), job["share_token"]


def who_am_i(settings: Any) -> tuple[str, Any]:
    """The signed-in user in the header; the owner filter for admins (app/auth/)."""
    user = auth.current_user(settings)
    return (auth.user_header_html(settings),
            gr.Dropdown(visible=settings.auth_required and user.is_admin))
