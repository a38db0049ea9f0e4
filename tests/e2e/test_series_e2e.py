"""End to end in headless Chromium: a real TRL run folder (GRPOTrainer, save_steps=1, three
checkpoints, tests/trl_runs.py) read as a series from the New job -> "Run series" form of
`fisherlens up` (SQLite, filesystem queue, one real worker), with the initial Fisher of a real
Fisher job picked from the form's dropdown.

Checked: a folder that does not exist is refused under the form naming `run_dir` (nothing is
queued); the real folder is submitted, followed to the end, and the three figures are drawn with
the stored numbers (sparsity over steps, layer x module over steps, the Fisher-predicted sync
curve); the share link, opened in a fresh browser context, draws the same numbers.
Screenshots: test-artifacts/e2e/series-form.png, result-series.png, share-series.png.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser import wait_for_job
from tests.e2e.test_web_e2e import (  # noqa: F401 - fixtures
    _get_json,
    _open,
    _post_json,
    _wait_job,
    browser,
    shot,
    up_server,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(zoo_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The allowed model root holding the TRL run folder `grpo` (checkpoint-1..3)."""
    from tests.trl_runs import grpo_run_folder

    root = tmp_path_factory.mktemp("runs")
    grpo_run_folder(zoo_home / "zoo" / "arith-base", root / "grpo", steps=3)
    return root


@pytest.fixture(scope="module")
def series_server(browser, runs: Path, zoo_home: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    with up_server(tmp_path_factory.mktemp("series_home"), zoo_home, ALLOWED_MODEL_ROOTS=str(runs)) as base:
        yield base


def _traces(page, caption: str) -> list[dict]:
    """The traces plotly.js drew in the result figure whose caption is `caption`."""
    fig = page.locator("figure.fl-fig").filter(has=page.locator("figcaption", has_text=caption))
    plot = fig.locator(".js-plotly-plot")
    plot.wait_for(timeout=60_000)
    return plot.evaluate("el => el.data.map(t => ({name: t.name, type: t.type, x: t.x, y: t.y, z: t.z}))")


def _figures(page) -> dict[str, list[dict]]:
    return {
        "sparsity": _traces(page, "Update sparsity over steps"),
        "layer_module": _traces(page, "by layer x module over steps (step to step)"),
        "sync": _traces(page, "Sparse sync per step"),
    }


def test_series_of_a_trl_run_folder_from_the_form_with_its_share_link(browser, series_server, runs):  # noqa: F811
    server = series_server
    fisher = _post_json(server + "/api/jobs", {"kind": "fisher", "spec": {
        "model": "arith-base", "prompts": 4, "samples": 1, "max_new_tokens": 4}})
    assert _wait_job(server, fisher["id"])["status"] == "succeeded"

    ctx, page, _ = _open(browser, server + "/")
    page.wait_for_selector("#fisher-submit")
    page.get_by_role("tab", name="Run series", exact=True).click()
    page.wait_for_selector("#series-submit", state="visible")
    page.wait_for_function("() => { const i = document.querySelector('#series-base input');"
                           " return i && i.value !== ''; }")
    page.click("#series-base input")
    page.locator("li[data-testid='dropdown-option']", has_text="arith-base").first.click()
    box = "#series-run-dir textarea, #series-run-dir input"
    assert "checkpoint-1" in (page.get_attribute(box, "placeholder") or "")  # an example of what to give
    assert "run folder" in page.inner_text("#series-run-dir")

    # a folder that does not exist: refused under the form, naming the field; nothing queued
    before = len(_get_json(server + "/api/jobs"))
    page.fill(box, str(runs / "no-such-run"))
    page.click("#series-submit")
    msg = page.wait_for_selector("#series-msg .fl-errors").inner_text()
    assert "run_dir" in msg and "does not exist" in msg and "nothing was queued" in msg, msg
    assert len(_get_json(server + "/api/jobs")) == before

    page.fill(box, str(runs / "grpo"))
    page.click("#series-fisher input")
    page.locator("li[data-testid='dropdown-option']", has_text=f"#{fisher['id']} ").first.click()
    page.wait_for_function("() => document.querySelector('#series-fisher input').value.startsWith("
                           f"'#{fisher['id']} ')")
    page.evaluate("() => document.querySelector('#series-msg').innerHTML = ''")
    shot(page, "series-form", full_page=False)
    page.click("#series-submit")

    page.wait_for_selector("#fl-progress .fl-progress[data-job], #series-msg .fl-errors")
    assert not page.locator("#series-msg .fl-errors").count(), page.inner_text("#series-msg")
    job_id = int(page.get_attribute("#fl-progress .fl-progress[data-job]", "data-job"))
    status = wait_for_job(page)
    assert status == "succeeded", page.inner_text("#fl-progress")

    job = _get_json(f"{server}/api/jobs/{job_id}")
    assert job["kind"] == "series" and job["spec"]["base"] == "arith-base"
    assert job["spec"]["run_dir"] == str(runs / "grpo") and job["spec"]["fisher"] == f"job:{fisher['id']}"
    result = _get_json(f"{server}/api/results/{job['share_token']}")
    summary = result["summary"]
    assert summary["steps"] == [1, 2, 3]
    points = summary["points"]

    figs = _figures(page)
    # sparsity over steps: the unchanged fraction (both fp32: exact) vs the base at each checkpoint
    (vs_base,) = [t for t in figs["sparsity"] if t["name"] == "vs base: unchanged (exact)"]
    assert vs_base["x"] == [1, 2, 3]
    assert vs_base["y"] == pytest.approx([p["vs_base_update_sparsity"] for p in points])
    assert all(0.0 <= y < 1.0 for y in vs_base["y"])  # GRPO moved weights at every step
    # layer x module over steps: one column per checkpoint, the stored heatmap's cells
    (hm,) = figs["layer_module"]
    assert hm["type"] == "heatmap" and [str(x) for x in hm["x"]] == ["1", "2", "3"]
    (stored,) = [h for h in result["heatmaps"] if h["name"] == "step_sparsity_layer_module"]
    from app.figures.labels import group_name  # rows outside the blocks are named ("final norm")

    assert hm["z"] == stored["z"] and hm["y"] == [group_name(y) for y in stored["y_labels"]]
    # the Fisher-predicted sync curve: bytes per step, values-only on the Fisher support
    sync = {t["name"]: t for t in figs["sync"]}
    assert sync["values on the Fisher support"]["y"] == pytest.approx([p["support_bytes"] for p in points])
    assert sync["indices + values of changed"]["y"] == pytest.approx([p["sparse_bytes"] for p in points])
    assert sync["support captures: squared update"]["y"] == pytest.approx(
        [p["captured_sq_share"] for p in points])
    page.wait_for_timeout(1000)
    shot(page, "result-series")

    share = page.input_value("#fl-share-url textarea, #fl-share-url input")
    assert share == f"{server}/r/{job['share_token']}"
    ctx.close()

    # anyone with the link: a fresh context sees the same numbers in the same figures
    ctx2, page2, resp = _open(browser, share)
    assert resp.status == 200
    figs2 = _figures(page2)
    for name, traces in figs.items():
        assert [(t["name"], t["x"], t["y"], t["z"]) for t in figs2[name]] == \
            [(t["name"], t["x"], t["y"], t["z"]) for t in traces], name
    assert not page2.is_visible("#tab-new-button")  # read-only
    page2.wait_for_timeout(1000)
    shot(page2, "share-series")
    ctx2.close()


def _first_key_number(page) -> tuple[str, str]:
    page.wait_for_selector("#fl-key dl.fl-nums")
    items = page.eval_on_selector_all(
        "#fl-key dl.fl-nums > div", "els => els.map(e => [e.querySelector('dt').innerText, "
        "e.querySelector('.fl-val').innerText])")
    # the first number after the checkpoint count is the headline
    return next((lab, val) for lab, val in items if "unchanged" in lab.lower())


def test_series_of_a_masked_bf16_mixed_run_leads_in_bf16_in_the_browser_and_share_page(
        browser, series_server):  # noqa: F811
    """Issue 27, done-when: the series of a 5%-masked bf16-mixed GRPO run (its checkpoint folder,
    job:N) against its fp32 base leads with >= 90% unchanged, compared in bfloat16, on the result
    tab and on the share page; exact equality across precisions (~0%) is only the note's
    counter-number."""
    server = series_server
    small = {"steps": 2, "batch": 2, "group": 2, "max_new_tokens": 4, "eval_prompts": 4, "device": "cpu",
             "fisher_prompts": 2, "fisher_samples": 2}
    ids: dict[str, int] = {}
    for kind, spec in (
        ("fisher", {"model": "arith-base", "prompts": 4, "samples": 1, "max_new_tokens": 4}),
        ("mask", {"fisher": "job:{fisher}", "select": "fisher", "density": 0.05}),
        ("train", {"model": "arith-base", "mask": "job:{mask}", "precision": "bf16-mixed", "lr": 1e-2,
                   "save_steps": 1, **small}),
        ("series", {"base": "arith-base", "run_dir": "job:{train}", "fisher": "job:{fisher}"}),
    ):
        spec = {k: v.format(**ids) if isinstance(v, str) else v for k, v in spec.items()}
        job = _post_json(server + "/api/jobs", {"kind": kind, "spec": spec})
        assert _wait_job(server, job["id"])["status"] == "succeeded", (kind, _get_json(
            f"{server}/api/jobs/{job['id']}").get("error"))
        ids[kind] = job["id"]
    job = _get_json(f"{server}/api/jobs/{ids['series']}")
    summary = _get_json(f"{server}/api/results/{job['share_token']}")["summary"]
    assert summary["comparison_dtype"] == "bfloat16" and summary["final_update_sparsity"] >= 0.9
    # the construction rule: the series' Fisher is the one the mask was chosen from (the sha256s
    # recorded in the trained model's mask file and in the reference match)
    c = summary["construction"]
    assert c["trained_in_mask"] and c["same_fisher"] is True, c
    assert c["all_coordinates"] == "holds by construction: the mask was chosen from this Fisher"
    for url in (f"{server}/?tab=result&r={job['share_token']}", f"{server}/r/{job['share_token']}"):
        ctx, page, _ = _open(browser, url)
        label, value = _first_key_number(page)
        assert label == "Weights unchanged at the last checkpoint (vs base), compared in bfloat16", (url, label)
        assert float(value.rstrip("%")) >= 90, (url, value)
        shot(page, "series-bf16-mixed" + ("-share" if "/r/" in url else ""))
        ctx.close()
