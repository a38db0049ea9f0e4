"""The record of a cancelled job says what really happened (issue 28, item 3): a job whose
worker died while it ran, after its owner asked to cancel it, is recorded as having started,
not as "cancelled before it ran" (what a later delivery wrote before); a job cancelled while
still queued keeps that message."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from compute.contract.settings import Settings


def test_a_started_job_is_never_recorded_as_cancelled_before_it_ran(tmp_path: Path) -> None:
    from app import services
    from compute.worker.lifecycle import claim
    from storage import repo

    settings = Settings(fisherlens_home=tmp_path, database_url=None, redis_url=None,
                        job_stale_after_s=60)
    with services.sessions(settings)() as s:
        ran = repo.create_job(session=s, kind="fisher", spec={"model": "arith-base"}, spec_hash="a")
        repo.mark_running(session=s, job_id=ran.id, worker="dead-worker")
        repo.request_cancel(session=s, job_id=ran.id)  # running: cancel_requested only
        row = repo.get_job(session=s, job_id=ran.id)
        row.heartbeat_at = row.heartbeat_at - timedelta(minutes=10)  # its worker died long ago
        s.commit()
        queued = repo.create_job(session=s, kind="fisher", spec={"model": "arith-base"}, spec_hash="b")
        job = repo.get_job(session=s, job_id=queued.id)
        job.cancel_requested = True  # a cancel that raced its delivery
        s.commit()
        ran_id, queued_id = ran.id, queued.id
    assert claim(settings, ran_id, "new-worker") == "cancelled"  # the redelivery after the death
    assert claim(settings, queued_id, "new-worker") == "cancelled"
    got = {j: services.get_job(settings, j) for j in (ran_id, queued_id)}
    assert got[ran_id]["status"] == "cancelled"
    assert "it had started 1 time(s)" in got[ran_id]["message"], got[ran_id]
    assert got[queued_id]["message"] == "cancelled before it ran"
