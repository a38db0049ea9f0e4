"""Stored results as the caller may read them (owner, admin, or the holder of a share link
that is on) and the verified files behind artifact downloads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.services.common import public, sessions
from app.services.jobs import visible_job
from storage import repo


def readable_by_token(settings: Any, s: Any, token: str) -> Any:
    """The job of a share token if this caller may read its result, else None."""
    from app import auth

    job = repo.get_job_by_token(session=s, token=token)
    return job if job is not None and auth.can_read_result(settings, job) else None


def _result(settings: Any, s: Any, job: Any, by_token: bool = False) -> dict[str, Any] | None:
    if job is None:
        return None
    out = repo.result_dict(session=s, job=job)
    out["job"] = public(settings, out["job"])
    if by_token:  # whoever holds the link: references given by server path shown by label
        from app.figures.public import public_result

        out = public_result(out, job.refs)
    return out


def result_by_token(settings: Any, token: str) -> dict[str, Any] | None:
    """GET /api/results/{token}: the job and all its stored rows, or None for unknown tokens.
    A share link is public: a model, run folder or file the spec named by a server path is shown
    by its label ('grpo (local folder)', app/figures/public.py), in the spec and the summary."""
    with sessions(settings)() as s:
        return _result(settings, s, readable_by_token(settings, s, token), by_token=True)


def result_by_id(settings: Any, job_id: int) -> dict[str, Any] | None:
    """The job and its stored rows, or None when the caller may not see the job."""
    with sessions(settings)() as s:
        return _result(settings, s, visible_job(settings, s, job_id))


def _artifact_row(settings: Any, token: str, kind: str) -> Any:
    with sessions(settings)() as s:
        job = readable_by_token(settings, s, token)
        if job is None:
            return None
        return repo.get_artifact(session=s, job_id=job.id, kind=kind)


def artifact_path(settings: Any, token: str, kind: str) -> Path | None:
    """The verified file of a job's artifact (for downloads), or None when there is none: the
    stored file itself (folder store) or this machine's cached copy (object store).
    Raises FileNotFoundError when the file is gone (HTTP 410),
    storage.artifacts.ArtifactError when it does not match its sha256 (HTTP 409) and
    storage.artifacts.ArtifactStoreUnavailable when the store cannot be reached (HTTP 503)."""
    from storage.artifacts import ArtifactMissing, open_store

    art = _artifact_row(settings, token, kind)
    if art is None:
        return None
    try:
        return open_store(settings).fetch(art.path, art.sha256)
    except ArtifactMissing:
        raise FileNotFoundError(f"artifact {kind} of job {art.job_id} is no longer stored") from None


def artifact_url(settings: Any, token: str, kind: str, filename: str) -> str | None:
    """A short-lived presigned URL of a single-file artifact in object storage, when
    ARTIFACT_DOWNLOAD_REDIRECT is on and the store makes them; None otherwise (stream instead)."""
    from storage.artifacts import open_store

    if not settings.artifact_download_redirect:
        return None
    art = _artifact_row(settings, token, kind)
    if art is None or art.is_dir:
        return None
    return open_store(settings).download_url(art.path, art.sha256, filename,
                                             settings.artifact_presign_s)
