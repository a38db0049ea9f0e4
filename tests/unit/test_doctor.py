"""`fisherlens doctor` against real services: the embedded default, a scale-out configuration
(PostgreSQL, Redis, an S3-compatible store started here) where every check passes, and broken
settings where each failing service is named with what to fix."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from app.cli import main
from tests.s3 import MotoS3, moto_s3

SCALEOUT_ENV = ("DATABASE_URL", "REDIS_URL", "ARTIFACT_URL", "AWS_ENDPOINT_URL",
                "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                "ALLOWED_MODEL_ROOTS", "ARTIFACT_ROOT")


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoS3]:
    with moto_s3() as server:
        yield server


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for k in SCALEOUT_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("FISHERLENS_HOME", str(tmp_path))
    return tmp_path


def _doctor() -> tuple[int, dict[str, tuple[str, str]]]:
    out = CliRunner().invoke(main, ["doctor"])
    lines = {}
    for line in out.output.splitlines():
        if line[:5].strip() in ("ok", "warn", "FAIL"):
            status, rest = line[:5].strip(), line[6:]
            lines[rest[:15].strip()] = (status, rest[16:])
    return out.exit_code, lines


def test_embedded_default_is_healthy(home: Path) -> None:
    from storage.db import upgrade

    upgrade(f"sqlite:///{home / 'fisherlens.db'}")
    code, lines = _doctor()
    assert code == 0, lines
    assert lines["database"][0] == "ok" and "schema at head" in lines["database"][1]
    assert lines["broker"] == ("ok", f"filesystem queue {home / 'queue'} (embedded: this machine only)")
    assert lines["artifact store"] == ("ok", f"{home / 'artifacts'}: write, read back and delete ok")
    assert lines["model roots"][0] == "warn" and "run `fisherlens zoo build`" in lines["model roots"][1]
    assert lines["deployment"][0] == "ok" and "embedded" in lines["deployment"][1]
    assert list((home / "artifacts").iterdir()) == []  # the probe is gone
    # no worker is a warning, not a failure: a worker's start script runs doctor first
    assert lines["workers"] == ("warn", "no live worker: queued jobs wait until one starts (`fisherlens worker`)")

    from app import ceiling
    from storage import workers
    from storage.db import make_engine, make_session_factory

    with make_session_factory(make_engine(f"sqlite:///{home / 'fisherlens.db'}"))() as s:
        workers.publish(session=s, name="gpu0@box", host="box", device="cuda:0", device_name="H100",
                        free_bytes=62 * 10**9, total_bytes=80 * 10**9, torch_version="2.13.0")
    ceiling._workers_cache.clear()
    code, lines = _doctor()
    assert code == 0
    assert lines["workers"] == ("ok", "1 live: gpu0@box (cuda:0, 62 GB free); details: `fisherlens workers`")


def test_scale_out_settings_all_pass(home: Path, s3: MotoS3, monkeypatch) -> None:
    from tests.integration.conftest import REDIS_URL, _redis_or_skip
    from tests.pg import pg_schema_url

    _redis_or_skip()
    models = home / "models"
    models.mkdir()
    with pg_schema_url("fl_doctor") as db:
        for k, v in {"DATABASE_URL": db, "REDIS_URL": REDIS_URL, "ALLOWED_MODEL_ROOTS": str(models),
                     "ARTIFACT_URL": s3.url(f"doc{secrets.token_hex(3)}"), **s3.env}.items():
            monkeypatch.setenv(k, v)
        from storage.db import upgrade

        upgrade(db)
        code, lines = _doctor()
    assert code == 0, lines
    assert lines["database"][0] == "ok" and "postgresql+psycopg://postgres@" in lines["database"][1]
    assert lines["broker"] == ("ok", f"{REDIS_URL}: PING answered")
    assert lines["artifact store"][0] == "ok"
    assert lines["artifact store"][1].startswith(f"{os.environ['ARTIFACT_URL']}: write, read back")
    assert str(models) in lines["model roots"][1]
    assert lines["deployment"] == ("ok", "database, broker and artifact store are network "
                                   "services: ready for workers on other machines")
    assert s3.keys(os.environ["ARTIFACT_URL"].split("/", 3)[3]) == []  # the probe is gone


def test_each_broken_service_is_named_with_its_fix(home: Path, s3: MotoS3, monkeypatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens on port 1
    monkeypatch.setenv("ARTIFACT_URL", "s3://no-such-bucket/x")
    monkeypatch.setenv("ALLOWED_MODEL_ROOTS", str(home / "not-mounted"))
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    code, lines = _doctor()
    assert code == 1
    assert lines["broker"][0] == "FAIL"
    assert "cannot connect" in lines["broker"][1] and "check REDIS_URL" in lines["broker"][1]
    assert lines["artifact store"][0] == "FAIL"
    assert "bucket 'no-such-bucket' does not exist" in lines["artifact store"][1]
    assert lines["model roots"] == ("FAIL", f"ALLOWED_MODEL_ROOTS: {home / 'not-mounted'} not a "
                                    "readable folder on this machine (mount it, or remove it from the list)")
    assert lines["deployment"][0] == "warn" and "SQLite; set DATABASE_URL" in lines["deployment"][1]


def test_bad_artifact_url_is_a_settings_failure(home: Path, monkeypatch) -> None:
    monkeypatch.setenv("ARTIFACT_URL", "minio://bucket")
    code, lines = _doctor()
    assert code == 1 and lines["settings"][0] == "FAIL"
    assert "ARTIFACT_URL: Value error, ARTIFACT_URL: 'minio://bucket' is not an object-store URL" in (
        lines["settings"][1])
