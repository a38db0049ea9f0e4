"""storage/: migrations, repository functions and artifacts on SQLite and PostgreSQL.

PostgreSQL runs in a fresh schema per test module (search_path in the URL), dropped afterwards,
so concurrent runs on the shared `test` database do not collide.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from sqlalchemy import func, inspect, select, text

from compute.results import Heatmap, JobResult, LayerStat, SeriesPoint
from storage import repo
from storage.artifacts import ArtifactError, ArtifactStore
from storage.db import current_revision, make_engine, make_session_factory, upgrade
from storage.models import ArtifactRow, HeatmapRow, Job, LayerStatRow, SeriesRow, utcnow
from tests.conftest import require_service  # a skip on a laptop, a failure under CI

PG_URL = os.environ.get(
    "FISHERLENS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def _pg_schema_url() -> Iterator[str]:
    try:
        admin = make_engine(PG_URL, connect_args={"connect_timeout": 3})
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001
        require_service(
            f"PostgreSQL not reachable at {PG_URL} ({type(exc).__name__}); set FISHERLENS_TEST_PG_URL"
        )
    schema = f"fl_test_{secrets.token_hex(6)}"
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in PG_URL else "?"
    try:
        yield f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fl.db'}"
    else:
        yield from _pg_schema_url()


@pytest.fixture
def session(db_url: str):
    upgrade(db_url)
    engine = make_engine(db_url)
    factory = make_session_factory(engine)
    with factory() as s:
        yield s
    engine.dispose()


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "artifacts")


def _result(scale: float = 1.0) -> JobResult:
    return JobResult(
        kind="fisher",
        summary={"n_samples": 8, "gini": 0.5 * scale, "nan": float("nan")},
        layer_stats=[
            LayerStat("model.layers.0.self_attn.q_proj.weight", "q", 0, {"mean": 1.5 * scale}),
            LayerStat(
                "model.embed_tokens.weight", "embed", None, {"mean": 0.25, "inf": float("inf")}
            ),
        ],
        heatmaps=[
            Heatmap(
                "fisher/layer_module",
                ["q", "k"],
                ["0", "1"],
                [[1.0, None], [3.0, 4.0]],
                {"log": True},
            )
        ],
        series=[SeriesPoint("concentration", 0.01, 0.3), SeriesPoint("concentration", 0.1, 0.8)],
        tensors={
            "fisher": {"a.weight": torch.arange(6.0).reshape(2, 3) * scale, "b": torch.ones(2)}
        },
    )


def test_migrations_create_every_table_and_are_idempotent(db_url: str) -> None:
    upgrade(db_url)
    upgrade(db_url)  # second start-up: nothing to do, no error
    engine = make_engine(db_url)
    tables = set(inspect(engine).get_table_names())
    assert {
        "models",
        "jobs",
        "layer_stats",
        "heatmaps",
        "series",
        "artifacts",
        "alembic_version",
    } <= tables
    assert current_revision(engine) == _head()
    engine.dispose()


def _head() -> str:
    from alembic.script import ScriptDirectory

    from storage.db import alembic_config

    return str(ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head())


def test_long_revisions_fit_and_0002_converts_existing_rows(db_url: str) -> None:
    """jobs.model_revision is String(128); a diff/OPD/masked-train job joins 3 revisions
    (~200 characters), which PostgreSQL refused (StringDataRightTruncation -> HTTP 500).
    Now the column holds their sha256 and the parts live in jobs.revisions; 0002 converts rows
    written under 0001 with the same digest, so reuse still finds them."""
    import hashlib

    from storage.models import revision_digest

    upgrade(db_url, "0001")
    engine = make_engine(db_url)
    old = "model=" + "a" * 64 + ";mask=job:3:" + "b" * 40  # fits the old column on both backends
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO jobs (kind, spec, spec_hash, model_revision, status, progress, "
                "message, share_token, created_at, attempts, cancel_requested) VALUES "
                "('train', '{}', 'h', :rev, 'succeeded', 1.0, 'done', 'tok-old', "
                "CURRENT_TIMESTAMP, 1, false)"
            ),
            {"rev": old},
        )
    upgrade(db_url)
    assert current_revision(engine) == _head()
    factory = make_session_factory(engine)
    with factory() as s:
        row = s.scalar(select(Job).where(Job.share_token == "tok-old"))
        assert row.model_revision == hashlib.sha256(old.encode()).hexdigest()
        assert row.revisions == old.split(";")
        found = repo.find_reusable(
            session=s, kind="train", spec_hash="h", model_revision=revision_digest(old.split(";"))
        )
        assert found is not None and found.id == row.id
        parts = [f"{f}={'c' * 64}" for f in ("base", "tuned")] + [f"fisher=job:12:{'d' * 64}"]
        assert len(";".join(parts)) > 128
        job = repo.create_job(session=s, kind="diff", spec={}, spec_hash="h2", revisions=parts)
        s.expire_all()
        job = repo.get_job(session=s, job_id=job.id)
        assert job.revisions == parts and len(job.model_revision) == 64
        assert job.model_revision == hashlib.sha256(";".join(parts).encode()).hexdigest()
        assert repo.job_dict(job)["revisions"] == parts
    engine.dispose()


def test_concurrent_upgrades_do_not_collide(db_url: str) -> None:
    errors: list[BaseException] = []

    def go() -> None:
        try:
            upgrade(db_url)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_job_lifecycle_and_result_roundtrip(session, store: ArtifactStore) -> None:
    job = repo.create_job(
        session=session, kind="fisher", spec={"model": "m"}, spec_hash="h1", model_revision="r1"
    )
    assert job.status == "queued" and job.progress == 0.0 and job.attempts == 0
    assert len(job.share_token) >= 22  # >= 128 random bits, URL-safe
    repo.mark_running(session=session, job_id=job.id, worker="w1@host")
    assert (
        repo.update_progress(session=session, job_id=job.id, fraction=1.7, message="half") is False
    )
    got = repo.get_job(session=session, job_id=job.id)
    assert got.status == "running" and got.progress == 1.0 and got.message == "half"
    assert got.attempts == 1 and got.worker == "w1@host" and got.heartbeat_at is not None
    assert got.heartbeat_at.tzinfo is not None

    repo.save_result(session=session, job_id=job.id, result=_result(), store=store)
    repo.mark_succeeded(session=session, job_id=job.id)
    d = repo.result_dict(
        session=session, job=repo.get_job_by_token(session=session, token=job.share_token)
    )
    assert d["job"]["status"] == "succeeded" and d["job"]["progress"] == 1.0
    assert d["kind"] == "fisher"
    assert d["summary"] == {"n_samples": 8, "gini": 0.5, "nan": None}  # NaN stored as null
    assert d["layer_stats"][0] == {
        "param": "model.layers.0.self_attn.q_proj.weight",
        "module": "q",
        "layer": 0,
        "values": {"mean": 1.5},
        "group": "tensor",
    }
    assert d["layer_stats"][1]["layer"] is None and d["layer_stats"][1]["values"]["inf"] is None
    assert d["heatmaps"] == [
        {
            "name": "fisher/layer_module",
            "x_labels": ["q", "k"],
            "y_labels": ["0", "1"],
            "z": [[1.0, None], [3.0, 4.0]],
            "meta": {"log": True},
        }
    ]
    assert d["series"] == [
        {"name": "concentration", "step": 0.01, "value": 0.3},
        {"name": "concentration", "step": 0.1, "value": 0.8},
    ]
    (art,) = d["artifacts"]
    assert art["kind"] == "fisher" and art["path"] == f"{job.id}/fisher.safetensors"
    tensors = store.load_tensors(art["path"], art["sha256"])
    torch.testing.assert_close(tensors["a.weight"], torch.arange(6.0).reshape(2, 3))
    assert art["bytes"] == (store.root / art["path"]).stat().st_size
    # The same JSON shape as JobResult.to_dict() for everything but floats cleaned of NaN.
    assert set(_result().to_dict()) <= set(d)


def test_save_result_is_idempotent_replaces_rows(session, store: ArtifactStore) -> None:
    job = repo.create_job(session=session, kind="fisher", spec={}, spec_hash="h")
    for scale in (1.0, 1.0, 2.0):  # re-delivered twice, the last one wins
        repo.save_result(session=session, job_id=job.id, result=_result(scale), store=store)
    counts = {
        t.__tablename__: session.scalar(
            select(func.count()).select_from(t).where(t.job_id == job.id)
        )
        for t in (LayerStatRow, HeatmapRow, SeriesRow, ArtifactRow)
    }
    assert counts == {"layer_stats": 2, "heatmaps": 1, "series": 2, "artifacts": 1}
    d = repo.result_dict(session=session, job=job)
    assert d["layer_stats"][0]["values"]["mean"] == 3.0
    t = store.load_tensors(d["artifacts"][0]["path"], d["artifacts"][0]["sha256"])
    torch.testing.assert_close(t["a.weight"], torch.arange(6.0).reshape(2, 3) * 2)
    assert not [p for p in store.job_dir(job.id).iterdir() if p.name.endswith(".tmp")]


def test_share_tokens_unique_and_unguessable(session) -> None:
    tokens = {
        repo.create_job(session=session, kind="tokens", spec={}, spec_hash=str(i)).share_token
        for i in range(20)
    }
    assert len(tokens) == 20
    assert repo.get_job_by_token(session=session, token="job1") is None
    assert repo.get_job_by_token(session=session, token="") is None
    assert repo.get_job_by_token(session=session, token="x" * 500) is None


def test_share_token_unique_index(session) -> None:
    a = repo.create_job(session=session, kind="tokens", spec={}, spec_hash="1")
    dup = Job(
        kind="tokens",
        spec={},
        spec_hash="2",
        share_token=a.share_token,
        status="queued",
        progress=0.0,
        message="",
        attempts=0,
        cancel_requested=False,
    )
    session.add(dup)
    with pytest.raises(Exception, match="(?i)unique|duplicate"):
        session.commit()
    session.rollback()


def test_find_reusable_matches_kind_hash_revision_and_success(session) -> None:
    a = repo.create_job(session=session, kind="fisher", spec={}, spec_hash="h", model_revision="r")
    assert (
        repo.find_reusable(session=session, kind="fisher", spec_hash="h", model_revision="r")
        is None
    )
    repo.mark_succeeded(session=session, job_id=a.id)
    assert (
        repo.find_reusable(session=session, kind="fisher", spec_hash="h", model_revision="r").id
        == a.id
    )
    assert (
        repo.find_reusable(session=session, kind="fisher", spec_hash="h", model_revision="r2")
        is None
    )
    assert (
        repo.find_reusable(session=session, kind="mask", spec_hash="h", model_revision="r") is None
    )
    b = repo.create_job(session=session, kind="fisher", spec={}, spec_hash="h", model_revision="r")
    repo.mark_failed(session=session, job_id=b.id, error="Traceback...\nValueError: boom")
    assert repo.get_job(session=session, job_id=b.id).message == "ValueError: boom"
    assert (
        repo.find_reusable(session=session, kind="fisher", spec_hash="h", model_revision="r").id
        == a.id
    )


def test_cancel_queued_at_once_running_by_flag(session) -> None:
    q = repo.create_job(session=session, kind="fisher", spec={}, spec_hash="1")
    assert repo.request_cancel(session=session, job_id=q.id).status == "cancelled"
    r = repo.create_job(session=session, kind="fisher", spec={}, spec_hash="2")
    repo.mark_running(session=session, job_id=r.id, worker="w")
    assert repo.request_cancel(session=session, job_id=r.id).status == "running"
    assert repo.update_progress(session=session, job_id=r.id, fraction=0.1) is True
    done = repo.create_job(session=session, kind="fisher", spec={}, spec_hash="3")
    repo.mark_succeeded(session=session, job_id=done.id)
    assert repo.request_cancel(session=session, job_id=done.id).status == "succeeded"
    with pytest.raises(LookupError, match="job"):
        repo.request_cancel(session=session, job_id=10_000)


def test_stale_running_jobs_found_by_heartbeat_or_hostname(session) -> None:
    old = repo.create_job(session=session, kind="fisher", spec={}, spec_hash="1")
    repo.mark_running(session=session, job_id=old.id, worker="a@x")
    old.heartbeat_at = utcnow() - timedelta(seconds=600)
    session.commit()
    mine = repo.create_job(session=session, kind="fisher", spec={}, spec_hash="2")
    repo.mark_running(session=session, job_id=mine.id, worker="b@x")
    alive = repo.create_job(session=session, kind="fisher", spec={}, spec_hash="3")
    repo.mark_running(session=session, job_id=alive.id, worker="c@x")
    stale = repo.find_stale_running(session=session, stale_after_s=300, hostname="b@x")
    assert sorted(j.id for j in stale) == [old.id, mine.id]
    repo.requeue(session=session, job_id=old.id, message="re-queued")
    j = repo.get_job(session=session, job_id=old.id)
    assert j.status == "queued" and j.worker is None and j.attempts == 1


def test_list_jobs_newest_first_hides_shards(session) -> None:
    p = repo.create_job(session=session, kind="fisher", spec={}, spec_hash="p")
    repo.create_job(
        session=session, kind="fisher", spec={}, spec_hash="p", parent_id=p.id, shard_index=0
    )
    q = repo.create_job(session=session, kind="mask", spec={}, spec_hash="q")
    assert [j.id for j in repo.list_jobs(session=session)] == [q.id, p.id]
    assert [j.id for j in repo.list_jobs(session=session, kind="fisher")] == [p.id]
    assert len(repo.list_jobs(session=session, include_shards=True)) == 3
    assert [j.shard_index for j in repo.shard_jobs(session=session, parent_id=p.id)] == [0]


def test_register_and_list_models(session) -> None:
    repo.register_model(
        session=session,
        name="arith-base",
        source="/z/arith-base",
        revision="r1",
        architecture="LlamaForCausalLM",
        n_params=12345,
        n_layers=2,
    )
    repo.register_model(session=session, name="arith-base", source="/z/arith-base", revision="r2")
    (m,) = repo.list_models(session=session)
    assert repo.model_dict(m)["revision"] == "r2"


def test_deleting_a_job_deletes_its_rows(session, store: ArtifactStore) -> None:
    job = repo.create_job(session=session, kind="fisher", spec={}, spec_hash="h")
    repo.save_result(session=session, job_id=job.id, result=_result(), store=store)
    session.delete(repo.get_job(session=session, job_id=job.id))
    session.commit()
    assert session.scalar(select(func.count()).select_from(LayerStatRow)) == 0
    assert session.scalar(select(func.count()).select_from(ArtifactRow)) == 0


# -- artifacts (file system only) ---------------------------------------------------------------
def test_artifact_sha_mismatch_is_a_clear_error(store: ArtifactStore) -> None:
    info = store.save_tensors(7, "fisher", {"w": torch.ones(4)})
    path = store.root / info.path
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(ArtifactError, match="corrupt.*sha256"):
        store.load_tensors(info.path, info.sha256)
    path.unlink()
    with pytest.raises(ArtifactError, match="missing"):
        store.load_tensors(info.path, info.sha256)


def test_artifact_paths_cannot_escape_root(store: ArtifactStore) -> None:
    with pytest.raises(ArtifactError, match="outside"):
        store.resolve("../../etc/passwd")
    with pytest.raises(ArtifactError, match="kind"):
        store.save_tensors(1, "../x", {"w": torch.ones(1)})


def test_shared_storage_tensors_are_saved(store: ArtifactStore) -> None:
    base = torch.arange(4.0)
    info = store.save_tensors(1, "mask", {"a": base, "b": base})
    out = store.load_tensors(info.path, info.sha256)
    torch.testing.assert_close(out["a"], out["b"])


def test_folder_artifact_moved_under_job(store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "trained"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(b"\x00" * 10)
    info = store.save_folder(3, "model", src)
    assert not src.exists() and info.is_dir and info.bytes == 12
    assert store.verify(info.path, info.sha256) == store.root / "3" / "model"
    (store.root / "3" / "model" / "config.json").write_text('{"x": 1}')
    with pytest.raises(ArtifactError, match="corrupt"):
        store.verify(info.path, info.sha256)


def test_migrations_are_package_data() -> None:
    """`pip install .` (a wheel) must ship env.py and every version, not only the editable tree."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["storage"]
    needed = [
        p.relative_to(root / "storage").as_posix()
        for p in (root / "storage" / "migrations").rglob("*.py")
    ]
    assert "migrations/env.py" in needed and "migrations/versions/0001_initial.py" in needed
    for rel in needed:
        assert any(fnmatch.fnmatch(rel, pat) for pat in patterns), rel


def test_claim_job_lets_one_delivery_run_it(session) -> None:
    job = repo.create_job(session=session, kind="fisher", spec={}, spec_hash="c")
    first = repo.claim_job(session=session, job_id=job.id, worker="a@x", stale_after_s=300)
    assert first is not None and first.status == "running" and first.attempts == 1
    assert repo.claim_job(session=session, job_id=job.id, worker="b@y", stale_after_s=300) is None
    # The same worker name again means its earlier process died: it may take the job back.
    again = repo.claim_job(session=session, job_id=job.id, worker="a@x", stale_after_s=300)
    assert again is not None and again.attempts == 2 and again.message == "started (attempt 2)"
    again.heartbeat_at = utcnow() - timedelta(seconds=301)
    session.commit()
    taken = repo.claim_job(session=session, job_id=job.id, worker="b@y", stale_after_s=300)
    assert taken is not None and taken.worker == "b@y" and taken.attempts == 3
    repo.mark_succeeded(session=session, job_id=job.id)
    assert repo.claim_job(session=session, job_id=job.id, worker="b@y", stale_after_s=0) is None
    c = repo.create_job(session=session, kind="fisher", spec={}, spec_hash="d")
    repo.request_cancel(session=session, job_id=c.id)
    assert repo.claim_job(session=session, job_id=c.id, worker="a@x", stale_after_s=300) is None


def test_shards_belong_to_their_parents_owner(session) -> None:
    from storage.users import create_user

    ada = create_user(session=session, name="ada")
    parent = repo.create_job(session=session, kind="fisher", spec={"prompts": 4}, spec_hash="h",
                             owner_id=ada.id)
    assert parent.status == "queued" and parent.owner_id == ada.id
    parent.status = "running"
    session.commit()
    shards = repo.create_shards(session=session, parent_id=parent.id, n=3, spec={"prompts": 4},
                                spec_hash="h")
    assert [s.shard_index for s in shards] == [0, 1, 2]
    assert {s.owner_id for s in shards} == {ada.id}
    assert all(s.status == "queued" and s.attempts == 0 and s.share_token for s in shards)
    # Created once: a second fan-out (a re-delivered message) adds no rows.
    again = repo.create_shards(session=session, parent_id=parent.id, n=3, spec={"prompts": 4},
                               spec_hash="h")
    assert [s.id for s in again] == [s.id for s in shards]
