"""A running fisherlens app for tests that talk to it over HTTP: uvicorn in a thread, AUTH_REQUIRED,
SQLite under a temporary home that links the test zoo, with one API token per user. `submit` posts
a job through the REST API and, by default, runs it in this process with the worker's own
function (compute.worker.execute.execute_job)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.browser import free_port


class LiveApp:
    def __init__(self, zoo_home: Path, home: Path, users_: tuple[str, ...] = ("alice", "bob")):
        import uvicorn

        from app import services
        from app.web import create_app
        from compute.contract.settings import Settings
        from storage import users

        (home / "zoo").symlink_to(zoo_home / "zoo", target_is_directory=True)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.settings = Settings(fisherlens_home=home, database_url=None, redis_url=None,
                                 auth_required=True, public_url=self.url)
        app = create_app(self.settings)
        self.tokens: dict[str, str] = {}
        with services.sessions(self.settings)() as s:
            for name in users_:
                u = users.create_user(session=s, name=name, password=f"pw-{name}-123")
                self.tokens[name], _ = users.issue_token(session=s, user=u)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def submit(self, who: str, kind: str, spec: dict[str, Any], run: bool = True) -> dict[str, Any]:
        from compute.worker.execute import execute_job

        req = urllib.request.Request(f"{self.url}/api/jobs", method="POST",
                                     data=json.dumps({"kind": kind, "spec": spec}).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self.tokens[who]}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            job = json.loads(r.read())
        if run:
            assert execute_job(self.settings, job["id"]) == "succeeded", job
        return dict(job)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
