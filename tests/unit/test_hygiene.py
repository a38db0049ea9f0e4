"""Input hygiene on PostgreSQL (issue 28, item 5): a NUL or another control character in any
path, query parameter, form field or spec string is a 4xx naming where, before the database
(PostgreSQL cannot store NUL: it was a 500 with a traceback); user names are unique whatever
their case; a registered model's name cannot read as a reference."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from compute.contract.settings import Settings
from tests.pg import pg_schema_url

pytestmark = pytest.mark.postgres


class Env:
    def __init__(self, home: Path, db_url: str, models: Path):
        from app import services
        from app.web import create_app
        from storage import users

        zoo = home / "zoo" / "arith-base"
        zoo.mkdir(parents=True)
        (zoo / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 2}))
        (zoo / "model.safetensors").write_bytes(b"")
        self.settings = Settings(fisherlens_home=home, database_url=db_url, redis_url=None,
                                 allowed_model_roots=str(models), public_url="http://testserver",
                                 auth_required=True)
        self.app = create_app(self.settings)
        self.models = models
        with services.sessions(self.settings)() as s:
            for name, admin in (("alice", False), ("root", True)):
                u = users.create_user(session=s, name=name, password=f"pw-{name}-123", is_admin=admin)
                tok, _ = users.issue_token(session=s, user=u)
                setattr(self, f"{name}_token", tok)

    def client(self, who: str | None = None) -> TestClient:
        c = TestClient(self.app, follow_redirects=False, raise_server_exceptions=False)
        if who:
            c.headers["Authorization"] = f"Bearer {getattr(self, f'{who}_token')}"
        return c


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    home = tmp_path_factory.mktemp("hygiene_home")
    models = tmp_path_factory.mktemp("hygiene_models")
    with pg_schema_url("fl_hygiene") as url:
        yield Env(home, url, models)


ORIGIN = {"Origin": "http://testserver"}


def _refused(r: Any, status: int, field: str) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    (err,) = r.json()["detail"]
    assert err["field"] == field and "control character U+0000" in err["message"], err


def test_nul_everywhere_is_a_4xx_naming_where(env: Env) -> None:
    anon, root, alice = env.client(), env.client("root"), env.client("alice")
    # unauthenticated: the sign-in form, a share page, a result by token
    _refused(anon.post("/login", data={"name": "al\x00ice", "password": "x"}, headers=ORIGIN), 422, "form.name")
    _refused(anon.get("/r/a%00b"), 422, "path")
    _refused(anon.get("/api/results/a%00b"), 422, "path")
    # as admin: a query parameter, a path parameter, a model name
    _refused(root.get("/api/jobs?owner=a%00b"), 422, "query.owner")
    _refused(root.post("/api/users/a%00b/end-sessions", headers=ORIGIN), 422, "path")
    _refused(root.post("/api/models", json={"path": "arith-base", "name": "evil\u0000"}), 422, "name")
    # a spec string, nested, and a key
    _refused(alice.post("/api/jobs", json={"kind": "fisher", "spec": {"model": "arith\u0000base"}}),
             422, "spec.model")
    _refused(alice.post("/api/estimate", json={"kind": "fisher", "spec": {"model": "x", "k\u0000": 1}}),
             422, "spec.'k\\x00'")
    # the Gradio endpoints (same app, same middleware)
    _refused(alice.post("/gradio_api/queue/join", json={"data": ["arith-base", "1+\u00001"], "fn_index": 0}),
             422, "data[1]")
    # other control characters too; tab and newline stay allowed in body text
    r = alice.get("/api/jobs?owner=a%1bb")
    assert r.status_code == 422 and "U+001B" in r.text
    r = alice.post("/api/jobs", json={"kind": "tokens", "spec": {"model": "arith-base", "context": "1+1=\n\t2"}})
    assert r.status_code != 422 or "control character" not in r.text, r.text


def test_the_database_never_sees_the_nul(env: Env) -> None:
    """Every probe above answered before a query: the same probes leave no 5xx and the app
    still answers (a PostgreSQL error would also have poisoned nothing, but it would be 500)."""
    anon = env.client()
    for path in ("/r/%00", "/api/results/%00/stats.csv", "/api/jobs/%00", "/login?next=%00"):
        assert anon.get(path).status_code < 500, path
    assert env.client("alice").get("/api/me").status_code == 200


def test_user_names_are_unique_whatever_their_case(env: Env) -> None:
    from app import services
    from storage import users

    with services.sessions(env.settings)() as s:
        with pytest.raises(ValueError, match="only in case"):
            users.create_user(session=s, name="ROOT", password="pw-ROOT-123")
        with pytest.raises(ValueError, match="only in case"):
            users.create_user(session=s, name="Alice")
        users.create_user(session=s, name="alice2")  # a different name is fine


@pytest.mark.parametrize("name", ["job:1", "arith-base", "ARITH-BASE", "smollm2-135m", "../x", "a/b",
                                  "two\nlines", "evil\u202etxt.exe", ".hidden", "~root", "x" * 101])
def test_model_names_that_read_as_references_are_refused(env: Env, name: str) -> None:
    folder = env.models / "m"
    if not folder.exists():
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
        header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
        (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    r = env.client("root").post("/api/models", json={"path": str(folder), "name": name})
    assert r.status_code == 422, r.text
    (err,) = r.json()["detail"]
    assert err["field"] == "name", err
    ok = env.client("root").post("/api/models", json={"path": str(folder), "name": "my model #1"})
    assert ok.status_code == 201, ok.text
