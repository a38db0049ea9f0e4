"""The CLI's queue commands against a server (app/client.py): the token `fisherlens login` saved
goes only to the server it was saved for (compute.integrations.credentials.server_and_token, the TRL
callback's rule); FISHERLENS_TOKEN goes wherever FISHERLENS_URL says.

Real pieces: a running fisherlens app (uvicorn in a thread, AUTH_REQUIRED, SQLite), the real CLI
(`fisherlens login`, `submit`, `jobs`), and a plain HTTP server on another port that records the
headers it receives (what another server would see).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.live_app import LiveApp as App

pytestmark = pytest.mark.slow


class Recorder:
    """Another server: answers every request 401 and keeps the headers it was sent."""

    def __init__(self) -> None:
        seen: list[dict[str, str]] = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                seen.append({k.lower(): v for k, v in self.headers.items()})
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                body = json.dumps({"detail": "not authenticated"}).encode()
                self.send_response(401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.seen = seen
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def servers(zoo_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[App, Recorder]]:
    a = App(zoo_home, tmp_path_factory.mktemp("cli_remote_home"), users_=("alice",))
    rec = Recorder()
    try:
        yield a, rec
    finally:
        rec.stop()
        a.stop()


def _cli(*args: str) -> Any:
    from app.cli import main

    return CliRunner().invoke(main, list(args))


SPEC = json.dumps({"model": "arith-base", "prompts": 4, "samples": 1})


def test_the_saved_token_goes_only_to_the_saved_server(servers, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    app, other = servers
    monkeypatch.setenv("FISHERLENS_CREDENTIALS", str(tmp_path / "cfg" / "credentials.json"))
    monkeypatch.setenv("FISHERLENS_HOME", str(tmp_path / "cli_home"))
    for k in ("FISHERLENS_URL", "FISHERLENS_TOKEN", "DATABASE_URL", "REDIS_URL"):
        monkeypatch.delenv(k, raising=False)
    res = _cli("login", "--url", app.url, "--token", app.tokens["alice"])
    assert res.exit_code == 0, res.output

    # the saved server (also written with a trailing slash or the default port): the saved token
    res = _cli("submit", "fisher", "--spec", SPEC)
    assert res.exit_code == 0 and "queued" in res.output, res.output
    monkeypatch.setenv("FISHERLENS_URL", app.url + "/")
    res = _cli("jobs")
    assert res.exit_code == 0 and "fisher" in res.output, res.output
    # the server's workers, not this machine's (its home has no database): GET /api/workers
    from app import ceiling, services
    from storage import workers

    with services.sessions(app.settings)() as s:
        workers.publish(session=s, name="gpu0@remote", host="remote", device="cuda:0", device_name="H100",
                        free_bytes=62 * 10**9, total_bytes=80 * 10**9, torch_version="2.13.0")
    ceiling._workers_cache.clear()
    res = _cli("workers", "--json")
    assert res.exit_code == 0, res.output
    assert [w["name"] for w in json.loads(res.output)["workers"]] == ["gpu0@remote"]
    with services.sessions(app.settings)() as s:
        workers.remove(session=s, name="gpu0@remote")

    # another server named by FISHERLENS_URL: it is sent no token at all
    monkeypatch.setenv("FISHERLENS_URL", other.url)
    for args in (("submit", "fisher", "--spec", SPEC), ("jobs",), ("status", "1")):
        res = _cli(*args)
        assert res.exit_code == 1, res.output
    assert len(other.seen) == 3 and all("authorization" not in h for h in other.seen), other.seen
    # the same app under another host name is another server: no token, a 401 saying what to do
    alias = app.url.replace("127.0.0.1", "localhost")
    monkeypatch.setenv("FISHERLENS_URL", alias)
    res = _cli("submit", "fisher", "--spec", SPEC)
    assert res.exit_code == 1, res.output
    msg = res.output
    assert f"the server at {alias} refused" in msg and "no token was sent" in msg, msg
    assert f"is for {app.url}, not {alias}" in msg, msg
    assert f"fisherlens login --url {alias}" in msg and "FISHERLENS_TOKEN" in msg, msg
    assert app.tokens["alice"] not in msg

    # FISHERLENS_TOKEN goes wherever FISHERLENS_URL says
    monkeypatch.setenv("FISHERLENS_TOKEN", app.tokens["alice"])
    res = _cli("jobs")
    assert res.exit_code == 0 and "fisher" in res.output, res.output
    monkeypatch.setenv("FISHERLENS_URL", other.url)
    _cli("jobs")
    assert other.seen[-1].get("authorization") == f"Bearer {app.tokens['alice']}"
