"""End to end in headless Chromium: `fisherlens up` on a temp home (SQLite, filesystem queue, one
real worker), a Fisher job submitted through the form, its live progress, the heatmap, the share
link in a fresh browser context, form validation, and the not-found page of unknown links.

Screenshots go to test-artifacts/e2e/; with FISHERLENS_UPDATE_DOCS=1 the README ones are also
written to docs/screenshots/.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, JOB_TIMEOUT_MS
from tests.browser import free_port as _free_port
from tests.conftest import require_service  # a skip on a laptop, a failure under CI

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "screenshots"


def _get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def shot(page, name: str, docs: bool = False, full_page: bool = True) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=full_page)
    if docs and os.environ.get("FISHERLENS_UPDATE_DOCS") == "1":
        DOCS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ARTIFACTS / f"{name}.png", DOCS / f"{name}.png")


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        require_service(f"e2e: no Chromium at {CHROMIUM} (Debian: apt-get install chromium; .ci/run does)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:  # pragma: no cover
        require_service("e2e: the playwright Python package is not installed (pip install playwright)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@contextlib.contextmanager
def up_server(home: Path, zoo_home: Path, **extra_env: str) -> Iterator[str]:
    """`fisherlens up` on `home` holding a copy of the session's zoo (and `extra_env`, e.g.
    ALLOWED_MODEL_ROOTS); yields the base URL, stops the server (and its worker) after."""
    shutil.copytree(zoo_home / "zoo", home / "zoo")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "PUBLIC_URL")}
    env.update(FISHERLENS_HOME=str(home), FISHERLENS_DEVICE="cpu", OMP_NUM_THREADS="1",
               GRADIO_ANALYTICS_ENABLED="False", **extra_env)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = open(ARTIFACTS / "server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "up", "--port", str(port)], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"fisherlens up exited ({proc.returncode}); see {ARTIFACTS / 'server.log'}")
            try:
                _get_json(base + "/api/health")
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"fisherlens up did not serve {base} in 240 s; see server.log")
                time.sleep(1)
        yield base
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # uvicorn stops, then `up` stops its worker
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


@pytest.fixture(scope="module")
def server(browser, zoo_home: Path, tmp_path_factory: pytest.TempPathFactory):
    """`fisherlens up` on a fresh home holding a copy of the session's zoo; yields the base URL."""
    with up_server(tmp_path_factory.mktemp("e2e_home"), zoo_home) as base:
        yield base


def _open(browser, url: str, clipboard: bool = False):
    ctx = browser.new_context(viewport={"width": 1360, "height": 900})
    if clipboard:
        try:
            ctx.grant_permissions(["clipboard-read", "clipboard-write"], origin=url.split("/?")[0].split("/r/")[0])
        except Exception:  # noqa: BLE001 - clipboard permissions are optional in some builds
            pass
    page = ctx.new_page()
    page.set_default_timeout(60_000)
    resp = page.goto(url)
    return ctx, page, resp


def _plot_data(page, selector: str) -> dict:
    """The first trace of the Plotly figure inside `selector` (what plotly.js rendered)."""
    page.wait_for_selector(f"{selector} .js-plotly-plot", timeout=60_000)
    return page.eval_on_selector(
        f"{selector} .js-plotly-plot",
        "el => ({n: el.data.length, type: el.data[0].type, x: el.data[0].x, y: el.data[0].y, "
        "z: el.data[0].z, title: (el.layout.title || {}).text})",
    )


def test_fisher_job_form_progress_heatmap_and_share_link(browser, server):
    ctx, page, _ = _open(browser, server + "/", clipboard=True)
    page.wait_for_selector("#fisher-submit")
    page.wait_for_function("() => { const i = document.querySelector('#fisher-model input');"
                           " return i && i.value === 'arith-base'; }")
    page.fill("#fisher-prompts input", "6")
    page.fill("#fisher-samples input", "2")
    shot(page, "new-job-form", docs=True, full_page=False)
    page.click("#fisher-submit")

    # the page switches to the result view and follows the job's progress bar
    bar = page.wait_for_selector("#fl-progress .fl-progress[data-job]")
    job_id = int(bar.get_attribute("data-job"))
    best = -1.0  # screenshot the bar mid-run: each time it has moved on by 10% or more
    deadline = time.monotonic() + JOB_TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        status = page.get_attribute("#fl-progress .fl-progress", "data-status")
        if status in ("succeeded", "failed", "cancelled"):
            break
        frac = float(page.get_attribute("#fl-progress .fl-progress", "data-progress") or 0)
        if status == "running" and frac >= best + 0.1:
            best = frac
            shot(page, "progress-running", docs=True, full_page=False)
        page.wait_for_timeout(300)
    assert status == "succeeded", page.inner_text("#fl-progress")
    assert page.get_attribute("#fl-progress .fl-progress", "data-progress") == "1.0000"

    data = _plot_data(page, "#fl-fig-0")
    assert data["type"] == "heatmap" and "Fisher mean by layer x module" in data["title"]
    assert "q" in data["x"] and "0" in data["y"]
    values = [v for row in data["z"] for v in row if v is not None]
    assert values, "the heatmap has no finite cells"
    api = _get_json(f"{server}/api/jobs/{job_id}")
    token = api["share_token"]
    assert api["status"] == "succeeded"
    assert f"r={token}" in page.url  # the address bar follows the result shown
    page.wait_for_timeout(1500)  # let the other figures draw for the screenshot
    shot(page, "result-fisher", docs=True)

    share = page.input_value("#fl-share-url textarea, #fl-share-url input")
    assert share == f"{server}/r/{token}"
    page.click("#fl-copy")
    try:
        copied = page.evaluate("navigator.clipboard.readText()")
    except Exception:  # noqa: BLE001 - headless clipboard may be unavailable; the box is the link
        copied = share
    assert copied == share

    page.click("#tab-jobs-button")
    page.wait_for_selector(f"#fl-jobs tr[data-job='{job_id}'][data-status='succeeded']")
    assert page.url.endswith("/?tab=jobs")
    # the embedded worker that ran the job wrote its device: the workers table names it, and says
    # what a queued job is checked against (the figure submit uses)
    page.wait_for_selector("#fl-workers tr[data-worker]")
    workers_text = page.inner_text("#fl-workers")
    assert "1 live worker: queued jobs run there" in workers_text and "is checked against" in workers_text
    assert "of worker " in workers_text
    shot(page, "jobs", docs=True, full_page=False)
    ctx.close()

    # anyone with the link: a fresh context (no cookies, no state) sees the same figure read-only
    ctx2, page2, _ = _open(browser, share)
    data2 = _plot_data(page2, "#fl-fig-0")
    assert data2["z"] == data["z"] and data2["x"] == data["x"] and data2["y"] == data["y"]
    page2.wait_for_function(f"() => window.location.pathname === '/r/{token}'")
    assert not page2.is_visible("#tab-new-button")  # read-only: no job forms
    assert page2.is_visible(".fl-shared")
    page2.wait_for_timeout(1000)
    shot(page2, "share-view", docs=True)
    ctx2.close()


def test_out_of_range_value_shows_message_and_queues_nothing(browser, server):
    before = len(_get_json(server + "/api/jobs"))
    ctx, page, _ = _open(browser, server + "/")
    page.wait_for_selector("#fisher-submit")
    page.wait_for_function("() => { const i = document.querySelector('#fisher-model input');"
                           " return i && i.value === 'arith-base'; }")
    page.fill("#fisher-prompts input", "5000")
    page.click("#fisher-submit")
    msg = page.wait_for_selector(".fl-errors").inner_text()
    assert "prompts" in msg and "got 5000" in msg and "accepted range: >= 1, <= 4096" in msg
    assert "nothing was queued" in msg
    shot(page, "validation-error", docs=True, full_page=False)
    assert len(_get_json(server + "/api/jobs")) == before
    ctx.close()


def test_unknown_share_link_shows_not_found(browser, server):
    ctx, page, resp = _open(browser, f"{server}/r/{secrets.token_urlsafe(24)}")
    assert resp.status == 404
    assert page.inner_text("h1") == "Result not found"
    assert "share link" in page.inner_text("#fl-notfound")
    shot(page, "not-found")
    ctx.close()


def test_token_explorer_runs_a_job_and_clicking_a_token_extends_the_context(browser, server):
    ctx, page, _ = _open(browser, server + "/?tab=tokens")
    page.wait_for_selector("#tokens-submit")
    page.wait_for_function("() => { const i = document.querySelector('#tokens-context textarea, "
                           "#tokens-context input'); return i && i.value === '12+34='; }")
    page.wait_for_timeout(500)
    page.click("#tokens-submit")
    page.wait_for_selector("#tokens-fig-0 .js-plotly-plot", timeout=JOB_TIMEOUT_MS)
    bars = _plot_data(page, "#tokens-fig-0")  # the stored figures: next tokens first
    assert bars["type"] == "bar" and len(bars["x"]) >= 2 and 0 < sum(bars["y"]) <= 1 + 1e-6
    first = page.locator("#tokens-choice label").first
    token_label = first.inner_text()
    shot(page, "token-explorer", docs=True)
    first.click()
    box = "#tokens-context textarea, #tokens-context input"
    page.wait_for_function(f"() => document.querySelector({box!r}).value.length > 6")
    extended = page.input_value(box)
    assert extended.startswith("12+34=") and len(extended) > len("12+34="), (extended, token_label)
    ctx.close()


def _post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _wait_job(server: str, job_id: int, timeout_s: float = JOB_TIMEOUT_MS / 1000) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = _get_json(f"{server}/api/jobs/{job_id}")
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not finish in {timeout_s} s")


def test_compare_base_and_teacher_fisher_side_by_side(browser, server):
    tokens = []
    for model in ("arith-base", "arith-teacher"):  # submitted through the REST API this time
        job = _post_json(server + "/api/jobs", {"kind": "fisher", "spec": {"model": model, "prompts": 4, "samples": 2}})
        assert job["share_url"].endswith("/r/" + job["share_token"])
        assert _wait_job(server, job["id"])["status"] == "succeeded"
        tokens.append(job["share_token"])
    ctx, page, _ = _open(browser, f"{server}/?tab=compare&a={tokens[0]}&b={tokens[1]}")
    page.wait_for_function("() => document.querySelectorAll('#tab-compare .js-plotly-plot').length >= 2",
                           timeout=90_000)
    heads = page.inner_text("#tab-compare")
    assert "arith-base" in heads and "arith-teacher" in heads
    page.wait_for_timeout(1000)
    shot(page, "compare", docs=True)
    ctx.close()


def test_train_then_diff_the_trained_model_against_its_base_from_the_dropdowns(browser, server):
    """Trained models are models everywhere: the Train form's result appears in the diff form's
    'tuned' dropdown as '#N train arith-base grpo' (job:N), and the diff runs on it."""
    ctx, page, _ = _open(browser, server + "/")
    page.wait_for_selector("#fisher-submit")
    page.get_by_role("tab", name="Train", exact=True).click()
    page.wait_for_selector("#train-submit")
    page.wait_for_function("() => { const i = document.querySelector('#train-model input');"
                           " return i && i.value === 'arith-base'; }")
    for box, value in (("#train-steps", "2"), ("#train-batch", "2"), ("#train-group", "2")):
        page.fill(f"{box} input", value)
    page.click("#train-submit")
    bar = page.wait_for_selector("#fl-progress .fl-progress[data-job]")
    train_id = int(bar.get_attribute("data-job"))
    page.wait_for_selector(f"#fl-progress .fl-progress[data-job='{train_id}'][data-status='succeeded']",
                           timeout=JOB_TIMEOUT_MS)

    page.click("#tab-new-button")  # selecting the tab refreshes the model lists
    page.get_by_role("tab", name="Checkpoint diff").click()
    page.wait_for_selector("#diff-submit")
    page.wait_for_function("() => { const i = document.querySelector('#diff-base input');"
                           " return i && i.value === 'arith-base'; }")
    label = f"#{train_id} train arith-base grpo"
    page.click("#diff-tuned input")
    page.locator("li[data-testid='dropdown-option']", has_text=label).first.click()
    page.wait_for_function(f"() => document.querySelector('#diff-tuned input').value.startsWith({label!r})")
    shot(page, "diff-trained-model-form", full_page=False)
    page.click("#diff-submit")
    page.wait_for_selector(f"#fl-progress .fl-progress[data-job]:not([data-job='{train_id}'])")
    diff_id = int(page.get_attribute("#fl-progress .fl-progress", "data-job"))
    page.wait_for_selector(f"#fl-progress .fl-progress[data-job='{diff_id}'][data-status='succeeded']",
                           timeout=JOB_TIMEOUT_MS)
    job = _get_json(f"{server}/api/jobs/{diff_id}")
    assert job["kind"] == "diff" and job["spec"]["base"] == "arith-base"
    assert job["spec"]["tuned"] == f"job:{train_id}"
    summary = _get_json(f"{server}/api/results/{job['share_token']}")["summary"]
    assert summary["tuned"] == f"job:{train_id}" and 0 < summary["changed_fraction"] <= 1
    _plot_data(page, "#fl-fig-0")  # the diff's figures are drawn
    shot(page, "result-diff-trained")
    ctx.close()
