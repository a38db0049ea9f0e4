"""The `series` job kind on the deployed stack: the app (AUTH_REQUIRED, FastAPI TestClient) on
PostgreSQL, Redis as the broker, and a separate `fisherlens worker` process that computes.

alice submits a series of a real TRL run folder (GRPOTrainer, save_steps=1, three checkpoints:
tests/trl_runs.py) inside the allowed model roots against arith-base through the REST API; the
worker reads it. Checked: the stored result rows (summary points and series rows in step order,
the layer x module heatmap with one column per checkpoint) hold the sparsities computed by hand
here from the checkpoints' tensors (every tensor for the global numbers, q_proj of layer 0 for one
heatmap cell), and the share page serves them to a reader with no account.

Ownership: alice also trains with save_steps (a run folder in the artifact store, job T). bob
naming that run folder by `job:T` gets the answer of a job that does not exist, by its path in
the store "write job:T"; nothing is queued for him. alice may use `job:T`, and her series of it
reads the train job's checkpoints.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from app.figures import keynumbers as kn

pytestmark = [pytest.mark.redis, pytest.mark.postgres, pytest.mark.slow]

TRAIN = {"model": "arith-base", "steps": 2, "save_steps": 1, "batch": 2, "group": 2, "eval_prompts": 4,
         "bound": False, "max_new_tokens": 4}


class Deployed:
    def __init__(self, stack: Any, runs: Path):
        from app import services
        from app.web import create_app
        from storage import users

        self.stack, self.runs = stack, runs
        self.settings = stack.settings
        assert self.settings.db_url.startswith("postgresql") and self.settings.auth_required
        self.app = create_app(self.settings)
        self.tokens: dict[str, str] = {}
        with services.sessions(self.settings)() as s:
            for name in ("alice", "bob"):
                u = users.create_user(session=s, name=name, password=f"pw-{name}-123")
                self.tokens[name], _ = users.issue_token(session=s, user=u)

    def client(self, name: str | None = None) -> TestClient:
        c = TestClient(self.app, follow_redirects=False)
        if name:
            c.headers["Authorization"] = f"Bearer {self.tokens[name]}"
        return c

    def run(self, who: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
        r = self.client(who).post("/api/jobs", json={"kind": kind, "spec": spec})
        assert r.status_code == 201, r.text
        job, deadline = r.json(), time.monotonic() + 600  # only guards against a hang
        while job["status"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"{kind} job never finished: {job}\n{self.stack.logs()}"
            time.sleep(0.5)
            job = self.client(who).get(f"/api/jobs/{job['id']}").json()
        assert job["status"] == "succeeded", f"{kind}: {job}\n{self.stack.logs()}"
        return dict(job)


@pytest.fixture
def deployed(redis_stack: Any, zoo_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Deployed:
    from tests.trl_runs import grpo_run_folder

    runs = tmp_path / "runs"
    grpo_run_folder(zoo_home / "zoo" / "arith-base", runs / "grpo", steps=3)
    for k, v in {"ALLOWED_MODEL_ROOTS": str(runs), "AUTH_REQUIRED": "1",
                 "PUBLIC_URL": "http://testserver"}.items():
        monkeypatch.setenv(k, v)  # the app here
        redis_stack.env[k] = v  # and the worker
    redis_stack.start_worker()
    return Deployed(redis_stack, runs)


def _unchanged(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: list[str]) -> float:
    """The exactly-unchanged share of the coordinates of `names` between two state dicts."""
    same = sum(int((a[n] == b[n]).sum()) for n in names)
    return same / sum(a[n].numel() for n in names)


def test_series_of_a_trl_run_folder_through_a_worker_on_postgres(deployed: Deployed) -> None:
    d = deployed
    run = d.runs / "grpo"
    job = d.run("alice", "series", {"base": "arith-base", "run_dir": str(run)})
    result = d.client("alice").get(f"/api/results/{job['share_token']}").json()
    summary = result["summary"]

    base = load_file(str(d.settings.zoo_dir / "arith-base" / "model.safetensors"))
    ckpts = [load_file(str(run / f"checkpoint-{s}" / "model.safetensors")) for s in (1, 2, 3)]
    names = sorted(base)
    assert all(set(c) == set(base) for c in ckpts)
    assert summary["steps"] == [1, 2, 3] and [p["step"] for p in summary["points"]] == [1, 2, 3]
    assert summary["n_params"] == sum(base[n].numel() for n in names)
    prev = base
    for p, c in zip(summary["points"], ckpts, strict=True):
        assert p["vs_base_update_sparsity"] == pytest.approx(_unchanged(base, c, names), abs=1e-12)
        assert p["vs_prev_update_sparsity"] == pytest.approx(_unchanged(prev, c, names), abs=1e-12)
        prev = c
    assert 0.0 <= summary["final_update_sparsity"] < 1.0  # GRPO moved the weights

    # series rows, in step order, the same numbers
    rows = [r for r in result["series"] if r["name"] == "vs_base/update_sparsity"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["value"] for r in rows] == pytest.approx([p["vs_base_update_sparsity"] for p in summary["points"]])
    # layer x module over steps: the cell of layer 0's q_proj, by hand
    (hm,) = [h for h in result["heatmaps"] if h["name"] == "step_sparsity_layer_module"]
    assert hm["x_labels"] == ["1", "2", "3"]
    q0 = ["model.layers.0.self_attn.q_proj.weight"]
    want = [_unchanged(a, b, q0) for a, b in zip([base, *ckpts[:2]], ckpts, strict=True)]
    assert hm["z"][hm["y_labels"].index("0/q")] == pytest.approx(want, abs=1e-12)
    assert any(a["kind"] == "series" for a in result["artifacts"])

    # the share page: no account needed once alice turns the link on (off by default here)
    assert d.client().get(f"/r/{job['share_token']}").status_code == 404
    assert d.client("alice").post(f"/api/jobs/{job['id']}/share", json={"action": "on"}).status_code == 200
    page = d.client().get(f"/r/{job['share_token']}")
    assert page.status_code == 200, page.text[:500]
    for title in ("Update sparsity over steps", "Sparse sync per step", "Run folder series",
                  kn.pct(summary["final_update_sparsity"])):
        assert title in page.text, title


def test_another_users_run_folder_in_the_artifact_store_is_refused(deployed: Deployed) -> None:
    d = deployed
    train = d.run("alice", "train", TRAIN)
    n = train["id"]
    bob, before = d.client("bob"), len(d.client("bob").get("/api/jobs").json())

    def refused(who: TestClient, run_dir: str) -> str:
        r = who.post("/api/jobs", json={"kind": "series", "spec": {"base": "arith-base", "run_dir": run_dir}})
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["field"] == "run_dir", err
        return str(err["message"])

    theirs, missing = refused(bob, f"job:{n}"), refused(bob, "job:999999")
    assert theirs == missing.replace("999999", str(n)) and "does not exist" in theirs
    store = Path(d.settings.artifacts_dir) / str(n)
    assert store.is_dir()
    for path in (store, *sorted(store.rglob("checkpoint-*"))[:1]):
        msg = refused(bob, str(path))
        assert f"write job:{n}" in msg, msg
    assert len(bob.get("/api/jobs").json()) == before  # nothing queued for bob
    assert f"write job:{n}" in refused(d.client("alice"), str(store))  # by path: not even for alice

    # alice's own run folder by job reference: the train job's checkpoints, in step order
    series = d.run("alice", "series", {"base": "arith-base", "run_dir": f"job:{n}"})
    summary = d.client("alice").get(f"/api/results/{series['share_token']}").json()["summary"]
    assert summary["steps"] == [1, 2] and summary["run_dir"] == f"job:{n}"
