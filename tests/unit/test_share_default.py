"""Share links (issue 28, item 6), on PostgreSQL: off by default on a shared server
(AUTH_REQUIRED: the owner turns one on), on in the embedded mode (SHARE_BY_DEFAULT overrides
both), and a link's reader can never rotate or revoke it: not another user, not an anonymous
caller, and not the web UI's read-only view of the link (`/?view=<token>`, whose "New link",
"Cancel job" and "Re-run" refuse; the old link still opens afterwards)."""

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
SPEC = {"model": "arith-base", "prompts": 2, "samples": 1}


def _zoo(home: Path) -> None:
    z = home / "zoo" / "arith-base"
    z.mkdir(parents=True)
    (z / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 2,
                                               "hidden_size": 4, "vocab_size": 3}))
    (z / "model.safetensors").write_bytes(b"")
    (z / "fisherlens.json").write_text(json.dumps({"params": 12}))


@pytest.fixture
def pg_url() -> Iterator[str]:
    with pg_schema_url("fl_share_default") as url:
        yield url


def _app(home: Path, url: str, **kw: Any) -> tuple[Settings, Any]:
    from app.web import create_app

    _zoo(home)
    settings = Settings(fisherlens_home=home, database_url=url, redis_url=None,
                        public_url="http://testserver", **kw)
    return settings, create_app(settings)


def test_off_by_default_with_accounts_and_only_the_owner_changes_it(pg_url: str, tmp_path: Path) -> None:
    from app import services
    from storage import users

    settings, app = _app(tmp_path, pg_url, auth_required=True)
    tokens = {}
    with services.sessions(settings)() as s:
        for name in ("alice", "bob"):
            u = users.create_user(session=s, name=name, password=f"pw-{name}-123")
            tokens[name], _ = users.issue_token(session=s, user=u)

    def client(who: str | None) -> TestClient:
        c = TestClient(app, follow_redirects=False)
        if who:
            c.headers["Authorization"] = f"Bearer {tokens[who]}"
        return c

    alice, bob, anon = client("alice"), client("bob"), client(None)
    r = alice.post("/api/jobs", json={"kind": "fisher", "spec": SPEC})
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["shared"] is False
    token = job["share_token"]
    assert anon.get(f"/r/{token}").status_code == 404 and bob.get(f"/api/results/{token}").status_code == 404
    assert alice.get(f"/api/results/{token}").status_code == 200  # the owner reads it all the same
    assert alice.post(f"/api/jobs/{job['id']}/share", json={"action": "on"}).json()["shared"] is True
    assert anon.get(f"/api/results/{token}").status_code == 200  # on: anyone with the link
    # a reader of the link (another user, or nobody signed in) cannot rotate or revoke it
    for action in ("new", "off"):
        assert bob.post(f"/api/jobs/{job['id']}/share", json={"action": action}).status_code == 404
        assert anon.post(f"/api/jobs/{job['id']}/share", json={"action": action}).status_code == 401
    assert anon.get(f"/api/results/{token}").status_code == 200  # still the same, still on


@pytest.mark.parametrize(("auth", "explicit", "want"), [(False, None, True), (True, True, True),
                                                        (False, False, False)])
def test_the_default_follows_the_mode_unless_set(pg_url: str, tmp_path: Path, auth: bool,
                                                 explicit: bool | None, want: bool) -> None:
    from app import services
    from storage import users

    settings, app = _app(tmp_path, pg_url, auth_required=auth, share_by_default=explicit)
    c = TestClient(app, base_url="http://127.0.0.1")
    if auth:
        with services.sessions(settings)() as s:
            tok, _ = users.issue_token(session=s, user=users.create_user(session=s, name="u", password="pw-u-12345"))
        c.headers["Authorization"] = f"Bearer {tok}"
    r = c.post("/api/jobs", json={"kind": "fisher", "spec": SPEC})
    assert r.status_code == 201, r.text
    assert r.json()["shared"] is want


def test_the_read_only_view_of_a_link_cannot_rotate_cancel_or_rerun(pg_url: str, tmp_path: Path) -> None:
    """Embedded mode: the page opened as /?view=<token> (app.ui.page.on_load sets the
    session's readonly state) refuses New link / Cancel / Re-run; the owner's page may."""
    from app import services
    from app.ui import result

    settings, app = _app(tmp_path, pg_url)
    job = services.submit(settings, "fisher", SPEC)
    token = job["share_token"]
    note, new = result.reshare_current(settings, token, True)
    assert "read-only view of a share link" in note.value and isinstance(new, type(result.gr.skip()))
    assert "read-only" in result.cancel_current(settings, token, True).value
    assert "read-only" in result.rerun_current(settings, token, True)[0].value
    c = TestClient(app, base_url="http://127.0.0.1")
    assert c.get(f"/api/results/{token}").status_code == 200  # unchanged
    assert services.get_job(settings, job["id"])["status"] == "queued"  # not cancelled
    _, rotated = result.reshare_current(settings, token, False)  # the owner's own page
    assert isinstance(rotated, str) and rotated != token
    assert c.get(f"/api/results/{token}").status_code == 404
