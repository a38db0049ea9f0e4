"""End to end in headless Chromium: the server-rendered share page /r/<token> served by a real
uvicorn process (SQLite), with results stored through the repository functions.

Checks that the page draws every embedded figure with the local plotly.js (no other host is
contacted, no script error), that the key numbers come before the figures, that layers are named,
that the link to the explorer opens the same stored figures there, and that running and failed
jobs get their own pages. Screenshot: test-artifacts/e2e/share-page.png.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from compute.contract.jobresult import JobResult, LayerStat, SeriesPoint
from tests.browser import ARTIFACTS, CHROMIUM
from tests.browser import free_port as _free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _missing(what: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"e2e: {what} (CI must run the browser tests)")
    pytest.skip(f"e2e: {what}")


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        _missing(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:  # pragma: no cover
        _missing("the playwright Python package is not installed")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def _result() -> JobResult:
    return JobResult(
        kind="fisher",
        summary={"estimator": "sequence", "n_samples": 16, "gini": 0.6, "top1%_share": 0.21,
                 "top10%_share": 0.55, "split_half_jaccard": 0.42, "split_half_topk_percent": 1.0},
        layer_stats=[
            LayerStat("model.layers.0.self_attn.q_proj.weight", "q", 0, {"mean": 0.5, "mass": 2.0, "numel": 4}),
            LayerStat("model.layers.1.mlp.up_proj.weight", "up", 1, {"mean": 0.25, "mass": 1.0, "numel": 4}),
            LayerStat("model.embed_tokens.weight", "embed", None, {"mean": 0.25, "mass": 2.0, "numel": 8}),
            LayerStat("lm_head.weight", "lm_head", None, {"mean": 0.125, "mass": 1.0, "numel": 8}),
        ],
        series=[SeriesPoint("concentration", 0.01, 0.21), SeriesPoint("concentration", 0.1, 0.55),
                SeriesPoint("concentration", 1.0, 1.0)],
    )


@pytest.fixture(scope="module")
def server(browser, tmp_path_factory: pytest.TempPathFactory):
    """uvicorn serving app.web:create_app on a fresh home with three jobs; yields (url, tokens)."""
    from app import services
    from compute.contract.settings import Settings
    from storage import repo

    home = tmp_path_factory.mktemp("share_e2e")
    settings = Settings(fisherlens_home=home, database_url=None, redis_url=None)
    tokens = {}
    with services.sessions(settings)() as s:
        for status in ("succeeded", "running", "failed"):
            job = repo.create_job(session=s, kind="fisher", spec={"model": "arith-base"}, spec_hash=status)
            tokens[status] = job.share_token
            repo.claim_job(session=s, job_id=job.id, worker="e2e", stale_after_s=3600)
            if status == "succeeded":
                repo.save_result(session=s, job_id=job.id, result=_result())
                repo.mark_succeeded(session=s, job_id=job.id)
            elif status == "failed":
                repo.mark_failed(session=s, job_id=job.id, error="Traceback ...",
                                 message="ValueError: prompts: no prompts were processed")
            else:
                repo.update_progress(session=s, job_id=job.id, fraction=0.25, message="sampling")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "PUBLIC_URL")}
    env.update(FISHERLENS_HOME=str(home), GRADIO_ANALYTICS_ENABLED="False")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = open(ARTIFACTS / "share-server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "app.web:create_app",
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"uvicorn exited ({proc.returncode}); see {ARTIFACTS / 'share-server.log'}")
            try:
                urllib.request.urlopen(base + "/api/health", timeout=5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("uvicorn did not serve in 180 s; see share-server.log")
                time.sleep(0.5)
        yield base, tokens
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def test_share_page_draws_every_figure_with_key_numbers_first(browser, server):
    base, tokens = server
    ctx = browser.new_context(viewport={"width": 1360, "height": 900})
    page = ctx.new_page()
    page.set_default_timeout(60_000)
    errors: list[str] = []
    hosts: set[str] = set()
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: hosts.add(r.url.split("/")[2]))
    resp = page.goto(f"{base}/r/{tokens['succeeded']}")
    assert resp.status == 200
    n = page.eval_on_selector_all("script[type='application/json'][id^='fl-fig-']", "els => els.length")
    assert n >= 3
    page.wait_for_function(f"() => {{ const f = [...document.querySelectorAll('figure.fl-fig')];"
                           f" return f.length === {n} && f.every(x => x.querySelector('.js-plotly-plot .main-svg')); }}")
    first = page.eval_on_selector("#fl-fig-0 .js-plotly-plot",
                                  "el => ({type: el.data[0].type, y: el.data[0].y, x: el.data[0].x,"
                                  " title: el.layout.title.text})")
    assert first["type"] == "heatmap" and "Fisher mean by layer x module" in first["title"]
    assert first["y"] == ["0", "1", "embeddings", "lm_head"] and "-" not in first["y"]
    # key numbers (and the verdict: 0.42 < 0.5 is poor, its one name everywhere) above the first figure
    key = page.query_selector("#fl-key").bounding_box()
    fig0 = page.query_selector("#fl-fig-0").bounding_box()
    assert key["y"] + key["height"] <= fig0["y"]
    assert "poor:" in page.inner_text("#fl-verdict") and "unreliable" not in page.inner_text("#fl-verdict")
    assert "21%" in page.inner_text("#fl-key")
    assert errors == [] and hosts == {base.split("/")[2]}  # plotly.js from this server, no CDN
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "share-page.png"), full_page=True)

    # the explorer link opens the same stored figures in the Gradio result view
    page.click("#fl-open-app")
    page.wait_for_selector("#fl-fig-0 .js-plotly-plot .main-svg")
    ui = page.eval_on_selector("#fl-fig-0 .js-plotly-plot", "el => ({y: el.data[0].y, z: el.data[0].z})")
    assert ui["y"] == first["y"]
    ctx.close()


def test_running_and_failed_pages(browser, server):
    base, tokens = server
    ctx = browser.new_context()
    page = ctx.new_page()
    page.goto(f"{base}/r/{tokens['running']}")
    assert page.get_attribute("#fl-status", "data-status") == "running"
    assert "25%" in page.inner_text("#fl-status")
    page.goto(f"{base}/r/{tokens['failed']}")
    text = page.inner_text("#fl-status")
    assert text == "This job failed: ValueError: prompts: no prompts were processed"
    assert "Traceback" not in page.content()
    ctx.close()
