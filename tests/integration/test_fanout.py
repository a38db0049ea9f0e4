"""The worker's generic child-job fan-out (compute/jobs/runners.py's protocol), in-process on SQLite
and the filesystem queue: any kind implementing children/run_child/combine fans out, each child's
output is stored, the parent is combined exactly once, a failed child fails the parent naming
it, cancelling the parent cancels its children. The toy kind is tests/integration/toy_children."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from app import services
from compute.contract.settings import get_settings
from storage import repo

SPEC = {"model": "arith-base", "lrs": [1e-6, 1e-4, 1e-2], "optimizers": ["sgd"]}
# what submit stores with the job (app.services.refs); a hub id is handed on as it is
REFS = {"model": {"field": "model", "given": "org/tiny", "target": "model", "form": "hub",
                  "path": "org/tiny"}}


def _messages(settings) -> list[tuple[str, int]]:
    out = []
    for f in sorted((Path(settings.queue_dir) / "messages").glob("*.msg")):
        msg = json.loads(f.read_text())
        out.append((msg["headers"]["task"], json.loads(base64.b64decode(msg["body"]))[0][0]))
        f.unlink()  # consumed
    return sorted(out, key=lambda t: t[1])


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def settings(request: pytest.FixtureRequest, fl_home: Path, monkeypatch: pytest.MonkeyPatch):
    import compute.jobs.runners as runners
    import compute.runtime.celery_app as ca
    from storage.db import upgrade
    from tests.integration.conftest import _pg_schema

    if request.param == "postgresql":
        schema = _pg_schema()
        monkeypatch.setenv("DATABASE_URL", next(schema))
        request.addfinalizer(lambda: next(schema, None))
    monkeypatch.setenv("FISHERLENS_QUEUE", "fisherlens")
    monkeypatch.setitem(runners.RUNNERS, "sweep", "tests.integration.toy_children:run")
    ca._apps.clear()
    s = get_settings()
    upgrade(s.db_url)
    return s


def _parent(settings, **spec) -> int:
    with services.sessions(settings)() as s:
        return repo.create_job(session=s, kind="sweep", spec=SPEC | spec, spec_hash="h", refs=REFS).id


def _children(settings, parent: int) -> list:
    with services.sessions(settings)() as s:
        return repo.shard_jobs(session=s, parent_id=parent)


def test_any_kind_with_the_protocol_fans_out_and_combines_once(settings) -> None:
    from compute.worker import execute_finish, execute_job, execute_shard

    parent = _parent(settings)
    assert execute_job(settings, parent, hostname="p@x") == "fanned out 3 children"
    kids = _children(settings, parent)
    assert [(c.kind, c.shard_index, c.status, c.refs) for c in kids] == [
        ("sweep", i, "queued", REFS) for i in range(3)]  # children carry the parent's refs
    assert _messages(settings) == [("fisherlens.run_shard", c.id) for c in kids]
    assert execute_shard(settings, kids[2].id, hostname="a@x") == "succeeded"
    assert execute_shard(settings, kids[0].id, hostname="b@x") == "succeeded"
    assert _messages(settings) == []  # child 1 still to run: no finish yet
    assert execute_shard(settings, kids[1].id, hostname="a@x") == "succeeded"
    assert _messages(settings) == [("fisherlens.finish_shards", parent)]  # exactly one
    with services.sessions(settings)() as s:
        p = repo.get_job(session=s, job_id=parent)
        assert (p.status, p.n_children, p.combine_state) == ("running", 3, "queued")
        assert all(repo.get_artifact(session=s, job_id=c.id, kind="shard") for c in kids)
    assert execute_finish(settings, parent, hostname="f@x") == "succeeded"
    assert execute_finish(settings, parent, hostname="g@x") == "skipped"  # a duplicate message
    res = services.result_by_id(settings, parent)
    assert res["job"]["status"] == "succeeded"
    assert res["summary"] == {"indices": [0, 1, 2], "lrs": SPEC["lrs"], "w_sum": 6.0, "models": ["org/tiny"]}
    assert execute_shard(settings, kids[0].id, hostname="a@x") == "already succeeded"


def test_a_failed_child_fails_the_parent_naming_it(settings) -> None:
    from compute.worker import execute_job, execute_shard

    parent = _parent(settings, seed=13)
    execute_job(settings, parent, hostname="p@x")
    kids = _children(settings, parent)
    assert execute_shard(settings, kids[1].id, hostname="a@x") == "failed"
    with services.sessions(settings)() as s:
        p = repo.get_job(session=s, job_id=parent)
        assert p.status == "failed"
        assert p.message.startswith(f"child 1 (job {kids[1].id}) failed: ValueError: lrs: 0.0001")
        assert [c.status for c in repo.shard_jobs(session=s, parent_id=parent)] == [
            "cancelled", "failed", "cancelled"]
    assert execute_shard(settings, kids[0].id, hostname="a@x") == "already cancelled"


def test_cancelling_the_parent_cancels_its_children(settings) -> None:
    from compute.worker import execute_job, execute_shard

    parent = _parent(settings)
    execute_job(settings, parent, hostname="p@x")
    kids = _children(settings, parent)
    assert execute_shard(settings, kids[0].id, hostname="a@x") == "succeeded"
    services.cancel(settings, parent)
    assert [c.status for c in _children(settings, parent)] == ["succeeded", "cancelled", "cancelled"]
    assert execute_shard(settings, kids[1].id, hostname="a@x") == "already cancelled"


def test_one_child_or_none_runs_inline(settings) -> None:
    from compute.worker import execute_job

    parent = _parent(settings, lrs=[1e-3])
    assert execute_job(settings, parent, hostname="p@x") == "succeeded"
    assert _children(settings, parent) == []
    assert services.result_by_id(settings, parent)["summary"]["w_sum"] == 0.0


def test_a_job_queued_without_resolved_refs_fails_asking_for_a_rerun(settings) -> None:
    """The worker never resolves a reference: a row without jobs.refs (queued before they were
    stored with the job) ends failed with a message saying what to do."""
    from compute.worker import execute_job

    with services.sessions(settings)() as s:
        job_id = repo.create_job(session=s, kind="sweep", spec=SPEC | {"lrs": [1e-3]}, spec_hash="h").id
    assert execute_job(settings, job_id, hostname="p@x") == "failed"
    job = services.get_job(settings, job_id)
    assert "has no resolved references" in job["message"] and "re-run it" in job["message"]


def test_a_partial_protocol_is_an_error_naming_what_is_missing(monkeypatch) -> None:
    import types

    from compute.jobs import runners

    mod = types.ModuleType("half_protocol")
    mod.children = lambda spec: 2  # type: ignore[attr-defined]
    mod.run = lambda spec, progress: None  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "half_protocol", mod)
    monkeypatch.setitem(runners.RUNNERS, "tokens", "half_protocol:run")
    with pytest.raises(TypeError, match="missing run_child, combine"):
        runners.child_protocol("tokens")
    assert runners.child_protocol("train") is None


def test_two_concurrent_finish_deliveries_combine_once(settings) -> None:
    """Two finish_shards deliveries at once (two threads, two database connections): exactly
    one combines (repo.claim_combine), the other does nothing."""
    import threading

    from compute.worker import execute_finish, execute_job, execute_shard

    for _ in range(5):
        parent = _parent(settings)
        execute_job(settings, parent, hostname="p@x")
        for c in _children(settings, parent):
            execute_shard(settings, c.id, hostname="a@x")
        barrier = threading.Barrier(2)
        outcomes: list[str] = []

        def finish(name: str, parent: int = parent, barrier=barrier, outcomes=outcomes) -> None:
            barrier.wait()
            outcomes.append(execute_finish(settings, parent, hostname=name))

        threads = [threading.Thread(target=finish, args=(f"f{i}@x",)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes) in (["claimed elsewhere", "succeeded"], ["skipped", "succeeded"])
        assert services.result_by_id(settings, parent)["job"]["status"] == "succeeded"
