"""Real worker processes (Celery solo pool) running real fisher jobs on the zoo model, against the
embedded filesystem queue + SQLite and against Redis + PostgreSQL. Interruptions happen at named
fault points (compute.runtime.control), never at "a moment when the job is hopefully still running"."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from sqlalchemy import func, select

from app import services
from compute.contract.specs import SpecError
from storage import repo
from storage.artifacts import open_store
from storage.models import ArtifactRow, HeatmapRow, LayerStatRow, SeriesRow

pytestmark = pytest.mark.slow

SMALL = {
    "model": "arith-base",
    "task": "arithmetic",
    "prompts": 4,
    "samples": 2,
    "max_new_tokens": 6,
}


def _row_counts(settings, job_id: int) -> dict[str, int]:
    with services.sessions(settings)() as s:
        return {
            t.__tablename__: s.scalar(select(func.count()).select_from(t).where(t.job_id == job_id))
            for t in (LayerStatRow, HeatmapRow, SeriesRow, ArtifactRow)
        }


def _assert_no_duplicates(settings, job_id: int) -> None:
    res = services.result_by_id(settings, job_id)
    keys = Counter((s["group"], s["param"], s["module"], s["layer"]) for s in res["layer_stats"])
    assert max(keys.values()) == 1, [k for k, n in keys.items() if n > 1][:5]
    names = Counter(h["name"] for h in res["heatmaps"])
    assert max(names.values(), default=1) == 1
    series = Counter((p["name"], p["step"]) for p in res["series"])
    assert max(series.values(), default=1) == 1
    kinds = Counter(a["kind"] for a in res["artifacts"])
    assert max(kinds.values(), default=1) == 1


def test_fisher_job_runs_and_lands_in_the_database(stack) -> None:
    stack.start_worker("w1@test")
    settings = stack.settings
    job = services.submit(settings, "fisher", SMALL)
    done = stack.wait_final(job["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["progress"] == 1.0 and done["worker"] == "w1@test" and done["attempts"] == 1
    res = services.result_by_token(settings, job["share_token"])
    assert res["job"]["id"] == job["id"] and res["kind"] == "fisher"
    assert res["layer_stats"] and res["heatmaps"]
    assert all(h["z"] and len(h["z"]) == len(h["y_labels"]) for h in res["heatmaps"])
    (fisher,) = [a for a in res["artifacts"] if a["kind"] == "fisher"]
    tensors = open_store(settings).load_tensors(fisher["path"], fisher["sha256"])
    assert any(name.endswith("weight") for name in tensors)
    assert all(float(t.min()) >= 0.0 for t in tensors.values())  # a diagonal Fisher is >= 0
    _assert_no_duplicates(settings, job["id"])
    # The same spec again is the stored result, not a new computation.
    again = services.submit(settings, "fisher", SMALL)
    assert again["reused"] is True and again["id"] == job["id"]


def test_a_worker_sizes_its_automatic_budget_within_max_job_memory(redis_stack) -> None:
    """Issue 30, one rule at submit and in the job: MAX_JOB_MEMORY_MB, checked against the
    estimate at submit, also bounds what the job takes on its device. A worker capped at 2 GiB
    on this 24 GB machine runs a Fisher job with the automatic temporaries budget: a quarter of
    the cap less what the worker holds (256 MiB at the least), stated in the result, and no more
    than the budget the estimate priced for the same cap. Before, the job took a quarter of the
    machine's free memory whatever the cap (about 5 GB here)."""
    from compute.contract.cost import BUDGET_MIN_MB, fisher_budget_bytes

    cap_mb = 2048
    redis_stack.start_worker("capped@test", extra_env={"MAX_JOB_MEMORY_MB": str(cap_mb)})
    settings = redis_stack.settings
    job = services.submit(settings, "fisher", {**SMALL, "seed": 11})
    done = redis_stack.wait_final(job["id"])
    assert done["status"] == "succeeded", done["error"]
    summary = services.result_by_token(settings, job["share_token"])["summary"]
    used = summary["memory_budget_mb"]
    priced = fisher_budget_bytes(None, cap_mb * 2**20) / 2**20
    assert priced == cap_mb / 4
    assert BUDGET_MIN_MB <= used <= priced, summary
    assert summary["settings"]["memory_budget_mb"] is None  # the automatic budget was asked for


def test_invalid_spec_is_refused_and_nothing_reaches_the_worker(stack) -> None:
    settings = stack.settings
    with pytest.raises(SpecError) as err:
        services.submit(settings, "fisher", {**SMALL, "samples": 100000})
    assert err.value.errors[0]["field"] == "samples"
    assert "accepted range" in err.value.errors[0]["message"]
    assert services.list_jobs(settings) == []
    stack.start_worker("w1@test")
    from compute.worker import BrokerView

    view = BrokerView(settings).load()  # nothing was queued, so nothing can reach a worker
    assert view.waiting == set() and view.unacked == {}


def test_sigkill_mid_job_then_restart_reruns_it_once(stack) -> None:
    w = stack.start_worker("w1@test", faults=["mid_job"])
    settings = stack.settings
    job = services.submit(settings, "fisher", SMALL)
    stack.wait_reached("mid_job")  # the job reported progress > 0 and waits there
    assert stack.job(job["id"])["progress"] > 0
    w.kill()
    # Dead worker: the row still says running (nobody can know yet) ...
    assert stack.job(job["id"])["status"] == "running"
    # ... until a worker with the same name starts: it re-queues the job (attempt 2) and runs it.
    stack.start_worker("w1@test")  # no fault points: runs through
    done = stack.wait_final(job["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 2
    counts = _row_counts(settings, job["id"])
    assert counts["layer_stats"] > 0 and counts["artifacts"] >= 1
    _assert_no_duplicates(settings, job["id"])


def test_worker_lost_on_last_attempt_is_marked_failed_not_running(fs_stack) -> None:
    stack = fs_stack
    env = {"FISHERLENS_MAX_ATTEMPTS": "1"}
    w = stack.start_worker("w1@test", env, faults=["after_claim"])
    job = services.submit(stack.settings, "fisher", SMALL)
    stack.wait_reached("after_claim")
    assert stack.job(job["id"])["status"] == "running"
    w.kill()
    stack.start_worker("w1@test", env)
    done = stack.wait_final(job["id"])
    assert done["status"] == "failed" and "worker lost" in done["message"]
    assert "w1@test" in done["error"]


@pytest.mark.redis
def test_stale_job_of_a_dead_machine_is_taken_over_by_another_worker(redis_stack) -> None:
    stack = redis_stack
    stack.env["JOB_STALE_AFTER_S"] = "4"  # heartbeat every second
    a = stack.start_worker("a@machine1", faults=["mid_job"])
    job = services.submit(stack.settings, "fisher", SMALL | {"seed": 7})
    stack.wait_reached("mid_job")
    a.kill()
    # Another machine's worker (another host name: no pid to check): its start-up or periodic
    # reconcile (every second) finds the heartbeat older than 4 s and re-queues the job (its
    # unacked message is restored), which it then runs itself.
    stack.start_worker("b@machine2")
    done = stack.wait_final(job["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["worker"] == "b@machine2" and done["attempts"] == 2


def test_cancel_running_job(fs_stack) -> None:
    stack = fs_stack
    stack.start_worker("w1@test", faults=["mid_job"])
    job = services.submit(stack.settings, "fisher", SMALL | {"seed": 3})
    stack.wait_reached("mid_job")
    services.cancel(stack.settings, job["id"])
    stack.release("mid_job")
    done = stack.wait_final(job["id"])
    assert done["status"] == "cancelled" and done["attempts"] == 1
    assert _row_counts(stack.settings, job["id"])["layer_stats"] == 0


@pytest.mark.redis
def test_sharded_fisher_over_two_workers_equals_one_worker(redis_stack) -> None:
    """Two worker processes each take a shard (child job rows), the last one queues the finisher;
    the stored Fisher equals the same spec computed start to end in one process."""
    import torch

    from compute.jobs.fisher_run import run
    from compute.jobs.registry import parse_spec

    stack = redis_stack
    stack.start_worker("w1@test")
    stack.start_worker("w2@test")
    settings = stack.settings
    spec = SMALL | {"prompts": 6, "shards": 2}
    job = services.submit(settings, "fisher", spec)
    one = run(parse_spec("fisher", spec))  # the whole job in one process, shard after shard
    done = stack.wait_final(job["id"])
    assert done["status"] == "succeeded", done["error"]
    with services.sessions(settings)() as s:
        shards = repo.shard_jobs(session=s, parent_id=job["id"])
        assert [j.status for j in shards] == ["succeeded", "succeeded"]
        assert {j.worker for j in shards} <= {"w1@test", "w2@test"}
    assert [j["id"] for j in services.list_jobs(settings)] == [job["id"]]  # shards hidden
    res = services.result_by_id(settings, job["id"])
    (art,) = [x for x in res["artifacts"] if x["kind"] == "fisher"]
    stored = open_store(settings).load_tensors(art["path"], art["sha256"])
    assert stored.keys() == one.tensors["fisher"].keys()
    for k, t in one.tensors["fisher"].items():
        torch.testing.assert_close(stored[k], t, rtol=1e-5, atol=1e-12)
    assert [s["param"] for s in res["layer_stats"]] == [s.param for s in one.layer_stats]
    assert res["summary"]["n_rows"] == one.summary["n_rows"]


def test_a_worker_writes_what_its_device_offers_and_submit_checks_against_it(stack) -> None:
    """Issue 30 item 5 on a deployment: a real worker process writes its device, the memory a
    job may take there (within its MAX_JOB_MEMORY_MB less what it holds) and keeps the row after
    a job; the web's submit (this process: no MAX_JOB_MEMORY_MB, its own RAM 20+ GB) checks a
    job against that figure and names the worker; the row goes when the worker shuts down."""
    from app import ceiling, limits
    from storage import workers

    cap_mb = 3072
    w = stack.start_worker("dev@test", extra_env={"MAX_JOB_MEMORY_MB": str(cap_mb)})
    settings = stack.settings

    def rows() -> list[dict]:
        ceiling._workers_cache.clear()
        with services.sessions(settings)() as s:
            return workers.live(session=s)

    deadline = time.monotonic() + 60  # written beside the worker's start-up, not before "ready"
    while not rows() and time.monotonic() < deadline:
        time.sleep(0.2)
    (row,) = rows()
    assert row["name"] == "dev@test" and row["device"] == "cpu"
    assert 0 < row["free_bytes"] < cap_mb * 2**20  # the cap less what the worker holds
    free, where = limits.free_memory(settings)
    assert (free, where) == (row["free_bytes"], "cpu of worker dev@test")
    # an SFT step of 256 rows x 1,024 tokens (about 3.1 GB of activations, fits this machine's
    # RAM, not the worker's cap): refused at submit, nothing queued
    with pytest.raises(SpecError) as err:
        services.submit(settings, "train", {"model": "arith-base", "algo": "sft", "batch": 256,
                                            "max_new_tokens": 1024, "steps": 1})
    (e,) = err.value.errors
    assert e["field"] == "memory" and "cpu of worker dev@test has" in e["message"], e
    assert services.list_jobs(settings) == []
    job = services.submit(settings, "fisher", {**SMALL, "seed": 21})
    done = stack.wait_final(job["id"])
    assert done["status"] == "succeeded", done["error"]
    (after,) = rows()
    assert after["seen_at"] >= row["seen_at"] and 0 < after["free_bytes"] < cap_mb * 2**20
    w.stop()
    assert rows() == []
