"""Stored results as the caller may read them (owner, admin, or the holder of a share link
that is on) and the verified files behind artifact downloads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.services.common import public, sessions
from app.services.jobs import visible_job
from storage import repo


def _readable_by_token(settings: Any, s: Any, token: str) -> Any:
    """The job of a share token if this caller may read its result, else None."""
    from app import auth

    job = repo.get_job_by_token(session=s, token=token)
    return job if job is not None and auth.can_read_result(settings, job) else None


def _result(settings: Any, s: Any, job: Any) -> dict[str, Any] | None:
    if job is None:
        return None
    out = repo.result_dict(session=s, job=job)
    out["job"] = public(settings, out["job"])
    return out


def result_by_token(settings: Any, token: str) -> dict[str, Any] | None:
    """GET /api/results/{token}: the job and all its stored rows, or None for unknown tokens."""
    with sessions(settings)() as s:
        return _result(settings, s, _readable_by_token(settings, s, token))


def result_by_id(settings: Any, job_id: int) -> dict[str, Any] | None:
    """The job and its stored rows, or None when the caller may not see the job."""
    with sessions(settings)() as s:
        return _result(settings, s, visible_job(settings, s, job_id))


def artifact_path(settings: Any, token: str, kind: str) -> Path | None:
    """The verified file of a job's artifact (for downloads), or None when there is none.
    Raises FileNotFoundError when the file is gone (HTTP 410) and
    storage.artifacts.ArtifactError when it does not match its sha256 (HTTP 409)."""
    from storage.artifacts import ArtifactStore

    with sessions(settings)() as s:
        job = _readable_by_token(settings, s, token)
        if job is None:
            return None
        art = repo.get_artifact(session=s, job_id=job.id, kind=kind)
        if art is None:
            return None
        store = ArtifactStore(settings.artifacts_dir)
        if not store.resolve(art.path).exists():
            raise FileNotFoundError(f"artifact {kind} of job {job.id} is no longer stored")
        return store.verify(art.path, art.sha256)
