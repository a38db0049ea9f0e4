"""The explorer's result tab for every job kind at 1400x900, in headless Chromium, on results a real
worker computed (tests/e2e/every_kind.py: fisher -> mask -> masked bf16-mixed GRPO -> diff of the
base vs that job, tokens, sweep, retention), submitted to `fisherlens up` through the REST API.

Per kind: the key numbers are in the first screen (above 900 px) and before the first figure;
every figure is drawn; no table is wider than its card (each scrolls inside it); no cell shows a
raw dict or markdown; the picker lists the result by what it is. Screenshots:
test-artifacts/e2e/result-<kind>.png; with FISHERLENS_UPDATE_DOCS=1 also docs/screenshots/.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

from tests.browser import ARTIFACTS
from tests.e2e.every_kind import run_chain
from tests.e2e.test_web_e2e import DOCS, browser, server  # noqa: F401 - the fixtures

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RAW = re.compile(r"\{'|\{\"|\[\{|': |\|\s*-{3}")


@pytest.fixture(scope="module")
def jobs(server):  # noqa: F811 - the fixture imported above
    return run_chain(server)


@pytest.mark.parametrize("kind", ["fisher", "mask", "train", "diff", "tokens", "sweep", "retention"])
def test_result_tab_of_every_kind(browser, server, jobs, kind):  # noqa: F811
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    page = ctx.new_page()
    page.set_default_timeout(90_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server}/?tab=result&r={jobs[kind]['share_token']}")
    page.wait_for_selector("#fl-view .fl-result #fl-key")
    n = page.eval_on_selector_all("#fl-view figure.fl-fig", "els => els.length")
    page.wait_for_function(f"() => [...document.querySelectorAll('#fl-view figure.fl-fig')]"
                           f".filter(f => f.querySelector('.main-svg')).length === {n}")
    key = page.query_selector("#fl-key").bounding_box()
    assert key["y"] < 900, f"{kind}: the key numbers start {key['y']:.0f} px down"
    if n:
        assert key["y"] + key["height"] <= page.query_selector("#fl-view figure.fl-fig").bounding_box()["y"]
    # every table scrolls inside its card: no card wider than the view
    widths = page.eval_on_selector_all(
        "#fl-view .fl-table", "els => els.map(e => [e.getBoundingClientRect().right, "
        "e.querySelector('.fl-scroll').clientWidth <= e.clientWidth])")
    view_right = page.query_selector("#fl-view").bounding_box()
    for right, inside in widths:
        assert inside and right <= view_right["x"] + view_right["width"] + 1, kind
    cells = page.eval_on_selector_all("#fl-view td", "els => els.map(e => e.innerText)")
    assert not [c for c in cells if RAW.search(c)], kind
    # the picker names the result by what it is (a mask: its selector and density)
    label = page.input_value("#result-pick input")
    assert label.startswith(f"#{jobs[kind]['id']} "), label
    if kind == "mask":
        assert "fisher selector, 5%" in label
    assert errors == [], errors
    page.wait_for_timeout(500)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"result-{kind}.png"))
    if os.environ.get("FISHERLENS_UPDATE_DOCS") == "1":
        DOCS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ARTIFACTS / f"result-{kind}.png", DOCS / f"result-{kind}.png")
    ctx.close()
