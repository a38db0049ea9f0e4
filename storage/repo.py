"""Repository functions: every one takes `session=` explicitly (no global session).

Mutating functions commit their own unit of work, so a caller can do
`with session_factory(url)() as s: repo.request_cancel(session=s, job_id=3)`.
Read functions return ORM rows; `job_dict`, `model_dict` and `result_dict` turn them into the
JSON shapes the API serves (`result_dict` is the body of GET /api/results/{token}).

This module holds the model registry and is the one import for callers: job rows and their
compare-and-set state changes live in storage/jobs.py, parent/child fan-out and the combine
state in storage/fanout.py, stored results in storage/results.py, JSON shapes in
storage/serialize.py; their public names are re-exported here.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.fanout import (
    claim_combine,
    create_children,
    expected_children,
    fail_parent,
    mark_combine_resent,
    refresh_parent_progress,
    release_combine,
    request_combine,
    shard_jobs,
)
from storage.jobs import (
    MAX_ID,
    claim_job,
    create_job,
    create_job_within_quota,
    find_queued,
    find_reusable,
    get_job,
    get_job_by_token,
    heartbeat,
    job_head_by_token,
    list_job_dicts,
    list_jobs,
    mark_cancelled,
    mark_failed,
    mark_resent,
    mark_running,
    mark_succeeded,
    new_share_token,
    queued_since,
    recent_completion_lengths,
    recent_timings,
    release_lost,
    request_cancel,
    requeue,
    set_sharing,
    update_progress,
)
from storage.models import Model
from storage.results import get_artifact, result_dict, save_result
from storage.serialize import artifact_dict, job_dict, json_safe, model_dict

__all__ = [
    "MAX_ID", "artifact_dict", "claim_combine", "claim_job", "create_children", "create_job",
    "create_job_within_quota",
    "expected_children", "fail_parent", "find_queued", "find_reusable", "get_artifact",
    "get_job", "get_job_by_token", "get_model", "heartbeat", "job_dict", "job_head_by_token",
    "json_safe", "list_job_dicts", "list_jobs", "list_models", "mark_cancelled", "mark_combine_resent",
    "mark_failed", "mark_resent", "mark_running", "mark_succeeded", "model_dict",
    "new_share_token", "queued_since", "recent_completion_lengths", "recent_timings", "refresh_parent_progress", "register_model",
    "release_combine", "release_lost", "request_cancel", "request_combine", "requeue",
    "result_dict", "save_result", "set_sharing", "shard_jobs", "update_progress",
]


def register_model(
    *,
    session: Session,
    name: str,
    source: str,
    revision: str | None = None,
    architecture: str | None = None,
    n_params: int | None = None,
    n_layers: int | None = None,
    info: dict[str, Any] | None = None,
    owner_id: int | None = None,
) -> Model:
    """Insert or update the model called `name` (owner_id: who registered it, set on insert)."""
    row = session.scalar(select(Model).where(Model.name == name))
    if row is None:
        row = Model(name=name, source=source, info={}, owner_id=owner_id)
        session.add(row)
    row.source = source
    row.revision = revision
    row.architecture = architecture
    row.n_params = n_params
    row.n_layers = n_layers
    row.info = json_safe(info or {})
    session.commit()
    return row


def get_model(*, session: Session, name: str) -> Model | None:
    return session.scalar(select(Model).where(Model.name == name))


def list_models(*, session: Session) -> list[Model]:
    return list(session.scalars(select(Model).order_by(Model.name)))
