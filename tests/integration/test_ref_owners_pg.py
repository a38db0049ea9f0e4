"""Another user's artifact is unusable in every form, on PostgreSQL, through the real app
(FastAPI TestClient, AUTH_REQUIRED, the filesystem queue; no worker: nothing computes).

alice owns a succeeded fisher job F, mask job M and train job T (its trained model folder and
mask). For every reference field (model, teacher, base, tuned, fisher, mask) bob is refused in
every form that names alice's artifact: `job:N`, the file path `<artifact root>/N/<file>` and the
folder `<artifact root>/N`; the `job:N` answer is word for word the answer for a job that does not
exist, the path answers say "write job:N", and nothing is queued. alice and an admin may use
`job:N`; a share link lets bob read alice's result but not reuse it; /api/estimate answers bob the
same for alice's job as for a missing one (app.services.refs is the one resolver)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save_file

from compute.contract.settings import Settings
from tests.pg import pg_schema_url

pytestmark = pytest.mark.postgres

MISSING = 999_999


def _model_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 2,
        "hidden_size": 4, "vocab_size": 3}))
    save_file({"w": torch.zeros(4, 3)}, str(path / "model.safetensors"))
    return path


class Stack:
    def __init__(self, home: Path, db_url: str, models: Path):
        self.settings = Settings(
            fisherlens_home=home, database_url=db_url, redis_url=None,
            allowed_model_roots=str(models), public_url="http://testserver",
            auth_required=True, max_active_jobs=100, max_job_cost=None,
        )
        from app import services
        from app.web import create_app
        from storage import users

        self.app = create_app(self.settings)
        self.tokens: dict[str, str] = {}
        self.ids: dict[str, int] = {}
        with services.sessions(self.settings)() as s:
            for name, admin in (("alice", False), ("bob", False), ("root", True)):
                u = users.create_user(session=s, name=name, password=f"pw-{name}-123", is_admin=admin)
                self.tokens[name], _ = users.issue_token(session=s, user=u)
                self.ids[name] = u.id

    def client(self, name: str) -> TestClient:
        c = TestClient(self.app, follow_redirects=False)
        c.headers["Authorization"] = f"Bearer {self.tokens[name]}"
        return c

    def succeeded(self, owner: str, kind: str, tensors: dict[str, Any], files: dict[str, str],
                  tmp: Path) -> dict[str, Any]:
        """A succeeded job of `owner` with these artifacts (what a worker leaves)."""
        from app import services
        from compute.contract.jobresult import JobResult
        from storage import repo
        from storage.artifacts import open_store

        with services.sessions(self.settings)() as s:
            job = repo.create_job(session=s, kind=kind, spec={"model": "arith-base"},
                                  spec_hash=f"{kind}-{tmp.name}", owner_id=self.ids[owner], refs={})
            repo.mark_running(session=s, job_id=job.id, worker="test")
            repo.save_result(session=s, job_id=job.id, store=open_store(self.settings),
                             result=JobResult(kind=kind, summary={}, tensors=tensors, files=files))
            repo.mark_succeeded(session=s, job_id=job.id)
            return repo.job_dict(repo.get_job(session=s, job_id=job.id))

    def rows(self) -> int:
        from app import services
        from storage.models import Job

        with services.sessions(self.settings)() as s:
            return int(s.query(Job).count())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("owners_home")
    _model_folder(home / "zoo" / "arith-base")
    models = tmp_path_factory.mktemp("owners_models")
    with pg_schema_url("fl_owners") as url:
        yield Stack(home, url, models)


@pytest.fixture(scope="module")
def alice_jobs(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("owners_out")
    w = torch.rand(4, 3)
    fisher = stack.succeeded("alice", "fisher", {"fisher": {"w": w}}, {}, tmp / "f")
    mask = stack.succeeded("alice", "mask", {"mask": {"w": w > 0.5}}, {}, tmp / "m")
    trained = _model_folder(tmp / "trained")
    train = stack.succeeded("alice", "train", {"mask": {"w": w > 0.5}}, {"model": str(trained)}, tmp / "t")
    return {"fisher": fisher, "mask": mask, "train": train}


# field -> (job kind, spec with X for the reference, the job whose artifact it names, its file)
FIELDS = {
    "model": ("fisher", {"model": "X", "prompts": 2, "samples": 1}, "train", "model/model.safetensors"),
    "teacher": ("train", {"model": "arith-base", "algo": "opd", "teacher": "X", "steps": 1}, "train",
                "model/config.json"),
    "base": ("diff", {"base": "X", "tuned": "arith-base"}, "train", "model"),
    "tuned": ("diff", {"base": "arith-base", "tuned": "X"}, "train", "model"),
    "fisher": ("mask", {"fisher": "X", "density": 0.1}, "fisher", "fisher.safetensors"),
    "mask": ("train", {"model": "arith-base", "mask": "X", "steps": 1}, "mask", "mask.safetensors"),
}


def _body(field: str, ref: str) -> dict[str, Any]:
    kind, spec, _, _ = FIELDS[field]
    return {"kind": kind, "spec": {k: (ref if v == "X" else v) for k, v in spec.items()}}


def _only_error(r: Any, field: str) -> str:
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert [e["field"] for e in detail] == [field], detail
    return str(detail[0]["message"])


@pytest.mark.parametrize("field", list(FIELDS))
def test_another_users_artifact_is_refused_in_every_form(stack, alice_jobs, field) -> None:
    _, _, source, file = FIELDS[field]
    n = alice_jobs[source]["id"]
    root = stack.settings.artifacts_dir
    bob = stack.client("bob")
    before = stack.rows()

    as_job = _only_error(bob.post("/api/jobs", json=_body(field, f"job:{n}")), field)
    missing = _only_error(bob.post("/api/jobs", json=_body(field, f"job:{MISSING}")), field)
    assert as_job == missing.replace(str(MISSING), str(n))  # no hint that job n exists
    assert "does not exist" in as_job
    for path in (root / str(n) / file, root / str(n)):  # the file, and the job's folder
        msg = _only_error(bob.post("/api/jobs", json=_body(field, str(path))), field)
        assert f"write job:{n}" in msg and str(root) not in msg.replace(str(path), "")
    assert stack.rows() == before  # nothing created, nothing queued

    # the share link opens the result for bob, and still grants no reuse
    token = alice_jobs[source]["share_token"]
    assert bob.get(f"/api/results/{token}").status_code == 200
    assert _only_error(bob.post("/api/jobs", json=_body(field, f"job:{n}")), field) == as_job

    # the owner and an admin may use it by job reference (never by path)
    for who in ("alice", "root"):
        r = stack.client(who).post("/api/jobs", json=_body(field, f"job:{n}"))
        assert r.status_code == 201, (who, r.text)
    msg = _only_error(stack.client("alice").post("/api/jobs", json=_body(field, str(root / str(n)))), field)
    assert f"write job:{n}" in msg


def test_estimate_does_not_reveal_another_users_job(stack, alice_jobs) -> None:
    t = alice_jobs["train"]["id"]

    def estimate(who: str, ref: str) -> dict[str, Any]:
        r = stack.client(who).post("/api/estimate", json={"kind": "fisher", "spec": {"model": ref}})
        assert r.status_code == 200, r.text
        return dict(r.json())

    theirs, missing = estimate("bob", f"job:{t}"), estimate("bob", f"job:{MISSING}")
    assert theirs == missing and theirs["params"] is None and theirs["unknown_models"] == ["model"]
    mine = estimate("alice", f"job:{t}")
    assert mine["params"] == 12  # the trained folder's safetensors header: one 4 x 3 tensor
