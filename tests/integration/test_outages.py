"""Outages of PostgreSQL and Redis under a real worker process and the real web app (issue 21):
both servers are private to the test (PrivatePostgres, PrivateRedis), so they can be stopped
and started without touching the shared ones.

PostgreSQL stopped while a job runs: the worker computes on, holds the outcome until the
database is back and records it then (no failure, no second run, no attempt burnt); meanwhile
the web answers 503 with a short message naming no address, and /api/health says which service
is missing. Redis stopped: a submit is 503, again without the broker's address."""

from __future__ import annotations

import re
import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from app import services
from storage.models import LayerStatRow

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

SMALL = {"model": "arith-base", "task": "arithmetic", "prompts": 4, "samples": 2,
         "max_new_tokens": 6}


def _wait_log(stack, pattern: str, timeout: float = 180.0) -> None:
    """Wait until a worker logs `pattern` (the bound only guards against a hang)."""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, stack.logs()):
        if time.monotonic() > deadline:
            raise AssertionError(f"no worker logged {pattern!r}\n{stack.logs()}")
        time.sleep(0.2)


def _no_address(text: str, port: int) -> bool:
    return "127.0.0.1" not in text and str(port) not in text and "Error" not in text


def test_postgres_stopped_under_a_running_job_loses_nothing(
    private_pg, private_redis, private_pg_stack
) -> None:
    from app.web import create_app
    from storage import users

    stack = private_pg_stack
    web = stack.settings.model_copy(update={"auth_required": True,
                                            "public_url": "http://testserver"})
    app = create_app(web)
    with services.sessions(web)() as s:
        u = users.create_user(session=s, name="alice", password="pw-alice-123")
        token, _ = users.issue_token(session=s, user=u)
    client = TestClient(app, raise_server_exceptions=False,
                        headers={"Authorization": f"Bearer {token}"})
    assert client.get("/api/health").json() == {"database": "ok", "broker": "ok", "store": "ok", "ok": True}

    worker = stack.start_worker(faults=["mid_job"])
    job = services.submit(stack.settings, "fisher", SMALL)
    stack.wait_reached("mid_job")
    private_pg.stop()

    # the web while the database is down: 503, short, no address; health names the service
    r = client.get("/api/jobs")
    assert r.status_code == 503 and _no_address(r.text, private_pg.port), r.text
    assert "database" in r.json()["detail"] and r.headers["Retry-After"]
    r = client.get("/api/health")
    assert r.status_code == 503
    assert r.json() == {"database": "unreachable", "broker": "ok", "store": "ok", "ok": False}

    # the job goes on without the database and waits for it to record its end
    stack.release("mid_job")
    _wait_log(stack, rf"of job {job['id']} waits for it", timeout=600)
    private_pg.start()
    done = stack.wait_final(job["id"], timeout=60)  # within a minute of the database's return
    assert (done["status"], done["attempts"], done["worker"]) == ("succeeded", 1, worker.name), (
        done, worker.log.read_text(errors="replace")[-6000:])
    with services.sessions(stack.settings)() as s:
        rows = s.scalar(select(func.count()).select_from(LayerStatRow)
                        .where(LayerStatRow.job_id == job["id"]))
    assert rows and rows > 0
    log = worker.log.read_text(errors="replace")
    assert f"job {job['id']} failed" not in log and "reconciled job" not in log
    assert client.get("/api/health").json()["ok"] is True

    # its message was acked: nothing of it waits in Redis' unacked store
    import redis

    held = redis.Redis.from_url(private_redis.url).hgetall("unacked")
    assert not [raw for raw in held.values() if f"[{job['id']}]".encode() in raw], held


def test_broker_down_is_503_without_its_address(private_pg, private_redis, private_pg_stack) -> None:
    from app.web import create_app

    stack = private_pg_stack
    web = stack.settings.model_copy(update={"public_url": "http://testserver"})
    client = TestClient(create_app(web), base_url="http://127.0.0.1", raise_server_exceptions=False)
    private_redis.stop()
    r = client.post("/api/jobs", json={"kind": "fisher", "spec": SMALL})
    assert r.status_code == 503, r.text
    assert _no_address(r.text, private_redis.port) and "queue" in r.json()["detail"], r.text
    assert int(r.headers["Retry-After"]) >= 1
    r = client.get("/api/health")
    assert r.status_code == 503 and r.json()["broker"] == "unreachable"
    assert r.json()["database"] == "ok"


def test_reconciler_drops_unacked_messages_of_ended_jobs(private_redis, private_pg_stack) -> None:
    """A consumer killed before its ack leaves the message in Redis' unacked store until the
    visibility timeout; once its job has ended the reconciler drops it (as the ack would have),
    and keeps the one of a job still running."""
    import base64
    import json

    import redis

    import compute.runtime.celery_app as ca
    from compute.worker.reconciler import reconcile
    from storage import repo

    stack = private_pg_stack
    ended = services.submit(stack.settings, "fisher", SMALL | {"seed": 1})["id"]
    running = services.submit(stack.settings, "fisher", SMALL | {"seed": 2})["id"]
    with services.sessions(stack.settings)() as s:
        repo.mark_running(session=s, job_id=ended, worker="gone")
        repo.mark_succeeded(session=s, job_id=ended)
        repo.mark_running(session=s, job_id=running, worker="alive")
    r = redis.Redis.from_url(private_redis.url)
    for job_id in (ended, running):
        body = base64.b64encode(json.dumps([[job_id], {}, {}]).encode()).decode()
        payload = {"headers": {"task": ca.RUN_JOB}, "body": body,
                   "properties": {"body_encoding": "base64", "delivery_tag": f"tag-{job_id}"}}
        r.hset("unacked", f"tag-{job_id}", json.dumps([payload, "", ca.queue_name(stack.settings)]))
        r.zadd("unacked_index", {f"tag-{job_id}": time.time() - 600})  # taken 10 min ago
    reconcile(stack.settings)
    assert set(r.hkeys("unacked")) == {f"tag-{running}".encode()}
    assert set(r.zrange("unacked_index", 0, -1)) == {f"tag-{running}".encode()}
