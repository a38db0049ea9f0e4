"""The `series` job kind end to end on a real TRL run folder (GRPOTrainer, save_steps=1, 3 steps
on arith-base): `fisherlens series` writes DIR/series.json; `POST /api/jobs {"kind": "series"}`
validates (allowed roots, checkpoints that fit the base), the job runs in process as a worker runs
it, and its share page renders the figures and names the run folder and the Fisher file by label
('grpo (local folder)'), never by server path; a folder outside the roots or without checkpoints is
refused at submit with the field named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def trl_run(zoo_home: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(allowed root, run folder inside it, a Fisher file for arith-base)."""
    from tests.trl_runs import grpo_run_folder

    root = tmp_path_factory.mktemp("runs")
    run = grpo_run_folder(zoo_home / "zoo" / "arith-base", root / "grpo", steps=3)
    base = load_file(str(zoo_home / "zoo" / "arith-base" / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    fisher = root / "fisher.safetensors"
    save_file({n: torch.rand(t.shape, generator=g) for n, t in base.items()}, str(fisher))
    return root, run, fisher


@pytest.mark.slow
def test_cli_writes_series_json(trl_run, zoo_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from app.cli import main

    root, run, fisher = trl_run
    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["series", "arith-base", str(run), "--fisher", str(fisher), "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "series.json").read_text())
    assert data["steps"] == [1, 2, 3] and [p["step"] for p in data["points"]] == [1, 2, 3]
    p3 = data["points"][2]["vs_prev"]
    assert set(p3) == {"global", "layer", "module", "layer_module"}
    assert {"support_bytes", "captured_sq_share", "auc", "sparse_bytes"} <= set(p3["global"]["all"])
    result = json.loads((out / "result.json").read_text())
    assert result["kind"] == "series" and result["summary"]["steps"] == [1, 2, 3]
    assert (out / "result.html").is_file()
    assert "Unchanged" in res.output or "final_update_sparsity" in res.output


@pytest.mark.slow
def test_api_worker_and_share_page(trl_run, zoo_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi.testclient import TestClient

    from app.web import create_app
    from compute.contract.settings import Settings
    from compute.worker.execute import execute_job

    root, run, fisher = trl_run
    monkeypatch.setenv("FISHERLENS_HOME", str(zoo_home))
    monkeypatch.setenv("ALLOWED_MODEL_ROOTS", str(root))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    settings = Settings()
    client = TestClient(create_app(settings), follow_redirects=False,
                        base_url="http://127.0.0.1")  # embedded mode: a loopback Host
    # refused at submit, naming the field
    for run_dir, words in ((str(zoo_home), "outside the allowed model roots"),
                           (str(root), "holds no checkpoint-<step> folder")):
        r = client.post("/api/jobs", json={"kind": "series", "spec": {"base": "arith-base", "run_dir": run_dir}})
        assert r.status_code == 422, r.text
        assert any(e["field"] == "run_dir" and words in e["message"] for e in r.json()["detail"]), r.text
    r = client.post("/api/jobs", json={"kind": "series", "spec": {
        "base": "arith-base", "run_dir": str(run), "fisher": str(fisher)}})
    assert r.status_code == 201, r.text
    job = r.json()
    assert execute_job(settings, job["id"]) == "succeeded", client.get(f"/api/jobs/{job['id']}").json()
    got = client.get(f"/api/jobs/{job['id']}").json()
    assert got["status"] == "succeeded"
    result = client.get(f"/api/results/{job['share_token']}").json()
    assert result["summary"]["steps"] == [1, 2, 3]
    assert any(a["kind"] == "series" for a in result["artifacts"])
    names = {s["name"] for s in result["series"]}
    assert {"vs_prev/update_sparsity", "sync/sparse_bytes", "sync/support_bytes", "fisher/auc_vs_prev"} <= names
    page = client.get(f"/r/{job['share_token']}")
    assert page.status_code == 200
    for title in ("Update sparsity over steps", "Sparse sync per step", "Run folder series"):
        assert title in page.text, title
    # a public link names the run folder and the Fisher file by label, never by server path: on
    # the page (meta line, settings), in the result JSON (spec and summary) and in the explorer's
    # result tab; the owner's job API keeps the spec as submitted
    for text in (page.text, client.get(f"/api/results/{job['share_token']}").text):
        assert str(root) not in text and str(root.resolve()) not in text
    assert "run_dir <b>grpo (local folder)</b>" in page.text
    assert "fisher.safetensors (local file)" in page.text
    assert (result["summary"]["run_dir"], result["summary"]["fisher"]) == (
        "grpo (local folder)", "fisher.safetensors (local file)")
    assert result["job"]["spec"]["run_dir"] == "grpo (local folder)"
    from app.ui.result import job_by_token, stored_payload, view_html

    meta = job_by_token(settings, job["share_token"])
    assert meta is not None
    tab = view_html(stored_payload(settings, meta), meta)
    assert str(root) not in tab and "grpo (local folder)" in tab
    assert got["spec"]["run_dir"] == str(run) and got["spec"]["fisher"] == str(fisher)
