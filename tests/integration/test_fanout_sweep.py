"""A queued sweep fans out over real worker processes (Celery solo pool), on the embedded
filesystem queue + SQLite and on Redis + PostgreSQL: one child job per grid point, run by two
workers at once, and the parent's combined result holds every point.

That the two points really run on two workers is forced, not hoped for: both workers stop at the
`mid_job` fault point (compute.runtime.control, one-shot), so the first child to report progress holds its
worker there; a solo-pool worker reserves one message at a time (acks_late, prefetch 1), so the
other child can only be run, to the end, by the other worker. Then the held child is released."""

from __future__ import annotations

import re
import time

import pytest

from app import services
from storage import repo

pytestmark = pytest.mark.slow

TINY = {
    "model": "arith-base",
    "lrs": [1e-6, 1e-2],
    "optimizers": ["sgd"],
    "precision": ["bf16-mixed"],
    "steps": 1,
    "batch": 2,
    "group": 2,
    "max_new_tokens": 4,
    "eval_prompts": 8,
    "fisher_prompts": 4,
    "fisher_samples": 2,
}


def _children(settings, parent: int, n: int, timeout: float = 60.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        with services.sessions(settings)() as s:
            kids = repo.shard_jobs(session=s, parent_id=parent)
        if len(kids) >= n or time.monotonic() > deadline:
            return kids
        time.sleep(0.2)


def test_queued_sweep_runs_one_child_per_point_on_two_workers(stack) -> None:
    stack.start_worker("w1@test", faults=["mid_job"])
    stack.start_worker("w2@test", faults=["mid_job"])
    settings = stack.settings
    job = services.submit(settings, "sweep", TINY)
    marker = stack.wait_reached("mid_job", timeout=300)  # one child holds its worker here
    held = int(re.search(r"job=(\d+)", marker).group(1))  # type: ignore[union-attr]
    kids = _children(settings, job["id"], 2)
    assert [(k.kind, k.shard_index) for k in kids] == [("sweep", 0), ("sweep", 1)]
    (other,) = [k.id for k in kids if k.id != held]
    assert held in {k.id for k in kids}
    done_other = stack.wait_for(other, lambda j: j["status"] == "succeeded", 300, "succeeded")
    held_job = stack.job(held)
    assert held_job["status"] == "running"
    assert done_other["worker"] != held_job["worker"]  # two worker processes at once
    assert stack.job(job["id"])["status"] == "running"  # the parent waits for both points
    stack.release("mid_job")
    done = stack.wait_final(job["id"], timeout=300)
    assert done["status"] == "succeeded", (done["error"], stack.logs())
    with services.sessions(settings)() as s:
        kids = repo.shard_jobs(session=s, parent_id=job["id"])
        assert [k.status for k in kids] == ["succeeded", "succeeded"]
        assert {k.worker for k in kids} == {"w1@test", "w2@test"}
        assert all(repo.get_artifact(session=s, job_id=k.id, kind="shard") for k in kids)
    assert [j["id"] for j in services.list_jobs(settings)] == [job["id"]]  # children hidden
    res = services.result_by_id(settings, job["id"])
    points = res["summary"]["points"]
    assert [(p["lr"], p["optimizer"], p["precision"]) for p in points] == [
        (1e-6, "sgd", "bf16-mixed"), (1e-2, "sgd", "bf16-mixed")]
    for p in points:
        assert p["stored_dtype"] == "bfloat16"
        assert 0.0 <= p["unchanged_bf16"] <= 1.0 and 0.0 <= p["reward_after"] <= 1.0
    assert res["summary"]["initial_fisher"]["source"] == "other-prompts"
    assert any(a["kind"] == "fisher" for a in res["artifacts"])  # unit 0's Fisher, stored once
    assert {h["name"] for h in res["heatmaps"]} >= {"sweep_unchanged_bf16_bf16-mixed"}
