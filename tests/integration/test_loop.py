"""The research loop end to end on the deployed stack (Redis + PostgreSQL, real `fisherlens
worker` processes), every step taking the previous one's result by `job:N`:

    fisher -> mask(fisher=job:F) -> train(mask=job:M) -> diff(tuned=job:T, fisher=job:F)
           -> tokens(model=job:T)             and   train(algo=opd, teacher=arith-teacher)
           -> fisher(model=job:T) -> mask(fisher=job:F2) -> train(model=job:T, mask=job:M2,
                                                                   gradient_checkpointing)

The references are resolved once, at submit (app.services.refs), stored with the job, and the
workers only re-verify their sha256: the Fisher of a trained model is read from the artifact
store, never re-resolved against the model roots.

Checked: every job succeeds, its rows and artifacts are stored (sha256-verified), the trained
weights moved only inside the mask (bit-identical elsewhere) and the diff job measured exactly
that, long revision lists fit PostgreSQL, and every share link serves its result."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from app import services
from storage import repo

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SMALL = {"max_new_tokens": 4}
TRAIN = {"steps": 2, "batch": 2, "group": 2, "eval_prompts": 4, "bound": False, **SMALL}


def _run(stack, kind: str, spec: dict) -> dict:
    job = services.submit(stack.settings, kind, spec, reuse=False)
    assert job["status"] == "queued", job
    done = stack.wait_final(job["id"], timeout=300)
    assert done["status"] == "succeeded", f"{kind} job: {done}\n{stack.logs()}"
    return done


def _artifact(stack, job: dict, kind: str):
    path = services.artifact_path(stack.settings, job["share_token"], kind)  # verifies sha256
    assert path is not None and path.exists(), (job["id"], kind)
    return path


def test_fisher_mask_train_diff_tokens_and_opd_through_workers(redis_stack):
    stack = redis_stack
    stack.start_worker()
    stack.start_worker()
    settings = stack.settings
    assert settings.db_url.startswith("postgresql")

    # OPD from a teacher runs on the second worker while the loop goes on.
    opd = services.submit(settings, "train", {"model": "arith-base", "algo": "opd",
                                              "teacher": "arith-teacher", **TRAIN}, reuse=False)

    fisher = _run(stack, "fisher", {"model": "arith-base", "prompts": 4, "samples": 2, **SMALL})
    f_res = services.result_by_token(settings, fisher["share_token"])
    assert f_res["layer_stats"] and f_res["summary"]["n_samples"] == 8
    # the estimate shown at submit is kept with the job on PostgreSQL, and the result says what
    # the job took on the worker process against it, by the job's parts (jobs.estimate, Time)
    from app.figures.keynumbers import key_numbers

    est = f_res["job"]["estimate"]
    assert est and est["seconds"] > 0 and est["memory_bytes"] > 0, est
    took = f_res["summary"]["seconds_parts"]
    assert {"load", "sampling", "self-check", "per-sample passes", "statistics"} <= set(took), took
    if est.get("seconds_parts"):  # a calibrated worker home: the same part names
        assert set(took) <= set(est["seconds_parts"]), (took, est["seconds_parts"])
    when = next(i for i in key_numbers(f_res)["items"] if i["label"] == "Time")
    assert when["value"].startswith("took ") and "estimated" in when["value"], when
    fisher_file = _artifact(stack, fisher, "fisher")

    mask = _run(stack, "mask", {"fisher": f"job:{fisher['id']}", "density": 0.05})
    m_sum = services.result_by_token(settings, mask["share_token"])["summary"]
    assert m_sum["fisher"] == f"job:{fisher['id']}"  # the reference is shown, not a server path
    mask_t = load_file(str(_artifact(stack, mask, "mask")))
    assert set(mask_t) == set(load_file(str(fisher_file)))
    assert sum(int(m.sum()) for m in mask_t.values()) == m_sum["kept"] > 0

    train = _run(stack, "train", {"model": "arith-base", "mask": f"job:{mask['id']}", **TRAIN})
    trained_dir = _artifact(stack, train, "model")
    base = load_file(str(settings.zoo_dir / "arith-base" / "model.safetensors"))
    tuned = load_file(str(trained_dir / "model.safetensors"))
    moved = 0
    for name, m in mask_t.items():
        if name not in tuned:
            continue  # e.g. a tied output layer is saved once
        changed = tuned[name] != base[name]
        assert not bool((changed & ~m).any()), f"{name} moved outside the mask"
        moved += int(changed.sum())
    assert moved > 0  # and the masked coordinates did train

    diff = _run(stack, "diff", {"base": "arith-base", "tuned": f"job:{train['id']}",
                                "fisher": f"job:{fisher['id']}"})
    d_row = services.get_job(settings, diff["id"])
    assert [p.split("=")[0] for p in d_row["revisions"]] == ["base", "tuned", "fisher"]
    assert len(";".join(d_row["revisions"])) > 128 and len(d_row["model_revision"]) == 64
    d_sum = services.result_by_token(settings, diff["share_token"])["summary"]
    assert d_sum["tuned"] == f"job:{train['id']}"
    n = d_sum["n_params"]
    assert d_sum["changed_fraction"] == pytest.approx(moved / n, abs=0.5 / n)

    tokens = _run(stack, "tokens", {"model": f"job:{train['id']}", "context": "12+34=", "top_k": 4,
                                    "layer": 0, "random_k": 2, "low_k": 2})
    t_res = services.result_by_token(settings, tokens["share_token"])
    assert len(t_res["summary"]["top_tokens"]) == 4 and t_res["heatmaps"]

    # the loop again from the trained model: its Fisher, a mask from it, a masked train from it
    fisher2 = _run(stack, "fisher", {"model": f"job:{train['id']}", "prompts": 4, "samples": 2, **SMALL})
    f2_sum = services.result_by_token(settings, fisher2["share_token"])["summary"]
    assert f2_sum["model"] == f"job:{train['id']}" and f2_sum["n_samples"] == 8
    fisher2_t = load_file(str(_artifact(stack, fisher2, "fisher")))
    assert set(fisher2_t) == set(load_file(str(fisher_file)))
    assert any(not bool((fisher2_t[n] == f).all()) for n, f in load_file(str(fisher_file)).items())
    mask2 = _run(stack, "mask", {"fisher": f"job:{fisher2['id']}", "density": 0.05})
    mask2_t = load_file(str(_artifact(stack, mask2, "mask")))
    # with gradient checkpointing (the memory option a refusal names): same loop, frozen outside the mask
    train2 = _run(stack, "train", {"model": f"job:{train['id']}", "mask": f"job:{mask2['id']}",
                                   "gradient_checkpointing": True, **TRAIN})
    assert services.get_job(settings, train2["id"])["spec"]["gradient_checkpointing"] is True
    tuned2 = load_file(str(_artifact(stack, train2, "model") / "model.safetensors"))
    moved2 = 0
    for name, m in mask2_t.items():
        if name not in tuned2:
            continue
        changed = tuned2[name] != tuned[name]
        assert not bool((changed & ~m).any()), f"{name} moved outside the second mask"
        moved2 += int(changed.sum())
    assert moved2 > 0
    assert [p.split("=")[0] for p in services.get_job(settings, train2["id"])["revisions"]] == ["model", "mask"]

    opd = stack.wait_final(opd["id"], timeout=300)
    assert opd["status"] == "succeeded", f"{opd}\n{stack.logs()}"
    o_sum = services.result_by_token(settings, opd["share_token"])["summary"]
    assert o_sum["algo"] == "opd" and len(services.get_job(settings, opd["id"])["revisions"]) == 2
    _artifact(stack, opd, "model")

    # one row per job, nothing else queued or failed, every share link serves its result
    from fastapi.testclient import TestClient

    from app.web import create_app

    jobs = {j["id"]: j for j in services.list_jobs(settings, limit=50)}
    assert set(jobs) == {fisher["id"], mask["id"], train["id"], diff["id"], tokens["id"], opd["id"],
                         fisher2["id"], mask2["id"], train2["id"]}
    assert {j["status"] for j in jobs.values()} == {"succeeded"}
    with services.sessions(settings)() as s:
        assert all(repo.get_job(session=s, job_id=i).attempts == 1 for i in jobs)
    client = TestClient(create_app(settings), base_url="http://127.0.0.1")  # embedded: a loopback Host
    for j in jobs.values():
        page = client.get(f"/r/{j['share_token']}")
        assert page.status_code == 200 and f"#{j['id']}" in page.text, (j["id"], page.status_code)
        api = client.get(f"/api/results/{j['share_token']}").json()
        assert api["job"]["id"] == j["id"] and api["job"]["status"] == "succeeded"
    # the trained model is offered where models are chosen
    refs = [m["ref"] for m in client.get("/api/models").json()]
    assert f"job:{train['id']}" in refs and f"job:{opd['id']}" in refs
