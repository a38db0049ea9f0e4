"""What a job took against what it was estimated to take, part by part, for every kind: the
estimate its submitter saw is kept with the job (jobs.estimate, migration 0007), the job reports
its time by the estimate's part names (summary.seconds_parts), and the result's key numbers and
share page show both (app.figures.keynumbers.time_item)."""

from __future__ import annotations

import shutil

import pytest

from app.figures.keynumbers import key_numbers, time_item


def test_a_submitted_job_keeps_its_estimate_and_its_result_shows_it_by_part(zoo_home, tmp_path, monkeypatch) -> None:
    from fastapi.testclient import TestClient

    from app.web import create_app
    from compute.contract.settings import Settings
    from compute.worker.execute import execute_job

    home = tmp_path / "home"
    shutil.copytree(zoo_home / "zoo" / "arith-base", home / "zoo" / "arith-base")
    (home / "throughput.json").write_text('{"seconds_per_token_pass": 1e-5, "seconds_per_param_token_pass": 2e-11}')
    monkeypatch.setenv("FISHERLENS_HOME", str(home))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    settings = Settings(fisherlens_home=home, database_url=None, redis_url=None, public_url="http://testserver")
    client = TestClient(create_app(settings), follow_redirects=False, base_url="http://127.0.0.1")
    spec = {"model": "arith-base", "prompts": 2, "samples": 2, "max_new_tokens": 4, "device": "cpu"}
    shown = client.post("/api/estimate", json={"kind": "fisher", "spec": spec}).json()
    r = client.post("/api/jobs", json={"kind": "fisher", "spec": spec})
    assert r.status_code == 201, r.text
    job = r.json()
    # the job row keeps what the submitter was shown (and the cost model's parts before any
    # correction by the clock: none yet, no job has run), nothing else of the estimate
    assert shown["seconds_corrections"] == {} and shown["model_seconds_parts"] == shown["seconds_parts"]
    assert job["estimate"]["seconds"] == shown["seconds"] and job["estimate"]["seconds_parts"] == shown["seconds_parts"]
    assert set(job["estimate"]) == {"seconds", "seconds_from", "seconds_parts", "model_seconds_parts",
                                    "completion_lengths_from", "memory_bytes"}
    assert job["estimate"]["completion_lengths_from"] is None  # no job has sampled this model yet
    assert execute_job(settings, job["id"]) == "succeeded"
    res = client.get(f"/api/results/{job['share_token']}").json()
    assert res["job"]["estimate"] == job["estimate"]
    took = res["summary"]["seconds_parts"]
    assert set(took) == set(shown["seconds_parts"]), (took, shown["seconds_parts"])
    when = next(i for i in key_numbers(res)["items"] if i["label"] == "Time")
    assert when["value"].startswith("took ") and "estimated" in when["value"] and "at submit" in when["value"]
    assert when["note"].startswith("by part, took / estimated: load ")
    for part in shown["seconds_parts"]:
        assert f"{part} " in when["note"], (part, when["note"])
    page = client.get(f"/r/{job['share_token']}").text
    assert "estimated" in page and "by part, took / estimated" in page

    # the next estimate on this model prices its sampling by how long that job's completions ran
    # (the job recorded them); the first job's clock was against the upper bound (every batch to
    # max_new_tokens), so it corrects nothing priced on the lengths
    again = client.post("/api/estimate", json={"kind": "fisher", "spec": {**spec, "prompts": 3}}).json()
    assert again["completion_lengths_from"] == {"jobs": [job["id"]], "rows": 4, "temperature": 1.0}
    assert "sampling priced on how long 4 completions of this model on this task ran (job " in again["seconds_from"]
    assert again["seconds_corrections"] == {}
    # a second job keeps the uncorrected parts too: its own correction is measured against
    # them, so corrections never compound
    second = client.post("/api/jobs", json={"kind": "fisher", "spec": {**spec, "prompts": 3}}).json()
    assert second["estimate"]["model_seconds_parts"] == pytest.approx(again["model_seconds_parts"])
    assert second["estimate"]["seconds_parts"] == pytest.approx(again["seconds_parts"])
    assert second["estimate"]["completion_lengths_from"]["jobs"] == [job["id"]]
    assert execute_job(settings, second["id"]) == "succeeded"
    took2 = client.get(f"/api/results/{second['share_token']}").json()["summary"]["seconds_parts"]

    # the next estimate on this model learns from that job's clock, part by part: each part
    # scaled by took / cost-model estimate (within 1/4..4), said in seconds_from
    third = client.post("/api/estimate", json={"kind": "fisher", "spec": {**spec, "prompts": 5}}).json()
    assert third["completion_lengths_from"]["jobs"] == [second["id"], job["id"]]  # newest first
    corr = third["seconds_corrections"]
    assert set(corr) == set(took2) and all(c["jobs"] == 1 for c in corr.values()), corr
    for p, c in corr.items():
        want = min(4.0, max(0.25, took2[p] / second["estimate"]["model_seconds_parts"][p]))
        assert c["factor"] == pytest.approx(want), (p, c, want)
        assert third["seconds_parts"][p] == pytest.approx(third["model_seconds_parts"][p] * c["factor"])
    assert third["seconds"] == pytest.approx(sum(third["seconds_parts"].values()))
    assert "by the clock of 1 earlier job on this model" in third["seconds_from"]
    # another model: nothing to learn from
    other = client.post("/api/estimate", json={"kind": "fisher", "spec": {**spec, "model": "arith-teacher"}}).json()
    assert other.get("seconds_corrections") in ({}, None) and other["completion_lengths_from"] is None, other

    # one rule, every kind that samples: a GRPO run's estimate on the same model and task prices
    # its rollouts by the Fisher jobs' recorded lengths (arith-base answers in a few tokens: less
    # than to max_new_tokens), at the temperature they were sampled at only
    train = {"model": "arith-base", "algo": "grpo", "steps": 2, "batch": 2, "group": 4, "max_new_tokens": 16,
             "bound": False, "concentration": False, "device": "cpu"}
    seen = client.post("/api/estimate", json={"kind": "train", "spec": train}).json()
    unseen = client.post("/api/estimate", json={"kind": "train", "spec": {**train, "temperature": 0.7}}).json()
    assert seen["completion_lengths_from"]["jobs"] == [second["id"], job["id"]]
    assert unseen["completion_lengths_from"] is None
    assert seen["seconds_parts"]["steps"] < 0.8 * unseen["seconds_parts"]["steps"]
    assert seen["seconds_parts"]["evaluation"] == unseen["seconds_parts"]["evaluation"]  # greedy: the bound


def test_the_time_item_without_an_estimate_or_a_job() -> None:
    """A direct CLI run has no estimate row: the parts alone; a part the estimate did not name is
    shown against '-'; nothing at all when the result holds no time."""
    res = {"kind": "fisher", "summary": {"seconds_parts": {"sampling": 0.5, "statistics": 12.0}}}
    assert time_item(res) == {"label": "Time", "value": "took 12 s", "note": "by part: sampling 0.5 s; statistics 12 s"}
    res["job"] = {"started_at": "2026-12-07T03:00:00+00:00", "finished_at": "2026-12-07T03:03:00+00:00",
                  "estimate": {"seconds": 150.0, "seconds_parts": {"sampling": 1.0, "load": 3.0}}}
    got = time_item(res)
    assert got is not None and got["value"] == "took 3 min, estimated 2 min at submit"
    assert got["note"] == "by part, took / estimated: sampling 0.5 s / 1 s; load - / 3 s; statistics 12 s / -"
    assert time_item({"kind": "fisher", "summary": {}}) is None
