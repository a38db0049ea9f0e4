"""What the CLI, the REST API and the UI do with jobs: submit, reuse, cancel, rerun, look up.

No torch here (the web process imports this). Tasks are sent by name with only the job id.
Every function takes `settings` (app.settings.Settings) and returns plain dicts.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from compute.celery_app import send_job
from compute.specs import SpecError, parse_spec
from storage import repo
from storage.db import session_factory, upgrade
from storage.models import FINAL_STATUSES, revision_digest

_JOB_REF = re.compile(r"^job:(\d{1,12})$")
# Spec fields naming other jobs' artifacts: field -> (kind of job it must be, artifact kind).
REF_FIELDS: dict[str, dict[str, tuple[str, str]]] = {
    "mask": {"fisher": ("fisher", "fisher")},
    "train": {"mask": ("mask", "mask")},
    "diff": {"fisher": ("fisher", "fisher")},
}
MODEL_FIELDS = ("model", "teacher", "base", "tuned")

_upgraded: set[str] = set()
_upgrade_lock = threading.Lock()


def sessions(settings: Any) -> sessionmaker[Session]:
    """The session factory for settings.db_url, migrating the schema once per process."""
    url = settings.db_url
    with _upgrade_lock:
        if url not in _upgraded:
            upgrade(url)
            _upgraded.add(url)
    return session_factory(url)


def share_url(settings: Any, token: str) -> str:
    return f"{settings.public_url.rstrip('/')}/r/{token}"


def _public(settings: Any, job_dict: dict[str, Any], **extra: Any) -> dict[str, Any]:
    out = dict(job_dict)
    out["share_url"] = share_url(settings, job_dict["share_token"])
    out.update(extra)
    return out


def validate(settings: Any, kind: str, data: dict[str, Any]) -> tuple[Any, list[str]]:
    """(spec, model revision) or SpecError naming each bad field. Checks model references
    (allowed roots, zoo built) and job/file references, so nothing unrunnable is queued."""
    spec = parse_spec(kind, data)
    errors: list[dict[str, str]] = []
    revisions: list[str] = []
    from compute.modelref import model_revision

    for field in MODEL_FIELDS:
        ref = getattr(spec, field, None)
        if not ref:
            continue
        try:
            revisions.append(f"{field}={model_revision(ref, settings)}")
        except ValueError as exc:
            msg = str(exc)
            msg = msg.split(": ", 1)[1] if msg.startswith("model: ") else msg
            errors.append({"field": field, "message": msg})
    for field, (want_kind, _art) in REF_FIELDS.get(kind, {}).items():
        ref = getattr(spec, field, None)
        if not ref:
            continue
        try:
            revisions.append(f"{field}={_ref_revision(settings, ref, want_kind)}")
        except ValueError as exc:
            errors.append({"field": field, "message": str(exc)})
    if errors:
        raise SpecError(errors)
    return spec, revisions


def _ref_revision(settings: Any, ref: str, want_kind: str) -> str:
    """A revision string for a 'job:<id>' or file reference; ValueError if unusable."""
    m = _JOB_REF.match(ref.strip())
    if m:
        with sessions(settings)() as s:
            job = repo.get_job(session=s, job_id=int(m.group(1)))
            if job is None:
                raise ValueError(f"{ref!r}: no such job")
            if job.kind != want_kind:
                raise ValueError(f"{ref!r} is a {job.kind} job; a {want_kind} job is needed")
            if job.status != "succeeded":
                raise ValueError(f"{ref!r} is {job.status}; submit this once it has succeeded")
            art = repo.get_artifact(session=s, job_id=job.id, kind=want_kind)
            return f"job:{job.id}:{art.sha256 if art else ''}"
    if ref.startswith("job:"):
        raise ValueError(f"{ref!r}: a job reference is 'job:<number>'")
    path = Path(ref).expanduser()
    if not path.is_absolute():
        raise ValueError(f"{ref!r}: give an absolute path, or 'job:<id>' of a {want_kind} job")
    roots = [Path(settings.artifacts_dir), *[Path(r) for r in settings.model_roots]]
    resolved = path.resolve()
    if not any(resolved.is_relative_to(r.resolve()) for r in roots):
        raise ValueError(
            f"{ref!r} is outside the artifact root and the allowed model roots "
            f"({', '.join(str(r) for r in roots)})"
        )
    if not resolved.is_file():
        raise ValueError(f"{ref!r}: file does not exist")
    st = resolved.stat()
    return f"{resolved}:{st.st_size}:{st.st_mtime_ns}"


def submit(settings: Any, kind: str, data: dict[str, Any], *, reuse: bool = True) -> dict[str, Any]:
    """Validate, reuse an identical succeeded job, or create a job row and queue it.

    Returns the job dict plus "share_url" and "reused" (True when an earlier result is returned
    instead of computing again). Raises compute.specs.SpecError (nothing queued) on bad input.
    """
    spec, parts = validate(settings, kind, data)
    spec_hash = spec.spec_hash()
    revision = revision_digest(parts)
    with sessions(settings)() as s:
        if reuse:
            old = repo.find_reusable(
                session=s, kind=kind, spec_hash=spec_hash, model_revision=revision
            )
            if old is not None:
                return _public(settings, repo.job_dict(old), reused=True)
        job = repo.create_job(
            session=s,
            kind=kind,
            spec=spec.model_dump(mode="json"),
            spec_hash=spec_hash,
            model_revision=revision,
            revisions=parts,
        )
        out = repo.job_dict(job)
    try:
        send_job(settings, out["id"])
    except Exception as exc:  # broker down: the row must not claim to be queued forever
        with sessions(settings)() as s:
            repo.mark_failed(
                session=s,
                job_id=out["id"],
                error=f"could not queue the job: {exc!r}",
                message="could not reach the job queue (broker); is Redis running?",
            )
        raise RuntimeError(f"could not queue job {out['id']}: {exc}") from exc
    return _public(settings, out, reused=False)


def get_job(settings: Any, job_id: int) -> dict[str, Any] | None:
    with sessions(settings)() as s:
        job = repo.get_job(session=s, job_id=job_id)
        return _public(settings, repo.job_dict(job)) if job else None


def list_jobs(settings: Any, limit: int = 100, **filters: Any) -> list[dict[str, Any]]:
    with sessions(settings)() as s:
        return [
            _public(settings, repo.job_dict(j))
            for j in repo.list_jobs(session=s, limit=limit, **filters)
        ]


def result_by_token(settings: Any, token: str) -> dict[str, Any] | None:
    """GET /api/results/{token}: the job and all its stored rows, or None for unknown tokens."""
    with sessions(settings)() as s:
        job = repo.get_job_by_token(session=s, token=token)
        if job is None:
            return None
        out = repo.result_dict(session=s, job=job)
        out["job"]["share_url"] = share_url(settings, job.share_token)
        return out


def result_by_id(settings: Any, job_id: int) -> dict[str, Any] | None:
    with sessions(settings)() as s:
        job = repo.get_job(session=s, job_id=job_id)
        if job is None:
            return None
        out = repo.result_dict(session=s, job=job)
        out["job"]["share_url"] = share_url(settings, job.share_token)
        return out


def cancel(settings: Any, job_id: int) -> dict[str, Any]:
    """Cancel a queued job now, or ask a running one to stop; LookupError if there is none."""
    with sessions(settings)() as s:
        job = repo.request_cancel(session=s, job_id=job_id)
        return _public(settings, repo.job_dict(job))


def rerun(settings: Any, job_id: int) -> dict[str, Any]:
    """A new job with the same kind and spec, computed again (no reuse). LookupError if the job
    does not exist; ValueError if it is still queued or running."""
    with sessions(settings)() as s:
        job = repo.get_job(session=s, job_id=job_id)
        if job is None:
            raise LookupError(f"job: no job with id {job_id}")
        if job.status not in FINAL_STATUSES:
            raise ValueError(f"job: job {job_id} is still {job.status}; cancel it first")
        kind, spec = job.kind, dict(job.spec)
    return submit(settings, kind, spec, reuse=False)


def list_models(settings: Any) -> list[dict[str, Any]]:
    with sessions(settings)() as s:
        return [repo.model_dict(m) for m in repo.list_models(session=s)]


def artifact_path(settings: Any, token: str, kind: str) -> Path | None:
    """The verified file of a job's artifact (for downloads), or None when there is none.
    Raises storage.artifacts.ArtifactError if the file does not match its sha256."""
    from storage.artifacts import ArtifactStore

    with sessions(settings)() as s:
        job = repo.get_job_by_token(session=s, token=token)
        if job is None:
            return None
        art = repo.get_artifact(session=s, job_id=job.id, kind=kind)
        if art is None:
            return None
        return ArtifactStore(settings.artifacts_dir).verify(art.path, art.sha256)
