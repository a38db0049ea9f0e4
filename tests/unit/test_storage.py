"""storage/: migrations, repository functions and artifacts on SQLite and PostgreSQL.

PostgreSQL runs in a fresh schema per test module (search_path in the URL), dropped afterwards,
so concurrent runs on the shared `test` database do not collide.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from sqlalchemy import func, inspect, select, text

from compute.contract.jobresult import Heatmap, JobResult, LayerStat, SeriesPoint
from storage import repo
from storage.artifacts import ArtifactError, ArtifactStore
from storage.db import current_revision, make_engine, make_session_factory, upgrade
from storage.models import ArtifactRow, HeatmapRow, Job, LayerStatRow, SeriesRow, utcnow
from tests.pg import pg_schema_url

PG_URL = os.environ.get(
    "FISHERLENS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def _pg_schema_url() -> Iterator[str]:
    with pg_schema_url("fl_test") as url:
        yield url


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
                "fisher/mean",
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
            "name": "fisher/mean",
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


def test_requeue_clears_worker_and_combine_state(session) -> None:
    old = repo.create_job(session=session, kind="fisher", spec={}, spec_hash="1")
    repo.mark_running(session=session, job_id=old.id, worker="a@x")
    old.combine_state = "running"
    session.commit()
    repo.requeue(session=session, job_id=old.id, message="re-queued")
    j = repo.get_job(session=session, job_id=old.id)
    assert (j.status, j.worker, j.attempts, j.combine_state) == ("queued", None, 1, None)


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


def _running_parent(session, n: int | None = None, **kw):
    parent = repo.create_job(session=session, kind="sweep", spec={"lrs": [1e-6, 1e-3]},
                             spec_hash="h", **kw)
    assert repo.claim_job(session=session, job_id=parent.id, worker="p@x", stale_after_s=300)
    return parent


def test_children_belong_to_their_parents_owner_kind_and_spec(session) -> None:
    from storage.users import create_user

    ada = create_user(session=session, name="ada")
    parent = _running_parent(session, owner_id=ada.id)
    children = repo.create_children(session=session, parent_id=parent.id, n=3)
    assert [c.shard_index for c in children] == [0, 1, 2]
    assert {(c.owner_id, c.kind, c.spec_hash) for c in children} == {(ada.id, "sweep", "h")}
    assert all(c.spec == {"lrs": [1e-6, 1e-3]} for c in children)
    assert all(c.status == "queued" and c.attempts == 0 and c.share_token for c in children)
    p = repo.get_job(session=session, job_id=parent.id)
    assert (p.status, p.worker, p.n_children, p.combine_state) == ("running", None, 3, None)
    # Created once: a second fan-out (a re-delivered message) adds no rows.
    again = repo.create_children(session=session, parent_id=parent.id, n=3)
    assert [c.id for c in again] == [c.id for c in children]
    assert [j.id for j in repo.list_jobs(session=session)] == [parent.id]  # children hidden


def _finish_children(session, children, status: str = "succeeded") -> None:
    for c in children:
        repo.claim_job(session=session, job_id=c.id, worker="c@x", stale_after_s=300)
        repo.mark_succeeded(session=session, job_id=c.id)
    if status != "succeeded":
        repo.mark_failed(session=session, job_id=children[-1].id, error="boom")


def test_combine_is_requested_and_claimed_once(session) -> None:
    """NULL -> 'queued' -> 'running' by compare-and-set; neither step before every child
    succeeded; a dead combiner is released once; progress counts succeeded children."""
    parent = _running_parent(session)
    children = repo.create_children(session=session, parent_id=parent.id, n=2)
    claim = dict(session=session, parent_id=parent.id, stale_after_s=300)
    assert repo.request_combine(session=session, parent_id=parent.id) is False  # none done
    _finish_children(session, children[:1])
    repo.refresh_parent_progress(session=session, parent_id=parent.id)
    p = repo.get_job(session=session, job_id=parent.id)
    assert (p.progress, p.message) == (pytest.approx(0.475), "1/2 children done")
    assert repo.request_combine(session=session, parent_id=parent.id) is False  # one to go
    assert repo.claim_combine(worker="f@x", **claim) is False
    _finish_children(session, children[1:])
    assert repo.request_combine(session=session, parent_id=parent.id) is True
    assert repo.request_combine(session=session, parent_id=parent.id) is False  # one message
    assert repo.claim_combine(worker="f@x", **claim) is True
    assert repo.claim_combine(worker="g@y", **claim) is False  # a duplicate delivery
    p = repo.get_job(session=session, job_id=parent.id)
    assert (p.combine_state, p.worker) == ("running", "f@x")
    assert repo.release_combine(session=session, parent_id=parent.id, worker="g@y") is False
    assert repo.release_combine(session=session, parent_id=parent.id, worker="f@x") is True
    assert repo.release_combine(session=session, parent_id=parent.id, worker="f@x") is False
    assert repo.get_job(session=session, job_id=parent.id).combine_state == "queued"
    assert repo.mark_combine_resent(session=session, parent_id=parent.id, older_than_s=60) is False
    assert repo.claim_combine(worker="g@y", **claim) is True


def test_failed_child_fails_parent_and_cancels_queued_siblings(session) -> None:
    parent = _running_parent(session)
    children = repo.create_children(session=session, parent_id=parent.id, n=3)
    _finish_children(session, children[:2], status="failed")
    assert repo.request_combine(session=session, parent_id=parent.id) is False
    assert repo.fail_parent(session=session, parent_id=parent.id, message="child 1 failed: boom")
    assert repo.fail_parent(session=session, parent_id=parent.id, message="again") is False
    p = repo.get_job(session=session, job_id=parent.id)
    assert (p.status, p.message) == ("failed", "child 1 failed: boom")
    assert repo.get_job(session=session, job_id=children[2].id).status == "cancelled"


def test_cancelling_a_parent_cancels_its_children(session) -> None:
    parent = _running_parent(session)
    children = repo.create_children(session=session, parent_id=parent.id, n=2)
    repo.claim_job(session=session, job_id=children[0].id, worker="c@x", stale_after_s=300)
    repo.request_cancel(session=session, job_id=parent.id)
    rows = [repo.get_job(session=session, job_id=j) for j in (parent.id, *[c.id for c in children])]
    assert [(j.status, j.cancel_requested) for j in rows] == [
        ("cancelled", True), ("running", True), ("cancelled", True)]  # the running one stops itself
    assert repo.claim_combine(session=session, parent_id=parent.id, worker="f@x",
                              stale_after_s=300) is False


def _race(factory, barrier, won: list[bool], step: str, parent_id: int, name: str) -> None:
    with factory() as s:
        barrier.wait()
        if step == "request":
            won.append(repo.request_combine(session=s, parent_id=parent_id))
        else:
            won.append(repo.claim_combine(session=s, parent_id=parent_id, worker=name,
                                          stale_after_s=300))


@pytest.mark.parametrize("step", ["request", "claim"])
def test_two_concurrent_finish_claims_let_exactly_one_combine(db_url: str, step: str) -> None:
    """Two finishers in separate sessions (threads, each its own connection) racing on the same
    parent, 20 rounds: exactly one wins every round, on SQLite and on PostgreSQL."""
    upgrade(db_url)
    engine = make_engine(db_url)
    factory = make_session_factory(engine)
    for _ in range(20):
        with factory() as s:
            parent = _running_parent(s)
            _finish_children(s, repo.create_children(session=s, parent_id=parent.id, n=2))
            if step == "claim":
                assert repo.request_combine(session=s, parent_id=parent.id)
        barrier = threading.Barrier(2)
        won: list[bool] = []
        threads = [
            threading.Thread(target=_race, args=(factory, barrier, won, step, parent.id, f"w{i}@x"))
            for i in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(won) == [False, True]
    engine.dispose()


def test_0004_converts_running_parents(db_url: str) -> None:
    """A parent fanned out under 0003 gets n_children = its child rows, and one that was
    combining (running with a worker) gets combine_state 'running'."""
    upgrade(db_url, "0003")
    engine = make_engine(db_url)
    insert = text(
        "INSERT INTO jobs (id, kind, spec, spec_hash, status, progress, message, share_token, "
        "created_at, attempts, cancel_requested, shared, worker, parent_id, shard_index) VALUES "
        "(:id, 'fisher', '{}', 'h', :status, 0.0, '', :tok, CURRENT_TIMESTAMP, 1, false, true, "
        ":worker, :parent, :idx)"
    )
    rows = [(1, "running", "f@x", None, None), (2, "running", None, None, None),
            (3, "succeeded", None, 1, 0), (4, "succeeded", None, 1, 1),
            (5, "succeeded", None, 2, 0), (6, "queued", None, None, None)]
    with engine.begin() as conn:
        for id_, status, worker, parent, idx in rows:
            conn.execute(insert, {"id": id_, "status": status, "tok": f"t{id_}",
                                  "worker": worker, "parent": parent, "idx": idx})
    upgrade(db_url)
    with make_session_factory(engine)() as s:
        got = {j.id: (j.n_children, j.combine_state) for j in s.scalars(select(Job))}
    assert got == {1: (2, "running"), 2: (1, None), 3: (None, None), 4: (None, None),
                   5: (None, None), 6: (None, None)}
    engine.dispose()
