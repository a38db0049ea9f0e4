"""app.services against a real SQLite database and kombu's real filesystem queue (no worker):
what gets queued (the task name and the job id only), reuse, validation, cancel, rerun."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

from app import services
from compute.contract.settings import get_settings
from compute.contract.specs import SpecError
from compute.runtime.celery_app import RUN_JOB
from storage import repo
from tests.pg import pg_schema_url


@pytest.fixture
def settings(fl_home: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FISHERLENS_QUEUE", "fisherlens")
    zoo = fl_home / "zoo" / "arith-base"  # model_revision only hashes the files
    zoo.mkdir(parents=True)
    (zoo / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    (zoo / "model.safetensors").write_bytes(b"weights-v1")
    teacher = fl_home / "zoo" / "arith-teacher"
    teacher.mkdir(parents=True)
    (teacher / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    (teacher / "model.safetensors").write_bytes(b"teacher")
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
    with pytest.raises(SpecError, match=f"fisher: job {fisher['id']} is queued; only a succeeded"):
        services.submit(settings, "mask", {"fisher": f"job:{fisher['id']}"})
    with pytest.raises(SpecError, match="job 999 does not exist"):
        services.submit(settings, "mask", {"fisher": "job:999"})
    with pytest.raises(SpecError, match="is a fisher job; a mask or train job is needed"):
        services.submit(settings, "train", {"model": "arith-base", "mask": f"job:{fisher['id']}"})
    with pytest.raises(SpecError, match="outside the allowed model roots"):
        services.submit(settings, "mask", {"fisher": "/etc/passwd"})
    with services.sessions(settings)() as s:
        repo.mark_succeeded(session=s, job_id=fisher["id"])
    with pytest.raises(SpecError, match=f"job {fisher['id']} has no fisher artifact"):
        services.submit(settings, "mask", {"fisher": f"job:{fisher['id']}"})
    _store_result(settings, fisher["id"], tensors={"fisher": {"w": torch.ones(3)}})
    mask = services.submit(settings, "mask", {"fisher": f"job:{fisher['id']}", "density": 0.1})
    assert mask["status"] == "queued"
    assert mask["revisions"][0].startswith(f"fisher=job:{fisher['id']}:")


def _store_result(settings, job_id: int, **kw) -> None:
    from compute.contract.jobresult import JobResult
    from storage.artifacts import open_store

    with services.sessions(settings)() as s:
        repo.save_result(session=s, job_id=job_id, result=JobResult(kind="x", summary={}, **kw),
                         store=open_store(settings))
        repo.mark_succeeded(session=s, job_id=job_id)


def _trained(settings, tmp_path: Path, **spec) -> dict:
    """A succeeded train job whose saved model folder is in the artifact store (as a worker
    leaves it): the folder is an HF directory with 2 layers."""
    job = services.submit(settings, "train", {"model": "arith-base", **spec})
    out = tmp_path / f"trained-{job['id']}"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    (out / "model.safetensors").write_bytes(b"trained weights")
    _store_result(settings, job["id"], files={"model": str(out)})
    return job


def test_trained_model_is_a_model_everywhere(settings, tmp_path: Path) -> None:
    """job:N of a succeeded train job is accepted as model, teacher, base and tuned; the trained
    folder lives in the artifact store (outside the allowed model roots), is verified by sha256,
    and errors name the field without server paths."""
    from app.services.refs import resolve
    from compute.contract.modelref import resolve_model

    trained = _trained(settings, tmp_path, mask_select="fisher", mask_density=0.1)
    ref = f"job:{trained['id']}"
    art = resolve(settings, "tuned", ref, "model")
    assert art.label == f"#{trained['id']} train arith-base grpo masked"
    assert (art.form, art.job_id, art.job_kind, art.path) == ("artifact", trained["id"], "train", f"{trained['id']}/model")
    local = Path(art.where())
    assert local.is_relative_to(settings.artifacts_dir) and (local / "config.json").is_file()
    with pytest.raises(ValueError, match="is a job reference"):  # the engine never resolves job:N
        resolve_model(ref, settings)
    for kind, spec in [
        ("diff", {"base": "arith-base", "tuned": ref}),
        ("fisher", {"model": ref, "prompts": 2}),
        ("tokens", {"model": ref, "context": "1+1=", "layer": 1}),
        ("train", {"model": "arith-base", "algo": "opd", "teacher": ref}),
    ]:
        job = services.submit(settings, kind, spec)
        assert job["status"] == "queued", (kind, job)
        assert any(p.startswith(f"{f}=job:{trained['id']}:") for p in job["revisions"]
                   for f in ("model", "teacher", "tuned"))
    with pytest.raises(SpecError) as err:
        services.submit(settings, "tokens", {"model": ref, "context": "1+1=", "layer": 2})
    assert err.value.errors == [{"field": "layer", "message": "got 2; accepted range: >= 0, <= 1 (the model has 2 blocks)"}]
    fisher = services.submit(settings, "fisher", {"model": "arith-base", "prompts": 3})
    with pytest.raises(SpecError, match="tuned: job .* is a fisher job; a train job is needed"):
        services.submit(settings, "diff", {"base": "arith-base", "tuned": f"job:{fisher['id']}"})
    # corrupt, then missing: a clear 4xx-style message, no server path
    (local / "model.safetensors").write_bytes(b"changed")
    with pytest.raises(SpecError) as err:
        services.submit(settings, "diff", {"base": "arith-base", "tuned": ref, "topk_percent": 2})
    msg = err.value.errors[0]["message"]
    assert err.value.errors[0]["field"] == "tuned" and "does not match its recorded sha256" in msg
    import shutil

    shutil.rmtree(local)
    with pytest.raises(SpecError, match="missing from the artifact store") as err:
        services.submit(settings, "diff", {"base": "arith-base", "tuned": ref, "topk_percent": 3})
    assert str(settings.home) not in str(err.value)


@pytest.mark.parametrize(
    ("kind", "spec", "field", "words"),
    [
        ("train", {"model": "arith-base", "algo": "opd"}, "teacher", "needs a teacher"),
        ("fisher", {"model": "arith-base", "task": "nonsense"}, "task", "unknown task 'nonsense'"),
        ("fisher", {"model": "arith-base", "task": "arithmetic?digits=1000000"}, "task", "accepted: 1..6"),
        ("fisher", {"model": "arith-base", "task": "arithmetic?bogus=1"}, "task", "unknown option"),
        ("fisher", {"model": "arith-base", "task": "jsonl:/missing.jsonl"}, "task", "outside the allowed roots"),
        ("fisher", {"model": "arith-base", "task": "jsonl:data.jsonl"}, "task", "absolute path"),
        ("tokens", {"model": "arith-base", "context": "1+", "layer": 7}, "layer", "got 7; accepted range: >= 0, <= 1"),
        ("fisher", {"model": "arith-base", "prompts": 1.5}, "prompts", "whole number"),
        ("fisher", {"model": "arith-base", "device": "banana"}, "device", "cuda:N"),
        ("fisher", {"model": "arith-base", "prompts": 2, "shards": 3}, "shards", "<= prompts (2)"),
        ("mask", {"select": "fisher"}, "fisher", "needs a Fisher"),
        ("mask", {"select": "gradient", "gradient": "job:1", "model": "arith-base"}, "gradient", "not accepted"),
        ("train", {"model": "arith-base", "mask_select": "fisher"}, "mask_density", "needed with mask_select"),
        ("retention", {"model": "arith-teacher", "algo": "opd"}, "teacher", "needs a teacher"),
        ("retention", {"model": "arith-base", "algo": "opd", "teacher": "not-built"}, "teacher", "unknown model"),
        ("diff", {"base": "arith-base", "tuned": "job:x"}, "tuned", "not a job reference"),
        ("fisher", {"model": "a" * 300}, "model", "not a usable model reference"),
        ("fisher", {"model": "no-org/not-cached"}, "model", "not in the local cache"),
    ],
)
def test_bad_input_never_queues_anything(settings, kind, spec, field, words) -> None:
    with pytest.raises(SpecError) as err:
        services.submit(settings, kind, spec)
    fields = {e["field"]: e["message"] for e in err.value.errors}
    assert field in fields and words in fields[field], err.value.errors
    assert _messages(settings) == [] and services.list_jobs(settings) == []
    for e in err.value.errors:  # no server path in what the user sees
        assert str(settings.home) not in e["message"]


def test_references_that_do_not_fit_together_are_refused(settings, tmp_path: Path) -> None:
    """What the worker checks when it loads two references (Fisher or mask vs model, base vs
    tuned, teacher tokenizer) is checked at submit time from safetensors headers and
    tokenizer.json (no torch, no weights read)."""
    from safetensors.torch import save_file

    zoo = Path(settings.zoo_dir)
    for name, hidden in (("arith-base", 4), ("other-arch", 6)):
        (zoo / name).mkdir(exist_ok=True)
        (zoo / name / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 1}')
        save_file({"w.weight": torch.zeros(hidden, 3), "b": torch.zeros(2)}, str(zoo / name / "model.safetensors"))
        vocab = {"a": 0, "b": 1} if name == "arith-base" else {"a": 0, "c": 1}
        (zoo / name / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))
    fisher = services.submit(settings, "fisher", {"model": "other-arch"})
    _store_result(settings, fisher["id"], tensors={"fisher": {"w.weight": torch.ones(6, 3), "b": torch.ones(2)}})
    with pytest.raises(SpecError) as err:
        services.submit(settings, "mask", {"fisher": f"job:{fisher['id']}", "model": "arith-base"})
    assert err.value.errors == [{"field": "fisher", "message": "parameter 'w.weight' has shape [6, 3] in the fisher but [4, 3] in the model"}]
    ok = services.submit(settings, "mask", {"fisher": f"job:{fisher['id']}", "model": "other-arch"})
    assert ok["status"] == "queued"
    with pytest.raises(SpecError, match="tuned: different architecture: parameter 'w.weight'"):
        services.submit(settings, "diff", {"base": "arith-base", "tuned": "other-arch"})
    with pytest.raises(SpecError, match="teacher: its tokenizer differs from the model's"):
        services.submit(settings, "train", {"model": "arith-base", "algo": "opd", "teacher": "other-arch"})
    mask = Path(settings.artifacts_dir) / "mask.safetensors"
    mask.parent.mkdir(parents=True, exist_ok=True)
    save_file({"x": torch.ones(2, dtype=torch.bool)}, str(mask))
    with pytest.raises(SpecError, match=r"mask: .* is inside the artifact store; write job:<id>"):
        services.submit(settings, "train", {"model": "arith-base", "mask": str(mask)})
    mask = Path(settings.zoo_dir) / "mask.safetensors"  # inside the allowed model roots
    save_file({"x": torch.ones(2, dtype=torch.bool)}, str(mask))
    # issue 27: a mask must cover every parameter of the model (the worker would refuse it)
    with pytest.raises(SpecError, match="mask: parameter 'b' is in the model but not in the mask"):
        services.submit(settings, "train", {"model": "arith-base", "mask": str(mask)})
    assert _messages(settings) == [{"task": RUN_JOB, "args": [j], "kwargs": {}} for j in (fisher["id"], ok["id"])]


def test_jsonl_tasks_inside_the_allowed_roots_are_checked_line_by_line(fl_home, tmp_path, monkeypatch) -> None:
    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setenv("ALLOWED_MODEL_ROOTS", str(data))
    zoo = fl_home / "zoo" / "arith-base"
    zoo.mkdir(parents=True)
    (zoo / "config.json").write_text("{}")
    settings = get_settings()
    good = data / "good.jsonl"
    good.write_text('{"prompt": "1+1=", "answer": 2, "split": "train"}\n')
    bad = data / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": 2}\nnot json\n')
    assert services.submit(settings, "fisher", {"model": "arith-base", "task": f"jsonl:{good}"})["status"] == "queued"
    with pytest.raises(SpecError, match=r"bad.jsonl:2: not valid JSON"):
        services.submit(settings, "fisher", {"model": "arith-base", "task": f"jsonl:{bad}"})
    with pytest.raises(SpecError, match="does not exist"):
        services.submit(settings, "fisher", {"model": "arith-base", "task": f"jsonl:{data / 'none.jsonl'}"})


def test_long_revisions_on_postgresql(fl_home, tmp_path, monkeypatch) -> None:
    """On PostgreSQL a diff of two models with a Fisher answered 500 (the joined revisions did
    not fit String(128)); now it is stored as a digest with its parts."""
    with pg_schema_url() as url:
        monkeypatch.setenv("DATABASE_URL", url)
        monkeypatch.setenv("FISHERLENS_QUEUE", "fisherlens")
        for name in ("arith-base", "arith-teacher"):
            z = fl_home / "zoo" / name
            z.mkdir(parents=True)
            (z / "config.json").write_text('{"model_type": "llama"}')
            (z / "model.safetensors").write_bytes(name.encode())
        settings = get_settings()
        fisher = services.submit(settings, "fisher", {"model": "arith-base"})
        _store_result(settings, fisher["id"], tensors={"fisher": {"w": torch.ones(3)}})
        trained = _trained(settings, tmp_path)
        job = services.submit(settings, "diff", {"base": "arith-base", "tuned": f"job:{trained['id']}",
                                                 "fisher": f"job:{fisher['id']}"})
        assert len(";".join(job["revisions"])) > 128 and len(job["model_revision"]) == 64
        opd = services.submit(settings, "train", {"model": "arith-base", "algo": "opd",
                                                  "teacher": "arith-teacher"})
        assert opd["status"] == "queued"


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
    from compute.runtime import celery_app

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
        "import sys, app.services, app.commands.jobs, compute.runtime.celery_app, storage.repo;"
        "print(sorted(m for m in ('torch', 'transformers', 'compute.worker') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_model_that_needs_remote_code_is_refused_at_submit_unless_the_operator_allows_it(
    settings, fl_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRUST_REMOTE_CODE (Settings.trust_remote_code): off, a model whose config.json names its
    own code (auto_map) is a 422-style field error at submit, nothing queued; on, it passes
    validation (and compute.lm.causal_lm.load_model passes trust_remote_code=True)."""
    folder = fl_home / "zoo" / "custom-code"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "custom", "num_hidden_layers": 2,
        "auto_map": {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}}))
    for spec in ({"model": "custom-code"}, {"model": "arith-base", "algo": "opd", "teacher": "custom-code"}):
        kind = "fisher" if "teacher" not in spec else "train"
        field = "teacher" if "teacher" in spec else "model"
        with pytest.raises(SpecError) as err:
            services.submit(settings, kind, spec)
        assert [e["field"] for e in err.value.errors] == [field]
        assert "needs its own code" in err.value.errors[0]["message"]
        assert "TRUST_REMOTE_CODE=1" in err.value.errors[0]["message"]
    assert _messages(settings) == []
    monkeypatch.setenv("TRUST_REMOTE_CODE", "1")
    allowed = get_settings()
    assert allowed.trust_remote_code
    spec, parts, refs = services.validate(allowed, "fisher", {"model": "custom-code"})
    assert refs["model"].form == "zoo" and parts == [f"model={refs['model'].sha256}"]
