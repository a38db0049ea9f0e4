"""compute.worker.recover() on a real database and the real filesystem queue (in-process, fast):
jobs left `running` by dead workers are re-queued once or failed, never left running."""

from __future__ import annotations

import base64
import json
from datetime import timedelta
from pathlib import Path

import pytest

from app import services
from app.settings import get_settings
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
    monkeypatch.setenv("FISHERLENS_QUEUE", "fisherlens")
    return get_settings()


def test_recover_requeues_fails_and_finishes(settings) -> None:
    from compute.worker import MAX_ATTEMPTS, recover

    assert MAX_ATTEMPTS == 2
    old = utcnow() - timedelta(seconds=settings.job_stale_after_s + 5)
    with services.sessions(settings)() as s:

        def running(worker: str, attempts: int, heartbeat=None, **kw):
            j = repo.create_job(session=s, kind="fisher", spec={}, spec_hash="h", **kw)
            for _ in range(attempts):
                repo.claim_job(session=s, job_id=j.id, worker=worker, stale_after_s=0)
            j = repo.get_job(session=s, job_id=j.id)
            if heartbeat is not None:
                j.heartbeat_at = heartbeat
                s.commit()
            return j.id

        stale_once = running("dead@m1", 1, heartbeat=old)
        mine_twice = running("me@m2", 2)  # same name as the starting worker: its process died
        alive = running("busy@m3", 1)
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
        p.heartbeat_at = old
        s.commit()
        bad_parent = running("x@m", 1)
        bad = repo.create_job(
            session=s, kind="fisher", spec={}, spec_hash="h", parent_id=bad_parent, shard_index=0
        )
        repo.mark_failed(session=s, job_id=bad.id, error="boom")

    actions = dict(recover(settings, hostname="me@m2"))
    assert actions == {
        stale_once: "requeued",
        mine_twice: "failed",
        parent: "finishing",
        bad_parent: "failed",
    }
    with services.sessions(settings)() as s:
        status = {
            j: repo.get_job(session=s, job_id=j).status
            for j in (stale_once, mine_twice, alive, parent, bad_parent)
        }
        failed = repo.get_job(session=s, job_id=mine_twice)
    assert status == {
        stale_once: "queued",
        mine_twice: "failed",
        alive: "running",
        parent: "running",
        bad_parent: "failed",
    }
    assert "worker lost" in failed.message and "me@m2" in failed.error
    assert _queued(settings) == [
        ("fisherlens.run_job", stale_once),
        ("fisherlens.finish_shards", parent),
    ]
    # A second pass right away changes nothing and queues nothing more.
    assert recover(settings, hostname="me@m2") == []
    assert len(_queued(settings)) == 2
