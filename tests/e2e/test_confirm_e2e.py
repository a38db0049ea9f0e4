"""End to end in headless Chromium: a job estimated above CONFIRM_ABOVE_S is not queued by its
first click. `fisherlens up` with CONFIRM_ABOVE_S=1 (every Fisher takes longer than a second):
the Fisher form's first click shows the estimate and the checkbox "I understand this takes
about ..." and queues nothing; ticking it and clicking again queues the job (the API's job list
is the witness)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_web_e2e import _get_json, _open, browser, shot, up_server  # noqa: F401 - fixtures

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def confirm_server(browser, zoo_home: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    with up_server(tmp_path_factory.mktemp("e2e_confirm"), zoo_home, CONFIRM_ABOVE_S="1") as base:
        yield base


def test_a_long_job_needs_the_checkbox_before_the_second_click_queues_it(browser, confirm_server):  # noqa: F811
    ctx, page, _ = _open(browser, confirm_server + "/")
    page.wait_for_selector("#fisher-submit")
    page.wait_for_function("() => { const i = document.querySelector('#fisher-model input');"
                           " return i && i.value === 'arith-base'; }")
    page.fill("#fisher-prompts input", "4")
    page.click("#fisher-submit")
    page.wait_for_selector("#fisher-confirm", state="visible")
    label = page.inner_text("#fisher-confirm")
    assert "I understand this takes about" in label
    assert "above the confirmation threshold of 1 s" in page.inner_text("#fisher-msg")
    assert _get_json(confirm_server + "/api/jobs") == []  # the first click queued nothing
    shot(page, "confirm-long-job", full_page=False)
    page.locator("#fisher-confirm input[type=checkbox]").check()
    page.click("#fisher-submit")
    page.wait_for_function("() => { const b = document.querySelector('#fisher-confirm');"
                           " return !b || b.offsetParent === null; }", timeout=60_000)
    jobs = _get_json(confirm_server + "/api/jobs")
    assert [j["kind"] for j in jobs] == ["fisher"] and jobs[0]["spec"]["prompts"] == 4
    ctx.close()
