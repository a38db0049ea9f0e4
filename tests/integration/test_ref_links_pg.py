"""Links inside folders never reach another user's artifacts (issue 28, item 1), on PostgreSQL,
through the real app (FastAPI TestClient, AUTH_REQUIRED).

alice owns a succeeded train job T (a trained model folder), fisher job F and mask job M in the
artifact store. bob builds folders inside the allowed model roots that are his own except for
what a job reads from alice: a weight file linked into T's folder (a symlink, or a hard link), a
config linked into it, the whole folder or a checkpoint folder linked to it, a weight index whose
shard name climbs out of the folder, a Fisher / mask file linked into F / M inside a folder he
names. For every reference field (model of fisher / tokens / train / mask, teacher, base, tuned,
run_dir, fisher, mask) each is refused with 422 naming that field and saying "write job:N", and
nothing is queued; a link to a file outside the roots is refused too; bob's own copies (with a
link to his own file inside the roots) are accepted, so the check refuses what it must and no
more. The worker side (a link swapped after submit) is test_link_swapped_after_submit_*, with a
separate `fisherlens worker` process on PostgreSQL + Redis."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.integration.test_ref_owners_pg import Stack, _model_folder
from tests.pg import pg_schema_url

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("links_home")
    _model_folder(home / "zoo" / "arith-base")
    models = tmp_path_factory.mktemp("links_models")
    with pg_schema_url("fl_links") as url:
        yield Stack(home, url, models)


@pytest.fixture(scope="module")
def alice(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    tmp = tmp_path_factory.mktemp("links_out")
    w = torch.rand(4, 3)
    trained = _model_folder(tmp / "trained")
    save_file({"w": torch.rand(4, 3)}, str(trained / "model.safetensors"))  # alice's weights
    out = {
        "train": stack.succeeded("alice", "train", {}, {"model": str(trained)}, tmp / "t")["id"],
        "fisher": stack.succeeded("alice", "fisher", {"fisher": {"w": w}}, {}, tmp / "f")["id"],
        "mask": stack.succeeded("alice", "mask", {"mask": {"w": w > 0.5}}, {}, tmp / "m")["id"],
    }
    return out


# field -> (job kind, spec with X for the reference); bob's own Fisher file fills the others
MODEL_FIELDS = {
    "model/fisher": ("fisher", {"model": "X", "prompts": 2, "samples": 1}),
    "model/tokens": ("tokens", {"model": "X", "context": "1+1="}),
    "model/train": ("train", {"model": "X", "steps": 1}),
    "model/mask": ("mask", {"model": "X", "fisher": "OWN_FISHER", "density": 0.1}),
    "teacher/train": ("train", {"model": "arith-base", "algo": "opd", "teacher": "X", "steps": 1}),
    "base/diff": ("diff", {"base": "X", "tuned": "arith-base"}),
    "tuned/diff": ("diff", {"base": "arith-base", "tuned": "X"}),
}
FILE_FIELDS = {
    "fisher/mask": ("mask", {"fisher": "X", "density": 0.1}, "fisher"),
    "mask/train": ("train", {"model": "arith-base", "mask": "X", "steps": 1}, "mask"),
}
RUN_DIR = ("series", {"base": "arith-base", "run_dir": "X"})


def _body(kind: str, spec: dict[str, Any], ref: str, own_fisher: Path) -> dict[str, Any]:
    fill = {"X": ref, "OWN_FISHER": str(own_fisher)}
    return {"kind": kind, "spec": {k: fill.get(v, v) if isinstance(v, str) else v for k, v in spec.items()}}


def _refused(stack: Stack, body: dict[str, Any], field: str) -> str:
    before = stack.rows()
    r = stack.client("bob").post("/api/jobs", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert [e["field"] for e in detail] == [field], detail
    assert stack.rows() == before  # nothing created, nothing queued
    msg = str(detail[0]["message"])
    assert str(stack.settings.artifacts_dir) not in msg  # never where a link points
    return msg


def _models(stack: Stack) -> Path:
    return Path(stack.settings.allowed_model_roots)


def _own_fisher(stack: Stack) -> Path:
    path = _models(stack) / "bob-own-fisher.safetensors"
    if not path.exists():
        save_file({"w": torch.rand(4, 3)}, str(path))
    return path


def _own_model(folder: Path) -> Path:
    """bob's own model folder (config, weights, a tokenizer file), nothing linked."""
    _model_folder(folder)
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


def _hard_link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError as exc:  # another device: no hard link can be made there, nothing to refuse
        pytest.skip(f"cannot hard-link into the artifact store here ({exc.strerror})")


def _model_attacks(stack: Stack, n: int, tag: str) -> dict[str, Path]:
    """attack name -> the folder bob names, each reading alice's trained model of job n."""
    theirs = stack.settings.artifacts_dir / str(n) / "model"
    base = _models(stack) / f"bob-{tag}"
    out: dict[str, Path] = {}

    f = out["linked weights"] = _own_model(base / "linked-weights")
    (f / "model.safetensors").unlink()
    (f / "model.safetensors").symlink_to(theirs / "model.safetensors")

    f = out["linked config"] = _own_model(base / "linked-config")
    (f / "config.json").unlink()
    (f / "config.json").symlink_to(theirs / "config.json")

    f = out["linked folder"] = base / "linked-folder"
    f.symlink_to(theirs, target_is_directory=True)

    f = out["hard link"] = _own_model(base / "hard-link")
    (f / "model.safetensors").unlink()
    _hard_link(theirs / "model.safetensors", f / "model.safetensors")

    f = out["index escape"] = _own_model(base / "index-escape")
    (f / "model.safetensors").unlink()
    rel = os.path.relpath(theirs / "model.safetensors", f)
    (f / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": rel}}))
    return out


@pytest.mark.parametrize("case", list(MODEL_FIELDS))
def test_model_fields_refuse_links_into_another_users_model(stack, alice, case) -> None:
    field = case.split("/")[0]
    kind, spec = MODEL_FIELDS[case]
    n = alice["train"]
    for attack, folder in _model_attacks(stack, n, case.replace("/", "-")).items():
        msg = _refused(stack, _body(kind, spec, str(folder), _own_fisher(stack)), field)
        if attack == "index escape":
            assert "weight index names the shard" in msg, msg
        else:
            assert f"write job:{n}" in msg, (attack, msg)

    # a link to a file outside the roots (bob's own file, elsewhere on the server)
    outside = stack.settings.home / "outside" / case.replace("/", "-")
    _own_model(outside)
    f = _own_model(_models(stack) / f"bob-{case.replace('/', '-')}" / "outside-link")
    (f / "model.safetensors").unlink()
    (f / "model.safetensors").symlink_to(outside / "model.safetensors")
    msg = _refused(stack, _body(kind, spec, str(f), _own_fisher(stack)), field)
    assert "links outside the allowed model roots" in msg and str(outside) not in msg

    # bob's own folder, with a link to his own file inside the roots, is accepted
    mine = _own_model(_models(stack) / f"bob-{case.replace('/', '-')}" / "own")
    spare = _models(stack) / f"bob-{case.replace('/', '-')}" / "spare.safetensors"
    shutil.move(mine / "model.safetensors", spare)
    (mine / "model.safetensors").symlink_to(spare)
    r = stack.client("bob").post("/api/jobs", json=_body(kind, spec, str(mine), _own_fisher(stack)))
    assert r.status_code == 201, r.text
    from app import services
    from storage import repo

    with services.sessions(stack.settings)() as s:  # the manifest the worker re-verifies
        stored = repo.get_job(session=s, job_id=r.json()["id"]).refs[field]
    assert set(stored["files"]) == {"config.json", "model.safetensors", "tokenizer_config.json"}
    assert stored["files"]["model.safetensors"] == hashlib.sha256(spare.read_bytes()).hexdigest()


@pytest.mark.parametrize("case", list(FILE_FIELDS))
def test_file_fields_refuse_links_into_another_users_artifact(stack, alice, case) -> None:
    field = case.split("/")[0]
    kind, spec, source = FILE_FIELDS[case]
    n = alice[source]
    theirs = stack.settings.artifacts_dir / str(n) / f"{source}.safetensors"
    base = _models(stack) / f"bob-{case.replace('/', '-')}"
    base.mkdir()

    inside = base / "folder-with-link"  # a folder named, the file inside it linked
    inside.mkdir()
    (inside / f"{source}.safetensors").symlink_to(theirs)
    linked_folder = base / "linked-folder"
    linked_folder.symlink_to(theirs.parent, target_is_directory=True)
    linked_file = base / "linked.safetensors"
    linked_file.symlink_to(theirs)
    hard = base / "hard.safetensors"
    _hard_link(theirs, hard)
    hard_inside = base / "folder-with-hard-link"
    hard_inside.mkdir()
    _hard_link(theirs, hard_inside / f"{source}.safetensors")
    for path in (inside, linked_folder, linked_file, hard, hard_inside):
        msg = _refused(stack, _body(kind, spec, str(path), _own_fisher(stack)), field)
        assert f"write job:{n}" in msg, (path.name, msg)

    mine = base / "own"  # bob's own file, in a folder: accepted
    mine.mkdir()
    save_file({"w": torch.rand(4, 3)} if source == "fisher" else {"w": torch.rand(4, 3) > 0.5},
              str(mine / f"{source}.safetensors"))
    r = stack.client("bob").post("/api/jobs", json=_body(kind, spec, str(mine), _own_fisher(stack)))
    assert r.status_code == 201, r.text


def _run_folder(folder: Path) -> Path:
    _own_model(folder / "checkpoint-1")
    return folder


def test_run_dir_refuses_linked_checkpoints_and_files(stack, alice) -> None:
    n = alice["train"]
    theirs = stack.settings.artifacts_dir / str(n) / "model"
    base = _models(stack) / "bob-run"
    kind, spec = RUN_DIR

    linked_ckpt = _run_folder(base / "linked-checkpoint")  # checkpoint-2 is alice's model
    (linked_ckpt / "checkpoint-2").symlink_to(theirs, target_is_directory=True)
    linked_file = _run_folder(base / "linked-file")
    (linked_file / "checkpoint-1" / "model.safetensors").unlink()
    (linked_file / "checkpoint-1" / "model.safetensors").symlink_to(theirs / "model.safetensors")
    hard = _run_folder(base / "hard-link")
    (hard / "checkpoint-1" / "model.safetensors").unlink()
    _hard_link(theirs / "model.safetensors", hard / "checkpoint-1" / "model.safetensors")
    linked_run = base / "linked-run"
    linked_run.symlink_to(theirs.parent, target_is_directory=True)
    for path in (linked_ckpt, linked_file, hard):
        msg = _refused(stack, _body(kind, spec, str(path), _own_fisher(stack)), "run_dir")
        assert f"write job:{n}" in msg, (path.name, msg)
    msg = _refused(stack, _body(kind, spec, str(linked_run), _own_fisher(stack)), "run_dir")
    assert f"write job:{n}" in msg

    mine = _run_folder(base / "own")
    r = stack.client("bob").post("/api/jobs", json=_body(kind, spec, str(mine), _own_fisher(stack)))
    assert r.status_code == 201, r.text


def test_estimate_and_registration_use_the_same_check(stack, alice) -> None:
    """/api/estimate reads headers of what a spec names: a linked weight file gives no size."""
    folder = _model_attacks(stack, alice["train"], "estimate")["linked weights"]
    r = stack.client("bob").post("/api/estimate", json={"kind": "fisher", "spec": {"model": str(folder)}})
    assert r.status_code == 200, r.text
    assert r.json()["params"] is None and r.json()["unknown_models"] == ["model"]


def test_gradio_run_tokens_refuses_a_linked_weight_file(stack, alice) -> None:
    """The web UI's token explorer (app.ui.tokens.run_tokens, the Gradio endpoint) as bob."""
    from app import services
    from app.auth.principal import acting_as, principal
    from app.ui import tokens
    from storage import users

    n = alice["train"]
    folder = _model_attacks(stack, n, "gradio")["linked weights"]
    with services.sessions(stack.settings)() as s:
        bob = principal(users.get_user(session=s, name="bob"), stack.settings, "session")
    before = stack.rows()
    with acting_as(bob):
        msg, _, _ = tokens.run_tokens(stack.settings, str(folder), "1+1=", 8, None, 8)
    assert f"write job:{n}" in msg and "nothing was queued" in msg, msg
    assert stack.rows() == before


# -- the worker: a link swapped after submit ------------------------------------------------------
@pytest.mark.redis
@pytest.mark.slow
def test_link_swapped_after_submit_is_caught_by_the_worker(redis_stack: Any, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL + Redis + a separate worker process. bob submits a diff of his own folder (its
    weights a link to his own file inside the roots: accepted), then points the link at alice's
    trained weights in the store before a worker runs it: the worker fails the job naming the
    field, and nothing of alice's reaches bob's result. The same folder left alone succeeds. A
    link swapped while a job runs (after the worker verified it, while it loads the model)
    fails that job after the run, its result not stored."""
    from fastapi.testclient import TestClient

    from app import services
    from app.web import create_app
    from compute.contract.jobresult import JobResult
    from storage import repo, users
    from storage.artifacts import open_store

    models = tmp_path / "models"
    models.mkdir()
    for k, v in {"ALLOWED_MODEL_ROOTS": str(models), "AUTH_REQUIRED": "1",
                 "PUBLIC_URL": "http://testserver"}.items():
        monkeypatch.setenv(k, v)
        redis_stack.env[k] = v
    settings = redis_stack.settings
    assert settings.db_url.startswith("postgresql") and settings.auth_required
    app = create_app(settings)
    zoo = settings.zoo_dir / "arith-base"
    with services.sessions(settings)() as s:
        ids, tokens = {}, {}
        for name in ("alice", "bob"):
            u = users.create_user(session=s, name=name, password=f"pw-{name}-123")
            tokens[name], _ = users.issue_token(session=s, user=u)
            ids[name] = u.id
        trained = tmp_path / "alice-trained"  # alice's "trained" model: arith-base, weights moved
        shutil.copytree(zoo, trained)
        w = load_file(str(zoo / "model.safetensors"))
        save_file({k: v + 0.5 for k, v in w.items()}, str(trained / "model.safetensors"))
        job = repo.create_job(session=s, kind="train", spec={"model": "arith-base"}, spec_hash="alice-t",
                              owner_id=ids["alice"], refs={})
        repo.mark_running(session=s, job_id=job.id, worker="test")
        repo.save_result(session=s, job_id=job.id, store=open_store(settings),
                         result=JobResult(kind="train", summary={}, files={"model": str(trained)}))
        repo.mark_succeeded(session=s, job_id=job.id)
        n = job.id
    theirs = settings.artifacts_dir / str(n) / "model" / "model.safetensors"
    assert theirs.is_file()

    bob = TestClient(app, follow_redirects=False)
    bob.headers["Authorization"] = f"Bearer {tokens['bob']}"

    def bobs_folder(name: str, shift: float) -> Path:
        folder = models / name
        shutil.copytree(zoo, folder)
        save_file({k: v + shift for k, v in w.items()}, str(models / f"{name}.safetensors"))
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors").symlink_to(models / f"{name}.safetensors")
        return folder

    folders = {name: bobs_folder(name, shift) for name, shift in (("during", 0.4), ("swapped", 0.1),
                                                                  ("kept", 0.2), ("retargeted", 0.3))}
    jobs = {}
    r = bob.post("/api/jobs", json={"kind": "fisher", "spec": {  # first in the queue: it stops loading
        "model": str(folders["during"]), "prompts": 2, "samples": 1, "max_new_tokens": 4}})
    assert r.status_code == 201, r.text
    jobs["during"] = r.json()["id"]
    for name, folder in folders.items():
        if name == "during":
            continue
        r = bob.post("/api/jobs", json={"kind": "diff", "spec": {"base": "arith-base", "tuned": str(folder)}})
        assert r.status_code == 201, r.text
        jobs[name] = r.json()["id"]
    for name, to in (("swapped", theirs), ("retargeted", models / "kept.safetensors")):
        (folders[name] / "model.safetensors").unlink()  # after submit, before any worker runs it
        (folders[name] / "model.safetensors").symlink_to(to)

    redis_stack.start_worker(faults=["loading"])  # the fisher job stops as it loads its model
    redis_stack.wait_reached("loading")  # verified by now (fetch_refs ran): swap it mid-run
    (folders["during"] / "model.safetensors").unlink()
    (folders["during"] / "model.safetensors").symlink_to(theirs)
    redis_stack.release("loading")
    done: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + 300  # only guards against a hang
    for name, j in jobs.items():
        while (job := bob.get(f"/api/jobs/{j}").json())["status"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"job {j} never finished: {job}\n{redis_stack.logs()}"
            time.sleep(0.5)
        done[name] = job
    assert done["kept"]["status"] == "succeeded", (done["kept"], redis_stack.logs())
    bad = done["swapped"]
    assert bad["status"] == "failed", bad
    assert "tuned:" in bad["message"] and "changed since the job was submitted" in bad["message"], bad
    assert "links into the artifact store" in bad["message"] and str(settings.artifacts_dir) not in bad["message"]
    other = done["retargeted"]  # the link moved to another of bob's files: other bytes
    assert other["status"] == "failed" and "holds other bytes" in other["message"], other
    during = done["during"]  # swapped while it ran: the result is not stored
    assert during["status"] == "failed" and "changed while the job ran" in during["message"], during
    assert "model:" in during["message"]
    with services.sessions(settings)() as s:
        assert repo.get_artifact(session=s, job_id=jobs["during"], kind="fisher") is None
    with services.sessions(settings)() as s:
        for name in ("swapped", "retargeted"):
            assert repo.get_artifact(session=s, job_id=jobs[name], kind="delta") is None
