"""compute.worker.reconcile() on a real database and the real filesystem queue (in-process, fast):
jobs left `running` by dead workers are re-queued once or failed, never left running; queued jobs
whose message is lost are re-sent once; sharded parents are finished or failed."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from app import services
from compute.contract.settings import get_settings
from storage import repo
from storage.models import utcnow


def _queued(settings) -> list[tuple[str, int]]:
    out = []
    for f in sorted((Path(settings.queue_dir) / "messages").glob("*.msg")):
        msg = json.loads(f.read_text())
        out.append((msg["headers"]["task"], json.loads(base64.b64decode(msg["body"]))[0][0]))
    return sorted(out, key=lambda t: t[1])


@pytest.fixture
def settings(fl_home: Path, monkeypatch: pytest.MonkeyPatch):
    import compute.runtime.celery_app as ca

    monkeypatch.setenv("FISHERLENS_QUEUE", "fisherlens")
    monkeypatch.setenv("RECONCILE_QUEUED_AFTER_S", "60")
    ca._apps.clear()
    return get_settings()


def _dead_pid() -> int:
    """The pid of a process of this host that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_reconcile_requeues_fails_finishes_and_resends(settings) -> None:
    from compute.runtime.celery_app import send_job
    from compute.worker import MAX_ATTEMPTS, default_worker_name, reconcile

    assert MAX_ATTEMPTS == 2
    old = utcnow() - timedelta(seconds=settings.job_stale_after_s + 5)
    long_ago = utcnow() - timedelta(seconds=settings.reconcile_queued_after_s + 5)
    dead_here = default_worker_name(pid=_dead_pid())
    alive_here = default_worker_name()  # this process: alive
    with services.sessions(settings)() as s:

        def running(worker: str, attempts: int, heartbeat=None, **kw):
            j = repo.create_job(session=s, kind="fisher", spec={"shards": 2}, spec_hash="h", **kw)
            for _ in range(attempts):
                repo.claim_job(session=s, job_id=j.id, worker=worker, stale_after_s=0)
            j = repo.get_job(session=s, job_id=j.id)
            if heartbeat is not None:
                j.heartbeat_at = heartbeat
                s.commit()
            return j.id

        def queued(created=long_ago):
            j = repo.create_job(session=s, kind="fisher", spec={}, spec_hash="h")
            j.created_at = created
            s.commit()
            return j.id

        stale_once = running("dead@m1", 1, heartbeat=old)
        mine_twice = running("me@m2", 2)  # same name as the starting worker: its process died
        alive = running("busy@m3", 1)
        pid_dead = running(dead_here, 1)  # fresh heartbeat, but its process is gone
        pid_alive = running(alive_here, 1)  # a sibling on this host that is alive
        parent = running("x@m", 1)
        shards = [
            repo.create_job(
                session=s, kind="fisher", spec={}, spec_hash="h", parent_id=parent, shard_index=i
            ).id
            for i in range(2)
        ]
        for sid in shards:
            repo.mark_succeeded(session=s, job_id=sid)
        p = repo.get_job(session=s, job_id=parent)
        p.worker, p.heartbeat_at = None, long_ago  # fanned out, finish_shards never came
        s.commit()
        bad_parent = running("x@m", 1)
        bad = repo.create_job(
            session=s, kind="fisher", spec={}, spec_hash="h", parent_id=bad_parent, shard_index=0
        )
        repo.mark_failed(session=s, job_id=bad.id, error="boom")
        lost = queued()  # its message is nowhere: lost
        waiting = queued()  # its message waits in the queue
        fresh = queued(created=utcnow())  # just submitted: its message may be on its way
    send_job(settings, waiting)

    actions = dict(reconcile(settings, hostname="me@m2"))
    assert actions == {
        stale_once: "requeued",
        mine_twice: "failed",
        pid_dead: "requeued",
        parent: "finishing",
        bad_parent: "failed",
        lost: "re-sent",
    }
    with services.sessions(settings)() as s:
        status = {
            j: repo.get_job(session=s, job_id=j).status
            for j in (stale_once, mine_twice, alive, pid_dead, pid_alive, parent, bad_parent)
        }
        failed = repo.get_job(session=s, job_id=mine_twice)
        assert repo.get_job(session=s, job_id=pid_dead).attempts == 1  # the claim adds the next
    assert status == {
        stale_once: "queued",
        mine_twice: "failed",
        alive: "running",
        pid_dead: "queued",
        pid_alive: "running",
        parent: "running",
        bad_parent: "failed",
    }
    assert "worker lost" in failed.message and "me@m2" in failed.error
    assert _queued(settings) == sorted(
        [
            ("fisherlens.run_job", stale_once),
            ("fisherlens.run_job", pid_dead),
            ("fisherlens.finish_shards", parent),
            ("fisherlens.run_job", lost),
            ("fisherlens.run_job", waiting),
        ],
        key=lambda t: t[1],
    )
    assert fresh not in {j for _, j in _queued(settings)}
    # A second pass right away changes nothing and queues nothing more.
    assert reconcile(settings, hostname="me@m2") == []
    assert len(_queued(settings)) == 5


def test_two_reconcilers_release_a_dead_job_once(settings) -> None:
    """release_lost is a compare-and-set on (worker, attempts): after one reconciler re-queued
    the job and a worker claimed it again, a second reconciler that judged the first holder dead
    changes nothing (so the job cannot be handed out twice)."""
    with services.sessions(settings)() as s:
        j = repo.create_job(session=s, kind="fisher", spec={}, spec_hash="h")
        repo.claim_job(session=s, job_id=j.id, worker="dead@m", stale_after_s=0)
        args = dict(session=s, job_id=j.id, worker="dead@m", attempts=1, requeue=True)
        assert repo.release_lost(**args, message="re-queued") is True
        assert repo.claim_job(session=s, job_id=j.id, worker="new@m", stale_after_s=300)
        assert repo.release_lost(**args, message="re-queued") is False
        row = repo.get_job(session=s, job_id=j.id)
        assert (row.status, row.worker, row.attempts) == ("running", "new@m", 2)
        # mark_resent: one caller wins per period
        q = repo.create_job(session=s, kind="fisher", spec={}, spec_hash="h")
        q.created_at = utcnow() - timedelta(seconds=120)
        s.commit()
        assert repo.mark_resent(session=s, job_id=q.id, older_than_s=60) is True
        assert repo.mark_resent(session=s, job_id=q.id, older_than_s=60) is False


def test_fault_points_are_off_unless_testing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fault point needs FISHERLENS_TESTING=1, its name in FISHERLENS_FAULT_POINTS and a
    FISHERLENS_FAULT_DIR: without any one of them it returns at once and writes nothing."""
    from compute.runtime.control import fault_point

    monkeypatch.setenv("FISHERLENS_FAULT_POINTS", "after_claim")
    monkeypatch.setenv("FISHERLENS_FAULT_DIR", str(tmp_path))
    monkeypatch.delenv("FISHERLENS_TESTING", raising=False)
    assert fault_point("after_claim") is False
    monkeypatch.setenv("FISHERLENS_TESTING", "1")
    assert fault_point("mid_job") is False  # not listed
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "after_claim.release").touch()  # released in advance: passes through once
    assert fault_point("after_claim", "job=1") is True
    assert (tmp_path / "after_claim.reached").read_text().startswith(f"pid={os.getpid()}")
    assert fault_point("after_claim") is False  # one-shot


def test_reconcile_resends_a_lost_or_orphaned_combine_once(settings) -> None:
    """A parent whose children all succeeded: combine 'queued' but its finish message lost ->
    re-sent once per period; 'running' under a dead combiner -> released to 'queued' and
    re-sent once; 'running' under a live combiner -> left alone."""
    from compute.worker import default_worker_name, reconcile

    long_ago = utcnow() - timedelta(seconds=settings.reconcile_queued_after_s + 5)

    def parent(s, state: str, worker: str | None) -> int:
        p = repo.create_job(session=s, kind="fisher", spec={}, spec_hash="h")
        repo.claim_job(session=s, job_id=p.id, worker="p@x", stale_after_s=0)
        for c in repo.create_children(session=s, parent_id=p.id, n=2):
            repo.claim_job(session=s, job_id=c.id, worker="c@x", stale_after_s=0)
            repo.mark_succeeded(session=s, job_id=c.id)
        assert repo.request_combine(session=s, parent_id=p.id)
        if state == "running":
            assert repo.claim_combine(session=s, parent_id=p.id, worker=worker, stale_after_s=0)
        row = repo.get_job(session=s, job_id=p.id)
        row.heartbeat_at = long_ago  # requested (or last heard of) long ago
        s.commit()
        return p.id

    with services.sessions(settings)() as s:
        lost = parent(s, "queued", None)
        orphan = parent(s, "running", default_worker_name(pid=_dead_pid()))
        live = parent(s, "running", default_worker_name())  # this process: alive
        repo.heartbeat(session=s, job_id=live)
    assert dict(reconcile(settings)) == {lost: "finishing", orphan: "finishing"}
    assert _queued(settings) == [("fisherlens.finish_shards", lost),
                                 ("fisherlens.finish_shards", orphan)]
    with services.sessions(settings)() as s:
        states = {j: repo.get_job(session=s, job_id=j).combine_state for j in (lost, orphan, live)}
    assert states == {lost: "queued", orphan: "queued", live: "running"}
    assert reconcile(settings) == []  # the messages now wait in the queue: nothing more
