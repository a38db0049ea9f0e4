"""Jobs as the caller may see them: submit (validate, reuse, queue), list, cancel, rerun, share."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.orm import Session

from app.services.common import public, sessions
from app.services.validation import validate
from compute.runtime.celery_app import send_job
from storage import repo
from storage.models import FINAL_STATUSES, revision_digest

log = logging.getLogger("fisherlens.web")


def submit(settings: Any, kind: str, data: dict[str, Any], *, reuse: bool = True,
           confirm: bool = False) -> dict[str, Any]:
    """Validate, reuse an identical succeeded job, or create a job row and queue it.

    Returns the job dict plus "share_url" and "reused" (True when an earlier result is returned
    instead of computing again). Raises compute.contract.specs.SpecError (nothing queued) on bad
    input, over the per-job ceiling, when the predicted peak memory does not fit the worker's
    device (field `memory`), and app.limits.ConfirmationRequired (field `confirm`) when the
    estimate is above CONFIRM_ABOVE_S and `confirm` is false.
    """
    from app import auth, limits

    user = auth.current_user(settings)  # accounts: owner, quotas and cost ceiling (app/limits.py)
    limits.check_spec_size(data, max_keys=settings.max_spec_keys, max_string=settings.max_spec_string)
    spec, parts, refs = validate(settings, kind, data, user)  # every reference resolved, owners too
    est = limits.estimate(settings, kind, spec, refs=refs)
    limits.check_cost(est, user.max_job_cost, user.max_job_seconds)
    limits.check_memory(settings, est, spec)
    limits.check_confirm(est, confirm)
    spec_hash = spec.spec_hash()
    revision = revision_digest(parts)
    with sessions(settings)() as s:
        if reuse:
            old = repo.find_reusable(
                session=s, kind=kind, spec_hash=spec_hash, model_revision=revision,
                owner_id=user.id if settings.auth_required else None,
            )
            if old is not None:
                return public(settings, repo.job_dict(old), reused=True)
        job = repo.create_job_within_quota(  # count + insert under a lock on the user's row
            owner_id=user.id,
            check=lambda active: limits.check_active(active, user.max_active_jobs),
            session=s,
            kind=kind,
            spec=spec.model_dump(mode="json"),
            spec_hash=spec_hash,
            model_revision=revision,
            revisions=parts,
            refs={f: r.stored() for f, r in refs.items()},
            shared=share_default(settings),
            estimate=limits.submitted_estimate(est),
        )
        out = repo.job_dict(job)
    _queue(settings, out["id"])
    return public(settings, out, reused=False)


def share_default(settings: Any) -> bool:
    """Whether a new job's share link works from the start: SHARE_BY_DEFAULT when set, else on
    in the embedded mode (one local user) and off on a shared server (AUTH_REQUIRED: a link
    opens the result, its figures and its downloads, a trained model included, to anyone
    holding it, so the owner turns it on: POST /api/jobs/{id}/share {"action": "on"})."""
    explicit = getattr(settings, "share_by_default", None)
    return bool(explicit) if explicit is not None else not settings.auth_required


BROKER_DOWN = "could not queue the job: the job queue (broker) cannot be reached right now; try again in a minute"


def _queue(settings: Any, job_id: int) -> None:
    """Send the job to the broker; when it is down, mark the row failed (it must not claim to be
    queued forever) and raise RuntimeError with a short message (the broker's address and the
    client's error go to the job's operator-only `error` and the log, never to the caller)."""
    try:
        send_job(settings, job_id)
    except Exception as exc:  # broker down: any error of the client
        log.warning("could not queue job %s: %r", job_id, exc)
        with sessions(settings)() as s:
            repo.mark_failed(
                session=s,
                job_id=job_id,
                error=f"could not queue the job: {exc!r}",
                message="could not reach the job queue (broker); submit it again",
            )
        raise RuntimeError(BROKER_DOWN) from exc


def health(settings: Any) -> dict[str, Any]:
    """{"ok", "database", "broker", "store"}: each service "ok" or "unreachable" (no address,
    no error text: /api/health is public). The store is asked for one object's metadata (an
    object store's HEAD; the local folder's stat), not written."""
    from sqlalchemy import text

    out: dict[str, Any] = {"database": "ok", "broker": "ok", "store": "ok"}
    try:
        with sessions(settings)() as s:
            s.execute(text("SELECT 1"))
    except Exception:  # noqa: BLE001 - any error: the database is not usable
        log.warning("health: database unreachable", exc_info=True)
        out["database"] = "unreachable"
    try:
        if settings.redis_url:
            import redis

            client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2,
                                          socket_timeout=2)
            try:
                client.ping()
            finally:
                client.close()
        else:  # the embedded filesystem queue: its folders exist (made if need be)
            from compute.runtime.celery_app import filesystem_options

            filesystem_options(settings.queue_dir)
    except Exception:  # noqa: BLE001
        log.warning("health: broker unreachable", exc_info=True)
        out["broker"] = "unreachable"
    try:
        from storage.artifacts import open_store

        store = open_store(settings)
        store.exists(".fisherlens-health")
        for root in store.local_roots():  # the local folder: there (made on first write) or makeable
            if not (root.is_dir() or root.parent.is_dir()):
                raise OSError(f"{root} is missing")
    except Exception:  # noqa: BLE001
        log.warning("health: artifact store unreachable", exc_info=True)
        out["store"] = "unreachable"
    out["ok"] = all(out[k] == "ok" for k in ("database", "broker", "store"))
    return out


def visible_job(settings: Any, s: Session, job_id: int) -> Any:
    """The job row if the caller may see it (owner or admin), else None (answered as 404)."""
    from app import auth

    user = auth.current_user(settings)
    job = repo.get_job(session=s, job_id=job_id)
    return job if job is not None and auth.can_see(user, job.owner_id) else None


def _own_job(settings: Any, s: Session, job_id: int) -> Any:
    """visible_job, or LookupError naming the id."""
    job = visible_job(settings, s, job_id)
    if job is None:
        raise LookupError(f"job: no job with id {job_id}")
    return job


def get_job(settings: Any, job_id: int) -> dict[str, Any] | None:
    """The job, or None when it does not exist or belongs to another user (non-admin)."""
    with sessions(settings)() as s:
        job = visible_job(settings, s, job_id)
        return public(settings, repo.job_dict(job)) if job is not None else None


def list_jobs(
    settings: Any, limit: int = 100, owner: str | None = None, **filters: Any
) -> list[dict[str, Any]]:
    """Newest first: the caller's own jobs (admins: everyone's, or owner=NAME / 'me')."""
    from app import auth
    from storage.db import read

    owner_id = auth.owner_filter(settings, auth.current_user(settings), owner)
    sessions(settings)  # the schema migrated once per process
    rows = read(settings.db_url, lambda conn: repo.list_job_dicts(
        session=conn, limit=limit, owner_id=owner_id, **filters))
    return [public(settings, r) for r in rows]


def trained_models(settings: Any, limit: int = 100) -> list[dict[str, Any]]:
    """Succeeded train jobs whose saved model is in the artifact store, newest first, as model
    choices: {"ref": "job:6", "label": "#6 train arith-base grpo masked", "job_id": 6, "spec"}.
    Any model field (model, teacher, base, tuned) accepts the ref."""
    from compute.contract.modelref import trained_model_label

    jobs = list_jobs(settings, limit=limit, kind="train", status="succeeded")
    out = []
    with sessions(settings)() as s:
        for j in jobs:
            if repo.get_artifact(session=s, job_id=j["id"], kind="model") is None:
                continue
            out.append({"ref": f"job:{j['id']}", "label": trained_model_label(j["id"], j["spec"]),
                        "job_id": j["id"], "spec": j["spec"]})
    return out


def cancel(settings: Any, job_id: int) -> dict[str, Any]:
    """Cancel a queued job now, or ask a running one to stop; LookupError if there is none."""
    with sessions(settings)() as s:
        _own_job(settings, s, job_id)
        job = repo.request_cancel(session=s, job_id=job_id)
        return public(settings, repo.job_dict(job))


def rerun(settings: Any, job_id: int) -> dict[str, Any]:
    """A new job with the same kind and spec, computed again (no reuse). LookupError if the job
    does not exist; ValueError if it is still queued or running."""
    with sessions(settings)() as s:
        job = _own_job(settings, s, job_id)
        if job.status not in FINAL_STATUSES:
            raise ValueError(f"job: job {job_id} is still {job.status}; cancel it first")
        kind, spec = job.kind, dict(job.spec)
    return submit(settings, kind, spec, reuse=False)


def list_models(settings: Any) -> list[dict[str, Any]]:
    with sessions(settings)() as s:
        return [repo.model_dict(m) for m in repo.list_models(session=s)]


def set_sharing(settings: Any, job_id: int, action: str) -> dict[str, Any]:
    """The owner's control of a result's share link: 'new' (a new token: the old link answers
    404 from now on), 'off' (the link stops working; the owner still sees the result) or 'on'.
    LookupError for another user's job (non-admin), ValueError for another action."""
    if action not in ("new", "off", "on"):
        raise ValueError(f"action: got {action!r}; accepted: new, off, on")
    with sessions(settings)() as s:
        _own_job(settings, s, job_id)
        job = repo.set_sharing(session=s, job_id=job_id, new_token=action == "new",
                               shared=action != "off")
        return public(settings, repo.job_dict(job))
