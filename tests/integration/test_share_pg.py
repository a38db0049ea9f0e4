"""The share page on PostgreSQL: its own connection pool has no pre-ping, so a connection that
the database dropped (a restart, an idle timeout) must be retried once on a fresh one, never a
500 for the reader. The server side of the connections is killed with pg_terminate_backend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from compute.contract.jobresult import JobResult, SeriesPoint
from tests.integration.conftest import PG_URL, _pg_schema


@pytest.fixture
def pg_url() -> Iterator[str]:
    yield from _pg_schema()


def test_share_page_survives_dropped_connections(pg_url: str, tmp_path):
    from app import services
    from app.web import create_app
    from compute.contract.settings import Settings
    from storage import repo
    from storage.db import make_engine

    app_name = "fl_share_" + pg_url.rsplit("%3D", 1)[1]  # only this test's connections
    url = f"{pg_url}&application_name={app_name}"
    settings = Settings(fisherlens_home=tmp_path, database_url=url, redis_url=None)
    client = TestClient(create_app(settings), base_url="http://127.0.0.1")  # embedded: a loopback Host
    result = JobResult(kind="fisher", summary={"gini": 0.5},
                       series=[SeriesPoint("concentration", 0.1, 0.5), SeriesPoint("concentration", 1.0, 1.0)])
    with services.sessions(settings)() as s:
        job = repo.create_job(session=s, kind="fisher", spec={"model": "m"}, spec_hash="pg")
        repo.claim_job(session=s, job_id=job.id, worker="t", stale_after_s=60)
        repo.save_result(session=s, job_id=job.id, result=result)
        repo.mark_succeeded(session=s, job_id=job.id)
        token = job.share_token
    first = client.get(f"/r/{token}")
    assert first.status_code == 200 and "fl-fig-0" in first.text
    admin = make_engine(PG_URL)
    with admin.begin() as conn:  # the database drops every connection this app holds
        killed = conn.execute(text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                   "WHERE application_name = :a"), {"a": app_name}).scalar()
    admin.dispose()
    assert killed >= 1
    again = client.get(f"/r/{token}")
    assert again.status_code == 200 and again.text == first.text
