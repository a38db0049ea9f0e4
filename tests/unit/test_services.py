"""app.services against a real SQLite database and kombu's real filesystem queue (no worker):
what gets queued (the task name and the job id only), reuse, validation, cancel, rerun."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from app import services
from app.settings import get_settings
from compute.celery_app import RUN_JOB
from compute.specs import SpecError
from storage import repo


@pytest.fixture
def settings(fl_home: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FISHERLENS_QUEUE", "fisherlens")
    zoo = fl_home / "zoo" / "arith-base"  # model_revision only hashes the files
    zoo.mkdir(parents=True)
    (zoo / "config.json").write_text('{"model_type": "llama"}')
    (zoo / "model.safetensors").write_bytes(b"weights-v1")
    return get_settings()


def _messages(settings) -> list[dict]:
    folder = Path(settings.queue_dir) / "messages"
    out = []
    for f in sorted(folder.glob("*.msg")) if folder.exists() else []:
        msg = json.loads(f.read_text())
        body = json.loads(base64.b64decode(msg["body"]))
        out.append({"task": msg["headers"]["task"], "args": body[0], "kwargs": body[1]})
    return out


def test_submit_creates_row_and_queues_task_by_name_with_only_the_id(settings) -> None:
    job = services.submit(settings, "fisher", {"model": "arith-base", "prompts": 8, "samples": 2})
    assert job["status"] == "queued" and job["reused"] is False
    assert job["share_url"] == f"{settings.public_url}/r/{job['share_token']}"
    assert _messages(settings) == [{"task": RUN_JOB, "args": [job["id"]], "kwargs": {}}]
    row = services.get_job(settings, job["id"])
    assert row["spec"]["prompts"] == 8 and row["spec"]["estimator"] == "sequence"  # defaults stored
    assert row["revisions"][0].startswith("model=") and len(row["revisions"]) == 1
    assert len(row["model_revision"]) == 64  # sha256 of the joined parts, fits any database


def test_identical_succeeded_spec_is_reused_until_model_changes(settings) -> None:
    first = services.submit(settings, "fisher", {"model": "arith-base", "prompts": 8})
    # Not succeeded yet: a second identical submit is a new job.
    second = services.submit(settings, "fisher", {"model": "arith-base", "prompts": 8})
    assert second["id"] != first["id"]
    with services.sessions(settings)() as s:
        repo.mark_succeeded(session=s, job_id=first["id"])
    again = services.submit(settings, "fisher", {"prompts": 8, "model": "arith-base", "samples": 4})
    assert again["reused"] is True and again["id"] == first["id"]
    assert len(_messages(settings)) == 2  # the reuse queued nothing
    (Path(settings.zoo_dir) / "arith-base" / "model.safetensors").write_bytes(b"weights-v2")
    changed = services.submit(settings, "fisher", {"model": "arith-base", "prompts": 8})
    assert changed["reused"] is False and changed["id"] not in (first["id"], second["id"])
    forced = services.submit(settings, "fisher", {"model": "arith-base", "prompts": 8}, reuse=False)
    assert forced["reused"] is False


def test_invalid_spec_names_fields_and_queues_nothing(settings) -> None:
    with pytest.raises(SpecError) as err:
        services.submit(settings, "fisher", {"model": "arith-base", "prompts": 0, "bogus": 1})
    fields = {e["field"]: e["message"] for e in err.value.errors}
    assert "accepted range" in fields["prompts"] and ">= 1" in fields["prompts"]
    assert fields["bogus"] == "unknown field"
    with pytest.raises(SpecError, match="kind"):
        services.submit(settings, "nope", {})
    with pytest.raises(SpecError) as err:
        services.submit(settings, "fisher", {"model": "/etc"})
    assert err.value.errors[0]["field"] == "model" and "allowed" in err.value.errors[0]["message"]
    with pytest.raises(SpecError, match="model"):
        services.submit(settings, "fisher", {"model": "not-built-yet"})
    assert _messages(settings) == []
    assert services.list_jobs(settings) == []


def test_job_references_must_be_succeeded_jobs_of_the_right_kind(settings) -> None:
    fisher = services.submit(settings, "fisher", {"model": "arith-base"})
    with pytest.raises(SpecError, match="fisher: 'job:.*' is queued"):
        services.submit(settings, "mask", {"fisher": f"job:{fisher['id']}"})
    with pytest.raises(SpecError, match="no such job"):
        services.submit(settings, "mask", {"fisher": "job:999"})
    with pytest.raises(SpecError, match="is a fisher job; a mask job is needed"):
        services.submit(settings, "train", {"model": "arith-base", "mask": f"job:{fisher['id']}"})
    with pytest.raises(SpecError, match="outside the artifact root"):
        services.submit(settings, "mask", {"fisher": "/etc/passwd"})
    with services.sessions(settings)() as s:
        repo.mark_succeeded(session=s, job_id=fisher["id"])
    mask = services.submit(settings, "mask", {"fisher": f"job:{fisher['id']}", "density": 0.1})
    assert mask["status"] == "queued"


def test_cancel_and_rerun(settings) -> None:
    job = services.submit(settings, "fisher", {"model": "arith-base"})
    with pytest.raises(ValueError, match="still queued"):
        services.rerun(settings, job["id"])
    assert services.cancel(settings, job["id"])["status"] == "cancelled"
    new = services.rerun(settings, job["id"])
    assert new["id"] != job["id"] and new["spec"] == job["spec"] and new["status"] == "queued"
    with pytest.raises(LookupError):
        services.cancel(settings, 12345)


def test_results_by_token(settings) -> None:
    job = services.submit(settings, "fisher", {"model": "arith-base"})
    res = services.result_by_token(settings, job["share_token"])
    assert res["job"]["id"] == job["id"] and res["layer_stats"] == [] and res["artifacts"] == []
    assert services.result_by_token(settings, "not-a-token") is None
    assert services.artifact_path(settings, job["share_token"], "fisher") is None


def test_broker_down_marks_job_failed_not_queued(fl_home: Path, monkeypatch) -> None:
    zoo = fl_home / "zoo" / "arith-base"
    zoo.mkdir(parents=True)
    (zoo / "config.json").write_text("{}")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens on port 1
    monkeypatch.setenv("FISHERLENS_QUEUE", "fisherlens")
    settings = get_settings()
    from compute import celery_app

    celery_app._apps.clear()
    app = celery_app.celery_for(settings)
    app.conf.broker_connection_retry = False
    app.conf.broker_connection_max_retries = 0
    app.conf.broker_transport_options = {"max_retries": 0}
    with pytest.raises(RuntimeError, match="could not queue"):
        services.submit(settings, "fisher", {"model": "arith-base"})
    (row,) = services.list_jobs(settings)
    assert row["status"] == "failed" and "broker" in row["message"]
    celery_app._apps.clear()


# -- the CLI on top of the services ---------------------------------------------------------------
def test_cli_submit_status_jobs_cancel(settings, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from app.cli import main

    cli = CliRunner()
    bad = cli.invoke(main, ["submit", "fisher", "--spec", '{"model": "arith-base", "prompts": 0}'])
    assert bad.exit_code == 2
    assert "prompts: got 0; accepted range: >= 1, <= 4096" in bad.output
    assert cli.invoke(main, ["submit", "fisher", "--spec", "{nope"]).exit_code == 2
    assert _messages(settings) == []

    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps({"model": "arith-base", "task": "arithmetic", "prompts": 8, "samples": 2})
    )
    ok = cli.invoke(main, ["submit", "fisher", "--spec", f"@{spec}"])
    assert ok.exit_code == 0, ok.output
    job_id = int(ok.output.split()[1])
    assert "share link: http://127.0.0.1:7860/r/" in ok.output
    assert _messages(settings) == [{"task": RUN_JOB, "args": [job_id], "kwargs": {}}]
    assert cli.invoke(main, ["status", str(job_id)]).output.strip() == "queued"
    listing = cli.invoke(main, ["jobs"]).output
    assert f"{job_id:>5}  fisher    queued" in listing
    assert "cancelled" in cli.invoke(main, ["cancel", str(job_id)]).output
    assert cli.invoke(main, ["status", str(job_id)]).output.strip() == "cancelled"
    waited = cli.invoke(main, ["status", str(job_id), "--wait", "--timeout", "1"])
    assert waited.exit_code == 1 and waited.output.strip() == "cancelled"
    missing = cli.invoke(main, ["status", "999"])
    assert missing.exit_code == 2 and "no job with id 999" in missing.output
    assert cli.invoke(main, ["db", "upgrade"]).exit_code == 0


def test_web_side_modules_do_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, app.services, app.commands.jobs, compute.celery_app, storage.repo;"
        "print(sorted(m for m in ('torch', 'transformers', 'compute.worker') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
