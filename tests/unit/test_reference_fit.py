"""Issue 27, item 4: a mask or Fisher used with a model must come from that model, checked at
submit for every reference pair (app.services.validation -> app.services.compat), against the
real zoo models: a file of arith-base given with arith-deep-base (more layers: another
architecture) and with arith-teacher (the same names and shapes, another model revision). Each is
refused before anything is queued, naming the field and both models; `allow_other_model` lets the
same-shapes case through, never the shape mismatch. SQLite and the filesystem queue (no worker)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from app import services
from compute.contract.modelref import folder_revision
from compute.contract.settings import get_settings
from compute.contract.specs import SpecError


@pytest.fixture
def settings(fl_home: Path, zoo_home: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FISHERLENS_QUEUE", "fisherlens")
    shutil.copytree(zoo_home / "zoo", fl_home / "zoo")
    return get_settings()


def _files(settings) -> dict[str, Path]:
    """A Fisher and a mask of arith-base (every parameter), recording the model they were made for
    as the engine writes it (compute.jobs.fisher_run.fisher_metadata; a mask keeps its Fisher's)."""
    zoo = Path(settings.zoo_dir)
    base = zoo / "arith-base"
    with safe_open(str(base / "model.safetensors"), framework="pt") as h:
        shapes = {n: tuple(h.get_slice(n).get_shape()) for n in h.keys()}  # noqa: SIM118
    info = {"model": "arith-base", "model_sha256": folder_revision(base), "split_half_jaccard": 0.5}
    fisher, mask = zoo / "base-fisher.safetensors", zoo / "base-mask.safetensors"
    save_file({n: torch.ones(s) for n, s in shapes.items()}, str(fisher),
              metadata={"estimator": "sequence", "fisherlens": json.dumps(info)})
    save_file({n: torch.ones(s, dtype=torch.bool) for n, s in shapes.items()}, str(mask),
              metadata={"format": "fisherlens-mask", "fisher_reliability": json.dumps(info)})
    return {"fisher": fisher, "mask": mask}


def _cases(files: dict[str, Path]) -> list[tuple[str, dict, str]]:
    """(kind, spec with {model} for the model under test, the field of the reference)."""
    f, m = str(files["fisher"]), str(files["mask"])
    small = {"steps": 1, "batch": 2, "group": 2}
    return [
        ("train", {"model": "{model}", "mask": m, **small}, "mask"),
        ("train", {"model": "{model}", "fisher": f, **small}, "fisher"),
        ("sweep", {"model": "{model}", "fisher": f, "lrs": [1e-3], "optimizers": ["sgd"], **small}, "fisher"),
        ("mask", {"model": "{model}", "fisher": f, "select": "fisher", "density": 0.05}, "fisher"),
        ("diff", {"base": "{model}", "tuned": "{model}", "fisher": f}, "fisher"),
    ]


def _spec(spec: dict, model: str) -> dict:
    return {k: (v.format(model=model) if isinstance(v, str) and "{model}" in v else v) for k, v in spec.items()}


def _refusal(settings, kind: str, spec: dict) -> list[dict]:
    with pytest.raises(SpecError) as err:
        services.submit(settings, kind, spec)
    return err.value.errors


def test_a_reference_of_another_architecture_is_refused_naming_the_field_and_both_models(settings) -> None:
    files = _files(settings)
    for kind, spec, field in _cases(files):
        # the shapes never fit a model: allow_other_model does not help (a diff's Fisher may cover
        # a subset of the checkpoints' tensors, so there it is the revision that refuses it)
        for allow in (False, True) if kind != "diff" else (False,):
            errors = _refusal(settings, kind, {**_spec(spec, "arith-deep-base"), "allow_other_model": allow})
            assert [e["field"] for e in errors] == [field], (kind, field, errors)
            msg = errors[0]["message"]
            assert "parameter 'model.layers." in msg or "shape" in msg or kind == "diff", (kind, field, msg)
            assert "'arith-base'" in msg and "'arith-deep-base'" in msg, (kind, field, msg)
    assert services.list_jobs(settings) == []  # nothing queued


def test_a_reference_of_another_model_with_the_same_shapes_is_refused_unless_allowed(settings) -> None:
    files = _files(settings)
    for kind, spec, field in _cases(files):
        errors = _refusal(settings, kind, _spec(spec, "arith-teacher"))
        assert [e["field"] for e in errors] == [field], (kind, field, errors)
        msg = errors[0]["message"]
        assert "made for model 'arith-base'" in msg and "'arith-teacher'" in msg, msg
        assert "allow_other_model" in msg, msg
    assert services.list_jobs(settings) == []
    # the same references with their own model are queued; with allow_other_model, the other one too
    for kind, spec, _field in _cases(files):
        assert services.submit(settings, kind, _spec(spec, "arith-base"))["status"] == "queued"
        job = services.submit(settings, kind, {**_spec(spec, "arith-teacher"), "allow_other_model": True})
        assert job["status"] == "queued"


def test_the_api_answers_422_naming_the_field_and_both_models(settings) -> None:
    from fastapi.testclient import TestClient

    from app.web import create_app

    files = _files(settings)
    client = TestClient(create_app(settings), base_url="http://127.0.0.1")
    r = client.post("/api/jobs", json={"kind": "train", "spec": {
        "model": "arith-teacher", "mask": str(files["mask"]), "steps": 1, "batch": 2, "group": 2}})
    assert r.status_code == 422, r.text
    body = json.dumps(r.json())
    assert "mask" in body and "arith-base" in body and "arith-teacher" in body


@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
def test_a_fisher_job_of_another_model_is_refused_by_job_reference(fl_home: Path, zoo_home: Path, db: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The same rule for `job:N` references (the artifact store and the job row: SQLite and
    PostgreSQL): a Fisher job of arith-base used with arith-teacher is refused, with arith-base
    queued."""
    import contextlib

    from compute.contract.jobresult import JobResult
    from storage import repo
    from storage.artifacts import open_store
    from tests.pg import pg_schema_url

    monkeypatch.setenv("FISHERLENS_QUEUE", "fisherlens")
    shutil.copytree(zoo_home / "zoo", fl_home / "zoo")
    ctx = pg_schema_url() if db == "postgresql" else contextlib.nullcontext(None)
    with ctx as url:
        if url:
            monkeypatch.setenv("DATABASE_URL", url)
        settings = get_settings()
        files = _files(settings)
        with safe_open(str(files["fisher"]), framework="pt") as h:
            tensors = {n: h.get_tensor(n) for n in h.keys()}  # noqa: SIM118
            meta = h.metadata()
        job = services.submit(settings, "fisher", {"model": "arith-base", "prompts": 4})
        with services.sessions(settings)() as s:
            repo.save_result(session=s, job_id=job["id"], store=open_store(settings),
                             result=JobResult(kind="fisher", summary={}, tensors={"fisher": tensors},
                                              metadata={"fisher": meta}))
            repo.mark_succeeded(session=s, job_id=job["id"])
        spec = {"fisher": f"job:{job['id']}", "steps": 1, "batch": 2, "group": 2}
        errors = _refusal(settings, "train", {"model": "arith-teacher", **spec})
        assert [e["field"] for e in errors] == ["fisher"]
        assert "made for model 'arith-base'" in errors[0]["message"] and "'arith-teacher'" in errors[0]["message"]
        assert services.submit(settings, "train", {"model": "arith-base", **spec})["status"] == "queued"
