"""A job's status line says what it waits for while a model loads (issue 18: a SmolLM2 tokens job
showed "0% · loading" for 90 s): compute.lm.causal_lm.load_model reports its stages, and the worker's
progress callback writes each new stage at once, even inside its 0.5 s throttle (a dropped stage
name would stay on screen through the next, long stage). Real SQLite job row, real zoo model."""

from __future__ import annotations

from compute.contract.settings import Settings


def _running_job(settings: Settings) -> int:
    from app import services
    from storage import repo

    with services.sessions(settings)() as s:
        job = repo.create_job(session=s, kind="tokens", spec={"model": "arith-base"}, spec_hash="p")
        repo.claim_job(session=s, job_id=job.id, worker="t", stale_after_s=60)
        return job.id


def _row(settings: Settings, job_id: int) -> tuple[float, str]:
    from app import services
    from storage import repo

    with services.sessions(settings)() as s:
        job = repo.get_job(session=s, job_id=job_id)
        return job.progress, job.message


def test_each_loading_stage_reaches_the_job_row_at_once(tmp_path):
    from compute.worker.lifecycle import JobProgress

    settings = Settings(fisherlens_home=tmp_path, database_url=None, redis_url=None)
    job_id = _running_job(settings)
    progress = JobProgress(settings, job_id)
    progress(0.0, "loading the tokenizer of m")
    progress(0.0, "loading the weights of m (270 MB)")  # within 0.5 s: a new stage, written
    assert _row(settings, job_id) == (0.0, "loading the weights of m (270 MB)")
    progress(0.1, "sampling 1/8")  # a new stage at a new fraction: written too
    progress(0.2, "sampling 2/8")  # the same stage moving on within 0.5 s: throttled
    assert _row(settings, job_id) == (0.1, "sampling 1/8")


def test_load_model_names_its_stages(zoo_home, monkeypatch):
    from compute.lm.causal_lm import load_model

    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    heard: list[tuple[float, str]] = []
    model, tok = load_model("arith-base", device="cpu", dtype="float32",
                            progress=lambda f, m: heard.append((f, m)))
    assert [m.split(" of ")[0] for _, m in heard] == ["loading the tokenizer", "loading the weights"]
    assert heard[1][1].endswith(" MB)") and all(f == 0.0 for f, _ in heard)
