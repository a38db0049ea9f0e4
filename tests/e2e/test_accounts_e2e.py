"""End to end in headless Chromium with accounts: `fisherlens up` with AUTH_REQUIRED=true (SQLite,
filesystem queue, one real worker), users made with `fisherlens user add`. Alice signs in on the
login page, sees her name and the cost estimate, submits a Fisher job through the form, sees
only her own jobs (not Bob's), opens her share link in a signed-out browser context, and signs
out (the session is revoked: the explorer sends her back to the login page)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, JOB_TIMEOUT_MS
from tests.browser import free_port as _free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def shot(page, name: str, full_page: bool = True) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=full_page)


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"e2e: no Chromium at {CHROMIUM} (required under CI)")
        pytest.skip(f"e2e: no Chromium at {CHROMIUM} (Debian: apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def _api(base: str, path: str, token: str | None = None, body: dict | None = None) -> tuple[int, object]:
    req = urllib.request.Request(base + path, method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


@pytest.fixture(scope="module")
def auth_server(browser, zoo_home: Path, tmp_path_factory: pytest.TempPathFactory):
    """`fisherlens up` with AUTH_REQUIRED=true; yields (base URL, {name: API token}, zoo dir)."""
    home = tmp_path_factory.mktemp("e2e_auth_home")
    shutil.copytree(zoo_home / "zoo", home / "zoo")
    port = _free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "PUBLIC_URL", "FISHERLENS_URL", "FISHERLENS_TOKEN")}
    env.update(FISHERLENS_HOME=str(home), FISHERLENS_DEVICE="cpu", OMP_NUM_THREADS="1",
               GRADIO_ANALYTICS_ENABLED="False", AUTH_REQUIRED="true")
    tokens = {}
    for name in ("alice", "bob"):
        out = subprocess.run([sys.executable, "-m", "app.cli", "user", "add", name, "--password-stdin"],
                             cwd=ROOT, env=env, input=f"pw-{name}-e2e\n", capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        tokens[name] = next(w for w in out.stdout.split() if w.startswith("fl_"))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = open(ARTIFACTS / "server-auth.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "up", "--port", str(port)], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"fisherlens up exited ({proc.returncode}); see {ARTIFACTS / 'server-auth.log'}")
            try:
                if _api(base, "/api/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"fisherlens up did not serve {base} in 240 s; see server-auth.log")
            time.sleep(1)
        yield base, tokens, home / "zoo", env
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def test_sign_in_submit_own_jobs_share_and_sign_out(browser, auth_server):
    base, tokens, _zoo, env = auth_server
    assert _api(base, "/api/jobs")[0] == 401  # nobody signed in
    status, bob_job = _api(base, "/api/jobs", tokens["bob"],
                           {"kind": "fisher", "spec": {"model": "arith-base", "prompts": 1, "samples": 1}})
    assert status == 201, bob_job

    ctx = browser.new_context(viewport={"width": 1360, "height": 900})
    page = ctx.new_page()
    page.set_default_timeout(60_000)
    page.goto(base + "/")
    page.wait_for_selector("#fl-login")  # the explorer sent us to the login page
    assert "/login?next=" in page.url
    page.fill("#fl-name", "alice")
    page.fill("#fl-password", "wrong password")
    page.click("#fl-signin")
    assert "Wrong user name or password" in page.inner_text(".fl-login-error")
    page.fill("#fl-name", "alice")
    page.fill("#fl-password", "pw-alice-e2e")
    page.click("#fl-signin")
    page.wait_for_selector("#fl-user-name")
    assert page.inner_text("#fl-user-name") == "alice"
    cookie = next(c for c in ctx.cookies() if c["name"] == "fl_session")
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"

    # the form shows the cost estimate before submitting
    page.wait_for_function("() => { const i = document.querySelector('#fisher-model input');"
                           " return i && i.value === 'arith-base'; }")
    page.fill("#fisher-prompts input", "2")
    page.fill("#fisher-samples input", "1")
    page.press("#fisher-samples input", "Tab")
    # by hand: 2 prompts x 1 sample of 64 (assumed prompt) + 16 tokens; sampling 1 pass, gradient
    # 3 (forward + backward), exact output layer 1: 2 * 80 * 5 token-passes x the zoo's count
    params = json.loads((_zoo / "arith-base" / "fisherlens.json").read_text())["params"]
    want = float(2 * 1 * (64 + 16) * 5 * params)
    page.wait_for_function(f"() => (document.querySelector('#fisher-cost .fl-cost') || {{}})"
                           f".dataset?.cost === '{want}'")
    assert page.get_attribute("#fisher-cost .fl-cost", "data-within") == "yes"
    assert "800 token-passes" in page.inner_text("#fisher-cost")
    shot(page, "accounts-form")
    page.click("#fisher-submit")
    bar = page.wait_for_selector("#fl-progress .fl-progress[data-job]")
    job_id = int(bar.get_attribute("data-job"))
    share = page.input_value("#fl-share-url textarea, #fl-share-url input")
    assert "share link off" in share  # a shared server: off until the owner turns it on
    page.click("#fl-reshare")  # "New link" turns one on
    # the link read in the same check that sees it (a job-status refresh may redraw the box
    # between a wait and a second read: CI once read "share link off" here)
    share = page.wait_for_function("() => { const b = document.querySelector('#fl-share-url textarea, "
                                   "#fl-share-url input'); return b && b.value.includes('/r/') && b.value; }"
                                   ).json_value()

    # only her own jobs: Bob's is not listed, and the admin's owner filter is not offered
    page.click("#tab-jobs-button")
    page.wait_for_selector(f"#fl-jobs tr[data-job='{job_id}']")
    assert page.locator(f"#fl-jobs tr[data-job='{bob_job['id']}']").count() == 0
    assert not page.is_visible("#jobs-owner")
    shot(page, "accounts-jobs", full_page=False)

    deadline = time.monotonic() + JOB_TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        job = _api(base, f"/api/jobs/{job_id}", tokens["alice"])[1]
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(1)
    assert job["status"] == "succeeded", job
    assert _api(base, f"/api/jobs/{job_id}", tokens["bob"])[0] == 404

    # the owner replaces the share link: the old one answers 404, the new one opens the result
    page.click("#tab-result-button")
    page.click("#fl-reshare")
    old, share = share, page.wait_for_function(
        f"() => {{ const b = document.querySelector('#fl-share-url textarea, #fl-share-url input'); "
        f"return b && b.value && b.value.includes('/r/') && b.value !== {share!r} && b.value; }}").json_value()
    assert "/r/" in share and share != old
    ctx_old = browser.new_context()
    assert ctx_old.new_page().goto(old).status == 404
    ctx_old.close()

    # the CLI's queue commands talk to the server with a token: `fisherlens login` saves it (0600)
    creds = ARTIFACTS / "cli-credentials.json"
    creds.unlink(missing_ok=True)
    cli_env = {**env, "FISHERLENS_CREDENTIALS": str(creds)}

    def cli(*args: str, token: str | None = None) -> subprocess.CompletedProcess:
        e = {**cli_env, **({"FISHERLENS_TOKEN": token} if token else {})}
        return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, env=e,
                              capture_output=True, text=True, timeout=120)

    out = cli("login", "--url", base, "--token", tokens["alice"])
    assert out.returncode == 0 and "as alice" in out.stdout, out.stderr
    assert creds.stat().st_mode & 0o777 == 0o600
    listed = [int(line.split()[0]) for line in cli("jobs").stdout.splitlines()[1:]]
    assert listed == [job_id]  # hers only, through the server
    out = cli("cancel", str(bob_job["id"]))
    assert out.returncode == 2 and f"no job with id {bob_job['id']}" in out.stderr
    listed = [int(line.split()[0]) for line in cli("jobs", token=tokens["bob"]).stdout.splitlines()[1:]]
    assert listed == [bob_job["id"]]
    out = cli("jobs", token="fl_not-a-token")
    assert out.returncode == 1 and "not valid" in out.stderr
    creds.unlink()

    # a signed-out context opens the share link (no login page)
    ctx2 = browser.new_context(viewport={"width": 1360, "height": 900})
    page2 = ctx2.new_page()
    resp = page2.goto(share)
    assert resp.status == 200 and "/login" not in page2.url
    assert "Fisher" in page2.inner_text("h1")
    shot(page2, "accounts-share")
    ctx2.close()

    # sign out: back to the login page, and the explorer needs a sign-in again
    page.click("#tab-new-button")
    page.click("#fl-signout")
    page.wait_for_selector("#fl-login")
    assert not [c for c in ctx.cookies() if c["name"] == "fl_session"]
    page.goto(base + "/")
    page.wait_for_selector("#fl-login")
    ctx.close()
