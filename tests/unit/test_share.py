"""The share page /r/<token> against a real SQLite database and artifact folder (no worker: job
rows are moved through their states with storage's repository functions).

Covers: figures embedded in the HTML as Plotly JSON with named layers, key numbers before the
figures before the tables, ETag / 304 / Cache-Control, a running job (not cached, refreshes), an
unknown token (404 page), a failed job (one line, no traceback, no server path), figures built
once per job (also under concurrent first viewers) and rebuilt when the drawing code changes,
the local plotly.js, and the key numbers of each job kind on hand-made summaries.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.figures import keynumbers, labels
from app.figures.store import FIGURES_KEY, FigureStore, build_payload
from compute.contract.jobresult import Heatmap, JobResult, LayerStat, SeriesPoint
from compute.contract.settings import Settings

TRACEBACK = ('Traceback (most recent call last):\n  File "/srv/fisherlens/compute/jobs/fisher_run.py", '
             'line 12, in run\nValueError: secret internals')


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("share_home")
    settings = Settings(fisherlens_home=home, database_url=None, redis_url=None,
                        public_url="http://testserver")
    from app.web import create_app

    return settings, TestClient(create_app(settings), follow_redirects=False)


def _fisher_result() -> JobResult:
    # layer 0: up (mass 2 over 4), q (mass 1 over 4); outside the blocks: embeddings (mass 2
    # over 8) and the final norm (mass 0.5 over 4). Total mass 5.5.
    return JobResult(
        kind="fisher",
        summary={"estimator": "sequence", "n_samples": 16, "gini": 0.75, "top1%_share": 0.3,
                 "top10%_share": 0.7, "split_half_jaccard": 0.91, "split_half_topk_percent": 1.0},
        layer_stats=[
            LayerStat("model.layers.0.mlp.up_proj.weight", "up", 0, {"mean": 0.5, "mass": 2.0, "numel": 4}),
            LayerStat("model.layers.0.self_attn.q_proj.weight", "q", 0, {"mean": 0.25, "mass": 1.0, "numel": 4}),
            LayerStat("model.embed_tokens.weight", "embed", None, {"mean": 0.25, "mass": 2.0, "numel": 8}),
            LayerStat("model.norm.weight", "norm", None, {"mean": 0.125, "mass": 0.5, "numel": 4}),
        ],
        heatmaps=[Heatmap("fisher/mean", ["embed", "q", "up", "norm"], ["0", "-"],
                          [[None, 0.25, 0.5, None], [0.25, None, None, 0.125]], {"log": True})],
        series=[SeriesPoint("concentration", 0.01, 0.3), SeriesPoint("concentration", 0.1, 0.7),
                SeriesPoint("concentration", 1.0, 1.0)],
    )


def _job(settings: Settings, status: str, result: JobResult | None = None, message: str = "",
         error: str | None = None, kind: str = "fisher", spec: dict | None = None,
         refs: dict | None = None) -> tuple[int, str]:
    from app import services
    from storage import repo

    with services.sessions(settings)() as s:
        job = repo.create_job(session=s, kind=kind, spec=spec or {"model": "arith-base", "prompts": 8},
                              spec_hash=f"h{status}{id(result)}", refs=refs)
        job_id, token = job.id, job.share_token
        if status == "queued":
            return job_id, token
        repo.claim_job(session=s, job_id=job_id, worker="test", stale_after_s=60)
        if status == "running":
            repo.update_progress(session=s, job_id=job_id, fraction=0.4, message="sampling 3/8")
        elif status == "succeeded":
            assert result is not None
            repo.save_result(session=s, job_id=job_id, result=result)
            repo.mark_succeeded(session=s, job_id=job_id)
        elif status == "failed":
            repo.mark_failed(session=s, job_id=job_id, error=error or message, message=message)
    return job_id, token


def _figures(page: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r"<script type='application/json' id='fl-fig-\d+-data'[^>]*>(.*?)</script>",
                                               page, re.S)]


def test_finished_fisher_page_embeds_named_figures_and_key_numbers_first(env):
    settings, client = env
    job_id, token = _job(settings, "succeeded", _fisher_result())
    r = client.get(f"/r/{token}")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    # order: key numbers, then figures, then tables
    assert page.index("id='fl-key'") < page.index("id='fl-figures'") < page.index("id='fl-tables'")
    assert "Fisher mass in the top 1% of coordinates" in page and "30%" in page
    assert "Split-half top-1% Jaccard" in page and ">0.91<" in page
    assert "fl-verdict fl-good" in page and "<b>Reliability:</b> good:" in page  # one name per verdict
    # the figures are in the HTML itself, drawn by the local plotly.js
    figs = _figures(page)
    assert len(figs) >= 3
    mean = figs[0]["data"][0]
    assert mean["type"] == "heatmap" and "Fisher mean by layer x module" in figs[0]["layout"]["title"]["text"]
    # the row outside the blocks is split into named rows, never "-"; numbers unchanged (log10)
    assert mean["y"] == ["0", "embeddings", "final norm"]
    assert mean["x"] == ["embed", "q", "up", "norm"]
    assert mean["z"][1][0] == pytest.approx(-0.60206, abs=1e-5)  # log10(2 / 8)
    assert mean["z"][2][3] == pytest.approx(-0.90309, abs=1e-5)  # log10(0.5 / 4)
    assert mean["z"][1][3] is None and mean["z"][2][0] is None
    for f in figs:
        for tr in f["data"]:
            for ax in ("x", "y"):
                assert "-" not in (tr.get(ax) or []), (f["layout"]["title"], tr)
    assert "heatmap:" not in page and "fisher_mean" not in page  # no internal panel tags
    assert 'src="/share-static/plotly-' in page and "cdn" not in page.lower()
    assert f"href='/?view={token}'" in page  # the interactive view of the same result
    # built once: stored next to the job's artifacts
    stored = json.loads((settings.artifacts_dir / str(job_id) / "share-figures.json").read_text())
    assert stored["figures_key"] == FIGURES_KEY and [f["figure"] for f in stored["figures"]] == figs


def test_a_model_folder_given_by_path_is_shown_by_label(env, tmp_path: Path):
    """A model named by a server path: the share page, /api/results/<token>, its stats JSON and
    the explorer's result tab show 'my-llama (local folder)', never the path; the owner's job API
    keeps the spec as submitted (Rerun sends it again). A job stored before refs existed (no
    jobs.refs) is labelled from its spec."""
    from app.services import refs as refs_mod
    from app.ui.result import job_by_token, stored_payload, view_html

    settings, client = env
    folder = tmp_path / "srv-models" / "my-llama"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    ref = refs_mod.resolve(settings, "model", str(folder), "model", local=True, hash_models=False)
    assert ref.form == "local" and ref.path == str(folder.resolve())
    res = _fisher_result()
    res.summary["model"] = str(folder)  # as run_fisher records it: the spec's value
    job_id, token = _job(settings, "succeeded", res, spec={"model": str(folder), "prompts": 8},
                         refs={"model": ref.stored()})
    raw = str(tmp_path)
    page = client.get(f"/r/{token}").text
    assert raw not in page and "srv-models" not in page
    assert "my-llama (local folder)" in page  # the meta line and the settings table
    api = client.get(f"/api/results/{token}")
    assert raw not in api.text and api.json()["job"]["spec"]["model"] == "my-llama (local folder)"
    assert api.json()["summary"]["model"] == "my-llama (local folder)"
    assert raw not in client.get(f"/api/results/{token}/stats.json").text
    meta = job_by_token(settings, token)
    assert meta is not None and meta["spec"]["model"] == "my-llama (local folder)"
    tab = view_html(stored_payload(settings, meta), meta)
    assert raw not in tab and "my-llama (local folder)" in tab
    assert client.get(f"/api/jobs/{job_id}").json()["spec"]["model"] == str(folder)  # the owner's API

    _, old = _job(settings, "succeeded", _fisher_result(), spec={"model": "/srv/old/models/llama-7b", "prompts": 8})
    page = client.get(f"/r/{old}").text
    assert "/srv/old" not in page and "llama-7b (local folder)" in page
    # names, hub ids and job references are shown as given
    from app.figures.public import ref_label

    assert ref_label({"form": "zoo", "given": "arith-base", "path": "/h/zoo/arith-base"}) == "arith-base"
    assert ref_label({"form": "zoo", "given": "/h/zoo/arith-base", "path": "/h/zoo/arith-base"}) == "arith-base"
    assert ref_label({"form": "hub", "given": "org/model", "path": "org/model"}) == "org/model"
    assert ref_label({"form": "artifact", "given": "job:3", "path": "3/fisher.safetensors", "job_id": 3}) == "job:3"
    assert ref_label({"form": "local", "given": "/a/b/f.safetensors", "path": "/a/b/f.safetensors",
                      "target": "fisher"}) == "f.safetensors (local file)"


def test_etag_304_and_cache_headers(env):
    settings, client = env
    _, token = _job(settings, "succeeded", _fisher_result())
    r = client.get(f"/r/{token}")
    etag = r.headers["etag"]
    assert etag.startswith('"') and r.headers["cache-control"] == "public, no-cache"
    again = client.get(f"/r/{token}")
    assert again.headers["etag"] == etag and again.content == r.content
    r304 = client.get(f"/r/{token}", headers={"If-None-Match": etag})
    assert r304.status_code == 304 and r304.content == b"" and r304.headers["etag"] == etag
    assert client.get(f"/r/{token}", headers={"If-None-Match": f'W/{etag}, "x"'}).status_code == 304
    assert client.get(f"/r/{token}", headers={"If-None-Match": '"other"'}).status_code == 200
    plain = client.get(f"/r/{token}", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and plain.text == r.text


def test_running_job_page_is_not_cached_and_refreshes(env):
    settings, client = env
    _, token = _job(settings, "running")
    r = client.get(f"/r/{token}")
    assert r.status_code == 200
    assert r.headers["cache-control"] == "no-store" and "etag" not in r.headers
    assert "data-status='running'" in r.text and "(40%)" in r.text and "sampling 3/8" in r.text
    assert 'http-equiv="refresh"' in r.text and "fl-fig-0" not in r.text
    _, queued = _job(settings, "queued")
    assert "data-status='queued'" in client.get(f"/r/{queued}").text


def test_unknown_token_is_a_404_page(env):
    _, client = env
    r = client.get("/r/NoSuchTokenAbCdEfGhIjKlMn")
    assert r.status_code == 404 and "text/html" in r.headers["content-type"]
    assert "Result not found" in r.text and "NoSuchTokenAbCdEfGhIjKlMn" in r.text


def test_failed_job_shows_one_line_without_traceback_or_paths(env):
    settings, client = env
    msg = "FileNotFoundError: [Errno 2] No such file: '/home/alice/runs/mask.safetensors'\nmore"
    _, token = _job(settings, "failed", message=msg, error=TRACEBACK)
    page = client.get(f"/r/{token}").text
    line = re.search(r"<p id='fl-status' data-status='failed'[^>]*>(.*?)</p>", page).group(1)
    assert line.startswith("This job failed: FileNotFoundError: [Errno 2] No such file:")
    assert "&lt;path&gt;" in line
    for leak in ("/home/alice", "Traceback", "/srv/fisherlens", "secret internals", "more"):
        assert leak not in page
    # a message that is itself a traceback: only its last line
    _, token2 = _job(settings, "failed", message=TRACEBACK)
    page2 = client.get(f"/r/{token2}").text
    assert "ValueError: secret internals" in page2 and "Traceback" not in page2 and "/srv/" not in page2


def test_concurrent_first_viewers_build_once(tmp_path: Path):
    store = FigureStore(tmp_path)
    res = {**_fisher_result().to_dict(), "job": {"id": 7, "finished_at": "2026-01-01T00:00:00+00:00"}}
    calls = []
    start = threading.Barrier(8)
    out: list[dict] = []

    def load() -> dict:
        calls.append(1)
        return res

    def viewer() -> None:
        start.wait()
        out.append(store.get(7, "2026-01-01T00:00:00+00:00", load))

    threads = [threading.Thread(target=viewer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(out) == 8 and all(o == out[0] for o in out)
    # later views (a new process: a new store) read the file; no build
    assert FigureStore(tmp_path).get(7, "2026-01-01T00:00:00+00:00", lambda: pytest.fail("rebuilt")) == out[0]
    # a payload drawn by other code (or for another finish time) is rebuilt
    stale = {**out[0], "figures_key": "older-code"}
    store.write(7, stale)
    assert FigureStore(tmp_path).read(7, "2026-01-01T00:00:00+00:00") is None
    assert FigureStore(tmp_path).read(7, "2027-01-01T00:00:00+00:00") is None
    again = FigureStore(tmp_path).get(7, "2026-01-01T00:00:00+00:00", load)
    assert len(calls) == 2 and again["figures_key"] == FIGURES_KEY


def test_ui_result_tab_uses_the_stored_figures(env):
    """The UI reads the same file: after a view, its figures are the stored ones."""
    settings, client = env
    job_id, token = _job(settings, "succeeded", _fisher_result())
    page = client.get(f"/r/{token}").text
    from app.figures.store import store_for

    payload = store_for(settings).read(job_id, client.get(f"/api/jobs/{job_id}").json()["finished_at"])
    assert payload is not None and [f["figure"] for f in payload["figures"]] == _figures(page)


def test_local_plotly_js_is_served_gzipped():
    from app.share import PLOTLY_JS, PLOTLY_URL

    settings = Settings(database_url="sqlite://", redis_url=None)
    from fastapi import FastAPI

    from app.share import make_share_router

    app = FastAPI()
    app.include_router(make_share_router(settings))
    client = TestClient(app)
    r = client.get(PLOTLY_URL)
    assert r.status_code == 200 and r.headers["content-encoding"] == "gzip"
    assert r.content == PLOTLY_JS.read_bytes()  # TestClient decodes gzip
    assert "immutable" in r.headers["cache-control"]


# ---------------------------------------------------------------- pure parts


def test_split_row_keeps_every_number_and_names_rows():
    fig = {"data": [{"type": "heatmap", "x": ["embed", "q", "norm", "lm_head"], "y": ["0", "1", "-"],
                     "z": [[None, 1, None, None], [None, 2, None, None], [3, None, 4, 5]],
                     "customdata": [["", "a", "", ""], ["", "b", "", ""], ["c", "", "d", "e"]]}]}
    tr = labels.name_layers(fig)["data"][0]
    assert tr["y"] == ["0", "1", "embeddings", "final norm", "lm_head"]
    assert tr["z"][2:] == [[3, None, None, None], [None, None, 4, None], [None, None, None, 5]]
    assert tr["customdata"][2:] == [["c", "", "", ""], ["", "", "d", ""], ["", "", "", "e"]]
    # a row that aggregates everything outside the blocks (x = thresholds) is named for that
    prof = labels.name_layers({"data": [{"type": "heatmap", "x": ["exact", "bf16"], "y": ["0", "-"],
                                         "z": [[0.1, 0.2], [0.3, 0.4]]}]})["data"][0]
    assert prof["y"] == ["0", labels.OUTSIDE] and prof["z"] == [[0.1, 0.2], [0.3, 0.4]]
    # bars: a module outside the blocks gets its name; a block module's empty "-" bar goes
    bars = labels.name_layers({"data": [
        {"type": "bar", "name": "embed", "x": ["0", "-"], "y": [0.0, 0.5]},
        {"type": "bar", "name": "q", "x": ["0", "-"], "y": [0.5, 0.0]}]})["data"]
    assert bars[0]["x"] == ["0", "embeddings"] and bars[0]["y"] == [0.0, 0.5]
    assert bars[1]["x"] == ["0"] and bars[1]["y"] == [0.5]
    rows = labels.name_layer_cells(["scope", "layer", "module"], [["layer -", None, "lm_head"], ["x", 3, "q"]])
    assert rows == [[f"layer: {labels.OUTSIDE}", "lm_head", "lm_head"], ["x", 3, "q"]]


@pytest.mark.parametrize("jac,level", [(0.85, "good"), (0.8, "good"), (0.6, "fair"), (0.2, "poor"),
                                       (None, "none")])
def test_jaccard_verdict(jac, level):
    assert keynumbers.jaccard_verdict(jac, 1.0)["level"] == level


def test_random_topk_jaccard_matches_brute_force():
    import random

    n, k = 2000, 100  # 5%: expected |A & B| = k^2 / n, |A | B| = 2k - k^2 / n
    rng = random.Random(0)
    vals = []
    for _ in range(400):
        a, b = set(rng.sample(range(n), k)), set(rng.sample(range(n), k))
        vals.append(len(a & b) / len(a | b))
    assert sum(vals) / len(vals) == pytest.approx(keynumbers.random_topk_jaccard(k / n), rel=0.1)


def test_key_numbers_train_diff_retention():
    train = keynumbers.key_numbers({"kind": "train", "summary": {
        "accuracy_before": 0.2, "accuracy_after": 0.39, "eval": {"prompts": 500},
        "trainable_fraction": 0.05, "update_sparsity": {"unchanged_exact": 0.006}},
        "series": [{"name": "train/reward", "step": 2, "value": 0.4}, {"name": "train/reward", "step": 1, "value": 0.25},
                   {"name": "train/reward", "step": 100, "value": 0.5}]})
    items = {i["label"]: i for i in train["items"]}
    # issue 27: one binomial SE next to each accuracy: sqrt(0.2 x 0.8 / 500) = 1.8 points,
    # sqrt(0.39 x 0.61 / 500) = 2.2; the change's SE at most sqrt(1.8^2 + 2.2^2) = 2.8
    assert items["Held-out accuracy before -> after"]["value"] == "20% ± 1.8 -> 39% ± 2.2 (+19 points)"
    assert items["Held-out accuracy before -> after"]["note"] == (
        "greedy, 500 held-out prompts; ± one binomial SE in points; the change's SE is at most 2.8 points (unpaired)")
    assert items["Sample reward, first -> last step"]["value"] == "0.25 -> 0.5"
    assert items["Stored weights exactly unchanged"]["value"] == "0.6%" and not train["warnings"]

    diff = keynumbers.key_numbers({"kind": "diff", "summary": {
        "unchanged_exact": 0.5, "unchanged_bf16": 0.75, "unchanged_atol_1e-08": 0.6,
        "unchanged_rel_0.001": 0.9, "auc": 0.28, "changed_auc": 0.55,
        "overlap_settings": {"topk_percent": 1.0}}})
    got = [(i["label"], i["value"]) for i in diff["items"]]
    assert got == [("Weights exactly unchanged", "50%"), ("Fisher AUC for the top-1% |delta| coordinates", "0.28"),
                   ("Fisher AUC for changed-at-all coordinates", "0.55")]
    assert diff["table"]["headers"] == ["threshold", "unchanged"]
    assert diff["table"]["rows"] == [["exactly equal", "50%"], ["equal after casting both to bf16", "75%"],
                                     ["|delta| <= 1e-08", "60%"], ["|delta| <= 0.001 x rms(base tensor)", "90%"]]
    # the bf16-checkpoint convention sits next to the float32 row of the same atol
    both = keynumbers.key_numbers({"kind": "diff", "summary": {
        "unchanged_atol_1e-08": 0.6, "unchanged_bf16delta_atol_1e-08": 0.7, "unchanged_below_half_ulp": 0.25}})
    assert both["table"]["rows"] == [["|delta| <= 1e-08", "60%", "70%"],
                                     ["|delta| < half a bf16 ULP of |base weight|", "25%", ""]]
    nofisher = keynumbers.key_numbers({"kind": "diff", "summary": {"unchanged_exact": 0.5}})
    assert nofisher["items"][-1]["value"] == "not computed"

    rows = [{"selector": "fisher", "density": 0.01, "reward_mean": 0.389, "reward_std": 0.003,
             "retention_mean": 0.98, "retention_std": 0.1, "retention_of_means": 0.98}]
    ok = keynumbers.key_numbers({"kind": "retention", "summary": {
        "base_reward": 0.2, "full_reward_mean": 0.393, "full_reward_std": 0.018, "full_rewards": [0.4] * 3,
        "rows": rows}})
    assert not ok["warnings"] and ok["table"]["rows"] == [["fisher", "0.01", "0.389 +- 0.003", "0.98 +- 0.1", "0.98"]]
    bad = keynumbers.key_numbers({"kind": "retention", "summary": {
        "base_reward": 0.3, "full_reward_mean": 0.28, "full_reward_std": 0.01, "rows": rows}})
    assert len(bad["warnings"]) == 1 and "did not beat the base" in bad["warnings"][0]
    noisy = keynumbers.key_numbers({"kind": "retention", "summary": {
        "base_reward": 0.3, "full_reward_mean": 0.31, "full_reward_std": 0.05, "rows": rows}})
    assert "within one seed spread" in noisy["warnings"][0]


def test_payload_leaves_out_operator_fields():
    res = {**_fisher_result().to_dict(), "job": {"id": 1, "error": TRACEBACK, "worker": "host-1:pid",
                                                   "share_token": "t", "finished_at": None}}
    payload = build_payload(res)
    text = json.dumps(payload)
    assert "Traceback" not in text and "host-1" not in text and payload["job"]["share_token"] == "t"


def test_link_turned_off_is_a_404_even_after_a_cached_view(env):
    """Finished pages are cached per process, but every view re-reads the job's row: a link its
    owner turned off (jobs.shared) answers 404 at once, also to a revalidation."""
    from app import services
    from storage.models import Job

    settings, client = env
    job_id, token = _job(settings, "succeeded", _fisher_result())
    etag = client.get(f"/r/{token}").headers["etag"]
    with services.sessions(settings)() as s:
        s.get(Job, job_id).shared = False
        s.commit()
    assert client.get(f"/r/{token}").status_code == 404
    assert client.get(f"/r/{token}", headers={"If-None-Match": etag}).status_code == 404


def test_key_numbers_sweep_and_fisher_read_declared_fields():
    sweep = keynumbers.key_numbers({"kind": "sweep", "summary": {"points": [
        {"lr": 1e-5, "optimizer": "adamw", "precision": "bf16-mixed", "unchanged_bf16": 0.98,
         "fisher_auc_changed": 0.61, "reward_after": 0.3}]}})
    assert sweep["items"] == [{"label": "Points (lr x optimizer x precision)", "value": "1", "note": ""}]
    # stored before issue 27 (no unchanged_common): the bf16 count, and the table says it is bf16
    assert sweep["table"]["rows"] == [["bf16-mixed", "adamw", "1e-05", "98%", "bfloat16", "0.61", "30%"]]
    # a batch-estimator Fisher stores split_half_jaccard = None: the verdict says why there is none
    none = keynumbers.key_numbers({"kind": "fisher", "summary": {"split_half_jaccard": None, "top1%_share": 0.25}})
    assert none["verdict"]["level"] == "none" and none["items"][0]["value"] == "25%"
    assert keynumbers.key_numbers({"kind": "x", "summary": {}})["items"] == []
