"""Parent jobs that fan out into child jobs (compute/jobs/runners.py's child protocol).

A parent is claimed like any job, then `create_children` writes its n child rows (queued, the
parent's kind, spec and owner; shard_index = 0..n-1) and hands the parent from its claimer to
its children (worker NULL, n_children = n) in one transaction. When every child succeeded, the
combining step is taken in two compare-and-sets on `jobs.combine_state`:

    NULL --request_combine--> 'queued' --claim_combine--> 'running' --> succeeded/failed

request_combine is won by exactly one caller (the child that completed the set, or a
reconciler), which then sends the one finish message; claim_combine is won by exactly one
delivery of that message. A combiner that died is released back to 'queued' by
release_combine (a compare-and-set on its worker name), and a 'queued' whose message was lost is
re-sent once per period (mark_combine_resent).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import exists, func, select, update
from sqlalchemy.orm import Session, aliased

from storage.jobs import mark_cancelled, mark_failed, must_get, queued_job, update_progress
from storage.models import FINAL_STATUSES, Job, utcnow


def shard_jobs(*, session: Session, parent_id: int) -> list[Job]:
    """The parent's child jobs, ordered by index (re-read from the database)."""
    q = select(Job).where(Job.parent_id == parent_id).order_by(Job.shard_index)
    return list(session.scalars(q.execution_options(populate_existing=True)))


def create_children(*, session: Session, parent_id: int, n: int) -> list[Job]:
    """The parent's children 0..n-1, creating the missing ones in one transaction (so a crash
    leaves all of them or none), with the parent's kind, spec, resolved refs and owner; the
    parent is handed from its claimer to its children (worker NULL, n_children = n, combine_state NULL).
    Returns all n children, ordered by index."""
    parent = must_get(session, parent_id)
    have = {j.shard_index for j in shard_jobs(session=session, parent_id=parent_id)}
    for i in range(n):
        if i not in have:
            session.add(queued_job(
                kind=parent.kind, spec=dict(parent.spec or {}), spec_hash=parent.spec_hash,
                model_revision=parent.model_revision, owner_id=parent.owner_id,
                refs=parent.refs, parent_id=parent_id, shard_index=i, shared=bool(parent.shared),
            ))
    session.execute(
        update(Job)
        .where(Job.id == parent_id, Job.status == "running")
        .values(worker=None, heartbeat_at=utcnow(), n_children=n, combine_state=None,
                message=f"0/{n} children done")
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return shard_jobs(session=session, parent_id=parent_id)


def expected_children(parent: Job, children: list[Job]) -> int:
    """How many children the parent fanned out into (rows of databases before migration 0004
    have no n_children: their child rows are all there is)."""
    return parent.n_children if parent.n_children is not None else len(children)


def refresh_parent_progress(*, session: Session, parent_id: int) -> None:
    """The parent's progress: 0.95 x the mean of its children's (a succeeded child counts 1)."""
    children = shard_jobs(session=session, parent_id=parent_id)
    if not children:
        return
    n = max(len(children), expected_children(must_get(session, parent_id), children))
    mean = sum(1.0 if j.status == "succeeded" else j.progress for j in children) / n
    done = sum(j.status == "succeeded" for j in children)
    update_progress(session=session, job_id=parent_id, fraction=0.95 * mean,
                    message=f"{done}/{n} children done")


def fail_parent(*, session: Session, parent_id: int, message: str) -> bool:
    """A child failed for good: the parent fails with `message` (which names the child) and its
    queued children are cancelled. False when the parent had already ended."""
    parent = must_get(session, parent_id)
    if parent.status in FINAL_STATUSES:
        return False
    mark_failed(session=session, job_id=parent_id, error=message, message=message[:500])
    for j in shard_jobs(session=session, parent_id=parent_id):
        if j.status == "queued":
            mark_cancelled(session=session, job_id=j.id, message="a sibling child job failed")
    return True


def _all_children_succeeded() -> Any:
    """SQL condition on a jobs row: it has n_children (or, before 0004, >= 1) children and
    every one of them succeeded."""
    child = aliased(Job)
    count = select(func.count(child.id)).where(child.parent_id == Job.id).scalar_subquery()
    unfinished = exists().where(child.parent_id == Job.id, child.status != "succeeded")
    return (count >= func.coalesce(Job.n_children, 1)) & ~unfinished


def request_combine(*, session: Session, parent_id: int) -> bool:
    """Compare-and-set NULL -> 'queued' on a running parent all of whose children succeeded.
    True for exactly one caller, which must then send the finish message."""
    res = session.execute(
        update(Job)
        .where(Job.id == parent_id, Job.status == "running", Job.worker.is_(None),
               Job.combine_state.is_(None), _all_children_succeeded())
        .values(combine_state="queued", heartbeat_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return res.rowcount == 1  # type: ignore[attr-defined]


def claim_combine(*, session: Session, parent_id: int, worker: str, stale_after_s: float) -> bool:
    """Compare-and-set -> 'running' for `worker`: the combine was requested ('queued'; or NULL
    with no holder, for a finish message sent before migration 0004), or its holder is this
    worker's name or silent for stale_after_s. All children must have succeeded. True for
    exactly one of two concurrent deliveries; the other does nothing."""
    cutoff = utcnow() - timedelta(seconds=stale_after_s)
    holder_gone = (Job.worker == worker) | Job.heartbeat_at.is_(None) | (Job.heartbeat_at < cutoff)
    takeable = (
        (Job.combine_state == "queued")
        | (Job.combine_state.is_(None) & Job.worker.is_(None))
        | ((Job.combine_state == "running") & holder_gone)
    )
    res = session.execute(
        update(Job)
        .where(Job.id == parent_id, Job.status == "running", Job.cancel_requested.is_(False),
               takeable, _all_children_succeeded())
        .values(combine_state="running", worker=worker[:255], heartbeat_at=utcnow(),
                message="combining the children's results")
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return res.rowcount == 1  # type: ignore[attr-defined]


def release_combine(*, session: Session, parent_id: int, worker: str | None) -> bool:
    """The combiner `worker` died: 'running' -> 'queued' (the caller re-sends the finish
    message). A compare-and-set on the holder, so two reconcilers release it once."""
    who = Job.worker.is_(None) if worker is None else Job.worker == worker
    res = session.execute(
        update(Job)
        .where(Job.id == parent_id, Job.status == "running", Job.combine_state == "running", who)
        .values(combine_state="queued", worker=None, heartbeat_at=utcnow(),
                message=f"re-queued the combine: {worker or 'its worker'} was lost")
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return res.rowcount == 1  # type: ignore[attr-defined]


def mark_combine_resent(*, session: Session, parent_id: int, older_than_s: float) -> bool:
    """A requested combine whose message may be lost: True for one caller per older_than_s
    (heartbeat_at of a 'queued' combine is when its message was last sent)."""
    now = utcnow()
    res = session.execute(
        update(Job)
        .where(Job.id == parent_id, Job.status == "running", Job.combine_state == "queued",
               Job.heartbeat_at < now - timedelta(seconds=older_than_s))
        .values(heartbeat_at=now)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return res.rowcount == 1  # type: ignore[attr-defined]
