"""Repository functions: every one takes `session=` explicitly (no global session).

Mutating functions commit their own unit of work, so a caller can do
`with session_factory(url)() as s: repo.request_cancel(session=s, job_id=3)`.
Read functions return ORM rows; `job_dict`, `model_dict` and `result_dict` turn them into the
JSON shapes the API serves (`result_dict` is the body of GET /api/results/{token}).
"""

from __future__ import annotations

import math
import secrets
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, bindparam, delete, select, update
from sqlalchemy.orm import Session

from storage.artifacts import ArtifactInfo, ArtifactStore
from storage.models import (
    FINAL_STATUSES,
    ArtifactRow,
    HeatmapRow,
    Job,
    LayerStatRow,
    Model,
    SeriesRow,
    revision_digest,
    utcnow,
)


def new_share_token() -> str:
    """192 random bits, URL-safe: cannot be guessed or enumerated."""
    return secrets.token_urlsafe(24)


def _clean(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf -> None (PostgreSQL's json rejects them), tuples -> lists,
    numpy/torch scalars -> Python numbers."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, bool | int | str) or obj is None:
        return obj
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return _clean(obj.item())
        except (ValueError, RuntimeError):
            pass
    if hasattr(obj, "tolist"):
        return _clean(obj.tolist())
    return str(obj)


# -- models -----------------------------------------------------------------------------------
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
    row.info = _clean(info or {})
    session.commit()
    return row


def get_model(*, session: Session, name: str) -> Model | None:
    return session.scalar(select(Model).where(Model.name == name))


def list_models(*, session: Session) -> list[Model]:
    return list(session.scalars(select(Model).order_by(Model.name)))


def model_dict(m: Model) -> dict[str, Any]:
    return {
        "id": m.id,
        "name": m.name,
        "source": m.source,
        "revision": m.revision,
        "architecture": m.architecture,
        "n_params": m.n_params,
        "n_layers": m.n_layers,
        "info": m.info or {},
        "created_at": _iso(m.created_at),
    }


# -- jobs -------------------------------------------------------------------------------------
def _queued_job(**fields: Any) -> Job:
    """A new `queued` Job row (not yet added): the one place a job's initial state is written."""
    spec = fields.pop("spec")
    return Job(
        shared=True, spec=_clean(spec), status="queued", progress=0.0, message="queued",
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
) -> Job:
    """A queued job. `revisions` (the parts, e.g. ['model=<sha256>', 'mask=job:3:<sha256>'])
    are stored as they are and their digest becomes model_revision (unless one is given)."""
    if model_revision is None and revisions:
        model_revision = revision_digest(revisions)
    if owner_id is None and parent_id is not None:  # shards belong to their parent's owner
        owner_id = session.scalar(select(Job.owner_id).where(Job.id == parent_id))
    job = _queued_job(
        kind=kind, spec=spec, spec_hash=spec_hash, model_revision=model_revision,
        revisions=list(revisions) if revisions else None, owner_id=owner_id,
        parent_id=parent_id, shard_index=shard_index,
    )
    session.add(job)
    session.commit()
    return job


MAX_ID = 2**31 - 1  # jobs.id is a 32-bit INTEGER on PostgreSQL (and what SQLite binds safely)


def get_job(*, session: Session, job_id: int) -> Job | None:
    """The job, or None (also for ids no row can have: < 1 or > MAX_ID, which PostgreSQL would
    refuse with NumericValueOutOfRange and SQLite with OverflowError)."""
    if not 1 <= int(job_id) <= MAX_ID:
        return None
    return session.get(Job, int(job_id), populate_existing=True)


def set_sharing(*, session: Session, job_id: int, new_token: bool, shared: bool) -> Job:
    """Turn a job's share link on/off, or give it a new token (the old one stops working)."""
    job = _must(session, job_id)
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
            "message": row.message, "finished_at": _iso(row.finished_at),
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
    """Newest first. Shard children (of a sharded job) are hidden unless include_shards;
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


def shard_jobs(*, session: Session, parent_id: int) -> list[Job]:
    q = select(Job).where(Job.parent_id == parent_id).order_by(Job.shard_index)
    return list(session.scalars(q.execution_options(populate_existing=True)))


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
    job = _must(session, job_id)
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
    res = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.cancel_requested.is_(False),
            (Job.status == "queued")
            | (
                (Job.status == "running")
                & (
                    (Job.worker == worker)
                    | Job.heartbeat_at.is_(None)
                    | (Job.heartbeat_at < cutoff)
                )
            ),
        )
        .values(
            status="running",
            worker=worker[:255],
            attempts=Job.attempts + 1,
            started_at=now,
            heartbeat_at=now,
            finished_at=None,
            error=None,
            progress=0.0,
            message="started",
        )
        .execution_options(synchronize_session=False)
    )
    session.commit()
    if res.rowcount != 1:  # type: ignore[attr-defined]
        return None
    job = _must(session, job_id)
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
    job = _must(session, job_id)
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
    job = _must(session, job_id)
    job.status = "queued"
    job.message = message
    job.worker = None
    job.progress = 0.0
    job.heartbeat_at = None
    job.finished_at = None
    session.commit()
    return job


def request_cancel(*, session: Session, job_id: int) -> Job:
    """Queued jobs are cancelled at once; running ones get cancel_requested (the worker's next
    progress call stops them). Finished jobs are left as they are. Shards follow their parent."""
    job = _must(session, job_id)
    targets = [job, *shard_jobs(session=session, parent_id=job.id)]
    now = utcnow()
    for j in targets:
        if j.status in FINAL_STATUSES:
            continue
        j.cancel_requested = True
        if j.status == "queued" or (j is job and j.status == "running" and _has_shards(session, j)):
            j.message = "cancelled before it ran" if j.status == "queued" else "cancelled"
            j.status = "cancelled"
            j.finished_at = now
    session.commit()
    return job


def _has_shards(session: Session, job: Job) -> bool:
    return session.scalar(select(Job.id).where(Job.parent_id == job.id).limit(1)) is not None


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


def find_stale_running(
    *, session: Session, stale_after_s: float, hostname: str | None = None
) -> list[Job]:
    """Running jobs whose worker is gone: heartbeat older than stale_after_s, or claimed by
    `hostname` (the worker now starting has that name, so its previous process is dead).
    A sharded parent is judged by its shards, not by its own heartbeat."""
    cutoff = utcnow() - timedelta(seconds=stale_after_s)
    rows = session.scalars(select(Job).where(Job.status == "running").order_by(Job.id))
    out = []
    for job in rows:
        if _has_shards(session, job):
            continue
        hb = job.heartbeat_at or job.started_at or job.created_at
        if (hostname is not None and job.worker == hostname) or hb < cutoff:
            out.append(job)
    return out


# -- reconciliation (compute/worker.reconcile): every state change below is a compare-and-set ----
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
    """Queued jobs (shards included) whose message went out more than older_than_s ago."""
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


def create_shards(
    *, session: Session, parent_id: int, n: int, spec: dict[str, Any], spec_hash: str
) -> list[Job]:
    """The parent's shard children 0..n-1, creating the missing ones in one transaction (so a
    crash leaves all of them or none), and the parent handed from its claimer to its shards
    (worker = NULL). Returns all n children, ordered by shard index."""
    have = {j.shard_index for j in shard_jobs(session=session, parent_id=parent_id)}
    owner_id = session.scalar(select(Job.owner_id).where(Job.id == parent_id))  # shards are the parent's
    now = utcnow()
    for i in range(n):
        if i not in have:
            session.add(_queued_job(kind="fisher", spec=spec, spec_hash=spec_hash, owner_id=owner_id,
                                    parent_id=parent_id, shard_index=i))
    session.execute(
        update(Job)
        .where(Job.id == parent_id, Job.status == "running")
        .values(worker=None, heartbeat_at=now, message=f"0/{n} shards done")
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return shard_jobs(session=session, parent_id=parent_id)


def claim_finish(*, session: Session, job_id: int, worker: str, stale_after_s: float) -> bool:
    """Atomically take the combining step of a sharded parent: it is `running`, and nobody holds
    it (worker NULL after the fan-out) or its holder's heartbeat is older than stale_after_s.
    A duplicate finish_shards delivery gets False and does nothing."""
    now = utcnow()
    cutoff = now - timedelta(seconds=stale_after_s)
    res = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.status == "running",
            Job.worker.is_(None) | (Job.worker == worker) | (Job.heartbeat_at < cutoff),
        )
        .values(worker=worker[:255], heartbeat_at=now, message="combining shards")
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return res.rowcount == 1  # type: ignore[attr-defined]


def _must(session: Session, job_id: int) -> Job:
    job = get_job(session=session, job_id=job_id)
    if job is None:
        raise LookupError(f"job: no job with id {job_id}")
    return job


# -- results ----------------------------------------------------------------------------------
def save_result(
    *,
    session: Session,
    job_id: int,
    result: Any,
    store: ArtifactStore | None = None,
    artifacts: list[ArtifactInfo] | None = None,
) -> None:
    """Store a compute.results.JobResult for a job, replacing whatever an earlier delivery of the
    same job stored (idempotent: rows are never duplicated). Tensors go to `store` as safetensors,
    `result.files` are moved under the job's artifact folder; `artifacts` adds prepared ones."""
    job = _must(session, job_id)
    infos: list[ArtifactInfo] = list(artifacts or [])
    if result.tensors or result.files:
        if store is None:
            raise ValueError("store: an ArtifactStore is needed for results with tensors or files")
        for kind, tensors in result.tensors.items():
            infos.append(store.save_tensors(job.id, kind, tensors))
        for kind, path in result.files.items():
            infos.append(store.save_folder(job.id, kind, path))
    for table in (LayerStatRow, HeatmapRow, SeriesRow, ArtifactRow):
        session.execute(delete(table).where(table.job_id == job.id))
    job.summary = _clean(result.summary or {})
    for i, s in enumerate(result.layer_stats):
        session.add(
            LayerStatRow(
                job_id=job.id,
                position=i,
                param=s.param,
                module=s.module,
                layer=s.layer,
                group=s.group,
                values=_clean(s.values),
            )
        )
    for i, h in enumerate(result.heatmaps):
        session.add(
            HeatmapRow(
                job_id=job.id,
                position=i,
                name=h.name,
                x_labels=_clean(list(h.x_labels)),
                y_labels=_clean(list(h.y_labels)),
                z=_clean(h.z),
                meta=_clean(h.meta or {}),
            )
        )
    for i, p in enumerate(result.series):
        value = float(p.value)
        session.add(
            SeriesRow(
                job_id=job.id,
                position=i,
                name=p.name,
                step=float(p.step),
                value=value if math.isfinite(value) else None,
            )
        )
    seen: set[str] = set()
    for info in infos:
        if info.kind in seen:
            continue
        seen.add(info.kind)
        session.add(
            ArtifactRow(
                job_id=job.id,
                kind=info.kind,
                path=info.path,
                sha256=info.sha256,
                bytes=info.bytes,
                is_dir=info.is_dir,
                created_at=utcnow(),
            )
        )
    session.commit()
    session.expire(job)


def get_artifact(*, session: Session, job_id: int, kind: str) -> ArtifactRow | None:
    return session.scalar(
        select(ArtifactRow).where(ArtifactRow.job_id == job_id, ArtifactRow.kind == kind)
    )


def _iso(dt: datetime | None) -> str | None:
    return dt.isoformat() if dt is not None else None


def job_dict(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "kind": job.kind,
        "spec": job.spec,
        "spec_hash": job.spec_hash,
        "model_revision": job.model_revision,
        "revisions": job.revisions,
        "status": job.status,
        "progress": job.progress,
        "message": job.message,
        "error": job.error,
        "share_token": job.share_token,
        "created_at": _iso(job.created_at),
        "started_at": _iso(job.started_at),
        "finished_at": _iso(job.finished_at),
        "heartbeat_at": _iso(job.heartbeat_at),
        "worker": job.worker,
        "attempts": job.attempts,
        "cancel_requested": job.cancel_requested,
        "parent_id": job.parent_id,
        "shard_index": job.shard_index,
        "owner_id": job.owner_id,
        "shared": job.shared,
    }


def artifact_dict(a: ArtifactRow) -> dict[str, Any]:
    return {
        "kind": a.kind,
        "path": a.path,
        "sha256": a.sha256,
        "bytes": a.bytes,
        "is_dir": a.is_dir,
    }


def result_dict(*, session: Session, job: Job) -> dict[str, Any]:
    """The JSON of GET /api/results/{token}: job metadata plus every stored result row, in the
    same shape as compute.results.JobResult.to_dict() (so plot builders take either)."""
    job_id = job.id
    stats = session.scalars(
        select(LayerStatRow).where(LayerStatRow.job_id == job_id).order_by(LayerStatRow.position)
    )
    heatmaps = session.scalars(
        select(HeatmapRow).where(HeatmapRow.job_id == job_id).order_by(HeatmapRow.position)
    )
    series = session.scalars(
        select(SeriesRow).where(SeriesRow.job_id == job_id).order_by(SeriesRow.position)
    )
    arts = session.scalars(
        select(ArtifactRow).where(ArtifactRow.job_id == job_id).order_by(ArtifactRow.kind)
    )
    return {
        "job": job_dict(job),
        "kind": job.kind,
        "summary": job.summary or {},
        "layer_stats": [
            {
                "param": s.param,
                "module": s.module,
                "layer": s.layer,
                "values": s.values,
                "group": s.group,
            }
            for s in stats
        ],
        "heatmaps": [
            {
                "name": h.name,
                "x_labels": h.x_labels,
                "y_labels": h.y_labels,
                "z": h.z,
                "meta": h.meta,
            }
            for h in heatmaps
        ],
        "series": [{"name": p.name, "step": p.step, "value": p.value} for p in series],
        "artifacts": [artifact_dict(a) for a in arts],
    }
