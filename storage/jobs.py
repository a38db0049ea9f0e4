"""Job rows and their state changes. Every function takes `session=` explicitly.

Every state change that two processes may attempt at once (claim, release of a lost job,
re-send) is a compare-and-set: one UPDATE whose WHERE holds the expected state, and the
caller learns from the row count whether it won. Parent/child fan-out: storage/fanout.py.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

from sqlalchemy import Connection, bindparam, select, update
from sqlalchemy.orm import Session

from storage.models import FINAL_STATUSES, Job, User, revision_digest, utcnow
from storage.serialize import JOB_DATES, JOB_DICT_COLUMNS, iso, json_safe

MAX_ID = 2**31 - 1  # jobs.id is a 32-bit INTEGER on PostgreSQL (and what SQLite binds safely)


def new_share_token() -> str:
    """192 random bits, URL-safe: cannot be guessed or enumerated."""
    return secrets.token_urlsafe(24)


def queued_job(**fields: Any) -> Job:
    """A new `queued` Job row (not yet added): the one place a job's initial state is written."""
    spec = fields.pop("spec")
    shared = bool(fields.pop("shared", True))  # submit passes the server's default (share_default)
    return Job(
        shared=shared, spec=json_safe(spec), status="queued", progress=0.0, message="queued",
        share_token=new_share_token(), attempts=0, cancel_requested=False, created_at=utcnow(),
        **fields,
    )


def create_job(
    *,
    session: Session,
    kind: str,
    spec: dict[str, Any],
    spec_hash: str,
    model_revision: str | None = None,
    parent_id: int | None = None,
    shard_index: int | None = None,
    revisions: list[str] | None = None,
    owner_id: int | None = None,
    refs: dict[str, Any] | None = None,
    shared: bool = True,
    estimate: dict[str, Any] | None = None,
) -> Job:
    """A queued job (`shared`: whether its share link works from the start). `revisions` (the parts, e.g. ['model=<sha256>', 'mask=job:3:<sha256>'])
    are stored as they are and their digest becomes model_revision (unless one is given).
    `refs`: {field: Ref JSON} resolved at submit (app.services.refs), what the worker reads."""
    if model_revision is None and revisions:
        model_revision = revision_digest(revisions)
    if owner_id is None and parent_id is not None:  # children belong to their parent's owner
        owner_id = session.scalar(select(Job.owner_id).where(Job.id == parent_id))
    job = queued_job(
        kind=kind, spec=spec, spec_hash=spec_hash, model_revision=model_revision,
        revisions=list(revisions) if revisions else None, owner_id=owner_id, refs=refs,
        parent_id=parent_id, shard_index=shard_index, shared=shared,
        estimate=json_safe(estimate) if estimate else None,
    )
    session.add(job)
    session.commit()
    return job


def recent_timings(*, session: Session, kind: str, limit: int = 20) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(spec, estimate, summary.seconds_parts) of the latest succeeded top-level jobs of `kind`
    that kept their estimate (jobs.estimate) and reported their parts, newest first: what the
    estimate of the next such job learns from (app.limits.clock_corrections). Only the summary's
    seconds_parts is read from the database (a JSON path), not the whole summary."""
    took_col = Job.summary["seconds_parts"]
    rows = session.execute(
        select(Job.spec, Job.estimate, took_col)
        .where(Job.kind == kind, Job.status == "succeeded", Job.parent_id.is_(None), Job.estimate.is_not(None))
        .order_by(Job.id.desc()).limit(limit))
    out = []
    for spec, est, took in rows:
        if isinstance(est, dict) and isinstance(took, dict) and took:
            out.append((dict(spec or {}), est, took))
    return out


def recent_completion_lengths(*, session: Session, model: str, task: str,
                              limit: int = 10) -> list[tuple[int, float, dict[str, Any]]]:
    """(job id, sampling temperature, summary.completion_lengths) of the latest succeeded jobs
    whose spec samples `model` (its `model` field, as written) on `task` and that recorded how long
    their completions ran (compute.contract.cost.length_record), newest first: what a later
    estimate on that model prices its sampling by (app.limits.stop_history). JSON paths: only those
    values are read."""
    lengths = Job.summary["completion_lengths"]
    rows = session.execute(
        select(Job.id, Job.spec["temperature"].as_float(), lengths)
        .where(Job.status == "succeeded", Job.spec["model"].as_string() == model,
               Job.spec["task"].as_string() == task,
               # not `lengths IS NOT NULL`: SQLite's JSON path of a missing key reads 'null' there
               Job.summary[("completion_lengths", "rows")].as_integer() > 0)
        .order_by(Job.id.desc()).limit(limit))
    return [(int(i), float(t if t is not None else 1.0), rec) for i, t, rec in rows
            if isinstance(rec, dict) and rec.get("rows")]


def create_job_within_quota(
    *, session: Session, owner_id: int, check: Callable[[int], None], **fields: Any
) -> Job:
    """create_job for `owner_id`, after `check(active)` has accepted the owner's number of
    queued + running top-level jobs, counted under a lock on the owner's row that is held
    until the new row is committed, so a burst of submits can never exceed a quota (count and
    insert are one critical section per user). `check` raises to refuse; nothing is written.

    PostgreSQL: SELECT ... FOR UPDATE on the users row. SQLite: the transaction's first
    statement is a write to that row, which takes SQLite's one write lock (waited for under
    busy_timeout) before the count is read, so the count cannot be stale."""
    from storage.users import active_jobs

    session.rollback()  # the lock must be the first statement of its transaction
    try:
        if session.get_bind().dialect.name == "postgresql":
            session.execute(select(User.id).where(User.id == owner_id).with_for_update())
        else:
            session.execute(
                update(User).where(User.id == owner_id).values(id=User.id)
                .execution_options(synchronize_session=False)
            )
        check(active_jobs(session=session, owner_id=owner_id))
    except BaseException:
        session.rollback()
        raise
    return create_job(session=session, owner_id=owner_id, **fields)  # commits: lock released


def get_job(*, session: Session, job_id: int) -> Job | None:
    """The job, or None (also for ids no row can have: < 1 or > MAX_ID, which PostgreSQL would
    refuse with NumericValueOutOfRange and SQLite with OverflowError)."""
    if not 1 <= int(job_id) <= MAX_ID:
        return None
    return session.get(Job, int(job_id), populate_existing=True)


def must_get(session: Session, job_id: int) -> Job:
    job = get_job(session=session, job_id=job_id)
    if job is None:
        raise LookupError(f"job: no job with id {job_id}")
    return job


def set_sharing(*, session: Session, job_id: int, new_token: bool, shared: bool) -> Job:
    """Turn a job's share link on/off, or give it a new token (the old one stops working)."""
    job = must_get(session, job_id)
    if new_token:
        job.share_token = new_share_token()
    job.shared = shared
    session.commit()
    return job


def get_job_by_token(*, session: Session, token: str) -> Job | None:
    if not token or len(token) > 64:
        return None
    return session.scalar(select(Job).where(Job.share_token == token))


# Built once: the share page runs this on every view (building a select costs more than running it).
_HEAD_BY_TOKEN = select(
    Job.id, Job.kind, Job.status, Job.progress, Job.message, Job.finished_at, Job.share_token
).where(Job.share_token == bindparam("token"), Job.shared.is_(True))


def job_head_by_token(*, session: Session | Connection, token: str) -> dict[str, Any] | None:
    """The few columns a share page reads on every view (no spec, no summary JSON), or None when
    no job has this token or its owner turned the link off. Takes a Session or a plain Connection
    (the share page uses a Connection: a third of the cost of an ORM session per view)."""
    row = session.execute(_HEAD_BY_TOKEN, {"token": token}).first()
    if row is None:
        return None
    return {"id": row.id, "kind": row.kind, "status": row.status, "progress": row.progress,
            "message": row.message, "finished_at": iso(row.finished_at),
            "share_token": row.share_token}


def list_jobs(
    *,
    session: Session,
    limit: int = 100,
    offset: int = 0,
    kind: str | None = None,
    status: str | None = None,
    include_shards: bool = False,
    owner_id: int | None = None,
) -> list[Job]:
    """Newest first. Child jobs (of a fanned-out parent) are hidden unless include_shards;
    owner_id: only that user's jobs."""
    q = select(Job)
    if owner_id is not None:
        q = q.where(Job.owner_id == owner_id)
    if kind:
        q = q.where(Job.kind == kind)
    if status:
        q = q.where(Job.status == status)
    if not include_shards:
        q = q.where(Job.parent_id.is_(None))
    q = q.order_by(Job.id.desc()).limit(max(1, min(int(limit), 1000))).offset(max(0, int(offset)))
    return list(session.scalars(q))


# job_dict's fields, in its order: what a job listing reads (no refs, no summary JSON).
@lru_cache(maxsize=32)
def _listing(owner: bool, kind: bool, status: bool, include_shards: bool) -> Any:
    """The listing's select for one combination of filters, built once (values are bound)."""
    q = select(*(getattr(Job, c) for c in JOB_DICT_COLUMNS))
    if owner:
        q = q.where(Job.owner_id == bindparam("owner_id"))
    if kind:
        q = q.where(Job.kind == bindparam("kind"))
    if status:
        q = q.where(Job.status == bindparam("status"))
    if not include_shards:
        q = q.where(Job.parent_id.is_(None))
    return q.order_by(Job.id.desc()).limit(bindparam("limit")).offset(bindparam("offset"))


def list_job_dicts(
    *,
    session: Session | Connection,
    limit: int = 100,
    offset: int = 0,
    kind: str | None = None,
    status: str | None = None,
    include_shards: bool = False,
    owner_id: int | None = None,
) -> list[dict[str, Any]]:
    """list_jobs as job_dict's dicts, read without the ORM (a Session or a plain Connection):
    the same rows, the same fields, a third of the work per listing (it is polled)."""
    q = _listing(owner_id is not None, bool(kind), bool(status), include_shards)
    params = {"owner_id": owner_id, "kind": kind, "status": status,
              "limit": max(1, min(int(limit), 1000)), "offset": max(0, int(offset))}
    rows = session.execute(q, {k: v for k, v in params.items() if v is not None})
    return [{c: iso(v) if c in JOB_DATES else v for c, v in zip(JOB_DICT_COLUMNS, r, strict=True)}
            for r in rows]


def update_progress(
    *, session: Session, job_id: int, fraction: float | None, message: str | None = None
) -> bool:
    """Record progress (clamped to [0, 1]) and a heartbeat; returns True if cancel was requested."""
    values: dict[str, Any] = {"heartbeat_at": utcnow()}
    if fraction is not None and math.isfinite(fraction):
        values["progress"] = min(1.0, max(0.0, float(fraction)))
    if message is not None:
        values["message"] = str(message)[:2000]
    session.execute(update(Job).where(Job.id == job_id, Job.status == "running").values(**values))
    session.commit()
    return bool(session.scalar(select(Job.cancel_requested).where(Job.id == job_id)))


def heartbeat(*, session: Session, job_id: int) -> bool:
    """Touch heartbeat_at of a running job; returns True if cancel was requested."""
    return update_progress(session=session, job_id=job_id, fraction=None)


def mark_running(*, session: Session, job_id: int, worker: str) -> Job:
    """Set a job running without a compare-and-set (tests and tools; workers use claim_job)."""
    job = must_get(session, job_id)
    now = utcnow()
    job.status = "running"
    job.worker = worker[:255]
    job.attempts = (job.attempts or 0) + 1
    job.started_at = now
    job.heartbeat_at = now
    job.finished_at = None
    job.error = None
    job.progress = 0.0
    job.message = "started" if job.attempts == 1 else f"started (attempt {job.attempts})"
    session.commit()
    return job


def claim_job(*, session: Session, job_id: int, worker: str, stale_after_s: float) -> Job | None:
    """Atomically mark a job `running` for `worker` (attempts + 1) if nobody else holds it:
    it is queued, or running under this worker's name, or running with a heartbeat older than
    stale_after_s. Returns the job, or None when another delivery already claimed it (two
    workers handed the same job can never both run it)."""
    now = utcnow()
    cutoff = now - timedelta(seconds=stale_after_s)
    free = (Job.worker == worker) | Job.heartbeat_at.is_(None) | (Job.heartbeat_at < cutoff)
    res = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.cancel_requested.is_(False),
            (Job.status == "queued") | ((Job.status == "running") & free),
        )
        .values(
            status="running", worker=worker[:255], attempts=Job.attempts + 1, started_at=now,
            heartbeat_at=now, finished_at=None, error=None, progress=0.0, message="started",
        )
        .execution_options(synchronize_session=False)
    )
    session.commit()
    if res.rowcount != 1:  # type: ignore[attr-defined]
        return None
    job = must_get(session, job_id)
    if job.attempts > 1:
        job.message = f"started (attempt {job.attempts})"
        session.commit()
    return job


def mark_succeeded(*, session: Session, job_id: int, message: str = "done") -> Job:
    return _finish(session, job_id, "succeeded", message=message, progress=1.0)


def mark_failed(*, session: Session, job_id: int, error: str, message: str | None = None) -> Job:
    short = message or (error.strip().splitlines() or ["failed"])[-1][:500]
    return _finish(session, job_id, "failed", message=short, error=error)


def mark_cancelled(*, session: Session, job_id: int, message: str = "cancelled") -> Job:
    return _finish(session, job_id, "cancelled", message=message)


def _finish(
    session: Session,
    job_id: int,
    status: str,
    *,
    message: str,
    error: str | None = None,
    progress: float | None = None,
) -> Job:
    job = must_get(session, job_id)
    job.status = status
    job.message = message
    job.error = error
    job.finished_at = utcnow()
    if progress is not None:
        job.progress = progress
    session.commit()
    return job


def requeue(*, session: Session, job_id: int, message: str = "re-queued") -> Job:
    """Back to `queued` (after a lost worker, or a rerun); result rows are kept until replaced."""
    job = must_get(session, job_id)
    job.status = "queued"
    job.message = message
    job.worker = None
    job.progress = 0.0
    job.heartbeat_at = None
    job.finished_at = None
    job.combine_state = None
    session.commit()
    return job


def request_cancel(*, session: Session, job_id: int) -> Job:
    """Queued jobs are cancelled at once; running ones get cancel_requested (the worker's next
    progress call stops them). Finished jobs are left as they are. Children follow their parent;
    a running parent that fanned out is cancelled at once (its children stop on their own)."""
    job = must_get(session, job_id)
    children = list(session.scalars(select(Job).where(Job.parent_id == job.id)))
    now = utcnow()
    for j in [job, *children]:
        if j.status in FINAL_STATUSES:
            continue
        j.cancel_requested = True
        if j.status == "queued" or (j is job and j.status == "running" and children):
            j.message = "cancelled before it ran" if j.status == "queued" else "cancelled"
            j.status = "cancelled"
            j.finished_at = now
    session.commit()
    return job


def find_reusable(
    *,
    session: Session,
    kind: str,
    spec_hash: str,
    model_revision: str | None,
    owner_id: int | None = None,
) -> Job | None:
    """The newest succeeded job with the same kind, spec hash and model revision (of `owner_id`
    when given: a user never receives another user's job)."""
    q = select(Job).where(Job.owner_id == owner_id) if owner_id is not None else select(Job)
    q = q.where(
        Job.kind == kind,
        Job.spec_hash == spec_hash,
        Job.status == "succeeded",
        Job.parent_id.is_(None),
    )
    q = q.where(
        Job.model_revision.is_(None)
        if model_revision is None
        else Job.model_revision == model_revision
    )
    return session.scalar(q.order_by(Job.id.desc()).limit(1))


# -- reconciliation (compute/worker/reconciler.py): every state change below is a compare-and-set
def release_lost(
    *,
    session: Session,
    job_id: int,
    worker: str | None,
    attempts: int,
    requeue: bool,
    message: str,
    error: str | None = None,
) -> bool:
    """A job whose worker died: back to `queued` (requeue=True) or `failed`, but only if it is
    still `running` under the same worker and attempt that were judged dead (so two reconcilers,
    or a reconciler racing a new claim, never release a job that someone else has claimed since).
    For a queued job heartbeat_at is the time its message was (re)sent."""
    now = utcnow()
    values: dict[str, Any] = {"message": message[:2000], "worker": None, "progress": 0.0}
    if requeue:
        values.update(status="queued", heartbeat_at=now, finished_at=None)
    else:
        values.update(status="failed", error=error or message, finished_at=now)
    who = Job.worker.is_(None) if worker is None else Job.worker == worker
    res = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == "running", who, Job.attempts == attempts)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return res.rowcount == 1  # type: ignore[attr-defined]


def queued_since(job: Job) -> datetime:
    """When a queued job's current message was sent: its last (re)send, else its creation."""
    return max(t for t in (job.created_at, job.heartbeat_at, job.started_at) if t is not None)


def find_queued(*, session: Session, older_than_s: float) -> list[Job]:
    """Queued jobs (children included) whose message went out more than older_than_s ago."""
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    rows = session.scalars(
        select(Job).where(Job.status == "queued", Job.created_at < cutoff).order_by(Job.id)
    )
    return [j for j in rows if queued_since(j) < cutoff]


def mark_resent(*, session: Session, job_id: int, older_than_s: float) -> bool:
    """Compare-and-set before re-sending a queued job's message: True for exactly one caller
    (heartbeat_at, for a queued job, is when its message was last sent)."""
    now = utcnow()
    cutoff = now - timedelta(seconds=older_than_s)
    res = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.status == "queued",
            Job.created_at < cutoff,
            Job.heartbeat_at.is_(None) | (Job.heartbeat_at < cutoff),
        )
        .values(heartbeat_at=now)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return res.rowcount == 1  # type: ignore[attr-defined]
