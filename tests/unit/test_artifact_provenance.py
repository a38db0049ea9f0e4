"""The files a server job stores, downloaded through its share link, name the job's references by
label and sha256, never by server path (compute.contract.provenance): a Fisher's safetensors
metadata names its model, a mask's names the Fisher it was built on, a trained model's
metrics.json names its model and mask.

Real jobs: submitted through the API (references resolved and hashed at submit), run in process
as the worker runs them (compute.worker.execute.execute_job, refs re-verified), downloaded from
/api/results/<token>/artifacts/<kind>; the inputs are a zoo model copied into an allowed root and
the downloaded Fisher and mask placed next to it, each given by absolute path.
"""

from __future__ import annotations

import io
import json
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest


def _header(data: bytes) -> dict[str, Any]:
    """The JSON header of a safetensors file (its metadata under "__metadata__")."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n])


@pytest.fixture
def server(zoo_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from fastapi.testclient import TestClient

    from app.web import create_app
    from compute.contract.settings import Settings

    home = tmp_path / "home"
    home.mkdir()
    (home / "zoo").symlink_to(zoo_home / "zoo")
    root = tmp_path / "srv-secret" / "models"
    root.mkdir(parents=True)
    for k, v in {"FISHERLENS_HOME": str(home), "ALLOWED_MODEL_ROOTS": str(root),
                 "FISHERLENS_DEVICE": "cpu"}.items():
        monkeypatch.setenv(k, v)
    for k in ("DATABASE_URL", "REDIS_URL", "AUTH_REQUIRED"):
        monkeypatch.delenv(k, raising=False)
    settings = Settings()
    client = TestClient(create_app(settings), follow_redirects=False,
                        base_url="http://127.0.0.1")  # embedded mode: a loopback Host
    return settings, client, root


def _run(settings: Any, client: Any, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    from compute.worker.execute import execute_job

    r = client.post("/api/jobs", json={"kind": kind, "spec": spec})
    assert r.status_code == 201, r.text
    job = r.json()
    assert execute_job(settings, job["id"]) == "succeeded", client.get(f"/api/jobs/{job['id']}").json()
    return job


def _download(client: Any, job: dict[str, Any], kind: str) -> bytes:
    r = client.get(f"/api/results/{job['share_token']}/artifacts/{kind}")
    assert r.status_code == 200, r.text
    return r.content


@pytest.mark.slow
def test_downloaded_artifacts_name_inputs_by_label_and_sha256(server, zoo_home: Path) -> None:
    from compute.contract.modelref import file_sha256, folder_revision
    from compute.contract.results import reliability_level
    from compute.jobs.artifact_files import fisher_provenance

    settings, client, root = server
    secret = str(root.parent)  # every input lives under .../srv-secret/
    model = root / "my-model"
    shutil.copytree(zoo_home / "zoo" / "arith-base", model)
    model_sha = folder_revision(model)

    # a Fisher of a model given by path: the file names the model by label and revision
    fjob = _run(settings, client, "fisher", {
        "model": str(model), "prompts": 4, "samples": 2, "max_new_tokens": 4, "exact_output": False,
        "device": "cpu"})
    data = _download(client, fjob, "fisher")
    header = _header(data)
    assert secret not in json.dumps(header) and "srv-secret" not in json.dumps(header)
    info = json.loads(header["__metadata__"]["fisherlens"])
    assert info["model"] == "my-model (local folder)" and info["model_sha256"] == model_sha
    assert info["reliability"] == reliability_level(info["split_half_jaccard"])

    # a mask built from that Fisher given by path: its copy of the Fisher's verdict names the
    # Fisher by label and the sha256 of the file it read, and the Fisher's model by label
    fdir = root / "fishers"
    fdir.mkdir()
    ffile = fdir / "fisher.safetensors"
    ffile.write_bytes(data)
    mjob = _run(settings, client, "mask", {"fisher": str(ffile), "model": str(model), "select": "fisher",
                                           "density": 0.1})
    mdata = _download(client, mjob, "mask")
    mheader = _header(mdata)
    assert secret not in json.dumps(mheader)
    rel = json.loads(mheader["__metadata__"]["fisher_reliability"])
    assert rel["source"] == "fisher.safetensors (local file)"
    assert rel["source_sha256"] == file_sha256(ffile)
    assert rel["model"] == "my-model (local folder)" and rel["model_sha256"] == model_sha
    assert rel["split_half_jaccard"] == info["split_half_jaccard"]
    mfile = fdir / "mask.safetensors"
    mfile.write_bytes(mdata)
    # what reads it back does not need a path: the verdict travels by label
    back = fisher_provenance(str(mfile), "mask")
    assert back["source"] == "fisher.safetensors (local file)" and back["reliability"] == info["reliability"]

    # a train job on the model and the mask, both by path: the model folder (a zip download)
    # holds no path; metrics.json names both by label and sha256
    tjob = _run(settings, client, "train", {
        "model": str(model), "mask": str(mfile), "algo": "sft", "steps": 1, "batch": 2,
        "max_new_tokens": 4, "eval_prompts": 4, "device": "cpu"})
    zdata = _download(client, tjob, "model")
    with zipfile.ZipFile(io.BytesIO(zdata)) as z:
        for name in z.namelist():
            body = z.read(name)
            head = json.dumps(_header(body)) if name.endswith(".safetensors") else body.decode("utf-8", "replace")
            assert secret not in head and "srv-secret" not in head, name
        metrics = json.loads(z.read("metrics.json"))
    assert metrics["spec"]["model"] == "my-model (local folder)"
    assert metrics["spec"]["mask"] == "mask.safetensors (local file)"
    assert metrics["references"]["model"] == {"label": "my-model (local folder)", "sha256": model_sha}
    assert metrics["references"]["mask"] == {"label": "mask.safetensors (local file)",
                                             "sha256": file_sha256(mfile)}
    assert metrics["fisher_reliability"]["source"].startswith("the Fisher of mask mask.safetensors (local file)")

    # the owner's job API keeps the spec as submitted
    assert client.get(f"/api/jobs/{tjob['id']}").json()["spec"]["model"] == str(model)


def test_paths_in_older_files_are_read_back_as_labels(tmp_path: Path) -> None:
    """A Fisher or mask written before files were labelled (a path in "model" / "source"): what
    reads it (fisher_provenance, for masks, trains, diffs, series) shows the label."""
    import torch
    from safetensors.torch import save_file

    from compute.contract.modelref import name_ref
    from compute.jobs.artifact_files import fisher_provenance

    old = {"estimator": "sequence", "model": "/srv/models/llama-7b", "split_half_jaccard": 0.8,
           "reliability": "good"}
    f = tmp_path / "fisher.safetensors"
    save_file({"w": torch.ones(3)}, str(f), metadata={"fisherlens": json.dumps(old)})
    ref = name_ref("fisher", str(f), "fisher")
    rel = fisher_provenance(ref)
    assert rel["model"] == "llama-7b (local folder)" and rel["source"] == "fisher.safetensors (local file)"
    m = tmp_path / "mask.safetensors"
    save_file({"w": torch.ones(3, dtype=torch.bool)}, str(m),
              metadata={"fisher_reliability": json.dumps({**old, "source": "/srv/f/fisher.safetensors"})})
    rel = fisher_provenance(str(m), "mask")
    assert rel["source"] == "fisher.safetensors (local file)" and rel["model"] == "llama-7b (local folder)"
    assert rel["split_half_jaccard"] == 0.8
