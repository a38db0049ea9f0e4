"""No address, ever (issue 28, item 4), on PostgreSQL with an object store (moto's S3 server)
that goes down: a submit that must read an artifact answers 503 with a short message and
Retry-After, naming neither the store's address nor its error (before: 422 with
"EndpointConnectionError: Could not connect to the endpoint URL: http://127.0.0.1:.../art/45/
fisher.safetensors"); /api/health reports the store; the job limit's 429 carries Retry-After."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from compute.contract.settings import Settings
from tests.pg import pg_schema_url
from tests.s3 import MotoS3, moto_s3

pytestmark = pytest.mark.postgres


@pytest.fixture
def s3() -> Iterator[MotoS3]:
    with moto_s3() as server:
        yield server


@pytest.fixture
def pg_url() -> Iterator[str]:
    with pg_schema_url("fl_store_down") as url:
        yield url


def test_store_down_at_submit_is_503_without_its_address(s3: MotoS3, pg_url: str, tmp_path: Path) -> None:
    from app import services
    from app.web import create_app
    from compute.contract.jobresult import JobResult
    from storage import repo, users
    from storage.artifacts import open_store

    zoo = tmp_path / "zoo" / "arith-base"
    zoo.mkdir(parents=True)
    (zoo / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 2}))
    settings = Settings(fisherlens_home=tmp_path, database_url=pg_url, redis_url=None,
                        artifact_url=s3.url("down"), aws_endpoint_url=s3.endpoint,
                        aws_access_key_id="testing", aws_secret_access_key="testing",
                        aws_default_region="us-east-1", auth_required=True,
                        public_url="http://testserver", max_active_jobs=1,
                        allowed_model_roots=str(tmp_path / "models"))
    (tmp_path / "models").mkdir()
    app = create_app(settings)
    with services.sessions(settings)() as s:
        u = users.create_user(session=s, name="alice", password="pw-alice-123")
        token, _ = users.issue_token(session=s, user=u)
        job = repo.create_job(session=s, kind="fisher", spec={"model": "arith-base"}, spec_hash="f",
                              owner_id=u.id, refs={})
        repo.mark_running(session=s, job_id=job.id, worker="test")
        repo.save_result(session=s, job_id=job.id, store=open_store(settings),
                         result=JobResult(kind="fisher", summary={}, tensors={"fisher": {"w": torch.rand(4, 3)}}))
        repo.mark_succeeded(session=s, job_id=job.id)
        n = job.id
    # the web on another machine: its own cache, without a copy (a read must download)
    settings = settings.model_copy(update={"artifact_cache_dir": tmp_path / "web-cache"})
    app = create_app(settings)
    client = TestClient(app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {token}"})
    assert client.get("/api/health").json() == {"database": "ok", "broker": "ok", "store": "ok", "ok": True}

    s3.stop()
    try:
        r = client.post("/api/jobs", json={"kind": "mask", "spec": {"fisher": f"job:{n}", "density": 0.1}})
        assert r.status_code == 503, r.text
        assert int(r.headers["Retry-After"]) >= 1
        text = r.text
        assert str(s3.port) not in text and "127.0.0.1" not in text and "Error" not in text, text
        assert "artifact store cannot be reached" in r.json()["detail"]
        r = client.get("/api/health")
        assert r.status_code == 503 and r.json()["store"] == "unreachable" and str(s3.port) not in r.text
        assert int(r.headers["Retry-After"]) >= 1
    finally:
        s3.start()

    # the job limit (max_active_jobs=1): the second active job is 429 with Retry-After
    r = client.post("/api/jobs", json={"kind": "mask", "spec": {"fisher": f"job:{n}", "density": 0.1}})
    assert r.status_code == 201, r.text  # the store is back: the same submit is accepted

    # this machine's cache now holds a copy of job n's Fisher: a link to it is refused like a
    # link into the store (the cache is other users' bytes too)
    cached = [p for p in (tmp_path / "web-cache").rglob("*") if p.is_file() and p.suffix == ".safetensors"]
    assert cached, list((tmp_path / "web-cache").rglob("*"))
    folder = tmp_path / "models" / "linked-cache"
    folder.mkdir()
    (folder / "fisher.safetensors").symlink_to(cached[0])
    r = client.post("/api/jobs", json={"kind": "mask", "spec": {"fisher": str(folder), "density": 0.3}})
    assert r.status_code == 422 and "links into the artifact store" in r.text, r.text
    r = client.post("/api/jobs", json={"kind": "mask", "spec": {"fisher": f"job:{n}", "density": 0.2}})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1, (r.status_code, r.headers)
