"""The drill-down through the real app (FastAPI TestClient, SQLite, the folder artifact store):
results stored with their safetensors artifacts, opened by heatmap cell and by name, numbers
equal to the stored tensors read back whole; the cache file is written once and read after; bad
names and kinds are 404s that say what is missing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from compute.contract.jobresult import JobResult, LayerStat

NAMES = {"model.embed_tokens.weight": (300, 16), "model.layers.0.self_attn.q_proj.weight": (16, 16),
         "model.layers.0.self_attn.k_proj.weight": (8, 16), "model.layers.0.input_layernorm.weight": (16,),
         "model.layers.0.self_attn.q_norm.weight": (4,), "model.layers.1.mlp.up_proj.weight": (48, 16)}


def _tensors(seed: int, kind: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, shape in NAMES.items():
        x = torch.rand(shape, generator=g) ** 6
        out[n] = (x > 0.5) if kind == "mask" else x
    return out


def _store(settings, kind: str, tensors: dict[str, dict[str, torch.Tensor]], spec=None, refs=None) -> dict:
    from app import services
    from storage import repo
    from storage.artifacts import open_store

    rows = [LayerStat(n, "q" if "q_proj" in n else "other", None, {"numel": float(t.numel())})
            for n, t in next(iter(tensors.values())).items()]
    with services.sessions(settings)() as s:
        job = repo.create_job(session=s, kind=kind, spec=spec or {"model": "arith-base"}, spec_hash=f"{kind}{len(refs or {})}",
                              refs=refs)
        repo.claim_job(session=s, job_id=job.id, worker="t", stale_after_s=60)
        repo.save_result(session=s, job_id=job.id, result=JobResult(kind=kind, summary={}, layer_stats=rows,
                                                                     tensors=tensors), store=open_store(settings))
        repo.mark_succeeded(session=s, job_id=job.id)
        return {"id": job.id, "token": job.share_token}


@pytest.fixture
def app_and_jobs(tmp_path: Path):
    from app import services
    from app.web import create_app
    from compute.contract.settings import Settings
    from storage.models import ArtifactRow

    settings = Settings(fisherlens_home=tmp_path, database_url=None, redis_url=None)
    client = TestClient(create_app(settings), base_url="http://127.0.0.1")
    fisher = _store(settings, "fisher", {"fisher": _tensors(0, "fisher")})
    mask = _store(settings, "mask", {"mask": _tensors(0, "mask")})
    with services.sessions(settings)() as s:
        row = s.query(ArtifactRow).filter(ArtifactRow.job_id == fisher["id"]).one()
        fref = {"field": "fisher", "given": f"job:{fisher['id']}", "target": "fisher", "form": "artifact",
                "path": row.path, "sha256": row.sha256, "job_id": fisher["id"], "job_kind": "fisher"}
    delta = {n: (t - 0.5) * (torch.rand(t.shape) < 0.4) for n, t in _tensors(1, "fisher").items()}
    diff = _store(settings, "diff", {"delta": delta}, spec={"base": "a", "tuned": "b", "topk_percent": 10.0},
                  refs={"fisher": fref})
    return client, settings, {"fisher": fisher, "mask": mask, "diff": diff}, delta


def _artifact_file(settings, job_id: int, kind: str) -> Path:
    from storage.artifacts import open_store

    root = Path(open_store(settings).describe())
    return root / str(job_id) / f"{kind}.safetensors"


def test_cell_opens_its_tensors_with_the_stored_numbers(app_and_jobs):
    from safetensors.numpy import load_file

    client, settings, jobs, _ = app_and_jobs
    tok = jobs["fisher"]["token"]
    cell = client.get(f"/api/results/{tok}/tensors", params={"layer": "0", "module": "norm"}).json()
    assert [t["name"] for t in cell["tensors"]] == ["model.layers.0.input_layernorm.weight",
                                                    "model.layers.0.self_attn.q_norm.weight"]
    emb = client.get(f"/api/results/{tok}/tensors", params={"layer": "embeddings", "module": "embed"}).json()
    assert [t["name"] for t in emb["tensors"]] == ["model.embed_tokens.weight"]
    stored = load_file(str(_artifact_file(settings, jobs["fisher"]["id"], "fisher")))
    x = stored["model.embed_tokens.weight"].astype(np.float64)
    v = client.get(f"/api/results/{tok}/tensor", params={"name": "model.embed_tokens.weight"}).json()
    assert v["cached"] is False and v["shape"] == [300, 16] and v["pool"] == "max"
    assert v["sum"] == pytest.approx(x.sum(), rel=1e-9)
    top = np.unravel_index(np.argmax(x), x.shape)
    assert (v["top"][0]["row"], v["top"][0]["column"]) == (int(top[0]), int(top[1]))
    assert v["top"][0]["value"] == pytest.approx(float(x.max()))
    assert v["row_marginal"]["mean_sum"] == pytest.approx(x.sum(axis=1).tolist(), rel=1e-6)
    # the second open reads the cache file written by the first
    again = client.get(f"/api/results/{tok}/tensor", params={"name": "model.embed_tokens.weight"}).json()
    assert again["cached"] is True and again["sum"] == v["sum"]
    files = list((_artifact_file(settings, jobs["fisher"]["id"], "fisher").parent).glob("explore-tensor-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["name"] == "model.embed_tokens.weight"
    # the view: the figures of the tensor, drawn like every other figure
    html = client.get(f"/api/results/{tok}/tensor/view", params={"layer": "0", "module": "q"}).json()
    assert html["name"] == "model.layers.0.self_attn.q_proj.weight"
    assert "fl-tensor-fig-0" in html["html"] and "block max" in html["html"]


def test_mask_is_mean_pooled_and_heads_follow_the_config(app_and_jobs, monkeypatch):
    client, settings, jobs, _ = app_and_jobs
    v = client.get(f"/api/results/{jobs['mask']['token']}/tensor",
                   params={"name": "model.layers.0.self_attn.q_proj.weight"}).json()
    from safetensors.numpy import load_file

    m = load_file(str(_artifact_file(settings, jobs["mask"]["id"], "mask")))["model.layers.0.self_attn.q_proj.weight"]
    assert v["pool"] == "mean" and v["sum"] == int(m.sum())
    assert np.allclose(v["map"]["z"], m.astype(float))  # 16 x 16: one coordinate per block


def test_diff_overlay_uses_the_fisher_it_was_scored_against(app_and_jobs):
    client, settings, jobs, delta = app_and_jobs
    name = "model.layers.1.mlp.up_proj.weight"
    v = client.get(f"/api/results/{jobs['diff']['token']}/tensor", params={"name": name}).json()
    d = delta[name].abs().double().numpy()
    assert v["sum"] == pytest.approx(d.sum(), rel=1e-6) and v["value"] == "|delta|"
    o = v["overlay"]
    assert o["k_percent"] == 10.0 and o["sample"] == d.size
    from safetensors.numpy import load_file

    f = load_file(str(_artifact_file(settings, jobs["fisher"]["id"], "fisher")))[name].reshape(-1)
    lab = d.reshape(-1) > 0
    pos, neg = f[lab], f[~lab]
    auc = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (pos.size * neg.size)
    assert o["roc"]["changed"]["auc"] == pytest.approx(float(auc))
    html = client.get(f"/api/results/{jobs['diff']['token']}/tensor/view", params={"name": name}).json()["html"]
    assert "ROC of the Fisher" in html and "top-10% Fisher" in html


def test_bad_requests_name_what_is_missing(app_and_jobs):
    client, _, jobs, _ = app_and_jobs
    r = client.get(f"/api/results/{jobs['fisher']['token']}/tensor", params={"name": "nope.weight"})
    assert r.status_code == 404 and "name: this result has no tensor 'nope.weight'" in r.json()["detail"]
    r = client.get("/api/results/not-a-token/tensor", params={"name": "x"})
    assert r.status_code == 404 and "token" in r.json()["detail"]
    r = client.get(f"/api/results/{jobs['fisher']['token']}/tensor/view", params={"layer": "7", "module": "q"})
    assert r.status_code == 404 and "cell (7, q)" in r.json()["detail"]
    r = client.get(f"/api/results/{jobs['fisher']['token']}/tensor/view")
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "name"
