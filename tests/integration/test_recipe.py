"""docs/lab.md's "Several users without Docker" recipe, run as written: the ```bash block after the
`<!-- recipe: several users ... -->` marker, line by line, in one bash process.

Only the values of its `export` lines are replaced (this test's PostgreSQL schema, Redis database,
folder, port and public URL); every command is the README's. Then, as a user would: ada's token
(printed by `user add`) submits a Fisher job to the web app the recipe started, the worker it
started computes it, and the share link is under PUBLIC_URL. A second test shows share links
following the request's host when PUBLIC_URL is not set.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.browser import free_port
from tests.integration.conftest import REDIS_URL, _redis_or_skip
from tests.pg import pg_schema_url

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- recipe: several users without Docker"


def recipe_block(readme: str) -> list[str]:
    """The command lines of the README's recipe block (comments and blank lines dropped)."""
    start = readme.index(MARKER)
    m = re.search(r"```bash\n(.*?)```", readme[start:], re.S)
    assert m, "the recipe marker is not followed by a ```bash block"
    return [ln for ln in m.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def with_values(lines: list[str], values: dict[str, str]) -> list[str]:
    """The block with the values of its `export NAME=...` assignments replaced (NAME from
    `values`); every other word as written. Fails if the block does not export a name."""
    out, seen = [], set()
    for ln in lines:
        if ln.startswith("export "):
            parts = []
            for word in ln.split()[1:]:
                name = word.split("=", 1)[0]
                if name in values:
                    seen.add(name)
                    word = f"{name}={values[name]}"
                parts.append(word)
            ln = "export " + " ".join(parts)
        out.append(ln)
    assert seen == set(values), f"the recipe does not set {sorted(set(values) - seen)}"
    return out


def _get(url: str, token: str | None = None, data: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=15) as r:
        return json.loads(r.read())


def test_recipe_block_is_what_the_readme_says():
    lines = recipe_block((ROOT / "docs" / "lab.md").read_text())
    assert "fisherlens db upgrade" in lines and "fisherlens worker &" in lines
    assert "fisherlens up --no-worker --host 0.0.0.0 &" in lines
    exported = {w.split("=", 1)[0] for ln in lines if ln.startswith("export ") for w in ln.split()[1:]}
    assert {"DATABASE_URL", "REDIS_URL", "PUBLIC_URL", "FISHERLENS_HOME", "AUTH_REQUIRED", "PORT"} <= exported


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.postgres
def test_several_users_recipe_runs_as_written(tmp_path):
    _redis_or_skip()
    lines = recipe_block((ROOT / "docs" / "lab.md").read_text())
    port = free_port()
    public = f"http://127.0.0.1:{port}"
    (tmp_path / "ada-password.txt").write_text("correct horse battery staple\n")
    with pg_schema_url("fl_recipe") as db_url:
        script = "set -e\n" + "\n".join(with_values(lines, {
            "DATABASE_URL": db_url, "REDIS_URL": REDIS_URL, "FISHERLENS_HOME": str(tmp_path / "home"),
            "PUBLIC_URL": public, "PORT": str(port), "AUTH_REQUIRED": "true"})) + "\nwait\n"
        env = {k: v for k, v in os.environ.items()
               if k not in ("DATABASE_URL", "REDIS_URL", "PUBLIC_URL", "FISHERLENS_HOME", "PORT")}
        # `fisherlens` is the console script of the environment running the tests
        env.update(PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}", PYTHONPATH=str(ROOT),
                   FISHERLENS_DEVICE="cpu", OMP_NUM_THREADS="1", GRADIO_ANALYTICS_ENABLED="False")
        log = tmp_path / "recipe.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None, f"the recipe stopped ({proc.returncode}):\n{log.read_text()[-3000:]}"
                try:
                    _get(f"{public}/api/health")
                    break
                except OSError:
                    assert time.monotonic() < deadline, f"no server at {public}:\n{log.read_text()[-3000:]}"
                    time.sleep(1)
            token = re.search(r"API token \(shown once, store it now\): (\S+)", log.read_text()).group(1)
            job = _get(f"{public}/api/jobs", token, {"kind": "fisher", "spec": {
                "model": "arith-base", "prompts": 2, "samples": 1, "max_new_tokens": 4, "device": "cpu"}})
            assert job["share_url"] == f"{public}/r/{job['share_token']}"  # PUBLIC_URL, as set
            while job["status"] not in ("succeeded", "failed", "cancelled"):
                assert time.monotonic() < deadline + 300, f"job still {job['status']}:\n{log.read_text()[-3000:]}"
                time.sleep(1)
                job = _get(f"{public}/api/jobs/{job['id']}", token)
            assert job["status"] == "succeeded", job.get("message")
            _get(f"{public}/api/jobs/{job['id']}/share", token, {"action": "on"})  # off by default
            with urllib.request.urlopen(f"{public}/r/{job['share_token']}", timeout=15) as r:
                assert r.status == 200 and b"id='fl-key'" in r.read()  # anyone with the link
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def test_share_links_follow_the_request_host_without_public_url(tmp_path, zoo_home):
    """`up --host 0.0.0.0` without PUBLIC_URL: links use the address the client reached us by,
    never 127.0.0.1 (and PUBLIC_URL, when set, wins)."""
    import shutil

    from fastapi.testclient import TestClient

    from app.web import create_app
    from compute.contract.settings import Settings

    shutil.copytree(zoo_home / "zoo", tmp_path / "zoo")
    # embedded mode answers only names it was told (the DNS-rebinding guard): the operator lists them
    hosts = "10.1.2.3,lens.example.org"
    settings = Settings(fisherlens_home=tmp_path, database_url=None, redis_url=None, allowed_hosts=hosts)
    assert "public_url" not in settings.model_fields_set
    client = TestClient(create_app(settings), base_url="http://10.1.2.3:7860")
    r = client.post("/api/jobs", json={"kind": "fisher", "spec": {"model": "arith-base", "prompts": 2}},
                    headers={"Host": "10.1.2.3:7860"})
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["share_url"] == f"http://10.1.2.3:7860/r/{job['share_token']}"
    behind = client.get(f"/api/jobs/{job['id']}", headers={"Host": "lens.example.org", "X-Forwarded-Proto": "https"})
    assert behind.json()["share_url"] == f"https://lens.example.org/r/{job['share_token']}"
    fixed = Settings(fisherlens_home=tmp_path, database_url=None, redis_url=None, public_url="http://pub:1",
                     allowed_hosts=hosts)
    r2 = TestClient(create_app(fixed), base_url="http://10.1.2.3:7860").get(f"/api/jobs/{job['id']}")
    assert r2.json()["share_url"] == f"http://pub:1/r/{job['share_token']}"
