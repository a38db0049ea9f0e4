"""Scale-out with no shared disk: the web (this process) and two `fisherlens worker` processes,
each on its own FISHERLENS_HOME, sharing only PostgreSQL, Redis and an S3-compatible object store
(moto in server mode, started here: tests/s3.py).

    the research loop   fisher -> mask -> train -> diff -> fisher of the trained model, each step
                        by job:N, one worker keeping no cache at all (a 1-byte cap: everything
                        it reads is evicted after each job)
    sharded Fisher      one shard on each worker, combined from the store, equal to one process
    faults              the store stopped mid-upload (the job retries its upload; nothing is
                        published half-written, nothing is lost, nothing recomputed); a
                        corrupted object (refused by sha256 with a clear error)
"""

from __future__ import annotations

import hashlib
import io
import json
import secrets
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from app import services
from storage import repo
from storage.artifact_cache import ArtifactCache
from storage.artifacts import sha256_dir
from tests.s3 import BUCKET, MotoS3, moto_s3

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SMALL = {"max_new_tokens": 4}
TRAIN = {"steps": 2, "batch": 2, "group": 2, "eval_prompts": 4, "bound": False, **SMALL}


class Cluster:
    """The stack (Redis + PostgreSQL, the web's home) plus the object store and worker machines."""

    def __init__(self, stack, s3: MotoS3, prefix: str, zoo_home: Path, tmp_path: Path):
        self.stack, self.s3, self.prefix = stack, s3, prefix
        self.zoo_home, self.tmp = zoo_home, tmp_path
        self.homes: dict[str, Path] = {"web": stack.home}

    def machine(self, name: str, faults: tuple[str, ...] = (), **env: str):
        """A worker on its own home (the zoo is built there too: here, linked)."""
        home = self.tmp / name
        home.mkdir()
        (home / "zoo").symlink_to(self.zoo_home / "zoo", target_is_directory=True)
        self.homes[name] = home
        return self.stack.start_worker(f"{name}@scaleout", faults=faults,
                                       extra_env={"FISHERLENS_HOME": str(home), **env})

    @property
    def settings(self):
        return self.stack.settings

    def run(self, kind: str, spec: dict) -> dict:
        job = services.submit(self.settings, kind, spec, reuse=False)
        done = self.stack.wait_final(job["id"], timeout=400)
        assert done["status"] == "succeeded", f"{kind}: {done}\n{self.stack.logs()}"
        return done

    def keys(self, job_id: int) -> list[str]:
        return self.s3.keys(f"{self.prefix}/{job_id}/")

    def no_local_artifacts(self) -> None:
        """Nothing was written to any machine's artifact folder: the store is the only copy."""
        for name, home in self.homes.items():
            folder = home / "artifacts"
            files = [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []
            assert files == [], f"{name} wrote local artifacts: {files}"


@pytest.fixture
def cluster(redis_stack, zoo_home: Path, tmp_path: Path, monkeypatch) -> Iterator[Cluster]:
    prefix = f"scaleout-{secrets.token_hex(4)}"
    with moto_s3() as s3:
        env = {"ARTIFACT_URL": s3.url(prefix), **s3.env}
        redis_stack.env.update(env)  # every worker
        for k, v in env.items():  # and the web (this process)
            monkeypatch.setenv(k, v)
        yield Cluster(redis_stack, s3, prefix, zoo_home, tmp_path)


def test_research_loop_web_and_two_workers_share_no_disk(cluster: Cluster) -> None:
    cluster.machine("gpu-a")
    cluster.machine("gpu-b", ARTIFACT_CACHE_MAX_BYTES="1")  # keeps nothing between jobs
    settings = cluster.settings
    assert settings.db_url.startswith("postgresql") and settings.artifact_url

    fisher = cluster.run("fisher", {"model": "arith-base", "prompts": 4, "samples": 2, **SMALL})
    assert cluster.keys(fisher["id"]) == [f"{cluster.prefix}/{fisher['id']}/fisher.safetensors"]
    mask = cluster.run("mask", {"fisher": f"job:{fisher['id']}", "density": 0.05})
    train = cluster.run("train", {"model": "arith-base", "mask": f"job:{mask['id']}", **TRAIN})
    diff = cluster.run("diff", {"base": "arith-base", "tuned": f"job:{train['id']}",
                                "fisher": f"job:{fisher['id']}"})
    jobs = [fisher, mask, train, diff]
    with services.sessions(settings)() as s:
        ran_on = {j["id"]: repo.get_job(session=s, job_id=j["id"]).worker for j in jobs}
    assert set(ran_on.values()) <= {"gpu-a@scaleout", "gpu-b@scaleout"}

    # the web reads everything through its own cache, verified
    mask_t = load_file(str(services.artifact_path(settings, mask["share_token"], "mask")))
    trained = services.artifact_path(settings, train["share_token"], "model")
    assert trained is not None and trained.is_relative_to(settings.artifact_cache)
    model_keys = cluster.keys(train["id"])
    assert f"{cluster.prefix}/{train['id']}/model.dir.json" in model_keys
    manifest = json.loads(cluster.s3.client().get_object(
        Bucket=BUCKET, Key=f"{cluster.prefix}/{train['id']}/model.dir.json")["Body"].read())
    assert sorted(f["path"] for f in manifest["files"]) == sorted(
        p.relative_to(trained).as_posix() for p in trained.rglob("*") if p.is_file())
    base = load_file(str(settings.zoo_dir / "arith-base" / "model.safetensors"))
    tuned = load_file(str(trained / "model.safetensors"))
    moved = 0
    for name, m in mask_t.items():
        if name in tuned:
            changed = tuned[name] != base[name]
            assert not bool((changed & ~m).any()), f"{name} moved outside the mask"
            moved += int(changed.sum())
    assert moved > 0
    d_sum = services.result_by_token(settings, diff["share_token"])["summary"]
    assert d_sum["changed_fraction"] == pytest.approx(moved / d_sum["n_params"],
                                                      abs=0.5 / d_sum["n_params"])

    # downloads stream from the store; share pages render; their figures are objects too
    from fastapi.testclient import TestClient

    from app.web import create_app

    client = TestClient(create_app(settings), base_url="http://127.0.0.1")  # embedded Host allow-list
    r = client.get(f"/api/results/{fisher['share_token']}/artifacts/fisher")
    (art,) = [a for a in services.result_by_id(settings, fisher["id"])["artifacts"]
              if a["kind"] == "fisher"]
    assert r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == art["sha256"]
    r = client.get(f"/api/results/{train['share_token']}/artifacts/model")
    assert r.status_code == 200
    assert "config.json" in zipfile.ZipFile(io.BytesIO(r.content)).namelist()
    for j in jobs:
        page = client.get(f"/r/{j['share_token']}")
        assert page.status_code == 200 and f"#{j['id']}" in page.text
        assert f"{cluster.prefix}/{j['id']}/share-figures.json" in cluster.keys(j["id"])
    cluster.no_local_artifacts()
    # the worker with a 1-byte cap kept nothing once its jobs ended
    assert ArtifactCache(cluster.homes["gpu-b"] / "artifact-cache", 1).size() <= 1

    # the last step: the Fisher of the trained model, read from the store on any worker
    spec = {"model": f"job:{train['id']}", "prompts": 4, "samples": 2, **SMALL}
    job = services.submit(settings, "fisher", spec, reuse=False)
    done = cluster.stack.wait_final(job["id"], timeout=400)
    assert done["status"] == "succeeded", f"{done}\n{cluster.stack.logs()}"
    assert services.result_by_id(settings, job["id"])["summary"]["n_samples"] == 8


def test_sharded_fisher_one_shard_on_each_machine(cluster: Cluster) -> None:
    """gpu-a stops inside its shard until gpu-b has finished the other one: each machine ran
    one shard, the combine read both from the store, and the result is the one-process one."""
    import torch

    from compute.jobs.fisher_run import run
    from compute.jobs.registry import parse_spec

    cluster.machine("gpu-a", faults=("mid_job",))
    cluster.machine("gpu-b")
    spec = {"model": "arith-base", "task": "arithmetic", "prompts": 4, "samples": 2,
            "max_new_tokens": 6, "shards": 2}
    job = services.submit(cluster.settings, "fisher", spec, reuse=False)
    cluster.stack.wait_reached("mid_job")
    with services.sessions(cluster.settings)() as s:
        children = repo.shard_jobs(session=s, parent_id=job["id"])
    other = next(c.id for c in children if c.worker != "gpu-a@scaleout")
    cluster.stack.wait_final(other, timeout=400)
    cluster.stack.release("mid_job")
    done = cluster.stack.wait_final(job["id"], timeout=400)
    assert done["status"] == "succeeded", f"{done}\n{cluster.stack.logs()}"
    with services.sessions(cluster.settings)() as s:
        children = repo.shard_jobs(session=s, parent_id=job["id"])
        assert sorted(c.worker for c in children) == ["gpu-a@scaleout", "gpu-b@scaleout"]
    for c in children:
        assert cluster.keys(c.id) == [f"{cluster.prefix}/{c.id}/shard.pt"]
    one = run(parse_spec("fisher", spec))  # the whole job in this process
    res = services.result_by_id(cluster.settings, job["id"])
    (art,) = [a for a in res["artifacts"] if a["kind"] == "fisher"]
    from storage.artifacts import open_store

    stored = open_store(cluster.settings).load_tensors(art["path"], art["sha256"])
    assert stored.keys() == one.tensors["fisher"].keys()
    for k, t in one.tensors["fisher"].items():
        torch.testing.assert_close(stored[k], t, rtol=1e-5, atol=1e-12)
    cluster.no_local_artifacts()


def test_store_down_mid_upload_then_a_corrupted_object(cluster: Cluster) -> None:
    """The store stops after the first object of a trained model reached it: the job keeps its
    result and retries the upload (its message says so), nothing is recorded meanwhile; when
    the store is back the job succeeds on its first attempt, with exactly the manifest's objects.
    Then an object corrupted in the store is refused by sha256, at submit and at download."""
    cluster.machine("gpu-a", faults=("artifact_uploaded",))
    settings = cluster.settings
    train = services.submit(settings, "train", {"model": "arith-base", **TRAIN}, reuse=False)
    cluster.stack.wait_reached("artifact_uploaded", timeout=400)
    cluster.s3.stop()
    try:
        cluster.stack.release("artifact_uploaded")
        waiting = cluster.stack.wait_for(
            train["id"], lambda j: "artifact store unreachable" in (j["message"] or ""), 120,
            "reported the store down")
        assert waiting["status"] == "running"
        assert services.result_by_id(settings, train["id"])["artifacts"] == []  # nothing published
    finally:
        cluster.s3.start()
    done = cluster.stack.wait_final(train["id"], timeout=400)
    assert done["status"] == "succeeded", f"{done}\n{cluster.stack.logs()}"
    with services.sessions(settings)() as s:
        assert repo.get_job(session=s, job_id=train["id"]).attempts == 1  # not recomputed
    arts = services.result_by_id(settings, train["id"])["artifacts"]
    (art,) = [a for a in arts if a["kind"] == "model"]
    manifest = json.loads(cluster.s3.client().get_object(
        Bucket=BUCKET, Key=f"{cluster.prefix}/{train['id']}/model.dir.json")["Body"].read())
    assert cluster.keys(train["id"]) == sorted(
        [f"{cluster.prefix}/{train['id']}/model.dir.json"]
        + [f"{cluster.prefix}/{train['id']}/model/{f['path']}" for f in manifest["files"]]
        + [f"{cluster.prefix}/{a['path']}" for a in arts if a["kind"] != "model"])
    model = services.artifact_path(settings, train["share_token"], "model")  # the web: verified
    assert model is not None and sha256_dir(model)[0] == art["sha256"] == manifest["sha256"]

    fisher = cluster.run("fisher", {"model": "arith-base", "prompts": 4, "samples": 2, **SMALL})
    key = f"{cluster.prefix}/{fisher['id']}/fisher.safetensors"
    cluster.s3.client().put_object(Bucket=BUCKET, Key=key, Body=b"flipped bits")
    from compute.contract.specs import SpecError

    with pytest.raises(SpecError, match=rf"the fisher of job {fisher['id']} does not match its "
                                        r"recorded sha256 \(corrupt"):
        services.submit(settings, "mask", {"fisher": f"job:{fisher['id']}", "density": 0.05})
    from fastapi.testclient import TestClient

    from app.web import create_app

    r = TestClient(create_app(settings), base_url="http://127.0.0.1").get(f"/api/results/{fisher['share_token']}/artifacts/fisher")
    assert r.status_code == 409 and "sha256" in r.json()["detail"]
    cluster.no_local_artifacts()
