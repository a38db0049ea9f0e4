"""The explorer's interactive side in headless Chromium at 1400x900, on results a real runner
computed (compute.worker.execute.execute_job in this process, jobs submitted through the REST API
of a uvicorn server in a thread, SQLite): two Fishers of arith-base (seeds 0 and 1) and a diff of
arith-base vs arith-teacher scored against the first Fisher.

- clicking a Fisher heatmap cell (and a diff heatmap cell) opens the tensor view, whose numbers
  (tensor, top coordinate and its value) equal those read from the stored safetensors files;
- Compare of the two Fishers shows per layer x module the top-k Jaccard a hand computation from
  the two files gives (tests/unit/test_explore_compare.py `_hand`);
- after three tab moves every colour bar's fill resolves (url(#id) of an element in the page);
- no figure offers a cloud upload (no "Share chart", no Chart Studio link, no plotly logo link),
  on the explorer and the share page; the SVG button downloads a valid SVG.
Screenshots: docs/screenshots/explorer-{drilldown,overlay,compare}.png (and test-artifacts/e2e/).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests.browser import ARTIFACTS, CHROMIUM, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "screenshots"
FISHER = {"model": "arith-base", "prompts": 8, "samples": 2, "max_new_tokens": 4, "device": "cpu"}


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"e2e: no Chromium at {CHROMIUM}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def _post(url: str, data: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(data).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def app(zoo_home, tmp_path_factory):
    """(base url, settings, jobs): the three computed results, by name."""
    import uvicorn

    from app.web import create_app
    from compute.contract.settings import Settings
    from compute.worker.execute import execute_job

    home = tmp_path_factory.mktemp("explorer_e2e")
    (home / "zoo").symlink_to(zoo_home / "zoo", target_is_directory=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    settings = Settings(fisherlens_home=home, database_url=None, redis_url=None, public_url=url)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    jobs = {}
    for name, kind, spec in (("fisher", "fisher", {**FISHER, "seed": 0}), ("fisher2", "fisher", {**FISHER, "seed": 1}),
                             ("diff", "diff", {"base": "arith-base", "tuned": "arith-teacher", "fisher": "job:{fisher}",
                                               "topk_percent": 5.0})):
        spec = {k: v.format(fisher=jobs["fisher"]["id"]) if isinstance(v, str) and "{" in v else v for k, v in spec.items()}
        job = _post(f"{url}/api/jobs", {"kind": kind, "spec": spec})
        assert execute_job(settings, job["id"]) == "succeeded", job
        jobs[name] = job
    yield url, settings, jobs
    server.should_exit = True
    thread.join(timeout=30)


def _fisher_file(settings, job_id: int) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(Path(settings.artifacts_dir) / str(job_id) / "fisher.safetensors"))


def _page(browser, errors: list[str]):
    ctx = browser.new_context(viewport={"width": 1400, "height": 900}, accept_downloads=True)
    page = ctx.new_page()
    page.set_default_timeout(90_000)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return ctx, page


def _open_result(page, base: str, token: str) -> None:
    page.goto(f"{base}/?tab=result&r={token}")
    page.wait_for_selector("#fl-view .fl-result #fl-key")
    page.wait_for_function("() => [...document.querySelectorAll('#fl-view figure.fl-fig')]"
                           ".every(f => f.querySelector('.main-svg'))")


def _click_cell(page, fig_selector: str, layer: str, module: str) -> None:
    """A real mouse click at the centre of heatmap cell (layer, module)."""
    xy = page.eval_on_selector(fig_selector + " .js-plotly-plot", """(gd, cell) => {
        const tr = gd.data[0]; const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
        const i = tr.x.indexOf(cell[1]), j = tr.y.indexOf(cell[0]);
        const box = gd.getBoundingClientRect();
        return [box.left + xa._offset + xa.c2p(i), box.top + ya._offset + ya.c2p(j)];
    }""", [layer, module])
    page.mouse.click(xy[0], xy[1])


def _drill(page, fig_selector: str, layer: str, module: str) -> dict:
    page.eval_on_selector(fig_selector, "f => f.scrollIntoView({block: 'center'})")
    _click_cell(page, fig_selector, layer, module)
    page.wait_for_selector("#fl-tensor #fl-tensor-top")
    page.wait_for_function("() => [...document.querySelectorAll('#fl-tensor figure.fl-fig')]"
                           ".every(f => f.querySelector('.main-svg'))")
    top = page.eval_on_selector_all("#fl-tensor-top tbody tr", "rs => rs.map(r => [...r.cells].map(c => c.innerText))")
    return {"name": page.get_attribute("#fl-tensor", "data-name"), "top": top,
            "summary": page.inner_text("#fl-tensor-summary")}


def test_fisher_and_diff_cells_open_the_stored_tensor(browser, app):
    from app.explore.sources import job_files, open_source

    base, settings, jobs = app
    errors: list[str] = []
    ctx, page = _page(browser, errors)
    _open_result(page, base, jobs["fisher"]["share_token"])
    fig = "#fl-view figure.fl-fig[data-drill]"
    view = _drill(page, fig, "0", "q")
    assert view["name"] == "model.layers.0.self_attn.q_proj.weight"
    f = _fisher_file(settings, jobs["fisher"]["id"])[view["name"]].astype(np.float64)
    order = np.lexsort((np.arange(f.size), -f.reshape(-1)))[:3]
    want = [[str(int(i // f.shape[1])), str(int(i % f.shape[1]))] for i in order]
    assert [r[1:3] for r in view["top"][:3]] == want
    assert float(view["top"][0][3]) == pytest.approx(f.max(), rel=1e-3)  # shown to 4 digits
    assert "shape 64 x 64" in view["summary"]
    assert page.eval_on_selector_all("#fl-tensor figure.fl-fig", "els => els.length") >= 4  # map, 2 marginals, heads, hist
    page.eval_on_selector("#fl-tensor", "e => e.scrollIntoView()")
    page.wait_for_timeout(400)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "explorer-drilldown.png"))
    # a diff cell: |tuned - base| read from the two checkpoints, laid over the Fisher
    _open_result(page, base, jobs["diff"]["share_token"])
    view = _drill(page, "#fl-view figure.fl-fig[data-drill]", "1", "up")
    assert view["name"] == "model.layers.1.mlp.up_proj.weight"
    src = open_source(settings, job_files(settings, jobs["diff"]["share_token"]))
    d = np.abs(src.reader(view["name"])(0, 192)).astype(np.float64)
    from safetensors.numpy import load_file

    zoo = Path(settings.fisherlens_home) / "zoo"
    by_hand = np.abs(load_file(str(zoo / "arith-teacher" / "model.safetensors"))[view["name"]].astype(np.float64)
                     - load_file(str(zoo / "arith-base" / "model.safetensors"))[view["name"]])
    assert np.allclose(d, by_hand, atol=1e-7)
    r, c = np.unravel_index(np.argmax(by_hand), by_hand.shape)
    assert view["top"][0][1:3] == [str(r), str(c)]
    assert "Fisher AUC" in view["summary"]
    titles = page.eval_on_selector_all("#fl-tensor figure.fl-fig figcaption", "cs => cs.map(c => c.innerText)")
    assert any(t.startswith("|delta| against F") for t in titles) and any(t.startswith("ROC of the Fisher") for t in titles)
    page.eval_on_selector("#fl-tensor figure.fl-fig[data-name^='delta-against-f']", "e => e.scrollIntoView()")
    page.wait_for_timeout(400)
    page.screenshot(path=str(ARTIFACTS / "explorer-overlay.png"))
    assert errors == [], errors
    ctx.close()
    _docs("explorer-drilldown", "explorer-overlay")


def _docs(*names: str) -> None:
    import shutil

    DOCS.mkdir(parents=True, exist_ok=True)
    for n in names:
        shutil.copyfile(ARTIFACTS / f"{n}.png", DOCS / f"{n}.png")


def test_compare_of_two_fishers_shows_the_hand_computed_jaccard(browser, app):
    from tests.unit.test_explore_compare import _hand

    base, settings, jobs = app
    errors: list[str] = []
    ctx, page = _page(browser, errors)
    a, b = jobs["fisher"]["share_token"], jobs["fisher2"]["share_token"]
    page.goto(f"{base}/?tab=compare&a={a}&b={b}&k=5")
    page.wait_for_selector("#compare-computed #fl-compare-cells")
    rows = page.eval_on_selector_all("#fl-compare-cells tbody tr", "rs => rs.map(r => [...r.cells].map(c => c.innerText))")
    hand = _hand(_fisher_file(settings, jobs["fisher"]["id"]), _fisher_file(settings, jobs["fisher2"]["id"]), 5.0)
    names = {"embeddings": "-/embed", "final norm": "-/norm", "lm_head": "-/lm_head"}
    assert len(rows) == len(hand)
    for r in rows:
        key = names.get(r[0], f"{r[0]}/{r[1]}")
        assert float(r[3]) == pytest.approx(hand[key]["jaccard"], abs=5e-4), r  # shown to 4 digits
        assert float(r[4]) == pytest.approx(hand[key]["jaccard_baseline"], rel=1e-3), r
    key = page.query_selector("#fl-compare-key").bounding_box()
    assert key["y"] < 900  # overall numbers first, in the first screen
    link = page.get_attribute("#fl-compare-link", "href")
    assert link == f"/r/{a}/compare/{b}?k=5"
    page.wait_for_function("() => [...document.querySelectorAll('#compare-computed figure.fl-fig')]"
                           ".every(f => f.querySelector('.main-svg'))")
    page.wait_for_timeout(300)
    page.screenshot(path=str(ARTIFACTS / "explorer-compare.png"))
    # the two results side by side: every table inside its column (none cut off), every title
    # inside its figure (long ones wrap), the slider below the x axis title
    page.wait_for_function("() => [...document.querySelectorAll('#compare-figs-b figure.fl-fig')]"
                           ".every(f => f.querySelector('.main-svg'))")
    over = page.evaluate("""() => {
      const out = [];
      document.querySelectorAll('.fl-compare-side').forEach(col => {
        const c = col.getBoundingClientRect();
        col.querySelectorAll('.fl-table').forEach(t => {
          if (t.getBoundingClientRect().right > c.right + 1) { out.push('table ' + t.innerText.slice(0, 40)); } });
        col.querySelectorAll('figure.fl-fig').forEach(f => {
          const r = f.getBoundingClientRect(), g = f.querySelector('.gtitle');
          if (g && g.getBoundingClientRect().right > r.right + 1) { out.push('title ' + g.textContent); } });
      });
      return out;
    }""")
    assert over == [], over
    page.eval_on_selector("#compare-head-a", "e => e.scrollIntoView()")
    page.wait_for_timeout(300)
    page.screenshot(path=str(ARTIFACTS / "explorer-compare-sides.png"))
    # the shared link opens the same numbers on a plain page
    page.goto(base + link)
    page.wait_for_selector("#fl-compare-cells")
    shared = page.eval_on_selector_all("#fl-compare-cells tbody tr", "rs => rs.map(r => [...r.cells].map(c => c.innerText))")
    assert shared == rows
    assert errors == [], errors
    ctx.close()
    _docs("explorer-compare")


FILLS = """() => {
  const bad = [];
  let n = 0;
  document.querySelectorAll('.js-plotly-plot .colorbar rect, .js-plotly-plot .cbfill').forEach(el => {
    const fill = el.getAttribute('fill') || el.style.fill || '';
    if (!fill.startsWith('url')) { return; }
    n += 1;
    const m = fill.match(/url\\(["']?([^"')]*)#([^"')]+)["']?\\)/);
    const here = window.location.href.split('#')[0];
    if (!m || (m[1] && m[1] !== here) || !document.getElementById(m[2])) { bad.push(fill); }
  });
  return {n: n, bad: bad};
}"""


def test_colour_bars_survive_tab_moves_and_no_cloud_button(browser, app):
    base, settings, jobs = app
    errors: list[str] = []
    ctx, page = _page(browser, errors)
    # the result is opened from the Jobs tab: its figures are drawn before the app rewrites the
    # address to ?tab=result&r=<token> (where plotly.js used to bake the old address into fills)
    page.goto(f"{base}/?tab=jobs")
    page.fill("#jobs-id input, #jobs-id textarea", str(jobs["diff"]["id"]))
    page.get_by_role("button", name="Open", exact=True).click()
    page.wait_for_function("() => window.location.search.includes('r=')")
    page.wait_for_function("() => { const f = [...document.querySelectorAll('#fl-view figure.fl-fig')];"
                           " return f.length && f.every(x => x.querySelector('.main-svg')); }")
    for name in ("Jobs", "Compare", "Result"):
        page.get_by_role("tab", name=name, exact=True).click()
        page.wait_for_timeout(400)
    page.wait_for_function("() => window.location.search.includes('r=')")
    fills = page.evaluate(FILLS)
    assert fills["n"] >= 2 and fills["bad"] == [], fills
    _no_cloud(page)
    # SVG export: the modebar button downloads a valid SVG
    fig = page.query_selector("#fl-view figure.fl-fig .js-plotly-plot")
    fig.scroll_into_view_if_needed()
    fig.hover()
    with page.expect_download() as dl:
        page.click("#fl-view figure.fl-fig >> nth=0 >> [data-title='Download plot as SVG']")
    path = dl.value.path()
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg") and dl.value.suggested_filename.endswith(".svg")
    # "download figures": every drawn figure of the result as SVG in one zip
    n = page.eval_on_selector_all("#fl-view figure.fl-fig[data-drawn]", "els => els.length")
    with page.expect_download() as dl:
        page.click("#fl-view #fl-download-figs")
    with zipfile.ZipFile(dl.value.path()) as z:
        names = z.namelist()
        assert len(names) == n and all(x.endswith(".svg") for x in names)
        assert ET.fromstring(z.read(names[0])).tag.endswith("svg")
    # the share page: the same figures, the same buttons
    page.goto(f"{base}/r/{jobs['diff']['share_token']}")
    page.wait_for_selector("figure.fl-fig .main-svg")
    _no_cloud(page)
    assert errors == [], errors
    ctx.close()


def _no_cloud(page) -> None:
    titles = page.eval_on_selector_all(".modebar-btn", "bs => bs.map(b => b.getAttribute('data-title') || '')")
    assert titles, "no modebar rendered"
    assert not [t for t in titles if "Share" in t or "Chart Studio" in t or "cloud" in t.lower()], titles
    assert "Download plot as SVG" in titles
    assert page.eval_on_selector_all("a[href*='plotly.com'], a[href*='chart-studio']", "a => a.length") == 0
